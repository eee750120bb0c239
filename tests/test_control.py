"""The control socket against a Service double: a real ControlServer on a real Unix socket,
answering `events` from a real journal.

The server runs on an asyncio loop in a background thread; the tests talk to it with the
blocking ControlClient or with raw lines, as any other client would.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

import arbiterd
from arbiterd import control
from arbiterd.cli.controlclient import ControlClient
from arbiterd.control import (
    COMMANDS,
    CONTROL_COMMANDS,
    CONTROL_PROTOCOL,
    EVENTS_PAGE_MAX,
    MAX_LINE_BYTES,
    MODEL_COMMANDS,
)
from arbiterd.daemon.control import server as controlserver
from arbiterd.daemon.control.server import ControlServer, StoredEvent, peer_uid
from arbiterd.daemon.observe.journal import Journal
from arbiterd.daemon.service import ServedModel
from arbiterd.errors import (
    ControlError,
    ControlReplyError,
    DaemonError,
    DaemonNotRunningError,
    UnknownModelError,
)
from arbiterd.procs import WaitNews
from arbiterd.request import GenerateRequest
from arbiterd.states import ResidencyState
from arbiterd.status import DaemonStatus, ModelStatus
from arbiterd.wire import LineReader
from tests.support.waiting import wait_until

T = TypeVar("T")
WAIT_S = 10.0
DOC = Path(__file__).parents[1] / "docs" / "control-protocol.md"
# A status as the control socket writes it (arbiterd/status.py's record, every field).
STATUS = DaemonStatus(
    models=(ModelStatus(name="alpha", state=ResidencyState.WARM, pid=4242),),
    arena="/run/user/0/arbiterd/arena/gpu0",
).to_json()
AT = 1_718_000_000.5  # a time events happened at


def no_history(*, since: float | None, after_seq: int | None, limit: int) -> list[StoredEvent]:
    """The history of a daemon whose journal is empty."""
    return []


class FakeService:
    """The Service methods the control socket uses: records commands, returns a canned status,
    and lets the test publish events to every subscriber (on the loop, via LoopThread)."""

    def __init__(self) -> None:
        self.models = ["alpha", "beta"]
        self.commands: list[tuple[str, str | None]] = []
        self.subscribers: list[asyncio.Queue[dict[str, Any]]] = []
        self.failure: BaseException | None = None
        self.on_command: Callable[[], Awaitable[None]] | None = None
        self.queue_max = 0  # the subscribers' queues are unbounded unless a test bounds them

    def model_names(self) -> list[str]:
        return list(self.models)

    def model(self, asked: str) -> ServedModel | None:
        if asked not in self.models:
            return None
        return ServedModel(asked, embedding=False, strict_api=False, images=None)

    async def complete(self, model: str, request: GenerateRequest) -> dict[str, Any]:
        raise NotImplementedError

    def stream(self, model: str, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError

    async def status(self) -> DaemonStatus:
        return DaemonStatus.from_json(STATUS)

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue(self.queue_max)
        self.subscribers.append(events)
        return events

    def unsubscribe(self, events: asyncio.Queue[dict[str, Any]]) -> None:
        self.subscribers.remove(events)  # ValueError on a second unsubscribe: a bug to catch

    async def command(
        self,
        name: str,
        model: str | None = None,
        on_news: Callable[[WaitNews], None] | None = None,
        *,
        pid: int | None = None,
    ) -> dict[str, Any]:
        self.commands.append((name, model))
        if self.on_command is not None:
            await self.on_command()
        if self.failure is not None:
            raise self.failure
        if model is not None and model not in self.models:
            raise UnknownModelError(f"no model named {model!r} (models: alpha, beta)")
        return {"command": name, "model": model}

    async def metrics_text(self) -> bytes:
        return b""

    def publish(self, *events: dict[str, Any]) -> None:
        for queue in self.subscribers:
            for event in events:
                if not queue.full():  # as the supervisor does: a full subscriber misses events
                    queue.put_nowait(event)

    def backlog(self) -> int:
        return sum(queue.qsize() for queue in self.subscribers)


class LoopThread:
    """An asyncio loop on its own named thread, driven from the test's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="control-test-loop")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    def call(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self.run(call())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


