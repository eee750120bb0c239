"""Measured VRAM: readers on recorded /sys and /proc trees and a fake NVML, the accounting reader
for real, the sampler thread, the teardown verdict and its polling, and the metric series."""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import psutil
import pytest
from prometheus_client import CollectorRegistry, Gauge

from arbiterd.telemetry import (
    GPU_CONTEXT_ALLOWANCE_BYTES,
    AccountingReader,
    AmdSysfsReader,
    ColdFootprints,
    DeviceMemory,
    DrmFdinfoReader,
    NvmlReader,
    ProcessMemory,
    ReaderSet,
    Reading,
    Sampler,
    TeardownCheck,
    TeardownOutcome,
    TeardownSample,
    TelemetryError,
    TelemetrySnapshot,
    VramGauge,
    arena_device_name,
    build_snapshot,
    device_for_arena,
    device_index,
    drm_cards,
    select_readers,
    teardown_verdict,
    vram_series,
)
from arbiterd.telemetry.drm import drm_client, parse_fdinfo, parse_size
from tests.support.waiting import wait_until

FIXTURES = Path(__file__).parent / "fixtures" / "telemetry"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
WAIT_S = 10.0

NAMES = {4242: "python3", 5151: "Game.exe", 3001: "python3", 9001: "python3"}


def name_of(pid: int) -> str | None:
    return NAMES.get(pid)


def tree(machine: str) -> tuple[Path, Path]:
    return FIXTURES / machine / "sys", FIXTURES / machine / "proc"


def copied_tree(machine: str, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / machine
    shutil.copytree(FIXTURES / machine, root, symlinks=True)
    return root / "sys", root / "proc"


def by_pid(reading: Reading) -> dict[tuple[int, str], int | None]:
    return {(p.pid, p.device): p.used_bytes for p in reading.processes}


# -- names and records -----------------------------------------------------------------------


def test_devices_are_named_like_their_arenas() -> None:
    assert arena_device_name(0) == "gpu0"
    assert arena_device_name(3) == "gpu3"
    assert device_index("gpu12") == 12
    assert device_index("cpu") is None
    assert device_for_arena(Path("/run/user/1000/arbiterd/arena/gpu1")) == "gpu1"
    assert device_for_arena(Path("/tmp/my-arena")) == "gpu0"
    with pytest.raises(ValueError, match=">= 0"):
        arena_device_name(-1)


def test_a_process_missing_from_a_measured_device_holds_nothing_elsewhere_unknown() -> None:
    reading = Reading(
        processes=(
            ProcessMemory(1, "gpu0", 5 * GiB, "a"),
            ProcessMemory(2, "gpu0", None, "b"),
        ),
        measured=frozenset({"gpu0"}),
    )
    assert reading.process_bytes(1, "gpu0") == 5 * GiB
    assert reading.process_bytes(2, "gpu0") is None  # listed without a figure: unknown, not 0
    assert reading.process_bytes(3, "gpu0") == 0
    assert reading.process_bytes(3, "gpu1") is None  # nobody measures gpu1's processes
    assert reading.process_bytes(1) == 5 * GiB


# -- fdinfo parsing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("1024 KiB", MiB),
        ("16 MiB", 16 * MiB),
        ("2 GiB", 2 * GiB),
        ("12 B", 12),
        (" 8 KiB ", 8 * KiB),
        ("7 kB", None),
        ("lots", None),
        ("", None),
    ],
)
def test_sizes_parse_in_the_units_drivers_print(text: str, expected: int | None) -> None:
    assert parse_size(text) == expected


def test_amdgpu_padded_keys_parse() -> None:
    fields = parse_fdinfo("drm-driver:\tamdgpu\ndrm-memory-gtt: \t4112 KiB\nnot a field\n")
    assert fields == {"drm-driver": "amdgpu", "drm-memory-gtt": "4112 KiB"}


def test_a_non_drm_fdinfo_is_no_client() -> None:
    text = (FIXTURES / "amdgpu" / "proc" / "7171" / "fdinfo" / "0").read_text()
    assert drm_client(parse_fdinfo(text)) is None


