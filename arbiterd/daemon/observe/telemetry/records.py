"""What every VRAM reader returns, and the one interface readers share.

Owns the record of one reading, the `Reader` protocol and the device ↔ arena naming ("gpu0",
"gpu1", …: one arena per GPU). A reading's rows are the records a `vram` event carries
(events.DeviceMemory, events.ProcessMemory: one definition for the reader and the wire). Holds
no state and touches no driver: the readers live in nvml.py, drm.py and readers.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from arbiterd.events import DeviceMemory, ProcessMemory

_ARENA_DEVICE = re.compile(r"gpu(\d+)")


def arena_device_name(index: int) -> str:
    """The device (and arena directory) name of the GPU a reader numbers `index`: "gpu0"."""
    if index < 0:
        raise ValueError(f"a device index is >= 0, not {index}")
    return f"gpu{index}"


def device_index(device: str) -> int | None:
    """The index in a device name ("gpu3" → 3), or None for a name of another shape."""
    match = _ARENA_DEVICE.fullmatch(device)
    return int(match.group(1)) if match else None


def device_for_arena(arena: Path) -> str:
    """The device an arena stands for: its directory name (…/arena/gpu1 → "gpu1"); an arena
    named otherwise (a custom --arena DIR) stands for the first GPU, as the default does."""
    return arena.name if device_index(arena.name) is not None else arena_device_name(0)


@dataclass(frozen=True)
class Reading:
    """One look at the machine.

    `measured` names the devices whose process list is complete: there, a process that is not
    listed holds nothing (NVML drops a process once it frees its last allocation; fdinfo shows
    no device-local bytes). On any other device a missing process is *unknown*, never 0 — the
    difference between "freed" and "cannot tell" after a release.
    """

    devices: tuple[DeviceMemory, ...] = ()
    processes: tuple[ProcessMemory, ...] = ()
    measured: frozenset[str] = field(default_factory=frozenset)
    errors: tuple[str, ...] = ()  # what failed in part, reading went on without it

    def process_bytes(self, pid: int, device: str | None = None) -> int | None:
        """What `pid` holds on `device` (all devices when None); None when it cannot be told."""
        rows = [p for p in self.processes if p.pid == pid and device in (None, p.device)]
        if any(p.used_bytes is None for p in rows):
            return None
        if rows:
            return sum(p.used_bytes or 0 for p in rows)
        scope = self.measured if device is None else self.measured & {device}
        return 0 if scope else None


class Reader(Protocol):
    """A source of VRAM figures. `open` once, `read` from any one thread at a time, `close`."""

    @property
    def source(self) -> str:
        """A short name for status and notes: "nvml", "amd-sysfs", "drm-fdinfo", "accounting"."""
        ...

    def open(self) -> str | None:
        """Get ready; None when this reader works here, else one line saying why not."""
        ...

    def read(self) -> Reading:
        """The figures now; raises TelemetryError when nothing could be read."""
        ...

    def close(self) -> None: ...
