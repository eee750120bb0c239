"""The engine thread's beat, as the io thread's status says it (issue 24): it advances through a
long generation, batch by batch, and stops while one native call hangs. Through a release or a
restore, one long native call that calls nothing back, it advances while the call works (its
CPU clock moves) and stops while it is blocked on a device that does not answer (issue 40)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiterd.spec import KvPolicy, ModelSpec, WorkerConfig
from arbiterd.worker.engine import Generation, Moved, Prepared
from tests.support.blocking_worker import BlockingWorker
from tests.support.requests import request_for
from tests.support.waiting import wait_until
from tests.worker.test_loop import FlakyRestore, InProcess

HUNG_S = 0.5  # how long the double's one native call hangs
# A tiny model decodes hundreds of tokens a second: its beat is milliseconds old, up to a few
# hundred when a busy 2-core CI machine does not schedule the engine thread.
FRESH_S = 1.0


@pytest.fixture
def worker(tmp_path: Path, tiny_model: Path) -> Iterator[BlockingWorker]:
    spec = ModelSpec(name="long", path=tiny_model, n_ctx=16384, n_gpu_layers=0)
    spawned = BlockingWorker.spawn(WorkerConfig(spec=spec, arena=tmp_path / "arena"))
    yield spawned
    spawned.kill()


def test_the_beat_stays_fresh_through_a_long_generation(worker: BlockingWorker) -> None:
    generating = threading.Thread(
        target=worker.generate,
        args=(
            request_for("completion", {"prompt": "the fox", "max_tokens": 16000, "temperature": 0}),
        ),
        kwargs={"timeout_s": 120, "request_id": "long"},
    )
    generating.start()
    wait_until(lambda: worker.status()["current"] is not None, 30, "the decode to start")
    ages = []
    started = time.monotonic()
    # Without a beat per decode, the beat would be as old as the generation by the end.
    while (sampled_s := time.monotonic() - started) < 2.5 * FRESH_S:
        status = worker.status()
        assert status["current"] == "long", f"the generation ended after {sampled_s:.1f} s"
        ages.append(status["beat_age_s"])
    worker.cancel("long")
    generating.join(timeout=60)
    assert max(ages) < FRESH_S, f"the engine's beat reached {max(ages)} s during a generation"


class HungDecode(FlakyRestore):
    """A backend whose generation is one native call that hangs (a stuck driver): it asks
    nothing of the worker until it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.running = threading.Event()
        self.unhang = threading.Event()

    def run(self, request: Prepared, sink: Any, cancelled: Any) -> Generation:
        self.running.set()
        self.unhang.wait(timeout=30)
        return Generation({"choices": []}, 1, 1, 1)

    def restore(self) -> Moved:
        self.warm = True
        return Moved(0.0, 100, 10, 0)


def test_the_beat_stops_while_a_native_call_hangs_and_status_still_answers(
    tmp_path: Path,
) -> None:
    backend = HungDecode()
    worker = InProcess(tmp_path, backend)
    asked = iter(range(1_000_000))

    def status() -> dict[str, Any]:
        result: dict[str, Any] = worker.ask(f"s{next(asked)}", op="status")["result"]
        return result

    worker.until(lambda m: m.get("to") == "warm")
    worker.writer.send(
        {"op": "generate", "id": "g", "request": {"kind": "completion", "prompt": ""}}
    )
    wait_until(backend.running.is_set, 10, "the generation to start")
    wait_until(lambda: status()["beat_age_s"] >= HUNG_S, 10, "the beat to age")
    hung = status()
    assert (hung["state"], hung["current"]) == ("warm", "g")  # the io thread answers
    backend.unhang.set()
    worker.until(lambda m: m.get("id") == "g")
    wait_until(lambda: status()["beat_age_s"] < 0.1, 10, "the beat to come back")
    worker.close()
    assert worker.raised == []


class SlowRelease(FlakyRestore):
    """A backend whose release is one long native call: it copies (spends CPU) until told to
    stop, or it sleeps in the kernel as one blocked on an RPC server that stopped answering."""

    def __init__(self, *, copying: bool) -> None:
        super().__init__()
        self.copying = copying
        self.releasing = threading.Event()
        self.done = threading.Event()

    def release(self, kv: KvPolicy) -> Moved:
        self.releasing.set()
        if self.copying:
            while not self.done.is_set():
                bytes(64 * 1024)
        else:
            self.done.wait(timeout=30)
        return super().release(kv)


def statuses(worker: InProcess) -> Iterator[dict[str, Any]]:
    for n in range(1_000_000):
        result: dict[str, Any] = worker.ask(f"s{n}", op="status")["result"]
        yield result


def test_a_release_that_copies_keeps_the_beat_fresh(tmp_path: Path) -> None:
    backend = SlowRelease(copying=True)
    worker = InProcess(tmp_path, backend)
    worker.until(lambda m: m.get("to") == "warm")
    worker.writer.send({"op": "release", "id": "r"})
    wait_until(backend.releasing.is_set, 10, "the release to start")
    ages, started = [], time.monotonic()
    # Without the CPU clock, the beat would be as old as the release by the end.
    for status in statuses(worker):
        assert status["state"] == "cooling"
        ages.append(status["beat_age_s"])
        if time.monotonic() - started >= 2.5 * FRESH_S:
            break
    backend.done.set()
    worker.until(lambda m: m.get("id") == "r")
    worker.close()
    assert max(ages) < FRESH_S, f"the beat reached {max(ages)} s during a release that copies"


def test_a_release_blocked_on_a_device_lets_the_beat_age(tmp_path: Path) -> None:
    backend = SlowRelease(copying=False)
    worker = InProcess(tmp_path, backend)
    worker.until(lambda m: m.get("to") == "warm")
    worker.writer.send({"op": "release", "id": "r"})
    wait_until(backend.releasing.is_set, 10, "the release to start")
    asked = statuses(worker)
    wait_until(lambda: next(asked)["beat_age_s"] >= HUNG_S, 10, "the beat to age")
    stuck = next(asked)
    assert stuck["state"] == "cooling"
    assert stuck["beat_age_s"] >= HUNG_S  # a look that saw no progress is no beat
    backend.done.set()
    worker.until(lambda m: m.get("id") == "r")
    worker.close()
    assert worker.raised == []
