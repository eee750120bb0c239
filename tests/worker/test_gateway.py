"""The worker's way to the GPU (worker/gateway.py): a wait measured from its first ask, with the
holder its first busy try saw."""

from __future__ import annotations

from pathlib import Path

from arbiterd.arena.records import ArenaState, HolderInfo
from arbiterd.worker.gateway import Waiting


def held_by(pid: int, name: str) -> ArenaState:
    holder = HolderInfo(pid=pid, name=name, model=name, since=0.0)
    return ArenaState(Path("/arena"), pid, holder, None, (), 0)


def test_a_wait_for_a_free_token_names_no_holder() -> None:
    wait = Waiting().done()
    assert (wait.holder_pid, wait.holder_name) == (None, None)
    assert wait.wait_s >= 0


def test_a_wait_names_the_holder_the_first_busy_try_saw() -> None:
    waiting = Waiting()
    waiting.saw(held_by(101, "alpha"))
    waiting.saw(held_by(202, "beta"))  # a later try, another holder: the wait began with alpha
    wait = waiting.done()
    assert (wait.holder_pid, wait.holder_name) == (101, "alpha")
