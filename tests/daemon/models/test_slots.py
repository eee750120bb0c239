"""A model slot's lifecycle: the transition table, what each state keeps, and what status shows."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import itertools
import re
from pathlib import Path

import pytest

import arbiterd
from arbiterd.config import Load
from arbiterd.daemon.models.slots import Slot, new_slot
from arbiterd.daemon.models.workerport import WorkerPort
from arbiterd.errors import InvalidTransitionError
from arbiterd.states import SLOT_TRANSITIONS, ResidencyState, SlotState
from tests.support.fakeworkers import IdleWorker
from tests.support.models import model_config
from tests.support.waiting import to_first_wait

WORKER = IdleWorker()  # a slot only keeps its worker; it never calls it
# How a new slot (starting) gets to each state, one allowed move at a time.
PATH_TO: dict[SlotState, tuple[SlotState, ...]] = {
    SlotState.STARTING: (),
    SlotState.READY: (SlotState.READY,),
    SlotState.RESTARTING: (SlotState.RESTARTING,),
    SlotState.FAILED: (SlotState.FAILED,),
    SlotState.STOPPED: (SlotState.STOPPED,),
    SlotState.UNLOADING: (SlotState.READY, SlotState.UNLOADING),
    SlotState.UNLOADED: (SlotState.READY, SlotState.UNLOADING, SlotState.UNLOADED),
}
# UNKNOWN is only read, never moved to or from (tests/test_states.py): not a state a slot is in.
KNOWN = [state for state in SlotState if state is not SlotState.UNKNOWN]
TRANSITIONS = {state: SLOT_TRANSITIONS[state] for state in KNOWN}
ALLOWED = [(old, new) for old, targets in TRANSITIONS.items() for new in sorted(targets)]
REFUSED = [
    (old, new) for old, new in itertools.product(KNOWN, repeat=2) if new not in TRANSITIONS[old]
]


def move(slot: Slot, new: SlotState, reason: str = "") -> None:
    slot.move(new, worker=WORKER if new is SlotState.READY else None, reason=reason)


def report(slot: Slot, residency: str, now: float = 0.0) -> None:
    """What the supervisor does with a worker's residency event."""
    slot.report_residency(ResidencyState(residency), now=now)


def slot_in(state: SlotState) -> Slot:
    slot = Slot(model_config("m"))
    for step in PATH_TO[state]:
        move(slot, step)
    assert slot.state is state
    return slot


def test_the_table_has_every_state_and_any_state_but_stopped_can_stop() -> None:
    assert set(TRANSITIONS) == set(KNOWN)
    assert [s for s in KNOWN if SlotState.STOPPED not in TRANSITIONS[s]] == [SlotState.STOPPED]
    assert len(ALLOWED) == 15  # the diagram in slots.py's docstring, edge by edge


@pytest.mark.parametrize(("old", "new"), ALLOWED)
def test_every_transition_in_the_table_is_allowed(old: SlotState, new: SlotState) -> None:
    slot = slot_in(old)
    move(slot, new)
    assert slot.state is new
    assert (slot.worker is WORKER) is (new is SlotState.READY)
    assert slot.ready.is_set() is (new is SlotState.READY)


@pytest.mark.parametrize(("old", "new"), REFUSED)
def test_every_transition_not_in_the_table_is_refused(old: SlotState, new: SlotState) -> None:
    slot = slot_in(old)
    worker = slot.worker
    with pytest.raises(InvalidTransitionError, match=f"m: {old.value} → {new.value}"):
        move(slot, new)
    assert (slot.state, slot.worker) == (old, worker)  # nothing changed


def test_only_ready_takes_a_worker_and_ready_needs_one() -> None:
    slot = Slot(model_config("m"))
    with pytest.raises(InvalidTransitionError, match="a worker belongs to ready"):
        slot.move(SlotState.READY)
    with pytest.raises(InvalidTransitionError, match="a worker belongs to ready"):
        slot.move(SlotState.RESTARTING, worker=WORKER)
    assert (slot.state, slot.worker, slot.ready.is_set()) == (SlotState.STARTING, None, False)


def test_the_ready_event_is_set_exactly_while_ready() -> None:
    slot = Slot(model_config("m"))
    seen = []
    for step in (
        SlotState.READY,
        SlotState.RESTARTING,
        SlotState.STARTING,
        SlotState.READY,
        SlotState.STOPPED,
    ):
        move(slot, step)
        seen.append((step, slot.ready.is_set(), slot.worker is WORKER))
    assert seen == [
        (SlotState.READY, True, True),
        (SlotState.RESTARTING, False, False),
        (SlotState.STARTING, False, False),
        (SlotState.READY, True, True),
        (SlotState.STOPPED, False, False),
    ]


