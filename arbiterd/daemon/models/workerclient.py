"""The daemon's side of a worker: spawns the process, talks its protocol, reaps it.

`WorkerClient` lives on the daemon's asyncio loop: one reader task routes every message —
replies and chunks to the request waiting on that id, events to the `on_event` callback — and
the process's exit is awaited, not watched by a thread (`spawn` installs a pidfd child watcher,
see `use_pidfd_child_watcher`). The worker's hello, read into a `WorkerHello`, says what runs the
model: its residency backend and what the engine can do. A generate op's result and a status
are read into their records (arbiterd/reply.py's WorkerResult and WorkerStatus); a generate
whose asker gave up still hands its late result to the `on_end` it was given, so the router
publishes the cancelled request's end (its one `request` event).

It also keeps what the daemon last heard of the worker's life (issue 24): its last status and
when it came, the engine thread's last beat (from that status's `beat_age_s`, or any event or
chunk, which only the engine thread sends), and the status question still unanswered. One
status question is in flight at a time, whoever asks: a worker that stopped reading gets one
line, not one per `arbiterd status`. `heard` is what daemon/models/liveness.py judges.

A worker's stderr is a pipe the client reads (issue 25): every line goes on to the daemon's
stderr as before (its log), and the last few are kept as the worker's last words, so an exit
names its reason — ggml's GGML_ASSERT message, glibc's "corrupted double-linked list", a Python
traceback — in the log and in the `worker` event, not just a signal number.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from arbiterd.daemon.models.liveness import Heard
from arbiterd.errors import ProtocolError, WorkerError, WorkerGoneError, error_from_wire
from arbiterd.reply import EngineReport, WorkerResult, WorkerStatus
from arbiterd.request import GenerateRequest
from arbiterd.spec import WORKER_PROTOCOL, WorkerConfig
from arbiterd.states import BackendKind, WorkerOp
from arbiterd.wire import AsyncLineReader, encode

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 30.0
STATUS_TIMEOUT_S = 10.0  # a worker answers status from its io thread, even mid-decode
# How many of the requests lately cancelled are remembered, to drop their late error replies.
CANCELLED_KEPT = 256
# What a worker's exit keeps of its stderr: its last lines, each cut to a length, and how long
# the client waits for the pipe's end once the process is gone (a child it left holding the pipe
# must not hold up its restart).
LAST_WORDS_LINES = 8
LAST_WORDS_LINE_CHARS = 300
STDERR_DRAIN_S = 1.0
# The residency backends a worker may name (arbiterd/worker/engine's Backend.kind).
BACKENDS = frozenset(kind for kind in BackendKind if kind is not BackendKind.UNKNOWN)

EventListener = Callable[[dict[str, Any]], None]
ChunkListener = Callable[[dict[str, Any]], None]
# Told each generate's result, also the one that comes after its asker gave up (a client that
# went away: its request ends cancelled, and that end is still the request's news).
EndListener = Callable[[WorkerResult], None]


@dataclass(frozen=True)
class WorkerHello:
    """A worker's first line (the protocol in arbiterd/worker/loop.py's docstring)."""

    protocol: int
    model: str
    pid: int
    backend: BackendKind  # one of BACKENDS
    fallback_reason: str  # "" for in-place; else why in-place was not available
    engine: EngineReport

    @classmethod
    def read(cls, raw: object) -> WorkerHello:
        """Check the hello field by field; the first problem is a ProtocolError that names it."""
        if not isinstance(raw, Mapping):
            raise ProtocolError(f"hello is not an object: {raw!r}")
        protocol = raw.get("protocol")
        if protocol != WORKER_PROTOCOL:
            raise ProtocolError(f"worker speaks protocol {protocol}, not {WORKER_PROTOCOL}")
        model, pid = raw.get("model"), raw.get("pid")
        if not isinstance(model, str) or isinstance(pid, bool) or not isinstance(pid, int):
            raise ProtocolError(f"hello: model and pid must be a string and an integer: {raw}")
        backend, reason = raw.get("backend"), raw.get("fallback_reason")
        if backend not in BACKENDS:
            raise ProtocolError(f"hello: unknown backend {backend!r}")
        if not isinstance(reason, str):
            raise ProtocolError(f"hello: fallback_reason is not a string: {reason!r}")
        engine = EngineReport.read(raw.get("engine"))
        return cls(protocol, model, pid, BackendKind(backend), reason, engine)


class _PidfdChildWatcher(asyncio.AbstractChildWatcher):
    """Learns of a child's exit through its pidfd, on the loop that started the child, as
    Python 3.12's own watcher does (3.11's default waits in one thread per child, and its
    PidfdChildWatcher serves a single loop)."""

    def __init__(self) -> None:
        self._children: dict[int, tuple[asyncio.AbstractEventLoop, int]] = {}

    def add_child_handler(  # type: ignore[override]  # typeshed's TypeVarTuple form
        self, pid: int, callback: Callable[..., object], *args: Any
    ) -> None:
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(pid)
        self._children[pid] = loop, pidfd
        loop.add_reader(pidfd, self._reap, pid, callback, args)

    def remove_child_handler(self, pid: int) -> bool:
        child = self._children.pop(pid, None)
        if child is None:
            return False
        loop, pidfd = child
        loop.remove_reader(pidfd)
        os.close(pidfd)
        return True

    def _reap(self, pid: int, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.remove_child_handler(pid)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:  # reaped elsewhere: its status is lost
            code = 255
        else:
            code = os.waitstatus_to_exitcode(status)
        callback(pid, code, *args)

    def attach_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        pass  # every child is watched on the loop that started it

    def close(self) -> None:
        for pid in list(self._children):
            self.remove_child_handler(pid)

    def is_active(self) -> bool:
        return True

    def __enter__(self) -> _PidfdChildWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def use_pidfd_child_watcher() -> None:
    """Have asyncio learn of child exits through pidfds, on the loop that started each child,
    instead of Python 3.11's default of one waiting thread per child (3.12 does this itself)."""
    if sys.version_info >= (3, 12):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if not isinstance(asyncio.get_event_loop_policy().get_child_watcher(), _PidfdChildWatcher):
            asyncio.set_child_watcher(_PidfdChildWatcher())


