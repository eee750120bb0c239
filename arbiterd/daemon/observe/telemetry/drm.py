"""VRAM from the kernel's DRM files: AMD's sysfs totals per device, and any driver's fdinfo per
process (amdgpu, i915, xe, …).

Owns the reading of `/sys/class/drm/card*` and `/proc/<pid>/fdinfo/*` and the parsing of their
formats. Only reads; both roots are injectable so tests point them at recorded fixture trees.

Formats relied on (Documentation/gpu/drm-usage-stats.rst; amdgpu_fdinfo.c before 6.9):
- `/sys/class/drm/cardN/device` links to the PCI device; amdgpu puts `mem_info_vram_total` and
  `mem_info_vram_used` (bytes) there.
- fdinfo of a DRM fd: `drm-driver`, `drm-pdev` (PCI address), `drm-client-id` (unique per open
  file description), and memory as `drm-total-<region>`, `drm-resident-<region>` (and
  `drm-shared-`, `-active-`, `-purgeable-`), or the older amdgpu `drm-memory-<region>`; a value
  is "<uint> [KiB|MiB]" (bytes without a unit). Several fds — dup(), or a fd passed on — share
  one client, so a client counts once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from arbiterd.daemon.observe.telemetry.records import (
    Reading,
    arena_device_name,
)
from arbiterd.errors import TelemetryError
from arbiterd.events import DeviceMemory, ProcessMemory
from arbiterd.procs import process_name

SYSFS = Path("/sys")
PROCFS = Path("/proc")

_CARD = re.compile(r"card(\d+)")  # not card0-DP-1 (a connector) nor renderD128
_PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_SIZE = re.compile(r"(\d+)\s*([A-Za-z]*)")
# Device-local memory: amdgpu "vram", xe "vram0"/"vram1", i915 discrete "local0". Not system
# memory or GTT (host RAM the GPU maps), nor stolen memory (firmware-reserved), nor keys that
# merely share the prefix, like xe's "drm-total-cycles-rcs".
_DEVICE_LOCAL = re.compile(r"(vram|local)\d*")
# Per region, the figure that says what really sits in device memory comes first: amdgpu (6.9+)
# counts `total` by *requested* placement, `resident` by where the buffers are now.
_MEMORY_KEYS = ("drm-resident-", "drm-total-", "drm-memory-")


@dataclass(frozen=True)
class DrmCard:
    card: int  # N in /dev/dri/cardN
    pci_address: str  # "0000:03:00.0"
    driver: str | None  # "amdgpu", "i915", "xe"; None when the link cannot be read
    device_dir: Path  # …/cardN/device
    device: str  # "gpu0": see drm_cards


def drm_cards(sysfs: Path = SYSFS) -> tuple[DrmCard, ...]:
    """The machine's PCI GPUs in card order, named gpu0, gpu1, … by position.

    By position, not by N: on many machines simpledrm takes card0 during boot and the real GPU
    becomes card1; platform devices (simpledrm, ARM display controllers) are not GPUs that hold
    models and are skipped.
    """
    found: list[tuple[int, str, str | None, Path]] = []
    try:
        entries = list((sysfs / "class" / "drm").iterdir())
    except OSError:
        return ()
    for entry in entries:
        match = _CARD.fullmatch(entry.name)
        if match is None:
            continue
        device_dir = entry / "device"
        try:
            address = os.path.basename(os.readlink(device_dir))
        except OSError:
            continue
        if not _PCI_ADDRESS.fullmatch(address):
            continue
        try:
            driver: str | None = os.path.basename(os.readlink(device_dir / "driver"))
        except OSError:
            driver = None
        found.append((int(match.group(1)), address.lower(), driver, device_dir))
    found.sort()
    return tuple(
        DrmCard(card, address, driver, device_dir, arena_device_name(position))
        for position, (card, address, driver, device_dir) in enumerate(found)
    )


class AmdSysfsReader:
    """Used and total VRAM of every amdgpu card (per device only: processes come from fdinfo)."""

    source = "amd-sysfs"

    def __init__(self, sysfs: Path = SYSFS) -> None:
        self._sysfs = sysfs

    def open(self) -> str | None:
        if not self._cards():
            return "amd-sysfs: no DRM card with mem_info_vram_total"
        return None

    def close(self) -> None:
        pass

    def read(self) -> Reading:
        devices: list[DeviceMemory] = []
        errors: list[str] = []
        for card in self._cards():
            try:
                total = _read_int(card.device_dir / "mem_info_vram_total")
                used = _read_int(card.device_dir / "mem_info_vram_used")
            except (OSError, ValueError) as exc:
                errors.append(f"{card.device}: {exc}")  # unplugged, or reset in progress
                continue
            devices.append(DeviceMemory(card.device, _card_name(card), total, used))
        if not devices:
            raise TelemetryError("amd-sysfs: " + ("; ".join(errors) or "no card left"))
        return Reading(devices=tuple(devices), errors=tuple(errors))

    def _cards(self) -> list[DrmCard]:
        cards = drm_cards(self._sysfs)
        return [c for c in cards if (c.device_dir / "mem_info_vram_total").is_file()]


def _card_name(card: DrmCard) -> str:
    """The board's marketing name when amdgpu knows it (`product_name`, from the FRU EEPROM;
    often empty on consumer boards), else driver and PCI address."""
    try:
        product = (card.device_dir / "product_name").read_text().strip()
    except OSError:
        product = ""
    return product or f"{card.driver or 'drm'} {card.pci_address}"


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def parse_fdinfo(text: str) -> dict[str, str]:
    """`key:\\tvalue` lines → dict; amdgpu pads some keys ("drm-memory-gtt: \\t4112 KiB")."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields[key.strip()] = value.strip()
    return fields


