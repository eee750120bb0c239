"""What the daemon unloads of its own accord: each model that stayed cold and idle for its
unload_after_s (issues 14, 29), and the least recently used cold, idle models while the host
RAM they keep exceeds [daemon] host_ram_budget (issue 14).

Owns the two watches and their timing: `IdleUnloads` sleeps until the first model is due (a
pure function of the slots, `next_unload_check`) or until woken because one may be due sooner;
`RamBudget` looks at the budget whenever a model goes cold or loads, one look at a time, and
applies budgets.ram_plan. Both unload through the lifecycle's unload path (lifecycle.py), so a
model's prompt cache waits on disk; neither unloads a model whose worker does not answer, or
one a request waits in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any

from arbiterd.config import Config
from arbiterd.daemon.models.budgets import ColdModel, CopyUse, ram_plan
from arbiterd.daemon.models.lifecycle import Lifecycle
from arbiterd.daemon.models.slots import Slot
from arbiterd.errors import ArbiterError
from arbiterd.events import Event, RamBudgetEvent
from arbiterd.states import ResidencyState, SlotState, UnloadReason

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 10.0
# A model due for unloading but not idle (a request waits for the GPU in it) is looked at again
# this soon; one that is not unloaded for another reason (its file gone, its worker not
# answering), one unload_after_s later.
UNLOAD_RETRY_S = 1.0


def unload_at(slot: Slot) -> float | None:
    """When `slot` will have been cold for its unload_after_s (time.monotonic()), if it stays
    cold; None while it is not cold, or has no unload_after_s."""
    after_s = slot.config.unload_after_s
    if (
        after_s <= 0
        or slot.state is not SlotState.READY
        or slot.residency is not ResidencyState.COLD
        or slot.cold_since is None
    ):
        return None
    return slot.cold_since + after_s


def unload_due(slot: Slot, now: float) -> bool:
    """Whether `slot` has been cold for its unload_after_s by `now` (time.monotonic()); whether
    it is also idle (nothing queued) its worker's status says."""
    at = unload_at(slot)
    return at is not None and now >= at


def next_unload_check(slots: Iterable[Slot], retry: Mapping[str, float]) -> float | None:
    """When there is next a model to look at for unloading (time.monotonic()): the first
    moment one is due, or for one found due but not unloaded then, the time in `retry` (by
    name) to look at it again; None while none can become due, however long the daemon idles."""
    return min(
        (
            max(at, retry.get(slot.name, at))
            for slot in slots
            if (at := unload_at(slot)) is not None
        ),
        default=None,
    )


