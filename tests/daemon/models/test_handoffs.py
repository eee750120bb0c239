"""Handoffs as the model that got the GPU measured them: pure, from residency events alone."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

from arbiterd.daemon.models.handoffs import Handoffs
from arbiterd.events import HandoffEvent, ResidencyEvent, WaitEvent
from arbiterd.states import ResidencyState

A_PID, B_PID, GAME_PID = 1001, 1002, 4242
WORKERS = {A_PID: "a", B_PID: "b"}


def released(model: str, at: float, duration_s: float = 0.25) -> ResidencyEvent:
    return ResidencyEvent(
        at=at,
        model=model,
        from_state=ResidencyState.COOLING,
        to_state=ResidencyState.COLD,
        duration_s=duration_s,
    )


def warmed(
    model: str,
    *,
    holder_pid: int | None,
    holder_name: str | None = None,
    waited_from: float | None = 100.0,
    wait_s: float | None = 2.0,
    from_state: str = "warming",
) -> ResidencyEvent:
    return ResidencyEvent(
        at=103.0,
        model=model,
        from_state=ResidencyState(from_state),
        to_state=ResidencyState.WARM,
        duration_s=0.5,
        weights_bytes=3000,
        kv_bytes=200,
        waited_from=waited_from,
        wait_s=wait_s,
        holder_pid=holder_pid,
        holder_name=holder_name,
    )


def test_a_warm_up_behind_another_models_worker_is_a_handoff_with_its_measures() -> None:
    handoffs = Handoffs()
    assert handoffs.observe(released("a", at=101.0, duration_s=0.25), WORKERS) is None
    made = handoffs.observe(warmed("b", holder_pid=A_PID, holder_name="a"), WORKERS)
    assert made == HandoffEvent(
        at=103.0,
        from_model="a",
        to_model="b",
        holder_pid=A_PID,
        waited_from=100.0,
        wait_s=2.0,
        release_s=0.25,  # a's release happened while b waited
        restore_s=0.5,
        restored_bytes=3200,
    )


def test_a_handoff_says_why_the_holder_let_go_a_pause_included() -> None:
    handoffs = Handoffs()
    paused = dataclasses.replace(released("a", at=101.0), reason="preempted")
    handoffs.observe(paused, WORKERS)
    made = handoffs.observe(warmed("b", holder_pid=A_PID), WORKERS)
    assert isinstance(made, HandoffEvent)
    assert made.release_reason == "preempted"
    assert HandoffEvent.from_json(made.to_json()) == made


def test_a_handoff_says_how_many_requests_the_holders_turn_served() -> None:
    """Issue 43: the release that ends a turn counts its requests; the handoff passes it on."""
    handoffs = Handoffs()
    handoffs.observe(replace(released("a", at=101.0), reason="wanted", turn_served=5), WORKERS)
    made = handoffs.observe(warmed("b", holder_pid=A_PID), WORKERS)
    assert isinstance(made, HandoffEvent)
    assert made.turn_served == 5
    stale = Handoffs()  # a release before the wait began is not this handoff's
    stale.observe(replace(released("a", at=99.0), turn_served=5), WORKERS)
    made = stale.observe(warmed("b", holder_pid=A_PID), WORKERS)
    assert isinstance(made, HandoffEvent)
    assert made.turn_served is None


def test_a_handoff_and_a_wait_carry_the_devices_of_the_model_that_got_them() -> None:
    split = ("rpc:127.0.0.1:50052", "rpc:127.0.0.1:50053")
    made = Handoffs().observe(warmed("b", holder_pid=A_PID), WORKERS, split)
    assert isinstance(made, HandoffEvent)
    assert made.devices == split
    assert HandoffEvent.from_json(made.to_json()) == made
    behind = Handoffs().observe(warmed("b", holder_pid=GAME_PID), WORKERS, ("gpu1",))
    assert isinstance(behind, WaitEvent)
    assert behind.devices == ("gpu1",)


def test_a_first_load_behind_another_model_is_a_handoff_too() -> None:
    made = Handoffs().observe(warmed("b", holder_pid=A_PID, from_state="loading"), WORKERS)
    assert isinstance(made, HandoffEvent)
    assert (made.from_model, made.to_model) == ("a", "b")


def test_a_release_before_the_wait_began_is_not_part_of_the_handoff() -> None:
    handoffs = Handoffs()
    handoffs.observe(released("a", at=99.0), WORKERS)  # b began waiting at 100
    made = handoffs.observe(warmed("b", holder_pid=A_PID), WORKERS)
    assert isinstance(made, HandoffEvent)
    assert made.release_s is None


def test_a_release_of_another_model_is_not_the_holders_release() -> None:
    handoffs = Handoffs()
    handoffs.observe(released("c", at=101.0), {**WORKERS, 1003: "c"})
    made = handoffs.observe(warmed("b", holder_pid=A_PID), WORKERS)
    assert isinstance(made, HandoffEvent)
    assert made.release_s is None


def test_the_latest_release_of_the_holder_is_the_one_that_counts() -> None:
    handoffs = Handoffs()
    handoffs.observe(released("a", at=90.0, duration_s=9.0), WORKERS)
    handoffs.observe(released("a", at=101.5, duration_s=0.5), WORKERS)
    made = handoffs.observe(warmed("b", holder_pid=A_PID), WORKERS)
    assert isinstance(made, HandoffEvent)
    assert made.release_s == 0.5


def test_a_warm_up_behind_a_program_that_is_not_our_model_is_a_wait() -> None:
    made = Handoffs().observe(warmed("b", holder_pid=GAME_PID, holder_name="game"), WORKERS)
    assert made == WaitEvent(
        at=103.0,
        model="b",
        holder_pid=GAME_PID,
        holder_name="game",
        waited_from=100.0,
        wait_s=2.0,
    )


def test_a_foreign_holder_without_a_name_is_a_wait_with_an_empty_name() -> None:
    made = Handoffs().observe(warmed("b", holder_pid=GAME_PID), WORKERS)
    assert isinstance(made, WaitEvent)
    assert made.holder_name == ""


def test_a_wait_behind_the_models_own_earlier_worker_is_not_a_handoff_to_itself() -> None:
    made = Handoffs().observe(warmed("a", holder_pid=A_PID), WORKERS)
    assert isinstance(made, WaitEvent)
    assert made.model == "a"


def test_a_warm_up_that_found_the_token_free_is_neither() -> None:
    handoffs = Handoffs()
    handoffs.observe(released("a", at=101.0), WORKERS)
    assert handoffs.observe(warmed("b", holder_pid=None), WORKERS) is None


def test_events_that_end_no_wait_are_neither() -> None:
    handoffs = Handoffs()
    for from_state, to_state in [
        ("cold", "warming"),
        ("warm", "cooling"),
        ("loading", "failed"),
        ("warming", "cold"),  # a failed restore rolled back
    ]:
        event = ResidencyEvent(
            at=103.0,
            model="b",
            from_state=ResidencyState(from_state),
            to_state=ResidencyState(to_state),
            holder_pid=A_PID,
        )
        assert handoffs.observe(event, WORKERS) is None, (from_state, to_state)
    nameless = warmed("b", holder_pid=A_PID)
    assert handoffs.observe(replace(nameless, model=None), WORKERS) is None


def test_a_forgotten_model_has_no_release_to_report() -> None:
    handoffs = Handoffs()
    handoffs.observe(released("a", at=101.0), WORKERS)
    handoffs.forget("a")
    handoffs.forget("never-seen")  # forgetting an unknown model is harmless
    made = handoffs.observe(warmed("b", holder_pid=A_PID), WORKERS)
    assert isinstance(made, HandoffEvent)
    assert made.release_s is None
