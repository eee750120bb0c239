"""The control socket's client, blocking, for the CLI, the demo and the tests.

Speaks the control protocol (arbiterd.control): one request at a time, replies matched by id,
events after `subscribe` kept in order. An error reply raises the class its code names.
"""

from __future__ import annotations

import itertools
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from arbiterd.control import (
    CONTROL_PROTOCOL,
    PROTOCOL_CODES,
)
from arbiterd.errors import (
    ArbiterError,
    ControlError,
    ControlReplyError,
    DaemonError,
    DaemonNotRunningError,
    ProtocolError,
    error_from_wire,
)
from arbiterd.wire import LineReader, LineWriter

CONNECT_TIMEOUT_S: Final = 5.0
# unix(7)'s struct ucred: pid, uid, gid.
PEERCRED_SIZE: Final = struct.calcsize("3i")


def _reply_error(message: str, code: str) -> ArbiterError:
    if code in PROTOCOL_CODES:
        return ControlReplyError(message, code)
    return error_from_wire({"code": code, "message": message})


class ControlClient:
    """A blocking connection to the daemon, for one thread. Create with `connect`; close it."""

    def __init__(self, sock: socket.socket, path: Path, timeout_s: float) -> None:
        self.path = path
        # How long `call` waits for its reply; raise it for commands that load a model.
        self.timeout_s = timeout_s
        # The daemon's hello: protocol, server, version, commands.
        self.server: dict[str, Any] = {}
        self._sock = sock
        self._reader = LineReader(sock)
        self._writer = LineWriter(sock)
        self._ids = itertools.count(1)
        # Events read while waiting for a reply, for `events` to yield first.
        self._events: deque[dict[str, Any]] = deque()

    def peer_pid(self) -> int:
        """The daemon's pid, as the kernel tells it of the socket's other end (SO_PEERCRED)."""
        creds = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED_SIZE)
        pid: int = struct.unpack("3i", creds)[0]
        return pid

    @classmethod
    def connect(cls, path: Path, timeout_s: float = CONNECT_TIMEOUT_S) -> ControlClient:
        """Connect and say hello. DaemonNotRunningError if nothing listens on `path`."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise DaemonNotRunningError(f"arbiterd is not running (no daemon on {path})") from None
        except OSError as exc:
            sock.close()
            raise DaemonError(
                f"cannot connect to arbiterd on {path}: {exc.strerror or exc}"
            ) from None
        client = cls(sock, path, timeout_s)
        try:
            client.server = client.call("hello", protocol=CONTROL_PROTOCOL)
        except BaseException:
            client.close()
            raise
        return client

    def call(self, command: str, /, **args: Any) -> dict[str, Any]:
        """Send one request and return its reply's data. An error reply raises the class its
        code names (UnknownModelError, ...), or ControlReplyError for a refusal of the
        protocol's own; DaemonError if the daemon goes away or does not answer in `timeout_s`."""
        return self._call(command, args, None)

    def call_watched(
        self, command: str, on_progress: Callable[[dict[str, Any]], None], /, **args: Any
    ) -> dict[str, Any]:
        """`call` of a model command that says, through `on_progress`, what the model waits
        for while it waits for the GPU: the daemon's progress lines, as they come."""
        return self._call(command, {**args, "progress": True}, on_progress)

    def _call(
        self,
        command: str,
        args: dict[str, Any],
        on_progress: Callable[[dict[str, Any]], None] | None,
    ) -> dict[str, Any]:
        request_id = next(self._ids)
        if not self._writer.send({**args, "command": command, "request_id": request_id}):
            raise DaemonError(f"arbiterd closed the connection on {self.path}")
        deadline = time.monotonic() + self.timeout_s
        while True:
            message = self._next(deadline)
            if message is None:
                raise DaemonError(f"arbiterd did not answer {command!r} within {self.timeout_s} s")
            if "event" in message:
                self._events.append(message)
                continue
            reply_id, error = message.get("request_id"), message.get("error")
            progress = message.get("progress")
            if "progress" in message and "error" not in message:
                if on_progress is not None and reply_id == request_id:
                    on_progress(progress if isinstance(progress, dict) else {})
                continue
            # An error with request_id null refuses the connection or the line itself; any other
            # reply is a late answer to a call that timed out.
            if reply_id != request_id and (reply_id is not None or error == "success"):
                continue
            if error != "success":
                raise _reply_error(str(error), str(message.get("code", "")))
            data = message.get("data")
            return data if isinstance(data, dict) else {}

    def history(
        self, *, since: float | None = None, after_seq: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """The daemon's journal (`events`): the events stored at or after `since` (seconds since
        the epoch) with a seq above `after_seq`, oldest first, as stored, each with its "seq".
        Asks page after page until the last; ControlReplyError from a daemon without `events`."""
        while True:
            args = {"since": since, "after_seq": after_seq}
            page = self.call("events", **{k: v for k, v in args.items() if v is not None})
            stored = page.get("events")
            events = [e for e in stored if isinstance(e, dict)] if isinstance(stored, list) else []
            yield from events
            seqs = [e["seq"] for e in events if isinstance(e.get("seq"), int)]
            if page.get("more") is not True or not seqs:
                return
            after_seq = seqs[-1]

    def events(self, timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """The events after `call("subscribe")`, those that came before a reply first. Ends when
        none arrives within `timeout_s` (None: waits for ever); ControlError if the daemon
        dropped this client for reading too slowly, DaemonError if the daemon went away."""
        while True:
            while self._events:
                event = self._events.popleft()
                if event.get("event") == "overflow":
                    raise ControlError(
                        "arbiterd dropped this connection: events came faster than it read them"
                    )
                yield event
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            message = self._next(deadline)
            if message is None:
                return
            if "event" in message:
                self._events.append(message)
            # Anything else is a late reply to a call that timed out.

    def _next(self, deadline: float | None) -> dict[str, Any] | None:
        """The next line, or None when `deadline` (time.monotonic) passes first."""
        if deadline is None:
            self._sock.settimeout(None)
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._sock.settimeout(remaining)
        try:
            message = self._reader.read()
        except TimeoutError:
            return None  # LineReader keeps a partial line for the next read
        except ProtocolError as exc:
            raise DaemonError(f"arbiterd sent a malformed line: {exc}") from None
        except OSError as exc:
            raise DaemonError(f"lost the connection to arbiterd: {exc.strerror or exc}") from None
        if message is None:
            raise DaemonError(f"arbiterd closed the connection on {self.path}")
        return message

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