@dataclass
class Served:
    service: FakeService
    server: ControlServer
    path: Path
    loop: LoopThread
    journal: Journal  # what `events` answers from

    def publish(self, *events: dict[str, Any]) -> None:
        self.loop.call(lambda: self.service.publish(*events))

    def subscribers(self) -> int:
        return len(self.service.subscribers)


class Raw:
    """A client that writes raw lines and reads every line the server sends."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(str(path))
        self._reader = LineReader(self.sock)

    def send_line(self, line: bytes) -> None:
        self.sock.sendall(line + b"\n")

    def send(self, **message: Any) -> None:
        self.send_line(json.dumps(message).encode())

    def read(self) -> dict[str, Any]:
        message = self._reader.read()
        assert message is not None, "the server closed the connection"
        return message

    def request(self, **message: Any) -> dict[str, Any]:
        self.send(**message)
        return self.read()

    def at_eof(self) -> bool:
        return self._reader.read() is None


class Connections:
    """Opens raw and client connections and closes every one when the test ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._raws: list[Raw] = []
        self._clients: list[ControlClient] = []

    def raw(self) -> Raw:
        raw = Raw(self.path)
        self._raws.append(raw)
        return raw

    def client(self) -> ControlClient:
        client = ControlClient.connect(self.path, timeout_s=WAIT_S)
        self._clients.append(client)
        return client

    def close(self) -> None:
        for raw in self._raws:
            raw.sock.close()
        for client in self._clients:
            client.close()


