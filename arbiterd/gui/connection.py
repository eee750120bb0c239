"""The tray's connection to the daemon: the control protocol (docs/control-protocol.md) over
QLocalSocket, driven by the Qt event loop, never blocking it.

Owns every socket the GUI opens. One long-lived connection says `hello`, `subscribe`s to events,
polls `status` (one request in flight at a time, at most once a second) and, when asked, pages
through the daemon's journal (`events`); when it drops — the daemon restarted, or dropped us
with `overflow` — it reconnects with a doubling backoff.
Commands (warm, release, pin, …) each get a short-lived connection of their own: the daemon
answers a connection's requests in order, and a `warm` that loads a model for minutes must not
hold up the status and events of the long-lived one.

    DaemonConnection.connected(hello data)      after each successful hello
    DaemonConnection.disconnected(reason)       the connection dropped, or an attempt failed
    DaemonConnection.status_received(status)    one status object, about once a second
    DaemonConnection.event_received(event)      each event (an arbiterd.events record), in order
    DaemonConnection.history_received(events)   the journal's events `request_history` asked for,
                                                oldest first, once every page is in
    DaemonConnection.command_finished(id, command, data)
    DaemonConnection.command_failed(id, command, message, code)
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any, Final

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtNetwork import QLocalSocket

from arbiterd.control import CONTROL_PROTOCOL, EVENTS_PAGE_MAX
from arbiterd.errors import ProtocolError
from arbiterd.events import Event, OverflowEvent, parse_event
from arbiterd.states import ControlCommand
from arbiterd.wire import MAX_MESSAGE_BYTES, decode, encode

log = logging.getLogger(__name__)

STATUS_INTERVAL_MS: Final = 1000  # the issue: update at most about once a second
# A status the daemon has not answered by then means it is wedged: drop and reconnect.
STATUS_TIMEOUT_S: Final = 15.0
RECONNECT_FIRST_S: Final = 0.5
RECONNECT_MAX_S: Final = 10.0
# warm may load a model from disk and hold may wait for every model to release.
COMMAND_TIMEOUT_S: Final = 600.0
CODE_UNREACHABLE: Final = "unreachable"  # our own code for a command that found no daemon
CODE_LOST: Final = "lost"  # the daemon closed the connection before it answered


class _LineSocket(QObject):
    """One QLocalSocket carrying newline-delimited JSON objects in both directions."""

    opened = Signal()
    message = Signal(object)  # dict[str, Any]
    closed = Signal(object, str)  # this _LineSocket, why; emitted once

    def __init__(self, path: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.path = path
        self._socket = QLocalSocket(self)
        self._buffer = bytearray()
        self._closed = False
        self.unreachable = False  # closed because nothing listens on the path
        self._socket.connected.connect(self._on_connected)
        self._socket.readyRead.connect(self._read)
        self._socket.disconnected.connect(self._on_disconnected)
        self._socket.errorOccurred.connect(self._on_error)

    def open(self) -> None:
        if not self._closed:
            self._socket.connectToServer(str(self.path))

    def send(self, message: dict[str, Any]) -> None:
        if not self._closed:
            self._socket.write(encode(message))

    def close(self, reason: str = "closed") -> None:
        """Close now; `closed` is emitted unless it was already. Nothing comes from the socket
        after this, so the owner may deleteLater() this object at once."""
        if self._closed:
            return
        self._closed = True
        # Silenced before abort(): the socket's late signals (and any it sends while being
        # deleted with this object) must not reach Python slots; without this, the tests saw
        # PySide crash in ~QObject when a deleteLater() ran during the next test.
        self._socket.blockSignals(True)
        self._socket.abort()
        self.closed.emit(self, reason)

    def _on_connected(self) -> None:
        if not self._closed:
            self.opened.emit()

    def _read(self) -> None:
        if self._closed or not self._socket.isOpen():
            return
        self._buffer += bytes(self._socket.readAll().data())
        while not self._closed:
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > MAX_MESSAGE_BYTES:
                    self.close(f"arbiterd sent a line over {MAX_MESSAGE_BYTES} bytes")
                return
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            if not line.strip():
                continue
            try:
                message = decode(line)
            except ProtocolError as exc:
                self.close(f"arbiterd sent a malformed line: {exc}")
                return
            self.message.emit(message)

    def _on_disconnected(self) -> None:
        self._read()  # the last line may have come with the end of the stream
        self.close(f"arbiterd closed the connection on {self.path}")

    def _on_error(self, error: QLocalSocket.LocalSocketError) -> None:
        if error == QLocalSocket.LocalSocketError.PeerClosedError:
            self._on_disconnected()
        elif error in (
            QLocalSocket.LocalSocketError.ServerNotFoundError,
            QLocalSocket.LocalSocketError.ConnectionRefusedError,
        ):
            self.unreachable = True
            self.close(f"arbiterd is not running (no daemon on {self.path})")
        else:
            self.close(f"cannot talk to arbiterd on {self.path}: {self._socket.errorString()}")


class _CommandCall(QObject):
    """One command on a connection of its own: hello, the command, its reply, close."""

    done = Signal(object)  # this call, its outcome in data / message / code

    def __init__(
        self, path: Path, request: dict[str, Any], timeout_s: float, parent: QObject
    ) -> None:
        super().__init__(parent)
        self.request = request
        self.data: dict[str, Any] | None = None  # the reply's data; None when it failed
        self.message = ""  # why it failed
        self.code = ""
        self._finished = False
        self._lines = _LineSocket(path, self)
        self._lines.opened.connect(self._on_open)
        self._lines.message.connect(self._on_message)
        self._lines.closed.connect(self._on_closed)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self._on_timeout)
        self._timeout_s = timeout_s

    def start(self) -> None:
        if self._finished:  # aborted before the event loop got to it
            return
        self._timer.start(int(self._timeout_s * 1000))
        self._lines.open()

    def _on_open(self) -> None:
        # Replies come in request order, so both may go at once; a refused hello closes the
        # connection and its error is the answer.
        self._lines.send(
            {"command": ControlCommand.HELLO, "protocol": CONTROL_PROTOCOL, "request_id": 0}
        )
        self._lines.send(self.request)

    def _on_message(self, message: dict[str, Any]) -> None:
        if "event" in message:
            return
        error = message.get("error")
        if message.get("request_id") == 0 and error == "success":
            return  # the hello
        if error == "success":
            data = message.get("data")
            self._finish(data if isinstance(data, dict) else {}, "", "")
        else:
            self._finish(None, str(error), str(message.get("code", "")))

    def _on_closed(self, lines: _LineSocket, reason: str) -> None:
        self._finish(None, reason, CODE_UNREACHABLE if lines.unreachable else CODE_LOST)

    def _on_timeout(self) -> None:
        command = self.request.get("command")
        self._finish(None, f"arbiterd did not answer {command!r} in time", CODE_LOST)

    def _finish(self, data: dict[str, Any] | None, message: str, code: str) -> None:
        if self._finished:
            return
        self._finished = True
        self._timer.stop()
        self.data, self.message, self.code = data, message, code
        self._lines.close("done")
        self.done.emit(self)

    def abort(self) -> None:
        self._finished = True
        self._timer.stop()
        self._lines.close("aborted")


class DaemonConnection(QObject):
    connected = Signal(object)  # the hello reply's data
    disconnected = Signal(str)
    status_received = Signal(object)
    event_received = Signal(object)
    history_received = Signal(object)  # list[Event]
    command_finished = Signal(int, str, object)
    command_failed = Signal(int, str, str, str)

    def __init__(
        self,
        path: Path,
        parent: QObject | None = None,
        *,
        status_interval_ms: int = STATUS_INTERVAL_MS,
        reconnect_first_s: float = RECONNECT_FIRST_S,
        reconnect_max_s: float = RECONNECT_MAX_S,
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> None:
        super().__init__(parent)
        self.path = path
        self.server: dict[str, Any] = {}  # the last hello reply
        self.command_timeout_s = command_timeout_s
        self._ids = itertools.count(1)
        self._lines: _LineSocket | None = None
        self._connected = False
        self._running = False
        # request id -> command, on the long-lived connection
        self._pending: dict[int, ControlCommand] = {}
        self._status_sent_at: float | None = None  # time.monotonic of the status in flight
        self._history: list[Event] | None = None  # the pages read so far of a history asked for
        self._calls: dict[int, _CommandCall] = {}
        self._first_s = reconnect_first_s
        self._max_s = reconnect_max_s
        self._backoff_s = reconnect_first_s
        self._poll = QTimer(self)
        self._poll.setInterval(status_interval_ms)
        self._poll.timeout.connect(self.request_status)
        self._retry = QTimer(self)
        self._retry.setSingleShot(True)
        self._retry.timeout.connect(self._open)

    @property
    def is_connected(self) -> bool:
        return self._connected

    @property
    def next_retry_s(self) -> float:
        """How long the next failed attempt waits before trying again."""
        return self._backoff_s

    def start(self) -> None:
        if not self._running:
            self._running = True
            self._open()

    def retry_now(self) -> None:
        """Try to connect soon, from the shortest backoff (e.g. after starting the daemon)."""
        self._backoff_s = self._first_s
        if self._running and not self._connected and self._lines is None:
            self._retry.start(int(self._first_s * 1000))

    def stop(self) -> None:
        """Close every socket and stop every timer; `start` may follow."""
        self._running = False
        self._retry.stop()
        self._poll.stop()
        for call in list(self._calls.values()):
            call.abort()
            call.deleteLater()
        self._calls.clear()
        self._drop_lines()
        self._connected = False

    # -- the long-lived connection ---------------------------------------------------------------

    def _open(self) -> None:
        if not self._running:
            return
        self._drop_lines()
        lines = _LineSocket(self.path, self)
        self._lines = lines
        lines.opened.connect(self._on_open)
        lines.message.connect(self._on_message)
        lines.closed.connect(self._on_closed)
        lines.open()

    def _drop_lines(self) -> None:
        lines, self._lines = self._lines, None
        self._pending.clear()
        self._status_sent_at = None
        self._history = None  # lost with the connection; the tray asks again once connected
        if lines is not None:
            lines.close("replaced")  # _on_closed ignores it: it is no longer self._lines
            lines.deleteLater()

    def _send(self, command: ControlCommand, **args: Any) -> None:
        if self._lines is None:
            return
        request_id = next(self._ids)
        self._pending[request_id] = command
        self._lines.send({**args, "command": command, "request_id": request_id})

    def _on_open(self) -> None:
        self._send(ControlCommand.HELLO, protocol=CONTROL_PROTOCOL)

    def request_history(self, since: float) -> None:
        """Ask for the journal's events at or after `since` (seconds since the epoch), for
        `history_received`; nothing when not connected, or while a history is on its way."""
        if not self._connected or self._history is not None:
            return
        self._history = []
        self._send(ControlCommand.EVENTS, since=since, limit=EVENTS_PAGE_MAX)

    def _on_history_page(self, data: dict[str, Any]) -> None:
        collected = self._history
        if collected is None:
            return
        stored = data.get("events")
        page = [e for e in stored if isinstance(e, dict)] if isinstance(stored, list) else []
        collected += (parse_event(e) for e in page)
        seqs = [e["seq"] for e in page if isinstance(e.get("seq"), int)]
        if data.get("more") is True and seqs:
            self._send(ControlCommand.EVENTS, after_seq=seqs[-1], limit=EVENTS_PAGE_MAX)
        else:
            self._finish_history()

    def _finish_history(self) -> None:
        collected, self._history = self._history, None
        if collected is not None:
            self.history_received.emit(collected)

    def request_status(self) -> None:
        """Ask for a status now, unless one is already on its way (then at most wait for it)."""
        if not self._connected:
            return
        if self._status_sent_at is not None:
            if time.monotonic() - self._status_sent_at > STATUS_TIMEOUT_S:
                self._lost(f"arbiterd did not answer status within {STATUS_TIMEOUT_S:.0f} s")
            return
        self._status_sent_at = time.monotonic()
        self._send(ControlCommand.STATUS)

    def _on_message(self, message: dict[str, Any]) -> None:
        if "event" in message:
            event = parse_event(message)
            if isinstance(event, OverflowEvent):
                # Events were lost: start over with a fresh subscription and status.
                self._lost("arbiterd dropped the tray for reading events too slowly", retry_s=0)
            else:
                self.event_received.emit(event)
            return
        request_id = message.get("request_id")
        command = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        error = message.get("error")
        if error != "success":
            log.warning("arbiterd refused %s: %s (%s)", command, error, message.get("code"))
            if command in (None, ControlCommand.HELLO):
                # A refused hello (protocol) or a refused connection (permission): it closes.
                self._lost(f"arbiterd refused the tray: {error}")
            elif command is ControlCommand.STATUS:
                self._status_sent_at = None
            elif command is ControlCommand.EVENTS:
                self._finish_history()  # an older daemon, or its journal failed: no history
            return
        data = message.get("data")
        data = data if isinstance(data, dict) else {}
        if command is ControlCommand.HELLO:
            self.server = data
            self._connected = True
            self._backoff_s = self._first_s
            self._send(ControlCommand.SUBSCRIBE)
            self.connected.emit(data)
            self.request_status()
            self._poll.start()
        elif command is ControlCommand.STATUS:
            self._status_sent_at = None
            self.status_received.emit(data)
        elif command is ControlCommand.EVENTS:
            self._on_history_page(data)

    def _on_closed(self, lines: _LineSocket, reason: str) -> None:
        if lines is self._lines:
            self._lost(reason)

    def _lost(self, reason: str, retry_s: float | None = None) -> None:
        log.info("tray: %s", reason)
        self._poll.stop()
        self._drop_lines()
        self._connected = False
        self.disconnected.emit(reason)
        if not self._running:
            return
        delay_s = self._backoff_s if retry_s is None else retry_s
        self._backoff_s = min(self._max_s, self._backoff_s * 2)
        self._retry.start(int(delay_s * 1000))

    # -- commands ----------------------------------------------------------------------------------

    def send_command(self, command: str, model: str | None = None) -> int:
        """Send `command` (warm, release, pin, unpin, hold, unhold, …) on a connection of its
        own; returns its request id, which `command_finished` or `command_failed` carries."""
        request_id = next(self._ids)
        request: dict[str, Any] = {"command": command, "request_id": request_id}
        if model is not None:
            request["model"] = model
        call = _CommandCall(self.path, request, self.command_timeout_s, self)
        self._calls[request_id] = call
        call.done.connect(self._on_command_done)
        # From the event loop: a refused connect fails at once, and the caller should have the
        # request id before any answer about it.
        QTimer.singleShot(0, call, call.start)
        return request_id

    def _on_command_done(self, call: _CommandCall) -> None:
        request_id = call.request["request_id"]
        if self._calls.pop(request_id, None) is None:
            return
        call.deleteLater()
        command = str(call.request.get("command"))
        if call.data is None:
            log.warning("tray: %s failed: %s (%s)", command, call.message, call.code)
            self.command_failed.emit(request_id, command, call.message, call.code)
        else:
            self.command_finished.emit(request_id, command, call.data)
            self.request_status()  # show its effect without waiting for the next poll
