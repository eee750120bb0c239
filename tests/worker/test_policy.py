"""The release policy, as the pure function it is."""

from __future__ import annotations

import itertools

import pytest

from arbiterd.worker.policy import HoldView, ReleaseReason, decided_again_in_s, release_reason


def decide(
    *,
    wanted: bool = False,
    held_s: float = 10,
    idle_s: float = 0,
    busy: bool = False,
    pinned: bool = False,
    min_hold_s: float = 0.1,
    idle_release_s: float = 0,
) -> ReleaseReason | None:
    view = HoldView(wanted=wanted, held_s=held_s, idle_s=idle_s, busy=busy, pinned=pinned)
    return release_reason(view, min_hold_s=min_hold_s, idle_release_s=idle_release_s)


def test_nobody_waiting_means_keep_holding() -> None:
    assert decide() is None


def test_a_waiter_is_served_after_the_minimum_hold() -> None:
    assert decide(wanted=True, held_s=0.05) is None
    assert decide(wanted=True, held_s=0.1) is ReleaseReason.WANTED


def test_a_queued_request_does_not_block_a_waiters_turn() -> None:
    assert decide(wanted=True, busy=True) is ReleaseReason.WANTED


def test_idle_release_is_off_by_default_and_needs_an_empty_queue() -> None:
    assert decide(idle_s=3600) is None
    assert decide(idle_s=5, idle_release_s=5) is ReleaseReason.IDLE
    assert decide(idle_s=5, idle_release_s=5, busy=True) is None
    assert decide(idle_s=4, idle_release_s=5) is None


def test_a_pinned_model_keeps_the_gpu_whoever_waits() -> None:
    assert decide(wanted=True, pinned=True) is None
    assert decide(idle_s=10, idle_release_s=5, pinned=True) is None


def test_the_minimum_hold_ends_once_the_request_that_woke_the_model_has_run() -> None:
    waking = HoldView(wanted=True, held_s=0.01, idle_s=0.0, busy=False)
    assert release_reason(waking, min_hold_s=0.1, idle_release_s=0) is None
    served = HoldView(wanted=True, held_s=0.01, idle_s=0.0, busy=False, served_since_warm=True)
    assert release_reason(served, min_hold_s=0.1, idle_release_s=0) is ReleaseReason.WANTED
    alone = HoldView(wanted=False, held_s=0.01, idle_s=0.0, busy=False, served_since_warm=True)
    assert release_reason(alone, min_hold_s=0.1, idle_release_s=0) is None


def again_in(
    *,
    wanted: bool = False,
    held_s: float = 10,
    idle_s: float = 0,
    busy: bool = False,
    pinned: bool = False,
    served: bool = False,
    min_hold_s: float = 0.1,
    idle_release_s: float = 0,
) -> float | None:
    view = HoldView(
        wanted=wanted,
        held_s=held_s,
        idle_s=idle_s,
        busy=busy,
        pinned=pinned,
        served_since_warm=served,
    )
    return decided_again_in_s(view, min_hold_s=min_hold_s, idle_release_s=idle_release_s)


def test_nothing_changes_by_itself_for_a_holder_nobody_wants() -> None:
    """A sleeping holder then waits for a bell (or its safety probe) alone."""
    assert again_in() is None
    assert again_in(pinned=True, wanted=True, held_s=0) is None


def test_a_waiter_that_came_early_is_looked_at_again_when_the_minimum_hold_ends() -> None:
    assert again_in(wanted=True, held_s=0.025) == pytest.approx(0.075)
    assert again_in(wanted=True, held_s=0.025, served=True) is None  # released already


def test_an_idle_release_is_looked_at_when_it_is_due() -> None:
    assert again_in(idle_s=3, idle_release_s=5) == pytest.approx(2)
    assert again_in(idle_s=3, idle_release_s=5, busy=True) is None  # a request comes first
    assert again_in(wanted=True, held_s=0.05, idle_s=0.01, idle_release_s=5) == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("wanted", "busy", "pinned", "served"), list(itertools.product((False, True), repeat=4))
)
def test_whenever_it_holds_on_its_answer_is_in_the_future(
    wanted: bool, busy: bool, pinned: bool, served: bool
) -> None:
    """Never 0 or less where release_reason says keep holding: a sleep of 0 would spin."""
    for held_s, idle_s in itertools.product((0.0, 0.05, 0.1, 4.0), (0.0, 4.9, 5.0, 9.0)):
        view = HoldView(
            wanted=wanted,
            held_s=held_s,
            idle_s=idle_s,
            busy=busy,
            pinned=pinned,
            served_since_warm=served,
        )
        limits = {"min_hold_s": 0.1, "idle_release_s": 5.0}
        if release_reason(view, **limits) is None:
            again = decided_again_in_s(view, **limits)
            assert again is None or again > 0
