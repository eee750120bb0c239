"""NVIDIA VRAM through NVML (`nvidia-ml-py`, module `pynvml`): per device and per process.

Owns every NVML call in arbiterd, and routes each one through `NvmlReader._query`, which turns
`pynvml.NVMLError` (and a function an older pynvml lacks) into TelemetryError — as nvitop's
`nvmlQuery` does. Must never import pynvml at module import (the daemon starts without a
driver) and never let an NVML error escape as anything but TelemetryError.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from arbiterd.daemon.observe.telemetry.records import (
    Reading,
    arena_device_name,
)
from arbiterd.errors import TelemetryError
from arbiterd.events import DeviceMemory, ProcessMemory
from arbiterd.procs import process_name

log = logging.getLogger(__name__)

# Both lists: a CUDA worker shows under Compute, a game (or a Vulkan llama.cpp) under Graphics,
# a process with both kinds of context under both — with the same per-process figure.
_PROCESS_LISTS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")


class NvmlReader:
    """Device totals and per-process figures of every NVIDIA GPU, numbered as NVML numbers them
    (PCI bus order; CUDA agrees when CUDA_DEVICE_ORDER=PCI_BUS_ID).

    `nvml` is the pynvml module, or an object with the same functions (tests pass a fake).
    """

    source = "nvml"

    def __init__(
        self,
        nvml: object | None = None,
        *,
        name_of: Callable[[int], str | None] = process_name,
    ) -> None:
        self._nvml: Any = nvml  # the module, or a stand-in with its names
        self._name_of = name_of
        self._initialised = False

    def open(self) -> str | None:
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                return f"nvml: pynvml is not installed ({exc})"
        try:
            self._query("nvmlInit")
            self._initialised = True
            count = int(self._query("nvmlDeviceGetCount"))
        except TelemetryError as exc:
            self.close()
            return str(exc)
        if count == 0:
            self.close()
            return "nvml: no NVIDIA GPU"
        return None

    def close(self) -> None:
        if self._initialised:
            self._initialised = False  # NVML counts inits: one shutdown for our one init
            try:
                self._query("nvmlShutdown")
            except TelemetryError:
                log.debug("nvmlShutdown failed", exc_info=True)

    def read(self) -> Reading:
        if not self._initialised:
            raise TelemetryError("nvml: not initialised")
        devices: list[DeviceMemory] = []
        processes: list[ProcessMemory] = []
        measured: set[str] = set()
        errors: list[str] = []
        for index in range(int(self._query("nvmlDeviceGetCount"))):
            device = arena_device_name(index)
            try:
                handle = self._query("nvmlDeviceGetHandleByIndex", index)
                memory = self._query("nvmlDeviceGetMemoryInfo", handle)
                name = _text(self._query("nvmlDeviceGetName", handle))
            except TelemetryError as exc:
                errors.append(f"{device}: {exc}")  # e.g. "GPU is lost": the others still count
                continue
            devices.append(DeviceMemory(device, name, int(memory.total), int(memory.used)))
            try:
                usage = self._process_usage(handle)
            except TelemetryError as exc:
                errors.append(f"{device}: {exc}")  # the device stays, its processes unknown
                continue
            measured.add(device)
            processes.extend(
                ProcessMemory(pid=pid, device=device, used_bytes=used, name=self._name_of(pid))
                for pid, used in sorted(usage.items())
            )
        if not devices and errors:
            raise TelemetryError("; ".join(errors))
        return Reading(tuple(devices), tuple(processes), frozenset(measured), tuple(errors))

    def _process_usage(self, handle: object) -> dict[int, int | None]:
        """pid → bytes on one device, merged over both lists. NVML reports one figure per
        process and device, repeated in each list: take it once (the larger, if they differ),
        never the sum; `usedGpuMemory` None (not available, e.g. under WDDM or MIG without
        permission) stays unknown rather than 0."""
        usage: dict[int, int | None] = {}
        for function in _PROCESS_LISTS:
            for info in self._query(function, handle):
                pid, used = int(info.pid), info.usedGpuMemory
                figure = None if used is None else int(used)
                if pid not in usage:
                    usage[pid] = figure
                elif figure is not None:
                    usage[pid] = max(usage[pid] or 0, figure)
        return usage

    def _query(self, function: str, *args: object) -> Any:
        """Call one NVML function; every NVML failure leaves here as TelemetryError."""
        nvml = self._nvml
        try:
            nvml_error: type[BaseException] = nvml.NVMLError
            call = getattr(nvml, function)
        except AttributeError as exc:
            raise TelemetryError(f"nvml: {function}: not in this pynvml ({exc})") from None
        try:
            return call(*args)
        except nvml_error as exc:
            raise TelemetryError(f"nvml: {function}: {exc}") from exc


def _text(value: object) -> str:
    """Older pynvml versions return bytes for names."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
