"""nvml.py: NvmlReader on a fake pynvml, and on the real one where it loads."""

from __future__ import annotations

import importlib

import pytest

from arbiterd.daemon.observe.telemetry import DeviceMemory, NvmlReader, TelemetryError
from tests.daemon.observe.telemetry.support import FakeNvml, GiB, by_pid, name_of, two_gpus


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
            assert all(d.total_bytes is not None and d.total_bytes > 0 for d in reading.devices)
        else:  # here: no libnvidia-ml.so
            assert reason.startswith("nvml: nvmlInit: ")
    finally:
        reader.close()