def parse_size(value: str) -> int | None:
    """A size as fdinfo prints it: "1024 KiB" → 1048576, a bare number is bytes; else None."""
    match = _SIZE.fullmatch(value.strip())
    if match is None or match.group(2) not in _UNITS:
        return None
    return int(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class DrmClient:
    """One DRM client (an open file description of a card or render node) as fdinfo shows it."""

    driver: str
    pdev: str  # PCI address, lower case
    client_id: str
    device_local_bytes: int


def drm_client(fields: dict[str, str]) -> DrmClient | None:
    """The client an fdinfo describes, or None when the fd is not a DRM client we can place (not
    DRM at all, or a driver that prints no `drm-pdev`/`drm-client-id`)."""
    driver, pdev, client_id = (fields.get(k) for k in ("drm-driver", "drm-pdev", "drm-client-id"))
    if not driver or not pdev or not client_id:
        return None
    regions: dict[str, int] = {}
    for prefix in reversed(_MEMORY_KEYS):  # the preferred key is written last, and wins
        for key, value in fields.items():
            region = key.removeprefix(prefix)
            if region == key or not _DEVICE_LOCAL.fullmatch(region):
                continue
            size = parse_size(value)
            if size is not None:
                regions[region] = size
    return DrmClient(driver, pdev.lower(), client_id, sum(regions.values()))


class DrmFdinfoReader:
    """Per-process device memory of every DRM client on the machine, from fdinfo.

    Reads only the fds that link to /dev/dri; processes of other users are skipped (their
    fdinfo is not ours to read). Processes that hold no device memory are left out: on the
    devices this reader maps, a process it does not list holds nothing there.
    """

    source = "drm-fdinfo"

    def __init__(
        self,
        procfs: Path = PROCFS,
        sysfs: Path = SYSFS,
        *,
        name_of: Callable[[int], str | None] = process_name,
    ) -> None:
        self._procfs = procfs
        self._sysfs = sysfs
        self._name_of = name_of

    def open(self) -> str | None:
        if not any(_pids(self._procfs)):
            return f"drm-fdinfo: no processes under {self._procfs}"
        if not drm_cards(self._sysfs):
            return "drm-fdinfo: no PCI DRM card"
        return None

    def close(self) -> None:
        pass

    def read(self) -> Reading:
        # Cards are looked up on every read: an eGPU may come and go.
        devices = {card.pci_address: card.device for card in drm_cards(self._sysfs)}
        processes: list[ProcessMemory] = []
        for pid in sorted(_pids(self._procfs)):
            clients = self._clients(pid)
            per_device: dict[str, int] = {}
            for client in clients.values():
                device = devices.get(client.pdev)
                if device is not None:
                    per_device[device] = per_device.get(device, 0) + client.device_local_bytes
            processes.extend(
                ProcessMemory(pid, device, used, self._name_of(pid))
                for device, used in sorted(per_device.items())
                if used > 0
            )
        return Reading(processes=tuple(processes), measured=frozenset(devices.values()))

    def _clients(self, pid: int) -> dict[tuple[str, str], DrmClient]:
        """A process's DRM clients, once each by (drm-pdev, drm-client-id)."""
        clients: dict[tuple[str, str], DrmClient] = {}
        process_dir = self._procfs / str(pid)
        try:
            fds = list((process_dir / "fdinfo").iterdir())
        except OSError:  # gone, or another user's
            return clients
        for fdinfo in fds:
            if not _is_drm_fd(process_dir / "fd" / fdinfo.name):
                continue
            try:
                text = fdinfo.read_text(errors="replace")
            except OSError:  # the fd was closed meanwhile
                continue
            client = drm_client(parse_fdinfo(text))
            if client is not None:
                clients.setdefault((client.pdev, client.client_id), client)
        return clients


def _pids(procfs: Path) -> Iterator[int]:
    try:
        entries = list(procfs.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name.isdigit():
            yield int(entry.name)


def _is_drm_fd(fd: Path) -> bool:
    """True when the fd links to a DRM node, or when the link cannot be read (then the fdinfo
    itself decides: it has no drm-driver key unless it is one). Skips reading the fdinfo of
    every socket and pipe on the machine."""
    try:
        target = os.readlink(fd)
    except OSError:
        return True
    return target.startswith("/dev/dri/")