def test_resident_beats_total_beats_the_legacy_key() -> None:
    fields = {
        "drm-driver": "amdgpu",
        "drm-pdev": "0000:03:00.0",
        "drm-client-id": "1",
        "drm-memory-vram": "100 KiB",
        "drm-total-vram": "300 KiB",
        "drm-resident-vram": "200 KiB",
    }
    client = drm_client(fields)
    assert client is not None
    assert client.device_local_bytes == 200 * KiB
    del fields["drm-resident-vram"]
    client = drm_client(fields)
    assert client is not None
    assert client.device_local_bytes == 300 * KiB
    del fields["drm-total-vram"]
    client = drm_client(fields)
    assert client is not None
    assert client.device_local_bytes == 100 * KiB


# -- DRM cards and AMD sysfs -----------------------------------------------------------------


def test_cards_are_pci_gpus_in_card_order_without_connectors_or_render_nodes() -> None:
    sysfs, _ = tree("amdgpu")
    cards = drm_cards(sysfs)
    assert [(c.card, c.pci_address, c.driver, c.device) for c in cards] == [
        (0, "0000:03:00.0", "amdgpu", "gpu0"),
        (1, "0000:0b:00.0", "amdgpu", "gpu1"),
    ]


def test_simpledrm_on_card0_does_not_push_the_gpu_to_gpu1() -> None:
    sysfs, _ = tree("xe")
    assert [(c.card, c.driver, c.device) for c in drm_cards(sysfs)] == [(1, "xe", "gpu0")]


def test_no_drm_class_means_no_cards(tmp_path: Path) -> None:
    assert drm_cards(tmp_path) == ()


def test_amd_sysfs_reads_each_cards_vram() -> None:
    sysfs, _ = tree("amdgpu")
    reader = AmdSysfsReader(sysfs)
    assert reader.open() is None
    reading = reader.read()
    assert reading.devices == (
        DeviceMemory("gpu0", "amdgpu 0000:03:00.0", 17163091968, 7516192768),
        DeviceMemory("gpu1", "AMD Radeon PRO W6600", 8573157376, 1342177280),
    )
    assert reading.devices[0].free_bytes == 17163091968 - 7516192768
    assert reading.measured == frozenset()  # totals only: processes come from fdinfo


def test_amd_sysfs_is_unavailable_without_vram_files() -> None:
    sysfs, _ = tree("xe")
    reason = AmdSysfsReader(sysfs).open()
    assert reason is not None
    assert "mem_info_vram_total" in reason


def test_amd_sysfs_keeps_the_cards_it_can_still_read(tmp_path: Path) -> None:
    sysfs, _ = copied_tree("amdgpu", tmp_path)
    (sysfs / "class" / "drm" / "card1" / "device" / "mem_info_vram_used").unlink()
    reading = AmdSysfsReader(sysfs).read()
    assert [d.device for d in reading.devices] == ["gpu0"]
    assert len(reading.errors) == 1
    assert reading.errors[0].startswith("gpu1: ")
    (sysfs / "class" / "drm" / "card0" / "device" / "mem_info_vram_used").unlink()
    with pytest.raises(TelemetryError, match="amd-sysfs"):
        AmdSysfsReader(sysfs).read()


# -- DRM fdinfo ------------------------------------------------------------------------------


def test_amdgpu_fdinfo_counts_a_shared_client_once_and_sums_two_clients() -> None:
    sysfs, procfs = tree("amdgpu")
    reader = DrmFdinfoReader(procfs, sysfs, name_of=name_of)
    assert reader.open() is None
    reading = reader.read()
    # 4242: client 12 (fds 5 and 6, resident 6144 MiB of a requested 7168) + client 13.
    # 5151: the older format's drm-memory-vram on the second card.
    # 6161 (GTT only) and 7171 (no DRM fd) hold no device memory: not listed.
    assert by_pid(reading) == {
        (4242, "gpu0"): 6144 * MiB + 262148 * KiB,
        (5151, "gpu1"): 1048576 * KiB,
    }
    assert {p.pid: p.name for p in reading.processes} == {4242: "python3", 5151: "Game.exe"}
    assert reading.measured == frozenset({"gpu0", "gpu1"})
    assert reading.process_bytes(6161, "gpu0") == 0


def test_i915_counts_local_memory_not_system_memory() -> None:
    sysfs, procfs = tree("i915")
    reading = DrmFdinfoReader(procfs, sysfs, name_of=name_of).read()
    # client 7 on the Arc (card1 → gpu1): resident local0; client 8 on the iGPU: system0 only.
    assert by_pid(reading) == {(3001, "gpu1"): 3072 * MiB}
    assert reading.process_bytes(3001, "gpu0") == 0


