"""arbiterd.daemon.http.server in a thread of the test's process, serving a trivial app (or the
test's) with the peers the test chooses."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from starlette.types import ASGIApp

from arbiterd.daemon.http.peers import Peer, peer_of
from arbiterd.daemon.http.server import HttpServer
from tests.support.http_server import hello
from tests.support.waiting import wait_until

DEADLINE_S = 10.0


@dataclass
class Served:
    server: HttpServer
    port: int  # of the loopback listener, when the test did not bring its own
    peers: list[Peer] = field(default_factory=list)  # given to each connection, in order

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def serving(
    *,
    app: ASGIApp = hello,
    peer: Peer | None = None,
    listeners: list[socket.socket] | None = None,
    allow_uids: frozenset[int] = frozenset(),
    api_key: str = "",
    max_connections: int = 100,
    header_timeout_s: float = DEADLINE_S,
    allow_origins: frozenset[str] = frozenset(),
) -> Iterator[Served]:
    """An HttpServer of `app` on a loopback port (or `listeners`), configured as a daemon
    listening on 127.0.0.1; every connection's peer is `peer`, or the real one when None."""
    owned = listeners is None
    sockets = [socket.create_server(("127.0.0.1", 0))] if listeners is None else listeners
    seen: list[Peer] = []

    def identify(sock: socket.socket) -> Peer:
        seen.append(peer_of(sock) if peer is None else peer)
        return seen[-1]

    server = HttpServer(
        app,
        sockets,
        allow_uids=allow_uids,
        api_key=api_key,
        max_connections=max_connections,
        header_timeout_s=header_timeout_s,
        http_host="127.0.0.1",
        allow_origins=allow_origins,
        identify=identify,
    )
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), name="test-http")
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), DEADLINE_S, "the server")
        assert server.started, "the server stopped before it started"
        yield Served(server, sockets[0].getsockname()[1] if owned else 0, seen)
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        assert not thread.is_alive(), "the server did not stop"
        if owned:
            for sock in sockets:
                sock.close()
