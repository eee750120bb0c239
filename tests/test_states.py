"""The shared vocabulary (arbiterd/states.py): tolerant reading and the two transition tables."""

from __future__ import annotations

from typing import Any

import pytest

from arbiterd.states import (
    RESIDENCY_TRANSITIONS,
    SLOT_TRANSITIONS,
    BackendKind,
    RequestStatus,
    ResidencyState,
    SlotState,
    WorkerOp,
)

ENUMS = (ResidencyState, SlotState, WorkerOp, RequestStatus, BackendKind)


@pytest.mark.parametrize("kind", ENUMS)
def test_a_value_this_version_does_not_know_reads_as_unknown(kind: Any) -> None:
    assert kind("a-state-from-a-newer-version") is kind.UNKNOWN


@pytest.mark.parametrize("kind", ENUMS)
def test_every_known_value_reads_as_its_member(kind: Any) -> None:
    for member in kind:
        assert kind(member.value) is member
        assert member == member.value  # StrEnum: serialises as its value


@pytest.mark.parametrize(
    ("table", "kind"), [(RESIDENCY_TRANSITIONS, ResidencyState), (SLOT_TRANSITIONS, SlotState)]
)
def test_the_tables_cover_every_state_and_never_lead_to_or_from_unknown(
    table: dict[Any, frozenset[Any]], kind: Any
) -> None:
    assert set(table) == set(kind)
    assert table[kind.UNKNOWN] == frozenset()
    assert all(kind.UNKNOWN not in targets for targets in table.values())
    assert all(
        kind.STOPPED in targets
        for state, targets in table.items()
        if state not in (kind.STOPPED, kind.UNKNOWN)
    )