def test_xe_counts_vram0_once_per_client_and_ignores_cycle_counters() -> None:
    sysfs, procfs = tree("xe")
    reading = DrmFdinfoReader(procfs, sysfs, name_of=name_of).read()
    # client 6 on fds 4 and 5 (2052 MiB) + client 9 (512 MiB resident of 1024).
    assert by_pid(reading) == {(9001, "gpu0"): 2052 * MiB + 512 * MiB}


def test_fdinfo_is_read_when_the_fd_link_cannot_be(tmp_path: Path) -> None:
    sysfs, procfs = copied_tree("xe", tmp_path)
    shutil.rmtree(procfs / "9001" / "fd")  # e.g. the link is not ours to read
    reading = DrmFdinfoReader(procfs, sysfs, name_of=name_of).read()
    assert by_pid(reading) == {(9001, "gpu0"): 2564 * MiB}


def test_a_client_on_an_unknown_pci_device_is_skipped(tmp_path: Path) -> None:
    sysfs, procfs = copied_tree("xe", tmp_path)
    shutil.rmtree(sysfs / "class" / "drm" / "card1")  # the eGPU was unplugged
    reading = DrmFdinfoReader(procfs, sysfs, name_of=name_of).read()
    assert reading.processes == ()
    assert reading.measured == frozenset()


def test_fdinfo_is_unavailable_without_processes_or_cards(tmp_path: Path) -> None:
    sysfs, procfs = tree("xe")
    assert DrmFdinfoReader(tmp_path, sysfs).open() == f"drm-fdinfo: no processes under {tmp_path}"
    assert DrmFdinfoReader(procfs, tmp_path).open() == "drm-fdinfo: no PCI DRM card"


def test_fdinfo_reads_this_machines_proc_without_failing() -> None:
    reading = DrmFdinfoReader(name_of=name_of).read()  # no GPU here: an empty, valid reading
    assert all(p.used_bytes for p in reading.processes)


# -- NVML ------------------------------------------------------------------------------------


class FakeNvmlError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code as `value`."""

    MESSAGES: ClassVar[dict[int, str]] = {
        3: "Not Supported",
        9: "Driver Not Loaded",
        12: "NVML Shared Library Not Found",
    }

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self.MESSAGES.get(self.value, f"Unknown Error {self.value}")


@dataclass
class FakeMemory:  # c_nvmlMemory_t
    total: int
    free: int
    used: int


@dataclass
class FakeProcess:  # nvmlFriendlyObject of c_nvmlProcessInfo_v3_t
    pid: int
    usedGpuMemory: int | None  # pynvml's names, camel case and all
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class FakeGpu:
    name: str | bytes
    memory: FakeMemory
    compute: list[FakeProcess] = field(default_factory=list)
    graphics: list[FakeProcess] = field(default_factory=list)
    process_error: int | None = None


class FakeNvml:
    """The pynvml functions telemetry calls, with pynvml's names and shapes."""

    NVMLError = FakeNvmlError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_LIBRARY_NOT_FOUND = 12

    def __init__(self, gpus: Sequence[FakeGpu], *, init_error: int | None = None) -> None:
        self.gpus = list(gpus)
        self.init_error = init_error
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> FakeMemory:
        return handle.memory

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str | bytes:
        return handle.name

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[FakeProcess]:
        if handle.process_error is not None:
            raise FakeNvmlError(handle.process_error)
        return handle.compute

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeGpu) -> list[FakeProcess]:
        return handle.graphics


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(
                "NVIDIA GeForce RTX 4090",
                FakeMemory(total=24 * GiB, free=14 * GiB, used=10 * GiB),
                compute=[FakeProcess(4242, 6 * GiB), FakeProcess(4343, None)],
                # a process with both a CUDA and a graphics context: one figure, listed twice
                graphics=[FakeProcess(4242, 6 * GiB), FakeProcess(5151, 2 * GiB)],
            ),
            FakeGpu(b"NVIDIA RTX A4000", FakeMemory(total=16 * GiB, free=16 * GiB, used=0)),
        ]
    )


def test_the_fake_nvml_has_the_real_modules_names() -> None:
    pynvml = importlib.import_module("pynvml")
    for name in [n for n in dir(FakeNvml) if n.startswith(("nvml", "NVML"))]:
        assert hasattr(pynvml, name), name


