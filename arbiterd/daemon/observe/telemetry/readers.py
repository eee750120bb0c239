"""Choosing the readers a machine has, and the reader of last resort: the engines' own figures.

Owns `select_readers` (NVML if it initialises, else the DRM files, else accounting), the
`ReaderSet` that merges the chosen readers into one, and `AccountingReader`, which lets the
whole pipeline — sampler, teardown check, metrics — run on a machine without a GPU. Never
raises from selection: a reader that cannot work here is noted and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from arbiterd.daemon.observe.telemetry.drm import PROCFS, SYSFS, AmdSysfsReader, DrmFdinfoReader
from arbiterd.daemon.observe.telemetry.nvml import NvmlReader
from arbiterd.daemon.observe.telemetry.records import (
    Reader,
    Reading,
    arena_device_name,
)
from arbiterd.errors import TelemetryError
from arbiterd.events import DeviceMemory, ProcessMemory
from arbiterd.procs import process_name
from arbiterd.status import ACCOUNTING_SOURCE

log = logging.getLogger(__name__)

# What a cold worker may keep on a GPU and still count as freed, until its own cold footprint has
# been measured once: a CUDA or ROCm context with its module images is some 300 to 500 MiB.
GPU_CONTEXT_ALLOWANCE_BYTES = 512 << 20


class AccountingReader:
    """No GPU to ask: each worker's own accounting (weights + KV + compute buffers while warm,
    what a release left on the device once cold; the workers' "resident_bytes") stands in for a
    measurement, on one device: the arena's, which is the host's RAM where the engine runs the
    models on the CPU (status names it so: DaemonStatus.device_label).

    `accounted` returns {pid: bytes} for the workers; `total_bytes` is the device's size — a
    configured figure, else the host's RAM (where a CPU build keeps the model).
    """

    source = ACCOUNTING_SOURCE

    def __init__(
        self,
        accounted: Callable[[], Mapping[int, int]],
        *,
        total_bytes: int | None = None,
        device: str = arena_device_name(0),
        name_of: Callable[[int], str | None] = process_name,
    ) -> None:
        self._accounted = accounted
        self._total_bytes = total_bytes
        self._device = device
        self._name_of = name_of

    def open(self) -> str | None:
        return None

    def close(self) -> None:
        pass

    def read(self) -> Reading:
        try:
            figures = dict(self._accounted())
        except Exception as exc:  # the daemon's callable: whatever it raises is a failed read
            raise TelemetryError(f"accounting: {type(exc).__name__}: {exc}") from exc
        total = self._total_bytes
        if total is None:
            total = psutil.virtual_memory().total
        used = sum(figures.values())
        device = DeviceMemory(self._device, "engine accounting (no GPU reader)", total, used)
        processes = tuple(
            ProcessMemory(pid, self._device, figures[pid], self._name_of(pid))
            for pid in sorted(figures)
        )
        return Reading((device,), processes, frozenset({self._device}))


@dataclass(frozen=True)
class ReaderSet:
    """The readers chosen for this machine, read as one.

    Device figures come from the first reader that has the device, process figures likewise
    per (pid, device); a reader that fails is noted in the reading's `errors` and the others
    still count. Raises TelemetryError only when every reader failed.
    """

    readers: tuple[Reader, ...]
    skipped: tuple[str, ...] = ()  # why the readers not chosen could not work here
    # What a cold worker may hold before it is known (0 where figures are the engines' own).
    context_allowance_bytes: int = GPU_CONTEXT_ALLOWANCE_BYTES

    @property
    def source(self) -> str:
        return " + ".join(r.source for r in self.readers)

    def describe(self) -> str:
        """One line for status and notes: "amd-sysfs + drm-fdinfo (nvml: …)"."""
        if not self.skipped:
            return self.source
        return f"{self.source} (not used: {'; '.join(self.skipped)})"

    def open(self) -> str | None:
        return None  # opened by select_readers

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def read(self) -> Reading:
        devices: dict[str | None, DeviceMemory] = {}
        processes: dict[tuple[int | None, str | None], ProcessMemory] = {}
        measured: set[str] = set()
        errors: list[str] = []
        failures = 0
        for reader in self.readers:
            try:
                reading = reader.read()
            except TelemetryError as exc:
                failures += 1
                errors.append(str(exc))
                continue
            for device in reading.devices:
                devices.setdefault(device.device, device)
            for process in reading.processes:
                processes.setdefault((process.pid, process.device), process)
            measured |= reading.measured
            errors.extend(reading.errors)
        if self.readers and failures == len(self.readers):
            raise TelemetryError("; ".join(errors))
        return Reading(
            devices=tuple(sorted(devices.values(), key=lambda d: d.device or "")),
            processes=tuple(sorted(processes.values(), key=lambda p: (p.device or "", p.pid or 0))),
            measured=frozenset(measured),
            errors=tuple(errors),
        )


def select_readers(
    accounted: Callable[[], Mapping[int, int]],
    *,
    accounting_total_bytes: int | None = None,
    nvml: object | None = None,
    sysfs: Path = SYSFS,
    procfs: Path = PROCFS,
    name_of: Callable[[int], str | None] = process_name,
) -> ReaderSet:
    """What this machine has: NVML if it initialises; else AMD sysfs and DRM fdinfo, whichever
    work (i915/xe have fdinfo but no sysfs totals); else the engines' own accounting.

    `nvml` replaces the pynvml module (tests); `accounted` and `accounting_total_bytes` feed
    the AccountingReader. Close the set when done (it holds NVML's init).
    """
    skipped: list[str] = []
    nvml_reader = NvmlReader(nvml, name_of=name_of)
    reason = nvml_reader.open()
    if reason is None:
        return ReaderSet((nvml_reader,))
    skipped.append(reason)
    drm: list[Reader] = []
    for reader in (AmdSysfsReader(sysfs), DrmFdinfoReader(procfs, sysfs, name_of=name_of)):
        reason = reader.open()
        if reason is None:
            drm.append(reader)
        else:
            skipped.append(reason)
    if drm:
        return ReaderSet(tuple(drm), tuple(skipped))
    accounting = AccountingReader(accounted, total_bytes=accounting_total_bytes, name_of=name_of)
    return ReaderSet((accounting,), tuple(skipped), context_allowance_bytes=0)
