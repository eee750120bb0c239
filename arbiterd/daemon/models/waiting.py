"""While a request or a command waits for its model to get the GPU (issue 30): says what it
waits for, and gives a request up once it waited longer than its model's `max_queue_s`.

Owns the timing of a wait and nothing else. Whether a model waits, and for whom, is read at
each look from its slot (the residency its worker last reported) and a snapshot of the arenas
of its devices, taken without a lock (procs.WaitNews): a model waits while its worker is loading
(a worker queues for the token before it loads) or cold, and does not hold every one of its
devices' tokens. A model on several devices takes them in the canonical order
(arena/devices.py), so what it waits for is the first of them it does not hold: that arena's
holder and its place in that arena's queue are what it is told (issue 27). A wait is looked at
only at its notice times and its deadline, so nothing wakes while nothing waits (issue 29), and
the watch ends at the first look that finds the model has the GPU: from then on the request is
the model's, however long it runs.

Notices: a stream's first after `[daemon] queue_notice_s`, then every NOTICE_EVERY_S (the HTTP
edge writes each as an SSE comment); a command's after COMMAND_NOTICE_AFTER_S, then every
COMMAND_NOTICE_EVERY_S (the CLI prints those that say something new).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from arbiterd.arena import Arena, ArenaState
from arbiterd.arena.devices import canonical_order
from arbiterd.arena.groups import keeper_name
from arbiterd.daemon.models.slots import Slot
from arbiterd.errors import ArenaError, BadValueError, QueueTimeoutError
from arbiterd.paths import DEFAULT_DEVICE, device_arena_of
from arbiterd.procs import WaitNews, news_for
from arbiterd.states import ResidencyState

NOTICE_EVERY_S = 5.0
COMMAND_NOTICE_AFTER_S = 0.25
COMMAND_NOTICE_EVERY_S = 1.0
# A residency in which a worker that does not hold the token is waiting for it.
_WAITING_IN = frozenset({ResidencyState.LOADING, ResidencyState.COLD})

_T = TypeVar("_T")
NewsListener = Callable[[WaitNews], None]


class Waits:
    def __init__(self, arena: Arena, *, notice_after_s: float) -> None:
        """`arena`: gpu0's; every other device's is its sibling (paths.device_arena_of)."""
        self._arenas: dict[str, Arena] = {DEFAULT_DEVICE: arena}  # by device id, made on use
        self._notice_after_s = notice_after_s

    def _arenas_of(self, devices: Iterable[str]) -> list[Arena]:
        """The arenas of `devices`, in the order a worker takes them."""
        found = []
        for device in canonical_order(devices):
            arena = self._arenas.get(str(device))
            if arena is None:
                gpu0 = self._arenas[DEFAULT_DEVICE].path
                arena = self._arenas[str(device)] = Arena(device_arena_of(device, gpu0))
            found.append(arena)
        return found

    def news(self, slot: Slot) -> WaitNews | None:
        """What `slot`'s model waits for; None when it does not wait for the GPU (it has it,
        or it has no worker to wait with)."""
        worker = slot.worker
        if worker is None or slot.residency not in _WAITING_IN:
            return None
        try:
            states = [arena.observe() for arena in self._arenas_of(slot.config.devices)]
        except (ArenaError, BadValueError, OSError):
            return None  # nothing to say: the worker's own wait reports what is wrong
        state = waited_on(states, worker.pid)
        if state is None:
            return None  # loading or restoring, with every token
        group = slot.config.group
        if group and state.holder is not None and state.holder.name == keeper_name(group):
            return None  # its group has the GPU: it is on its way in
        return news_for(state, worker.pid)

    async def request(
        self, slot: Slot, attempt: Awaitable[_T], on_news: NewsListener | None = None
    ) -> _T:
        """`attempt` (a request to `slot`'s worker), with `on_news` told of its wait at the
        notice times, given up (cancelled, QueueTimeoutError) once it waited past the model's
        max_queue_s (0: never)."""
        limit = slot.config.max_queue_s
        return await self._watch(
            slot,
            attempt,
            on_news,
            first_s=self._notice_after_s,
            every_s=NOTICE_EVERY_S,
            limit_s=limit or None,
        )

    async def command(self, slot: Slot, attempt: Awaitable[_T], on_news: NewsListener) -> _T:
        """`attempt` (a command to `slot`'s worker: warm, release, unload), with `on_news` told
        of its wait soon and then every second; a command is never given up here."""
        return await self._watch(
            slot,
            attempt,
            on_news,
            first_s=COMMAND_NOTICE_AFTER_S,
            every_s=COMMAND_NOTICE_EVERY_S,
            limit_s=None,
        )

    async def _watch(
        self,
        slot: Slot,
        attempt: Awaitable[_T],
        on_news: NewsListener | None,
        *,
        first_s: float,
        every_s: float,
        limit_s: float | None,
    ) -> _T:
        if on_news is None and limit_s is None:
            return await attempt  # nobody to tell, no deadline: nothing to look at
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(attempt)
        started = loop.time()
        notice_at = started + first_s if on_news is not None else math.inf
        deadline = math.inf if limit_s is None else started + limit_s
        try:
            while True:
                timeout = max(0.0, min(notice_at, deadline) - loop.time())
                done, _ = await asyncio.wait({task}, timeout=timeout)
                if done:
                    return task.result()
                news = self.news(slot)
                if news is None:
                    return await task  # the model has the GPU: the request is its own now
                now = loop.time()
                if now >= deadline:
                    raise _gave_up(slot, news, now - started)
                if on_news is not None and now >= notice_at:
                    on_news(news)
                    notice_at = now + every_s
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def waited_on(states: Iterable[ArenaState], pid: int) -> ArenaState | None:
    """Of the arenas of a model's devices (`states`, in the canonical order), the one its worker
    (`pid`) waits on: the first whose token it does not hold; None when it holds them all."""
    return next((state for state in states if state.holder_pid != pid), None)


def _gave_up(slot: Slot, news: WaitNews, waited_s: float) -> QueueTimeoutError:
    retry_after_s = max(1, math.ceil(slot.config.max_queue_s))
    error = QueueTimeoutError(
        f"{slot.name} waited {waited_s:.1f} s for the GPU, its max_queue_s: the GPU is held by "
        f"{news.holder}; try again in {retry_after_s} s"
    )
    error.retry_after_s = retry_after_s
    return error