def test_nvml_reads_devices_and_merges_compute_and_graphics_processes() -> None:
    nvml = two_gpus()
    reader = NvmlReader(nvml, name_of=name_of)
    assert reader.open() is None
    reading = reader.read()
    assert reading.devices == (
        DeviceMemory("gpu0", "NVIDIA GeForce RTX 4090", 24 * GiB, 10 * GiB),
        DeviceMemory("gpu1", "NVIDIA RTX A4000", 16 * GiB, 0),
    )
    assert by_pid(reading) == {
        (4242, "gpu0"): 6 * GiB,  # not 12: the same figure in both lists
        (4343, "gpu0"): None,  # usedGpuMemory None: unknown, not 0
        (5151, "gpu0"): 2 * GiB,
    }
    assert [p.name for p in reading.processes] == ["python3", None, "Game.exe"]
    assert reading.measured == frozenset({"gpu0", "gpu1"})
    assert reading.process_bytes(4343, "gpu0") is None
    reader.close()
    reader.close()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_nvml_that_fails_to_initialise_reports_unavailable() -> None:
    nvml = FakeNvml([], init_error=FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED)
    reader = NvmlReader(nvml)
    assert reader.open() == "nvml: nvmlInit: Driver Not Loaded"
    with pytest.raises(TelemetryError, match="not initialised"):
        reader.read()
    assert nvml.shutdowns == 0


def test_nvml_without_gpus_is_unavailable() -> None:
    nvml = FakeNvml([])
    assert NvmlReader(nvml).open() == "nvml: no NVIDIA GPU"
    assert nvml.shutdowns == 1


def test_nvml_process_failure_leaves_the_device_unmeasured() -> None:
    nvml = two_gpus()
    nvml.gpus[0].process_error = FakeNvml.NVML_ERROR_NOT_SUPPORTED
    reader = NvmlReader(nvml, name_of=name_of)
    assert reader.open() is None
    reading = reader.read()
    assert [d.device for d in reading.devices] == ["gpu0", "gpu1"]
    assert reading.measured == frozenset({"gpu1"})
    assert reading.errors == ("gpu0: nvml: nvmlDeviceGetComputeRunningProcesses: Not Supported",)
    assert reading.process_bytes(4242, "gpu0") is None  # never 0 when it cannot be told


def test_nvml_function_missing_from_an_old_pynvml_is_a_telemetry_error() -> None:
    class OldNvml(FakeNvml):
        def __getattribute__(self, name: str) -> object:
            if name == "nvmlDeviceGetGraphicsRunningProcesses":
                raise AttributeError(name)
            return super().__getattribute__(name)

    reader = NvmlReader(OldNvml(two_gpus().gpus), name_of=name_of)
    assert reader.open() is None
    reading = reader.read()
    assert reading.measured == frozenset()
    assert all("nvmlDeviceGetGraphicsRunningProcesses" in e for e in reading.errors)

    class NoModule:
        pass

    assert (NvmlReader(NoModule()).open() or "").startswith("nvml: nvmlInit: not in this pynvml")


def test_the_real_pynvml_either_reads_or_says_why_not() -> None:
    reader = NvmlReader()
    reason = reader.open()
    try:
        if reason is None:  # a machine with an NVIDIA driver
            reading = reader.read()
            assert reading.devices
            assert all(d.total_bytes > 0 for d in reading.devices)
        else:  # here: no libnvidia-ml.so
            assert reason.startswith("nvml: nvmlInit: ")
    finally:
        reader.close()


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


def no_driver() -> FakeNvml:
    return FakeNvml([], init_error=FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND)


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


class ScriptedReader:
    """Returns the scripted readings (or raises the scripted errors) in turn, then the last
    one again and again."""

    def __init__(self, script: Sequence[Reading | Exception], source: str = "scripted") -> None:
        self.script = list(script)
        self.source = source
        self.reads = 0

    def open(self) -> str | None:
        return None

    def read(self) -> Reading:
        item = self.script[min(self.reads, len(self.script) - 1)]
        self.reads += 1
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        pass


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


# -- sampler ---------------------------------------------------------------------------------

WORKER_PID = 4242


