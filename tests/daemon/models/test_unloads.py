"""What the daemon unloads of its own accord: when a cold model becomes due for unloading, and
when the unload watch wakes, as pure functions of the slots (the watches themselves run in
tests/daemon/test_serve.py and test_serve_budgets.py, through a real daemon)."""

from __future__ import annotations

from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.unloads import next_unload_check, unload_due
from arbiterd.states import ResidencyState, SlotState
from tests.support.fakeworkers import IdleWorker
from tests.support.models import model_config


def test_a_model_is_due_for_unloading_once_cold_for_its_unload_after_s() -> None:
    slot = Slot(model_config("m", unload_after_s=60.0))
    slot.move(SlotState.READY, worker=IdleWorker())
    slot.report_residency(ResidencyState.COLD, now=1000.0)
    assert not unload_due(slot, 1059.0)
    assert unload_due(slot, 1060.0)
    slot.residency = ResidencyState.WARM  # cold_since is cleared then too; the state alone says no
    assert not unload_due(slot, 2000.0)
    never = Slot(model_config("n"))  # unload_after_s = 0
    never.move(SlotState.READY, worker=IdleWorker())
    never.report_residency(ResidencyState.COLD, now=0.0)
    assert not unload_due(never, 1e9)


def cold_slot(name: str, *, since: float, unload_after_s: float = 0.0) -> Slot:
    slot = Slot(model_config(name, unload_after_s=unload_after_s))
    slot.move(SlotState.READY, worker=IdleWorker())
    slot.report_residency(ResidencyState.COLD, now=since)
    return slot


def test_the_unload_watch_sleeps_without_a_deadline_while_no_model_can_become_due() -> None:
    never = cold_slot("never", since=0.0)  # no unload_after_s
    warm = cold_slot("warm", since=0.0, unload_after_s=60.0)
    warm.report_residency(ResidencyState.WARM, now=5.0)
    unloaded = Slot(model_config("unloaded", unload_after_s=60.0), state=SlotState.UNLOADED)
    assert next_unload_check([never, warm, unloaded], {}) is None


def test_the_unload_watch_wakes_for_the_first_model_due_or_looked_at_again() -> None:
    soon = cold_slot("soon", since=1000.0, unload_after_s=60.0)
    later = cold_slot("later", since=990.0, unload_after_s=600.0)
    assert next_unload_check([soon, later], {}) == 1060.0
    # Due, but a request waited in it: looked at again then, not at once and again.
    assert next_unload_check([soon, later], {"soon": 1070.0}) == 1070.0
    assert next_unload_check([soon, later], {"soon": 2000.0}) == 1590.0
    assert next_unload_check([soon], {"soon": 10.0}) == 1060.0  # never before it is due
