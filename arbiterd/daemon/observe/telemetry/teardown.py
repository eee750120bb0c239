"""Verified teardown: after a model goes cold, prove its worker gave the VRAM back.

Owns the verdict (a pure function of the figures seen so far), the bounded polling around it,
when to say `vram_not_freed` (events.VramNotFreedEvent, the record) and each model's *cold
footprint* — what a cold worker still holds,
e.g. its CUDA/ROCm context. Never decides anything about residency: it measures and reports.

Why: "VRAM not freed" is the most repeated complaint about every peer (llama-swap #97, Ollama's
"gpu VRAM usage didn't recover within timeout", vLLM's sleep that leaves 16 GB) — issue 5.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from arbiterd.daemon.observe.telemetry.records import Reader
from arbiterd.errors import TelemetryError
from arbiterd.events import VramNotFreedEvent

log = logging.getLogger(__name__)

# Drivers free lazily: NVML and amdgpu settle within a few hundred ms of the last cudaFree /
# buffer release; 2 s separates "slow" from "kept".
TEARDOWN_DEADLINE_S = 2.0
TEARDOWN_POLL_S = 0.1
# Allocator slack between one cold state and the next (cuBLAS workspaces, pool rounding).
TEARDOWN_TOLERANCE_BYTES = 128 << 20
_CLOCK_SLACK_S = 1e-6  # what is left of the deadline after summing float waits is no wait


class TeardownOutcome(enum.Enum):
    FREED = "freed"
    NOT_FREED = "not_freed"
    UNMEASURED = "unmeasured"  # no reader could tell what the worker holds


@dataclass(frozen=True)
class TeardownSample:
    elapsed_s: float  # since the check began
    used_bytes: int | None  # what the worker held then; None: could not be told


@dataclass(frozen=True)
class TeardownVerdict:
    outcome: TeardownOutcome
    used_bytes: int | None  # FREED: the first figure within bounds; else the latest known
    elapsed_s: float  # when that figure was seen (FREED), else the last sample's time


def teardown_verdict(
    samples: Sequence[TeardownSample], expected_bytes: int, tolerance_bytes: int
) -> TeardownVerdict:
    """Freed as soon as one figure is within `expected_bytes + tolerance_bytes` (memory that fell
    and came back belongs to a new warm-up, not to this release); otherwise not freed on the
    latest known figure, or unmeasured when none was known. The caller decides when to stop."""
    limit = expected_bytes + tolerance_bytes
    for sample in samples:
        if sample.used_bytes is not None and sample.used_bytes <= limit:
            return TeardownVerdict(TeardownOutcome.FREED, sample.used_bytes, sample.elapsed_s)
    last_s = samples[-1].elapsed_s if samples else 0.0
    known = [s.used_bytes for s in samples if s.used_bytes is not None]
    if not known:
        return TeardownVerdict(TeardownOutcome.UNMEASURED, None, last_s)
    return TeardownVerdict(TeardownOutcome.NOT_FREED, known[-1], last_s)


@dataclass(frozen=True)
class TeardownResult:
    outcome: TeardownOutcome
    model: str
    pid: int
    device: str | None
    bytes_before: int | None  # while warm, as the caller last saw it (or the first sample)
    bytes_after: int | None
    expected_bytes: int
    tolerance_bytes: int
    waited_s: float

    @property
    def freed(self) -> bool:
        return self.outcome is TeardownOutcome.FREED

    def event(self) -> VramNotFreedEvent | None:
        """The `vram_not_freed` event when the memory did not come back, else None."""
        if self.outcome is not TeardownOutcome.NOT_FREED:
            return None
        return VramNotFreedEvent(
            model=self.model,
            pid=self.pid,
            device=self.device,
            bytes_before=self.bytes_before,
            bytes_after=self.bytes_after,
            expected_bytes=self.expected_bytes,
            waited_s=round(self.waited_s, 3),
        )


class TeardownCheck:
    """Polls `reader` every `poll_s` until the worker's figure is within its cold footprint or
    `deadline_s` has passed. Blocking: run it off the event loop. `cancel()` ends a check at
    once (daemon shutdown); it then reports what it has seen.

    `clock` and `wait` (returns True when cancelled, like Event.wait) are injectable so the
    polling is tested without sleeping.
    """

    def __init__(
        self,
        reader: Reader,
        *,
        deadline_s: float = TEARDOWN_DEADLINE_S,
        poll_s: float = TEARDOWN_POLL_S,
        tolerance_bytes: int = TEARDOWN_TOLERANCE_BYTES,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], bool] | None = None,
    ) -> None:
        self._reader = reader
        self._deadline_s = deadline_s
        self._poll_s = poll_s
        self.tolerance_bytes = tolerance_bytes
        self._clock = clock
        self._cancelled = threading.Event()
        self._wait = wait or self._cancelled.wait

    def cancel(self) -> None:
        self._cancelled.set()

    def run(
        self,
        model: str,
        pid: int,
        *,
        expected_bytes: int,
        bytes_before: int | None = None,
        device: str | None = None,
    ) -> TeardownResult:
        started = self._clock()
        samples: list[TeardownSample] = []
        while True:
            samples.append(TeardownSample(self._clock() - started, self._measure(pid, device)))
            verdict = teardown_verdict(samples, expected_bytes, self.tolerance_bytes)
            if verdict.outcome is TeardownOutcome.FREED:
                break
            left_s = self._deadline_s - (self._clock() - started)
            if left_s <= _CLOCK_SLACK_S or self._wait(min(self._poll_s, left_s)):
                break
        if bytes_before is None:
            bytes_before = samples[0].used_bytes
        return TeardownResult(
            outcome=verdict.outcome,
            model=model,
            pid=pid,
            device=device,
            bytes_before=bytes_before,
            bytes_after=verdict.used_bytes,
            expected_bytes=expected_bytes,
            tolerance_bytes=self.tolerance_bytes,
            waited_s=verdict.elapsed_s,
        )

    def _measure(self, pid: int, device: str | None) -> int | None:
        try:
            return self._reader.read().process_bytes(pid, device)
        except TelemetryError as exc:
            log.debug("teardown check: reading failed: %s", exc)
            return None


class ColdFootprints:
    """Per model, what its worker holds while cold — a figure users care about — and what the
    next teardown check should expect.

    Only a verified (freed) figure becomes the expectation, so a leak is never learned as the
    norm; the latest figure, freed or not, is what status shows. Thread-safe.
    """

    def __init__(self, default_expected_bytes: int) -> None:
        self._default = default_expected_bytes
        self._lock = threading.Lock()
        self._latest: dict[str, int] = {}
        self._verified: dict[str, int] = {}

    def expected(self, model: str) -> int:
        with self._lock:
            return self._verified.get(model, self._default)

    def footprint(self, model: str) -> int | None:
        with self._lock:
            return self._latest.get(model)

    def record(self, result: TeardownResult) -> None:
        if result.bytes_after is None:
            return
        with self._lock:
            self._latest[result.model] = result.bytes_after
            if result.freed:
                self._verified[result.model] = result.bytes_after

    def forget(self, model: str) -> None:
        """The model was removed or reconfigured: its old figures no longer apply."""
        with self._lock:
            self._latest.pop(model, None)
            self._verified.pop(model, None)

    def to_json(self) -> dict[str, int]:
        with self._lock:
            return dict(self._latest)
