"""Groups (arbiterd/arena/groups.py): members are warm together under one token the keeper holds; a
waiter from outside makes every member go cold before the token moves; members never hand the
GPU to each other; a killed member holds nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from arbiterd.arena import Arena
from arbiterd.arena.groups import GATE_TRANSITIONS, Gate, GateHold, GateState, Keeper, group_dir
from arbiterd.errors import AcquireCancelledError, BadValueError, InvalidTransitionError
from arbiterd.states import Priority
from tests.support.waiting import wait_until


class Members:
    """Members' ways in, as a worker takes them (queue, then take); whatever a test leaves
    held is let go before its keeper stops (a keeper waits for its members)."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.holds: list[GateHold] = []

    def enter(
        self,
        name: str,
        timeout_s: float = 10,
        *,
        footprint: int | None = None,
        group: str = "pair",
        queued: threading.Event | None = None,
    ) -> GateHold:
        """Queue at the group's gate (then `queued` is set), and take it."""
        ticket = Gate(self.arena, group, name, lambda: footprint).queue(Priority.NORMAL)
        if queued is not None:
            queued.set()
        cancel = threading.Event()
        timer = threading.Timer(timeout_s, cancel.set)
        timer.start()
        try:
            hold = ticket.take(name, cancel=cancel)
        finally:
            timer.cancel()
            ticket.leave()
        self.holds.append(hold)
        return hold

    def release_all(self) -> None:
        for hold in self.holds:
            hold.release()


@pytest.fixture
def members(arena: Arena) -> Iterator[Members]:
    members = Members(arena)
    yield members
    members.release_all()


@pytest.fixture
def keeper(arena: Arena, members: Members) -> Iterator[Keeper]:
    keeper = Keeper(arena, "pair")
    keeper.start()
    yield keeper
    members.release_all()
    keeper.stop()


def test_members_are_warm_together_under_one_token(
    arena: Arena, keeper: Keeper, members: Members
) -> None:
    a = members.enter("a")
    b = members.enter("b")  # a stays warm: no handoff between members
    state = arena.observe()
    assert state.holder_pid == os.getpid()
    assert state.holder is not None
    assert (state.holder.name, keeper.holding) == ("group pair", True)
    assert not a.wanted()
    assert not b.wanted()
    a.release()
    b.release()
    # Every member cold and none waiting: the group lets the token go.
    wait_until(lambda: arena.observe().holder_pid is None, 5, "the keeper to release")
    assert not keeper.holding
    assert keeper.handoffs == 0


def test_an_outside_waiter_gets_the_token_only_once_every_member_is_cold(
    arena: Arena, keeper: Keeper, members: Members
) -> None:
    a, b = members.enter("a"), members.enter("b")
    got: list[float] = []

    def outsider() -> None:
        token = arena.acquire("game", timeout_s=20)
        got.append(time.monotonic())
        time.sleep(0.3)
        token.release()

    thread = threading.Thread(target=outsider)
    thread.start()
    wait_until(lambda: a.wanted() and b.wanted(), 5, "the members to see the outsider")
    assert keeper.gate is GateState.LEAVING
    a.release()
    time.sleep(0.1)  # a window for the token to move, were it free to: an absence needs one
    assert not got, "the token moved while b was still warm"
    b_cold = time.monotonic()
    b.release()
    thread.join(timeout=20)
    assert got
    assert got[0] >= b_cold
    assert keeper.handoffs == 1
    assert not keeper.holding  # its gate shut before the token went


def test_a_member_waits_at_the_gate_while_an_outsider_waits(
    arena: Arena, keeper: Keeper, members: Members
) -> None:
    a = members.enter("a")
    order: list[str] = []

    def outsider() -> None:
        token = arena.acquire("game", timeout_s=20)
        order.append("game")
        time.sleep(0.2)
        token.release()

    thread = threading.Thread(target=outsider)
    thread.start()
    wait_until(a.wanted, 5, "a to see the outsider")

    # b asks while the outsider waits: it must not slip in ahead (that would starve the outsider).
    b_queued = threading.Event()

    def member_b() -> None:
        hold = members.enter("b", timeout_s=20, queued=b_queued)
        order.append("b")
        hold.release()

    b_thread = threading.Thread(target=member_b)
    b_thread.start()
    assert b_queued.wait(10)
    a.release()
    thread.join(timeout=20)
    b_thread.join(timeout=20)
    assert order == ["game", "b"]
    assert keeper.handoffs == 1
    wait_until(lambda: arena.observe().holder_pid is None, 5, "the keeper to release")