@pytest.fixture(autouse=True)
def no_asyncio_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """asyncio reports a leaked task or a failed callback only as a log record: fail on it."""
    yield
    records = [caplog.get_records(when) for when in ("setup", "call", "teardown")]
    errors = [r for rs in records for r in rs if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # tmp_path can exceed sun_path's 108 bytes; a short directory under /tmp cannot.
    path = Path(tempfile.mkdtemp(prefix="ad", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture
def served(loop: LoopThread, sock_dir: Path, tmp_path: Path) -> Iterator[Served]:
    service = FakeService()
    path = sock_dir / "arbiterd" / "control.sock"
    journal = Journal(tmp_path / "journal.sqlite3", daemon=str(path))
    server = ControlServer(service, path, history=journal.own_events)  # as the daemon wires it
    loop.run(server.start())
    yield Served(service, server, path, loop, journal)
    loop.run(server.close())
    journal.close()
    assert not path.exists()
    assert service.subscribers == []


@pytest.fixture
def conns(served: Served) -> Iterator[Connections]:
    connections = Connections(served.path)
    yield connections
    connections.close()


# hello and the protocol version


def test_client_says_hello_and_learns_the_protocol_and_commands(conns: Connections) -> None:
    client = conns.client()
    assert client.server == {
        "protocol": CONTROL_PROTOCOL,
        "server": "arbiterd",
        "version": arbiterd.__version__,
        "commands": sorted(
            COMMANDS | {"hello", "status", "devices", "subscribe", "unsubscribe", "events"}
        ),
    }


def test_hello_without_a_version_is_answered(conns: Connections) -> None:
    reply = conns.raw().request(command="hello", request_id="h")
    assert reply["error"] == "success"
    assert reply["request_id"] == "h"
    assert reply["data"]["protocol"] == 1


def test_hello_with_another_protocol_version_is_refused_and_closed(
    served: Served, conns: Connections
) -> None:
    raw = conns.raw()
    reply = raw.request(command="hello", protocol=2, request_id=1)
    assert reply["request_id"] == 1
    assert reply["code"] == "protocol"
    assert "protocol 2 is not supported" in reply["error"]
    assert raw.at_eof()


# status and commands


def test_status_is_the_services_status(conns: Connections) -> None:
    assert conns.client().call("status") == STATUS


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_reaches_the_service(name: str, served: Served, conns: Connections) -> None:
    model = "beta" if name in MODEL_COMMANDS else None
    args: dict[str, object] = {"model": model} if model else {}
    if name == "yield":
        args = {"pid": 4242}
    assert conns.client().call(name, **args) == {"command": name, "model": model}
    assert served.service.commands == [(name, model)]


def test_unknown_model_is_an_error_reply_with_its_stable_code_raised_as_its_class(
    served: Served, conns: Connections
) -> None:
    raw = conns.raw()
    reply = raw.request(command="warm", model="gamma", request_id=9)
    assert reply == {
        "request_id": 9,
        "error": "no model named 'gamma' (models: alpha, beta)",
        "code": "unknown_model",
    }
    client = conns.client()
    with pytest.raises(UnknownModelError, match="no model named 'gamma'") as caught:
        client.call("pin", model="gamma")
    assert caught.value.exit_code == 65  # the CLI's status for it, as errors.OUTCOMES says
    assert client.call("status") == STATUS  # still usable


def test_a_command_that_cannot_be_done_now_is_a_control_error(
    served: Served, conns: Connections
) -> None:
    served.service.failure = ControlError("the GPU is already held")
    reply = conns.raw().request(command="hold", request_id="x")
    assert (reply["error"], reply["code"]) == ("the GPU is already held", "control")


def test_an_unexpected_failure_is_internal_logged_and_survived(
    served: Served, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    served.service.failure = RuntimeError("worker table corrupted")
    raw = conns.raw()
    with caplog.at_level(logging.ERROR, logger="arbiterd.control"):
        reply = raw.request(command="reload", request_id=3)
    assert reply == {"request_id": 3, "error": "worker table corrupted", "code": "internal"}
    assert any(r.exc_info and "reload failed" in r.getMessage() for r in caplog.records)
    served.service.failure = None
    assert raw.request(command="status", request_id=4)["data"] == STATUS


def test_a_command_that_closes_the_server_does_not_hang_it(
    served: Served, conns: Connections
) -> None:
    served.service.on_command = served.server.close  # what a careless `shutdown` would do
    raw = conns.raw()
    raw.send(command="shutdown", request_id=1)
    assert raw.at_eof()  # the reply is lost with the connection, but the close completes
    wait_until(lambda: not served.path.exists(), WAIT_S, "the socket file to be removed")


# the guard ladder


@pytest.mark.parametrize(
    "case",
    [
        (b"\xff\xfe", None, "invalid_request", "not UTF-8"),
        (b"status", None, "invalid_request", "not JSON"),
        (b"[1, 2]", None, "invalid_request", "not a JSON object"),
        # Past the recursion limit of the parser (issue 24: the connection was dropped).
        (b'{"a": ' * 100_000, None, "invalid_request", "nested too deeply"),
        (b'"status"', None, "invalid_request", "not a JSON object"),
        (b'{"command": "status", "request_id": [1]}', None, "invalid_request", "scalar"),
        (b'{"request_id": 7}', 7, "invalid_request", "command must be a string"),
        (b'{"command": 5, "request_id": 7}', 7, "invalid_request", "command must be a string"),
        (b'{"command": "fly", "request_id": 7}', 7, "unknown_command", "'fly'"),
        (b'{"command": "warm", "request_id": 7}', 7, "invalid_args", "missing argument 'model'"),
        (b'{"command": "warm", "model": 3, "request_id": 7}', 7, "invalid_args", "a string"),
        (b'{"command": "warm", "model": "", "request_id": 7}', 7, "invalid_args", "empty"),
        (
            b'{"command": "warm", "model": "a", "progress": 1, "request_id": 7}',
            7,
            "invalid_args",
            "argument 'progress' must be true or false, not 1",
        ),
        (b'{"command": "hold", "progress": true, "request_id": 7}', 7, "invalid_args", "'prog"),
        (b'{"command": "hello", "protocol": "1", "request_id": 7}', 7, "invalid_args", "integ"),
        (b'{"command": "hello", "protocol": true, "request_id": 7}', 7, "invalid_args", "integ"),
        (b'{"command": "status", "modle": "a", "request_id": 7}', 7, "invalid_args", "'modle'"),
    ],
)
def test_a_bad_line_is_answered_and_the_connection_stays_usable(
    case: tuple[bytes, object, str, str], served: Served, conns: Connections
) -> None:
    line, request_id, code, message = case
    raw = conns.raw()
    raw.send_line(line)
    reply = raw.read()
    assert (reply["request_id"], reply["code"]) == (request_id, code)
    assert message in reply["error"]
    assert raw.request(command="status", request_id=8) == {
        "request_id": 8,
        "error": "success",
        "data": STATUS,
    }
    assert served.service.commands == []


def test_blank_lines_are_skipped_and_a_request_may_omit_its_id(conns: Connections) -> None:
    raw = conns.raw()
    raw.send_line(b"")
    raw.send_line(b"  \r")
    assert raw.request(command="status") == {"request_id": None, "error": "success", "data": STATUS}


def test_a_line_of_the_maximum_size_is_read(conns: Connections) -> None:
    raw = conns.raw()
    head = b'{"command": "status", "request_id": 1, "pad": "'
    raw.send_line(head + b"x" * (MAX_LINE_BYTES - len(head) - 2) + b'"}')
    assert raw.read()["code"] == "invalid_args"  # read and judged, not refused for its size


# Just over the limit; and far over it, so that the server leaves input unread in the kernel
# (it stops reading at twice its limit) and must drain it to close without a reset.
@pytest.mark.parametrize("size", [MAX_LINE_BYTES + 1, 4 * MAX_LINE_BYTES])
def test_an_oversize_line_is_answered_then_closed_cleanly(
    size: int, served: Served, conns: Connections
) -> None:
    raw = conns.raw()
    raw.send_line(b"x" * size)
    reply = raw.read()
    assert (reply["request_id"], reply["code"]) == (None, "too_large")
    assert str(MAX_LINE_BYTES) in reply["error"]
    assert raw.at_eof()  # EOF, not a reset: the server read what it had not yet
    assert conns.client().call("status") == STATUS  # the server goes on


# events


def test_subscriber_gets_events_interleaved_with_replies(
    served: Served, conns: Connections
) -> None:
    raw = conns.raw()
    assert raw.request(command="subscribe", request_id=1)["data"] == {"subscribed": True}
    served.publish({"event": "hold", "at": 1.0, "held": True})
    assert raw.read() == {"event": "hold", "at": 1.0, "held": True}
    assert raw.request(command="status", request_id=2)["data"] == STATUS
    served.publish({"event": "hold", "at": 2.0, "held": False})
    assert raw.read()["at"] == 2.0
    assert raw.request(command="unsubscribe", request_id=3)["data"] == {"subscribed": False}
    assert served.subscribers() == 0
    served.publish({"event": "hold", "at": 3.0, "held": True})  # nobody listens any more
    assert raw.request(command="status", request_id=4)["request_id"] == 4


def test_subscribing_twice_keeps_one_subscription(served: Served, conns: Connections) -> None:
    raw = conns.raw()
    raw.request(command="subscribe", request_id=1)
    raw.request(command="subscribe", request_id=2)
    assert served.subscribers() == 1
    served.publish({"event": "hold", "at": 1.0, "held": True})
    assert raw.read()["event"] == "hold"
    assert raw.request(command="status", request_id=3)["request_id"] == 3  # no duplicate event


def test_client_keeps_events_that_arrive_before_a_reply(served: Served, conns: Connections) -> None:
    client = conns.client()
    client.call("subscribe")
    published = [{"event": "request", "at": float(n), "model": "alpha"} for n in range(3)]
    served.publish(*published)
    # Once the pump has taken them all, they are queued ahead of the reply to `status`.
    wait_until(lambda: served.service.backlog() == 0, WAIT_S, "the events to be pumped")
    assert client.call("status") == STATUS
    assert list(itertools.islice(client.events(timeout_s=WAIT_S), 3)) == published


def test_disconnecting_unsubscribes(served: Served, conns: Connections) -> None:
    raw = conns.raw()
    raw.request(command="subscribe", request_id=1)
    client = conns.client()
    client.call("subscribe")
    assert served.subscribers() == 2
    raw.sock.close()
    wait_until(lambda: served.subscribers() == 1, WAIT_S, "the closed subscriber to go")
    client.close()
    wait_until(lambda: served.subscribers() == 0, WAIT_S, "the client's subscription to go")


def test_a_subscriber_that_reads_keeps_up_with_bursts(served: Served, conns: Connections) -> None:
    client = conns.client()
    client.call("subscribe")
    events = client.events(timeout_s=WAIT_S)
    for burst in range(20):
        served.publish(*({"event": "request", "at": 0.0, "n": burst * 100 + i} for i in range(100)))
        assert [e["n"] for e in itertools.islice(events, 100)] == list(
            range(burst * 100, burst * 100 + 100)
        )
    assert served.subscribers() == 1


def _flood_until_dropped(served: Served, raw: Raw) -> int:
    """Subscribe `raw`, which then reads nothing, and publish numbered 1 KiB events until the
    server drops it: once the kernel's buffer, the transport's and the outbox are full (a few
    hundred of these) it must, rather than queue without bound. Returns how many were sent."""
    assert raw.request(command="subscribe", request_id=1)["error"] == "success"
    pad = "x" * 1024
    published = 0
    for _ in range(100):
        if served.subscribers() == 0:
            break
        served.publish(
            *({"event": "request", "at": 0.0, "n": published + i, "pad": pad} for i in range(20))
        )
        published += 20
    wait_until(lambda: served.subscribers() == 0, WAIT_S, "the slow subscriber to be dropped")
    return published


def _read_to_the_end(raw: Raw) -> list[dict[str, Any]]:
    lines = []
    while (message := raw._reader.read()) is not None:
        lines.append(message)
    return lines


def test_a_slow_subscriber_is_dropped_after_an_overflow_event(
    served: Served, conns: Connections, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controlserver, "OUTBOX_MAX_LINES", 50)
    raw = conns.raw()
    published = _flood_until_dropped(served, raw)
    lines = _read_to_the_end(raw)
    assert lines[-1]["event"] == "overflow"
    delivered = [line["n"] for line in lines[:-1]]
    assert delivered == list(range(len(delivered)))  # in order, without gaps, then the end
    assert 0 < len(delivered) < published
    assert conns.client().call("status") == STATUS  # the daemon was never blocked


def test_a_subscriber_slower_than_the_linger_still_reads_its_overflow_line(
    served: Served, conns: Connections, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controlserver, "OUTBOX_MAX_LINES", 50)
    raw = conns.raw()
    published = _flood_until_dropped(served, raw)
    # The subscriber is slow on purpose: it comes back to read after the usual linger has
    # passed (which cut the connection and lost its last lines, the overflow line among them).
    time.sleep(controlserver.LINGER_S + 1)
    lines = _read_to_the_end(raw)
    assert lines[-1]["event"] == "overflow"
    assert 0 < len(lines) - 1 < published


def test_a_burst_of_connections_is_queued_not_refused(served: Served, conns: Connections) -> None:
    # The server's loop is busy (blocked here on purpose) while 300 clients connect at once,
    # more than the old backlog of 100: the kernel must queue them all, none refused (EAGAIN).
    busy, release = threading.Event(), threading.Event()

    def block() -> None:
        busy.set()
        release.wait(WAIT_S)

    served.loop.loop.call_soon_threadsafe(block)
    assert busy.wait(WAIT_S)
    socks, refused = [], 0
    try:
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX)
            socks.append(sock)
            sock.setblocking(False)
            try:
                sock.connect(str(served.path))
            except BlockingIOError:
                refused += 1
    finally:
        release.set()
        for sock in socks:
            sock.close()
    assert refused == 0
    assert conns.client().call("status") == STATUS


def test_a_subscriber_whose_service_queue_filled_up_is_dropped(
    served: Served, conns: Connections
) -> None:
    served.service.queue_max = 5
    raw = conns.raw()
    raw.request(command="subscribe", request_id=1)
    served.publish(*({"event": "request", "at": 0.0, "n": n} for n in range(8)))  # 3 are lost
    wait_until(lambda: served.subscribers() == 0, WAIT_S, "the subscriber to be dropped")
    lines = []
    while (message := raw._reader.read()) is not None:
        lines.append(message)
    assert [line["event"] for line in lines] == ["overflow"]


# permissions and the socket file


def test_peer_uid_is_ours_on_our_own_socket() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        assert peer_uid(ours) == os.getuid()


def test_a_peer_with_another_uid_is_refused(
    served: Served, conns: Connections, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controlserver, "peer_uid", lambda sock: os.getuid() + 1)
    raw = conns.raw()
    raw.send(command="shutdown", request_id=1)
    reply = raw.read()
    assert (reply["request_id"], reply["error"], reply["code"]) == (
        None,
        "permission denied",
        "permission",
    )
    assert raw.at_eof()
    assert served.service.commands == []
    with pytest.raises(ControlReplyError, match="permission denied") as refused:
        conns.client()
    assert refused.value.reply_code == control.CODE_PERMISSION


def test_socket_is_0600_in_a_0700_directory(served: Served) -> None:
    assert stat.S_IMODE(served.path.stat().st_mode) == 0o600
    assert stat.S_ISSOCK(served.path.stat().st_mode)
    assert stat.S_IMODE(served.path.parent.stat().st_mode) == 0o700


def test_a_directory_others_can_enter_is_refused(loop: LoopThread, sock_dir: Path) -> None:
    directory = sock_dir / "open"
    directory.mkdir()
    directory.chmod(0o755)
    server = ControlServer(FakeService(), directory / "control.sock", history=no_history)
    with pytest.raises(DaemonError, match=r"has mode 0755; it must be 0700"):
        loop.run(server.start())
    assert not (directory / "control.sock").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a directory away")
def test_a_directory_owned_by_another_user_is_refused(loop: LoopThread, sock_dir: Path) -> None:
    directory = sock_dir / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    server = ControlServer(FakeService(), directory / "control.sock", history=no_history)
    with pytest.raises(DaemonError, match="is owned by uid 65534, not by you"):
        loop.run(server.start())


def test_a_second_server_on_a_live_socket_is_refused(served: Served, conns: Connections) -> None:
    inode = served.path.stat().st_ino
    second = ControlServer(FakeService(), served.path, history=no_history)
    with pytest.raises(DaemonError) as caught:
        served.loop.run(second.start())
    assert str(caught.value) == f"another arbiterd is already running on {served.path}"
    assert served.path.stat().st_ino == inode
    assert conns.client().call("status") == STATUS  # the first one still serves


def test_a_stale_socket_file_is_replaced(loop: LoopThread, sock_dir: Path) -> None:
    path = sock_dir / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # a daemon that died: the file stays, nobody listens
    service = FakeService()
    server = ControlServer(service, path, history=no_history)
    loop.run(server.start())
    try:
        with ControlClient.connect(path, timeout_s=WAIT_S) as client:
            assert client.call("status") == STATUS
    finally:
        loop.run(server.close())
    assert not path.exists()


def test_a_file_that_is_not_a_socket_is_left_alone(loop: LoopThread, sock_dir: Path) -> None:
    path = sock_dir / "control.sock"
    path.write_text("notes")
    with pytest.raises(DaemonError, match="exists and is not a socket"):
        loop.run(ControlServer(FakeService(), path, history=no_history).start())
    assert path.read_text() == "notes"


# history: the events command


def hold(at: float, held: bool = True) -> dict[str, Any]:
    return {"event": "hold", "at": at, "held": held}


def test_events_answers_from_the_history_since_a_time(served: Served, conns: Connections) -> None:
    for at in (AT, AT + 1, AT + 2):
        served.journal.append(hold(at))
    assert conns.client().call("events", since=AT + 1) == {
        "events": [{**hold(AT + 1), "seq": 2}, {**hold(AT + 2), "seq": 3}],
        "more": False,
    }
    assert conns.client().call("events", since=AT + 3) == {"events": [], "more": False}


def test_events_come_in_pages_by_seq_and_the_client_reads_every_page(
    served: Served, conns: Connections, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs = [served.journal.append(hold(AT + i, i % 2 == 0)) for i in range(5)]
    raw = conns.raw()
    first = raw.request(command="events", limit=2, request_id=1)["data"]
    assert ([e["seq"] for e in first["events"]], first["more"]) == (seqs[:2], True)
    rest = raw.request(command="events", after_seq=seqs[1], limit=3, request_id=2)["data"]
    assert ([e["seq"] for e in rest["events"]], rest["more"]) == (seqs[2:], False)
    # Pages of two by default: the client must ask three times to read all five.
    monkeypatch.setattr(controlserver, "EVENTS_PAGE_MAX", 2)
    client = conns.client()
    assert [e["seq"] for e in client.history()] == seqs
    assert list(client.history(since=AT + 3)) == [
        {**hold(AT + 3, False), "seq": seqs[3]},
        {**hold(AT + 4), "seq": seqs[4]},
    ]
    assert list(client.history(after_seq=seqs[-1])) == []


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"limit": 0}, f"'limit' must be from 1 to {EVENTS_PAGE_MAX}, not 0"),
        ({"limit": EVENTS_PAGE_MAX + 1}, f"'limit' must be from 1 to {EVENTS_PAGE_MAX}"),
        ({"limit": 2.5}, "'limit' must be an integer, not 2.5"),
        ({"after_seq": -1}, "'after_seq' must be from 0 to"),
        ({"since": "1h"}, "'since' must be a number, not '1h'"),
        ({"since": True}, "'since' must be a number, not True"),
        ({"kinds": ["hold"]}, "unknown argument 'kinds'"),
    ],
)
def test_bad_events_arguments_are_refused(
    served: Served, conns: Connections, args: dict[str, Any], problem: str
) -> None:
    served.journal.append(hold(AT))
    reply = conns.raw().request(command="events", request_id=4, **args)
    assert (reply["request_id"], reply["code"]) == (4, "invalid_args")
    assert problem in reply["error"]


