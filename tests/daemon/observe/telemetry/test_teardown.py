"""teardown.py: teardown_verdict, TeardownCheck's polling and ColdFootprints."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from arbiterd.daemon.observe.telemetry import (
    GPU_CONTEXT_ALLOWANCE_BYTES,
    ColdFootprints,
    TeardownCheck,
    TeardownOutcome,
    TeardownSample,
    TelemetryError,
    arena_device_name,
    select_readers,
    teardown_verdict,
)
from arbiterd.events import VramNotFreedEvent
from tests.daemon.observe.telemetry.support import (
    WAIT_S,
    WORKER_PID,
    GiB,
    KiB,
    MiB,
    ScriptedReader,
    copied_tree,
    name_of,
    no_driver,
    worker_reading,
)

EXPECTED = 400 * MiB
TOLERANCE = 128 * MiB


def samples(*figures: int | None) -> list[TeardownSample]:
    return [TeardownSample(0.1 * i, figure) for i, figure in enumerate(figures)]


def test_verdict_freed_at_the_first_figure_within_the_cold_footprint() -> None:
    verdict = teardown_verdict(samples(6 * GiB, 3 * GiB, 450 * MiB, 6 * GiB), EXPECTED, TOLERANCE)
    assert verdict.outcome is TeardownOutcome.FREED
    assert verdict.used_bytes == 450 * MiB
    assert verdict.elapsed_s == pytest.approx(0.2)


def test_verdict_not_freed_on_the_latest_known_figure() -> None:
    verdict = teardown_verdict(samples(6 * GiB, 3 * GiB, None), EXPECTED, TOLERANCE)
    assert verdict.outcome is TeardownOutcome.NOT_FREED
    assert verdict.used_bytes == 3 * GiB
    assert verdict.elapsed_s == pytest.approx(0.2)


def test_verdict_tolerance_is_inclusive() -> None:
    at_limit = teardown_verdict(samples(EXPECTED + TOLERANCE), EXPECTED, TOLERANCE)
    assert at_limit.outcome is TeardownOutcome.FREED
    over = teardown_verdict(samples(EXPECTED + TOLERANCE + 1), EXPECTED, TOLERANCE)
    assert over.outcome is TeardownOutcome.NOT_FREED


def test_verdict_unmeasured_when_nothing_could_be_told() -> None:
    assert teardown_verdict(samples(None, None), 0, 0).outcome is TeardownOutcome.UNMEASURED
    assert teardown_verdict([], 0, 0).outcome is TeardownOutcome.UNMEASURED


class FakeTime:
    """A clock that moves only when the check waits: the polling runs without sleeping."""

    def __init__(self, on_wait: Callable[[int], None] | None = None) -> None:
        self.now = 100.0
        self.waits: list[float] = []
        self.on_wait = on_wait

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        if self.on_wait is not None:
            self.on_wait(len(self.waits))
        return False


def test_check_reports_freed_with_the_figure_and_the_time_it_took() -> None:
    reader = ScriptedReader([worker_reading(6 * GiB), worker_reading(3 * GiB), worker_reading(0)])
    time_ = FakeTime()
    check = TeardownCheck(
        reader, tolerance_bytes=TOLERANCE, clock=time_.clock, wait=time_.wait, poll_s=0.1
    )
    result = check.run(
        "qwen", WORKER_PID, expected_bytes=EXPECTED, bytes_before=6 * GiB, device="gpu0"
    )
    assert result.outcome is TeardownOutcome.FREED
    assert result.freed
    assert result.bytes_after == 0
    assert result.waited_s == pytest.approx(0.2)
    assert result.event() is None
    assert reader.reads == 3


def test_check_reports_vram_not_freed_after_the_deadline() -> None:
    reader = ScriptedReader([worker_reading(6 * GiB), worker_reading(3 * GiB)])
    time_ = FakeTime()
    check = TeardownCheck(
        reader,
        deadline_s=2.0,
        poll_s=0.1,
        tolerance_bytes=TOLERANCE,
        clock=time_.clock,
        wait=time_.wait,
    )
    result = check.run("qwen", WORKER_PID, expected_bytes=EXPECTED, device="gpu0")
    assert result.outcome is TeardownOutcome.NOT_FREED
    assert result.event() == VramNotFreedEvent(
        model="qwen",
        pid=WORKER_PID,
        device="gpu0",
        bytes_before=6 * GiB,  # the first sample, none was given
        bytes_after=3 * GiB,
        expected_bytes=EXPECTED,
        waited_s=2.0,
    )
    assert sum(time_.waits) == pytest.approx(2.0)
    assert reader.reads == 21  # at 0 s, then every 0.1 s up to 2 s


def test_check_that_cannot_measure_says_so_and_raises_no_alarm() -> None:
    reader = ScriptedReader([TelemetryError("nvml: GPU is lost")])
    time_ = FakeTime()
    check = TeardownCheck(reader, deadline_s=0.5, clock=time_.clock, wait=time_.wait)
    result = check.run("qwen", WORKER_PID, expected_bytes=0)
    assert result.outcome is TeardownOutcome.UNMEASURED
    assert result.event() is None
    assert result.outcome.value == "unmeasured"


def test_cancelled_check_stops_waiting_at_once() -> None:
    check = TeardownCheck(ScriptedReader([worker_reading(6 * GiB)]), deadline_s=600.0, poll_s=300.0)
    check.cancel()
    result = check.run("qwen", WORKER_PID, expected_bytes=EXPECTED, device="gpu0")
    assert result.outcome is TeardownOutcome.NOT_FREED
    assert result.waited_s < 1.0


def test_check_polls_in_real_time_within_its_deadline() -> None:
    reader = ScriptedReader([worker_reading(6 * GiB)])
    check = TeardownCheck(reader, deadline_s=0.05, poll_s=0.01)
    result = check.run("qwen", WORKER_PID, expected_bytes=EXPECTED, device="gpu0")
    assert result.outcome is TeardownOutcome.NOT_FREED
    assert 0.05 <= result.waited_s < WAIT_S
    assert reader.reads >= 2


def amd_release(procfs: Path) -> None:
    """What the worker's release does to its fdinfo: client 12's VRAM goes; client 13 (its
    context) stays."""
    for fd in ("5", "6"):
        path = procfs / "4242" / "fdinfo" / fd
        path.write_text(
            path.read_text()
            .replace("drm-resident-vram:\t6144 MiB", "drm-resident-vram:\t0")
            .replace("drm-total-vram:\t7168 MiB", "drm-total-vram:\t0")
            .replace("drm-memory-vram:\t6291456 KiB", "drm-memory-vram:\t0 KiB")
        )


def test_teardown_on_the_amdgpu_tree_finds_the_cold_footprint(tmp_path: Path) -> None:
    sysfs, procfs = copied_tree("amdgpu", tmp_path)
    readers = select_readers(dict, nvml=no_driver(), sysfs=sysfs, procfs=procfs, name_of=name_of)
    footprints = ColdFootprints(readers.context_allowance_bytes)
    time_ = FakeTime(on_wait=lambda n: amd_release(procfs) if n == 3 else None)
    check = TeardownCheck(readers, clock=time_.clock, wait=time_.wait)
    result = check.run(
        "qwen", 4242, expected_bytes=footprints.expected("qwen"), device=arena_device_name(0)
    )
    footprints.record(result)
    assert result.outcome is TeardownOutcome.FREED
    assert result.bytes_before == 6144 * MiB + 262148 * KiB
    assert result.bytes_after == 262148 * KiB
    assert result.waited_s == pytest.approx(0.3)
    assert footprints.footprint("qwen") == 262148 * KiB
    assert footprints.expected("qwen") == 262148 * KiB  # verified: the next check expects it


def test_teardown_on_the_amdgpu_tree_catches_vram_that_stays(tmp_path: Path) -> None:
    sysfs, procfs = copied_tree("amdgpu", tmp_path)
    readers = select_readers(dict, nvml=no_driver(), sysfs=sysfs, procfs=procfs, name_of=name_of)
    footprints = ColdFootprints(readers.context_allowance_bytes)
    time_ = FakeTime()
    check = TeardownCheck(readers, clock=time_.clock, wait=time_.wait)
    result = check.run("qwen", 4242, expected_bytes=footprints.expected("qwen"), device="gpu0")
    footprints.record(result)
    event = result.event()
    assert event is not None
    assert event.kind == "vram_not_freed"
    assert event.bytes_after == 6144 * MiB + 262148 * KiB
    assert event.expected_bytes == GPU_CONTEXT_ALLOWANCE_BYTES
    assert footprints.footprint("qwen") == 6144 * MiB + 262148 * KiB  # shown to the user
    assert footprints.expected("qwen") == GPU_CONTEXT_ALLOWANCE_BYTES  # a leak is not learned
    footprints.forget("qwen")
    assert footprints.footprint("qwen") is None


def test_teardown_with_the_accounting_reader_for_real(tmp_path: Path) -> None:
    me = os.getpid()
    figures = {me: 300 * MiB}
    readers = select_readers(lambda: figures, nvml=no_driver(), sysfs=tmp_path, procfs=tmp_path)
    footprints = ColdFootprints(readers.context_allowance_bytes)

    def release(n: int) -> None:
        figures[me] = 0

    time_ = FakeTime(on_wait=release)
    result = TeardownCheck(readers, clock=time_.clock, wait=time_.wait).run(
        "qwen", me, expected_bytes=footprints.expected("qwen"), device="gpu0"
    )
    footprints.record(result)
    assert (result.outcome, result.bytes_before, result.bytes_after) == (
        TeardownOutcome.FREED,
        300 * MiB,
        0,
    )
    assert footprints.to_json() == {"qwen": 0}