def test_a_member_waiting_at_a_shut_gate_can_give_up(arena: Arena) -> None:
    # No keeper runs: the gate never opens.
    Keeper(arena, "pair")  # makes the files; never started
    ticket = Gate(arena, "pair", "a").queue(Priority.NORMAL)
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    with pytest.raises(AcquireCancelledError):
        ticket.take("a", cancel=cancel)
    ticket.leave()


def test_the_keeper_queues_for_the_group_in_its_class(arena: Arena, members: Members) -> None:
    seen: list[bool] = []
    keeper = Keeper(
        arena, "pair", priority=Priority.INTERACTIVE, on_change=lambda g, h: seen.append(h)
    )
    blocker = arena.acquire("game")
    keeper.start()
    try:
        entered = threading.Thread(target=lambda: members.enter("a", timeout_s=20).release())
        entered.start()
        wait_until(lambda: arena.observe().queue, 5, "the keeper to queue")
        (waiter,) = arena.observe().queue
        assert waiter.priority is Priority.INTERACTIVE
        blocker.release()
        entered.join(timeout=20)
        wait_until(lambda: seen == [True, False], 5, "the keeper to take and let go")
    finally:
        keeper.stop()


MEMBER = """
import sys, time
from pathlib import Path
from arbiterd.arena import Arena
from arbiterd.states import Priority
from arbiterd.arena.groups import Gate
ticket = Gate(Arena(Path(sys.argv[1])), "pair", "victim").queue(Priority.NORMAL)
hold = ticket.take("victim")
ticket.leave()
print("in", flush=True)
time.sleep(60)
"""


def test_a_killed_member_holds_nothing(arena: Arena, keeper: Keeper) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", MEMBER, str(arena.path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "in\n"
        got = threading.Event()

        def outsider() -> None:
            arena.acquire("game", timeout_s=20).release()
            got.set()

        thread = threading.Thread(target=outsider)
        thread.start()
        wait_until(lambda: arena.observe().queue, 5, "the outsider to queue")
        time.sleep(0.2)  # a window for the token to move, were it free to: an absence needs one
        assert not got.is_set()  # the member is warm (and deaf: it never looks)
        os.kill(proc.pid, signal.SIGKILL)
        thread.join(timeout=20)
        assert got.is_set()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_a_keeper_stopping_waits_for_its_members(arena: Arena, members: Members) -> None:
    keeper = Keeper(arena, "pair")
    keeper.start()
    a = members.enter("a")
    stopper = threading.Thread(target=keeper.stop)
    stopper.start()
    # The stopping keeper tells its members to leave: a warm member sees it, ...
    wait_until(a.wanted, 5, "the member to be told to leave")
    assert keeper.gate is GateState.STOPPING
    assert stopper.is_alive()
    assert arena.observe().holder_pid == os.getpid()
    a.release()  # ... goes cold by its policy, and only then does the token go
    stopper.join(timeout=10)
    assert not stopper.is_alive()
    assert arena.observe().holder_pid is None


def test_every_gate_state_leads_back_to_shut_and_only_open_leaves_it() -> None:
    assert set(GATE_TRANSITIONS) == set(GateState)
    assert GATE_TRANSITIONS[GateState.SHUT] == {GateState.OPEN}
    assert all(GateState.SHUT in GATE_TRANSITIONS[s] for s in GateState if s is not GateState.SHUT)


def test_the_keeper_refuses_a_move_its_gate_table_does_not_list(arena: Arena) -> None:
    keeper = Keeper(arena, "pair")  # not started: its gate is shut, and stays so
    with pytest.raises(InvalidTransitionError, match="shut"):
        keeper._move(GateState.SHUT, GateState.LEAVING)
    with pytest.raises(InvalidTransitionError, match="shut, not open"):
        keeper._move(GateState.OPEN, GateState.SHUT)
    assert keeper.gate is GateState.SHUT
    assert not keeper.holding


@pytest.mark.parametrize("name", ["", "../x", ".hidden", "a/b", "x" * 65])
def test_group_names_cannot_leave_the_arena(arena: Arena, name: str) -> None:
    with pytest.raises(BadValueError):
        group_dir(arena, name)


def test_group_files_are_private(arena: Arena) -> None:
    Gate(arena, "pair", "a")
    folder = group_dir(arena, "pair")
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "members").stat().st_mode & 0o777 == 0o700
    for name in ("gate.lock", "want.lock", "members/a.want.lock", "members/a.admit.lock"):
        assert (folder / name).stat().st_mode & 0o777 == 0o600


# -- a fitting set: a group with a budget (issue 44) --------------------------------------------


@pytest.fixture
def fitting_keeper(arena: Arena, members: Members) -> Iterator[Keeper]:
    keeper = Keeper(arena, "fit", budget=100)
    keeper.start()
    yield keeper
    members.release_all()
    keeper.stop()


