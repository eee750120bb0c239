"""The GPU token the daemon holds on someone's behalf: the user's (game mode, `arbiterd hold`)
and a program's it stepped aside for (issue 45, daemon/stepaside/). Owns gpu0's token while
either wants it: taken once, let go once neither does.

Taking it queues first (in the interactive class, ahead of the models' own waits), then asks
every model to release: a worker that released at once and wants the GPU back for a queued
request then queues behind the daemon, not before it. The wait itself runs in a thread (the
arena's acquire blocks); giving up while it waits cancels it, and nothing stays locked.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from arbiterd.arena import Arena, Token
from arbiterd.states import Priority


class DaemonHold:
    def __init__(self, arena: Arena, release_models: Callable[[], Awaitable[None]]) -> None:
        self._arena = arena
        self._release_models = release_models
        self._token: Token | None = None
        self._reasons: set[str] = set()  # who wants it held: "user", "aside"
        self._named_by = ""  # the reason whose label holder.json shows
        self._taking: asyncio.Task[None] | None = None
        self._cancel = threading.Event()

    @property
    def held(self) -> bool:
        return self._token is not None

    def wanted_by(self, reason: str) -> bool:
        return reason in self._reasons

    async def take(self, reason: str, label: str) -> None:
        """Hold the token for `reason` (under `label`, if this takes it); returns once it is
        held. Raises what the wait raised (AcquireCancelledError: every reason gave it up)."""
        self._reasons.add(reason)
        if self._token is not None:
            return
        if self._taking is None or self._taking.done() or self._cancel.is_set():
            # None in flight, or one given up that ends by itself: a wait of our own.
            self._named_by = reason
            self._cancel = threading.Event()
            self._taking = asyncio.get_running_loop().create_task(
                self._take(label, self._cancel), name="hold"
            )
        try:
            await asyncio.shield(self._taking)
        except BaseException:
            self._reasons.discard(reason)
            if not self._reasons:
                self._cancel.set()
            raise

    async def _take(self, label: str, cancel: threading.Event) -> None:
        waiting = asyncio.create_task(
            asyncio.to_thread(
                self._arena.acquire, label, priority=Priority.INTERACTIVE, cancel=cancel
            )
        )
        try:
            await self._release_models()
        except BaseException:
            cancel.set()  # nothing may stay locked for a take that failed
            await asyncio.gather(waiting, return_exceptions=True)
            raise
        token = await waiting
        if cancel.is_set():  # given up just as it came
            token.release()
        else:
            self._token = token

    def relabel(self, reason: str, label: str) -> None:
        """Show `label` in holder.json, if `reason` took the token under its own label."""
        if self._token is not None and self._named_by == reason:
            self._token.rename(label)

    def give_back(self, reason: str) -> bool:
        """`reason` no longer wants it; the token goes once nobody does. True when it went."""
        self._reasons.discard(reason)
        if self._reasons:
            return False
        self._cancel.set()  # a wait in flight gives up
        token, self._token = self._token, None
        if token is None:
            return False
        token.release()
        return True

    def close(self) -> None:
        self._reasons.clear()
        self.give_back("")