def worker_reading(used_bytes: int | None, *, game_bytes: int = 2 * GiB) -> Reading:
    processes = [ProcessMemory(5151, "gpu0", game_bytes, "Game.exe")]
    if used_bytes != 0:
        processes.insert(0, ProcessMemory(WORKER_PID, "gpu0", used_bytes, "python3"))
    return Reading(
        devices=(DeviceMemory("gpu0", "NVIDIA GeForce RTX 4090", 24 * GiB, 10 * GiB),),
        processes=tuple(processes),
        measured=frozenset({"gpu0"}),
    )


class Published:
    def __init__(self) -> None:
        self.snapshots: list[TelemetrySnapshot] = []
        self._lock = threading.Lock()

    def __call__(self, snapshot: TelemetrySnapshot) -> None:
        with self._lock:
            self.snapshots.append(snapshot)

    def count(self) -> int:
        with self._lock:
            return len(self.snapshots)


@pytest.fixture
def started() -> Iterator[list[Sampler]]:
    samplers: list[Sampler] = []
    yield samplers
    for sampler in samplers:
        sampler.stop()


def test_snapshot_splits_models_from_other_processes() -> None:
    snapshot = build_snapshot(
        worker_reading(6 * GiB), {"qwen": WORKER_PID, "gemma": 4343}, source="nvml", at=1.0
    )
    assert [(m.model, m.used_bytes) for m in snapshot.models] == [("qwen", 6 * GiB)]
    assert [(p.pid, p.name) for p in snapshot.others] == [(5151, "Game.exe")]
    assert snapshot.model_bytes("qwen") == 6 * GiB
    assert snapshot.model_bytes("gemma") == 0  # not listed on a measured device
    assert snapshot.model_bytes("gemma", "gpu1") is None
    assert snapshot.model_bytes("nobody") is None
    assert snapshot.device("gpu0") is not None
    assert snapshot.to_json()["models"] == {"qwen": 6 * GiB, "gemma": 0}


def test_sampler_publishes_snapshots_from_a_named_thread(started: list[Sampler]) -> None:
    reader = ScriptedReader([worker_reading(6 * GiB)])
    published = Published()
    threads: list[str] = []

    def model_pids() -> dict[str, int]:
        threads.append(threading.current_thread().name)
        return {"qwen": WORKER_PID}

    sampler = Sampler(reader, published, model_pids=model_pids, interval_s=0.001)
    started.append(sampler)
    sampler.start()
    wait_until(lambda: published.count() >= 3, WAIT_S, "three snapshots")
    sampler.stop()
    assert not any(t.name == "telemetry-sampler" for t in threading.enumerate())
    assert set(threads) == {"telemetry-sampler"}
    first = published.snapshots[0]
    assert first.source == "scripted"
    assert first.model_bytes("qwen") == 6 * GiB
    assert sampler.latest is published.snapshots[-1]


def test_sampler_paces_by_interest() -> None:
    interested = [True]
    sampler = Sampler(
        ScriptedReader([worker_reading(0)]),
        Published(),
        model_pids=dict,
        interested=lambda: interested[0],
        interval_s=1.0,
        idle_interval_s=5.0,
    )
    assert sampler.pace_s() == 1.0
    interested[0] = False
    assert sampler.pace_s() == 5.0


def test_idle_sampler_wakes_for_a_new_subscriber_and_stops_at_once(
    started: list[Sampler],
) -> None:
    published = Published()
    interested = threading.Event()
    sampler = Sampler(
        ScriptedReader([worker_reading(0)]),
        published,
        model_pids=dict,
        interested=interested.is_set,
        interval_s=0.001,
        idle_interval_s=600.0,  # idle: the next sample would be ten minutes away
    )
    started.append(sampler)
    sampler.start()
    wait_until(lambda: published.count() >= 1, WAIT_S, "the first snapshot")
    interested.set()  # a subscriber arrives
    sampler.wake()
    wait_until(lambda: published.count() >= 5, WAIT_S, "sampling at the fast pace")
    interested.clear()
    sampler.stop(timeout_s=WAIT_S)  # interrupts the long wait
    assert not any(t.name == "telemetry-sampler" for t in threading.enumerate())