def test_members_that_fit_the_budget_are_warm_together(
    arena: Arena, fitting_keeper: Keeper, members: Members
) -> None:
    a = members.enter("a", footprint=40, group="fit")
    b = members.enter("b", footprint=50, group="fit")
    assert not a.wanted()
    assert not b.wanted()
    assert arena.observe().holder is not None
    assert fitting_keeper.look() == [("a", True, 40), ("b", True, 50)]
    assert fitting_keeper.withdrawals == 0


def test_one_that_does_not_fit_makes_the_least_recently_admitted_leave(
    arena: Arena, fitting_keeper: Keeper, members: Members
) -> None:
    a = members.enter("a", footprint=40, group="fit")
    b = members.enter("b", footprint=50, group="fit")
    entered: list[GateHold] = []
    third = threading.Thread(
        target=lambda: entered.append(members.enter("c", footprint=30, group="fit"))
    )
    third.start()
    wait_until(a.wanted, 5, "a (neither used: the first by name) to be told to leave")
    assert not b.wanted()
    assert not entered  # c waits until a has left: never over the budget
    a.release()
    third.join(timeout=10)
    assert entered
    assert not b.wanted()
    assert not entered[0].wanted()
    assert fitting_keeper.withdrawals == 1
    # The token never moved: the set kept it throughout, nobody outside was involved.
    state = arena.observe()
    assert state.holder is not None
    assert state.holder.name == "group fit"


def test_a_member_that_left_is_admitted_anew_when_it_comes_back(
    arena: Arena, fitting_keeper: Keeper, members: Members
) -> None:
    a = members.enter("a", footprint=60, group="fit")
    a.release()
    b = members.enter("b", footprint=60, group="fit")  # a's admission ended as it left
    assert not b.wanted()
    assert fitting_keeper.withdrawals == 0


def test_a_member_larger_than_the_budget_is_warm_alone_with_a_warning(
    arena: Arena, fitting_keeper: Keeper, members: Members, caplog: pytest.LogCaptureFixture
) -> None:
    a = members.enter("a", footprint=40, group="fit")
    entered: list[GateHold] = []
    big = threading.Thread(
        target=lambda: entered.append(members.enter("big", footprint=500, group="fit"))
    )
    with caplog.at_level("WARNING", logger="arbiterd.arena.groups"):
        big.start()
        wait_until(a.wanted, 5, "a to leave for the big one")
    a.release()
    big.join(timeout=10)
    assert entered
    assert "big takes 500 bytes, more than the budget of 100: it is warm alone" in caplog.text


def test_a_budget_that_shrinks_makes_the_least_used_leave_and_one_that_grows_lets_in(
    arena: Arena, fitting_keeper: Keeper, members: Members
) -> None:
    a = members.enter("a", footprint=40, group="fit")
    b = members.enter("b", footprint=50, group="fit")
    b.used()  # b was asked for: a, used least, is the one to leave
    fitting_keeper.set_budget(60)  # another program took 40 of the device's room
    wait_until(a.wanted, 5, "a to leave for the smaller budget")
    assert not b.wanted()
    assert fitting_keeper.withdrawals == 1
    a.release()
    fitting_keeper.set_budget(100)  # the program is gone: a comes back beside b
    back = members.enter("a", footprint=40, group="fit")
    assert not back.wanted()
    assert not b.wanted()
    assert fitting_keeper.withdrawals == 1


def test_a_member_back_before_its_keeper_looked_is_admitted_for_the_footprint_it_says_now(
    arena: Arena, members: Members, monkeypatch: pytest.MonkeyPatch
) -> None:
    keeper = Keeper(arena, "fit", budget=100)
    # A keeper slow to look (a busy daemon): the member is back before it saw it leave.
    look = keeper._admit

    def slowly(now: float) -> None:
        time.sleep(0.2)
        look(now)

    monkeypatch.setattr(keeper, "_admit", slowly)
    keeper.start()
    try:
        other = members.enter("other", footprint=40, group="fit")
        members.enter("a", footprint=50, group="fit").release()
        # Back at once, its footprint unknown (a retry alone, worker/loop.py): the whole budget.
        entered: list[GateHold] = []
        back = threading.Thread(target=lambda: entered.append(members.enter("a", group="fit")))
        back.start()
        wait_until(other.wanted, 5, "other to leave for a, now counted at the whole budget")
        assert not entered  # not on its admission for 50 bytes
        other.release()
        back.join(timeout=10)
        assert entered
        assert keeper.look() == [("a", True, None), ("other", False, 40)]
    finally:
        members.release_all()
        keeper.stop()
