"""The residency state machine of one model: an Enum, its transition table, one transition function.

Owns the model's residency state and the record of every transition (with how long the state
it left lasted, and the bytes moved). Pure bookkeeping: it moves nothing itself and is owned by
the worker's engine thread; other threads read the immutable event records it returns
(events.ResidencyEvent, the record every process reads them as).

    loading ──► warm ──► cooling ──► cold ──► warming ──► warm
       │          ▲                    ▲         │
       │          └──── (restore ok) ──┼─────────┘
       │                               └── (restore failed: rolled back)
       └──► failed          any state ──► stopped
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from arbiterd.errors import InvalidTransitionError
from arbiterd.events import ResidencyEvent


class State(enum.StrEnum):
    LOADING = "loading"  # holds the token, reading weights onto the device
    WARM = "warm"  # holds the token; weights and KV on the device
    COOLING = "cooling"  # releasing the device (saving KV to host)
    COLD = "cold"  # no token; weights and KV on the host only
    WARMING = "warming"  # holds the token again; restoring weights and KV
    FAILED = "failed"  # could not load; the reason is in the event
    STOPPED = "stopped"  # the worker exited


TRANSITIONS: dict[State, frozenset[State]] = {
    State.LOADING: frozenset({State.WARM, State.FAILED, State.STOPPED}),
    State.WARM: frozenset({State.COOLING, State.STOPPED}),
    State.COOLING: frozenset({State.COLD, State.STOPPED}),
    State.COLD: frozenset({State.WARMING, State.STOPPED}),
    # warming → cold: the restore failed and was rolled back (the token is given up too).
    State.WARMING: frozenset({State.WARM, State.COLD, State.STOPPED}),
    State.FAILED: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
}


@dataclass(frozen=True)
class Wait:
    """How a model got the token for a load or a warm-up, measured by its worker: when it began
    to ask, how long it waited, and who held the token then (None: it was free)."""

    since: float  # seconds since the epoch
    wait_s: float
    holder_pid: int | None
    holder_name: str | None


class Residency:
    """The current state of one model and the clock of how long it has been in it."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.state = State.LOADING
        self._entered = time.monotonic()

    def transition(
        self,
        expected: State,
        new: State,
        *,
        weights_bytes: int = 0,
        kv_bytes: int = 0,
        disk_read_bytes: int = 0,
        reason: str = "",
        wait: Wait | None = None,
    ) -> ResidencyEvent:
        """Move from `expected` to `new`, or raise if we are not in `expected` or the table
        forbids it. Returns the event describing the move."""
        if self.state is not expected:
            raise InvalidTransitionError(
                f"{self.model}: expected {expected.value}, but the state is {self.state.value}"
            )
        if new not in TRANSITIONS[expected]:
            raise InvalidTransitionError(f"{self.model}: {expected.value} → {new.value}")
        now = time.monotonic()
        event = ResidencyEvent(
            at=time.time(),
            model=self.model,
            from_state=expected.value,
            to_state=new.value,
            duration_s=round(now - self._entered, 6),
            weights_bytes=weights_bytes,
            kv_bytes=kv_bytes,
            disk_read_bytes=disk_read_bytes,
            reason=reason,
            waited_from=None if wait is None else wait.since,
            wait_s=None if wait is None else round(wait.wait_s, 6),
            holder_pid=None if wait is None else wait.holder_pid,
            holder_name=None if wait is None else wait.holder_name,
        )
        self.state, self._entered = new, now
        return event
