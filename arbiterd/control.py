"""The control socket: arbiterd's JSON command API on a Unix socket, in the style of mpv's IPC.

Owns the socket file and its directory, the protocol (docs/control-protocol.md) on the daemon's
side (`ControlServer`, on the daemon's event loop) and on the client's (`ControlClient`, blocking,
for the CLI and the tests). It asks the daemon only what `arbiterd.service.Service` offers, and
answers `events` from the `History` it is given (the journal's query); it never blocks the event
loop: every connection has its own bounded outbox, a subscriber that cannot keep up is dropped
rather than waited for, and the history is read in a thread.

    client → daemon  {"command": NAME, "request_id": SCALAR, ...args}
    daemon → client  {"request_id", "error": "success", "data": {...}}
                     {"request_id", "error": MESSAGE, "code": CODE}   CODE_* or an ErrorCode
                     {"event": KIND, "at": SECONDS, ...}          after `subscribe`
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol

import arbiterd
from arbiterd import socketfile
from arbiterd.errors import (
    ArbiterError,
    ControlError,
    ControlReplyError,
    DaemonError,
    DaemonNotRunningError,
    ProtocolError,
    error_from_wire,
)
from arbiterd.paths import ensure_private_dir
from arbiterd.service import COMMANDS, MODEL_COMMANDS, Service
from arbiterd.wire import LineReader, LineWriter, decode, encode

log = logging.getLogger(__name__)

CONTROL_PROTOCOL: Final = 1
SERVER_NAME: Final = "arbiterd"
SOCKET_MODE: Final = 0o600
# A request is a command and a model name; a line this long is a bug or abuse (not counting the
# newline). The daemon's own lines (status, events) are not bounded by it.
MAX_LINE_BYTES: Final = 1024 * 1024
# Lines queued for one connection (replies and events) before its subscriber counts as too slow:
# the kernel's socket buffer and the transport's high-water mark are full by then too.
OUTBOX_MAX_LINES = 1000
# After the daemon's last line to a connection it closes its side for writing, then reads and
# discards until the peer closes, at most this long: closing a Unix socket with unread input
# resets the peer, which could then lose the last line (unix_release_sock sets ECONNRESET).
LINGER_S: Final = 2.0
# A subscriber dropped for falling behind gets this long to read what it was sent, the overflow
# line last, before its connection is cut: it is slow, so the usual linger would lose that line.
OVERFLOW_GRACE_S: Final = 30.0
# Pending connections the kernel queues before refusing more: a burst of clients (a tray per
# login, scripts polling status) must not see ECONNREFUSED while the daemon is busy for a moment.
LISTEN_BACKLOG: Final = 1024
# The most events one `events` reply carries; a client asks on from the last seq while the reply
# says "more". A journaled event is a few hundred bytes: a page stays far below the 16 MiB a
# client accepts in a line (wire.MAX_MESSAGE_BYTES).
EVENTS_PAGE_MAX: Final = 500
CONNECT_TIMEOUT_S: Final = 5.0
DISCARD_BYTES: Final = 65536

# Error codes of the protocol itself, besides the codes of arbiterd errors (errors.ErrorCode,
# e.g. "unknown_model").
CODE_INVALID_REQUEST: Final = "invalid_request"  # not UTF-8/JSON/an object, no command string
CODE_UNKNOWN_COMMAND: Final = "unknown_command"
CODE_INVALID_ARGS: Final = "invalid_args"
CODE_PROTOCOL: Final = "protocol"  # hello with a protocol version this daemon does not speak
CODE_TOO_LARGE: Final = "too_large"  # a line over MAX_LINE_BYTES; the connection is closed
CODE_PERMISSION: Final = "permission"  # the peer is another user; the connection is closed
CODE_INTERNAL: Final = "internal"  # a bug in the daemon; logged with its traceback
# The protocol's own codes; every other code is an errors.ErrorCode (none share a name).
PROTOCOL_CODES: Final = frozenset(
    {
        CODE_INVALID_REQUEST,
        CODE_UNKNOWN_COMMAND,
        CODE_INVALID_ARGS,
        CODE_PROTOCOL,
        CODE_TOO_LARGE,
        CODE_PERMISSION,
        CODE_INTERNAL,
    }
)

_RESERVED_KEYS = frozenset({"command", "request_id"})
# Each command's arguments: name -> (type, required). Unknown arguments are refused, so a typo
# ("modle") is an error rather than a command applied to no model. A float argument takes any
# finite JSON number.
_ARGS: dict[str, dict[str, tuple[type, bool]]] = {
    "hello": {"protocol": (int, False)},
    "status": {},
    "subscribe": {},
    "unsubscribe": {},
    "events": {"since": (float, False), "after_seq": (int, False), "limit": (int, False)},
    **{name: {"model": (str, True)} for name in MODEL_COMMANDS},
    **{name: {} for name in COMMANDS - MODEL_COMMANDS},
}
CONTROL_COMMANDS: Final = tuple(sorted(_ARGS))
# The values an integer argument may take, by name (a seq is an SQLite integer).
_RANGES: Final = {"limit": (1, EVENTS_PAGE_MAX), "after_seq": (0, 2**63 - 1)}


class StoredEvent(Protocol):
    def to_json(self) -> dict[str, Any]:
        """The event object as stored, with its "seq"."""
        ...


class History(Protocol):
    """What answers `events`: the stored events at or after `since` (seconds since the epoch)
    with a seq above `after_seq`, oldest first, the first `limit` of them (`Journal.read` fits).
    It blocks on a file, so the server calls it in a thread."""

    def __call__(
        self, *, since: float | None, after_seq: int | None, limit: int
    ) -> Sequence[StoredEvent]: ...


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process that connected `sock` (unix(7) SO_PEERCRED: the credentials in
    effect at connect(2), kept by the kernel, so the peer cannot forge them)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _reply(request_id: object, data: dict[str, Any]) -> dict[str, Any]:
    return {"request_id": request_id, "error": "success", "data": data}


def _error(request_id: object, message: str, code: str) -> dict[str, Any]:
    return {"request_id": request_id, "error": message, "code": code}


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _type_name(kind: type) -> str:
    return {int: "an integer", str: "a string", float: "a number"}.get(kind, kind.__name__)


def _is_a(value: object, kind: type) -> bool:
    if isinstance(value, bool):  # bool is an int to Python, never to a client
        return False
    if kind is float:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, kind)


def _check_args(command: str, args: dict[str, Any]) -> str | None:
    """What is wrong with `args` for `command`, or None."""
    spec = _ARGS[command]
    unknown = sorted(set(args) - set(spec))
    if unknown:
        allowed = ", ".join(sorted(spec)) or "none"
        return f"{command}: unknown argument {unknown[0]!r} (arguments: {allowed})"
    for name, (kind, required) in spec.items():
        if name not in args:
            if required:
                return f"{command}: missing argument {name!r} ({_type_name(kind)})"
            continue
        value = args[name]
        if not _is_a(value, kind):
            return f"{command}: argument {name!r} must be {_type_name(kind)}, not {value!r}"
        if kind is str and not value:
            return f"{command}: argument {name!r} must not be empty"
        bounds = _RANGES.get(name)
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            low, high = bounds
            return f"{command}: argument {name!r} must be from {low} to {high}, not {value!r}"
    return None


@dataclass(frozen=True)
class Request:
    request_id: str | int | float | bool | None
    command: str
    args: dict[str, Any]


class RequestRefused(Exception):
    """A request line fell off the guard ladder; answered with `code`, never raised further."""

    def __init__(self, request_id: object, message: str, code: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code


def parse_request(line: bytes) -> Request:
    """The guard ladder: UTF-8 → JSON → object → request_id scalar → command string → known
    command → arguments → protocol version. RequestRefused says where it fell off."""
    try:
        message = decode(line)
    except ProtocolError as exc:
        raise RequestRefused(None, str(exc), CODE_INVALID_REQUEST) from None
    request_id = message.get("request_id")
    if not _is_scalar(request_id):
        raise RequestRefused(None, "request_id must be a JSON scalar", CODE_INVALID_REQUEST)
    command = message.get("command")
    if not isinstance(command, str):
        raise RequestRefused(request_id, "command must be a string", CODE_INVALID_REQUEST)
    if command not in _ARGS:
        known = ", ".join(CONTROL_COMMANDS)
        raise RequestRefused(
            request_id, f"unknown command {command!r} (commands: {known})", CODE_UNKNOWN_COMMAND
        )
    args = {k: v for k, v in message.items() if k not in _RESERVED_KEYS}
    problem = _check_args(command, args)
    if problem is not None:
        raise RequestRefused(request_id, problem, CODE_INVALID_ARGS)
    if command == "hello" and args.get("protocol", CONTROL_PROTOCOL) != CONTROL_PROTOCOL:
        raise RequestRefused(
            request_id,
            f"protocol {args['protocol']} is not supported "
            f"(this arbiterd speaks protocol {CONTROL_PROTOCOL})",
            CODE_PROTOCOL,
        )
    return Request(request_id, command, args)


class ControlServer:
    """Serves the control protocol for `service` on the Unix socket `path`; `history` answers
    `events`."""

    def __init__(self, service: Service, path: Path, *, history: History) -> None:
        self.service = service
        self.path = path
        self.history = history
        self._server: asyncio.Server | None = None
        self._inode: tuple[int, int] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._closed = False
        self._closing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen. DaemonError if the directory is unsafe or another daemon listens on `path`."""
        if self._server is not None or self._closed:
            raise DaemonError("a ControlServer starts once")
        # Anyone who can write the folder could replace the socket with their own and read
        # our commands.
        ensure_private_dir(self.path.parent, DaemonError)
        live = f"another arbiterd is already running on {self.path}"
        await asyncio.to_thread(socketfile.clear_stale, self.path, DaemonError, live)
        sock, self._inode = socketfile.bind(self.path, SOCKET_MODE, DaemonError, live)
        try:
            sock.setblocking(False)
            self._server = await asyncio.start_unix_server(
                self._on_connect, sock=sock, limit=MAX_LINE_BYTES, backlog=LISTEN_BACKLOG
            )
        except BaseException:
            sock.close()
            socketfile.unlink_own(self.path, self._inode)
            raise
        log.info("control socket listening on %s", self.path)

    async def close(self) -> None:
        """Stop listening, drop every connection and remove the socket file (if still ours).

        Shielded, so it completes even when called from a command it cancels; but then that
        command's reply is lost: a `shutdown` command should schedule the close and return."""
        if self._closing is None:
            self._closing = asyncio.create_task(self._close(), name="control-close")
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._closed = True
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
        socketfile.unlink_own(self.path, self._inode)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closed:  # accepted in the same loop turn as close()
            writer.transport.abort()
            return
        # close() cancels this inner task, never the one asyncio runs this callback in: asyncio
        # 3.11 logs "Exception in callback" for a connection task that ends cancelled.
        task = asyncio.create_task(
            _Connection(self.service, self.history, reader, writer).serve(),
            name="control-connection",
        )
        self._connections.add(task)
        try:
            await asyncio.gather(task, return_exceptions=True)
        finally:
            self._connections.discard(task)


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    """Cancel `tasks` and wait until they have ended, whatever they ended with."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Connection:
    """One client: a reader task answering requests in order, a writer task draining the
    outbox, and, while subscribed, a pump moving the service's events into the outbox."""

    def __init__(
        self,
        service: Service,
        history: History,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self._service = service
        self._history = history
        self._reader = reader
        self._writer = writer
        # None asks the writer task to stop once everything before it is written.
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=OUTBOX_MAX_LINES)
        self._events: asyncio.Queue[dict[str, Any]] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._overflowed = asyncio.Event()

    async def serve(self) -> None:
        try:
            uid = peer_uid(self._writer.get_extra_info("socket"))
            if uid != os.getuid():
                log.warning("control: refused a connection from uid %d", uid)
                self._writer.write(encode(_error(None, "permission denied", CODE_PERMISSION)))
                await self._finish()
                return
            await self._run()
        except asyncio.CancelledError:
            self._writer.transport.abort()
            raise
        except Exception:
            log.exception("control: connection failed")
            self._writer.transport.abort()
        finally:
            await self._stop_events()

    async def _run(self) -> None:
        writing = asyncio.create_task(self._write_loop(), name="control-writer")
        reading = asyncio.create_task(self._read_loop(), name="control-reader")
        overflow = asyncio.create_task(self._overflowed.wait(), name="control-overflow")
        try:
            await asyncio.wait({reading, writing, overflow}, return_when=asyncio.FIRST_COMPLETED)
            await _cancel(reading, overflow)
            await self._stop_events()
            failure = None if reading.cancelled() else reading.exception()
            if failure is not None:
                raise failure
            if self._overflowed.is_set():
                await _cancel(writing)
                log.warning("control: dropped a subscriber that did not keep up with events")
                self._writer.write(encode({"event": "overflow", "at": time.time()}))
                await self._finish(OVERFLOW_GRACE_S)
            elif not writing.done():
                # The reader ended (EOF, an oversize line, a refused hello): send what is queued.
                try:
                    async with asyncio.timeout(LINGER_S):
                        await self._outbox.put(None)
                        await writing
                except TimeoutError:
                    self._writer.transport.abort()
                else:
                    await self._finish()
            else:
                # The writer ended first: the peer is gone.
                self._writer.transport.abort()
        finally:
            # Also when cancelled (the server is closing) at any await above: no task outlives
            # its connection.
            await _cancel(reading, writing, overflow)
            await self._stop_events()

    async def _write_loop(self) -> None:
        while (line := await self._outbox.get()) is not None:
            self._writer.write(line)
            try:
                await self._writer.drain()
            except OSError:
                return  # the peer is gone

    async def _finish(self, linger_s: float = LINGER_S) -> None:
        """Close after the last line: shut down our side for writing, then discard input until
        the peer closes (bounded by `linger_s`), so the peer reads every line and then EOF."""
        transport = self._writer.transport
        try:
            async with asyncio.timeout(linger_s):
                if self._writer.can_write_eof():
                    self._writer.write_eof()  # sent once the buffered lines are
                while await self._reader.read(DISCARD_BYTES):
                    pass
                transport.close()  # flushes what is still buffered, then closes
                await self._writer.wait_closed()
        except (TimeoutError, OSError):
            transport.abort()

    async def _send(self, message: dict[str, Any]) -> None:
        try:
            line = encode(message)
        except (TypeError, ValueError) as exc:
            log.error("control: cannot encode a reply %r: %s", message, exc)
            line = encode(
                _error(message.get("request_id"), f"reply is not JSON: {exc}", CODE_INTERNAL)
            )
        await self._outbox.put(line)

    async def _read_loop(self) -> None:
        while True:
            try:
                line = await self._reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                # EOF; a last line without its newline is still a request.
                if exc.partial.strip():
                    await self._handle(exc.partial)
                return
            except (asyncio.LimitOverrunError, ValueError):
                log.info("control: closing a connection that sent a line over the limit")
                await self._send(
                    _error(None, f"line exceeds {MAX_LINE_BYTES} bytes", CODE_TOO_LARGE)
                )
                return
            except ConnectionError:
                return
            if not await self._handle(line):
                return

    async def _handle(self, line: bytes) -> bool:
        """Answer one request line; False when the connection must close after the answer."""
        if not line.strip():
            return True  # blank lines are allowed, as in mpv, for typing at a socat prompt
        try:
            request = parse_request(line)
        except RequestRefused as refused:
            log.info("control: refused a request (%s): %s", refused.code, refused)
            await self._send(_error(refused.request_id, str(refused), refused.code))
            return refused.code != CODE_PROTOCOL
        try:
            data = await self._dispatch(request.command, request.args)
        except ArbiterError as exc:
            await self._send(_error(request.request_id, str(exc), exc.code.value))
        except Exception as exc:
            log.exception("control: %s failed", request.command)
            message = str(exc) or type(exc).__name__
            await self._send(_error(request.request_id, message, CODE_INTERNAL))
        else:
            await self._send(_reply(request.request_id, data))
            if self._events is not None and self._pump is None:
                # Started only once the reply is queued, so events follow it; the service's
                # queue holds those that came meanwhile.
                self._pump = asyncio.create_task(
                    self._pump_events(self._events), name="control-events"
                )
        return True

    async def _dispatch(self, command: str, args: dict[str, Any]) -> dict[str, Any]:
        if command == "hello":
            return {
                "protocol": CONTROL_PROTOCOL,
                "server": SERVER_NAME,
                "version": arbiterd.__version__,
                "commands": list(CONTROL_COMMANDS),
            }
        if command == "status":
            return await self._service.status()
        if command == "subscribe":
            if self._events is None:
                self._events = self._service.subscribe()
            return {"subscribed": True}
        if command == "unsubscribe":
            await self._stop_events()
            return {"subscribed": False}
        if command == "events":
            return await self._history_page(args)
        return await self._service.command(command, args.get("model"))

    async def _history_page(self, args: dict[str, Any]) -> dict[str, Any]:
        limit: int = args.get("limit", EVENTS_PAGE_MAX)
        since = args.get("since")
        # One more than asked for: whether more follow is then known, not guessed.
        stored = await asyncio.to_thread(
            self._history,
            since=None if since is None else float(since),
            after_seq=args.get("after_seq"),
            limit=limit + 1,
        )
        return {
            "events": [event.to_json() for event in stored[:limit]],
            "more": len(stored) > limit,
        }

    async def _stop_events(self) -> None:
        pump, self._pump = self._pump, None
        events, self._events = self._events, None
        if events is not None:
            self._service.unsubscribe(events)
        if pump is not None:
            await _cancel(pump)

    async def _pump_events(self, events: asyncio.Queue[dict[str, Any]]) -> None:
        while True:
            event = await events.get()
            if events.maxsize and events.qsize() + 1 >= events.maxsize:
                # It was full: a service skips a subscriber whose queue is full
                # (supervisor._publish), so events may be lost, and the client must not go on as
                # if it had seen every one.
                self._overflowed.set()
                return
            try:
                line = encode(event)
            except (TypeError, ValueError) as exc:
                log.error("control: cannot encode event %r: %s", event, exc)
                continue
            try:
                self._outbox.put_nowait(line)
            except asyncio.QueueFull:
                self._overflowed.set()
                return


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
