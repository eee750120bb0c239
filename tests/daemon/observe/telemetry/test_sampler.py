"""sampler.py: build_snapshot and the "telemetry-sampler" thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from arbiterd.daemon.observe.telemetry import (
    Sampler,
    TelemetryError,
    TelemetrySnapshot,
    build_snapshot,
)
from tests.daemon.observe.telemetry.support import (
    WAIT_S,
    WORKER_PID,
    GiB,
    ScriptedReader,
    worker_reading,
)
from tests.support.waiting import wait_until


class Published:
    def __init__(self) -> None:
        self.snapshots: list[TelemetrySnapshot] = []
        self._lock = threading.Lock()

    def __call__(self, snapshot: TelemetrySnapshot) -> None:
        with self._lock:
            self.snapshots.append(snapshot)

    def count(self) -> int:
        with self._lock:
            return len(self.snapshots)


@pytest.fixture
def started() -> Iterator[list[Sampler]]:
    samplers: list[Sampler] = []
    yield samplers
    for sampler in samplers:
        sampler.stop()


def test_snapshot_splits_models_from_other_processes() -> None:
    snapshot = build_snapshot(
        worker_reading(6 * GiB), {"qwen": WORKER_PID, "gemma": 4343}, source="nvml", at=1.0
    )
    assert [(m.model, m.used_bytes) for m in snapshot.models] == [("qwen", 6 * GiB)]
    assert [(p.pid, p.name) for p in snapshot.others] == [(5151, "Game.exe")]
    assert snapshot.model_bytes("qwen") == 6 * GiB
    assert snapshot.model_bytes("gemma") == 0  # not listed on a measured device
    assert snapshot.model_bytes("gemma", "gpu1") is None
    assert snapshot.model_bytes("nobody") is None
    assert snapshot.device("gpu0") is not None
    assert snapshot.to_json()["models"] == {"qwen": 6 * GiB, "gemma": 0}


def test_sampler_publishes_snapshots_from_a_named_thread(started: list[Sampler]) -> None:
    reader = ScriptedReader([worker_reading(6 * GiB)])
    published = Published()
    threads: list[str] = []

    def model_pids() -> dict[str, int]:
        threads.append(threading.current_thread().name)
        return {"qwen": WORKER_PID}

    sampler = Sampler(reader, published, model_pids=model_pids, interval_s=0.001)
    started.append(sampler)
    sampler.start()
    wait_until(lambda: published.count() >= 3, WAIT_S, "three snapshots")
    sampler.stop()
    assert not any(t.name == "telemetry-sampler" for t in threading.enumerate())
    assert set(threads) == {"telemetry-sampler"}
    first = published.snapshots[0]
    assert first.source == "scripted"
    assert first.model_bytes("qwen") == 6 * GiB
    assert sampler.latest is published.snapshots[-1]


def test_sampler_paces_by_interest() -> None:
    interested = [True]
    sampler = Sampler(
        ScriptedReader([worker_reading(0)]),
        Published(),
        model_pids=dict,
        interested=lambda: interested[0],
        interval_s=1.0,
        idle_interval_s=5.0,
    )
    assert sampler.pace_s() == 1.0
    interested[0] = False
    assert sampler.pace_s() == 5.0


def test_idle_sampler_wakes_for_a_new_subscriber_and_stops_at_once(
    started: list[Sampler],
) -> None:
    published = Published()
    interested = threading.Event()
    sampler = Sampler(
        ScriptedReader([worker_reading(0)]),
        published,
        model_pids=dict,
        interested=interested.is_set,
        interval_s=0.001,
        idle_interval_s=600.0,  # idle: the next sample would be ten minutes away
    )
    started.append(sampler)
    sampler.start()
    wait_until(lambda: published.count() >= 1, WAIT_S, "the first snapshot")
    interested.set()  # a subscriber arrives
    sampler.wake()
    wait_until(lambda: published.count() >= 5, WAIT_S, "sampling at the fast pace")
    interested.clear()
    sampler.stop(timeout_s=WAIT_S)  # interrupts the long wait
    assert not any(t.name == "telemetry-sampler" for t in threading.enumerate())


def test_sampler_survives_failing_reads_and_publishers_logging_each_error_once(
    started: list[Sampler], caplog: pytest.LogCaptureFixture
) -> None:
    gone = TelemetryError("nvml: nvmlDeviceGetMemoryInfo: GPU is lost")
    reader = ScriptedReader([gone, gone, gone, RuntimeError("bug"), worker_reading(GiB)])
    published = Published()
    refusals = [0]

    def publish(snapshot: TelemetrySnapshot) -> None:
        if refusals[0] < 2:
            refusals[0] += 1
            raise ValueError("subscriber broke")
        published(snapshot)

    sampler = Sampler(reader, publish, model_pids=dict, interval_s=0.001)
    started.append(sampler)
    with caplog.at_level(logging.WARNING, logger="arbiterd.daemon.observe.telemetry.sampler"):
        sampler.start()
        wait_until(lambda: published.count() >= 2, WAIT_S, "snapshots after the failures")
        sampler.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("GPU is lost" in m for m in messages) == 1
    assert sum("RuntimeError: bug" in m for m in messages) == 1
    assert sum("subscriber broke" in m for m in messages) == 1
