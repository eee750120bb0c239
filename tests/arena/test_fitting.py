"""The fitting set's policy (arbiterd/arena/fitting.py): who is admitted, whose admission is
withdrawn to make room, and when to look again; pure."""

from __future__ import annotations

import dataclasses

from arbiterd.arena.fitting import (
    USE_HALF_LIFE_S,
    USE_TEXT_MAX_BYTES,
    Member,
    Plan,
    Use,
    plan,
)

GIB = 1 << 30


def member(
    name: str,
    footprint: int | None,
    *,
    warm: bool = False,
    waiting: bool = False,
    admitted: bool = False,
    since: float = 0.0,
    use: Use | None = None,
) -> Member:
    return Member(name, footprint, warm, waiting, admitted, since, use or Use())


def test_without_a_budget_every_member_that_waits_is_admitted() -> None:
    members = [member("a", None, waiting=True), member("b", 5 * GIB, warm=True, admitted=True)]
    assert plan(None, members, now=10) == Plan(admit=frozenset({"a"}))


def test_members_that_fit_are_admitted_with_nobody_leaving() -> None:
    members = [
        member("chat", 5 * GIB, warm=True, admitted=True),
        member("embed", GIB // 2, waiting=True),
        member("task", GIB, waiting=True, since=1),
    ]
    assert plan(8 * GIB, members, now=10) == Plan(admit=frozenset({"embed", "task"}))


def test_one_that_does_not_fit_has_others_leave_and_comes_in_once_they_left() -> None:
    members = [
        member("a", 4 * GIB, warm=True, admitted=True),
        member("b", 3 * GIB, warm=True, admitted=True),
        member("c", 3 * GIB, waiting=True),
    ]
    # 4 + 3 + 3 > 8: a leaves (neither was used: the first by name); c comes in once it has
    # left, not before.
    assert plan(8 * GIB, members, now=10) == Plan(withdraw=frozenset({"a"}))
    gone = [member("a", 4 * GIB, warm=True), *members[1:]]  # withdrawn, still leaving
    assert plan(8 * GIB, gone, now=10) == Plan()
    left = [member("a", 4 * GIB), *members[1:]]
    assert plan(8 * GIB, left, now=10) == Plan(admit=frozenset({"c"}))


def test_only_as_many_leave_as_make_room() -> None:
    members = [
        member("a", 2 * GIB, warm=True, admitted=True),
        member("b", 2 * GIB, warm=True, admitted=True),
        member("c", 2 * GIB, warm=True, admitted=True),
        member("d", 4 * GIB, waiting=True),
    ]
    assert plan(7 * GIB, members, now=10).withdraw == frozenset({"a", "b"})
    three = [*members[:3], member("d", 3 * GIB, waiting=True)]
    assert plan(7 * GIB, three, now=10).withdraw == frozenset({"a"})


def test_an_unknown_or_oversized_footprint_takes_the_whole_budget() -> None:
    members = [member("a", GIB, warm=True, admitted=True), member("b", None, waiting=True)]
    assert plan(8 * GIB, members, now=10).withdraw == frozenset({"a"})
    alone = [member("a", GIB), member("big", 20 * GIB, waiting=True)]
    assert plan(8 * GIB, alone, now=10).admit == frozenset({"big"})


def test_the_first_waiter_is_let_in_first() -> None:
    members = [
        member("a", 6 * GIB, warm=True, admitted=True),
        member("big", 4 * GIB, waiting=True, since=1),
        member("small", GIB, waiting=True, since=2),  # would fit, but big came first
    ]
    assert plan(8 * GIB, members, now=10) == Plan(withdraw=frozenset({"a"}))


def test_of_two_used_alike_the_least_recently_used_leaves_first() -> None:
    members = [
        member("busy", 4 * GIB, warm=True, admitted=True),  # used just now
        member("idle", 3 * GIB, warm=True, admitted=True),
        member("new", 3 * GIB, waiting=True),
    ]
    used = [
        dataclasses.replace(members[0], use=Use(1, 9.9)),
        dataclasses.replace(members[1], use=Use(1, 3)),
    ]
    assert plan(8 * GIB, [*used, members[2]], now=10).withdraw == {"idle"}


def test_one_used_often_stays_before_one_used_once_more_recently() -> None:
    # The alternating pattern: a and b asked by turns, c now and then (just now).
    members = [
        member("a", 3 * GIB, warm=True, admitted=True, use=Use(8, 9.5)),
        member("c", 3 * GIB, warm=True, admitted=True, use=Use(1, 9.8)),
        member("b", 3 * GIB, waiting=True),
    ]
    assert plan(7 * GIB, members, now=10).withdraw == {"c"}


def test_a_use_is_forgotten_by_half_every_half_life_and_read_back_from_its_text() -> None:
    use = Use().began(100.0).began(100.0)
    assert use == Use(2.0, 100.0)
    assert use.weight_at(100.0 + USE_HALF_LIFE_S) == 1.0
    assert use.began(100.0 + USE_HALF_LIFE_S) == Use(2.0, 100.0 + USE_HALF_LIFE_S)
    assert Use.from_text(use.to_text()) == use
    assert len(use.to_text()) == len(Use(1e9, 2e9).to_text()) == USE_TEXT_MAX_BYTES
    assert Use.from_text(b"") == Use()
    assert Use.from_text(b"nonsense 1 2") == Use()


def test_a_budget_that_shrank_has_the_least_used_leave_until_it_holds() -> None:
    # Another program took 1 GiB of the 8, then 3: a (used least), then b, leave; c (used
    # most) stays.
    members = [
        member("a", 2 * GIB, warm=True, admitted=True, use=Use(1.0, 10)),
        member("b", 2 * GIB, warm=True, admitted=True, use=Use(2.0, 10)),
        member("c", 3 * GIB, warm=True, admitted=True, use=Use(5.0, 10)),
    ]
    assert plan(7 * GIB, members, now=10) == Plan()
    assert plan(6 * GIB, members, now=10) == Plan(withdraw=frozenset({"a"}))
    assert plan(3 * GIB, members, now=10) == Plan(withdraw=frozenset({"a", "b"}))
    # Nobody comes in while a leaves: its bytes still count.
    waiter = member("d", GIB, waiting=True)
    assert plan(6 * GIB, [*members, waiter], now=10).admit == frozenset()
    left = [dataclasses.replace(members[0], warm=False, admitted=False), *members[1:], waiter]
    assert plan(6 * GIB, left, now=10) == Plan(admit=frozenset({"d"}))


def test_the_last_member_stays_however_small_the_budget_gets() -> None:
    members = [member("a", 4 * GIB, warm=True, admitted=True)]
    assert plan(GIB, members, now=10) == Plan()


def test_a_budget_of_nothing_makes_every_member_warm_alone() -> None:
    # Not known yet, or no room left: the members take turns as models always did.
    members = [member("a", 1, waiting=True), member("b", 1, waiting=True, since=1)]
    assert plan(0, members, now=10) == Plan(admit=frozenset({"a"}))
    warm = [member("a", 1, warm=True, admitted=True), members[1]]
    assert plan(0, warm, now=10) == Plan(withdraw=frozenset({"a"}))
    two = [member("a", 1, warm=True, admitted=True), member("b", 1, warm=True, admitted=True)]
    assert plan(0, two, now=10).withdraw == frozenset({"a"})


def test_a_budget_that_wavers_within_the_tolerance_makes_nobody_leave() -> None:
    members = [
        member("a", 2 * GIB, warm=True, admitted=True),
        member("b", 2 * GIB, warm=True, admitted=True, use=Use(1.0, 10)),
    ]
    half_a_reserve = GIB // 2
    assert plan(4 * GIB - GIB // 4, members, now=10, tolerance=half_a_reserve) == Plan()
    shrunk = plan(3 * GIB, members, now=10, tolerance=half_a_reserve)
    assert shrunk == Plan(withdraw=frozenset({"a"}))
    # A waiter still comes in only within the budget itself.
    waiter = member("c", GIB // 8, waiting=True)
    assert plan(4 * GIB, [*members, waiter], now=10, tolerance=GIB).admit == frozenset()
    # With no room at all, each is alone whatever the tolerance.
    assert plan(0, members, now=10, tolerance=GIB).withdraw == frozenset({"a"})
