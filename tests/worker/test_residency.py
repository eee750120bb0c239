"""The residency state machine: its table, its one transition function, its events."""

from __future__ import annotations

import pytest

from arbiterd.errors import InvalidTransitionError
from arbiterd.states import RESIDENCY_TRANSITIONS, ResidencyState
from arbiterd.worker.residency import Residency


def test_the_round_trip_walks_the_table() -> None:
    machine = Residency("m")
    path = [
        ResidencyState.WARM,
        ResidencyState.COOLING,
        ResidencyState.COLD,
        ResidencyState.WARMING,
        ResidencyState.WARM,
        ResidencyState.STOPPED,
    ]
    events = []
    for new in path:
        events.append(machine.transition(machine.state, new, kv_bytes=7))
    assert [(e.from_state, e.to_state) for e in events] == list(
        zip([ResidencyState.LOADING, *path[:-1]], path, strict=True)
    )
    assert all(e.duration_s is not None and e.duration_s >= 0 for e in events)
    assert all(e.kv_bytes == 7 and e.model == "m" for e in events)
    assert events[2].to_json()["from"] == "cooling"
    assert events[2].to_json()["to"] == "cold"


def test_a_failed_restore_may_fall_back_to_cold() -> None:
    machine = Residency("m")
    for new in (
        ResidencyState.WARM,
        ResidencyState.COOLING,
        ResidencyState.COLD,
        ResidencyState.WARMING,
        ResidencyState.COLD,
    ):
        machine.transition(machine.state, new)
    assert machine.state is ResidencyState.COLD


@pytest.mark.parametrize(
    ("start_path", "bad"),
    [
        ((), ResidencyState.COLD),  # loading cannot skip to cold
        ((ResidencyState.WARM,), ResidencyState.COLD),  # warm must cool first
        (
            (ResidencyState.WARM, ResidencyState.COOLING, ResidencyState.COLD),
            ResidencyState.WARM,
        ),  # cold must warm first
        ((ResidencyState.FAILED,), ResidencyState.WARM),
    ],
)
def test_transitions_outside_the_table_are_refused(
    start_path: tuple[ResidencyState, ...], bad: ResidencyState
) -> None:
    machine = Residency("m")
    for new in start_path:
        machine.transition(machine.state, new)
    before = machine.state
    with pytest.raises(InvalidTransitionError):
        machine.transition(before, bad)
    assert machine.state is before


def test_a_transition_from_the_wrong_state_is_refused() -> None:
    machine = Residency("m")
    with pytest.raises(InvalidTransitionError, match="expected warm"):
        machine.transition(ResidencyState.WARM, ResidencyState.COOLING)


def test_stopped_is_final_and_reachable_from_everywhere_else() -> None:
    # UNKNOWN is no state a model is ever in (only what a newer worker's value reads as).
    assert RESIDENCY_TRANSITIONS[ResidencyState.STOPPED] == frozenset()
    assert all(
        ResidencyState.STOPPED in targets
        for s, targets in RESIDENCY_TRANSITIONS.items()
        if s not in (ResidencyState.STOPPED, ResidencyState.UNKNOWN)
    )
