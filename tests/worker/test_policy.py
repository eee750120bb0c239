"""The release policy, as the pure function it is."""

from __future__ import annotations

from arbiterd.worker.policy import HoldView, ReleaseReason, release_reason


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
