"""Doubles for the tray tests: a fake control server on a real Unix socket, and a notification
sink that records its calls.

The fake server speaks the control protocol (docs/control-protocol.md) from threads: `hello`,
`status` (whatever `status` holds now), `subscribe` (then `push_event` reaches the connection),
`events` (from what `journal` put in its history, `page_size` at a time), and the steering
commands, which it records and answers. It refuses any command `refuse` names. `stop` closes
every socket and joins every thread.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbiterd.control import COMMANDS, CONTROL_PROTOCOL, EVENTS_PAGE_MAX, MODEL_COMMANDS
from arbiterd.errors import ProtocolError
from arbiterd.gui.notify import OnId
from arbiterd.wire import LineReader, encode

ACCEPT_POLL_S = 0.05  # how often the accept thread looks at its stop flag
JOIN_TIMEOUT_S = 10.0

MiB = 1 << 20
GiB = 1 << 30


def model(name: str, state: str = "cold", **fields: Any) -> dict[str, Any]:
    """One model of a status object, with the daemon's keys."""
    report: dict[str, Any] = {
        "name": name,
        "state": state,
        "pid": 1000 + len(name),
        "pinned": False,
        "queue": 0,
        "resident_bytes": 0,
        "host_ram_bytes": None,  # None: the daemon cannot tell; a test that needs it says
        "prompt_tokens_evaluated": 0,
        "served": 0,
        "restarts": 0,
        "last_error": "",
        "last_handoff": None,
    }
    report.update(fields)
    return report


def status(
    *models: dict[str, Any],
    holder: str | None = None,
    devices: list[dict[str, Any]] | None = None,
    others: list[dict[str, Any]] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "models": list(models),
        "arena": "/run/user/1000/arbiterd/arena/gpu0",
        "holder": None if holder is None else {"pid": 4242, "name": holder, "since": 1.0},
        "waiters": [],
        "hold": False,
        "host_ram_bytes": None,
        "telemetry": {
            "source": "test",
            "device": "gpu0",
            "devices": devices or [],
            "others": others or [],
            "models": {},
            "errors": [],
        },
    }
    report.update(fields)
    return report


@dataclass
class _Connection:
    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    subscribed: bool = False

    def send(self, message: dict[str, Any]) -> None:
        # OSError: the client went away; its reader thread ends the connection.
        with self.lock, contextlib.suppress(OSError):
            self.sock.sendall(encode(message))


