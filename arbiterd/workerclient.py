"""The daemon's side of a worker: spawns the process, talks its protocol, reaps it.

Owns the worker process, its socket and a reader thread that routes every message: replies and
chunks to the caller waiting for that request id, events to `events` (and any listener).
Blocking API, safe to call from several threads at once. The worker's hello, read into a
`WorkerHello`, says what runs the model: its residency backend and what the engine can do.
"""

from __future__ import annotations

import itertools
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from arbiterd.errors import ProtocolError, WorkerError
from arbiterd.spec import WORKER_PROTOCOL, WorkerConfig
from arbiterd.wire import LineReader, LineWriter

HELLO_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 30.0

EventListener = Callable[[dict[str, Any]], None]
_GONE = object()  # what the hello queue gets when the socket closes first
# The residency backends a worker may name (engine.py's Backend.kind).
BACKENDS = frozenset({"in-place", "reload"})


@dataclass(frozen=True)
class EngineReport:
    """What a worker's engine can do (engine.EngineInfo as the hello carries it; the daemon
    never imports the engine)."""

    offload: bool  # False: everything runs on the CPU, whatever n_gpu_layers asks
    devices: tuple[str, ...]  # "CPU: Intel Xeon", "CUDA0: NVIDIA H200", ...; may be empty

    @classmethod
    def read(cls, raw: object) -> EngineReport:
        if not isinstance(raw, Mapping):
            raise ProtocolError(f"hello: engine is not an object: {raw!r}")
        offload, devices = raw.get("offload"), raw.get("devices")
        if not isinstance(offload, bool):
            raise ProtocolError(f"hello: engine.offload is not a boolean: {offload!r}")
        if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
            raise ProtocolError(f"hello: engine.devices is not a list of strings: {devices!r}")
        return cls(offload, tuple(devices))

    def to_json(self) -> dict[str, Any]:
        return {"offload": self.offload, "devices": list(self.devices)}


@dataclass(frozen=True)
class WorkerHello:
    """A worker's first line (the protocol in arbiterd/worker.py's docstring)."""

    protocol: int
    model: str
    pid: int
    backend: str  # one of BACKENDS
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
        return cls(protocol, model, pid, str(backend), reason, EngineReport.read(raw.get("engine")))


class WorkerGoneError(WorkerError):
    """The worker was gone before the request could be sent: nothing of it ran."""


