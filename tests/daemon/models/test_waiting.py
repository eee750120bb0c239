"""daemon/models/waiting.py on a real arena: a real holder (`arbiterd run`), a real ticket."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from arbiterd.arena import Arena
from arbiterd.daemon.models import waiting
from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.waiting import Waits
from arbiterd.errors import QueueTimeoutError
from arbiterd.procs import WaitNews
from arbiterd.states import Priority, ResidencyState, SlotState
from tests.conftest import Processes
from tests.support.fakeworkers import IdleWorker
from tests.support.models import model_config
from tests.support.waiting import wait_until


class Worker(IdleWorker):
    """Where Waits looks: the pid whose ticket is its place (ours: this test queues it;
    IdleWorker's pid)."""


def cold_slot(**changes: Any) -> Slot:
    slot = Slot(model_config("gemma", **changes))
    slot.move(SlotState.READY, worker=Worker())
    slot.residency = ResidencyState.COLD
    return slot


@pytest.fixture
def game(arena: Arena, procs: Processes) -> int:
    """`arbiterd run --name game` holding the arena's token: its pid."""
    run = [sys.executable, "-m", "arbiterd", "run", "--arena", str(arena.path)]
    holder = procs.start([*run, "--name", "game", "--", "sleep", "60"])

    # holder.json names the command once `arbiterd run` has started it, just after the hold.
    def running() -> bool:
        state = arena.observe()
        return (
            state.holder_pid == holder.pid
            and state.holder is not None
            and (state.holder.command_pid is not None)
        )

    wait_until(running, 20, "the game's hold, running its command")
    return holder.pid


@pytest.fixture
def queued(arena: Arena) -> Iterator[None]:
    """Our ticket in the arena's queue, as a worker waiting for the GPU has one."""
    ticket = arena.queue(Priority.NORMAL)
    yield
    ticket.leave()


def test_a_cold_model_waiting_behind_a_holder_is_told_who_it_is_and_its_place(
    arena: Arena, game: int, queued: None
) -> None:
    news = Waits(arena, notice_after_s=1.0).news(cold_slot())
    assert news is not None
    assert (
        news.text == f"waiting for the GPU, held by game (arbiterd run, pid {game}), 1st in queue"
    )
    assert (news.holder_pid, news.place, news.queued) == (game, 1, 1)


def test_a_model_that_is_warm_or_holds_the_token_does_not_wait(arena: Arena) -> None:
    waits = Waits(arena, notice_after_s=1.0)
    slot = cold_slot()
    with arena.acquire("gemma", model="gemma"):  # held by this process: the slot's worker
        assert waits.news(slot) is None
    slot.residency = ResidencyState.WARM
    assert waits.news(slot) is None


def test_a_request_is_told_of_its_wait_and_given_up_past_max_queue_s(
    arena: Arena, game: int, queued: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(waiting, "NOTICE_EVERY_S", 0.1)
    slot = cold_slot(max_queue_s=0.5)
    told: list[WaitNews] = []
    attempt_cancelled = asyncio.Event()

    async def attempt() -> str:
        try:
            await asyncio.sleep(60)  # a worker that waits for the GPU
        except asyncio.CancelledError:
            attempt_cancelled.set()
            raise
        return "served"

    async def scenario() -> None:
        with pytest.raises(QueueTimeoutError) as caught:
            await Waits(arena, notice_after_s=0.05).request(slot, attempt(), told.append)
        assert attempt_cancelled.is_set()
        assert caught.value.retry_after_s == 1
        message = str(caught.value)
        assert message.startswith("gemma waited 0.5 s for the GPU, its max_queue_s")
        assert f"held by game (arbiterd run, pid {game})" in message

    asyncio.run(scenario())
    assert 2 <= len(told) <= 6  # at 0.05 s, then every 0.1 s until 0.5 s
    assert {news.place for news in told} == {1}


def test_the_watch_ends_once_the_model_has_the_gpu(arena: Arena, game: int, queued: None) -> None:
    slot = cold_slot(max_queue_s=0.3)
    told: list[WaitNews] = []

    async def attempt() -> str:
        await asyncio.sleep(0.15)
        slot.residency = ResidencyState.WARM  # it got the GPU, and generates for a while
        await asyncio.sleep(0.5)
        return "served"

    async def scenario() -> str:
        return await Waits(arena, notice_after_s=0.05).request(slot, attempt(), told.append)

    assert asyncio.run(scenario()) == "served"  # not given up at 0.3 s: it had the GPU
    assert len(told) == 1  # told at 0.05 s; the next look found it warm


def test_nobody_to_tell_and_no_limit_looks_at_nothing(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    def looked(self: Waits, slot: Slot) -> WaitNews | None:
        raise AssertionError("a wait nobody is told of, without a limit, was looked at")

    monkeypatch.setattr(Waits, "news", looked)

    async def attempt() -> str:
        await asyncio.sleep(0.2)
        return "served"

    async def scenario() -> str:
        return await Waits(arena, notice_after_s=0.0).request(cold_slot(), attempt())

    assert asyncio.run(scenario()) == "served"
