"""When a warm model should give the GPU up: a pure function of what the engine thread sees.

No I/O, no clocks: the caller reads the live lock state and the times, and applies the answer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReleaseReason(enum.StrEnum):
    WANTED = "wanted"  # another program waits for the token
    IDLE = "idle"  # idle longer than idle_release_s
    PREEMPTED = "preempted"  # paused mid-request for a waiter of a higher class


@dataclass(frozen=True)
class HoldView:
    """What the decision needs, read by the engine thread just before deciding."""

    wanted: bool  # live: want.lock probed now
    held_s: float  # since this model last became warm
    idle_s: float  # since its last request finished (or it became warm)
    busy: bool  # a request is queued for this model
    pinned: bool = False  # the user pinned it: it keeps the GPU whoever waits
    # A request has run since it became warm: the one that woke it is served.
    served_since_warm: bool = False


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
    """Release when wanted, after the minimum hold (it stops ping-pong between two busy
    models) or as soon as a request has run since the model became warm, whichever is first:
    the request that woke it is served, and nobody waits for the rest of the hold on a model
    with nothing to do; or, if configured, after idling that long. A queued request does not stop a
    release for a waiter — the waiter gets its turn and the queue waits for ours. A pinned
    model never releases by itself (an explicit release command still works)."""
    if view.pinned:
        return None
    if view.wanted and (view.held_s >= min_hold_s or view.served_since_warm):
        return ReleaseReason.WANTED
    if idle_release_s > 0 and not view.busy and view.idle_s >= idle_release_s:
        return ReleaseReason.IDLE
    return None


def decided_again_in_s(view: HoldView, *, min_hold_s: float, idle_release_s: float) -> float | None:
    """How long release_reason's None for `view` holds with nothing new to see (no waiter
    arriving, no request): until the minimum hold ends for a waiter that came early, or until
    the idle release is due. None: it holds until something happens. Always > 0 otherwise."""
    if view.pinned:
        return None
    due = []
    if view.wanted and not view.served_since_warm:
        due.append(min_hold_s - view.held_s)
    if idle_release_s > 0 and not view.busy:
        due.append(idle_release_s - view.idle_s)
    later = [s for s in due if s > 0]
    return min(later) if later else None