class IdleUnloads:
    """Unloads each model that stayed cold and idle for its unload_after_s."""

    def __init__(self, slots: Mapping[str, Slot], lifecycle: Lifecycle) -> None:
        self._slots = slots  # the supervisor's, read as they are now
        self._lifecycle = lifecycle
        # Set when a model may have become due for unloading sooner: a worker's residency
        # changed, or a reload changed the slots; the watch sleeps until then, or until the
        # first one is due (issue 29).
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """A model may be due sooner (a residency changed, or a reload changed the slots)."""
        self._wake.set()

    async def run(self) -> None:
        """Unload each model that stayed cold and idle for its unload_after_s (issue 14).

        Sleeps until the first model is due (next_unload_check), or until woken because one
        may be due sooner (`wake`): a daemon none of whose models is cold with an
        unload_after_s never wakes for it (issue 29)."""
        retry: dict[str, float] = {}  # found due but not unloaded: looked at again then
        while True:
            self._wake.clear()  # before the slots are read: a change after it wakes
            at = next_unload_check(self._slots.values(), retry)
            delay_s = None if at is None else max(0.0, at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await self._wake.wait()
            now = time.monotonic()
            due = [s for s in self._slots.values() if unload_due(s, now)]
            retry = {s.name: retry[s.name] for s in due if s.name in retry}
            for slot in due:
                if retry.get(slot.name, now) <= now:
                    later = await self._unload_if_idle(slot, now)
                    if later is None:
                        retry.pop(slot.name, None)
                    else:
                        retry[slot.name] = later

    async def _unload_if_idle(self, slot: Slot, now: float) -> float | None:
        """Unload `slot`, due at `now`, if its worker is idle; else when to look again (None:
        no need, its residency changed meanwhile, which wakes the watch)."""
        worker = slot.worker
        assert worker is not None  # ready
        if self._lifecycle.unload_refusal(slot):
            # Its file is gone: it stays (`unload` says why, when asked), unless the file is
            # back by the next look.
            return now + slot.config.unload_after_s
        try:
            live = await worker.status(timeout_s=STATUS_TIMEOUT_S)
            # A request may wait cold for the GPU: not idle.
            if not live.idle:
                return now + UNLOAD_RETRY_S
            if unload_due(slot, now):
                await self._lifecycle.unload(slot, UnloadReason.IDLE)
        except ArbiterError as exc:
            log.warning("%s: could not unload it: %s", slot.name, exc)
            return now + slot.config.unload_after_s
        return None


class RamBudget:
    """Keeps the host RAM the models keep within [daemon] host_ram_budget."""

    def __init__(
        self,
        slots: Mapping[str, Slot],
        lifecycle: Lifecycle,
        config: Callable[[], Config],
        publish: Callable[[Event], object],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._slots = slots  # the supervisor's, read as they are now
        self._lifecycle = lifecycle
        self._config = config  # as it is now: a reload replaces it
        self._publish = publish
        self._spawn = spawn  # the supervisor's: its stop cancels what runs
        # One check at a time; asked again while one runs, it runs once more after it.
        self._check: asyncio.Task[None] | None = None
        self._check_again = False

    def want_check(self) -> None:
        """Look at the host RAM budget soon (a model went cold, or one loaded)."""
        if self._config().daemon.host_ram_budget_bytes <= 0:
            return
        self._check_again = True
        if self._check is None or self._check.done():
            self._check = self._spawn(self._checks())

    async def _checks(self) -> None:
        while self._check_again:
            self._check_again = False
            try:
                await self._keep()
            except ArbiterError as exc:
                log.warning("host RAM budget: %s", exc)

    async def _keep(self) -> None:
        """Unload the least recently used cold, idle models while the host copies and what the
        workers keep on the host (KV caches, weights' own copies) exceed [daemon] host_ram_budget
        (issue 14); each goes through the unload path, so its prompt cache waits on disk."""
        budget = self._config().daemon.host_ram_budget_bytes
        ready = [s for s in self._slots.values() if s.worker is not None]
        lives = await asyncio.gather(
            *(s.worker.status(timeout_s=STATUS_TIMEOUT_S) for s in ready if s.worker),
            return_exceptions=True,
        )
        copies = self._lifecycle.host_copies.leases()
        key = {id(copy): str(n) for n, (copy, _) in enumerate(copies)}
        own_bytes, cold = 0, []
        for slot, live in zip(ready, lives, strict=True):
            if isinstance(live, BaseException):
                continue  # a worker that does not answer is not unloaded by guesswork
            own = live.host_kv_bytes + live.host_weights_bytes
            own_bytes += own
            idle = live.idle
            if (
                slot.residency is ResidencyState.COLD
                and slot.cold_since is not None
                and idle
                and not slot.pinned
                and not self._lifecycle.unload_refusal(slot)
            ):
                lease = slot.copy_lease
                copy = None if lease is None else key.get(id(lease.copy))
                cold.append(ColdModel(slot.name, slot.cold_since, own, copy))
        plan = ram_plan(
            budget,
            copies={key[id(c)]: CopyUse(c.size, leases) for c, leases in copies},
            own_bytes=own_bytes,
            cold=cold,
        )
        if not plan.over:
            return
        if not plan.unload:
            log.info(
                "host RAM %d bytes over its budget %d bytes, and no cold, idle model to unload",
                plan.used_bytes,
                budget,
            )
            return
        log.info(
            "host RAM %d bytes over its budget %d bytes: unloading %s",
            plan.used_bytes,
            budget,
            ", ".join(plan.unload),
        )
        self._publish(
            RamBudgetEvent(
                used_bytes=plan.used_bytes,
                budget_bytes=budget,
                unload=plan.unload,
                after_bytes=plan.after_bytes,
            )
        )
        for name in plan.unload:
            victim = self._slots.get(name)
            # Woken meanwhile (or gone): it is in use again, not least recently used.
            if (
                victim is None
                or victim.residency is not ResidencyState.COLD
                or victim.worker is None
            ):
                continue
            await self._lifecycle.unload(victim, UnloadReason.HOST_RAM_BUDGET)
