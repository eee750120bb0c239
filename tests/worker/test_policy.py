"""The release policy and the turns it gives (issue 43), as the pure functions they are."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import pytest

from arbiterd.states import ReleaseReason
from arbiterd.worker.policy import (
    HANDOFF_SMOOTHING,
    PRIOR_HANDOFF_S,
    HandoffCost,
    HoldView,
    decided_again_in_s,
    release_reason,
    turn_quantum_s,
)


def view(
    *,
    wanted: bool = False,
    held_s: float = 10,
    idle_s: float = 0,
    queued: int = 0,
    pinned: bool = False,
    served: bool = False,
    quantum_s: float = 0,
    wait_left_s: float = math.inf,
) -> HoldView:
    """A snapshot with the defaults the tests start from: warm for 10 s, nothing queued."""
    return HoldView(
        wanted=wanted,
        held_s=held_s,
        idle_s=idle_s,
        queued=queued,
        pinned=pinned,
        served_since_warm=served,
        quantum_s=quantum_s,
        wait_left_s=wait_left_s,
    )


def decide(
    *, min_hold_s: float = 0.1, idle_release_s: float = 0, **seen: Any
) -> ReleaseReason | None:
    return release_reason(view(**seen), min_hold_s=min_hold_s, idle_release_s=idle_release_s)


def test_nobody_waiting_means_keep_holding() -> None:
    assert decide() is None
    assert decide(queued=3, quantum_s=2) is None


def test_a_waiter_is_served_after_the_minimum_hold() -> None:
    assert decide(wanted=True, held_s=0.05) is None
    assert decide(wanted=True, held_s=0.1) is ReleaseReason.WANTED


def test_a_wanted_model_with_nothing_queued_releases_at_once_whatever_its_quantum() -> None:
    assert decide(wanted=True, held_s=0.2, served=True, quantum_s=5) is ReleaseReason.WANTED
    assert decide(wanted=True, held_s=0.01, served=True, quantum_s=5) is ReleaseReason.WANTED


def test_a_wanted_model_serves_its_queue_until_its_turn_ends() -> None:
    """Issue 43: not a handoff per request; the queue is served for the quantum."""
    assert decide(wanted=True, held_s=0.5, queued=3, served=True, quantum_s=2) is None
    assert decide(wanted=True, held_s=1.99, queued=1, served=True, quantum_s=2) is None
    assert decide(wanted=True, held_s=2, queued=3, served=True, quantum_s=2) is ReleaseReason.WANTED


def test_without_a_quantum_a_queued_request_does_not_block_a_waiter() -> None:
    """A quantum of 0 is the policy before turns: the GPU goes after each request."""
    assert decide(wanted=True, queued=2, served=True) is ReleaseReason.WANTED


def test_a_waiter_that_has_waited_its_bound_ends_the_turn() -> None:
    turn = functools.partial(decide, wanted=True, held_s=0.5, queued=4, served=True, quantum_s=5.0)
    assert turn(wait_left_s=0.3) is None
    assert turn(wait_left_s=0) is ReleaseReason.WANTED
    assert turn(wait_left_s=-2) is ReleaseReason.WANTED


def test_the_minimum_hold_still_comes_first_in_a_turn() -> None:
    """A model just woken by its request runs it, whoever waits and however long."""
    early = functools.partial(decide, wanted=True, held_s=0.05, queued=2, wait_left_s=-1)
    assert early() is None
    assert early(served=True) is ReleaseReason.WANTED


def test_idle_release_is_off_by_default_and_needs_an_empty_queue() -> None:
    assert decide(idle_s=3600) is None
    assert decide(idle_s=5, idle_release_s=5) is ReleaseReason.IDLE
    assert decide(idle_s=5, idle_release_s=5, queued=1) is None
    assert decide(idle_s=4, idle_release_s=5) is None


def test_a_pinned_model_keeps_the_gpu_whoever_waits() -> None:
    assert decide(wanted=True, pinned=True) is None
    assert decide(wanted=True, pinned=True, queued=2, quantum_s=1, wait_left_s=-5) is None
    assert decide(idle_s=10, idle_release_s=5, pinned=True) is None


def test_the_minimum_hold_ends_once_the_request_that_woke_the_model_has_run() -> None:
    waking = HoldView(wanted=True, held_s=0.01, idle_s=0.0, queued=0)
    assert release_reason(waking, min_hold_s=0.1, idle_release_s=0) is None
    served = HoldView(wanted=True, held_s=0.01, idle_s=0.0, queued=0, served_since_warm=True)
    assert release_reason(served, min_hold_s=0.1, idle_release_s=0) is ReleaseReason.WANTED
    alone = HoldView(wanted=False, held_s=0.01, idle_s=0.0, queued=0, served_since_warm=True)
    assert release_reason(alone, min_hold_s=0.1, idle_release_s=0) is None


def again_in(*, min_hold_s: float = 0.1, idle_release_s: float = 0, **seen: Any) -> float | None:
    return decided_again_in_s(view(**seen), min_hold_s=min_hold_s, idle_release_s=idle_release_s)


def test_nothing_changes_by_itself_for_a_holder_nobody_wants() -> None:
    """A sleeping holder then waits for a bell (or its safety probe) alone."""
    assert again_in() is None
    assert again_in(queued=2, quantum_s=3, held_s=1) is None
    assert again_in(pinned=True, wanted=True, held_s=0) is None


def test_a_waiter_that_came_early_is_looked_at_again_when_the_minimum_hold_ends() -> None:
    assert again_in(wanted=True, held_s=0.025) == pytest.approx(0.075)
    assert again_in(wanted=True, held_s=0.025, served=True) is None  # released already


def test_a_turn_is_looked_at_again_when_it_ends_or_a_waiter_reaches_its_bound() -> None:
    """The engine thread re-decides then, even with nothing to wake it."""
    turn = functools.partial(
        again_in, wanted=True, held_s=1.0, queued=2, served=True, quantum_s=2.5
    )
    assert turn() == pytest.approx(1.5)
    assert turn(wait_left_s=0.4) == pytest.approx(0.4)


def test_an_idle_release_is_looked_at_when_it_is_due() -> None:
    assert again_in(idle_s=3, idle_release_s=5) == pytest.approx(2)
    assert again_in(idle_s=3, idle_release_s=5, queued=1) is None  # a request comes first
    assert again_in(wanted=True, held_s=0.05, idle_s=0.01, idle_release_s=5) == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("wanted", "queued", "pinned", "served"),
    list(itertools.product((False, True), (0, 2), (False, True), (False, True))),
)
def test_whenever_it_holds_on_its_answer_is_in_the_future_and_holds_till_then(
    wanted: bool, queued: int, pinned: bool, served: bool
) -> None:
    """Never 0 or less where release_reason says keep holding (a sleep of 0 would spin), and
    the answer is still "keep holding" just before that time: no release is looked at late."""
    limits = {"min_hold_s": 0.1, "idle_release_s": 5.0}
    times = (0.0, 0.05, 0.1, 2.0, 4.0)
    for held_s, idle_s, wait_left_s in itertools.product(
        times, (0.0, 4.9, 5.0, 9.0), (math.inf, 1.0, 0.0)
    ):
        seen = HoldView(
            wanted=wanted,
            held_s=held_s,
            idle_s=idle_s,
            queued=queued,
            pinned=pinned,
            served_since_warm=served,
            quantum_s=3.0,
            wait_left_s=wait_left_s,
        )
        if release_reason(seen, **limits) is not None:
            continue
        again = decided_again_in_s(seen, **limits)
        assert again is None or again > 0
        if again is not None:
            almost = again * 0.999
            later = HoldView(
                wanted=wanted,
                held_s=held_s + almost,
                idle_s=idle_s + almost,
                queued=queued,
                pinned=pinned,
                served_since_warm=served,
                quantum_s=3.0,
                wait_left_s=wait_left_s - almost,
            )
            assert release_reason(later, **limits) is None


def test_a_turn_makes_handoffs_the_configured_share_of_the_time() -> None:
    knobs = {"switch_overhead": 0.1, "min_turn_s": 0.5, "max_turn_s": 5.0}
    quantum = turn_quantum_s(0.2, **knobs)
    assert quantum == pytest.approx(1.8)
    assert 0.2 / (0.2 + quantum) == pytest.approx(0.1)
    assert turn_quantum_s(0.2, **{**knobs, "switch_overhead": 0.5}) == pytest.approx(0.5)


def test_the_quantum_is_clamped_to_the_configured_turns() -> None:
    knobs = {"switch_overhead": 0.1, "min_turn_s": 0.5, "max_turn_s": 5.0}
    assert turn_quantum_s(0.01, **knobs) == 0.5  # 0.09 s: a turn no shorter than min_turn_s
    assert turn_quantum_s(1.0, **knobs) == 5.0  # 9 s: no waiter waits more than max_turn_s
    assert turn_quantum_s(0.0, **knobs) == 0.5


def test_the_handoff_cost_is_the_prior_until_measured_then_a_moving_average() -> None:
    cost = HandoffCost()
    assert cost.total_s == PRIOR_HANDOFF_S
    assert not cost.measured
    cost = cost.released(0.02)
    assert cost.release_s == 0.02  # the first measurement replaces the prior
    assert not cost.measured  # no restore measured yet: half the prior stands
    cost = cost.restored(0.04)
    assert cost.measured
    assert cost.total_s == pytest.approx(0.06)
    cost = cost.restored(0.14)
    assert cost.restore_s == pytest.approx(0.04 + HANDOFF_SMOOTHING * 0.1)
    assert (cost.releases, cost.restores) == (1, 2)
