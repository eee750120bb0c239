"""Who is at the other end of an accepted connection: real sockets, and a real second user."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiterd.daemon.http.peers import Peer, peer_of
from tests.support.users import NOBODY, as_user, needs_root, unix

TIMEOUT_S = 10.0


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.settimeout(TIMEOUT_S)
        yield sock


def peer_of_client(listener: socket.socket, client: socket.socket) -> Peer:
    with client, listener.accept()[0] as accepted:
        return peer_of(accepted)


def test_a_loopback_client_is_its_own_user(listener: socket.socket) -> None:
    client = socket.create_connection(listener.getsockname(), timeout=TIMEOUT_S)
    assert peer_of_client(listener, client) == Peer(os.getuid())


def test_an_ipv6_loopback_client_is_its_own_user() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        server = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no ::1 here: {exc}")
    with server:
        server.settimeout(TIMEOUT_S)
        client = socket.create_connection(server.getsockname()[:2], timeout=TIMEOUT_S)
        assert peer_of_client(server, client) == Peer(os.getuid())


def test_an_ipv4_client_of_a_dual_stack_listener_is_its_own_user() -> None:
    if not socket.has_dualstack_ipv6():
        pytest.skip("no dual-stack sockets")
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as server:
        server.settimeout(TIMEOUT_S)
        client = socket.create_connection(("127.0.0.1", server.getsockname()[1]), TIMEOUT_S)
        assert peer_of_client(server, client) == Peer(os.getuid())


def test_a_unix_peer_is_known_by_its_credentials() -> None:
    left, right = socket.socketpair()
    with left, right:
        assert peer_of(left) == Peer(os.getuid())


def test_a_client_on_another_address_is_unknown() -> None:
    address = _non_loopback_address()
    with socket.create_server((address, 0)) as server:
        server.settimeout(TIMEOUT_S)
        client = socket.create_connection(server.getsockname(), timeout=TIMEOUT_S)
        peer = peer_of_client(server, client)
    assert peer.uid is None
    assert "not a loopback address" in peer.unknown_because


def test_a_client_that_has_gone_is_unknown(listener: socket.socket) -> None:
    client = socket.create_connection(listener.getsockname(), timeout=TIMEOUT_S)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
    client.close()  # with linger 0: a reset, and the client's socket is gone
    with listener.accept()[0] as accepted:
        assert peer_of(accepted).uid is None


@needs_root
def test_another_users_loopback_client_is_that_user(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    found: list[Peer] = []

    def look_up() -> None:
        with listener.accept()[0] as accepted:
            found.append(peer_of(accepted))
            accepted.sendall(b"done")

    def connect_and_wait() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as client:
            return client.recv(16)  # open until the lookup is over

    thread = threading.Thread(target=look_up, name="test-peer-lookup")
    thread.start()
    try:
        assert as_user(NOBODY, connect_and_wait) == b"done"
    finally:
        thread.join(TIMEOUT_S)
    assert found == [Peer(NOBODY)]


@needs_root
def test_another_users_unix_client_is_that_user() -> None:
    # Not under tmp_path, whose parents are 0700: NOBODY may enter this one, and the socket
    # below is 0666.
    with tempfile.TemporaryDirectory(dir="/tmp") as folder, socket.socket(socket.AF_UNIX) as server:
        Path(folder).chmod(0o755)
        path = Path(folder) / "peer.sock"
        server.bind(str(path))
        path.chmod(0o666)
        server.listen()
        server.settimeout(TIMEOUT_S)
        # The kernel records the credentials at connect(2): they outlive the client.
        as_user(NOBODY, lambda: unix(path)().close())
        with server.accept()[0] as accepted:
            assert peer_of(accepted) == Peer(NOBODY)


def _non_loopback_address() -> str:
    """An address of this host that is not loopback, or skip."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed, never sent (UDP connect)
        except OSError:
            pytest.skip("no route off this host")
        address: str = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("no address but loopback")
    return address
