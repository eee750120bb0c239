"""prometheus.py: the arbiterd_vram_bytes series and VramGauge."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Gauge

from arbiterd.daemon.observe.telemetry import (
    DeviceMemory,
    ProcessMemory,
    Reading,
    TelemetrySnapshot,
    VramGauge,
    build_snapshot,
    vram_series,
)
from tests.daemon.observe.telemetry.support import WORKER_PID, GiB


def metrics_snapshot(others: Sequence[ProcessMemory], qwen_bytes: int) -> TelemetrySnapshot:
    processes = [ProcessMemory(WORKER_PID, "gpu0", qwen_bytes, "python3"), *others]
    reading = Reading(
        devices=(DeviceMemory("gpu0", "gpu", 24 * GiB, 10 * GiB),),
        processes=tuple(p for p in processes if p.used_bytes != 0),
        measured=frozenset({"gpu0"}),
    )
    return build_snapshot(reading, {"qwen": WORKER_PID, "gemma": 4343}, source="t", at=0.0)


def test_series_are_owned_by_model_names_and_process_names() -> None:
    snapshot = metrics_snapshot(
        [
            ProcessMemory(100, "gpu0", GiB, "firefox"),
            ProcessMemory(101, "gpu0", 2 * GiB, "firefox"),
            ProcessMemory(102, "gpu0", 3 * GiB, None),
            ProcessMemory(103, "gpu0", None, "mystery"),
        ],
        qwen_bytes=6 * GiB,
    )
    assert {(s.device, s.owner): s.bytes_ for s in vram_series(snapshot)} == {
        ("gpu0", "qwen"): 6 * GiB,
        ("gpu0", "gemma"): 0,  # cold and empty: a series at 0, not a missing one
        ("gpu0", "firefox"): 3 * GiB,
        ("gpu0", "unknown"): 3 * GiB,
    }


def test_gauge_follows_snapshots_and_drops_gone_processes() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("arbiterd_vram_bytes", "VRAM", ["device", "owner"], registry=registry)
    vram = VramGauge(gauge)

    def value(owner: str) -> float | None:
        return registry.get_sample_value("arbiterd_vram_bytes", {"device": "gpu0", "owner": owner})

    vram.update(metrics_snapshot([ProcessMemory(100, "gpu0", GiB, "Game.exe")], 6 * GiB))
    assert (value("qwen"), value("gemma"), value("Game.exe")) == (6 * GiB, 0, GiB)
    vram.update(metrics_snapshot([], 0))  # the game quit, qwen went cold
    assert (value("qwen"), value("gemma"), value("Game.exe")) == (0, 0, None)
