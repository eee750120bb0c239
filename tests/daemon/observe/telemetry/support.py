"""Telemetry test helpers: recorded /sys and /proc trees, a fake pynvml, scripted readings."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from arbiterd.daemon.observe.telemetry import DeviceMemory, ProcessMemory, Reading

FIXTURES = Path(__file__).parents[3] / "fixtures" / "telemetry"
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


def by_pid(reading: Reading) -> dict[tuple[int | None, str | None], int | None]:
    return {(p.pid, p.device): p.used_bytes for p in reading.processes}


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


def no_driver() -> FakeNvml:
    return FakeNvml([], init_error=FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND)


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
