"""The daemon's hold on a real arena, against a real holder (`arbiterd run`): held while the
user or a step aside wants it, let go once neither does; a wait given up leaves nothing locked,
also when a new reason asks again while the old wait is still ending."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import pytest

from arbiterd.arena import Arena
from arbiterd.daemon.stepaside.hold import DaemonHold
from arbiterd.errors import AcquireCancelledError
from tests.support.waiting import until, wait_until


class Releases:
    """The supervisor's "ask every model to release", counted."""

    def __init__(self) -> None:
        self.asked = 0

    async def __call__(self) -> None:
        self.asked += 1


def queued(arena: Arena, label: str) -> bool:
    """Whether a wait under `label` stands in the arena's queue."""
    return any(w.name == label for w in arena.observe().queue)


def holder_of(arena: Arena) -> int | None:
    return arena.observe().holder_pid


def test_held_while_any_reason_wants_it_and_let_go_once_none_does(arena: Arena) -> None:
    releases = Releases()

    async def scenario() -> None:
        hold = DaemonHold(arena, releases)
        await hold.take("user", "arbiterd hold")
        assert hold.held
        assert holder_of(arena) == os.getpid()
        info = arena.observe().holder
        assert info is not None
        assert info.name == "arbiterd hold"
        await hold.take(
            "aside", "blender (pid 5151; arbiterd stepped aside)"
        )  # already held: kept as is
        assert releases.asked == 1
        assert hold.give_back("user") is False  # the step aside still wants it
        assert holder_of(arena) == os.getpid()
        assert hold.give_back("aside") is True
        assert holder_of(arena) is None
        assert not hold.held

    asyncio.run(scenario())


def test_a_wait_given_up_leaves_nothing_locked_and_a_new_take_gets_it(arena: Arena) -> None:
    """The step aside ends while its take still waits behind another holder, and a new one
    begins at once: the first wait must not end holding a token nobody owns."""
    blocker = subprocess.Popen(
        [sys.executable, "-m", "arbiterd", "run", "--arena", str(arena.path), "--", "sleep", "30"],
        start_new_session=True,  # its sleep shares the token: both go, by their group
    )
    try:
        wait_until(lambda: holder_of(arena) == blocker.pid, 10, "the other holder")

        async def scenario() -> None:
            hold = DaemonHold(arena, Releases())
            first_label = "a (pid 1; arbiterd stepped aside)"
            first = asyncio.create_task(hold.take("aside", first_label))
            await until(lambda: queued(arena, first_label), 10, "the first take to queue")
            assert not first.done()  # waits behind the other holder
            assert hold.give_back("aside") is False  # nothing held yet
            with pytest.raises(AcquireCancelledError):
                await first
            second_label = "b (pid 2; arbiterd stepped aside)"
            second = asyncio.create_task(hold.take("aside", second_label))
            await until(lambda: queued(arena, second_label), 10, "the second take to queue")
            assert not second.done()
            os.killpg(blocker.pid, signal.SIGKILL)
            await asyncio.wait_for(second, 10)
            assert hold.held
            info = arena.observe().holder
            assert info is not None
            assert info.name == second_label
            hold.close()
            assert holder_of(arena) is None

        asyncio.run(scenario())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(blocker.pid, signal.SIGKILL)
        blocker.wait()