class RemoteError(WorkerError):
    """The worker answered a request with an error; `kind` is its exception class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class WorkerProcess:
    """A running worker. Create with `spawn`; always `shutdown` or `kill` it."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        sock: socket.socket,
        model: str,
        *,
        keep_events: bool = True,
    ) -> None:
        self.process = process
        # A caller that only listens (the daemon) must not let an unread queue grow for ever.
        self._keep_events = keep_events
        self.model = model
        self._sock = sock
        self._reader = LineReader(sock)
        self._out = LineWriter(sock)
        self._ids = itertools.count(1)
        self._pending: dict[str, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._listeners: list[EventListener] = []
        self._hello: queue.Queue[object] = queue.Queue()
        self.hello: WorkerHello | None = None  # set by `spawn` once the worker said it
        self._reader_thread = threading.Thread(
            target=self._read_loop, name=f"worker-client-{model}", daemon=True
        )
        self._reader_thread.start()

    @classmethod
    def spawn(
        cls,
        config: WorkerConfig,
        *,
        env: dict[str, str] | None = None,
        keep_events: bool = True,
    ) -> WorkerProcess:
        """Start a worker and wait for its hello (the model may still be loading then); a
        worker that exits first is a WorkerError at once, one whose hello is not ours is killed
        (ProtocolError). With keep_events=False, events reach only the listeners, not
        `events`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The host copy keeps its number in the child (pass_fds), where the spec names it.
        shared = [] if config.spec.host_copy_fd is None else [config.spec.host_copy_fd]
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "arbiterd.worker",
                    "--fd",
                    str(theirs.fileno()),
                    "--config",
                    config.to_json(),
                ],
                pass_fds=[theirs.fileno(), *shared],
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        worker = cls(process, ours, config.spec.name, keep_events=keep_events)
        try:
            said = worker._hello.get(timeout=HELLO_TIMEOUT_S)
        except queue.Empty:
            worker.kill()
            raise WorkerError(f"worker for {config.spec.name} did not say hello") from None
        if said is _GONE:  # its stderr (the daemon's) says why
            worker.kill()  # reaps it
            code = worker.process.returncode
            raise WorkerError(f"worker for {config.spec.name} exited ({code}) before its hello")
        try:
            worker.hello = WorkerHello.read(said)
        except ProtocolError:
            worker.kill()
            raise
        return worker

    @property
    def pid(self) -> int:
        return self.process.pid

    def add_listener(self, listener: EventListener) -> None:
        self._listeners.append(listener)

    # -- requests -----------------------------------------------------------------------------

    def request(self, op: str, *, timeout_s: float | None = 60.0, **fields: Any) -> dict[str, Any]:
        """Send one op and wait for its result (chunks, if any, are ignored)."""
        request_id, replies = self._open()
        try:
            self._send({"op": op, "id": request_id, **fields})
            while True:
                message = self._next(replies, request_id, timeout_s)
                if "chunk" not in message:
                    return _result(message)
        finally:
            self._close(request_id)

    def generate(
        self,
        kind: str,
        body: dict[str, Any],
        *,
        on_chunk: Callable[[dict[str, Any]], None] | None = None,
        timeout_s: float | None = 600.0,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """Run one request; with `on_chunk`, it streams. Returns the worker's result."""
        request_id, replies = self._open(request_id)
        try:
            self._send(
                {
                    "op": "generate",
                    "id": request_id,
                    "kind": kind,
                    "body": body,
                    "stream": on_chunk is not None,
                }
            )
            while True:
                message = self._next(replies, request_id, timeout_s)
                if "chunk" in message:
                    if on_chunk is not None:
                        on_chunk(message["chunk"])
                    continue
                return _result(message)
        finally:
            self._close(request_id)

    def cancel(self, target: str) -> None:
        self._send({"op": "cancel", "id": f"cancel-{next(self._ids)}", "target": target})

    def status(self) -> dict[str, Any]:
        return self.request("status", timeout_s=10.0)

    # -- lifetime -----------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int:
        """Ask the worker to stop (in-flight work finishes), wait, and reap it; a worker that
        is already gone is just reaped."""
        self._out.send({"op": "shutdown", "id": "shutdown"})
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.process.returncode
        self._sock.close()
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self._sock.close()

    def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """The next event (consumed from `events`) that matches `predicate`."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"no matching event from {self.model} within {timeout_s} s")
            try:
                event = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            if predicate(event):
                return event

    # -- plumbing -----------------------------------------------------------------------------

    def _open(self, request_id: str | None = None) -> tuple[str, queue.Queue[dict[str, Any]]]:
        request_id = request_id or f"r{next(self._ids)}"
        replies: queue.Queue[dict[str, Any]] = queue.Queue()
        with self._lock:
            self._pending[request_id] = replies
        return request_id, replies

    def _close(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def _send(self, message: dict[str, Any]) -> None:
        if not self._out.send(message):
            raise WorkerGoneError(f"worker for {self.model} is gone")

    def _next(
        self, replies: queue.Queue[dict[str, Any]], request_id: str, timeout_s: float | None
    ) -> dict[str, Any]:
        try:
            message = replies.get(timeout=timeout_s)
        except queue.Empty:
            raise WorkerError(f"no answer from {self.model} to {request_id}") from None
        if message.get("gone"):
            raise WorkerError(f"worker for {self.model} exited during {request_id}")
        return message

    def _read_loop(self) -> None:
        while True:
            try:
                message = self._reader.read()
            except ProtocolError:
                continue
            except OSError:
                message = None
            if message is None:
                with self._lock:
                    waiting = list(self._pending.values())
                for replies in waiting:
                    replies.put({"gone": True})
                self._hello.put(_GONE)  # a worker that died before its hello: spawn stops waiting
                return
            if "hello" in message:
                self._hello.put(message["hello"])
            elif "event" in message:
                if self._keep_events:
                    self.events.put(message)
                for listener in self._listeners:
                    listener(message)
            else:
                with self._lock:
                    waiter = self._pending.get(str(message.get("id")))
                if waiter is not None:
                    waiter.put(message)


def _result(message: dict[str, Any]) -> dict[str, Any]:
    if "error" in message:
        error = message["error"]
        raise RemoteError(str(error.get("type", "Error")), str(error.get("message", "")))
    result = message.get("result")
    if not isinstance(result, dict):
        raise ProtocolError(f"reply without a result: {message}")
    return result
