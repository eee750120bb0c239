"""llama.cpp RPC servers for tests: `arbiterd rpc-server` (ggml's own server, serving this
machine's CPU, or its front of several clients) run as real processes on 127.0.0.1, each on a
free port; and a fake one, in
this process, that lies to a probe as another local user's program could (issue 40)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from arbiterd.native import rpc
from arbiterd.rpcserver import server as rpcserver
from tests.support.daemon import free_port

START_TIMEOUT_S = 60.0  # the engine loads in the server before it listens


@dataclass
class RpcServer:
    endpoint: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def device(self) -> str:
        return f"rpc:{self.endpoint}"

    def anon_bytes(self) -> int:
        """The server process's resident anonymous memory now (RssAnon): what it holds for its
        clients, whose buffers are anonymous memory. Its resident file pages are the engine's
        code, which the first computations fault in and which stay: not a client's memory."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no RssAnon for the server {self.process.pid}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


def start_server(folder: Path, port: int | None = None, clients: int = 1) -> RpcServer:
    """`arbiterd rpc-server` serving the CPU on 127.0.0.1 (a free port unless given), `clients`
    at once, once it answers a probe."""
    port = free_port() if port is None else port
    endpoint = f"127.0.0.1:{port}"
    log = folder / f"rpc-server-{port}.log"
    started = rpcserver.start_local(endpoint, log, START_TIMEOUT_S, clients)
    return RpcServer(endpoint, started, log)


def serving_processes(front: RpcServer) -> list[int]:
    """The server processes of a front (`--clients N`) that serve a client now: connected to
    one (a socket besides their listening one); the spares are not."""
    pids = []
    for task in Path(f"/proc/{front.process.pid}/task").iterdir():
        started: list[str] = []
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since
            started = (task / "children").read_text().split()
        for pid in started:
            with contextlib.suppress(FileNotFoundError):  # ended since
                fds = list(Path(f"/proc/{pid}/fd").iterdir())
                if sum(os.readlink(fd).startswith("socket:") for fd in fds) > 1:
                    pids.append(int(pid))
    return pids


@contextmanager
def rpc_servers(folder: Path, count: int) -> Iterator[list[RpcServer]]:
    servers = [start_server(folder) for _ in range(count)]
    try:
        yield servers
    finally:
        for server in servers:
            server.kill()


class FakeRpcServer:
    """A server on 127.0.0.1 that speaks the part of ggml's RPC wire protocol a probe uses
    (native/rpc.py: a command byte, a 64-bit size, the payload; a 64-bit size and the reply),
    and lies: it claims `devices` devices and answers for each one asked, for ever; it sends
    each reply `byte_delay_s` apart a byte at a time when that is set. Each connection is
    served on a thread of its own until `close`, which ends them all."""

    MEMORY_BYTES = 1 << 30  # each device's free and total memory, as it says

    def __init__(self, devices: int, byte_delay_s: float = 0.0) -> None:
        self.devices = devices
        self.byte_delay_s = byte_delay_s
        self.memory_asked = 0  # GET_DEVICE_MEMORY requests answered, over all connections
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, name="fake-rpc-accept")]
        self._threads[0].start()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(OSError):  # closed by the probe already
                    conn.shutdown(socket.SHUT_RDWR)  # wakes a recv() of its thread
        for thread in list(self._threads):
            thread.join(timeout=10)
        for conn in self._connections:
            conn.close()

    def __enter__(self) -> FakeRpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._connections.append(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), name="fake-rpc")
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                head = _read_exactly(conn, 9)
                if head is None:
                    return
                command, size = head[0], struct.unpack("<Q", head[1:])[0]
                if _read_exactly(conn, size) is None:
                    return
                self._send(conn, self._reply(command))

    def _reply(self, command: int) -> bytes:
        if command == rpc._CMD_HELLO:
            return struct.pack("<BBBx24s", rpc.PROTOCOL_MAJOR, rpc.PROTOCOL_MINOR, 0, bytes(24))
        if command == rpc._CMD_DEVICE_COUNT:
            return struct.pack("<I", self.devices)
        if command == rpc._CMD_GET_DEVICE_MEMORY:
            with self._lock:
                self.memory_asked += 1
            return struct.pack("<QQ", self.MEMORY_BYTES, self.MEMORY_BYTES)
        raise AssertionError(f"a probe sent command {command}")

    def _send(self, conn: socket.socket, reply: bytes) -> None:
        message = struct.pack("<Q", len(reply)) + reply
        if not self.byte_delay_s:
            conn.sendall(message)
            return
        for byte in message:
            if self._stop.wait(self.byte_delay_s):
                return
            conn.sendall(bytes([byte]))


def _read_exactly(conn: socket.socket, size: int) -> bytes | None:
    """`size` bytes from `conn`, or None when it closes first."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data