class WorkerClient:
    """A running worker, driven from the asyncio loop it was spawned on. Create with `spawn`;
    always `shutdown` or `kill` it."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        model: str,
        on_event: EventListener | None,
    ) -> None:
        self.process = process
        self.model = model
        self._lines = AsyncLineReader(reader)
        self._writer = writer
        self._on_event = on_event
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        # The requests we cancelled lately: the error each answers with is nobody's news.
        self._cancelled: collections.deque[str] = collections.deque(maxlen=CANCELLED_KEPT)
        self._hello: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.hello: WorkerHello | None = None  # set by `spawn` once the worker said it
        # What the daemon last heard of its life; nothing yet but that it was just started.
        self.heard = Heard.started(time.monotonic())
        self._asking: asyncio.Task[WorkerStatus] | None = None  # the status question in flight
        # The generate requests whose asker gave up (cancelled): who is told their late result.
        self._late: collections.OrderedDict[str, EndListener] = collections.OrderedDict()
        self.killed_for = ""  # why the daemon killed it (`kill_for`); "" when it did not
        self._reader = asyncio.get_running_loop().create_task(
            self._read_loop(), name=f"worker-client-{model}"
        )
        self._words: collections.deque[str] = collections.deque(maxlen=LAST_WORDS_LINES)
        self._stderr = asyncio.get_running_loop().create_task(
            self._read_stderr(), name=f"worker-stderr-{model}"
        )

    @classmethod
    async def spawn(
        cls,
        config: WorkerConfig,
        *,
        env: dict[str, str] | None = None,
        on_event: EventListener | None = None,
    ) -> WorkerClient:
        """Start a worker and wait for its hello (the model may still be loading then). A
        worker that exits first is a WorkerError at once; one whose hello is not ours is killed
        (ProtocolError)."""
        # Here, not left to the daemon's setup: whoever spawns a worker learns of its exit on
        # the loop, never through a waiting thread per worker (Python 3.11's default).
        use_pidfd_child_watcher()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The host copy keeps its number in the child (pass_fds), where the spec names it.
        shared = [] if config.spec.host_copy_fd is None else [config.spec.host_copy_fd]
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "arbiterd.worker",
                "--fd",
                str(theirs.fileno()),
                "--config",
                config.to_json(),
                pass_fds=[theirs.fileno(), *shared],
                env=env,
                stderr=asyncio.subprocess.PIPE,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
        except BaseException:
            ours.close()
            process.kill()
            await process.wait()
            raise
        worker = cls(process, reader, writer, config.spec.name, on_event)
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                said = await asyncio.shield(worker._hello)
            worker.hello = WorkerHello.read(said)
        except TimeoutError:
            worker._hello.cancel()
            await worker.kill()
            raise WorkerError(f"worker for {config.spec.name} did not say hello") from None
        except WorkerGoneError:
            code = await worker.kill()
            said = await worker.last_words()
            raise WorkerError(
                f"worker for {config.spec.name} exited ({code}) before its hello"
                + (f": {said[-1]}" if said else "")
            ) from None
        except BaseException:
            await worker.kill()
            raise
        return worker

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    # -- requests -----------------------------------------------------------------------------

    async def request(
        self, op: str, *, timeout_s: float | None = 60.0, **fields: Any
    ) -> dict[str, Any]:
        """Send one op and wait for its result (chunks and a generate's "started", if any,
        are ignored). Cancelled (its asker gave up: a CLI's Ctrl-C), it is cancelled in the
        worker too: a warm leaves the queue for the GPU."""
        async with self._open() as (request_id, replies):
            self._send({"op": op, "id": request_id, **fields})
            try:
                while True:
                    message = await self._next(replies, f"its {op}", timeout_s)
                    if "chunk" not in message and "started" not in message:
                        return _result(message)
            except asyncio.CancelledError:
                self.cancel(request_id)
                raise

    async def generate(
        self,
        request: GenerateRequest,
        *,
        on_chunk: ChunkListener | None = None,
        timeout_s: float | None = 600.0,
        request_id: str | None = None,
        on_end: EndListener | None = None,
    ) -> WorkerResult:
        """Run one request; with `on_chunk` (called on the loop), it streams. Returns the
        worker's result; WorkerGoneError when the worker was gone before it started the request
        (its engine thread's "started" reply: nothing of it ran, no chunk was sent), WorkerError
        when it went after. Cancelled, it leaves `on_end` to be told the result that still
        comes (the worker ends the request cancelled once it is told, `cancel`)."""
        async with self._open(request_id) as (opened, replies):
            self._send(
                {
                    "op": WorkerOp.GENERATE,
                    "id": opened,
                    "request": request.to_json(),
                    "stream": on_chunk is not None,
                }
            )
            started = False
            try:
                while True:
                    message = await self._next(replies, "a request", timeout_s, started=started)
                    if "started" in message:
                        started = True
                        continue
                    if "chunk" in message:
                        if on_chunk is not None:
                            on_chunk(message["chunk"])
                        continue
                    return WorkerResult.from_json(_result(message))
            except asyncio.CancelledError:
                if on_end is not None:
                    self._late[opened] = on_end
                    while len(self._late) > CANCELLED_KEPT:
                        self._late.popitem(last=False)
                raise

    def cancel(self, target: str) -> None:
        """Ask the worker to stop request `target`; a gone worker has stopped it already."""
        with contextlib.suppress(WorkerGoneError):
            self._send({"op": WorkerOp.CANCEL, "id": f"cancel-{next(self._ids)}", "target": target})
            self._cancelled.append(target)

    async def status(self, timeout_s: float | None = STATUS_TIMEOUT_S) -> WorkerStatus:
        """The worker's status, from its io thread (also mid-decode). Joins the question in
        flight, if there is one; WorkerError after `timeout_s`, the question still asked (its
        answer, when it comes, is what `heard` holds)."""
        asking = self.ask()
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(asking)
        except TimeoutError:
            raise WorkerError(f"no answer from {self.model} to status in {timeout_s} s") from None

    def ask(self) -> asyncio.Task[WorkerStatus]:
        """The status question in flight, asked now if there is none."""
        if self._asking is None:
            self.heard = self.heard.asked(time.monotonic())
            self._asking = asyncio.get_running_loop().create_task(
                self._ask(), name=f"worker-status-{self.model}"
            )
            self._asking.add_done_callback(self._answered)
        return self._asking

    async def _ask(self) -> WorkerStatus:
        status = WorkerStatus.from_json(await self.request(WorkerOp.STATUS, timeout_s=None))
        self.heard = self.heard.answered(status, time.monotonic())
        return status

    def _answered(self, asked: asyncio.Task[WorkerStatus]) -> None:
        self._asking = None
        if not asked.cancelled():
            asked.exception()  # a gone worker's: said to whoever waited; retrieved here

    # -- lifetime -----------------------------------------------------------------------------

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int:
        """Ask the worker to stop (in-flight work finishes), wait, and reap it; a worker that
        is already gone is just reaped."""
        with contextlib.suppress(WorkerGoneError):
            self._send({"op": WorkerOp.SHUTDOWN, "id": "shutdown"})
        try:
            async with asyncio.timeout(timeout_s):
                await self.process.wait()
        except TimeoutError:
            return await self.kill()
        await self._close()
        return self._code()

    def kill_for(self, reason: str) -> None:
        """SIGKILL the worker now for `reason`, which the requests it had are told (and
        `killed_for` keeps); whoever awaits its exit reaps it."""
        if self.process.returncode is not None or self.killed_for:
            return
        self.killed_for = reason  # before the signal: the reader sees the socket close after
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def kill(self) -> int:
        """SIGKILL the worker (unless it is gone already) and reap it."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()
        await self._close()
        return self._code()

    async def wait(self) -> int:
        """The worker's exit status, once it has exited (negative: killed by that signal)."""
        await self.process.wait()
        return self._code()

    async def last_words(self) -> tuple[str, ...]:
        """The last lines the worker wrote to its stderr, once the pipe has ended (or
        STDERR_DRAIN_S after this is asked, for a pipe a child of the worker still holds)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STDERR_DRAIN_S):
                await asyncio.shield(self._stderr)
        return tuple(self._words)

    # -- plumbing -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _open(
        self, request_id: str | None = None
    ) -> AsyncIterator[tuple[str, asyncio.Queue[dict[str, Any]]]]:
        request_id = request_id or f"r{next(self._ids)}"
        replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._pending[request_id] = replies
        try:
            yield request_id, replies
        finally:
            self._pending.pop(request_id, None)

    def _send(self, message: dict[str, Any]) -> None:
        """Queue one line for the worker (the loop writes it; a worker that stopped reading
        blocks nothing but its own socket buffer)."""
        if self._writer.is_closing() or self._reader.done():
            raise WorkerGoneError(f"worker for {self.model} is gone")
        if message.get("op") != WorkerOp.STATUS:
            # Last words are what it wrote since it was last given work (status questions come
            # every few seconds and are no work): not the start-up lines of its engine.
            self._words.clear()
        self._writer.write(encode(message))

    async def _next(
        self,
        replies: asyncio.Queue[dict[str, Any]],
        what: str,
        timeout_s: float | None,
        *,
        started: bool = True,
    ) -> dict[str, Any]:
        """The next reply to the exchange that `what` names in words (a user reads it; the
        request id is the wire's own). A worker gone meanwhile is a WorkerError, or, while the
        exchange is not `started` (a request still in the worker's queue), a WorkerGoneError:
        it may go to the next worker."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel that comes
            # as the awaited message does, and a client's hang-up would then not stop its decode.
            async with asyncio.timeout(timeout_s):
                message = await replies.get()
        except TimeoutError:
            raise WorkerError(
                f"{self.model} did not answer {what} within {timeout_s:g} s"
            ) from None
        if message.get("gone"):
            why = await self._why_gone()
            if not started:
                raise WorkerGoneError(f"worker for {self.model} exited before {what} began{why}")
            raise WorkerError(f"worker for {self.model} exited during {what}{why}")
        return message

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    message = await self._lines.read()
                except ProtocolError as exc:
                    self._refused(exc)
                    continue
                except OSError:
                    message = None
                if message is None:
                    return
                self._route(message)
        finally:
            for replies in self._pending.values():
                replies.put_nowait({"gone": True})
            if not self._hello.done():  # a worker that died before its hello: spawn stops
                self._hello.set_exception(WorkerGoneError(f"worker for {self.model} is gone"))

    def _route(self, message: dict[str, Any]) -> None:
        if "event" in message or "chunk" in message or "started" in message:
            # Only the engine thread sends these.
            self.heard = self.heard.beat(time.monotonic())
        if "hello" in message:
            if not self._hello.done():
                self._hello.set_result(message["hello"])
        elif "event" in message:
            if self._on_event is not None:
                self._on_event(message)
        else:
            request_id = message.get("id")
            replies = self._pending.get(request_id) if isinstance(request_id, str) else None
            if replies is not None:
                replies.put_nowait(message)
            elif isinstance(request_id, str) and request_id in self._late:
                self._ended_late(request_id, message)
            elif "error" in message and request_id not in self._cancelled:
                # e.g. a line of ours it could not read and name
                log.warning("%s: an error for no request waiting: %s", self.model, message["error"])

    def _ended_late(self, request_id: str, message: dict[str, Any]) -> None:
        """A reply to a generate request whose asker gave up: its result goes to the listener
        it left; its chunks are nobody's, and an error it ends with is the cancel's own."""
        if "chunk" in message or "started" in message:
            return
        on_end = self._late.pop(request_id)
        result = message.get("result")
        if isinstance(result, dict):
            on_end(WorkerResult.from_json(result))

    def _refused(self, error: ProtocolError) -> None:
        """A line of the worker's that cannot be read fails the request it names at once (a
        reply that never comes would keep it waiting for its timeout); one that names none
        is logged."""
        replies = self._pending.get(error.request_id) if error.request_id else None
        if replies is not None:
            replies.put_nowait({"id": error.request_id, "error": error.to_wire()})
        else:
            log.warning("%s sent a line that cannot be read: %s", self.model, error)

    async def _close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self.last_words()
        self._stderr.cancel()
        await asyncio.gather(self._stderr, return_exceptions=True)

    async def _why_gone(self) -> str:
        """Why a worker whose socket closed is gone, for the requests it had: the daemon's own
        kill, else its exit status and its last words (waited for up to STDERR_DRAIN_S: the
        socket closes as the process dies, a moment before it can be reaped)."""
        if self.killed_for:
            return f": {self.killed_for}"
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STDERR_DRAIN_S):
                await self.process.wait()
        code = self.process.returncode
        if code is None:
            return ""
        why = f": killed by signal {-code}" if code < 0 else f": exited with code {code}"
        words = await self.last_words()
        return f"{why}; its last words: {words[-1]}" if words else why

    async def _read_stderr(self) -> None:
        """Pass each line of the worker's stderr on to the daemon's and keep the last ones."""
        stream = self.process.stderr
        assert stream is not None  # spawned with stderr=PIPE
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line beyond the stream's limit: its start was dropped
                continue
            if not line:
                return
            with contextlib.suppress(OSError):  # the daemon's stderr closed
                os.write(2, line)  # where the worker wrote before it had a pipe of its own
            text = line.decode(errors="replace").rstrip()
            if text:
                self._words.append(text[:LAST_WORDS_LINE_CHARS])

    def _code(self) -> int:
        code = self.process.returncode
        assert code is not None  # called once the process was awaited
        return code


def _result(message: dict[str, Any]) -> dict[str, Any]:
    if "error" in message:
        raise error_from_wire(message["error"])
    result = message.get("result")
    if not isinstance(result, dict):
        raise ProtocolError(f"reply without a result: {message}")
    return result