def test_a_since_that_is_not_a_finite_number_is_refused(conns: Connections) -> None:
    raw = conns.raw()
    raw.send_line(b'{"command": "events", "since": NaN, "request_id": 1}')
    reply = raw.read()
    assert (reply["code"], reply["error"]) == (
        "invalid_args",
        "events: argument 'since' must be a number, not nan",
    )
    assert raw.request(command="events", request_id=2)["data"] == {"events": [], "more": False}


# the client


def test_client_reports_a_missing_daemon(sock_dir: Path) -> None:
    path = sock_dir / "control.sock"
    with pytest.raises(DaemonNotRunningError) as caught:
        ControlClient.connect(path, timeout_s=WAIT_S)
    assert str(caught.value) == f"arbiterd is not running (no daemon on {path})"


def test_client_reports_a_dead_daemons_socket_as_not_running(sock_dir: Path) -> None:
    path = sock_dir / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))
    with pytest.raises(DaemonNotRunningError, match="arbiterd is not running"):
        ControlClient.connect(path, timeout_s=WAIT_S)


def test_client_sees_the_daemon_go_away(served: Served, conns: Connections) -> None:
    client = conns.client()
    client.call("subscribe")
    served.loop.run(served.server.close())
    with pytest.raises(DaemonError, match="closed the connection"):
        next(client.events(timeout_s=WAIT_S))
    with pytest.raises(DaemonError):
        client.call("status")


def test_events_end_when_none_comes_in_time(served: Served, conns: Connections) -> None:
    client = conns.client()
    client.call("subscribe")
    assert list(client.events(timeout_s=0.05)) == []


def test_the_protocol_document_covers_every_command_and_code() -> None:
    text = DOC.read_text()
    for name in CONTROL_COMMANDS:
        assert f"`{name}`" in text, name
    for code in (
        control.CODE_INVALID_REQUEST,
        control.CODE_UNKNOWN_COMMAND,
        control.CODE_INVALID_ARGS,
        control.CODE_PROTOCOL,
        control.CODE_TOO_LARGE,
        control.CODE_PERMISSION,
        control.CODE_INTERNAL,
        "unknown_model",
        "control",
    ):
        assert f"`{code}`" in text, code
    assert f"{MAX_LINE_BYTES:,}".replace(",", " ") in text or str(MAX_LINE_BYTES) in text
