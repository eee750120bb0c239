"""The memory budgets' pure policies (which cold model, which state file) and the prompt-cache
folder's bookkeeping, without processes or sleeps."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import psutil
import pytest

from arbiterd.daemon.models.budgets import (
    HOST_SOURCE,
    MEMORY_SOURCE,
    ColdModel,
    CopyUse,
    DeviceBudget,
    Measured,
    PromptCache,
    StateFile,
    cache_evictions,
    device_budget,
    measured_device,
    measured_host,
    ram_plan,
)
from arbiterd.daemon.observe.telemetry import TelemetrySnapshot, build_snapshot
from arbiterd.daemon.observe.telemetry.records import Reading
from arbiterd.errors import DaemonError
from arbiterd.events import DeviceMemory, ProcessMemory
from arbiterd.status import ACCOUNTING_SOURCE

MiB = 1 << 20


# -- a device's fitting set -----------------------------------------------------------------------

GiB = 1 << 30


def test_a_measured_device_gives_its_size_less_the_reserve_less_the_others() -> None:
    measured = Measured(24 * GiB, 3 * GiB, "nvml")
    assert device_budget(None, GiB, measured) == DeviceBudget(
        20 * GiB, 24 * GiB, "nvml", GiB, 3 * GiB
    )
    # [devices] memory below the measured size caps it; above, the device's own size counts.
    assert device_budget(16 * GiB, GiB, measured).budget_bytes == 12 * GiB
    assert device_budget(16 * GiB, GiB, measured).size_source == MEMORY_SOURCE
    assert device_budget(32 * GiB, GiB, measured).budget_bytes == 20 * GiB


def test_a_device_nothing_measures_gives_its_memory_less_the_reserve_or_nothing() -> None:
    assert device_budget(8 * GiB, GiB, None) == DeviceBudget(
        7 * GiB, 8 * GiB, MEMORY_SOURCE, GiB, 0
    )
    # Not known: 0, each member warm alone, as models always took turns.
    assert device_budget(None, GiB, None) == DeviceBudget(0, None, "", GiB, 0)
    # Others that took all the room: 0 as well, never below.
    assert device_budget(None, GiB, Measured(8 * GiB, 9 * GiB, "nvml")).budget_bytes == 0


def snapshot(
    source: str, *processes: ProcessMemory, used: int | None = 10 * GiB
) -> TelemetrySnapshot:
    reading = Reading(
        devices=(DeviceMemory("gpu0", "a GPU", 24 * GiB, used),),
        processes=processes,
        measured=frozenset({"gpu0"}),
    )
    pids = {"chat": 11, "embed": 12, "other": 13}
    return build_snapshot(reading, pids, source=source, at=0.0)


def test_a_reading_counts_all_the_device_uses_but_the_members_as_others() -> None:
    rows = (
        ProcessMemory(11, "gpu0", 5 * GiB, "worker"),  # chat, a member
        ProcessMemory(12, "gpu0", GiB, "worker"),  # embed, a member
        ProcessMemory(13, "gpu0", 2 * GiB, "worker"),  # other: a model outside the set
        ProcessMemory(99, "gpu0", GiB, "game"),
    )
    # 10 GiB used in all: 1 GiB of it no process owns (the driver's), counted with the others.
    found = measured_device(snapshot("nvml", *rows), "gpu0", ["chat", "embed"])
    assert found == Measured(24 * GiB, 4 * GiB, "nvml")
    # Without the device's own figure: the rows that are not the members'.
    found = measured_device(snapshot("nvml", *rows, used=None), "gpu0", ["chat", "embed"])
    assert found == Measured(24 * GiB, 3 * GiB, "nvml")


def test_the_engines_own_accounting_measures_no_device() -> None:
    # It knows no size (it stands in with the host's RAM) and no other program.
    assert measured_device(snapshot(ACCOUNTING_SOURCE), "gpu0", ["chat"]) is None
    assert measured_device(snapshot("nvml"), "gpu1", ["chat"]) is None
    assert measured_device(None, "gpu0", ["chat"]) is None


def test_the_host_measures_its_ram_and_leaves_the_workers_out_of_the_others() -> None:
    alone = measured_host([])
    assert (alone.total_bytes, alone.source) == (psutil.virtual_memory().total, HOST_SOURCE)
    rss = psutil.Process().memory_info().rss
    with_us = measured_host([os.getpid()])  # this process as a worker: its RSS is not others'
    assert with_us.others_bytes <= alone.others_bytes - rss // 2
    assert measured_host([2**22 + 12345]).others_bytes > 0  # a pid gone holds nothing


# -- host RAM ------------------------------------------------------------------------------------


def test_under_the_budget_nobody_is_unloaded() -> None:
    plan = ram_plan(
        100 * MiB,
        copies={"f": CopyUse(60 * MiB, 1)},
        own_bytes=10 * MiB,
        cold=[ColdModel("a", 1.0, 10 * MiB, "f")],
    )
    assert (plan.used_bytes, plan.unload, plan.over) == (70 * MiB, (), False)


def test_no_budget_unloads_nobody_however_much_is_used() -> None:
    plan = ram_plan(
        0, copies={"f": CopyUse(600 * MiB, 1)}, own_bytes=0, cold=[ColdModel("a", 1, 0, "f")]
    )
    assert (plan.unload, plan.over) == ((), False)


def test_the_least_recently_used_cold_model_goes_first_and_only_as_many_as_needed() -> None:
    # Three models, each on its own 50 MiB file; 150 MiB used, 110 allowed: one must go.
    copies = {name: CopyUse(50 * MiB, 1) for name in "abc"}
    cold = [
        ColdModel("b", cold_since=5.0, own_bytes=0, copy="b"),
        ColdModel("a", cold_since=9.0, own_bytes=0, copy="a"),
        ColdModel("c", cold_since=7.0, own_bytes=0, copy="c"),
    ]
    plan = ram_plan(110 * MiB, copies=copies, own_bytes=0, cold=cold)
    assert plan.unload == ("b",)
    assert (plan.used_bytes, plan.after_bytes) == (150 * MiB, 100 * MiB)
    tighter = ram_plan(60 * MiB, copies=copies, own_bytes=0, cold=cold)
    assert tighter.unload == ("b", "c")  # oldest first
    assert tighter.after_bytes == 50 * MiB


def test_a_shared_copy_is_freed_only_by_its_last_user() -> None:
    # x and y share one 100 MiB copy; z has its own 30 MiB one. Unloading x frees only its KV.
    copies = {"shared": CopyUse(100 * MiB, 2), "own": CopyUse(30 * MiB, 1)}
    cold = [
        ColdModel("x", 1.0, 5 * MiB, "shared"),
        ColdModel("y", 2.0, 5 * MiB, "shared"),
        ColdModel("z", 3.0, 0, "own"),
    ]
    plan = ram_plan(100 * MiB, copies=copies, own_bytes=10 * MiB, cold=cold)
    assert plan.used_bytes == 140 * MiB
    # x frees 5 MiB (135), y frees its KV and the shared copy (30): under the budget.
    assert plan.unload == ("x", "y")
    assert plan.after_bytes == 30 * MiB


def test_a_model_whose_unload_frees_nothing_is_passed_over() -> None:
    # "warm" (not a candidate) keeps the shared copy leased: unloading "idle", which has no
    # host KV, would free no byte and cost a load later.
    copies = {"shared": CopyUse(100 * MiB, 2), "own": CopyUse(40 * MiB, 1)}
    cold = [ColdModel("idle", 1.0, 0, "shared"), ColdModel("other", 2.0, 0, "own")]
    plan = ram_plan(120 * MiB, copies=copies, own_bytes=0, cold=cold)
    assert plan.unload == ("other",)
    assert plan.after_bytes == 100 * MiB


def test_a_copy_a_warm_model_uses_stays_however_many_cold_ones_go_before() -> None:
    # "warm" leases the shared copy too: after "a" (with KV) goes, "b" (without) still frees
    # nothing, and is passed over; "c" frees its own copy.
    copies = {"shared": CopyUse(100 * MiB, 3), "own": CopyUse(20 * MiB, 1)}
    cold = [
        ColdModel("a", 1.0, 10 * MiB, "shared"),
        ColdModel("b", 2.0, 0, "shared"),
        ColdModel("c", 3.0, 0, "own"),
    ]
    plan = ram_plan(105 * MiB, copies=copies, own_bytes=10 * MiB, cold=cold)
    assert plan.unload == ("a", "c")
    assert plan.after_bytes == 100 * MiB


def test_a_page_cache_model_frees_its_host_kv() -> None:
    plan = ram_plan(
        10 * MiB,
        copies={},
        own_bytes=30 * MiB,
        cold=[ColdModel("p", 1.0, 30 * MiB, None)],
    )
    assert (plan.unload, plan.after_bytes) == (("p",), 0)


def test_when_every_cold_model_is_not_enough_all_go_and_the_plan_says_it_stays_over() -> None:
    copies = {"warm": CopyUse(200 * MiB, 1), "c": CopyUse(10 * MiB, 1)}
    plan = ram_plan(100 * MiB, copies=copies, own_bytes=0, cold=[ColdModel("c", 1.0, 0, "c")])
    assert plan.unload == ("c",)
    assert plan.after_bytes == 200 * MiB > plan.budget_bytes


# -- the prompt caches on disk -------------------------------------------------------------------


def state(model: str, mib: int, mtime: int) -> StateFile:
    return StateFile(model, mib * MiB, mtime)


def test_the_oldest_files_are_evicted_first_until_the_new_one_fits() -> None:
    files = [state("new", 1, 30), state("old", 2, 10), state("mid", 2, 20)]
    assert cache_evictions(files, 6 * MiB, keep="x", incoming_bytes=2 * MiB) == (
        state("old", 2, 10),
    )
    assert cache_evictions(files, 4 * MiB, keep="x", incoming_bytes=2 * MiB) == (
        state("old", 2, 10),
        state("mid", 2, 20),
    )
    assert cache_evictions(files, 7 * MiB, keep="x", incoming_bytes=2 * MiB) == ()


def test_the_file_being_kept_is_never_evicted_even_when_oldest() -> None:
    files = [state("mine", 3, 1), state("theirs", 3, 2)]
    assert cache_evictions(files, 4 * MiB, keep="mine") == (state("theirs", 3, 2),)


def write_state(folder: Path, model: str, size: int, mtime_s: int) -> Path:
    path = folder / f"{model}.kv"
    path.write_bytes(b"\0" * size)
    os.utime(path, (mtime_s, mtime_s))
    return path


def test_settle_evicts_older_files_to_fit_and_refuses_a_file_larger_than_the_budget(
    tmp_path: Path,
) -> None:
    cache = PromptCache(tmp_path, budget_bytes=1000)
    write_state(tmp_path, "old", 400, 100)
    write_state(tmp_path, "older", 400, 50)
    write_state(tmp_path, "new", 500, 200)
    (tmp_path / ".new.kv.123.tmp").write_bytes(b"\0" * 5000)  # a write in progress: not counted
    assert cache.usage() == {"bytes": 1300, "files": 3, "budget_bytes": 1000}

    settled = cache.settle("new")
    assert [f.model for f in settled.evicted] == ["older"]
    assert settled.refused_bytes == 0
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == ["new.kv", "old.kv"]

    write_state(tmp_path, "huge", 1001, 300)
    settled = cache.settle("huge")
    assert (settled.evicted, settled.refused_bytes) == ((), 1001)
    assert not (tmp_path / "huge.kv").exists()
    assert cache.usage()["bytes"] == 900  # the others are untouched


def test_make_room_does_not_count_the_models_own_old_file(tmp_path: Path) -> None:
    cache = PromptCache(tmp_path, budget_bytes=1000)
    write_state(tmp_path, "me", 600, 10)  # replaced by the save
    write_state(tmp_path, "other", 300, 20)
    assert cache.make_room("me", incoming_bytes=700) == ()
    evicted = cache.make_room("me", incoming_bytes=800)
    assert [f.model for f in evicted] == ["other"]


def test_a_missing_folder_holds_nothing(tmp_path: Path) -> None:
    cache = PromptCache(tmp_path / "absent", budget_bytes=10)
    assert cache.usage() == {"bytes": 0, "files": 0, "budget_bytes": 10}
    assert cache.remove("x") is False


def test_the_prompt_cache_folder_is_made_0700_under_umask_022(tmp_path: Path) -> None:
    folder = tmp_path / "state" / "prompt-cache"
    old = os.umask(0o022)
    try:
        PromptCache(folder, budget_bytes=10).make_private()
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700


def test_a_loose_prompt_cache_folder_is_refused_with_its_fix(tmp_path: Path) -> None:
    folder = tmp_path / "prompt-cache"
    folder.mkdir()
    folder.chmod(0o755)
    with pytest.raises(DaemonError, match=rf"mode 0755; it must be 0700 \(chmod 700 {folder}\)"):
        PromptCache(folder, budget_bytes=10).make_private()
