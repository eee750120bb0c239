"""One model's worker process: keeps the model resident and time-shares the GPU through the arena.

    python -m arbiterd.worker --fd N --config JSON

Owns the engine thread's steps (`Worker`): what it does with each command and request, and when.
Its parts live beside it: the io thread and the inbox it fills (worker/inbox.py), the model's
residency, token and moves (worker/tenancy.py, through worker/gateway.py's way to the GPU: on
each of its devices' arenas for a model on several; issue 27), the engine thread's beat
(worker/progress.py), and a model that cannot be served (worker/unavailable.py).
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
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from arbiterd.arena import Place
from arbiterd.arena.doorbell import SAFETY_PROBE_S, Doorbell
from arbiterd.errors import (
    AcquireCancelledError,
    ArbiterError,
    EngineError,
    InternalError,
    RequestError,
    RestoreError,
    WorkerError,
    WorkerGoneError,
)
from arbiterd.footprint import ModelFootprint
from arbiterd.paths import DeviceKind, parse_device_id
from arbiterd.reply import EngineReport, ModelInfoReport, WorkerResult, WorkerStatus
from arbiterd.request import GenerateRequest
from arbiterd.spec import (
    WORKER_PROTOCOL,
    KvPolicy,
    WorkerConfig,
)
from arbiterd.states import Priority, ReleaseReason, ResidencyState, WorkerOp
from arbiterd.status import Turn
from arbiterd.wire import LineReader, LineWriter
from arbiterd.worker import keptkv
from arbiterd.worker.engine import (
    Backend,
    ChunkSink,
    EngineInfo,
    Generation,
    engine_info,
    select_backend,
)
from arbiterd.worker.gateway import Waiting
from arbiterd.worker.inbox import Command, Inbox
from arbiterd.worker.progress import Beat
from arbiterd.worker.tenancy import Tenancy
from arbiterd.worker.unavailable import Unavailable, answer_until_loaded

log = logging.getLogger(__name__)


# The window the status's tokens per second is measured over.
RATE_WINDOW_S = 1.0


@dataclass(frozen=True)
class _Flight:
    """A generate request begun on the backend."""

    id: str
    priority: Priority  # its class in the GPU queue
    began: float  # monotonic


def _rank(priority: Priority) -> int:
    return priority.rank


class Worker:
    """One model's worker: the engine thread's state and steps, and the io thread's answers.

    The engine thread's steps: serving commands, beginning requests into one batch, stepping
    it, answering each request, pausing it for a higher class, and publishing the status. The
    io thread touches only the inbox (worker/inbox.py) and the published status. What can stand
    alone does: the residency, the token and the moves between them are worker/tenancy.py's,
    when to release worker/policy.py's, how a state changes worker/residency.py's, the kept
    prompt cache worker/keptkv.py's, and the model itself worker/engine/'s.
    """

    def __init__(
        self, config: WorkerConfig, backend: Backend, sock: socket.socket, engine: EngineInfo
    ) -> None:
        self.config = config
        self.name = config.spec.name
        self._backend = backend
        self._engine = engine
        kv_policy, why = kv_on_release(config, backend.keeps_kv_on_device)
        if why:
            log.warning("%s: %s", self.name, why)
        self._out = LineWriter(sock)
        # The engine thread's sleep while warm and idle; the io thread wakes it for a command.
        self._doorbell = doorbell = Doorbell()
        self._inbox = Inbox(LineReader(sock), self._out, doorbell, self._answer_status)
        # Published by the engine thread (one reference assignment), read by the io thread.
        self._status = WorkerStatus()
        self._status_json = self._status.to_json()  # as the io thread sends it
        self._beat = Beat()  # the engine thread's last sign of life (see above)
        self._tenancy = Tenancy(
            config,
            backend,
            kv_policy=kv_policy,
            inbox=self._inbox,
            beat=self._beat,
            doorbell=doorbell,
            out=self._out,
            publish=self._publish,
        )
        self._paused = 0  # generations paused for a waiter of a higher class
        # The generate request being read, prepared and waiting for the GPU, before it begins.
        self._current: str | None = None
        # The requests begun on the backend: one batch, decoded together (engine thread only).
        self._flights: dict[str, _Flight] = {}
        # Generated tokens per second over the batch's last RATE_WINDOW_S (0 while idle).
        self._tokens_per_s = 0.0
        self._rate_since = time.monotonic()
        self._rate_tokens = 0
        self._publish()  # before the io thread can be asked for status

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
        self._beat.started()
        threading.Thread(target=self._inbox.serve, name="worker-io", daemon=True).start()
        try:
            if self._tenancy.load() or answer_until_loaded(self._inbox, self._tenancy, self._out):
                self._serve_forever()
        finally:
            self._stop()
        return 0

    def _serve_forever(self) -> None:
        look_in_s: float | None = 0.0  # just warm: probe before the first sleep
        while not self._inbox.stopping.is_set():
            self._beat.now()
            if self._tenancy.state is ResidencyState.WARM:
                queued, look_in_s = self._while_warm(look_in_s)
                if queued is None:
                    continue
                command = queued
            else:
                command = self._inbox.get()
            if command.op is WorkerOp.SHUTDOWN:
                return
            if command.op is WorkerOp.UNLOAD:
                saved = self._beat.native_call(lambda: keptkv.save(self.config, self._backend))
                self._reply(command.id, saved)
                return
            if command.op is WorkerOp.RELEASE:
                if self._tenancy.state is ResidencyState.WARM:
                    self._tenancy.cool(ReleaseReason.COMMAND)
                self._reply(command.id, {"state": self._tenancy.state.value})
            elif command.op is WorkerOp.WARM:
                self._handle_warm(command)
            elif command.op in (WorkerOp.PIN, WorkerOp.UNPIN):
                self._tenancy.pinned = command.op is WorkerOp.PIN
                self._publish()
                self._reply(command.id, {"pinned": self._tenancy.pinned})
            elif command.op is WorkerOp.GENERATE:
                self._handle_generate(command)
            look_in_s = 0.0  # a command may have made it warm, or left it idle: probe

    def _while_warm(self, look_in_s: float | None) -> tuple[Command | None, float | None]:
        """Warm: the next command if one is queued; else sleep until `look_in_s` (0: do not
        sleep) and probe, and say when to look next. A command that comes during the sleep goes
        first, the probe after it, as it always did."""
        if self._inbox.deferred or not self._inbox.empty():
            # Between two requests: where a turn ends (issue 43), or goes on with the next.
            self._maybe_release()
            if self._tenancy.state is not ResidencyState.WARM:
                return None, None
        try:
            return self._inbox.take_deferred() or self._inbox.get_nowait(), look_in_s
        except queue.Empty:
            pass
        if look_in_s is None or look_in_s > 0:
            self._sleep(look_in_s)
            if not self._inbox.empty():
                return None, look_in_s
        return None, self._maybe_release()

    def _sleep(self, timeout_s: float | None) -> None:
        """Warm and idle: wait for a bell, a command, `timeout_s` (the policy's next deadline)
        or the safety probe, whichever comes first."""
        with self._beat.waiting_for_others():
            self._doorbell.wait(
                min(SAFETY_PROBE_S, SAFETY_PROBE_S if timeout_s is None else timeout_s)
            )

    def _handle_warm(self, command: Command) -> None:
        try:
            if self._inbox.is_cancelled(command.id):
                raise AcquireCancelledError("the warm was withdrawn before it began")
            if self._tenancy.state is ResidencyState.COLD:
                self._tenancy.warm_up(
                    lambda: self._inbox.is_cancelled(command.id), self.config.priority
                )
            self._reply(command.id, {"state": self._tenancy.state.value})
        except (AcquireCancelledError, RestoreError) as exc:
            self._error(command.id, exc)
        except Exception as exc:  # a restore that raised what it never should: rolled back
            self._error(command.id, self._internal(command.id, exc))
        finally:
            self._inbox.forget_cancel(command.id)

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
        if self._inbox.is_cancelled(command.id):
            self._error(command.id, RequestError("cancelled before it started"))
            self._inbox.forget_cancel(command.id)
            return
        self._out.send({"id": command.id, "started": True})  # before it can send a chunk
        self._current = command.id
        self._publish()
        queued: tuple[Place, Waiting] | None = None
        try:
            request = GenerateRequest.from_json(command.request)
            # The class it waits for the GPU in: its own (from the HTTP edge's header) or the
            # model's.
            priority = request.priority or self.config.priority
            if self._tenancy.state is ResidencyState.COLD:
                # Queue before preparing: the holder releases while we tokenize.
                queued = self._tenancy.gpu.announce(priority)
            prepared = self._backend.prepare(request, lambda: self._between_pieces(command.id))
            if self._tenancy.state is ResidencyState.COLD:
                # Cold from the start, or its turn ended while it tokenized: it queues again.
                self._tenancy.warm_up(
                    lambda: self._inbox.is_cancelled(command.id), priority, queued
                )
            flight = _Flight(command.id, priority, time.monotonic())
            # One that runs alone may pause for a higher class inside its run; a batch pauses
            # between its steps (`_step`).
            cancelled = (
                (lambda: self._stops_or_pauses(command.id, priority))
                if prepared.alone
                else (lambda: self._stops(command.id))
            )
            if self._tenancy.gpu.token is not None:
                self._tenancy.gpu.token.used()
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
        for after the batch, `Inbox.defer`); none once the turn is over (a waiter wants the GPU:
        the batch ends, and the model's turn with it)."""
        parallel = self.config.spec.parallel
        while (
            not self._inbox.deferred
            and len(self._flights) < parallel
            and not self._inbox.empty()
            and not self._tenancy.turn_over()
        ):
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command.op is not WorkerOp.GENERATE or command.runs_alone:
                self._inbox.defer(command)
                return
            self._take(command)

    def _end(self, request_id: str, outcome: Generation | ArbiterError) -> None:
        """A request ended: its answer, and its event."""
        flight = self._flights.pop(request_id, None)
        # Published before the reply: a status asked right after it agrees with it.
        self._tenancy.served += isinstance(outcome, Generation)
        self._tenancy.idle_since = time.monotonic()
        self._inbox.forget_cancel(request_id)
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
        state, holds = self._tenancy.state, self._tenancy.gpu.token is not None
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
        self._beat.now()
        return self._inbox.orphaned.is_set() or self._inbox.is_cancelled(request_id)

    def _stops_or_pauses(self, request_id: str, priority: Priority) -> bool:
        """Before each decode of a request that runs alone: whether it stops (as `_stops`),
        after pausing it if a waiter of a higher class has queued meanwhile (preemption at a
        token boundary)."""
        if self._stops(request_id):
            return True
        if self._tenancy.preempted(priority):
            self._pause(lambda: self._inbox.is_cancelled(request_id), priority)
        return self._stops(request_id)

    def _pause_for_higher_class(self) -> None:
        """Before a batch's step: pause it if a waiter of a higher class than each of its
        requests has queued meanwhile."""
        priority = min((flight.priority for flight in self._flights.values()), key=_rank)
        if self._tenancy.preempted(priority):
            self._pause(lambda: all(map(self._inbox.is_cancelled, self._flights)), priority)

    def _pause(self, withdrawn: Callable[[], bool], priority: Priority) -> None:
        """Give the GPU to the waiter of a higher class, the generations' state kept (their KV
        saved like any release's; the decoder's tokens and samplers live on the host), then
        queue for it again in their class and resume where they stopped; unless `withdrawn`
        says nobody waits for them any more."""
        self._paused += 1
        self._tenancy.cool(ReleaseReason.PREEMPTED)
        self._tenancy.warm_up(withdrawn, priority)

    def _maybe_release(self) -> float | None:
        """Tenancy.maybe_release, with what waits or runs: the queue, the request being
        read, the batch."""
        queued = self._inbox.waiting() + (self._current is not None) + len(self._flights)
        return self._tenancy.maybe_release(queued)

    def _stop(self) -> None:
        while True:  # nothing queued is dropped silently
            try:
                command = self._inbox.take_deferred() or self._inbox.get_nowait()
            except queue.Empty:
                break
            if command.id:
                # Never begun: the daemon sends it to the worker that replaces this one (a
                # reload that changed the model's settings stops this one; issue 40).
                self._error(
                    command.id, WorkerGoneError(f"{self.name}'s worker stopped before it began")
                )
        self._tenancy.stop()
        self._publish()

    # -- helpers ------------------------------------------------------------------------------

    def _queued(self) -> int:
        """The requests that wait: those in the inbox, and the one taken from it while it waits
        for the GPU (issue 40: status said QUEUE 0 while a request waited for the token)."""
        waiting = self._current is not None and self._tenancy.gpu.token is None
        return self._inbox.waiting() + waiting

    def _publish(self) -> WorkerStatus:
        """Publish the status the io thread answers with (and return it)."""
        info = self._backend.model_info()
        self._status = WorkerStatus(
            model=self.name,
            pid=os.getpid(),
            state=self._tenancy.state,
            holds_token=self._tenancy.gpu.token is not None,
            pinned=self._tenancy.pinned,
            queue=self._queued(),
            # The request being begun, else the batch's oldest; every one the batch runs.
            current=self._current or next(iter(self._flights), None),
            running=tuple(self._flights),
            sequences=self._backend.generating,
            tokens_per_s=round(self._tokens_per_s, 1),
            served=self._tenancy.served,
            paused=self._paused,
            # Issue 43: the turn a wanted model keeps the GPU for, and the cost it comes from.
            turn=Turn(
                quantum_s=round(self._tenancy.quantum_s(), 3),
                handoff_s=round(self._tenancy.handoff.total_s, 3),
                handoff_measured=self._tenancy.handoff.measured,
                served=self._tenancy.served_this_turn,
            ),
            resident_bytes=self._backend.resident_bytes(),
            # Issue 44: what it takes of each device, predicted before its first load and
            # measured when it last became warm.
            footprint=ModelFootprint.of(self._backend.predicted_footprint, self._tenancy.footprint),
            capabilities=tuple(str(capability) for capability in self._backend.capabilities()),
            model_info=None if info is None else ModelInfoReport(**dataclasses.asdict(info)),
            host_kv_bytes=self._backend.host_kv_bytes(),
            host_weights_bytes=self._backend.host_weights_bytes(),
            prompt_tokens_evaluated=self._backend.prompt_tokens_evaluated_total,
            last_error=self._tenancy.last_error,
            backend=self._backend.kind,
            fallback_reason=self._backend.fallback_reason,
            engine=self._engine_report(),
        )
        self._status_json = self._status.to_json()  # once, here, not at every status asked
        return self._status

    def _answer_status(self) -> dict[str, Any]:
        """The status the io thread answers, as the wire carries it: the one last published,
        with the queue and the beat's age as they are now."""
        return {**self._status_json, "queue": self._queued(), "beat_age_s": self._beat.age_s()}

    def _engine_report(self) -> EngineReport:
        return EngineReport(self._engine.offload, self._engine.devices)

    def _reply(self, request_id: str, result: dict[str, Any]) -> None:
        self._out.send({"id": request_id, "result": result})

    def _error(self, request_id: str, exc: ArbiterError) -> None:
        self._out.send({"id": request_id, "error": exc.to_wire()})


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
