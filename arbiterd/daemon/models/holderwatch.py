"""The watch on the workers that hold a token (issues 24, 40): asks each for its status and
applies liveness.judge's verdict on it.

Owns which silent holders have been reported, and the device arenas it reads to tell whether a
loading worker holds its token yet. liveness.py decides (a pure function of what the daemon
heard and a clock); this module asks, reports (a log line, a `holder_silent` event) and kills
(the lifecycle's watch of the worker's exit restarts it as after any crash). Status asks it how
long a worker has been silent (`silence`), so both read the same verdict.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from arbiterd.arena import Arena
from arbiterd.arena.devices import canonical_order
from arbiterd.config import Config
from arbiterd.daemon.models.liveness import (
    Verdict,
    holds_token,
    judge,
    kill_reason,
    ping_interval_s,
    silent_s,
)
from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.workerport import WorkerPort
from arbiterd.errors import ArbiterError
from arbiterd.events import Event, HolderSilentEvent
from arbiterd.paths import device_arena_of
from arbiterd.states import ResidencyState

log = logging.getLogger(__name__)


class HolderWatch:
    """Asks every worker that holds a token for its status, and applies the verdict on each."""

    def __init__(
        self,
        slots: Mapping[str, Slot],
        config: Callable[[], Config],
        publish: Callable[[Event], object],
    ) -> None:
        self._slots = slots  # the supervisor's, read as they are now
        self._config = config  # as it is now: a reload replaces it
        self._publish = publish
        self._device_arenas: dict[Path, Arena] = {}  # a loading worker's, to see if it holds
        self._reported: set[WorkerPort] = set()  # the silent ones, each said once per silence

    async def run(self) -> None:
        """Ask every worker that holds a token (warm, loading, warming, cooling: issues 24, 40)
        for its status each quarter of [daemon] holder_timeout_s (one question in flight per
        worker: a frozen one is sent no more) and apply the verdict on each (liveness.judge):
        one silent for holder_timeout_s is reported, and killed once silent twice that long, so
        the kernel frees its token and the lifecycle restarts it as after any crash. Only the
        holders are asked, and a reported one until it is said to live again: `judge` finds
        every other worker live, and asking it would wake it and the daemon for nothing (issue
        29); `status` asks everyone."""
        reported = self._reported
        while True:
            await asyncio.sleep(ping_interval_s(self._config().daemon.holder_timeout_s))
            now = time.monotonic()
            workers = [(slot, slot.worker) for slot in self._slots.values()]
            reported &= {worker for _, worker in workers if worker is not None}
            for slot, worker in workers:
                if worker is None:
                    continue
                holds = self.holds(slot, worker)
                if holds or worker in reported:
                    worker.ask()
                    self._judge(slot, worker, holds, now, reported)

    def _judge(
        self,
        slot: Slot,
        worker: WorkerPort,
        holds: bool,
        now: float,
        reported: set[WorkerPort],
    ) -> None:
        timeout_s = self._config().daemon.holder_timeout_s
        heard = worker.heard
        verdict = judge(heard, holds=holds, now=now, timeout_s=timeout_s)
        state = slot.residency or ResidencyState.LOADING
        if verdict is Verdict.LIVE:
            if worker in reported:
                reported.discard(worker)
                log.warning("%s shows signs of life again", slot.name)
            return
        silent = silent_s(heard, now)
        if verdict is Verdict.SILENT and worker not in reported:
            reported.add(worker)
            log.warning(
                "%s (pid %d, %s) holds the GPU and has shown no sign of life for %.1f s; "
                "it is killed at %g s",
                slot.name,
                worker.pid,
                state.value,
                silent,
                2 * timeout_s,
            )
        elif verdict is Verdict.KILL and not worker.killed_for:
            reason = kill_reason(silent, timeout_s, state)
            log.error("%s (pid %d) %s", slot.name, worker.pid, reason)
            worker.kill_for(reason)  # the lifecycle's watch of its exit restarts the model
        else:
            return  # said already
        self._publish(
            HolderSilentEvent(
                model=slot.name,
                pid=worker.pid,
                silent_s=round(silent, 3),
                timeout_s=timeout_s,
                killed=verdict is Verdict.KILL,
                state=state.value,
            )
        )

    def silence(self, slot: Slot, worker: WorkerPort) -> float | None:
        """How long `slot`'s worker, holding a token, has shown no sign of life, once that is
        reported (at [daemon] holder_timeout_s); else None."""
        now, timeout_s = time.monotonic(), self._config().daemon.holder_timeout_s
        holds = self.holds(slot, worker)
        if judge(worker.heard, holds=holds, now=now, timeout_s=timeout_s) is Verdict.LIVE:
            return None
        return round(silent_s(worker.heard, now), 1)

    def holds(self, slot: Slot, worker: WorkerPort) -> bool:
        """Whether `slot`'s worker holds a token another model may wait for (liveness.holds_token):
        a loading one is looked up in its devices' arenas, which only a loading one costs (a read
        of /proc/locks per device, as status's holder is read)."""
        holders: set[int] = set()
        if slot.residency is ResidencyState.LOADING and not slot.config.group:
            # A group's member loads through its open gate: the keeper holds the token for it.
            holders = self._token_holders(slot.config.devices)
        return holds_token(slot.residency, pid=worker.pid, holders=holders)

    def _token_holders(self, devices: Iterable[str]) -> set[int]:
        """The pids that hold the tokens of `devices`' arenas now."""
        holders = set()
        try:
            for device in canonical_order(devices):
                path = device_arena_of(device, self._config().daemon.arena)
                arena = self._device_arenas.get(path)
                if arena is None:
                    arena = self._device_arenas[path] = Arena(path)
                holder = arena.observe().holder_pid
                if holder is not None:
                    holders.add(holder)
        except ArbiterError as exc:  # an arena that cannot be read holds nobody we can judge
            log.warning("cannot read the arenas of %s: %s", ", ".join(devices), exc)
        return holders
