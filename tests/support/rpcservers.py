"""llama.cpp RPC servers for tests: `arbiterd rpc-server` (ggml's own server, serving this
machine's CPU) run as real processes on 127.0.0.1, each on a free port."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from arbiterd.cli import rpcserver
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


def start_server(folder: Path, port: int | None = None) -> RpcServer:
    """`arbiterd rpc-server` serving the CPU on 127.0.0.1 (a free port unless given), once it
    answers a probe."""
    port = free_port() if port is None else port
    endpoint = f"127.0.0.1:{port}"
    log = folder / f"rpc-server-{port}.log"
    return RpcServer(endpoint, rpcserver.start_local(endpoint, log, START_TIMEOUT_S), log)


@contextmanager
def rpc_servers(folder: Path, count: int) -> Iterator[list[RpcServer]]:
    servers = [start_server(folder) for _ in range(count)]
    try:
        yield servers
    finally:
        for server in servers:
            server.kill()
