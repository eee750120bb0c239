"""The residency state machine of one model: its one transition function.

Owns the model's residency state and the record of every transition (with how long the state
it left lasted, and the bytes moved). The states and their table are the shared vocabulary's
(states.ResidencyState, states.RESIDENCY_TRANSITIONS: the daemon and the tray read the same
members); no move outside that table is made. Pure bookkeeping: it moves nothing itself and is
owned by the worker's engine thread; other threads read the immutable event records it returns
(events.ResidencyEvent, the record every process reads them as). states.py draws the machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from arbiterd.errors import InvalidTransitionError
from arbiterd.events import ResidencyEvent
from arbiterd.states import RESIDENCY_TRANSITIONS, ResidencyState


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
        self.state = ResidencyState.LOADING
        self._entered = time.monotonic()

    def transition(
        self,
        expected: ResidencyState,
        new: ResidencyState,
        *,
        weights_bytes: int = 0,
        kv_bytes: int = 0,
        disk_read_bytes: int = 0,
        file_bytes: int = 0,
        copied_bytes: int = 0,
        reason: str = "",
        wait: Wait | None = None,
    ) -> ResidencyEvent:
        """Move from `expected` to `new`, or raise if we are not in `expected` or the table
        forbids it. Returns the event describing the move."""
        if self.state is not expected:
            raise InvalidTransitionError(
                f"{self.model}: expected {expected.value}, but the state is {self.state.value}"
            )
        if new not in RESIDENCY_TRANSITIONS[expected]:
            raise InvalidTransitionError(f"{self.model}: {expected.value} → {new.value}")
        now = time.monotonic()
        event = ResidencyEvent(
            at=time.time(),
            model=self.model,
            from_state=expected,
            to_state=new,
            duration_s=round(now - self._entered, 6),
            weights_bytes=weights_bytes,
            kv_bytes=kv_bytes,
            disk_read_bytes=disk_read_bytes,
            file_bytes=file_bytes,
            copied_bytes=copied_bytes,
            reason=reason,
            waited_from=None if wait is None else wait.since,
            wait_s=None if wait is None else round(wait.wait_s, 6),
            holder_pid=None if wait is None else wait.holder_pid,
            holder_name=None if wait is None else wait.holder_name,
        )
        self.state, self._entered = new, now
        return event
