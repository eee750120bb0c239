"""The worker's io side: the io thread that reads the daemon's socket, and the inbox it fills.

Owns the socket's reading end, the commands queued for the engine thread (and the one it took
out of turn and kept for later, `deferred`), the requests the daemon cancelled, and the events
that stop the worker. The io thread answers `status` and `cancel` at once, also during a decode
(ctypes releases the GIL in llama_decode), and queues every other op for the engine thread
(worker/loop.py), ringing its doorbell; it never touches the model, the residency or the token.
What it may touch of the engine thread's is only what this class marks as shared: the cancelled
set (behind its lock) and threading.Events.

When the daemon's end closes, nobody reads our answers: the worker stops (`orphaned`), the
current request cancelled before its next decode.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from arbiterd.arena.doorbell import Doorbell
from arbiterd.errors import ProtocolError
from arbiterd.states import RequestKind, WorkerOp
from arbiterd.wire import LineReader, LineWriter


@dataclass(frozen=True)
class Command:
    """A message the engine thread must act on."""

    op: WorkerOp
    id: str
    # A generate op's GenerateRequest as the wire carried it: read in the engine thread, where
    # a malformed one fails its request.
    request: object = None
    stream: bool = False

    @property
    def runs_alone(self) -> bool:
        """A generate op whose request runs with no other beside it (`Prepared.alone`): images,
        or embeddings. Read from the wire as the engine thread will read it (a malformed one
        joins, and fails when it is read)."""
        raw = self.request
        if not isinstance(raw, dict):
            return False
        return raw.get("kind") == RequestKind.EMBEDDING.value or bool(raw.get("images"))


class Inbox:
    """The commands for the engine thread, filled by the io thread (`serve`)."""

    def __init__(
        self,
        reader: LineReader,
        out: LineWriter,
        doorbell: Doorbell,
        status: Callable[[], dict[str, Any]],
    ) -> None:
        """`status`: the status the io thread answers with, as the engine thread last
        published it (with the figures read at the moment of asking), in its wire form
        (reply.WorkerStatus's)."""
        self._reader = reader
        self._out = out
        self._doorbell = doorbell  # the engine thread's sleep while warm and idle
        self._status = status
        self._queue: queue.Queue[Command] = queue.Queue()
        # A command taken during a batch that is not for it: served right after (engine thread).
        self._deferred: Command | None = None
        # Written by the io thread, read by the engine thread: sets and Events only.
        self._cancelled: set[str] = set()
        self._cancel_lock = threading.Lock()
        self.wake = threading.Event()  # interrupts a wait for the token
        self.stopping = threading.Event()
        self.orphaned = threading.Event()  # the daemon is gone: nobody reads our answers

    # -- io thread ----------------------------------------------------------------------------

    def serve(self) -> None:
        """The io thread: read and dispatch every message until the daemon's end closes."""
        while True:
            try:
                message = self._reader.read()
            except ProtocolError as exc:  # answered to its request, when its id could be read
                self._out.send({"id": exc.request_id, "error": exc.to_wire()})
                continue
            except OSError:
                message = None
            if message is None:  # the daemon is gone: stop, whatever is queued or running
                self.orphaned.set()
                self.request_stop()
                return
            self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        raw_op, request_id = message.get("op"), message.get("id")
        op = WorkerOp(raw_op) if isinstance(raw_op, str) else WorkerOp.UNKNOWN
        if not isinstance(request_id, str) or op is WorkerOp.UNKNOWN:
            readable = request_id if isinstance(request_id, str) else None
            problem = (
                f"bad op {raw_op!r}"
                if op is WorkerOp.UNKNOWN
                else f"a {op} message without a string id"
            )
            self._out.send({"id": readable, "error": ProtocolError(problem).to_wire()})
            return
        if op is WorkerOp.STATUS:
            self._out.send({"id": request_id, "result": self._status()})
        elif op is WorkerOp.CANCEL:
            target = message.get("target")
            with self._cancel_lock:
                self._cancelled.add(str(target))
            self.wake.set()
            self._out.send({"id": request_id, "result": {"cancelled": target}})
        elif op is WorkerOp.SHUTDOWN:
            self.request_stop()
        else:
            self._queue.put(
                Command(
                    op,
                    request_id,
                    request=message.get("request"),
                    stream=bool(message.get("stream")),
                )
            )
            self._doorbell.wake()

    def request_stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        self._queue.put(Command(WorkerOp.SHUTDOWN, ""))
        self._doorbell.wake()

    # -- engine thread ------------------------------------------------------------------------

    def get(self, timeout_s: float | None = None) -> Command:
        """The deferred command, else the next one queued, waited for up to `timeout_s`
        (None: for good); queue.Empty when none came."""
        return self.take_deferred() or self._queue.get(timeout=timeout_s)

    def get_nowait(self) -> Command:
        """The next command queued (not the deferred one); queue.Empty when there is none."""
        return self._queue.get_nowait()

    def take_deferred(self) -> Command | None:
        command, self._deferred = self._deferred, None
        return command

    def defer(self, command: Command) -> None:
        """Keep `command` to serve right after the batch it came during."""
        self._deferred = command

    @property
    def deferred(self) -> bool:
        return self._deferred is not None

    def empty(self) -> bool:
        """Nothing queued (the deferred command aside)."""
        return self._queue.empty()

    def waiting(self) -> int:
        """The commands that wait: those queued, and the deferred one."""
        return self._queue.qsize() + (self._deferred is not None)

    def is_cancelled(self, request_id: str) -> bool:
        with self._cancel_lock:
            return request_id in self._cancelled

    def forget_cancel(self, request_id: str) -> None:
        with self._cancel_lock:
            self._cancelled.discard(request_id)
