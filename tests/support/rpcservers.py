"""llama.cpp RPC servers for tests: `arbiterd rpc-server` (ggml's own server, serving this
machine's CPU) run as real processes on 127.0.0.1, each on a free port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from arbiterd.errors import DeviceUnreachableError
from arbiterd.native import rpc
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
    # The server serves the CPU: its process need not start the Vulkan driver.
    env = {**os.environ, "GGML_VK_VISIBLE_DEVICES": ""}
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "arbiterd", "rpc-server", "--listen", endpoint],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = RpcServer(endpoint, process, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            rpc.probe(endpoint, timeout_s=1.0)
            return server
        except DeviceUnreachableError:
            if process.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise AssertionError(
                    f"the RPC server on {endpoint} did not start: {log.read_text()[-2000:]}"
                ) from None
            time.sleep(0.1)


@contextmanager
def rpc_servers(folder: Path, count: int) -> Iterator[list[RpcServer]]:
    servers = [start_server(folder) for _ in range(count)]
    try:
        yield servers
    finally:
        for server in servers:
            server.kill()