def test_a_request_waiting_for_the_slot_wakes_when_it_becomes_ready() -> None:
    async def scenario() -> WorkerPort | None:
        slot = Slot(model_config("m"))
        waiting = await to_first_wait(slot.ready.wait())
        assert not waiting.done()
        move(slot, SlotState.READY)
        await asyncio.wait_for(waiting, timeout=10)
        return slot.worker

    assert asyncio.run(scenario()) is WORKER


def test_leaving_ready_forgets_the_workers_residency() -> None:
    slot = slot_in(SlotState.READY)
    report(slot, "warm")
    move(slot, SlotState.RESTARTING, reason="worker killed by signal 9")
    assert (slot.residency, slot.worker) == (None, None)
    assert slot.last_error == "worker killed by signal 9"


def test_a_reason_is_kept_until_another_reason_replaces_it() -> None:
    slot = Slot(model_config("m"))
    move(slot, SlotState.RESTARTING, reason="could not start: EMFILE")
    move(slot, SlotState.STARTING)
    assert slot.last_error == "could not start: EMFILE"
    move(slot, SlotState.FAILED, reason="could not start: mmproj")
    assert slot.last_error == "could not start: mmproj"


def test_status_shows_the_residency_while_ready_and_the_slot_state_otherwise() -> None:
    slot = slot_in(SlotState.READY)
    assert slot.shown_state == "ready"  # no residency reported yet
    report(slot, "warm")
    assert slot.shown_state == "warm"
    move(slot, SlotState.RESTARTING)
    assert slot.shown_state == "restarting"
    assert slot_in(SlotState.FAILED).shown_state == "failed"
    assert slot_in(SlotState.STOPPED).shown_state == "stopped"
    assert Slot(model_config("m")).shown_state == "starting"


def test_a_slot_is_named_after_its_model() -> None:
    assert Slot(model_config("qwen")).name == "qwen"


def test_an_unloaded_slot_shows_unloaded_and_forgets_its_residency() -> None:
    slot = slot_in(SlotState.READY)
    report(slot, "cold", now=1.0)
    move(slot, SlotState.UNLOADING)
    assert slot.shown_state == "unloading"
    assert slot.worker is None
    assert [slot.residency, slot.cold_since] == [None, None]  # what it knew of its worker
    move(slot, SlotState.UNLOADED)
    assert slot.shown_state == "unloaded"
    assert not slot.ready.is_set()


def test_a_wait_for_another_worker_wakes_when_the_slot_moves_on_from_it() -> None:
    async def scenario() -> tuple[bool, bool]:
        slot = slot_in(SlotState.READY)
        waiting = await to_first_wait(slot.worker_changed(WORKER))
        still_waiting = not waiting.done()
        move(slot, SlotState.RESTARTING, reason="worker exited with code 1")
        await asyncio.wait_for(waiting, timeout=10)
        return still_waiting, slot.worker is None

    assert asyncio.run(scenario()) == (True, True)


def test_a_wait_for_another_worker_returns_at_once_when_it_is_not_the_slots() -> None:
    slot = Slot(model_config("m"))  # starting: no worker
    asyncio.run(asyncio.wait_for(slot.worker_changed(WORKER), timeout=10))


# -- one owner: no module but slots.py writes a slot's fields ------------------------------------

FIELDS = frozenset(f.name for f in dataclasses.fields(Slot))
# An object that holds a slot, as the daemon's modules name one.
NAMES_A_SLOT = re.compile(r"slot|victim|retired")


def slot_writes(source: str) -> list[str]:
    """Each assignment to a slot's field (`slot.residency = ...`, `self._slots[n].pinned = ...`,
    `slot.restarts += 1`) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (
                    isinstance(item, ast.Attribute)
                    and item.attr in FIELDS
                    and NAMES_A_SLOT.search(ast.unparse(item.value))
                ):
                    found.append(ast.unparse(item))
    return found


def test_the_check_sees_each_way_of_writing_a_slots_field() -> None:
    source = (
        "slot.residency = 'cold'\n"
        "self._slots[name].pinned = True\n"
        "slot.restarts += 1\n"
        "victim.worker, slot.cold_since = None, 0.0\n"
        "self.state = 1\n"  # an object's own field, not a slot's
        "worker.hello = hello\n"
    )
    assert slot_writes(source) == [
        "slot.residency",
        "self._slots[name].pinned",
        "slot.restarts",
        "victim.worker",
        "slot.cold_since",
    ]


def test_no_module_but_the_slot_writes_its_fields() -> None:
    package = Path(arbiterd.__file__).parent
    writes = {
        f"{path.relative_to(package)}: {write}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "slots.py"
        for write in slot_writes(path.read_text())
    }
    assert not writes, "change a slot through its methods:\n" + "\n".join(sorted(writes))


def test_a_demand_model_begins_unloaded_and_the_others_starting() -> None:
    assert new_slot(model_config("m", load=Load.DEMAND)).state is SlotState.UNLOADED
    assert new_slot(model_config("m")).state is SlotState.STARTING
