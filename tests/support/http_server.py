"""arbiterd.daemon.http.server serving a trivial app, in this process (`hello`) or as a script in a
process of its own, under an fd limit of the test's choosing:

    python tests/support/http_server.py OPEN_FILES MAX_CONNECTIONS HEADER_TIMEOUT_S

The script prints its port, serves until SIGTERM, and logs to stderr.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
import sys

from starlette.types import Receive, Scope, Send

from arbiterd.daemon.http.server import HttpServer


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    """200 "hello" at /, 404 elsewhere: enough to tell routing happened."""
    assert scope["type"] == "http"
    status = 200 if scope["path"] == "/" else 404
    headers = [(b"content-length", b"5")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"hello"})


async def main(open_files: int, max_connections: int, header_timeout_s: float) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    server = HttpServer(
        hello,
        [listener],
        allow_uids=frozenset(),
        api_key="",
        max_connections=max_connections,
        header_timeout_s=header_timeout_s,
        http_host="127.0.0.1",
    )
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: setattr(server, "should_exit", True)
    )
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
    print(listener.getsockname()[1], flush=True)
    with listener:
        await server.serve()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
