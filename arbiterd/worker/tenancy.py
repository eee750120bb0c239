"""The model's tenancy of its devices: its residency, the token, and the moves between them.

Owns the residency state machine (worker/residency.py's, driven here), the worker's hold on
the token (worker/gateway.py's `Access`) and every move that changes them: the load, a warm-up
(the token, then the restore), a release (cool), and the stop; each timed and measured, told as
a residency event (with what the worker holds once it is made), and fed to the handoff cost
that sizes the model's turns (issue 43). Also what a turn has been: when it began, how many
requests it served. The footprint the worker says to a fitting set's keeper and measures once
warm (issue 44) is here too: the restore that runs out of device memory tries again alone.

The engine thread's alone (worker/loop.py's Worker, which decides *when* to move: the
requests, the policy); never reads the socket. Waits for the token inside the beat's
`waiting_for_others`, and makes each long native call through it (worker/progress.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

from arbiterd import footprint
from arbiterd.arena import Place
from arbiterd.arena.doorbell import Doorbell
from arbiterd.config import FITTING_GROUP
from arbiterd.errors import (
    AcquireCancelledError,
    DeviceUnreachableError,
    EngineError,
    OutOfDeviceMemoryError,
    RestoreError,
)
from arbiterd.events import ResidencyEvent
from arbiterd.footprint import DeviceFootprint
from arbiterd.reply import WorkerStatus
from arbiterd.spec import KvPolicy, WorkerConfig
from arbiterd.states import FOR_A_WAITER, BackendKind, Priority, ReleaseReason, ResidencyState
from arbiterd.wire import LineWriter
from arbiterd.worker import keptkv
from arbiterd.worker.engine import Backend, Moved
from arbiterd.worker.engine.placement import check_servers_up
from arbiterd.worker.gateway import Access, Waiting
from arbiterd.worker.inbox import Inbox
from arbiterd.worker.policy import (
    HandoffCost,
    HoldView,
    decided_again_in_s,
    preempts,
    release_reason,
    turn_quantum_s,
)
from arbiterd.worker.progress import Beat
from arbiterd.worker.residency import Residency as ResidencyMachine
from arbiterd.worker.residency import Wait

log = logging.getLogger(__name__)

# How often a generation looks for a waiter of a higher class (each look lists the queue and
# reads /proc/locks).
PREEMPTION_CHECK_S = 0.02
# A footprint prediction off the measured one by more than this share of it is logged with both
# figures (issue 44, "Bad input").
FOOTPRINT_FAR_OFF = 0.25


class Tenancy:
    """One model's residency, token and moves (see the module's docstring)."""

    def __init__(
        self,
        config: WorkerConfig,
        backend: Backend,
        *,
        kv_policy: KvPolicy,
        inbox: Inbox,
        beat: Beat,
        doorbell: Doorbell,
        out: LineWriter,
        publish: Callable[[], WorkerStatus],
    ) -> None:
        """`kv_policy`: what a release does with the KV cache (loop.kv_on_release); `inbox`:
        whose `stopping` and `wake` interrupt a wait for the token; `publish`: the worker's
        status, published before each residency event is sent."""
        self.config = config
        self.name = config.spec.name
        self._backend = backend
        self._kv_policy = kv_policy
        self._inbox = inbox
        self._beat = beat
        self._doorbell = doorbell
        self._out = out
        self._publish = publish
        self.gpu = Access(config, self._gate_footprint, doorbell, out)
        self.residency = ResidencyMachine(self.name)
        self.served = 0  # requests answered
        self.served_when_warm = 0  # `served` when it last became warm: its turn began there
        # What a handoff costs this model, measured at each release and restore: it sizes the
        # turns (issue 43).
        self.handoff = HandoffCost()
        self.last_error = ""
        # Its footprint by the engine's figures, as it was when it last became warm (issue 44);
        # () until it first is, or where the engine cannot tell.
        self.footprint: tuple[DeviceFootprint, ...] = ()
        # A fitting set's member retrying a restore that ran out of device memory: it says no
        # footprint, so its keeper admits it alone (`warm_up`).
        self._alone = False
        self.retry_load = False  # the last load failed for a device out of reach: try again
        self.warm_since = time.monotonic()
        self.idle_since = time.monotonic()
        self.pinned = False  # the user pinned it: its turn never ends
        # Pausing releases in place, so the decoder's sequences survive it; the reload backend
        # frees the Llama object a generation runs on.
        self._can_pause = config.preemptible and backend.kind is BackendKind.IN_PLACE
        self._next_preemption_check = 0.0

    @property
    def state(self) -> ResidencyState:
        return self.residency.state

    @property
    def served_this_turn(self) -> int:
        """The requests its current turn (or, cold, its last) served."""
        return self.served - self.served_when_warm

    def turn_over(self) -> bool:
        """Whether a batch admits nothing new: a waiter wants the GPU, and the quantum is spent
        or a waiter has waited its class's bound (the batch then ends, and the model lets go:
        `maybe_release`). A pinned model's turn never ends."""
        token = self.gpu.token
        if token is None:
            return True
        if self.pinned or not token.wanted():
            return False
        return time.monotonic() - self.warm_since >= self.quantum_s() or self.wait_left_s() <= 0

    def preempted(self, priority: Priority) -> bool:
        """Whether a generation of class `priority` pauses now: a waiter of a higher class
        queues (looked at every PREEMPTION_CHECK_S at most), and the minimum hold is over."""
        if not self._can_pause or self.gpu.token is None:
            return False
        now = time.monotonic()
        if now < self._next_preemption_check:
            return False
        self._next_preemption_check = now + PREEMPTION_CHECK_S
        waiting = self.gpu.arena.first_class_waiting()
        return preempts(
            waiting,
            priority.rank,
            held_s=now - self.warm_since,
            min_hold_s=self.config.min_hold_s,
        )

    def maybe_release(self, queued: int) -> float | None:
        """Release if the policy says so; else how long its answer holds without a bell (None:
        until one rings, or for good). `queued`: what waits or runs (the queue, the request
        being read, the batch)."""
        if self.state is not ResidencyState.WARM or self.gpu.token is None:
            return None
        now = time.monotonic()
        wanted = self.gpu.token.wanted()  # live lock state, probed here where we decide
        held_s = now - self.warm_since
        quantum_s = self.quantum_s()
        # The waiters' waits matter only while the turn would go on without them: read then
        # alone (a look at the queue lists its folder and reads /proc/locks).
        in_turn = wanted and queued > 0 and held_s < quantum_s
        view = HoldView(
            wanted=wanted,
            held_s=held_s,
            idle_s=now - self.idle_since,
            queued=queued,
            pinned=self.pinned,
            served_since_warm=self.served > self.served_when_warm,
            quantum_s=quantum_s,
            wait_left_s=self.wait_left_s() if in_turn else math.inf,
        )
        min_hold_s, idle_release_s = self.config.min_hold_s, self.config.idle_release_s
        reason = release_reason(view, min_hold_s=min_hold_s, idle_release_s=idle_release_s)
        if reason is None:
            return decided_again_in_s(view, min_hold_s=min_hold_s, idle_release_s=idle_release_s)
        self.cool(reason)
        return None

    def stop(self) -> None:
        """Whatever the state, stopped: the model closed, the token let go of."""
        self.emit(self.residency.transition(self.residency.state, ResidencyState.STOPPED))
        self._backend.close()
        self.gpu.give_up()
        self._doorbell.close()

    def load(self) -> bool:
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
        place, waiting = self.gpu.announce(self.config.priority)
        try:
            with self._beat.waiting_for_others():
                taken = place.take(
                    self.name, model=self.name, cancel=self._inbox.stopping, on_wait=waiting.saw
                )
            self.gpu.got(taken)
        except AcquireCancelledError:
            return False
        finally:
            place.leave()
        wait = waiting.done()
        # Loading is timed from here: the wait for the token is not part of it.
        self.residency = ResidencyMachine(self.name)
        try:
            moved = self._beat.native_call(self._backend.load)
        except EngineError as exc:
            self._fail(exc)
            return False
        self._beat.native_call(lambda: keptkv.adopt(self.config, self._backend))
        self._moved(ResidencyState.LOADING, ResidencyState.WARM, moved, wait=wait)
        self.warm_since = self.idle_since = time.monotonic()
        self.served_when_warm = self.served
        return True

    def _fail(self, exc: EngineError) -> None:
        self.last_error = str(exc)
        self.retry_load = isinstance(exc, DeviceUnreachableError)
        failed = self.residency.transition(
            ResidencyState.LOADING, ResidencyState.FAILED, reason=str(exc)
        )
        self.gpu.give_up()  # before telling anyone: a failed model holds nothing
        self.emit(failed)

    def quantum_s(self) -> float:
        """How long this model's turn lasts, from its measured handoff cost."""
        turns = self.config.turns
        return turn_quantum_s(
            self.handoff.total_s,
            switch_overhead=turns.switch_overhead,
            min_turn_s=turns.min_turn_s,
            max_turn_s=turns.max_turn_s,
        )

    def wait_left_s(self) -> float:
        """The least time a queued waiter has left before it has waited max_wait_s of its own
        class (0 or less: one has); inf when no ticket queues. A stopped waiter is left out: it
        could not take the GPU it was handed (arena/token.py passes it over too)."""
        state = self.gpu.arena.observe()
        bounds = self.config.turns
        left = (
            bounds.bound_s(waiter.priority) - waiter.waited_s(state.observed_ns)
            for waiter in state.queue
            if waiter.pid not in state.stopped_pids
        )
        return min(left, default=math.inf)

    def cool(self, reason: ReleaseReason) -> None:
        """warm → cooling → cold: free the device first, then let go of the token."""
        self.emit(
            self.residency.transition(ResidencyState.WARM, ResidencyState.COOLING, reason=reason)
        )
        # A paused generation resumes from its KV: it is kept whatever the policy says.
        kv = self._kv_policy
        if reason is ReleaseReason.PREEMPTED and kv is KvPolicy.DROP:
            kv = KvPolicy.HOST
        moved = self._beat.native_call(lambda: self._backend.release(kv))
        self._moved(ResidencyState.COOLING, ResidencyState.COLD, moved, reason)
        if reason in FOR_A_WAITER:
            self.gpu.hand_over()
        else:
            self.gpu.give_up()
        self._publish()

    def warm_up(
        self,
        withdrawn: Callable[[], bool],
        priority: Priority,
        queued: tuple[Place, Waiting] | None = None,
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
            if self.config.group != FITTING_GROUP or self._inbox.stopping.is_set():
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
        queued: tuple[Place, Waiting] | None = None,
    ) -> None:
        """One try of `warm_up`: the token, then the restore; a restore that fails is rolled
        back to cold without the token and raised (RestoreError, or what no restore should
        raise)."""
        ticket, waiting = queued or self.gpu.announce(priority)
        try:
            while True:
                self._inbox.wake.clear()
                try:
                    with self._beat.waiting_for_others():
                        taken = ticket.take(
                            self.name, model=self.name, cancel=self._inbox.wake, on_wait=waiting.saw
                        )
                    self.gpu.got(taken)
                    break
                except AcquireCancelledError:
                    if self._inbox.stopping.is_set() or withdrawn():
                        raise
        finally:
            ticket.leave()
        wait = waiting.done()
        self.emit(self.residency.transition(ResidencyState.COLD, ResidencyState.WARMING))
        try:
            moved = self._beat.native_call(self._backend.restore)
        except Exception as exc:
            # Roll back: a model that is not warm must not keep the token. Whatever the restore
            # raised, the model is cold again and the next request may warm it.
            reason = str(exc) if isinstance(exc, EngineError) else type(exc).__name__
            rolled_back = self.residency.transition(
                ResidencyState.WARMING, ResidencyState.COLD, reason=reason
            )
            self.gpu.give_up()
            self.emit(rolled_back)
            if isinstance(exc, EngineError):
                # Out of device memory stays so: `warm_up` may try again.
                oom = isinstance(exc, OutOfDeviceMemoryError)
                error = OutOfDeviceMemoryError if oom else RestoreError
                raise error(f"{self.name} could not be restored: {exc}") from None
            raise
        self._moved(ResidencyState.WARMING, ResidencyState.WARM, moved, wait=wait)
        self.warm_since = self.idle_since = time.monotonic()
        self.served_when_warm = self.served

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
        event = self.residency.transition(
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
            self.handoff = self.handoff.released(event.duration_s)
            event = dataclasses.replace(event, turn_served=self.served_this_turn)
        elif expected is ResidencyState.WARMING and event.duration_s is not None:
            self.handoff = self.handoff.restored(event.duration_s)
        if new is ResidencyState.WARM:
            self._measure_footprint()
        self.emit(event)

    def _gate_footprint(self) -> int | None:
        """The bytes a fitting set's keeper counts for this model (issue 44): its footprint as
        measured when it last became warm, else as predicted; on its accelerators, or on the
        host for a model that has none. None: not known, or retrying alone (`warm_up`)."""
        if self._alone:
            return None
        known = self.footprint or self._backend.predicted_footprint
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
        first, self.footprint = not self.footprint, measured
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

    def emit(self, event: ResidencyEvent) -> None:
        # Published first: whoever sees the event and asks for status sees it applied.
        published = self._publish()
        # What it holds now, not only what moved: the daemon books this where no GPU reader
        # measures (issue 40: a warm CPU model was booked at the 0 bytes its restore moved).
        held = dataclasses.replace(event, resident_bytes=published.resident_bytes)
        self._out.send(held.to_json())