class FakeControlServer:
    def __init__(self, path: Path, status: dict[str, Any]) -> None:
        self.path = path
        self.status = status
        self.commands: list[tuple[str, str | None]] = []  # (command, model), in arrival order
        self.requests: list[dict[str, Any]] = []  # every request line, hello and status too
        self.refuse: dict[str, tuple[str, str]] = {}  # command -> (message, code)
        self.history: list[dict[str, Any]] = []  # what `events` answers from, each with a seq
        self.page_size = EVENTS_PAGE_MAX  # the most events one reply carries
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connections: list[_Connection] = []
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._names = itertools.count(1)

    # -- lifetime ------------------------------------------------------------------------------

    def start(self) -> FakeControlServer:
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(16)
        listener.settimeout(ACCEPT_POLL_S)
        self._listener = listener
        self._stop.clear()
        self._spawn(self._accept_loop, "fake-control-accept")
        return self

    def stop(self) -> None:
        """Stop listening, close every connection, join every thread; the socket file goes."""
        self._stop.set()
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)  # wakes its reader's recv
        for thread in self._threads:
            thread.join(JOIN_TIMEOUT_S)
            assert not thread.is_alive(), f"{thread.name} did not end"
        self._threads = []
        for connection in connections:
            connection.sock.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.path.unlink(missing_ok=True)

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- what the tests drive ------------------------------------------------------------------

    def journal(self, *events: dict[str, Any]) -> None:
        """Add events to the history `events` answers from, as the daemon's journal would."""
        with self._lock:
            for event in events:
                self.history.append({**event, "seq": len(self.history) + 1})

    def push_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            subscribers = [c for c in self._connections if c.subscribed]
        for connection in subscribers:
            connection.send(event)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return sum(1 for c in self._connections if c.subscribed)

    def commands_seen(self) -> list[tuple[str, str | None]]:
        with self._lock:
            return list(self.commands)

    def requests_seen(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.requests)

    # -- the protocol --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stop.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            connection = _Connection(sock)
            with self._lock:
                if self._stop.is_set():
                    sock.close()
                    return
                self._connections.append(connection)
                self._spawn(self._serve, f"fake-control-{next(self._names)}", connection)

    def _serve(self, connection: _Connection) -> None:
        reader = LineReader(connection.sock)
        while True:
            try:
                message = reader.read()
            except (OSError, ProtocolError):
                message = None
            if message is None:
                break
            with self._lock:
                self.requests.append(message)
            reply = self._answer(connection, message)
            connection.send(reply)
        with self._lock:
            if connection in self._connections:
                self._connections.remove(connection)
                connection.sock.close()

    def _answer(  # noqa: PLR0911 (one return per command, as the protocol's table)
        self, connection: _Connection, message: dict[str, Any]
    ) -> dict[str, Any]:
        request_id = message.get("request_id")
        command = message.get("command")

        def ok(data: dict[str, Any]) -> dict[str, Any]:
            return {"request_id": request_id, "error": "success", "data": data}

        if command == "hello":
            if message.get("protocol", CONTROL_PROTOCOL) != CONTROL_PROTOCOL:
                return {"request_id": request_id, "error": "bad protocol", "code": "protocol"}
            return ok({"protocol": CONTROL_PROTOCOL, "server": "fake", "commands": []})
        if command == "status":
            with self._lock:
                return ok(copy.deepcopy(self.status))
        if command == "subscribe":
            connection.subscribed = True
            return ok({"subscribed": True})
        name = message.get("model")
        with self._lock:
            if command in COMMANDS:
                self.commands.append((str(command), name if isinstance(name, str) else None))
            refused = self.refuse.get(str(command))
        if refused is not None:
            text, code = refused
            return {"request_id": request_id, "error": text, "code": code}
        if command == "events":
            return ok(self._history_page(message))
        if command in COMMANDS:
            if command in MODEL_COMMANDS:
                return ok({"model": name, "state": "warm"})
            return ok({"hold": command == "hold"})
        return {"request_id": request_id, "error": f"unknown {command}", "code": "unknown_command"}

    def _history_page(self, message: dict[str, Any]) -> dict[str, Any]:
        since, after = message.get("since"), message.get("after_seq")
        limit = min(message.get("limit", EVENTS_PAGE_MAX), self.page_size)
        with self._lock:
            found = [
                copy.deepcopy(event)
                for event in self.history
                if (since is None or event["at"] >= since)
                and (after is None or event["seq"] > after)
            ]
        return {"events": found[:limit], "more": len(found) > limit}


class RecordingSink:
    """A NotificationSink that records each call and answers with the next id, or holds the
    answer back until `answer()` when `manual`."""

    def __init__(self, *, manual: bool = False) -> None:
        self.calls: list[tuple[str, str, int]] = []  # (summary, body, replaces_id)
        self.manual = manual
        self._ids = itertools.count(101)
        self._waiting: list[OnId] = []

    def notify(self, summary: str, body: str, replaces_id: int, on_id: OnId) -> None:
        self.calls.append((summary, body, replaces_id))
        if self.manual:
            self._waiting.append(on_id)
        else:
            on_id(replaces_id or next(self._ids))

    def answer(self, notification_id: int | None = None) -> None:
        on_id = self._waiting.pop(0)
        on_id(notification_id if notification_id is not None else next(self._ids))
