"""The HTTP server under the API: owns the daemon's listening sockets (the TCP port and the Unix
socket `api.sock`, both bound before any model loads) and the connections on them: who may use
each, how many may be open, how long a client may take to send a request head, and the process's
file-descriptor limit they live under.

uvicorn speaks HTTP/1.1 (its h11 protocol, one instance per connection); the accept loop is ours,
because asyncio's (behind uvicorn's `create_server`) can neither wait for a free slot nor stay
quiet when accept(2) fails: out of file descriptors (Python 3.11) it goes on trying up to the
backlog's length (2,048) in one pass, logging a traceback and scheduling a retry for each try
(129,140 lines in 40 s in issue 10).

- Who: each connection's peer is identified once, when it is accepted (peers.py). The
  owner and the users in `[daemon] allow_users` get the API; anyone else (another user, or a
  peer that cannot be identified) gets a 403 on every request without the API key
  (arbiterd.daemon.http.app.refuse_stranger), before routing. A web page in the owner's browser
  is the owner's peer: arbiterd.daemon.http.browsers refuses what a page sends, per listener.
- How many: at most `max_connections` open at once, chosen below the fd limit and shared out
  evenly, each listener its own cap; beyond it the listener's accept loop waits and new
  clients wait in the kernel's listen backlog, nothing fails.
- How long: a request head must be complete `header_timeout_s` after the connection opens or
  after its first byte; an idle connection between requests is closed after KEEP_ALIVE_S. A
  head is at most MAX_HEAD_BYTES, however it arrives (uvicorn answers 400 past it).

Must never log once per connection or per failed accept: a flood must not become a flood of log.
Must not wake while nothing is served (issue 29): uvicorn's main loop ticks every 0.1 s, to look
at `should_exit` and to refresh the Date header; here `should_exit` wakes the loop itself and the
Date is made per response (`_DatedState`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import resource
import socket
import threading
import time
from collections.abc import Callable, Generator, Sequence
from email.utils import formatdate
from pathlib import Path
from types import TracebackType
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from arbiterd.daemon import socketfile
from arbiterd.daemon.http.app import refuse_stranger
from arbiterd.daemon.http.browsers import accepted_hosts, guard
from arbiterd.daemon.http.peers import Peer, peer_of
from arbiterd.errors import ListenError
from arbiterd.paths import ensure_private_dir

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 5  # uvicorn's default, named here because it is part of the bound
MAX_HEAD_BYTES = 16 * 1024  # h11's default, which h11 applies only to a head still incomplete
# Where a request head ends, as h11 finds it (h11/_receivebuffer.py).
_HEAD_END = re.compile(rb"\n\r?\n")
SHUTDOWN_TIMEOUT_S = 30  # for requests in flight when the daemon stops
# Kept free for the rest of the daemon: workers' sockets, model copies, the journal, the
# control socket and its clients.
FD_RESERVE = 256
MAX_CONNECTIONS = 4096
ACCEPT_RETRY_S = 0.25
BACKLOG = 2048  # uvicorn's own default, for the TCP port and the Unix socket alike
UNIX_SOCKET_MODE = 0o600


def raise_fd_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit, and return the soft limit now in force.

    systemd starts services with 1024 soft (and 524288 hard) only for the sake of programs that
    still call select(2), which arbiterd's code never does; 1024 is few for a server."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # an unlimited hard limit is above fs.nr_open
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP API's listening socket, bound before anything else starts."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {where}: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn does: a restart may bind while the old daemon's connections linger.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(
                f"{where} is already in use (another arbiterd or server?); pick a free port "
                "with http = HOST:PORT in the config's [daemon] table or --http HOST:PORT"
            ) from None
        raise ListenError(f"cannot listen on {where}: {exc.strerror}") from None
    return sock


def connection_limit(fd_limit: int) -> int:
    """How many HTTP connections may be open at once under the soft fd limit `fd_limit`:
    FD_RESERVE descriptors stay for the rest of the daemon (never fewer than half of them),
    and at most MAX_CONNECTIONS."""
    return min(MAX_CONNECTIONS, max(fd_limit - FD_RESERVE, fd_limit // 2))


class UnixListener:
    """The API's Unix socket: mode 0600 in a folder only the user can enter, so the file mode
    already keeps other users out; the server still checks each peer (SO_PEERCRED), for when
    the owner opens the file up. The file is removed on close unless another daemon has bound
    the path since."""

    def __init__(self, path: Path, sock: socket.socket, inode: tuple[int, int]) -> None:
        self.path = path
        self.sock = sock
        self._inode = inode

    @classmethod
    def bind(cls, path: Path) -> UnixListener:
        """Listen on `path`. Replaces a stale socket file there (the daemon calls this while it
        holds its single-instance lock); ListenError if a live server answers on it."""
        ensure_private_dir(path.parent, ListenError)
        live = f"another server is listening on {path}; stop it or set [daemon] api_socket"
        socketfile.clear_stale(path, ListenError, live)
        sock, inode = socketfile.bind(path, UNIX_SOCKET_MODE, ListenError, live)
        try:
            sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            socketfile.unlink_own(path, inode)
            raise ListenError(f"cannot listen on {path}: {exc.strerror or exc}") from None
        return cls(path, sock, inode)

    def close(self) -> None:
        self.sock.close()
        socketfile.unlink_own(self.path, self._inode)

    def __enter__(self) -> UnixListener:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class _AcceptFailures:
    """accept(2) failures, logged once per burst: the first, then one line when accepting works
    again, with how many there were and for how long."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._count = 0
        self._since = 0.0

    def failed(self, exc: OSError) -> None:
        if self._count == 0:
            self._since = time.monotonic()
            log.warning(
                "HTTP accept on %s failed: %s; retrying every %s s (not logged again until it "
                "works)",
                self._where,
                exc,
                ACCEPT_RETRY_S,
            )
        self._count += 1

    def ended(self) -> None:
        if self._count:
            log.warning(
                "HTTP accept on %s works again, after %d failed attempts in %.1f s",
                self._where,
                self._count,
                time.monotonic() - self._since,
            )
            self._count = 0


