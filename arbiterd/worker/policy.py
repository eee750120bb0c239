"""When a warm model should give the GPU up: a pure function of what the engine thread sees.

No I/O, no clocks: the caller reads the live lock state, its queue, the waiters' waits and the
times, and applies the answer. Also what a turn is worth (issue 43): the quantum a wanted model
keeps the GPU for while it has work queued, sized from what a handoff measurably costs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from arbiterd.states import ReleaseReason


@dataclass(frozen=True)
class HoldView:
    """What the decision needs, read by the engine thread just before deciding."""

    wanted: bool  # live: want.lock probed now
    held_s: float  # since this model last became warm: how long its turn has lasted
    idle_s: float  # since its last request finished (or it became warm)
    # Requests (and commands) this model has to serve: the one it prepares and those queued.
    queued: int
    pinned: bool = False  # the user pinned it: it keeps the GPU whoever waits
    # A request has run since it became warm: the one that woke it is served.
    served_since_warm: bool = False
    # How long a turn lasts (turn_quantum_s); 0: no turn, the GPU goes after one request.
    quantum_s: float = 0.0
    # The least time any queued waiter has left before it has waited max_wait_s of its class
    # (0 or less: one has waited longer); inf: no waiter says how long it has waited (a bare
    # `want.lock`, or nobody looked because the answer could not change).
    wait_left_s: float = math.inf

    @property
    def busy(self) -> bool:
        """A request is queued for this model."""
        return self.queued > 0

    @property
    def turn_over(self) -> bool:
        """Its turn is over: nothing left to serve, the quantum spent, or a waiter's bound
        reached. While it is not, a wanted model keeps the GPU for its own queue."""
        return not self.busy or self.held_s >= self.quantum_s or self.wait_left_s <= 0


def preempts(
    waiting_rank: int | None, running_rank: int, *, held_s: float, min_hold_s: float
) -> bool:
    """Whether a generation of class `running_rank` pauses for the first waiter's class
    (`waiting_rank`, None: nobody queues): only for a higher class (a lower rank), and not
    before the minimum hold."""
    return waiting_rank is not None and waiting_rank < running_rank and held_s >= min_hold_s


def release_reason(
    view: HoldView, *, min_hold_s: float, idle_release_s: float
) -> ReleaseReason | None:
    """Release when wanted, once the minimum hold is over (it stops ping-pong between two busy
    models) or a request has run since the model became warm, and its turn is over: a model
    with nothing queued lets go at once, one with work queued serves it until its quantum is
    spent or a waiter has waited its class's bound (issue 43: releasing after every request
    spent the GPU on handoffs, 669 for 672 requests). Or, if configured, after idling that
    long. A pinned model never releases by itself (an explicit release command still works)."""
    if view.pinned:
        return None
    if view.wanted and (view.held_s >= min_hold_s or view.served_since_warm) and view.turn_over:
        return ReleaseReason.WANTED
    if idle_release_s > 0 and not view.busy and view.idle_s >= idle_release_s:
        return ReleaseReason.IDLE
    return None


def decided_again_in_s(view: HoldView, *, min_hold_s: float, idle_release_s: float) -> float | None:
    """How long release_reason's None for `view` holds with nothing new to see (no waiter
    arriving, no request): until the minimum hold ends for a waiter that came early, the turn's
    quantum is spent or a waiter reaches its bound, or until the idle release is due. None: it
    holds until something happens. Always > 0 otherwise: a sooner deadline only means a look
    that finds the answer unchanged, never a missed one."""
    if view.pinned:
        return None
    due = []
    if view.wanted and not view.served_since_warm:
        due.append(min_hold_s - view.held_s)
    if view.wanted and view.busy:
        due.extend((view.quantum_s - view.held_s, view.wait_left_s))
    if idle_release_s > 0 and not view.busy:
        due.append(idle_release_s - view.idle_s)
    later = [s for s in due if 0 < s < math.inf]
    return min(later) if later else None


def turn_quantum_s(
    handoff_s: float, *, switch_overhead: float, min_turn_s: float, max_turn_s: float
) -> float:
    """How long a turn lasts so that handoffs take at most `switch_overhead` of the time: a turn
    of q after a handoff of h spends h / (h + q) switching, so q = h x (1 - s) / s, clamped to
    [min_turn_s, max_turn_s] (a CPU scheduler's time slice against its context-switch cost)."""
    quantum = handoff_s * (1 - switch_overhead) / switch_overhead
    return min(max(quantum, min_turn_s), max_turn_s)


# What a model's handoff is taken to cost until one has been measured: the upper end of what a
# release plus a restore took on this project's machines (0.05-0.3 s, docs/scheduling.md), so a
# first turn errs long (one handoff fewer) rather than short; on a GPU, where an 8 GB model's
# handoff is 0.5-1 s, the first measurement lengthens it. It is half release, half restore.
PRIOR_HANDOFF_S = 0.3
# The weight of each new measurement in the moving average: the last few handoffs dominate, so
# a model whose handoffs got dearer (its KV grew, the device got busier) is seen within a few.
HANDOFF_SMOOTHING = 0.3


@dataclass(frozen=True)
class HandoffCost:
    """What handing the GPU over costs one model, as its worker measured it: a moving average of
    its releases (warm → cold) and of its restores (cold → warm). A handoff between two models
    is one's release and the other's restore; over a round each pays its own pair, so a model's
    turn is sized from its own. The first token after a restore is not counted: with the KV
    kept (kv_on_release "host" or "device") it costs what it would have without a handoff, and
    with "drop" the re-prefill depends on the request, not on the switch."""

    release_s: float = PRIOR_HANDOFF_S / 2
    restore_s: float = PRIOR_HANDOFF_S / 2
    releases: int = 0  # measured so far; the prior stands until the first
    restores: int = 0

    @property
    def total_s(self) -> float:
        return self.release_s + self.restore_s

    @property
    def measured(self) -> bool:
        return self.releases > 0 and self.restores > 0

    def released(self, seconds: float) -> HandoffCost:
        return HandoffCost(
            _averaged(self.release_s, seconds, self.releases),
            self.restore_s,
            self.releases + 1,
            self.restores,
        )

    def restored(self, seconds: float) -> HandoffCost:
        return HandoffCost(
            self.release_s,
            _averaged(self.restore_s, seconds, self.restores),
            self.releases,
            self.restores + 1,
        )


def _averaged(average: float, seconds: float, count: int) -> float:
    """The moving average after `seconds`; the first measurement replaces the prior."""
    if count == 0:
        return seconds
    return average + HANDOFF_SMOOTHING * (seconds - average)
