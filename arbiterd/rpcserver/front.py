"""`arbiterd rpc-server --clients N`: several clients served at once (issue 44), where ggml's own
RPC server serves one at a time.

Owns the front: the process that listens on `--listen`, gives each connection a ggml server
process of its own on the same devices (`arbiterd rpc-server --clients 1` on a loopback port),
and passes the bytes between the two with splice(2) until either side closes. The protocol is
not read: every byte goes through as it came. Why processes: two clients of one ggml server
would share its one `rpc_server`, and ggml serves one connection at a time.

When its client leaves, a server process frees everything the client held, as ggml's server
does for any client that disconnects (docs/devices.md: 90-98 % of a model's share measured),
and goes back to the idle ones, for the next connection: ggml's client opens a connection for
each of its short questions (the device count, its memory) besides the one a model holds. Each
new process takes about half a second to load the engine, so SPARES idle ones are kept (each
holds what a backend holds before any client: on a GPU, its context); more than that are
stopped. A connection beyond `clients` waits, accepted, for one to end, as a connection to
ggml's server waits in its queue.

When the process lends its devices (`--lend`, arbiterd/lease/lender.py), the lender decides
whose connections the front serves: only its borrower's address, while a lease is open, nobody
otherwise (a connection it does not admit is closed at once); it asks how many are served now,
ends them all when a borrower does not give the devices back in time, and stops the idle server
processes before its own programs get the devices. The front counts the bytes it passes each
way, which the lender reports to its borrower.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from arbiterd.errors import DeviceUnreachableError, ListenError
from arbiterd.native import rpc

log = logging.getLogger(__name__)

# Set in a server process's environment to the front's pid: the process ends with the front
# (rpcserver.py, PR_SET_PDEATHSIG), even a front killed with SIGKILL.
FRONT_ENV = "ARBITERD_RPC_FRONT"
SPARES = 2  # idle ones kept: a restore probes the server, then connects (two connections)
READY_TIMEOUT_S = 60.0  # a server process loads the engine and its backends before it listens
SPLICE_BYTES = 1 << 20  # at most moved per splice(2) call (the pipe takes 64 KiB at a time)
STOP_TIMEOUT_S = 5.0


class _Server:
    """One ggml server process, listening on a loopback port for its one client."""

    def __init__(self, argv: Sequence[str]) -> None:
        with socket.socket() as chooser:  # a free port, taken back at once for the child
            chooser.bind(("127.0.0.1", 0))
            self.port = chooser.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        # Its lines (ggml's, per connection) would interleave with every other one's: kept
        # apart, read only to say why it did not start.
        self._output = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(
            [*argv, "--listen", self.endpoint, "--clients", "1"],
            stdin=subprocess.DEVNULL,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            env={**os.environ, FRONT_ENV: str(os.getpid())},  # it ends when the front does
        )

    def wait_ready(self) -> None:
        """Return once it listens; DeviceUnreachableError when it exits or takes too long."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                rpc.check_listening(self.endpoint, timeout_s=1.0)
                return
            except DeviceUnreachableError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self._output.seek(0)
                    said = self._output.read().decode(errors="replace")[-2000:]
                    self.stop()
                    raise DeviceUnreachableError(
                        f"a server process for a client (pid {self.process.pid}) did not listen "
                        f"on {self.endpoint} (exit status {self.process.returncode}): {said}"
                    ) from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # its handler ends it at once (rpcserver._exit_now)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._output.close()


