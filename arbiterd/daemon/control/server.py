"""The control socket's server: the control protocol (arbiterd.control) on the daemon's loop.

Owns the socket file and its directory and every connection. It asks the daemon only what
`arbiterd.daemon.service.Service` offers, and answers `events` from the `History` it is given
(the journal's query), and `devices` from the status's engine and the RPC servers it is given
(arbiterd.daemon.control.devicelist); it never blocks the event loop: every connection has its own
bounded outbox, a subscriber that cannot keep up is dropped rather than waited for, and the
history is read, and RPC servers probed, in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final, Protocol

import arbiterd
from arbiterd import render
from arbiterd.control import (
    CODE_INTERNAL,
    CODE_PERMISSION,
    CODE_PROTOCOL,
    CODE_TOO_LARGE,
    CONTROL_COMMANDS,
    CONTROL_PROTOCOL,
    EVENTS_PAGE_MAX,
    MAX_LINE_BYTES,
    SERVER_NAME,
    Request,
    RequestRefused,
    parse_request,
)
from arbiterd.daemon import socketfile
from arbiterd.daemon.control.devicelist import list_devices
from arbiterd.daemon.service import Service
from arbiterd.errors import (
    ArbiterError,
    ControlError,
    DaemonError,
)
from arbiterd.paths import ensure_private_dir
from arbiterd.procs import WaitNews
from arbiterd.states import ControlCommand
from arbiterd.wire import encode

log = logging.getLogger(__name__)

SOCKET_MODE: Final = 0o600
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
DISCARD_BYTES: Final = 65536


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


def _no_servers() -> Sequence[str]:
    return ()


class ControlServer:
    """Serves the control protocol for `service` on the Unix socket `path`; `history` answers
    `events`, `rpc_servers` says which RPC servers `devices` asks (the config's
    `[daemon] rpc_servers` as it is now: a reload may change it)."""

    def __init__(
        self,
        service: Service,
        path: Path,
        *,
        history: History,
        rpc_servers: Callable[[], Sequence[str]] = _no_servers,
    ) -> None:
        self.service = service
        self.path = path
        self.history = history
        self.rpc_servers = rpc_servers
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
            _Connection(self.service, self.history, self.rpc_servers, reader, writer).serve(),
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
        rpc_servers: Callable[[], Sequence[str]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self._service = service
        self._history = history
        self._rpc_servers = rpc_servers
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
            data = await self._dispatch(request)
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

    async def _dispatch(self, request: Request) -> dict[str, Any]:  # noqa: PLR0911 (one per command)
        command, args = request.command, request.args
        if command is ControlCommand.HELLO:
            return {
                "protocol": CONTROL_PROTOCOL,
                "server": SERVER_NAME,
                "version": arbiterd.__version__,
                "commands": list(CONTROL_COMMANDS),
            }
        if command is ControlCommand.STATUS:
            return (await self._service.status()).to_json()  # the one place status is written
        if command is ControlCommand.DEVICES:
            return await self._devices()
        if command is ControlCommand.SUBSCRIBE:
            if self._events is None:
                self._events = self._service.subscribe()
            return {"subscribed": True}
        if command is ControlCommand.UNSUBSCRIBE:
            await self._stop_events()
            return {"subscribed": False}
        if command is ControlCommand.EVENTS:
            return await self._history_page(args)
        on_news = None
        if args.get("progress"):

            def on_news(news: WaitNews) -> None:
                # A client that asked for progress waits for nothing else: once it has gone (a
                # CLI's Ctrl-C), the wait it asked for is withdrawn, not left to happen later.
                if self._reader.at_eof() or self._writer.is_closing():
                    raise ControlError(f"the client gave up its {command} while it waited")
                progress = {"model": args["model"], **news.to_json()}
                self._tell({"request_id": request.request_id, "progress": progress})

        return await self._service.command(command, args.get("model"), on_news, pid=args.get("pid"))

    async def _devices(self) -> dict[str, Any]:
        """The `devices` reply: the engine's devices as the status has them (what the latest
        worker's hello listed), gpu0's arena as the status names it, and the RPC servers."""
        status = await self._service.status()
        if not status.arena:  # a relative path would put the arenas in the daemon's cwd
            raise ControlError("the daemon's status names no arena: no device can be listed")
        labels = () if status.engine is None else status.engine.devices
        listed = await list_devices(labels, Path(status.arena), self._rpc_servers())
        leases = {
            lease.device: render.lease(lease.state, lease.lender, lease.by, lease.reason)
            for lease in status.leases
        }
        listed = [replace(d, lease=leases[d.id]) if d.id in leases else d for d in listed]
        return {"devices": [device.to_json() for device in listed]}

    def _tell(self, message: dict[str, Any]) -> None:
        """Queue a progress line: news, so a client too slow to take it misses it rather than
        holding up the reply."""
        with contextlib.suppress(asyncio.QueueFull):
            self._outbox.put_nowait(encode(message))

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
