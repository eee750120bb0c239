"""The residency state machine: its table, its one transition function, its events."""

from __future__ import annotations

import pytest

from arbiterd.errors import InvalidTransitionError
from arbiterd.worker.residency import TRANSITIONS, Residency, State


def test_the_round_trip_walks_the_table() -> None:
    machine = Residency("m")
    path = [State.WARM, State.COOLING, State.COLD, State.WARMING, State.WARM, State.STOPPED]
    events = []
    for new in path:
        events.append(machine.transition(machine.state, new, kv_bytes=7))
    assert [(e.from_state, e.to_state) for e in events] == list(
        zip([State.LOADING, *path[:-1]], path, strict=True)
    )
    assert all(e.duration_s is not None and e.duration_s >= 0 for e in events)
    assert all(e.kv_bytes == 7 and e.model == "m" for e in events)
    assert events[2].to_json()["from"] == "cooling"
    assert events[2].to_json()["to"] == "cold"


def test_a_failed_restore_may_fall_back_to_cold() -> None:
    machine = Residency("m")
    for new in (State.WARM, State.COOLING, State.COLD, State.WARMING, State.COLD):
        machine.transition(machine.state, new)
    assert machine.state is State.COLD


@pytest.mark.parametrize(
    ("start_path", "bad"),
    [
        ((), State.COLD),  # loading cannot skip to cold
        ((State.WARM,), State.COLD),  # warm must cool first
        ((State.WARM, State.COOLING, State.COLD), State.WARM),  # cold must warm first
        ((State.FAILED,), State.WARM),
    ],
)
def test_transitions_outside_the_table_are_refused(
    start_path: tuple[State, ...], bad: State
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
        machine.transition(State.WARM, State.COOLING)


def test_stopped_is_final_and_reachable_from_everywhere_else() -> None:
    assert TRANSITIONS[State.STOPPED] == frozenset()
    assert all(State.STOPPED in targets for s, targets in TRANSITIONS.items() if s != State.STOPPED)
