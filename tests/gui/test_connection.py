"""The tray's connection over QLocalSocket, against a fake control server on a real socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pytestqt.qtbot import QtBot

from arbiterd.control import CONTROL_PROTOCOL
from arbiterd.events import Event, HoldEvent, parse_event
from arbiterd.gui.connection import CODE_UNREACHABLE, DaemonConnection
from tests.gui.fakes import FakeControlServer, model, status

WAIT_MS = 5000


def make_connection(path: Path, **options: Any) -> DaemonConnection:
    options.setdefault("status_interval_ms", 50)
    options.setdefault("reconnect_first_s", 0.05)
    options.setdefault("reconnect_max_s", 0.4)
    return DaemonConnection(path, **options)


@pytest.fixture
def connection(server: FakeControlServer) -> Iterator[DaemonConnection]:
    conn = make_connection(server.path)
    yield conn
    conn.stop()


def test_it_says_hello_subscribes_and_polls_status(
    qtbot: QtBot, server: FakeControlServer, connection: DaemonConnection
) -> None:
    with qtbot.waitSignal(connection.connected, timeout=WAIT_MS) as hello:
        connection.start()
    assert hello.args is not None
    assert hello.args[0]["protocol"] == CONTROL_PROTOCOL
    with qtbot.waitSignal(connection.status_received, timeout=WAIT_MS) as reply:
        pass
    assert reply.args is not None
    assert reply.args[0]["holder"]["name"] == "alpha"
    qtbot.waitUntil(lambda: server.subscribers == 1, timeout=WAIT_MS)
    requests = server.requests_seen()
    assert requests[0] == {"command": "hello", "protocol": CONTROL_PROTOCOL, "request_id": 1}
    assert requests[1]["command"] == "subscribe"
    # Polling: more statuses follow, one request at a time, each with its own id.
    qtbot.waitUntil(
        lambda: sum(r["command"] == "status" for r in server.requests_seen()) >= 3,
        timeout=WAIT_MS,
    )
    ids = [r["request_id"] for r in server.requests_seen()]
    assert len(ids) == len(set(ids))


def test_events_arrive_in_order(
    qtbot: QtBot, server: FakeControlServer, connection: DaemonConnection
) -> None:
    received: list[Event] = []
    connection.event_received.connect(received.append)
    connection.start()
    qtbot.waitUntil(lambda: server.subscribers == 1, timeout=WAIT_MS)
    for n in range(5):
        server.push_event({"event": "hold", "at": float(n), "held": n % 2 == 0})
    qtbot.waitUntil(lambda: len(received) == 5, timeout=WAIT_MS)
    assert received == [HoldEvent(at=float(n), held=n % 2 == 0) for n in range(5)]


def hold(at: float) -> dict[str, Any]:
    return {"event": "hold", "at": at, "held": True}


def test_the_history_comes_once_every_page_is_in(
    qtbot: QtBot, server: FakeControlServer, connection: DaemonConnection
) -> None:
    server.journal(*(hold(float(n)) for n in range(6)))
    server.page_size = 2
    connection.start()
    qtbot.waitUntil(lambda: connection.is_connected, timeout=WAIT_MS)
    with qtbot.waitSignal(connection.history_received, timeout=WAIT_MS) as history:
        connection.request_history(1.0)
    assert history.args == [[parse_event(hold(float(n))) for n in range(1, 6)]]
    asked = [r for r in server.requests_seen() if r["command"] == "events"]
    assert [(r.get("since"), r.get("after_seq")) for r in asked] == [
        (1.0, None),
        (None, 3),
        (None, 5),
    ]


def test_a_daemon_that_refuses_history_gives_an_empty_one(
    qtbot: QtBot, server: FakeControlServer, connection: DaemonConnection
) -> None:
    server.refuse["events"] = ("unknown command 'events'", "unknown_command")
    connection.start()
    qtbot.waitUntil(lambda: connection.is_connected, timeout=WAIT_MS)
    with qtbot.waitSignal(connection.history_received, timeout=WAIT_MS) as history:
        connection.request_history(0.0)
    assert history.args == [[]]
    assert connection.is_connected  # and it goes on with what comes live


def test_commands_go_on_their_own_connection_with_request_ids(
    qtbot: QtBot, server: FakeControlServer, connection: DaemonConnection
) -> None:
    connection.start()
    qtbot.waitUntil(lambda: connection.is_connected, timeout=WAIT_MS)
    with qtbot.waitSignal(connection.command_finished, timeout=WAIT_MS) as done:
        request_id = connection.send_command("warm", "beta")
    assert done.args == [request_id, "warm", {"model": "beta", "state": "warm"}]
    assert server.commands_seen() == [("warm", "beta")]
    warm = next(r for r in server.requests_seen() if r["command"] == "warm")
    assert warm == {"command": "warm", "model": "beta", "request_id": request_id}


def test_an_error_reply_is_surfaced(
    qtbot: QtBot, server: FakeControlServer, connection: DaemonConnection
) -> None:
    server.refuse["pin"] = ("no model named 'gamma'", "UnknownModelError")
    with qtbot.waitSignal(connection.command_failed, timeout=WAIT_MS) as failed:
        request_id = connection.send_command("pin", "gamma")
    assert failed.args == [request_id, "pin", "no model named 'gamma'", "UnknownModelError"]


def test_a_command_without_a_daemon_fails_as_unreachable(qtbot: QtBot, short_dir: Path) -> None:
    connection = make_connection(short_dir / "nobody.sock")
    try:
        with qtbot.waitSignal(connection.command_failed, timeout=WAIT_MS) as failed:
            connection.send_command("hold")
    finally:
        connection.stop()
    assert failed.args is not None
    assert failed.args[1] == "hold"
    assert "not running" in failed.args[2]
    assert failed.args[3] == CODE_UNREACHABLE


def test_no_daemon_means_disconnected_and_retries_with_a_doubling_backoff(
    qtbot: QtBot, short_dir: Path
) -> None:
    connection = make_connection(short_dir / "nobody.sock", reconnect_first_s=0.02)
    reasons: list[str] = []
    connection.disconnected.connect(reasons.append)
    try:
        connection.start()
        qtbot.waitUntil(lambda: len(reasons) >= 4, timeout=WAIT_MS)
        assert connection.next_retry_s == pytest.approx(0.32)
        qtbot.waitUntil(lambda: len(reasons) >= 7, timeout=WAIT_MS)
        assert connection.next_retry_s == pytest.approx(0.4)  # the ceiling
    finally:
        connection.stop()
    assert all("not running" in reason for reason in reasons)


def test_it_reconnects_after_the_daemon_restarts(
    qtbot: QtBot, server: FakeControlServer, connection: DaemonConnection
) -> None:
    connection.start()
    qtbot.waitUntil(lambda: server.subscribers == 1, timeout=WAIT_MS)
    with qtbot.waitSignal(connection.disconnected, timeout=WAIT_MS):
        server.stop()
    assert not connection.is_connected
    server.status = status(model("alpha", "cold"), model("beta", "warm"), holder="beta")
    with qtbot.waitSignal(connection.connected, timeout=WAIT_MS):
        server.start()
    with qtbot.waitSignal(connection.status_received, timeout=WAIT_MS) as reply:
        pass
    assert reply.args is not None
    assert reply.args[0]["holder"]["name"] == "beta"
    qtbot.waitUntil(lambda: server.subscribers == 1, timeout=WAIT_MS)  # subscribed again
    received: list[Event] = []
    connection.event_received.connect(received.append)
    server.push_event(hold(1.0))
    qtbot.waitUntil(lambda: received == [HoldEvent(at=1.0, held=True)])


def test_an_overflow_starts_over_at_once(
    qtbot: QtBot, server: FakeControlServer, connection: DaemonConnection
) -> None:
    connection.start()
    qtbot.waitUntil(lambda: server.subscribers == 1, timeout=WAIT_MS)
    with qtbot.waitSignal(connection.disconnected, timeout=WAIT_MS) as lost:
        server.push_event({"event": "overflow", "at": 1.0})
    assert lost.args is not None
    assert "too slowly" in lost.args[0]
    with qtbot.waitSignal(connection.connected, timeout=WAIT_MS):
        pass
