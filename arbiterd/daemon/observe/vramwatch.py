"""Who holds how much device memory, as the daemon tells it: readings, accounting, teardowns.

Owns the VRAM sampler (a telemetry thread that reads ~1 Hz while someone watches, every 5 s
otherwise), the engines' own figures for machines without a GPU reader (the accounting reader:
what each worker says it holds, its `resident_bytes` — weights, KV and compute buffers — as of
its latest residency event; on a machine without a GPU that is host RAM), the verified
teardown after every release (in a thread: it polls the driver for seconds) and each model's
cold footprint. It reaches the event loop only through the callbacks it is given, hopping
there from its threads, and only while someone watches: otherwise a periodic reading is kept
as the latest (a teardown's "before") and the loop sleeps on (`on_reading` sees every reading
on the sampler's thread, for the fitting sets' budgets); `status` and a /metrics scrape
take a reading of their own (issue 29).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from arbiterd.daemon.observe.telemetry import (
    ColdFootprints,
    DrmFdinfoReader,
    NvmlReader,
    ReaderSet,
    Sampler,
    TeardownCheck,
    TeardownResult,
    TelemetrySnapshot,
    device_for_arena,
    select_readers,
)
from arbiterd.errors import TelemetryError
from arbiterd.events import Event, ResidencyEvent
from arbiterd.states import ResidencyState
from arbiterd.status import Telemetry

# The residency states of a worker that is done: whatever it still holds goes as it exits.
_DONE = frozenset({ResidencyState.FAILED, ResidencyState.STOPPED})
# The move that ends a release, after which the teardown is verified.
_RELEASED = (ResidencyState.COOLING, ResidencyState.COLD)


class VramWatch:
    def __init__(
        self,
        arena: Path,
        *,
        on_snapshot: Callable[[TelemetrySnapshot], None],
        on_leak: Callable[[Event], None],
        watched: Callable[[], bool],
        on_reading: Callable[[TelemetrySnapshot], None] = lambda _: None,
        readers: ReaderSet | None = None,
    ) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_reading = on_reading
        self._watched = watched
        self._on_snapshot = on_snapshot
        self._on_leak = on_leak
        # Read by the sampler's thread: replaced whole on every change, never mutated.
        self._accounted: dict[int, int] = {}  # worker pid -> device bytes by its own account
        self._model_pids: dict[str, int] = {}
        self.device = device_for_arena(arena)
        self.readers = readers or select_readers(lambda: self._accounted)
        self._sampler = Sampler(
            self.readers,
            self._from_sampler,
            model_pids=lambda: self._model_pids,
            interested=watched,
        )
        self._teardown = TeardownCheck(self.readers)
        self._footprints = ColdFootprints(self.readers.context_allowance_bytes)
        self._checks: set[asyncio.Task[TeardownResult]] = set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sampler.start()

    async def stop(self) -> None:
        self._teardown.cancel()
        await asyncio.gather(*self._checks, return_exceptions=True)
        await asyncio.to_thread(self._sampler.stop)
        self.readers.close()

    def wake(self) -> None:
        """Someone started watching: a fresh reading now, then every second."""
        self._sampler.wake()

    # -- workers ------------------------------------------------------------------------------

    def worker_started(self, model: str, pid: int) -> None:
        self._model_pids = {**self._model_pids, model: pid}

    def worker_gone(self, model: str, pid: int) -> None:
        self._accounted = {p: b for p, b in self._accounted.items() if p != pid}
        self._model_pids = {m: p for m, p in self._model_pids.items() if m != model}

    def model_removed(self, model: str) -> None:
        self._footprints.forget(model)

    @property
    def models_by_pid(self) -> dict[int, str]:
        return {pid: model for model, pid in self._model_pids.items()}

    def residency(
        self, pid: int, event: ResidencyEvent, devices: Sequence[str] | None = None
    ) -> None:
        """Account the engine's own figure for `pid` (what the accounting reader reports): the
        `resident_bytes` its event says it holds now (weights, KV and compute buffers while
        warm; the KV a release left on the device once cold), nothing once it failed or
        stopped; after a release, verify the teardown. Not the bytes the event moved (issue 40:
        a CPU model's restore moves only its KV, so the test model was booked at 877 B while
        warm, of the 21 MiB it held). `devices` are the model's device ids (None: this watch's
        device). A model on none of this device or the CPU (every layer on RPC servers, or on
        another GPU) holds nothing here: its bytes are another device's, and its release frees
        nothing here to check."""
        here = devices is None or any(d in (self.device, "cpu") for d in devices)
        # A worker always says its resident bytes; an event read without them books nothing.
        held = 0 if not here or event.to_state in _DONE else event.resident_bytes or 0
        self._accounted = {**self._accounted, pid: held}
        if here and event.model is not None and (event.from_state, event.to_state) == _RELEASED:
            self._verify_teardown(event.model, pid)

    # -- readings -----------------------------------------------------------------------------

    async def fresh(self) -> TelemetrySnapshot | None:
        """A reading taken now (the periodic one may be 5 s old); the latest one if it fails."""
        return await asyncio.to_thread(self._sampler.sample) or self._sampler.latest

    def other_programs_readers(self) -> str:
        """The readers that measure other programs' device memory ("nvml", "drm-fdinfo"), not
        only the engines' own figures; "" where none does."""
        per_process = (NvmlReader.source, DrmFdinfoReader.source)
        return " + ".join(r.source for r in self.readers.readers if r.source in per_process)

    def process_bytes(self) -> dict[int, int]:
        """What each process the readers see holds on the devices, by pid, read now (blocking:
        the step aside's lookout calls it from its thread); {} when no reader answers."""
        try:
            reading = self.readers.read()
        except TelemetryError:
            return {}
        used: dict[int, int] = {}
        for process in reading.processes:
            if process.pid is not None and process.used_bytes is not None:
                used[process.pid] = used.get(process.pid, 0) + process.used_bytes
        return used

    def model_bytes(self, snapshot: TelemetrySnapshot | None, model: str) -> int | None:
        return None if snapshot is None else snapshot.model_bytes(model, self.device)

    def footprint(self, model: str) -> int | None:
        return self._footprints.footprint(model)

    def status(self, snapshot: TelemetrySnapshot | None) -> Telemetry:
        """Status's `telemetry`: which readers, the arena's device, and `snapshot`'s figures."""
        readers = self.readers.describe()
        if snapshot is None:
            return Telemetry(readers=readers, device=self.device)
        return Telemetry(
            at=snapshot.at,
            source=snapshot.source,
            devices=snapshot.devices,
            models=tuple((name, snapshot.model_bytes(name)) for name in snapshot.model_pids),
            others=snapshot.others,
            errors=snapshot.errors,
            readers=readers,
            device=self.device,
        )

    # -- plumbing -----------------------------------------------------------------------------

    def _verify_teardown(self, model: str, pid: int) -> None:
        latest = self._sampler.latest
        check = asyncio.get_running_loop().create_task(
            asyncio.to_thread(
                self._teardown.run,
                model,
                pid,
                expected_bytes=self._footprints.expected(model),
                bytes_before=latest.model_bytes(model, self.device) if latest else None,
                device=self.device,
            )
        )
        self._checks.add(check)
        check.add_done_callback(self._checked)

    def _checked(self, check: asyncio.Task[TeardownResult]) -> None:
        self._checks.discard(check)
        if check.cancelled() or check.exception() is not None:
            return
        result = check.result()
        self._footprints.record(result)
        event = result.event()
        if event is not None:
            self._on_leak(event)

    @property
    def latest(self) -> TelemetrySnapshot | None:
        """The latest periodic reading (up to 5 s old), without reading anew."""
        return self._sampler.latest

    def _from_sampler(self, snapshot: TelemetrySnapshot) -> None:
        self._on_reading(snapshot)  # on this thread, watched or not: cheap, wakes no loop
        loop = self._loop
        if loop is not None and not loop.is_closed() and self._watched():
            loop.call_soon_threadsafe(self._on_snapshot, snapshot)