def test_sampler_survives_failing_reads_and_publishers_logging_each_error_once(
    started: list[Sampler], caplog: pytest.LogCaptureFixture
) -> None:
    gone = TelemetryError("nvml: nvmlDeviceGetMemoryInfo: GPU is lost")
    reader = ScriptedReader([gone, gone, gone, RuntimeError("bug"), worker_reading(GiB)])
    published = Published()
    refusals = [0]

    def publish(snapshot: TelemetrySnapshot) -> None:
        if refusals[0] < 2:
            refusals[0] += 1
            raise ValueError("subscriber broke")
        published(snapshot)

    sampler = Sampler(reader, publish, model_pids=dict, interval_s=0.001)
    started.append(sampler)
    with caplog.at_level(logging.WARNING, logger="arbiterd.telemetry.sampler"):
        sampler.start()
        wait_until(lambda: published.count() >= 2, WAIT_S, "snapshots after the failures")
        sampler.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("GPU is lost" in m for m in messages) == 1
    assert sum("RuntimeError: bug" in m for m in messages) == 1
    assert sum("subscriber broke" in m for m in messages) == 1


# -- teardown --------------------------------------------------------------------------------

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
    assert result.event() == {
        "event": "vram_not_freed",
        "model": "qwen",
        "pid": WORKER_PID,
        "device": "gpu0",
        "bytes_before": 6 * GiB,  # the first sample, none was given
        "bytes_after": 3 * GiB,
        "expected_bytes": EXPECTED,
        "waited_s": 2.0,
    }
    assert sum(time_.waits) == pytest.approx(2.0)
    assert reader.reads == 21  # at 0 s, then every 0.1 s up to 2 s


def test_check_that_cannot_measure_says_so_and_raises_no_alarm() -> None:
    reader = ScriptedReader([TelemetryError("nvml: GPU is lost")])
    time_ = FakeTime()
    check = TeardownCheck(reader, deadline_s=0.5, clock=time_.clock, wait=time_.wait)
    result = check.run("qwen", WORKER_PID, expected_bytes=0)
    assert result.outcome is TeardownOutcome.UNMEASURED
    assert result.event() is None
    assert result.to_json()["outcome"] == "unmeasured"


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
    assert event["event"] == "vram_not_freed"
    assert event["bytes_after"] == 6144 * MiB + 262148 * KiB
    assert event["expected_bytes"] == GPU_CONTEXT_ALLOWANCE_BYTES
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


# -- metrics ---------------------------------------------------------------------------------


def metrics_snapshot(others: Sequence[ProcessMemory], qwen_bytes: int) -> TelemetrySnapshot:
    processes = [ProcessMemory(WORKER_PID, "gpu0", qwen_bytes, "python3"), *others]
    reading = Reading(
        devices=(DeviceMemory("gpu0", "gpu", 24 * GiB, 10 * GiB),),
        processes=tuple(p for p in processes if p.used_bytes != 0),
        measured=frozenset({"gpu0"}),
    )
    return build_snapshot(reading, {"qwen": WORKER_PID, "gemma": 4343}, source="t", at=0.0)


def test_series_are_owned_by_model_names_and_process_names() -> None:
    snapshot = metrics_snapshot(
        [
            ProcessMemory(100, "gpu0", GiB, "firefox"),
            ProcessMemory(101, "gpu0", 2 * GiB, "firefox"),
            ProcessMemory(102, "gpu0", 3 * GiB, None),
            ProcessMemory(103, "gpu0", None, "mystery"),
        ],
        qwen_bytes=6 * GiB,
    )
    assert {(s.device, s.owner): s.bytes_ for s in vram_series(snapshot)} == {
        ("gpu0", "qwen"): 6 * GiB,
        ("gpu0", "gemma"): 0,  # cold and empty: a series at 0, not a missing one
        ("gpu0", "firefox"): 3 * GiB,
        ("gpu0", "unknown"): 3 * GiB,
    }


def test_gauge_follows_snapshots_and_drops_gone_processes() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("arbiterd_vram_bytes", "VRAM", ["device", "owner"], registry=registry)
    vram = VramGauge(gauge)

    def value(owner: str) -> float | None:
        return registry.get_sample_value("arbiterd_vram_bytes", {"device": "gpu0", "owner": owner})

    vram.update(metrics_snapshot([ProcessMemory(100, "gpu0", GiB, "Game.exe")], 6 * GiB))
    assert (value("qwen"), value("gemma"), value("Game.exe")) == (6 * GiB, 0, GiB)
    vram.update(metrics_snapshot([], 0))  # the game quit, qwen went cold
    assert (value("qwen"), value("gemma"), value("Game.exe")) == (0, 0, None)
