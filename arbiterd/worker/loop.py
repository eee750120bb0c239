"""One model's worker process: keeps the model resident and time-shares the GPU through the arena.

    python -m arbiterd.worker --fd N --config JSON

Owns the model (through a `Backend`), its residency state and its hold on the arena token
(on each of its devices' arenas for a model on several, `gateway`; issue 27).
Two threads:
- the **engine thread** (the main thread) owns the llama objects, the residency state machine
  and the token. It decodes the requests it has begun together, one batch (issue 42: a decode
  step of all of them at a time, requests queued meanwhile joining between two steps up to the
  model's `parallel`), and between requests it probes `wanted()`
  itself and goes cold when the policy says so. Idle and warm, it sleeps on a doorbell
  (arena/doorbell.py) armed on what a waiter does first, and probes when it rings, when the
  io thread queues a command, when the policy's next deadline comes, and at least every
  SAFETY_PROBE_S (issue 29). The decision reads live lock state, never a flag set by another
  thread. A request is prepared (sized, rendered, tokenized: CPU work with the vocabulary
  alone) before the worker asks for the GPU; a warm model preparing one probes between the
  tokenizer's pieces, so a waiter never waits for our tokenizing (issue 10).
- the **io thread** reads the socket: it answers `status` and `cancel` at once (also during a
  decode: ctypes releases the GIL in llama_decode) and queues everything else for the engine.
  Its `status` says how old the engine thread's last *beat* is (`beat_age_s`; 0 while it
  sleeps on the doorbell or waits in the queue for the token, which no hung driver does): the
  engine thread beats each turn of its loop and before each decode batch and tokenizer piece
  of a request, through the callbacks the engine already asks. So a long generation beats once
  per token or prompt batch, and only one native call that runs longer than the daemon's
  `holder_timeout_s` (a hung driver; a single batch that slow) looks like a hang. A load, a
  release or a restore is one long native call that asks nothing back: inside one, the engine
  thread's CPU clock moving on is its beat (worker/progress.py, issue 40), so a large model
  that loads for minutes stays live and one blocked on an RPC server that stopped answering
  does not. The daemon judges every holder (daemon/models/liveness.py, issues 24 and 40).
  When the daemon's end closes, it stops the worker: the current request is cancelled before
  its next decode, the token released, the process exits.

Message protocol (JSON lines, `arbiterd.wire`), version WORKER_PROTOCOL:
    worker → daemon  {"hello": {"protocol", "model", "pid",                first line
                                "backend", "fallback_reason", "engine"}}
                     backend: "in-place" | "reload", the residency mechanism this worker uses;
                     fallback_reason: "" for in-place, else one line saying why in-place was
                     not available; engine: {"offload": bool, "devices": [str, ...]}, what the
                     loaded llama.cpp can do (engine.EngineInfo; offload false = CPU only).
                     The daemon reads all six; fields are only ever added to the hello, and
                     WORKER_PROTOCOL changes when one changes meaning or goes (issue 15).
    daemon → worker  {"op": "generate", "id", "request", "stream"}   request: a GenerateRequest
                     (arbiterd/request.py) as its to_json writes it; an embedding model takes
                     kind "embedding" only, any other "completion" and "chat"
                     {"op": "status"|"release"|"warm"|"pin"|"unpin"|"shutdown", "id"}
                     {"op": "unload", "id"}  save the prompt cache to the config's kv_file
                     (worker/kvfile.py), answer {"kv_file", "kv_bytes", "tokens", "error"}
                     ("error": why nothing was saved, "" when it was or there was nothing),
                     then exit as on shutdown; the next worker restores it after loading
                     {"op": "cancel", "id", "target": request id}
    worker → daemon  {"id", "started": true}  the engine thread took a generate op from its
                     queue: it may run from here on (and may be what a crash was about), so a
                     request whose worker dies after this fails; one whose worker dies before
                     it never ran, and the daemon sends it to the next worker (issue 40), as
                     it does each op still queued when the worker stops: answered with code
                     "worker_gone"
                     {"id", "chunk": {...}}  {"id", "result": {...}}
                     a generate's result: a reply.WorkerResult (the OpenAI response and what
                     the request cost: the daemon's router publishes its `request` event);
                     a status result: a reply.WorkerStatus, its "beat_age_s" the age of the
                     engine thread's last beat when the io thread answered
                     {"id", "error": {"code", "message"}}: code is an errors.ErrorCode; a
                     message the worker cannot read, or one with a bad op, is answered so with
                     "bad_message" and the id it names (null when none could be read)
                     {"event": "residency", ...}  {"event": "encoder", ...}
                     {"event": "passed_over", ...}  (arbiterd/events.py's records)
                     A residency event that ends a load or a warm-up (→ warm) also says how
                     the token was had: "waited_from" (epoch s), "wait_s", and the holder when
                     the wait began, "holder_pid" and "holder_name" (null: the token was free).
                     Every residency event says "resident_bytes", what the worker holds on its
                     devices once the change is made, by the engine's own figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from arbiterd import footprint
from arbiterd.arena import Arena, ArenaState, Gateway, Hold, Place
from arbiterd.arena.devices import device_arenas
from arbiterd.arena.doorbell import SAFETY_PROBE_S, Doorbell
from arbiterd.arena.groups import Gate
from arbiterd.config import FITTING_GROUP
from arbiterd.errors import (
    AcquireCancelledError,
    ArbiterError,
    DeviceUnreachableError,
    EngineError,
    InternalError,
    OutOfDeviceMemoryError,
    ProtocolError,
    RequestError,
    RestoreError,
    WorkerError,
    WorkerGoneError,
)
from arbiterd.events import PassedOverEvent, ResidencyEvent
from arbiterd.footprint import DeviceFootprint, ModelFootprint
from arbiterd.paths import DeviceKind, device_arena_of, parse_device_id
from arbiterd.procs import holder_name
from arbiterd.reply import EngineReport, ModelInfoReport, WorkerResult, WorkerStatus
from arbiterd.request import GenerateRequest
from arbiterd.spec import (
    WORKER_PROTOCOL,
    Capability,
    KvPolicy,
    ModelInfo,
    ModelSpec,
    Residency,
    WorkerConfig,
)
from arbiterd.states import (
    FOR_A_WAITER,
    BackendKind,
    Priority,
    ReleaseReason,
    RequestKind,
    ResidencyState,
    WorkerOp,
)
from arbiterd.status import Turn
from arbiterd.wire import LineReader, LineWriter
from arbiterd.worker import keptkv
from arbiterd.worker.engine import (
    Backend,
    Cancelled,
    ChunkSink,
    EngineInfo,
    Generation,
    Moved,
    Prepared,
    engine_info,
    select_backend,
)
from arbiterd.worker.engine.placement import check_servers_up
from arbiterd.worker.kvfile import KvState
from arbiterd.worker.policy import (
    HandoffCost,
    HoldView,
    decided_again_in_s,
    preempts,
    release_reason,
    turn_quantum_s,
)
from arbiterd.worker.progress import NativeCall, Progress
from arbiterd.worker.residency import Residency as ResidencyMachine
from arbiterd.worker.residency import Wait

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# How often a generation looks for a waiter of a higher class (each look lists the queue and
# reads /proc/locks).
PREEMPTION_CHECK_S = 0.02
# A load that failed for a device out of reach (an RPC server down) is tried again after this,
# then after twice as long each time, up to the maximum.
LOAD_RETRY_S = 1.0
# The window the status's tokens per second is measured over.
RATE_WINDOW_S = 1.0
LOAD_RETRY_MAX_S = 30.0
# A footprint prediction off the measured one by more than this share of it is logged with both
# figures (issue 44, "Bad input").
FOOTPRINT_FAR_OFF = 0.25


@dataclass(frozen=True)
class _Flight:
    """A generate request begun on the backend."""

    id: str
    priority: Priority  # its class in the GPU queue
    began: float  # monotonic


def _rank(priority: Priority) -> int:
    return priority.rank


def _runs_alone(command: Command) -> bool:
    """A generate op whose request runs with no other beside it (`Prepared.alone`): images,
    or embeddings. Read from the wire as the engine thread will read it (a malformed one joins,
    and fails when it is read)."""
    raw = command.request
    if not isinstance(raw, dict):
        return False
    return raw.get("kind") == RequestKind.EMBEDDING.value or bool(raw.get("images"))


@dataclass(frozen=True)
class Command:
    """A message the engine thread must act on."""

    op: WorkerOp
    id: str
    # A generate op's GenerateRequest as the wire carried it: read in the engine thread, where
    # a malformed one fails its request.
    request: object = None
    stream: bool = False


class Worker:
    """One model's worker: the engine thread's state and steps, and the io thread's answers.

    Over 400 lines, on purpose: it is the one owner of the worker's mutable state (the model
    through its backend, the residency, the token), and its methods are the engine thread's
    steps, each reading that state directly; the io thread touches only what `__init__` marks
    as shared. What can stand alone does: when to release is worker/policy.py's, how a state
    changes worker/residency.py's, the kept prompt cache worker/keptkv.py's, and the model
    itself worker/engine/'s.
    """

    def __init__(
        self, config: WorkerConfig, backend: Backend, sock: socket.socket, engine: EngineInfo
    ) -> None:
        self.config = config
        self.name = config.spec.name
        self._backend = backend
        self._engine = engine
        self._kv_policy, why = kv_on_release(config, backend.keeps_kv_on_device)
        if why:
            log.warning("%s: %s", self.name, why)
        self._arena = gateway(config, self._gate_footprint)
        self._reader = LineReader(sock)
        self._out = LineWriter(sock)
        self._inbox: queue.Queue[Command] = queue.Queue()
        self._residency = ResidencyMachine(self.name)
        self._token: Hold | None = None
        # Written by the io thread, read by the engine thread: sets and Events only.
        self._cancelled: set[str] = set()
        self._cancel_lock = threading.Lock()
        self._wake = threading.Event()  # interrupts a wait for the token
        # The engine thread's sleep while warm and idle; the io thread wakes it for a command.
        self._doorbell = Doorbell()
        # The engine thread sleeps on the doorbell or waits for the token (see `_beat_age_s`).
        self._waiting = False
        self._stopping = threading.Event()
        self._orphaned = threading.Event()  # the daemon is gone: nobody reads our answers
        # Published by the engine thread (one reference assignment), read by the io thread.
        self._status = WorkerStatus()
        self._beat = time.monotonic()  # the engine thread's last sign of life (see above)
        # The load, release or restore the engine thread is in (see above), and the io thread's
        # look at its progress (made in `run`, on the engine thread, whose clock it reads).
        self._native: NativeCall | None = None
        self._progress: Progress | None = None
        self._served = 0
        self._served_when_warm = 0  # `_served` when it last became warm: its turn began there
        # What a handoff costs this model, measured at each release and restore: it sizes the
        # turns (issue 43).
        self._handoff = HandoffCost()
        self._paused = 0  # generations paused for a waiter of a higher class
        self._next_preemption_check = 0.0
        # Pausing releases in place, so the decoder's sequences survive it; the reload backend
        # frees the Llama object a generation runs on.
        self._can_pause = config.preemptible and backend.kind is BackendKind.IN_PLACE
        self._pinned = False
        # The generate request being read, prepared and waiting for the GPU, before it begins.
        self._current: str | None = None
        # The requests begun on the backend: one batch, decoded together (engine thread only).
        self._flights: dict[str, _Flight] = {}
        # A command taken from the inbox during a batch that is not for it: served right after.
        self._deferred: Command | None = None
        # Generated tokens per second over the batch's last RATE_WINDOW_S (0 while idle).
        self._tokens_per_s = 0.0
        self._rate_since = time.monotonic()
        self._rate_tokens = 0
        self._last_error = ""
        # Its footprint by the engine's figures, as it was when it last became warm (issue 44);
        # () until it first is, or where the engine cannot tell.
        self._footprint: tuple[DeviceFootprint, ...] = ()
        # A fitting set's member retrying a restore that ran out of device memory: it says no
        # footprint, so its keeper admits it alone (`_warm_up`).
        self._alone = False
        self._retry_load = False  # the last load failed for a device out of reach: try again
        self._warm_since = time.monotonic()
        self._idle_since = time.monotonic()
        self._publish()  # before the io thread can be asked for status

    # -- io thread ----------------------------------------------------------------------------

    def _io_loop(self) -> None:
        while True:
            try:
                message = self._reader.read()
            except ProtocolError as exc:  # answered to its request, when its id could be read
                self._out.send({"id": exc.request_id, "error": exc.to_wire()})
                continue
            except OSError:
                message = None
            if message is None:  # the daemon is gone: stop, whatever is queued or running
                self._orphaned.set()
                self._request_stop()
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
            status = dataclasses.replace(
                self._status, queue=self._queued(), beat_age_s=self._beat_age_s()
            )
            self._reply(request_id, status.to_json())
        elif op is WorkerOp.CANCEL:
            target = message.get("target")
            with self._cancel_lock:
                self._cancelled.add(str(target))
            self._wake.set()
            self._out.send({"id": request_id, "result": {"cancelled": target}})
        elif op is WorkerOp.SHUTDOWN:
            self._request_stop()
        else:
            self._inbox.put(
                Command(
                    op,
                    request_id,
                    request=message.get("request"),
                    stream=bool(message.get("stream")),
                )
            )
            self._doorbell.wake()

    def _beat_age_s(self) -> float:
        """How old the engine thread's last sign of life is, as the io thread answers status:
        0 while it waits on another process (the doorbell, the queue for the token), which no
        hung driver does; inside a load, release or restore, its CPU clock moving on counts."""
        if self._waiting:
            return 0.0
        now = time.monotonic()
        beat, native, progress = self._beat, self._native, self._progress
        if native is not None and progress is not None:
            beat = max(beat, progress.last_moved(native, now))
        return round(now - beat, 3)

    def _request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._inbox.put(Command(WorkerOp.SHUTDOWN, ""))
        self._doorbell.wake()

    # -- engine thread ------------------------------------------------------------------------

    def run(self) -> int:
        self._out.send(
            {
                "hello": {
                    "protocol": WORKER_PROTOCOL,
                    "model": self.name,
                    "pid": os.getpid(),
                    "backend": self._backend.kind,
                    "fallback_reason": self._backend.fallback_reason,
                    "engine": self._engine_report().to_json(),
                }
            }
        )
        self._progress = Progress(time.pthread_getcpuclockid(threading.get_ident()))
        threading.Thread(target=self._io_loop, name="worker-io", daemon=True).start()
        try:
            if self._load() or self._load_again():
                self._serve_forever()
        finally:
            self._stop()
        return 0

    def _load(self) -> bool:
        try:
            self._backend.open()  # what needs no GPU (host copy, vocabulary): before asking
            # A server that is down fails the load before the token is asked: no model is
            # made to release for a load that cannot happen. (Only "down": a server another
            # model uses is busy until that model releases, which the token brings about.)
            check_servers_up(self.config.spec)
        except EngineError as exc:
            self._fail(exc)
            return False
        # The token before the weights: loading can then never push a resident model out of VRAM.
        place, waiting = self._announce(self.config.priority)
        try:
            with self._waiting_for_others():
                taken = place.take(
                    self.name, model=self.name, cancel=self._stopping, on_wait=waiting.saw
                )
            self._got_token(taken)
        except AcquireCancelledError:
            return False
        finally:
            place.leave()
        wait = waiting.done()
        # Loading is timed from here: the wait for the token is not part of it.
        self._residency = ResidencyMachine(self.name)
        try:
            moved = self._native_call(self._backend.load)
        except EngineError as exc:
            self._fail(exc)
            return False
        self._native_call(lambda: keptkv.adopt(self.config, self._backend))
        self._moved(ResidencyState.LOADING, ResidencyState.WARM, moved, wait=wait)
        self._warm_since = self._idle_since = time.monotonic()
        self._served_when_warm = self._served
        return True

    def _fail(self, exc: EngineError) -> None:
        self._last_error = str(exc)
        self._retry_load = isinstance(exc, DeviceUnreachableError)
        failed = self._residency.transition(
            ResidencyState.LOADING, ResidencyState.FAILED, reason=str(exc)
        )
        self._give_up_token()  # before telling anyone: a failed model holds nothing
        self._emit(failed)

    def _serve_forever(self) -> None:
        look_in_s: float | None = 0.0  # just warm: probe before the first sleep
        while not self._stopping.is_set():
            self._beat = time.monotonic()
            if self._residency.state is ResidencyState.WARM:
                queued, look_in_s = self._while_warm(look_in_s)
                if queued is None:
                    continue
                command = queued
            else:
                command = self._take_deferred() or self._inbox.get()
            if command.op is WorkerOp.SHUTDOWN:
                return
            if command.op is WorkerOp.UNLOAD:
                saved = self._native_call(lambda: keptkv.save(self.config, self._backend))
                self._reply(command.id, saved)
                return
            if command.op is WorkerOp.RELEASE:
                if self._residency.state is ResidencyState.WARM:
                    self._cool(ReleaseReason.COMMAND)
                self._reply(command.id, {"state": self._residency.state.value})
            elif command.op is WorkerOp.WARM:
                self._handle_warm(command)
            elif command.op in (WorkerOp.PIN, WorkerOp.UNPIN):
                self._pinned = command.op is WorkerOp.PIN
                self._publish()
                self._reply(command.id, {"pinned": self._pinned})
            elif command.op is WorkerOp.GENERATE:
                self._handle_generate(command)
            look_in_s = 0.0  # a command may have made it warm, or left it idle: probe

    def _while_warm(self, look_in_s: float | None) -> tuple[Command | None, float | None]:
        """Warm: the next command if one is queued; else sleep until `look_in_s` (0: do not
        sleep) and probe, and say when to look next. A command that comes during the sleep goes
        first, the probe after it, as it always did."""
        if self._deferred is not None or not self._inbox.empty():
            # Between two requests: where a turn ends (issue 43), or goes on with the next.
            self._maybe_release()
            if self._residency.state is not ResidencyState.WARM:
                return None, None
        try:
            return self._take_deferred() or self._inbox.get_nowait(), look_in_s
        except queue.Empty:
            pass
        if look_in_s is None or look_in_s > 0:
            self._sleep(look_in_s)
            if not self._inbox.empty():
                return None, look_in_s
        return None, self._maybe_release()

    def _take_deferred(self) -> Command | None:
        command, self._deferred = self._deferred, None
        return command

    def _sleep(self, timeout_s: float | None) -> None:
        """Warm and idle: wait for a bell, a command, `timeout_s` (the policy's next deadline)
        or the safety probe, whichever comes first."""
        with self._waiting_for_others():
            self._doorbell.wait(
                min(SAFETY_PROBE_S, SAFETY_PROBE_S if timeout_s is None else timeout_s)
            )

    @contextlib.contextmanager
    def _waiting_for_others(self) -> Iterator[None]:
        """The engine thread waits on what other processes do (a bell, the token): alive, as
        its status says, however long that takes."""
        self._waiting = True
        try:
            yield
        finally:
            self._beat = time.monotonic()  # first: the io thread never sees a beat that old
            self._waiting = False

    def _native_call(self, call: Callable[[], _T]) -> _T:
        """`call`: a load, release or restore (or the kept KV set back), one long native call
        that beats by its CPU clock (worker/progress.py)."""
        self._beat = time.monotonic()
        self._native = NativeCall(time.thread_time(), self._beat)
        try:
            return call()
        finally:
            # The beat first: the io thread never sees the call gone and its entry's beat.
            self._beat = time.monotonic()
            self._native = None

    def _load_again(self) -> bool:
        """A model that cannot load keeps answering, with its reason, until shut down; True
        once it has loaded after all. A load that failed for a device that could not be reached
        (an RPC server down) is tried again with backoff, from LOAD_RETRY_S up to
        LOAD_RETRY_MAX_S, each try a check that its servers are up before any token is asked."""
        retry_in_s = LOAD_RETRY_S
        next_try = time.monotonic() + retry_in_s
        while True:
            # A deadline, not a timeout per get: requests answered meanwhile do not put it off.
            timeout_s = max(0.0, next_try - time.monotonic()) if self._retry_load else None
            try:
                command = self._inbox.get(timeout=timeout_s)
            except queue.Empty:
                retry_in_s = min(2 * retry_in_s, LOAD_RETRY_MAX_S)
                next_try = time.monotonic() + retry_in_s
                try:
                    check_servers_up(self.config.spec)
                except DeviceUnreachableError as exc:
                    self._last_error = str(exc)  # still failed: nothing new to say
                    continue
                self._residency = ResidencyMachine(self.name)  # loading again
                if self._load():
                    return True
                continue
            if command.op is WorkerOp.SHUTDOWN:
                return False
            if command.op is WorkerOp.UNLOAD:  # nothing was loaded: nothing to keep
                self._reply(command.id, keptkv.kept())
                return False
            self._error(command.id, EngineError(f"{self.name} failed to load: {self._last_error}"))

    def _handle_warm(self, command: Command) -> None:
        try:
            if self._is_cancelled(command.id):
                raise AcquireCancelledError("the warm was withdrawn before it began")
            if self._residency.state is ResidencyState.COLD:
                self._warm_up(lambda: self._is_cancelled(command.id), self.config.priority)
            self._reply(command.id, {"state": self._residency.state.value})
        except (AcquireCancelledError, RestoreError) as exc:
            self._error(command.id, exc)
        except Exception as exc:  # a restore that raised what it never should: rolled back
            self._error(command.id, self._internal(command.id, exc))
        finally:
            with self._cancel_lock:
                self._cancelled.discard(command.id)

    def _handle_generate(self, command: Command) -> None:
        """Run a generate request, and beside it those queued meanwhile: one batch, a decode
        step of all of them at a time (worker/engine/decode.py), until every one has ended.
        Those queued while it waited for the GPU join before the first step: a first step that
        evaluates a long prompt may outlast the turn by itself (issue 43's contention run: each
        turn served one request where three were queued)."""
        self._take(command)
        self._admit_queued()
        while self._flights:
            self._step()
            self._admit_queued()
        self._publish()

    def _take(self, command: Command) -> None:
        """Begin a generate request: read, prepared, the GPU waited for if cold, begun on the
        backend (or answered with what kept it from beginning)."""
        if self._is_cancelled(command.id):
            self._error(command.id, RequestError("cancelled before it started"))
            self._forget_cancel(command.id)
            return
        self._out.send({"id": command.id, "started": True})  # before it can send a chunk
        self._current = command.id
        self._publish()
        queued: tuple[Place, _Waiting] | None = None
        try:
            request = GenerateRequest.from_json(command.request)
            # The class it waits for the GPU in: its own (from the HTTP edge's header) or the
            # model's.
            priority = request.priority or self.config.priority
            if self._residency.state is ResidencyState.COLD:
                # Queue before preparing: the holder releases while we tokenize.
                queued = self._announce(priority)
            prepared = self._backend.prepare(request, lambda: self._between_pieces(command.id))
            if self._residency.state is ResidencyState.COLD:
                # Cold from the start, or its turn ended while it tokenized: it queues again.
                self._warm_up(lambda: self._is_cancelled(command.id), priority, queued)
            flight = _Flight(command.id, priority, time.monotonic())
            # One that runs alone may pause for a higher class inside its run; a batch pauses
            # between its steps (`_step`).
            cancelled = (
                (lambda: self._stops_or_pauses(command.id, priority))
                if prepared.alone
                else (lambda: self._stops(command.id))
            )
            if self._token is not None:
                self._token.used()
            self._backend.begin(command.id, prepared, self._sink(command), cancelled)
            self._flights[command.id] = flight
        except ArbiterError as exc:
            self._end(command.id, exc)
        except Exception as exc:
            # A bug met by this request alone (issue 24: a lone surrogate in a prompt, a
            # 5,000-digit token id, each ended the process and kept the model down through the
            # restart backoff).
            self._end(command.id, self._internal(command.id, exc))
        finally:
            if queued is not None:
                queued[0].leave()
            self._current = None
        self._publish()

    def _step(self) -> None:
        """One decode step of the batch, after pausing it for a waiter of a higher class; the
        requests that ended are answered."""
        try:
            self._pause_for_higher_class()
            ended = self._backend.step()
        except Exception as exc:
            # Nothing of the batch can go on (a bug, a device lost): each request fails, the
            # engine's KV emptied.
            failure = exc if isinstance(exc, ArbiterError) else self._internal("a batch", exc)
            ended = dict.fromkeys(self._backend.abandon(failure), failure)
            ended.update(dict.fromkeys(set(self._flights) - set(ended), failure))
        for request_id, outcome in ended.items():
            self._end(request_id, outcome)
        self._measure_rate()

    def _admit_queued(self) -> None:
        """Between two steps: begin the generate requests queued meanwhile, in order, while the
        batch has a free sequence, up to the first other op or request that runs alone (kept
        for after the batch, `_deferred`); none once the turn is over (a waiter wants the GPU:
        the batch ends, and the model's turn with it)."""
        parallel = self.config.spec.parallel
        while (
            self._deferred is None
            and len(self._flights) < parallel
            and not self._inbox.empty()
            and not self._turn_over()
        ):
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command.op is not WorkerOp.GENERATE or _runs_alone(command):
                self._deferred = command
                return
            self._take(command)

    def _turn_over(self) -> bool:
        """Whether a batch admits nothing new: a waiter wants the GPU, and the quantum is spent
        or a waiter has waited its class's bound (the batch then ends, and the model lets go:
        `_maybe_release`). A pinned model's turn never ends."""
        token = self._token
        if token is None:
            return True
        if self._pinned or not token.wanted():
            return False
        return time.monotonic() - self._warm_since >= self._quantum_s() or self._wait_left_s() <= 0

    def _end(self, request_id: str, outcome: Generation | ArbiterError) -> None:
        """A request ended: its answer, and its event."""
        flight = self._flights.pop(request_id, None)
        # Published before the reply: a status asked right after it agrees with it.
        self._served += isinstance(outcome, Generation)
        self._idle_since = time.monotonic()
        self._forget_cancel(request_id)
        self._publish()
        if not isinstance(outcome, Generation):
            self._error(request_id, outcome)
            self._check_settled()
            return
        assert flight is not None  # only a begun request generates
        for step in outcome.encoder_steps:  # a vision request's projector, step by step
            self._out.send(
                dataclasses.replace(
                    step, at=time.time(), model=self.name, request_id=request_id
                ).to_json()
            )
        # After its encoder steps: the daemon's router publishes the request's end (its one
        # `request` event) when this comes, and a listener sees the steps before it.
        result = WorkerResult(
            response=outcome.response,
            duration_s=round(time.monotonic() - flight.began, 6),
            prompt_tokens=outcome.prompt_tokens,
            prompt_tokens_evaluated=outcome.prompt_tokens_evaluated,
            completion_tokens=outcome.completion_tokens,
            cancelled=outcome.cancelled,
        )
        self._reply(request_id, result.to_json())

    def _measure_rate(self) -> None:
        """Generated tokens per second over the last RATE_WINDOW_S of the batch (0 once it has
        ended), published with the status."""
        now = time.monotonic()
        total = self._backend.tokens_generated_total
        if not self._flights:
            self._tokens_per_s = 0.0
        elif now - self._rate_since < RATE_WINDOW_S:
            return
        else:
            self._tokens_per_s = (total - self._rate_tokens) / (now - self._rate_since)
        self._rate_since, self._rate_tokens = now, total
        self._publish()

    def _forget_cancel(self, request_id: str) -> None:
        with self._cancel_lock:
            self._cancelled.discard(request_id)

    def _internal(self, request_id: str, exc: Exception) -> InternalError:
        """The error a request gets for an exception nothing expected; the traceback is logged
        here (the worker's stderr is the daemon's log). The message holds no request text:
        that may be what could not be encoded."""
        log.error("%s: request %s failed", self.name, request_id, exc_info=exc)
        return InternalError(
            f"internal error in the worker of {self.name} ({type(exc).__name__}); "
            "the daemon's log has its traceback"
        )

    def _check_settled(self) -> None:
        """After a failed request: the model must be warm with the token or cold without it,
        as every request leaves it. A release that raised midway (a pause for a higher class)
        leaves it cooling with the token, where no request can be served and no waiter would
        ever get the GPU: the worker exits instead, the kernel frees the token, and the daemon
        starts another worker."""
        state, holds = self._residency.state, self._token is not None
        if (state, holds) not in ((ResidencyState.WARM, True), (ResidencyState.COLD, False)):
            raise WorkerError(
                f"{self.name} was left {state.value} "
                f"({'with' if holds else 'without'} the token) by a failed request"
            )

    def _sink(self, command: Command) -> ChunkSink | None:
        if not command.stream:
            return None

        def sink(chunk: dict[str, Any]) -> None:
            self._out.send({"id": command.id, "chunk": chunk})  # a gone daemon stops us anyway

        return sink

    def _between_pieces(self, request_id: str) -> bool:
        """Between two pieces of a request's tokenizing, which needs no GPU: a waiter gets the
        GPU now, not after us (unless a batch runs: it ends first); and whether the request
        stops."""
        if not self._flights:
            self._maybe_release()
        return self._stops(request_id)

    def _stops(self, request_id: str) -> bool:
        """The request was cancelled, or the daemon is gone: nobody waits for its answer. (A
        shutdown the daemon asks for lets the requests begun finish.) Asked before each decode
        step and tokenizer piece: the engine thread beats here."""
        self._beat = time.monotonic()
        return self._orphaned.is_set() or self._is_cancelled(request_id)

    def _stops_or_pauses(self, request_id: str, priority: Priority) -> bool:
        """Before each decode of a request that runs alone: whether it stops (as `_stops`),
        after pausing it if a waiter of a higher class has queued meanwhile (preemption at a
        token boundary)."""
        if self._stops(request_id):
            return True
        if self._preempted(priority):
            self._pause(lambda: self._is_cancelled(request_id), priority)
        return self._stops(request_id)

    def _pause_for_higher_class(self) -> None:
        """Before a batch's step: pause it if a waiter of a higher class than each of its
        requests has queued meanwhile."""
        priority = min((flight.priority for flight in self._flights.values()), key=_rank)
        if self._preempted(priority):
            self._pause(lambda: all(map(self._is_cancelled, self._flights)), priority)

    def _preempted(self, priority: Priority) -> bool:
        """Whether a generation of class `priority` pauses now: a waiter of a higher class
        queues (looked at every PREEMPTION_CHECK_S at most), and the minimum hold is over."""
        if not self._can_pause or self._token is None:
            return False
        now = time.monotonic()
        if now < self._next_preemption_check:
            return False
        self._next_preemption_check = now + PREEMPTION_CHECK_S
        waiting = self._arena.first_class_waiting()
        return preempts(
            waiting, priority.rank, held_s=now - self._warm_since, min_hold_s=self.config.min_hold_s
        )

    def _pause(self, withdrawn: Callable[[], bool], priority: Priority) -> None:
        """Give the GPU to the waiter of a higher class, the generations' state kept (their KV
        saved like any release's; the decoder's tokens and samplers live on the host), then
        queue for it again in their class and resume where they stopped; unless `withdrawn`
        says nobody waits for them any more."""
        self._paused += 1
        self._cool(ReleaseReason.PREEMPTED)
        self._warm_up(withdrawn, priority)

    def _maybe_release(self) -> float | None:
        """Release if the policy says so; else how long its answer holds without a bell (None:
        until one rings, or for good)."""
        if self._residency.state is not ResidencyState.WARM or self._token is None:
            return None
        now = time.monotonic()
        wanted = self._token.wanted()  # live lock state, probed here where we decide
        held_s = now - self._warm_since
        # What waits or runs: the queue, the request being read, the batch.
        queued = self._inbox.qsize() + (self._deferred is not None)
        queued += (self._current is not None) + len(self._flights)
        quantum_s = self._quantum_s()
        # The waiters' waits matter only while the turn would go on without them: read then
        # alone (a look at the queue lists its folder and reads /proc/locks).
        in_turn = wanted and queued > 0 and held_s < quantum_s
        view = HoldView(
            wanted=wanted,
            held_s=held_s,
            idle_s=now - self._idle_since,
            queued=queued,
            pinned=self._pinned,
            served_since_warm=self._served > self._served_when_warm,
            quantum_s=quantum_s,
            wait_left_s=self._wait_left_s() if in_turn else math.inf,
        )
        min_hold_s, idle_release_s = self.config.min_hold_s, self.config.idle_release_s
        reason = release_reason(view, min_hold_s=min_hold_s, idle_release_s=idle_release_s)
        if reason is None:
            return decided_again_in_s(view, min_hold_s=min_hold_s, idle_release_s=idle_release_s)
        self._cool(reason)
        return None

    def _quantum_s(self) -> float:
        """How long this model's turn lasts, from its measured handoff cost."""
        turns = self.config.turns
        return turn_quantum_s(
            self._handoff.total_s,
            switch_overhead=turns.switch_overhead,
            min_turn_s=turns.min_turn_s,
            max_turn_s=turns.max_turn_s,
        )

    def _wait_left_s(self) -> float:
        """The least time a queued waiter has left before it has waited max_wait_s of its own
        class (0 or less: one has); inf when no ticket queues. A stopped waiter is left out: it
        could not take the GPU it was handed (arena/token.py passes it over too)."""
        state = self._arena.observe()
        bounds = self.config.turns
        left = (
            bounds.bound_s(waiter.priority) - waiter.waited_s(state.observed_ns)
            for waiter in state.queue
            if waiter.pid not in state.stopped_pids
        )
        return min(left, default=math.inf)

    def _cool(self, reason: ReleaseReason) -> None:
        """warm → cooling → cold: free the device first, then let go of the token."""
        self._emit(
            self._residency.transition(ResidencyState.WARM, ResidencyState.COOLING, reason=reason)
        )
        # A paused generation resumes from its KV: it is kept whatever the policy says.
        kv = self._kv_policy
        if reason is ReleaseReason.PREEMPTED and kv is KvPolicy.DROP:
            kv = KvPolicy.HOST
        moved = self._native_call(lambda: self._backend.release(kv))
        self._moved(ResidencyState.COOLING, ResidencyState.COLD, moved, reason)
        if reason in FOR_A_WAITER:
            token, self._token = self._token, None
            self._doorbell.disarm()
            if token is not None:
                token.hand_over()
        else:
            self._give_up_token()
        self._publish()

    def _announce(self, priority: Priority) -> tuple[Place, _Waiting]:
        """A place in the queue, which tells the holder at once, and the wait it starts."""
        waiting = _Waiting()
        # Looked at before we announce: once we have, the holder may be gone at once.
        state = self._arena.observe()
        ticket = self._arena.queue(priority)
        if state.holder_pid is not None:
            waiting.saw(state)  # the holder we asked
        return ticket, waiting

    def _warm_up(
        self,
        withdrawn: Callable[[], bool],
        priority: Priority,
        queued: tuple[Place, _Waiting] | None = None,
    ) -> None:
        """cold → warming → warm; waits for the token in the queue, as `priority` (interrupted
        by shutdown, or by a cancel once `withdrawn` says nobody waits for it; a wake for
        another request's cancel keeps its place).

        A member of a fitting set whose restore runs out of device memory (its footprint was
        wrong, or another program grew) queues once more with its footprint unknown, which its
        keeper counts at the whole budget (fitting.py): admitted alone, it tries again, and
        stays counted so for the warm spell that follows. If that fails too, it does not fit
        the device now even alone, and the error is raised (issue 44). Either way it is cold
        again after a failure, its KV and weights' copies kept. Only in a fitting set: in a
        group without a budget the keeper admits every member whatever it says, so a retry
        would meet the same members."""
        try:
            self._take_and_restore(withdrawn, priority, queued)
        except OutOfDeviceMemoryError as exc:
            if self.config.group != FITTING_GROUP or self._stopping.is_set():
                raise
            log.warning("%s; it tries once more, alone on its device", exc)
            self._alone = True  # read by `_gate_footprint` as it queues again
            try:
                self._take_and_restore(withdrawn, priority)
            finally:
                self._alone = False  # the next warm spell says its footprint again

    def _take_and_restore(
        self,
        withdrawn: Callable[[], bool],
        priority: Priority,
        queued: tuple[Place, _Waiting] | None = None,
    ) -> None:
        """One try of `_warm_up`: the token, then the restore; a restore that fails is rolled
        back to cold without the token and raised (RestoreError, or what no restore should
        raise)."""
        ticket, waiting = queued or self._announce(priority)
        try:
            while True:
                self._wake.clear()
                try:
                    with self._waiting_for_others():
                        taken = ticket.take(
                            self.name, model=self.name, cancel=self._wake, on_wait=waiting.saw
                        )
                    self._got_token(taken)
                    break
                except AcquireCancelledError:
                    if self._stopping.is_set() or withdrawn():
                        raise
        finally:
            ticket.leave()
        wait = waiting.done()
        self._emit(self._residency.transition(ResidencyState.COLD, ResidencyState.WARMING))
        try:
            moved = self._native_call(self._backend.restore)
        except Exception as exc:
            # Roll back: a model that is not warm must not keep the token. Whatever the restore
            # raised, the model is cold again and the next request may warm it.
            reason = str(exc) if isinstance(exc, EngineError) else type(exc).__name__
            rolled_back = self._residency.transition(
                ResidencyState.WARMING, ResidencyState.COLD, reason=reason
            )
            self._give_up_token()
            self._emit(rolled_back)
            if isinstance(exc, EngineError):
                # Out of device memory stays so: `_warm_up` may try again.
                oom = isinstance(exc, OutOfDeviceMemoryError)
                error = OutOfDeviceMemoryError if oom else RestoreError
                raise error(f"{self.name} could not be restored: {exc}") from None
            raise
        self._moved(ResidencyState.WARMING, ResidencyState.WARM, moved, wait=wait)
        self._warm_since = self._idle_since = time.monotonic()
        self._served_when_warm = self._served

    def _stop(self) -> None:
        while True:  # nothing queued is dropped silently
            try:
                command = self._take_deferred() or self._inbox.get_nowait()
            except queue.Empty:
                break
            if command.id:
                # Never begun: the daemon sends it to the worker that replaces this one (a
                # reload that changed the model's settings stops this one; issue 40).
                self._error(
                    command.id, WorkerGoneError(f"{self.name}'s worker stopped before it began")
                )
        self._emit(self._residency.transition(self._residency.state, ResidencyState.STOPPED))
        self._backend.close()
        self._give_up_token()
        self._doorbell.close()
        self._publish()

    def _got_token(self, token: Hold) -> None:
        """The token is ours: sleep on its bells from now on, so that a waiter who comes while
        the model loads or restores is seen at the first probe after."""
        self._token = token
        self._doorbell.arm(token.bells())
        for passed in token.passed_over:  # the arena logged each; the daemon's journal too
            event = PassedOverEvent(
                at=time.time(),
                model=self.name,
                pid=passed.waiter.pid,
                reason=passed.reason,
                free_s=passed.free_s,
                arena=str(passed.arena),
            )
            self._out.send(event.to_json())

    def _give_up_token(self) -> None:
        token, self._token = self._token, None
        self._doorbell.disarm()
        if token is not None:
            token.release()

    # -- helpers ------------------------------------------------------------------------------

    def _queued(self) -> int:
        """The requests that wait: those in the inbox, and the one taken from it while it waits
        for the GPU (issue 40: status said QUEUE 0 while a request waited for the token)."""
        waiting = self._current is not None and self._token is None
        return self._inbox.qsize() + (self._deferred is not None) + waiting

    def _is_cancelled(self, request_id: str) -> bool:
        with self._cancel_lock:
            return request_id in self._cancelled

    def _moved(
        self,
        expected: ResidencyState,
        new: ResidencyState,
        moved: Moved,
        reason: str = "",
        wait: Wait | None = None,
    ) -> None:
        """A transition that moved weights and KV: the event carries what `moved` reports. A
        release also says how many requests the turn it ends served; a release's and a
        restore's durations feed the measured handoff cost."""
        event = self._residency.transition(
            expected,
            new,
            weights_bytes=moved.weights_bytes,
            kv_bytes=moved.kv_bytes,
            disk_read_bytes=moved.disk_read_bytes,
            file_bytes=moved.file_bytes,
            copied_bytes=moved.copied_bytes,
            reason=reason,
            wait=wait,
        )
        if expected is ResidencyState.COOLING and event.duration_s is not None:
            self._handoff = self._handoff.released(event.duration_s)
            event = dataclasses.replace(event, turn_served=self._served - self._served_when_warm)
        elif expected is ResidencyState.WARMING and event.duration_s is not None:
            self._handoff = self._handoff.restored(event.duration_s)
        if new is ResidencyState.WARM:
            self._measure_footprint()
        self._emit(event)

    def _gate_footprint(self) -> int | None:
        """The bytes a fitting set's keeper counts for this model (issue 44): its footprint as
        measured when it last became warm, else as predicted; on its accelerators, or on the
        host for a model that has none. None: not known, or retrying alone (`_warm_up`)."""
        if self._alone:
            return None
        known = self._footprint or self._backend.predicted_footprint
        if not known:
            return None
        off_host = [f for f in known if f.device != footprint.CPU]
        return footprint.total(off_host or known)

    def _measure_footprint(self) -> None:
        """Take the footprint by the engine's figures, now warm; the first time, a prediction
        off by more than FOOTPRINT_FAR_OFF is logged with both."""
        measured = self._backend.footprint()
        if not measured:
            return
        first, self._footprint = not self._footprint, measured
        predicted = self._backend.predicted_footprint
        if not first or not predicted:
            return
        off = footprint.error(predicted, measured)
        if abs(off) > FOOTPRINT_FAR_OFF:
            log.warning(
                "%s: its footprint was predicted at %d bytes and measured at %d (%+.0f %%):"
                " predicted %s, measured %s",
                self.name,
                footprint.total(predicted),
                footprint.total(measured),
                100 * off,
                [f.to_json() for f in predicted],
                [f.to_json() for f in measured],
            )

    def _emit(self, event: ResidencyEvent) -> None:
        self._publish()  # first: whoever sees the event and asks for status sees it applied
        # What it holds now, not only what moved: the daemon books this where no GPU reader
        # measures (issue 40: a warm CPU model was booked at the 0 bytes its restore moved).
        held = dataclasses.replace(event, resident_bytes=self._status.resident_bytes)
        self._out.send(held.to_json())

    def _publish(self) -> None:
        info = self._backend.model_info()
        self._status = WorkerStatus(
            model=self.name,
            pid=os.getpid(),
            state=self._residency.state,
            holds_token=self._token is not None,
            pinned=self._pinned,
            queue=self._queued(),
            # The request being begun, else the batch's oldest; every one the batch runs.
            current=self._current or next(iter(self._flights), None),
            running=tuple(self._flights),
            sequences=self._backend.generating,
            tokens_per_s=round(self._tokens_per_s, 1),
            served=self._served,
            paused=self._paused,
            # Issue 43: the turn a wanted model keeps the GPU for, and the cost it comes from.
            turn=Turn(
                quantum_s=round(self._quantum_s(), 3),
                handoff_s=round(self._handoff.total_s, 3),
                handoff_measured=self._handoff.measured,
                served=self._served - self._served_when_warm,
            ),
            resident_bytes=self._backend.resident_bytes(),
            # Issue 44: what it takes of each device, predicted before its first load and
            # measured when it last became warm.
            footprint=ModelFootprint.of(self._backend.predicted_footprint, self._footprint),
            capabilities=tuple(str(capability) for capability in self._backend.capabilities()),
            model_info=None if info is None else ModelInfoReport(**dataclasses.asdict(info)),
            host_kv_bytes=self._backend.host_kv_bytes(),
            host_weights_bytes=self._backend.host_weights_bytes(),
            prompt_tokens_evaluated=self._backend.prompt_tokens_evaluated_total,
            last_error=self._last_error,
            backend=self._backend.kind,
            fallback_reason=self._backend.fallback_reason,
            engine=self._engine_report(),
        )

    def _engine_report(self) -> EngineReport:
        return EngineReport(self._engine.offload, self._engine.devices)

    def _reply(self, request_id: str, result: dict[str, Any]) -> None:
        self._out.send({"id": request_id, "result": result})

    def _error(self, request_id: str, exc: ArbiterError) -> None:
        self._out.send({"id": request_id, "error": exc.to_wire()})


def gateway(config: WorkerConfig, footprint: Callable[[], int | None]) -> Gateway:
    """The worker's way to the GPU: its group's gate in its device's arena (a group's models,
    a [groups] table's or a device's fitting set, are on one device: config/sharing.py sees to it),
    where it says `footprint()` to the keeper; else the arenas of its devices, taken in the
    canonical order (arena/devices.py). A model on one device goes through that device's arena
    alone: on the default ["gpu0"], gpu0's (`config.arena`), exactly as before devices had
    names; on ["cpu"], the cpu arena, shared only with the other models placed on the CPU."""
    if config.group:
        (device,) = config.spec.devices
        arena = Arena(device_arena_of(device, config.arena))
        return Gate(arena, config.group, config.spec.name, footprint)
    return device_arenas(config.spec.devices, config.arena)


def kv_on_release(config: WorkerConfig, keeps_kv_on_device: bool) -> tuple[KvPolicy, str]:
    """What a release does with the KV cache: the config's kv_on_release, or "host" where
    "device" cannot be, with why ("" when it is the config's). `keeps_kv_on_device`: the
    backend can leave the KV on the device (in place). Config load refuses "device" on an RPC
    device already; this guards a WorkerConfig made otherwise."""
    policy = config.kv_on_release
    if policy is not KvPolicy.DEVICE:
        return policy, ""
    if not keeps_kv_on_device:
        return KvPolicy.HOST, "kv_on_release=device needs the in-place backend; using host"
    remote = [d for d in config.spec.devices if parse_device_id(d).kind is DeviceKind.RPC]
    if remote:
        # A llama.cpp RPC server serves one client at a time: KV buffers kept on it while cold
        # would keep this worker its client, and no other model could reach the server.
        return KvPolicy.HOST, (
            f"kv_on_release=device would keep the connection to the RPC server of "
            f"{', '.join(remote)}, which serves one client at a time; using host"
        )
    return policy, ""


class _Waiting:
    """Measures one way to the token, however many tries it takes: from the first ask, with the
    holder the first busy try saw (the arena calls `saw` when a wait begins)."""

    def __init__(self) -> None:
        self._since, self._started = time.time(), time.monotonic()
        self._holder: ArenaState | None = None

    def saw(self, state: ArenaState) -> None:
        if self._holder is None:
            self._holder = state

    def done(self) -> Wait:
        holder = self._holder
        return Wait(
            since=self._since,
            wait_s=time.monotonic() - self._started,
            holder_pid=None if holder is None else holder.holder_pid,
            holder_name=None if holder is None else holder_name(holder),
        )


class Unavailable:
    """Stands in for a backend that cannot be made (residency = "in-place" on an engine without
    the residency API): the worker still says hello, then fails its load with `error`, like a
    model whose file cannot load, and answers every request with that reason. Without it the
    worker would die before its hello, and the daemon would retry it for ever, knowing nothing.
    """

    keeps_kv_on_device = False
    prompt_tokens_evaluated_total = 0
    tokens_generated_total = 0
    generating = 0
    fallback_reason = ""

    def __init__(self, spec: ModelSpec, error: EngineError) -> None:
        self.spec = spec
        # What the config asked for, as the status shows it (only "in-place" can fail so).
        self.kind = (
            BackendKind.IN_PLACE if spec.residency is Residency.IN_PLACE else BackendKind.RELOAD
        )
        self._error = error

    def open(self) -> None:
        raise self._error

    def load(self) -> Moved:
        raise self._error

    def release(self, kv: KvPolicy) -> Moved:
        raise self._error

    def restore(self) -> Moved:
        raise self._error

    def prepare(self, request: GenerateRequest, cancelled: Cancelled) -> Prepared:
        raise self._error

    def begin(
        self, request_id: str, request: Prepared, sink: ChunkSink | None, cancelled: Cancelled
    ) -> None:
        raise self._error

    def step(self) -> dict[str, Generation | ArbiterError]:
        return {}

    def abandon(self, error: ArbiterError) -> list[str]:
        return []

    def resident_bytes(self) -> int:
        return 0

    @property
    def predicted_footprint(self) -> tuple[DeviceFootprint, ...]:
        return ()

    def footprint(self) -> tuple[DeviceFootprint, ...]:
        return ()

    def capabilities(self) -> tuple[Capability, ...]:
        return ()

    def model_info(self) -> ModelInfo | None:
        return None

    def host_kv_bytes(self) -> int:
        return 0

    def host_weights_bytes(self) -> int:
        return 0

    def kept_kv(self) -> KvState | None:
        return None

    def adopt_kv(self, kv: KvState) -> None:
        raise self._error

    def close(self) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arbiterd-worker")
    parser.add_argument("--fd", type=int, required=True, help="connected stream socket")
    parser.add_argument("--config", required=True, help="WorkerConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="arbiterd-worker[%(process)d] %(levelname)s %(message)s"
    )
    config = WorkerConfig.from_json(args.config)
    sock = socket.socket(fileno=args.fd)
    try:
        backend: Backend
        try:
            backend = select_backend(config.spec, vram_budget=config.vram_budget)
        except EngineError as exc:
            backend = Unavailable(config.spec, exc)
        return Worker(config, backend, sock, engine_info()).run()
    finally:
        sock.close()
