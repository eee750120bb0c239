"""Handoffs, as the models that got the GPU measured them: pure bookkeeping of residency events.

A worker that ends a load or a warm-up says when it began to ask for the token, how long it
waited and which process held the token then (worker/loop.py). `Handoffs` turns that into a
`handoff` between two of the daemon's models when the holder was one of their workers (with
the holder's release time, when that release happened during the wait), or a `wait` behind a
program that is not one of them (a game, `arbiterd run CMD`, another daemon). Nothing is
inferred from timestamps.
"""

from __future__ import annotations

from collections.abc import Mapping

from arbiterd.events import HandoffEvent, ResidencyEvent, WaitEvent
from arbiterd.states import ResidencyState

# The moves to warm that end a wait for the token: a load, or a warm-up from cold.
_WARMING_UP = frozenset({ResidencyState.LOADING, ResidencyState.WARMING})


class Handoffs:
    """Remembers each model's last release; `observe` every residency event in order."""

    def __init__(self) -> None:
        self._releases: dict[str, ResidencyEvent] = {}  # model -> its last cooling → cold

    def observe(
        self,
        event: ResidencyEvent,
        models_by_pid: Mapping[int, str],
        devices: tuple[str, ...] = (),
    ) -> HandoffEvent | WaitEvent | None:
        """The handoff or wait `event` ends, if it ends one; `models_by_pid` names the daemon's
        live workers, `devices` are the device ids of `event`'s model."""
        model = event.model
        if model is None:
            return None
        if event.from_state is ResidencyState.COOLING and event.to_state is ResidencyState.COLD:
            self._releases[model] = event
            return None
        ends_a_wait = event.to_state is ResidencyState.WARM and event.from_state in _WARMING_UP
        if not ends_a_wait or event.holder_pid is None:
            return None  # not a warm-up, or the token was free
        holder = models_by_pid.get(event.holder_pid)
        if holder is None or holder == model:
            return WaitEvent(
                at=event.at,
                model=model,
                holder_pid=event.holder_pid,
                holder_name=event.holder_name or "",
                waited_from=event.waited_from,
                wait_s=event.wait_s,
                devices=devices,
            )
        release = self._releases.get(holder)
        during_wait = (
            release is not None
            and release.at is not None
            and event.waited_from is not None
            and release.at >= event.waited_from
        )
        return HandoffEvent(
            at=event.at,
            from_model=holder,
            to_model=model,
            holder_pid=event.holder_pid,
            waited_from=event.waited_from,
            wait_s=event.wait_s,
            release_s=release.duration_s if during_wait and release is not None else None,
            restore_s=event.duration_s,
            restored_bytes=event.moved_bytes,
            release_reason=release.release_reason if during_wait and release else None,
            devices=devices,
            turn_served=release.turn_served if during_wait and release else None,
        )

    def forget(self, model: str) -> None:
        self._releases.pop(model, None)