class Front:
    """Accepts clients on `listen` ("HOST:PORT") and serves each with a process of `argv`
    (the `arbiterd rpc-server` command line without --listen and --clients), `clients` at
    once at most. A lending front (`lending`) admits nobody until `admit` names an address."""

    def __init__(
        self, listen: str, argv: Sequence[str], clients: int, *, lending: bool = False
    ) -> None:
        self._listen = listen
        self._argv = list(argv)
        self._slots = threading.BoundedSemaphore(clients)
        self._spares: list[_Server] = []
        self._lock = threading.Lock()  # the spares, the live connections, the admission, counts
        self._live: dict[_Server, socket.socket] = {}  # serving a client now, and that client
        self._lending = lending
        self._admitted: str | None = None  # the one client address served while lending
        self._listener: socket.socket | None = None  # while it serves
        self._stopped = threading.Event()
        self._received_bytes = 0  # from clients to their servers, since the front started
        self._sent_bytes = 0  # from the servers back to their clients

    def admit(self, address: str | None) -> None:
        """Serve the connections from `address` (an IPv4 address) from now on; None: nobody.
        Only a lending front admits by address; connections already served stay."""
        with self._lock:
            self._admitted = address

    def serving(self) -> int:
        """How many clients are connected to a server process now."""
        with self._lock:
            return len(self._live)

    def close_all(self) -> None:
        """End every connection served now, and stop its server process: whatever the clients
        held is freed, even by a client that does not go."""
        with self._lock:
            live = list(self._live.items())
        for server, client in live:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            server.stop()

    def drop_spares(self) -> None:
        """Stop the idle server processes (on a GPU, each holds a context of its own): the
        lender's own programs get the whole device. The next connection starts them again."""
        with self._lock:
            idle, self._spares = self._spares, []
        for server in idle:
            server.stop()

    def counted(self) -> tuple[int, int]:
        """The bytes passed so far: (from clients, to clients)."""
        with self._lock:
            return self._received_bytes, self._sent_bytes

    def _admits(self, address: str) -> bool:
        with self._lock:
            return not self._lending or address == self._admitted

    def _count(self, *, received: int = 0, sent: int = 0) -> None:
        with self._lock:
            self._received_bytes += received
            self._sent_bytes += sent

    def serve_forever(self) -> None:
        """Listen and serve until `stop` (or an exception: ListenError when the port is
        taken). The server processes are stopped on the way out. They are started from this
        thread alone: a process's PR_SET_PDEATHSIG fires when the thread that started it
        ends, and this one lasts as long as the front."""
        host, port = rpc.split_endpoint(self._listen)
        try:
            listener = socket.create_server((host, port), backlog=64)
        except OSError as exc:
            raise ListenError(f"cannot listen on {self._listen}: {exc.strerror or exc}") from None
        self._listener = listener
        try:
            if not self._lending:  # a lender starts them for its first connection
                self._start_spares()
            with listener:
                while True:
                    try:
                        conn, (address, *_) = listener.accept()
                    except OSError:
                        if self._stopped.is_set():
                            return
                        raise
                    if not self._admits(address):
                        log.info("rpc-server: a connection from %s is not lent to: closed", address)
                        conn.close()
                        continue
                    server = self._claim(conn)
                    if server is None:
                        conn.close()
                        return
                    threading.Thread(
                        target=self._serve, args=(conn, server), name="rpc-client", daemon=True
                    ).start()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop listening (serve_forever returns) and stop every server process."""
        self._stopped.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        with self._lock:
            servers, self._spares = [*self._spares, *self._live], []
        for server in servers:
            server.stop()

    def _start_spares(self) -> None:
        with self._lock:  # as stop() takes them: none starts once it has
            while len(self._spares) < SPARES and not self._stopped.is_set():
                self._spares.append(_Server(self._argv))

    def _claim(self, client: socket.socket) -> _Server | None:
        """A server process for `client`, the connection just accepted: the oldest idle one,
        more starting meanwhile while fewer than SPARES are idle; None once stopped."""
        with self._lock:
            if self._stopped.is_set():
                return None
            server = self._spares.pop(0) if self._spares else _Server(self._argv)
            self._live[server] = client
        self._start_spares()
        return server

    def _serve(self, client: socket.socket, server: _Server) -> None:
        served = False
        with client, self._slots:
            try:
                server.wait_ready()
                with socket.create_connection(("127.0.0.1", server.port)) as upstream:
                    _relay(client, upstream, self._count)
                served = True
            except (DeviceUnreachableError, OSError) as exc:
                log.warning("rpc-server: a client could not be served: %s", exc)
            finally:
                self._done(server, served)

    def _done(self, server: _Server, served: bool) -> None:
        """After its client: back to the idle ones (it has freed what the client held), unless
        it failed, died, or enough are idle already."""
        with self._lock:
            self._live.pop(server, None)
            keep = served and server.process.poll() is None and len(self._spares) < SPARES
            if keep:
                self._spares.append(server)
        if not keep:
            server.stop()


def _relay(client: socket.socket, server: socket.socket, count: Callable[..., None]) -> None:
    """Pass bytes both ways until both directions ended (one side closing ends both: a
    ggml client or server never half-closes), each direction's bytes given to `count`."""
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(
        target=_pipe,
        args=(server, client, lambda n: count(sent=n)),
        name="rpc-relay",
        daemon=True,
    )
    back.start()
    _pipe(client, server, lambda n: count(received=n))
    back.join()


def _pipe(source: socket.socket, sink: socket.socket, count: Callable[[int], None]) -> None:
    """Move what `source` sends to `sink` through a kernel pipe (splice(2): no copy into
    Python), until `source` ends; then end both sockets, which ends the other direction."""
    read_end, write_end = os.pipe()
    try:
        while True:
            moved = os.splice(source.fileno(), write_end, SPLICE_BYTES)
            if moved == 0:
                break
            count(moved)
            while moved:
                moved -= os.splice(read_end, sink.fileno(), moved)
    except OSError:
        pass  # the other direction shut the sockets, or a peer reset: the connection is over
    finally:
        os.close(read_end)
        os.close(write_end)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def server_argv(args: Sequence[str]) -> list[str]:
    """The command line of a server process: this interpreter running `arbiterd rpc-server`
    with `args` (the devices, threads and cache the front was given)."""
    return [sys.executable, "-m", "arbiterd", "rpc-server", *args]
