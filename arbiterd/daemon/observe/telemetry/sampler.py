"""The sampler: a named thread that reads VRAM about once a second and publishes snapshots.

Owns the thread, its pace (1 s while someone is interested, 5 s otherwise) and the
`TelemetrySnapshot` record: per device used/total, per model (through its worker's pid) and per
other process (a game, a browser) with its name. Never dies: a reader or publisher that fails
is logged once per distinct error and the next tick tries again. Calls `publish` on its own
thread; the daemon hops to its event loop from there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from arbiterd.daemon.observe.telemetry.records import Reader, Reading
from arbiterd.events import DeviceMemory, ProcessMemory

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0  # while a status, tray or metrics scrape is watching
IDLE_SAMPLE_INTERVAL_S = 5.0  # nobody watching: enough to keep the cold footprints current
STOP_TIMEOUT_S = 10.0  # one read of /proc on a busy machine is well under a second
MAX_REMEMBERED_ERRORS = 64  # distinct errors logged once each; then the memory starts over
THREAD_NAME = "telemetry-sampler"


@dataclass(frozen=True)
class ModelMemory:
    """What one model's worker holds on one device."""

    model: str
    pid: int
    device: str
    used_bytes: int | None

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "pid": self.pid,
            "device": self.device,
            "used_bytes": self.used_bytes,
        }


@dataclass(frozen=True)
class TelemetrySnapshot:
    at: float  # seconds since the epoch
    source: str  # which readers: "nvml", "amd-sysfs + drm-fdinfo", "accounting"
    devices: tuple[DeviceMemory, ...]
    models: tuple[ModelMemory, ...]  # only where the worker holds something, or is unknown
    others: tuple[ProcessMemory, ...]  # every other process holding device memory
    model_pids: Mapping[str, int]
    measured: frozenset[str]  # devices where a worker not in `models` holds nothing
    errors: tuple[str, ...] = ()

    def model_bytes(self, model: str, device: str | None = None) -> int | None:
        """What `model`'s worker holds (on `device`, or in all); None when it cannot be told."""
        if model not in self.model_pids:
            return None
        rows = [m for m in self.models if m.model == model and device in (None, m.device)]
        if any(m.used_bytes is None for m in rows):
            return None
        if rows:
            return sum(m.used_bytes or 0 for m in rows)
        scope = self.measured if device is None else self.measured & {device}
        return 0 if scope else None

    def device(self, device: str) -> DeviceMemory | None:
        return next((d for d in self.devices if d.device == device), None)

    def to_json(self) -> dict[str, object]:
        """For status: {"at", "source", "devices": [...], "models": {name: bytes | None},
        "others": [...], "errors": [...]}."""
        return {
            "at": self.at,
            "source": self.source,
            "devices": [d.to_json() for d in self.devices],
            "models": {name: self.model_bytes(name) for name in self.model_pids},
            "others": [p.to_json() for p in self.others],
            "errors": list(self.errors),
        }


def build_snapshot(
    reading: Reading, model_pids: Mapping[str, int], *, source: str, at: float
) -> TelemetrySnapshot:
    """Split a reading into the models' rows (by worker pid) and everyone else's."""
    model_of = {pid: model for model, pid in model_pids.items()}
    models: list[ModelMemory] = []
    others: list[ProcessMemory] = []
    for process in reading.processes:
        model = None if process.pid is None else model_of.get(process.pid)
        if model is None or process.pid is None or process.device is None:
            others.append(process)
        else:
            models.append(ModelMemory(model, process.pid, process.device, process.used_bytes))
    return TelemetrySnapshot(
        at=at,
        source=source,
        devices=reading.devices,
        models=tuple(models),
        others=tuple(others),
        model_pids=dict(model_pids),
        measured=reading.measured,
        errors=reading.errors,
    )


class _OnceLog:
    """Logs each distinct failure once, so a driver gone for an hour is one line, not 3600."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warning(self, what: str, exc: BaseException | None = None) -> None:
        key = what if exc is None else f"{what}: {type(exc).__name__}: {exc}"
        if key in self._seen:
            return
        if len(self._seen) >= MAX_REMEMBERED_ERRORS:
            self._seen.clear()
        self._seen.add(key)
        log.warning("telemetry: %s", key, exc_info=exc)


class Sampler:
    """Reads `reader` every SAMPLE_INTERVAL_S while `interested()`, else every
    IDLE_SAMPLE_INTERVAL_S, and hands each snapshot to `publish` (on the sampler's thread).

    `model_pids()` maps each model to its worker's pid (called from the sampler's thread: return
    a copy). `wake()` takes the next sample at once, e.g. when a subscriber arrives.
    """

    def __init__(
        self,
        reader: Reader,
        publish: Callable[[TelemetrySnapshot], None],
        *,
        model_pids: Callable[[], Mapping[str, int]],
        interested: Callable[[], bool] = lambda: True,
        interval_s: float = SAMPLE_INTERVAL_S,
        idle_interval_s: float = IDLE_SAMPLE_INTERVAL_S,
    ) -> None:
        self._reader = reader
        self._publish = publish
        self._model_pids = model_pids
        self._interested = interested
        self._interval_s = interval_s
        self._idle_interval_s = idle_interval_s
        self._wake = threading.Event()
        self._stopping = False
        self._errors = _OnceLog()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self.latest: TelemetrySnapshot | None = None  # replaced whole, so safe to read anywhere

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop and join; the reader stays open (its owner closes it)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("telemetry: the sampler did not stop within %.0f s", timeout_s)

    def sample(self) -> TelemetrySnapshot | None:
        """Take one sample now and publish it; None when reading failed (logged)."""
        try:
            reading = self._reader.read()
            snapshot = build_snapshot(
                reading, self._model_pids(), source=self._reader.source, at=time.time()
            )
        except Exception as exc:  # a broken reader must not end the sampling
            self._errors.warning("reading VRAM failed", exc)
            return None
        for error in snapshot.errors:
            self._errors.warning(f"partial reading: {error}")
        self.latest = snapshot
        try:
            self._publish(snapshot)
        except Exception as exc:
            self._errors.warning("publishing a snapshot failed", exc)
        return snapshot

    def pace_s(self) -> float:
        """How long until the next sample: short while someone is interested."""
        try:
            interested = self._interested()
        except Exception as exc:  # err towards fresh figures
            self._errors.warning("asking who is interested failed", exc)
            interested = True
        return self._interval_s if interested else self._idle_interval_s

    def _run(self) -> None:
        while not self._stopping:
            self.sample()
            self._wake.wait(self.pace_s())
            self._wake.clear()