class _BoundedHeads(h11.Connection):
    """h11's server side, with MAX_HEAD_BYTES on every request head. h11 counts only the bytes of
    a head still incomplete: one that arrives whole in a single read (asyncio reads up to 256
    KiB) is parsed at any size; a 64 KiB head was served (issue 24)."""

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        if self.their_state is h11.IDLE:  # the next bytes are a request head
            buffered = self.trailing_data[0]
            if len(buffered) > MAX_HEAD_BYTES:
                end = _HEAD_END.search(buffered, 0, MAX_HEAD_BYTES)
                if end is None:
                    raise h11.RemoteProtocolError(
                        f"request head over {MAX_HEAD_BYTES} bytes", error_status_hint=431
                    )
        return super().next_event()


class _DatedState(ServerState):
    """uvicorn's server state, whose default headers carry the Date as each response starts
    (uvicorn's tick, which HttpServer does not run, refreshes it every second)."""

    def __init__(self) -> None:
        self._headers: list[tuple[bytes, bytes]] = []
        super().__init__()

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        # RFC 9110 section 6.6.1: an origin server with a clock sends Date in every response.
        return [(b"date", formatdate(usegmt=True).encode()), *self._headers]

    @default_headers.setter
    def default_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        self._headers = headers


class _Connection(H11Protocol):
    """One HTTP connection: uvicorn's h11 protocol serving the app chosen for its peer, with a
    deadline on each request head. uvicorn bounds only the idle time between requests, and stops
    that clock at the first byte: a head that starts and never ends would hold the connection,
    and its file descriptor, for good."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        *,
        app: ASGIApp,
        header_timeout_s: float,
        on_lost: Callable[[], None],
    ) -> None:
        super().__init__(config, server_state, app_state)
        self.conn = _BoundedHeads(h11.SERVER, MAX_HEAD_BYTES)
        self.app = app
        self._header_timeout_s = header_timeout_s
        self._on_lost = on_lost
        self._head_deadline: asyncio.TimerHandle | None = None
        self.made = False  # once connection_made has run, the transport owns the socket

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.made = True
        super().connection_made(transport)
        self._head_deadline = self.loop.call_later(self._header_timeout_s, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()  # a pipelined request may have begun

    def _should_upgrade(self) -> bool:
        # The API has no WebSocket route, and uvicorn would hand an upgraded connection to its
        # WebSocket protocol, which serves config.loaded_app: past this connection's app, so
        # past refuse_stranger and the browser checks (a web page may open a WebSocket to any
        # host, and no CORS applies). Served as the plain HTTP request it also is, unlogged.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_deadline()
        super().connection_lost(exc)
        self._on_lost()

    def _watch_head(self) -> None:
        """Keep the deadline running while part of a request head has come (h11 holds it,
        waiting for more), stop it once a head is complete."""
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            if self._head_deadline is None:
                self._head_deadline = self.loop.call_later(
                    self._header_timeout_s, self._head_timed_out
                )
        else:
            self._stop_head_deadline()

    def _stop_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        self.transport.close()


class HttpServer(uvicorn.Server):
    """Serves `app` on `listeners` (bound by the daemon, which closes them) until `should_exit`.
    Signals are left to the daemon."""

    def __init__(
        self,
        app: ASGIApp,
        listeners: Sequence[socket.socket],
        *,
        allow_uids: frozenset[int],
        api_key: str,
        max_connections: int,
        header_timeout_s: float,
        http_host: str,
        allow_origins: frozenset[str] = frozenset(),
        identify: Callable[[socket.socket], Peer] = peer_of,
    ) -> None:
        """`max_connections` is shared out among the listeners; `http_host` is the host the
        TCP listeners were configured with, the name their requests' Host may give
        (arbiterd.daemon.http.browsers, as `allow_origins`)."""
        # Before uvicorn's __init__, which sets should_exit. The lock orders should_exit, which
        # any thread may set, with main_loop's start and end.
        self._exit_lock = threading.Lock()
        self._exit_asked = False
        self._exit = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # while main_loop waits
        super().__init__(
            uvicorn.Config(
                app,
                lifespan="off",
                log_level="warning",
                # Nothing stands in front of the daemon: a client must not be able to
                # rewrite the address that logs show with X-Forwarded-For.
                proxy_headers=False,
                timeout_keep_alive=KEEP_ALIVE_S,
                h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                ws="none",  # no WebSocket routes: see _Connection._should_upgrade
                timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S,
            )
        )
        self.server_state = _DatedState()
        self._listeners = list(listeners)
        self._owner = os.getuid()
        self._allowed = allow_uids | {self._owner}
        self._api_key = api_key
        self._header_timeout_s = header_timeout_s
        self._identify = identify
        self._hosts = accepted_hosts(http_host)
        self._origins = allow_origins
        # Each listener its own share of the connections: a flood of connections to the TCP
        # port, which any local user can open, must not hold up api.sock, which only the owner
        # can (issue 24).
        share = max(1, max_connections // max(1, len(self._listeners)))
        self._slots = [asyncio.Semaphore(share) for _ in self._listeners]  # one per connection
        self._accepting: list[asyncio.Task[None]] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    @property
    def should_exit(self) -> bool:
        return self._exit_asked

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Asked from any thread (a test's server runs in a thread of its own): wakes
        main_loop's wait through call_soon_threadsafe, as an asyncio.Event is not thread-safe."""
        with self._exit_lock:  # held: the loop cannot leave main_loop and close meanwhile
            self._exit_asked = value
            if value and self._loop is not None:
                self._loop.call_soon_threadsafe(self._exit.set)

    async def main_loop(self) -> None:
        """Wait for should_exit, without uvicorn's tick every 0.1 s (its on_tick refreshes the
        Date header, which _DatedState makes per response, and looks at should_exit)."""
        with self._exit_lock:
            self._loop = asyncio.get_running_loop()
            asked = self._exit_asked
        try:
            if not asked:
                await self._exit.wait()
        finally:
            with self._exit_lock:
                self._loop = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # With an empty list uvicorn binds nothing of its own and only marks itself started.
        await super().startup(sockets=[])
        self.server_state.default_headers = list(self.config.encoded_headers)  # server: uvicorn
        loop = asyncio.get_running_loop()
        for listener, slots in zip(self._listeners, self._slots, strict=True):
            listener.setblocking(False)
            # Host means nothing on a Unix socket: no browser can open one.
            hosts = None if listener.family == socket.AF_UNIX else self._hosts
            app = guard(self.config.loaded_app, hosts=hosts, origins=self._origins)
            self._accepting.append(
                loop.create_task(
                    self._accept(listener, slots, app), name=f"http-accept-{listener.fileno()}"
                )
            )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for task in self._accepting:
            task.cancel()
        await asyncio.gather(*self._accepting, return_exceptions=True)
        await super().shutdown(sockets=None)

    async def _accept(
        self, listener: socket.socket, slots: asyncio.Semaphore, app: ASGIApp
    ) -> None:
        loop = asyncio.get_running_loop()
        failures = _AcceptFailures(_where(listener))
        while True:
            await slots.acquire()  # given back when the connection is lost
            try:
                conn, _ = await loop.sock_accept(listener)
            except BaseException as exc:
                slots.release()
                if not isinstance(exc, OSError):
                    raise  # cancelled: the server is stopping
                # ECONNABORTED: the client left before its turn; nothing is wrong here.
                if not isinstance(exc, ConnectionAbortedError):
                    failures.failed(exc)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            failures.ended()
            await self._connect(loop, conn, slots, app)

    async def _connect(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        slots: asyncio.Semaphore,
        app: ASGIApp,
    ) -> None:
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio turns Nagle's algorithm off only for a socket whose proto is IPPROTO_TCP,
            # and one accept(2) gives from a listener made with proto 0 is not. With it on, a
            # response's body waited for the client's delayed ACK of its head (Linux: 40 ms at
            # least) on every request after a connection's first (issue 40).
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _Connection(
            self.config,
            self.server_state,
            self.lifespan.state,
            # Once per connection: every request on it is served alike.
            app=self._app_for(self._identify(conn), app),
            header_timeout_s=self._header_timeout_s,
            on_lost=slots.release,
        )
        try:
            await loop.connect_accepted_socket(lambda: connection, conn)
        except BaseException:
            if not connection.made:  # the socket and the slot are still ours
                conn.close()
                slots.release()
            raise

    def _app_for(self, peer: Peer, app: ASGIApp) -> ASGIApp:
        """`app` (its listener's) for a connection from `peer`."""
        if peer.uid is not None and peer.uid in self._allowed:
            return app
        who = (
            f"this connection is from uid {peer.uid}"
            if peer.uid is not None
            else f"it cannot tell who opened this connection ({peer.unknown_because})"
        )
        # uids only: naming users would ask NSS (perhaps LDAP) from the event loop.
        reason = (
            f"this arbiterd serves its owner (uid {self._owner}) only, and {who}; the owner can "
            "add you to [daemon] allow_users, or give you the API key "
            "(sent as 'Authorization: Bearer <key>')"
        )
        return refuse_stranger(app, api_key=self._api_key, reason=reason)


def _where(listener: socket.socket) -> str:
    name = listener.getsockname()
    if listener.family == socket.AF_UNIX:
        return str(name)
    host = f"[{name[0]}]" if listener.family == socket.AF_INET6 else name[0]
    return f"{host}:{name[1]}"
