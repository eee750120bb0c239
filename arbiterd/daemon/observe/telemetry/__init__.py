"""Measured VRAM (issue 5; docs/lifecycle.md, "Measured VRAM"): per device and per process,
sampled by a named thread, and a verified teardown after every release.

    records        Reading (its rows: events.DeviceMemory, events.ProcessMemory), the Reader
                   protocol, device ↔ arena names
    nvml           NVIDIA through pynvml — the only module that calls NVML
    drm            AMD sysfs totals; any DRM driver's per-process fdinfo (amdgpu, i915, xe)
    readers        AccountingReader (no GPU: the engines' own figures), select_readers, ReaderSet
    sampler        the "telemetry-sampler" thread and TelemetrySnapshot
    teardown       teardown_verdict (pure), TeardownCheck (polling), ColdFootprints
    prometheus     arbiterd_vram_bytes{device,owner} from a snapshot

Nothing here imports pynvml at import time, writes anywhere, or raises out of the sampler.
"""

from arbiterd.daemon.observe.telemetry.drm import (
    AmdSysfsReader,
    DrmCard,
    DrmFdinfoReader,
    drm_cards,
)
from arbiterd.daemon.observe.telemetry.nvml import NvmlReader
from arbiterd.daemon.observe.telemetry.prometheus import VramGauge, VramSeries, vram_series
from arbiterd.daemon.observe.telemetry.readers import (
    GPU_CONTEXT_ALLOWANCE_BYTES,
    AccountingReader,
    ReaderSet,
    select_readers,
)
from arbiterd.daemon.observe.telemetry.records import (
    Reader,
    Reading,
    arena_device_name,
    device_for_arena,
    device_index,
)
from arbiterd.daemon.observe.telemetry.sampler import (
    ModelMemory,
    Sampler,
    TelemetrySnapshot,
    build_snapshot,
)
from arbiterd.daemon.observe.telemetry.teardown import (
    ColdFootprints,
    TeardownCheck,
    TeardownOutcome,
    TeardownResult,
    TeardownSample,
    TeardownVerdict,
    teardown_verdict,
)
from arbiterd.errors import TelemetryError
from arbiterd.events import DeviceMemory, ProcessMemory

__all__ = [
    "GPU_CONTEXT_ALLOWANCE_BYTES",
    "AccountingReader",
    "AmdSysfsReader",
    "ColdFootprints",
    "DeviceMemory",
    "DrmCard",
    "DrmFdinfoReader",
    "ModelMemory",
    "NvmlReader",
    "ProcessMemory",
    "Reader",
    "ReaderSet",
    "Reading",
    "Sampler",
    "TeardownCheck",
    "TeardownOutcome",
    "TeardownResult",
    "TeardownSample",
    "TeardownVerdict",
    "TelemetryError",
    "TelemetrySnapshot",
    "VramGauge",
    "VramSeries",
    "arena_device_name",
    "build_snapshot",
    "device_for_arena",
    "device_index",
    "drm_cards",
    "select_readers",
    "teardown_verdict",
    "vram_series",
]
