"""The daemon's memory budgets: host RAM and the prompt caches on disk (issue 14), and each
device's fitting set (issue 44).

Owns the three pure policies — which cold models to unload when the host copies and cold KV
caches exceed [daemon] host_ram_budget (`ram_plan`), which state files to remove so the prompt
caches fit [daemon] prompt_cache_budget (`cache_evictions`), what a fitting set may hold on its
device now (`device_budget`, from what `measured_device` or `measured_host` read) — and the
prompt-cache folder's files (`PromptCache`: their sizes and ages, and removing them). It never
starts, stops or asks a worker anything: unloads.py applies `ram_plan` through the
lifecycle's unload, keepers.py gives each fitting set's keeper its budget, and the lifecycle calls
`PromptCache` around a worker's save. `PromptCache`'s methods touch the disk (a directory
listing, an unlink): the daemon calls them from a thread. `measured_host` reads a few small
/proc files (well under a millisecond).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from arbiterd.daemon.observe.telemetry import TelemetrySnapshot
from arbiterd.errors import DaemonError
from arbiterd.paths import ensure_private_dir
from arbiterd.status import ACCOUNTING_SOURCE

KV_SUFFIX = ".kv"  # <model>.kv; the worker writes ".<model>.kv.<pid>.tmp" first (kvfile.write)


# -- host RAM ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyUse:
    """One host copy of a model file: its size, and how many slots lease it (hostcopy.py)."""

    size_bytes: int
    leases: int


@dataclass(frozen=True)
class ColdModel:
    """A model that may be unloaded for the budget: cold, idle, not pinned."""

    name: str
    cold_since: float  # time.monotonic() when it went cold: the smaller, the less recently used
    # What its worker keeps on the host for it alone: the KV cache, and the weights an
    # in-place release moved off the device (its share of the file's copy is in `copy`).
    own_bytes: int
    copy: str | None  # the key of the host copy it leases; None: it has none (page-cache)


@dataclass(frozen=True)
class RamPlan:
    """What `ram_plan` decided: host RAM in use, the budget, whom to unload, and what is left."""

    used_bytes: int
    budget_bytes: int
    unload: tuple[str, ...]
    after_bytes: int

    @property
    def over(self) -> bool:
        return 0 < self.budget_bytes < self.used_bytes


def ram_plan(
    budget_bytes: int,
    *,
    copies: Mapping[str, CopyUse],
    own_bytes: int,
    cold: Iterable[ColdModel],
) -> RamPlan:
    """Which cold models to unload, least recently used first, until the host RAM in use —
    every host copy once (`copies`) plus what every worker keeps for its model alone
    (`own_bytes`: host KV, the weights' own copies) — fits
    `budget_bytes` (0: no budget, nobody is unloaded).

    Unloading a model frees its own bytes, and its host copy once no other slot leases it. A
    model whose unload would free nothing — no own bytes, and a copy that a model outside `cold`
    (a warm one) keeps leasing — is passed over: restarting it later would cost a load for no
    byte. When even every cold model is not enough, all of them are unloaded and `after_bytes`
    stays over the budget."""
    used = sum(c.size_bytes for c in copies.values()) + own_bytes
    if budget_bytes <= 0 or used <= budget_bytes:
        return RamPlan(used, budget_bytes, (), used)
    candidates = sorted(cold, key=lambda m: (m.cold_since, m.name))
    leases = {key: use.leases for key, use in copies.items()}
    held_by_candidates: dict[str, int] = {}
    for model in candidates:
        if model.copy is not None:
            held_by_candidates[model.copy] = held_by_candidates.get(model.copy, 0) + 1
    # Copies some model that is not a candidate leases too: no unload here frees them.
    kept = {key for key, count in leases.items() if count > held_by_candidates.get(key, 0)}
    after, chosen = used, []
    for model in candidates:
        if after <= budget_bytes:
            break
        copy = model.copy
        if model.own_bytes == 0 and (copy is None or copy not in leases or copy in kept):
            continue
        chosen.append(model.name)
        after -= model.own_bytes
        if copy is not None and copy in leases:
            leases[copy] -= 1
            if leases[copy] == 0:
                after -= copies[copy].size_bytes
    return RamPlan(used, budget_bytes, tuple(chosen), after)


# -- a device's fitting set -----------------------------------------------------------------------

HOST_SOURCE = "host RAM"
MEMORY_SOURCE = "[devices] memory"


@dataclass(frozen=True)
class Measured:
    """A device as its readers see it now: its size, and what programs outside its fitting set
    hold on it (other programs, arbiterd's models that are not members, what no process owns)."""

    total_bytes: int
    others_bytes: int
    source: str  # who measured: the readers ("nvml"), or HOST_SOURCE


@dataclass(frozen=True)
class DeviceBudget:
    """What a fitting set's members may hold on their device at once, and what it was made of
    (status shows each part). `budget_bytes` 0: not known, or nothing left: each member is
    warm alone, as models always took turns."""

    budget_bytes: int
    size_bytes: int | None  # the device's size as counted; None: not known
    size_source: str  # who told the size: a reader, HOST_SOURCE, MEMORY_SOURCE; "": nobody
    reserve_bytes: int
    others_bytes: int  # what others hold now; 0 where nothing measures them


def device_budget(memory: int | None, reserve: int, measured: Measured | None) -> DeviceBudget:
    """The device's size (the smaller of `memory`, [devices.ID] memory, and the `measured` one,
    whichever there are) less `reserve` less what the others hold now."""
    sizes = [(memory, MEMORY_SOURCE)] if memory is not None else []
    if measured is not None:
        sizes.append((measured.total_bytes, measured.source))
    if not sizes:
        return DeviceBudget(0, None, "", reserve, 0)
    size, source = min(sizes, key=lambda s: s[0])
    others = measured.others_bytes if measured is not None else 0
    return DeviceBudget(max(0, size - reserve - others), size, source, reserve, others)


def measured_device(
    snapshot: TelemetrySnapshot | None, device: str, members: Iterable[str]
) -> Measured | None:
    """What `snapshot` says of `device` ("gpu0"): None where it cannot tell (no reading, the
    device not in it, or only the engines' own accounting, which knows no size and no other
    program). The others are everything the device uses but the `members`' workers: measured as
    one figure, so drivers' own memory and processes the reader cannot name count too."""
    if snapshot is None or snapshot.source == ACCOUNTING_SOURCE:
        return None
    found = snapshot.device(device)
    if found is None or found.total_bytes is None:
        return None
    inside = set(members)
    ours = sum(
        m.used_bytes or 0 for m in snapshot.models if m.device == device and m.model in inside
    )
    if found.used_bytes is not None:
        others = max(0, found.used_bytes - ours)
    else:  # only the processes: each one's row that is not a member's
        others = sum(p.used_bytes or 0 for p in snapshot.others if p.device == device) + sum(
            m.used_bytes or 0
            for m in snapshot.models
            if m.device == device and m.model not in inside
        )
    return Measured(found.total_bytes, others, snapshot.source)


def measured_host(workers: Iterable[int]) -> Measured:
    """The host's RAM as a CPU device's (`cpu`) size, and what programs other than arbiterd's
    `workers` (pids) hold of it: the RAM not available, less the workers' resident memory."""
    memory = psutil.virtual_memory()
    ours = 0
    for pid in workers:
        try:
            ours += psutil.Process(pid).memory_info().rss
        except psutil.Error:  # gone since: holds nothing
            continue
    others = max(0, memory.total - memory.available - ours)
    return Measured(memory.total, others, HOST_SOURCE)


# -- the prompt caches on disk ---------------------------------------------------------------------


@dataclass(frozen=True)
class StateFile:
    """One model's prompt cache on disk."""

    model: str
    size_bytes: int
    mtime_ns: int


def cache_evictions(
    files: Iterable[StateFile], budget_bytes: int, *, keep: str, incoming_bytes: int = 0
) -> tuple[StateFile, ...]:
    """The state files to remove, oldest (by mtime) first, so that `files` plus
    `incoming_bytes` (a file about to be written) fit `budget_bytes`; `keep`'s own file is
    never among them. Fewer than needed when removing every other file is not enough."""
    kept = list(files)
    total = sum(f.size_bytes for f in kept) + incoming_bytes
    evicted: list[StateFile] = []
    for state in sorted(kept, key=lambda f: (f.mtime_ns, f.model)):
        if total <= budget_bytes:
            break
        if state.model == keep:
            continue
        evicted.append(state)
        total -= state.size_bytes
    return tuple(evicted)


@dataclass(frozen=True)
class Settled:
    """What `PromptCache.settle` did after a save: the files it removed to make room, and the
    size of the new file when that was removed itself, being larger than the whole budget (0:
    it was kept)."""

    evicted: tuple[StateFile, ...] = ()
    refused_bytes: int = 0


class PromptCache:
    """The folder of state files (`<model>.kv`, worker/kvfile.py's format) and its budget.

    Invariant kept here: after `settle`, the files add up to at most the budget. While a worker
    writes, the folder may hold one file more than that: the worker does not know the budget,
    and a warm model's KV size is known only once it is written (`make_room` clears what it can
    beforehand when the size is known)."""

    def __init__(self, folder: Path, budget_bytes: int) -> None:
        self.folder = folder
        self.budget_bytes = budget_bytes

    def path(self, model: str) -> Path:
        return self.folder / f"{model}{KV_SUFFIX}"

    def make_private(self) -> None:
        """Create the folder 0700, or require the one there to be ours and 0700 (the fix named
        in the DaemonError): its files hold the KV of the user's prompts, which read back as
        text (issue 24), and the workers write them into it."""
        ensure_private_dir(self.folder, DaemonError)

    def files(self) -> list[StateFile]:
        """Every state file in the folder (none when there is no folder)."""
        found = []
        try:
            entries = list(os.scandir(self.folder))
        except FileNotFoundError:
            return []
        for entry in entries:
            name = entry.name
            if name.startswith(".") or not name.endswith(KV_SUFFIX):
                continue  # a write in progress (kvfile.write's temporary) or something else
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # used and removed by a worker meanwhile
                continue
            found.append(StateFile(name.removesuffix(KV_SUFFIX), st.st_size, st.st_mtime_ns))
        return found

    def usage(self) -> dict[str, int]:
        """For status: the bytes and the number of files on disk, and the budget."""
        files = self.files()
        return {
            "bytes": sum(f.size_bytes for f in files),
            "files": len(files),
            "budget_bytes": self.budget_bytes,
        }

    def remove(self, model: str) -> bool:
        """Remove `model`'s state file; whether there was one. OSError other than a missing
        file goes to the caller."""
        try:
            self.path(model).unlink()
        except FileNotFoundError:
            return False
        return True

    def make_room(self, model: str, incoming_bytes: int) -> tuple[StateFile, ...]:
        """Before `model` saves about `incoming_bytes`: remove the oldest other files until it
        would fit (its own old file is replaced by the save, so it does not count). Returns
        what was removed."""
        others = [f for f in self.files() if f.model != model]
        return self._evict(
            cache_evictions(others, self.budget_bytes, keep=model, incoming_bytes=incoming_bytes)
        )

    def settle(self, model: str) -> Settled:
        """After `model` saved its file: a file larger than the whole budget is removed (and
        nothing else); else the oldest other files go until the folder fits the budget."""
        files = self.files()
        own = next((f for f in files if f.model == model), None)
        if own is not None and own.size_bytes > self.budget_bytes:
            self.remove(model)
            return Settled(refused_bytes=own.size_bytes)
        return Settled(evicted=self._evict(cache_evictions(files, self.budget_bytes, keep=model)))

    def _evict(self, victims: tuple[StateFile, ...]) -> tuple[StateFile, ...]:
        removed = []
        for state in victims:
            if self.remove(state.model):
                removed.append(state)
        return tuple(removed)
