"""readers.py: the accounting reader for real, select_readers and ReaderSet."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import psutil
import pytest

from arbiterd.daemon.observe.telemetry import (
    GPU_CONTEXT_ALLOWANCE_BYTES,
    AccountingReader,
    DeviceMemory,
    ProcessMemory,
    ReaderSet,
    Reading,
    TelemetryError,
    select_readers,
)
from tests.daemon.observe.telemetry.support import (
    GiB,
    KiB,
    MiB,
    ScriptedReader,
    by_pid,
    name_of,
    no_driver,
    tree,
    two_gpus,
)

# -- accounting ------------------------------------------------------------------------------


def test_accounting_reads_the_workers_own_figures_for_real() -> None:
    me = os.getpid()
    figures = {me: 300 * MiB}
    reader = AccountingReader(lambda: figures)
    assert reader.open() is None
    reading = reader.read()
    assert reading.devices == (
        DeviceMemory(
            "gpu0", "engine accounting (no GPU reader)", psutil.virtual_memory().total, 300 * MiB
        ),
    )
    assert reading.processes == (ProcessMemory(me, "gpu0", 300 * MiB, psutil.Process().name()),)
    figures[me] = 0  # the worker went cold
    assert reader.read().process_bytes(me, "gpu0") == 0
    assert reader.read().process_bytes(me + 1_000_000, "gpu0") == 0


def test_accounting_with_a_configured_total_and_a_failing_source() -> None:
    reader = AccountingReader(lambda: {}, total_bytes=8 * GiB, device="gpu1")
    assert reader.read().devices == (
        DeviceMemory("gpu1", "engine accounting (no GPU reader)", 8 * GiB, 0),
    )

    def broken() -> Mapping[int, int]:
        raise KeyError("worker gone")

    with pytest.raises(TelemetryError, match="accounting: KeyError"):
        AccountingReader(broken).read()


# -- selection -------------------------------------------------------------------------------


def test_nvml_wins_when_it_initialises() -> None:
    sysfs, procfs = tree("amdgpu")
    readers = select_readers(dict, nvml=two_gpus(), sysfs=sysfs, procfs=procfs)
    assert readers.source == "nvml"
    assert readers.describe() == "nvml"
    assert readers.context_allowance_bytes == GPU_CONTEXT_ALLOWANCE_BYTES
    readers.close()


def test_amd_machine_gets_sysfs_totals_and_fdinfo_processes() -> None:
    sysfs, procfs = tree("amdgpu")
    readers = select_readers(dict, nvml=no_driver(), sysfs=sysfs, procfs=procfs, name_of=name_of)
    assert readers.source == "amd-sysfs + drm-fdinfo"
    assert readers.describe() == (
        "amd-sysfs + drm-fdinfo (not used: nvml: nvmlInit: NVML Shared Library Not Found)"
    )
    reading = readers.read()
    assert [(d.device, d.used_bytes) for d in reading.devices] == [
        ("gpu0", 7516192768),
        ("gpu1", 1342177280),
    ]
    assert by_pid(reading)[(4242, "gpu0")] == 6144 * MiB + 262148 * KiB
    assert reading.measured == frozenset({"gpu0", "gpu1"})


def test_intel_machine_gets_fdinfo_only() -> None:
    sysfs, procfs = tree("xe")
    readers = select_readers(dict, nvml=no_driver(), sysfs=sysfs, procfs=procfs)
    assert readers.source == "drm-fdinfo"
    assert "amd-sysfs: no DRM card with mem_info_vram_total" in readers.describe()


def test_a_machine_without_a_gpu_falls_back_to_accounting(tmp_path: Path) -> None:
    readers = select_readers(
        lambda: {os.getpid(): MiB}, nvml=no_driver(), sysfs=tmp_path, procfs=Path("/proc")
    )
    assert readers.source == "accounting"
    assert readers.context_allowance_bytes == 0
    assert "drm-fdinfo: no PCI DRM card" in readers.describe()
    assert readers.read().process_bytes(os.getpid(), "gpu0") == MiB


def test_a_reader_set_keeps_what_works_and_fails_only_when_all_fail() -> None:
    good = ScriptedReader(
        [Reading((DeviceMemory("gpu0", "x", 8, 4),), (), frozenset({"gpu0"}))], "good"
    )
    bad = ScriptedReader([TelemetryError("bad: gone")], "bad")
    reading = ReaderSet((bad, good)).read()
    assert [d.device for d in reading.devices] == ["gpu0"]
    assert reading.errors == ("bad: gone",)
    with pytest.raises(TelemetryError, match="bad: gone"):
        ReaderSet((bad,)).read()
