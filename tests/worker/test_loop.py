"""Worker processes on one arena: handoffs, status during a decode, kills, cancels, failures."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiterd.arena import Arena
from arbiterd.arena.doorbell import SAFETY_PROBE_S
from arbiterd.arena.groups import Gate, GateHold, Keeper, group_dir
from arbiterd.config import FITTING_GROUP
from arbiterd.daemon.models.workerclient import HELLO_TIMEOUT_S, WorkerHello
from arbiterd.errors import (
    ArbiterError,
    ContextOverflowError,
    EngineError,
    InternalError,
    OutOfDeviceMemoryError,
    ProtocolError,
    RequestError,
    RestoreError,
    WorkerError,
)
from arbiterd.footprint import DeviceFootprint
from arbiterd.reply import EngineReport
from arbiterd.request import GenerateRequest
from arbiterd.spec import (
    WORKER_PROTOCOL,
    Capability,
    KvPolicy,
    ModelInfo,
    ModelSpec,
    Turns,
    WorkerConfig,
)
from arbiterd.states import BackendKind, Priority
from arbiterd.wire import LineReader, LineWriter
from arbiterd.worker.engine import EngineInfo, Generation, Moved, Prepared, engine_info
from arbiterd.worker.kvfile import KvState
from arbiterd.worker.loop import Worker
from tests.conftest import Processes
from tests.support.blocking_worker import BlockingWorker
from tests.support.requests import request_for
from tests.support.waiting import wait_until

PREFIX = " ".join(f"the fox {w} is not a dog" for w in ("one", "two", "three", "four") * 8)

# What the doubles' engine says it is: no llama.cpp is asked.
FAKE_ENGINE = EngineInfo(offload=True, devices=("CPU: test cpu", "CUDA0: test gpu"))


class Workers:
    """Spawns workers on one arena and always reaps them."""

    def __init__(self, arena: Path, model: Path) -> None:
        self.arena = arena
        self.model = model
        self.started: list[BlockingWorker] = []

    def spawn(self, name: str, **config: Any) -> BlockingWorker:
        spec = ModelSpec(
            name=name,
            path=config.pop("path", self.model),
            n_ctx=config.pop("n_ctx", 2048),
            n_gpu_layers=0,
        )
        worker = BlockingWorker.spawn(WorkerConfig(spec=spec, arena=self.arena, **config))
        self.started.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.started:
            worker.kill()


@pytest.fixture
def workers(tmp_path: Path, tiny_model: Path) -> Iterator[Workers]:
    group = Workers(tmp_path / "arena", tiny_model)
    yield group
    group.close()


def complete(worker: BlockingWorker, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return worker.generate(request_for("completion", body), timeout_s=60)


def wait_state(worker: BlockingWorker, state: str) -> None:
    wait_until(lambda: worker.status()["state"] == state, 30, f"{worker.model} {state}")


def residency_events(worker: BlockingWorker) -> list[dict[str, Any]]:
    events = []
    while not worker.events.empty():
        event = worker.events.get_nowait()
        if event["event"] == "residency":
            events.append(event)
    return events


def token_intervals(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """When this worker held the token: from taking it (→loading/warming) to cooling → cold."""
    intervals, start = [], 0.0
    for event in events:
        if event["to"] == "warming" or (event["from"] == "loading" and event["to"] == "warm"):
            start = event["at"] if event["to"] == "warming" else event["at"] - event["duration_s"]
        if event["from"] == "cooling" and event["to"] == "cold":
            intervals.append((start, event["at"]))
    return intervals


def test_two_workers_alternate_sixty_times_and_keep_their_prompt_caches(
    workers: Workers,
) -> None:
    a, b = workers.spawn("a"), workers.spawn("b")
    prompts = {"a": PREFIX + " alpha", "b": PREFIX + " beta"}
    answers = []
    for i in range(62):
        worker = (a, b)[i % 2]
        answers.append(complete(worker, prompts[worker.model] + f" {i}"))
    assert len(answers) == 62  # every request answered: 0 stranded
    # After the first request of each, only the new suffix is evaluated, never the prefix.
    assert all(r["prompt_tokens_evaluated"] <= 3 for r in answers[2:])
    assert all(r["prompt_tokens"] > 200 for r in answers)
    intervals_a = token_intervals(residency_events(a))
    intervals_b = token_intervals(residency_events(b))
    assert len(intervals_a) + len(intervals_b) >= 60
    for start_a, end_a in intervals_a:
        for start_b, end_b in intervals_b:
            assert end_a <= start_b or end_b <= start_a, "both workers held the GPU at once"


def test_status_is_answered_during_a_long_decode(workers: Workers) -> None:
    worker = workers.spawn("long", n_ctx=4096)
    done = threading.Event()

    def long_decode() -> None:
        complete(worker, "the fox", max_tokens=1500)
        done.set()

    thread = threading.Thread(target=long_decode)
    thread.start()
    wait_until(lambda: worker.status()["current"] is not None, 30, "the decode to start")
    slowest = 0.0
    for _ in range(20):
        started = time.monotonic()
        status = worker.status()
        slowest = max(slowest, time.monotonic() - started)
        if status["current"] is None:
            break
    assert slowest < 0.5, f"status took {slowest:.3f} s during a decode"
    thread.join(timeout=120)
    assert done.is_set()


def test_a_killed_warm_worker_frees_the_gpu_and_can_be_restarted(workers: Workers) -> None:
    a = workers.spawn("a")
    wait_state(a, "warm")
    a.request("pin")  # it keeps the GPU, however long b waits
    b = workers.spawn("b")
    wait_until(lambda: Arena(workers.arena).observe().waiter_pids == (b.pid,), 30, "b to wait")
    assert b.status()["state"] == "loading"  # it waits for the token before loading
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    wait_state(b, "warm")
    assert complete(b, "the fox")["completion_tokens"] >= 1
    restarted = workers.spawn("a")
    assert complete(restarted, "the dog")["completion_tokens"] >= 1
    assert complete(b, "the cat")["completion_tokens"] >= 1


def test_a_cold_model_queues_in_its_class_or_its_requests(workers: Workers) -> None:
    """The model's class from its config; a request's own class (the HTTP edge's header) wins;
    an interactive request to one model is served before a batch request to another that
    queued first."""
    batch_model = workers.spawn("batchy", priority=Priority.BATCH)
    person_model = workers.spawn("person")
    for worker in (batch_model, person_model):
        wait_state(worker, "warm")
        worker.request("release")
    arena = Arena(workers.arena)
    order: list[str] = []

    def batch_request() -> None:
        complete(batch_model, "the fox")
        order.append("batchy")

    def person_request() -> None:
        body = {"prompt": "the dog", "max_tokens": 4, "priority": "interactive"}
        person_model.generate(request_for("completion", body))
        order.append("person")

    with arena.acquire("game"):
        threads = [threading.Thread(target=batch_request)]
        threads[0].start()
        wait_until(lambda: len(arena.observe().queue) == 1, 30, "the batch model to queue")
        assert arena.observe().queue[0].priority is Priority.BATCH
        threads.append(threading.Thread(target=person_request))
        threads[1].start()
        wait_until(lambda: len(arena.observe().queue) == 2, 30, "the person's model to queue")
        queued = arena.observe().queue
        assert [(w.pid, w.priority) for w in queued] == [
            (person_model.pid, Priority.INTERACTIVE),
            (batch_model.pid, Priority.BATCH),
        ]
    for thread in threads:
        thread.join(timeout=60)
    assert order == ["person", "batchy"]


def test_a_batch_generation_pauses_for_an_interactive_request_and_resumes_identically(
    workers: Workers,
) -> None:
    """Preemption at a token boundary: the batch model gives the GPU to the interactive request
    mid-generation, gets it back, and its greedy text is what an uninterrupted run wrote."""
    batch = workers.spawn("batch", priority=Priority.BATCH, min_hold_s=0.02)
    person = workers.spawn("person", min_hold_s=0.02)
    for worker in (batch, person):
        wait_state(worker, "warm")
    assert batch.status()["backend"] == "in-place"  # pausing needs the engine build
    body = {"prompt": "the fox", "max_tokens": 1200, "temperature": 0}
    reference = batch.generate(request_for("completion", body))
    assert reference["completion_tokens"] == 1200
    batch.request("release")
    streamed = threading.Event()
    results: dict[str, dict[str, Any]] = {}
    finished: list[str] = []

    def long_batch_job() -> None:
        results["batch"] = batch.generate(
            request_for("completion", body), on_chunk=lambda _c: streamed.set()
        )
        finished.append("batch")

    thread = threading.Thread(target=long_batch_job)
    thread.start()
    assert streamed.wait(60)
    question = {"prompt": "the dog", "max_tokens": 4, "priority": "interactive"}
    results["person"] = person.generate(request_for("completion", question))
    finished.append("person")
    thread.join(timeout=120)
    assert finished == ["person", "batch"]  # the interactive request did not wait it out
    text = results["batch"]["response"]["choices"][0]["text"]
    assert text == reference["response"]["choices"][0]["text"]
    assert batch.status()["paused"] >= 1


def test_a_worker_killed_while_paused_fails_its_request_and_strands_nothing(
    workers: Workers,
) -> None:
    batch = workers.spawn("batch", priority=Priority.BATCH, min_hold_s=0.02)
    wait_state(batch, "warm")
    arena = Arena(workers.arena)
    streamed = threading.Event()
    failures: list[Exception] = []

    def long_batch_job() -> None:
        body = {"prompt": "the fox", "max_tokens": 1500, "temperature": 0}
        try:
            batch.generate(request_for("completion", body), on_chunk=lambda _c: streamed.set())
        except Exception as exc:
            failures.append(exc)

    thread = threading.Thread(target=long_batch_job)
    thread.start()
    assert streamed.wait(60)
    with arena.acquire("game", priority=Priority.INTERACTIVE, timeout_s=30):  # preempts it
        queued = [batch.pid]
        wait_until(lambda: [w.pid for w in arena.observe().queue] == queued, 10, "it to queue")
        status = batch.status()
        assert (status["state"], status["paused"]) == ("cold", 1)
        assert status["current"] is not None  # paused, not finished
        os.kill(batch.pid, signal.SIGKILL)
        thread.join(timeout=30)
        assert failures
        assert isinstance(failures[0], WorkerError)
        assert arena.observe().queue == ()
    assert arena.observe().holder_pid is None
    with arena.acquire("next", timeout_s=5):
        pass  # nobody holds or blocks it


def test_a_model_that_is_not_preemptible_finishes_first(workers: Workers) -> None:
    batch = workers.spawn("batch", priority=Priority.BATCH, min_hold_s=0.02, preemptible=False)
    wait_state(batch, "warm")
    arena = Arena(workers.arena)
    streamed = threading.Event()
    body = {"prompt": "the fox", "max_tokens": 600, "temperature": 0}
    thread = threading.Thread(
        target=lambda: batch.generate(
            request_for("completion", body), on_chunk=lambda _c: streamed.set()
        )
    )
    thread.start()
    assert streamed.wait(60)
    with arena.acquire("game", priority=Priority.INTERACTIVE, timeout_s=60):
        assert batch.status()["current"] is None  # the token came once the generation ended
    thread.join(timeout=30)
    assert batch.status()["paused"] == 0


def test_a_worker_loads_only_once_it_holds_the_token(workers: Workers) -> None:
    arena = Arena(workers.arena)
    with arena.acquire("game") as token:
        worker = workers.spawn("m")
        wait_until(token.wanted, 10, "the worker to ask for the GPU")
        status = worker.status()
        assert (status["state"], status["holds_token"], status["resident_bytes"]) == (
            "loading",
            False,
            0,
        )
        held_until = time.time()
    wait_state(worker, "warm")
    assert worker.status()["resident_bytes"] > 0
    # The load's event says who it waited for, measured by the worker itself.
    loaded = next(e for e in residency_events(worker) if e["from"] == "loading")
    assert (loaded["holder_pid"], loaded["holder_name"]) == (os.getpid(), "game")
    assert loaded["waited_from"] + loaded["wait_s"] >= held_until - 0.01


def test_a_warm_up_says_which_model_held_the_gpu_and_how_long_it_waited(
    workers: Workers,
) -> None:
    a, b = workers.spawn("a"), workers.spawn("b")
    complete(a, "the fox")
    complete(b, "the dog")  # b waits for a, which releases because b wants the GPU
    warmed = [e for e in residency_events(b) if e["to"] == "warm"][-1]
    assert (warmed["holder_pid"], warmed["holder_name"]) == (a.pid, "a")
    assert warmed["wait_s"] >= 0
    released = [e for e in residency_events(a) if e["to"] == "cold"][-1]
    got_token_at = warmed["waited_from"] + warmed["wait_s"]
    assert warmed["waited_from"] <= released["at"] <= got_token_at + 0.05  # two clocks
    complete(b, "the cat")  # already warm: no wait at all
    assert [e for e in residency_events(b) if e["to"] == "warm"] == []


def test_cancel_stops_a_streaming_request(workers: Workers) -> None:
    worker = workers.spawn("m")
    chunks: list[dict[str, Any]] = []

    def on_chunk(chunk: dict[str, Any]) -> None:
        chunks.append(chunk)
        if len(chunks) == 2:
            worker.cancel("streamed")

    body = {"prompt": "the fox", "max_tokens": 1000, "temperature": 0}
    result = worker.generate(
        request_for("completion", body), on_chunk=on_chunk, request_id="streamed"
    )
    assert result["cancelled"]
    assert result["completion_tokens"] < 1000
    assert complete(worker, "the dog")["completion_tokens"] >= 1  # still serving


def test_release_and_warm_on_command(workers: Workers) -> None:
    worker = workers.spawn("m", kv_on_release=KvPolicy.HOST)
    first = complete(worker, PREFIX)
    assert worker.request("release")["state"] == "cold"
    assert worker.status()["resident_bytes"] == 0
    assert Arena(workers.arena).observe().holder_pid is None
    assert worker.request("warm")["state"] == "warm"
    follow_up = complete(worker, PREFIX + " more")
    suffix_tokens = follow_up["prompt_tokens"] - first["prompt_tokens"]
    assert follow_up["prompt_tokens_evaluated"] <= suffix_tokens + 1


def test_idle_release_goes_cold_by_itself(workers: Workers) -> None:
    worker = workers.spawn("m", idle_release_s=0.2)
    complete(worker, "the fox")
    event = worker.wait_event(lambda e: e.get("to") == "cold", timeout_s=10)
    assert event["reason"] == "idle"
    assert complete(worker, "the fox")["completion_tokens"] >= 1  # and warms on demand


GPU_JOB = Path(__file__).parents[2] / "docs" / "examples" / "gpu-job.sh"


@pytest.mark.parametrize("waiter", ["arbiterd", "the document's shell example"])
def test_a_waiter_that_comes_while_a_warm_worker_sleeps_is_served_before_its_safety_probe(
    workers: Workers, procs: Processes, waiter: str
) -> None:
    """Warm and idle, the worker sleeps on its doorbell: by itself it would next probe
    SAFETY_PROBE_S after it went to sleep, which it did after its event saying it is warm. A
    release that starts before then (the events' own times) was started by the waiter's ring."""
    worker = workers.spawn("m", min_hold_s=0.0)
    warm = worker.wait_event(lambda e: e.get("to") == "warm")
    time.sleep(0.2)  # not a measurement: the worker's first probe is over, it sleeps
    arena = Arena(workers.arena)
    if waiter == "arbiterd":
        taker = procs.actor(arena, "hold", "waiter")
    else:
        env = dict(os.environ, ARBITERD_ARENA=str(arena.path))
        taker = procs.start(["sh", str(GPU_JOB), "true"], env=env)
    cooling = worker.wait_event(lambda e: e.get("to") == "cooling")
    assert cooling["reason"] == "wanted"
    assert cooling["at"] < warm["at"] + SAFETY_PROBE_S, (
        f"released {cooling['at'] - warm['at']:.2f} s after it was warm: by its safety probe"
    )
    if waiter == "arbiterd":
        assert taker.stdout is not None
        assert taker.stdout.readline().strip() == "acquired"
    else:
        assert taker.wait(timeout=30) == 0


def test_a_prompt_longer_than_the_context_is_refused_and_the_worker_lives(
    workers: Workers,
) -> None:
    worker = workers.spawn("m", n_ctx=64)
    with pytest.raises(ContextOverflowError, match="context window"):
        complete(worker, PREFIX)
    assert complete(worker, "the fox")["completion_tokens"] >= 1


def test_the_requests_that_ended_a_worker_are_their_own_errors_and_it_lives(
    workers: Workers,
) -> None:
    """Issue 24's requests, sent past the HTTP edge that now refuses them: a lone surrogate in a
    prompt (a bug's internal error) and a 5,000-digit token id (a bad request)."""
    worker = workers.spawn("m")
    with pytest.raises(InternalError, match=r"\(UnicodeEncodeError\)"):
        complete(worker, "ab\ud800cd")
    bias = {
        "kind": "completion",
        "prompt": "x",
        "sampling": {"max_tokens": 1},
        "logit_bias": {"1" * 5000: 1},
    }
    with pytest.raises(RequestError, match="which is not an integer"):
        worker.request("generate", request=bias, timeout_s=60)
    assert complete(worker, "the fox")["completion_tokens"] >= 1
    assert worker.returncode is None


def test_a_model_that_cannot_load_fails_with_its_reason(workers: Workers, tmp_path: Path) -> None:
    worker = workers.spawn("broken", path=tmp_path / "missing.gguf")
    event = worker.wait_event(lambda e: e.get("to") == "failed")
    assert "missing.gguf" in event["reason"]
    status = worker.status()
    assert status["state"] == "failed"
    assert "missing.gguf" in status["last_error"]
    with pytest.raises(EngineError, match="failed to load"):
        complete(worker, "the fox")
    assert Arena(workers.arena).observe().holder_pid is None  # the token was given back
    assert worker.shutdown() == 0


def test_shutdown_releases_the_token_and_exits_cleanly(workers: Workers) -> None:
    worker = workers.spawn("m")
    wait_state(worker, "warm")
    assert worker.shutdown() == 0
    assert Arena(workers.arena).observe().holder_pid is None


def test_shutdown_lets_the_current_request_finish(workers: Workers) -> None:
    worker = workers.spawn("m")
    first_chunk = threading.Event()
    results: list[dict[str, Any]] = []
    body = {"prompt": "the fox", "max_tokens": 200, "temperature": 0}
    thread = threading.Thread(
        target=lambda: results.append(
            worker.generate(request_for("completion", body), on_chunk=lambda _: first_chunk.set())
        )
    )
    thread.start()
    assert first_chunk.wait(30)
    assert worker.shutdown() == 0  # the daemon is still there: it gets the whole answer
    thread.join(timeout=30)
    assert results[0]["cancelled"] is False
    assert results[0]["completion_tokens"] == 200


SUFFIX = " and the cat is quick"


def test_an_unloaded_worker_keeps_its_prompt_cache_for_the_next(
    workers: Workers, tmp_path: Path
) -> None:
    kv_file = tmp_path / "first.kv"
    first = workers.spawn("first", kv_file=kv_file)
    before = complete(first, PREFIX + SUFFIX, max_tokens=8)
    reply = first.request("unload")
    assert first.wait(timeout_s=30) == 0
    assert reply["kv_file"] == str(kv_file)
    assert reply["tokens"] == before["prompt_tokens"] + 7  # the last sampled token is not fed
    assert reply["kv_bytes"] == kv_file.stat().st_size
    assert reply["error"] == ""

    again = workers.spawn("first", kv_file=kv_file)
    after = complete(again, PREFIX + SUFFIX, max_tokens=8)
    assert after["response"]["choices"] == before["response"]["choices"]
    assert after["prompt_tokens_evaluated"] == 1  # decoded again for its logits
    assert not kv_file.exists()  # used once


def test_a_damaged_state_file_is_discarded_for_a_full_prefill(
    workers: Workers, tmp_path: Path
) -> None:
    kv_file = tmp_path / "first.kv"
    first = workers.spawn("first", kv_file=kv_file)
    before = complete(first, PREFIX, max_tokens=8)
    first.request("unload")
    first.wait(timeout_s=30)
    blob = bytearray(kv_file.read_bytes())
    blob[-100] ^= 0xFF
    kv_file.write_bytes(bytes(blob))

    again = workers.spawn("first", kv_file=kv_file)
    after = complete(again, PREFIX, max_tokens=8)
    assert after["response"]["choices"] == before["response"]["choices"]
    assert after["prompt_tokens_evaluated"] == after["prompt_tokens"]
    assert not kv_file.exists()


def test_a_state_file_for_another_context_is_discarded(workers: Workers, tmp_path: Path) -> None:
    kv_file = tmp_path / "first.kv"
    first = workers.spawn("first", kv_file=kv_file)
    complete(first, PREFIX)
    first.request("unload")
    first.wait(timeout_s=30)
    assert kv_file.exists()

    other = workers.spawn("first", kv_file=kv_file, n_ctx=1024)
    after = complete(other, PREFIX)
    assert after["prompt_tokens_evaluated"] == after["prompt_tokens"]


def test_an_unload_that_cannot_write_still_unloads_and_says_why(
    workers: Workers, tmp_path: Path
) -> None:
    kv_file = tmp_path / "no such folder" / "first.kv"
    first = workers.spawn("first", kv_file=kv_file)
    complete(first, PREFIX)
    reply = first.request("unload")
    assert first.wait(timeout_s=30) == 0
    assert reply["kv_file"] is None
    assert "could not save the prompt cache" in reply["error"]
    assert "No such file or directory" in reply["error"]


class FlakyRestore:
    """A backend whose restore fails: the worker must roll back to cold and free the token."""

    kind = BackendKind.RELOAD
    fallback_reason = "test double: no residency API"
    keeps_kv_on_device = False
    prompt_tokens_evaluated_total = 0
    tokens_generated_total = 0

    def __init__(self, failure: Exception | None = None) -> None:
        self.spec = ModelSpec(name="flaky", path=Path("/nonexistent"))
        self.warm = False
        self.failure = failure or RestoreError("out of device memory")
        self.restores = 0  # how often a restore was tried
        self.begun: dict[str, tuple[Prepared, Any, Any]] = {}  # by request id

    def open(self) -> None:
        pass

    def load(self) -> Moved:
        self.warm = True
        return Moved(0.0, 100, 0, 0)

    def release(self, kv: KvPolicy) -> Moved:
        self.warm = False
        return Moved(0.0, 100, 10, 0)

    def restore(self) -> Moved:
        self.restores += 1
        raise self.failure

    def prepare(self, request: GenerateRequest, cancelled: Any) -> Prepared:
        return Prepared(request.kind, {"prompt": [1]})

    @property
    def generating(self) -> int:
        return len(self.begun)

    def begin(self, request_id: str, request: Prepared, sink: Any, cancelled: Any) -> None:
        self.begun[request_id] = (request, sink, cancelled)

    def step(self) -> dict[str, Generation | ArbiterError]:
        """One decode of the batch: here each begun request runs to its end (`run`)."""
        begun, self.begun = self.begun, {}
        return {request_id: self.run(*args) for request_id, args in begun.items()}

    def abandon(self, error: ArbiterError) -> list[str]:
        begun, self.begun = self.begun, {}
        return list(begun)

    def run(self, request: Prepared, sink: Any, cancelled: Any) -> Generation:
        return Generation({"choices": []}, 1, 1, 1)

    def resident_bytes(self) -> int:
        return 100 if self.warm else 0

    @property
    def predicted_footprint(self) -> tuple[DeviceFootprint, ...]:
        return ()

    def footprint(self) -> tuple[DeviceFootprint, ...]:
        return ()

    def capabilities(self) -> tuple[Capability, ...]:
        return (Capability.COMPLETION,)

    def model_info(self) -> ModelInfo | None:
        return None

    def host_kv_bytes(self) -> int:
        return 0 if self.warm else 10

    def host_weights_bytes(self) -> int:
        return 0

    def kept_kv(self) -> KvState | None:
        return None

    def adopt_kv(self, kv: KvState) -> None:
        raise RestoreError("a test double keeps no cache")

    def close(self) -> None:
        self.warm = False


@pytest.mark.parametrize(
    ("failure", "code", "message"),
    [
        (RestoreError("the model file changed"), "restore", "the model file changed"),
        # Outside a fitting set, out of device memory is not tried again at once (issue 44).
        (OutOfDeviceMemoryError("out of device memory"), "restore", "out of device memory"),
        # What a restore should never raise is rolled back all the same (issue 24).
        (ValueError("a bug"), "internal_error", "(ValueError)"),
    ],
    ids=["restore-error", "out-of-device-memory", "unexpected"],
)
def test_a_failed_restore_rolls_back_to_cold_without_the_token(
    tmp_path: Path, failure: Exception, code: str, message: str
) -> None:
    ours, theirs = socket.socketpair()
    config = WorkerConfig(spec=ModelSpec(name="flaky", path=Path("/x")), arena=tmp_path / "arena")
    backend = FlakyRestore(failure)
    worker = Worker(config, backend, theirs, FAKE_ENGINE)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    reader, writer = LineReader(ours), LineWriter(ours)
    messages: list[dict[str, Any]] = []

    def until(predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            message = reader.read()
            assert message is not None
            messages.append(message)
            if predicate(message):
                return message

    until(lambda m: m.get("to") == "warm")
    writer.send({"op": "release", "id": "1"})
    until(lambda m: m.get("id") == "1")
    writer.send({"op": "generate", "id": "2", "request": {"kind": "completion", "prompt": "x"}})
    reply = until(lambda m: m.get("id") == "2" and "started" not in m)
    assert reply["error"]["code"] == code
    assert message in reply["error"]["message"]
    writer.send({"op": "warm", "id": "w"})  # a warm-up on command fails the same way
    assert until(lambda m: m.get("id") == "w")["error"]["code"] == code
    rollback = [m for m in messages if m.get("from") == "warming"]
    assert [m["to"] for m in rollback] == ["cold", "cold"]
    assert backend.restores == 2  # one try each
    assert Arena(tmp_path / "arena").observe().holder_pid is None
    writer.send({"op": "status", "id": "3"})
    assert until(lambda m: m.get("id") == "3")["result"]["state"] == "cold"
    ours.close()  # the daemon is gone: the worker stops
    thread.join(timeout=10)
    assert not thread.is_alive()
    theirs.close()


class Buggy(FlakyRestore):
    """A backend with a bug that one request's prompt sets off, in preparing or in running it;
    and, with `breaks_releasing`, a release that raises (its restore works). In place: a
    generation may pause."""

    kind = BackendKind.IN_PLACE
    fallback_reason = ""

    def __init__(self, *, breaks_releasing: bool = False) -> None:
        super().__init__()
        self.breaks_releasing = breaks_releasing

    def restore(self) -> Moved:
        self.warm = True
        return Moved(0.0, 100, 10, 0)

    def release(self, kv: KvPolicy) -> Moved:
        if self.breaks_releasing:
            raise ValueError("a bug in releasing")
        return super().release(kv)

    def prepare(self, request: GenerateRequest, cancelled: Any) -> Prepared:
        if request.prompt == "prepare":
            "ab\ud800cd".encode()  # what the tokenizer met in issue 24
        return Prepared(request.kind, {"prompt": [1], "bug": request.prompt})

    def step(self) -> dict[str, Generation | ArbiterError]:
        if any(
            request.completion["bug"] == "until-paused" and not cancelled()
            for request, _, cancelled in self.begun.values()
        ):
            time.sleep(0.002)  # a decode of a generation that goes on until paused
            return {}
        return super().step()

    def run(self, request: Prepared, sink: Any, cancelled: Any) -> Generation:
        if request.completion["bug"] == "run":
            int("1" * 5000)  # what the logit bias met in issue 24
        return super().run(request, sink, cancelled)


class InProcess:
    """A Worker on `backend` in a thread, and the daemon's end of its socket."""

    def __init__(self, tmp_path: Path, backend: FlakyRestore, **config: Any) -> None:
        self.arena = tmp_path / "arena"
        self._ours, self._theirs = socket.socketpair()
        spec = ModelSpec(name="buggy", path=Path("/x"))
        worker = Worker(
            WorkerConfig(spec=spec, arena=self.arena, **config), backend, self._theirs, FAKE_ENGINE
        )
        self.raised: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(worker,), daemon=True)
        self.thread.start()
        self.reader, self.writer = LineReader(self._ours), LineWriter(self._ours)

    def _run(self, worker: Worker) -> None:
        try:
            worker.run()
        except Exception as exc:  # what ended the worker, for the test to see
            self.raised.append(exc)

    def until(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            message = self.reader.read()
            assert message is not None, "the worker closed its socket"
            if predicate(message):
                return message

    def ask(self, request_id: str, **message: Any) -> dict[str, Any]:
        self.writer.send({"id": request_id, **message})
        return self.until(lambda m: m.get("id") == request_id)

    def generate(self, request_id: str, prompt: str) -> dict[str, Any]:
        """The request's reply, after the "started" its engine thread says as it takes it."""
        request = {"kind": "completion", "prompt": prompt}
        assert self.ask(request_id, op="generate", request=request) == {
            "id": request_id,
            "started": True,
        }
        return self.until(lambda m: m.get("id") == request_id)

    def send_line(self, line: bytes) -> None:
        """Write one raw line, as a daemon with a bug could."""
        self._ours.sendall(line + b"\n")

    def close(self) -> None:
        self._ours.close()  # the daemon is gone: the worker stops
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        self._theirs.close()


def test_a_request_that_meets_a_bug_is_its_own_error_and_the_worker_serves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker = InProcess(tmp_path, Buggy())
    worker.until(lambda m: m.get("to") == "warm")
    with caplog.at_level(logging.ERROR, logger="arbiterd.worker.loop"):
        failed = [worker.generate(where, where) for where in ("prepare", "run")]
    for reply, kind in zip(failed, ("UnicodeEncodeError", "ValueError"), strict=True):
        assert reply["error"] == {
            "code": "internal_error",
            "message": f"internal error in the worker of buggy ({kind}); "
            "the daemon's log has its traceback",
        }
    # Each traceback is in the log, where the request's own error points.
    assert [type(r.exc_info[1]).__name__ for r in caplog.records if r.exc_info] == [
        "UnicodeEncodeError",
        "ValueError",
    ]
    assert "result" in worker.generate("ok", "the fox")
    status = worker.ask("s", op="status")["result"]
    assert (status["state"], status["holds_token"], status["served"]) == ("warm", True, 1)
    worker.close()
    assert worker.raised == []


class OutOfDeviceMemory(FlakyRestore):
    """In place, its footprint predicted (50 bytes on gpu0): its first `failures` restores run
    out of device memory, the next ones work. Each restore notes the other members of its
    fitting set warm as it ran."""

    kind = BackendKind.IN_PLACE
    fallback_reason = ""

    def __init__(self, keeper: Keeper, failures: int) -> None:
        super().__init__(OutOfDeviceMemoryError("restore failed: out of device memory"))
        self.keeper = keeper
        self.failures = failures
        self.beside: list[list[str]] = []  # by restore, the others warm

    def restore(self) -> Moved:
        self.beside.append(
            [name for name, warm, _ in self.keeper.look() if warm and name != "buggy"]
        )
        if len(self.beside) <= self.failures:
            return super().restore()
        self.restores += 1
        self.warm = True
        return Moved(0.0, 100, 10, 0)

    @property
    def predicted_footprint(self) -> tuple[DeviceFootprint, ...]:
        return (DeviceFootprint("gpu0", weights_bytes=30, kv_bytes=10, compute_bytes=10),)


@pytest.fixture
def fitting_set(tmp_path: Path) -> Iterator[Keeper]:
    """A device's fitting set of 100 bytes, its keeper running in the test's arena."""
    keeper = Keeper(Arena(tmp_path / "arena"), FITTING_GROUP, budget=100)
    keeper.start()
    yield keeper
    keeper.stop()


def enter(keeper: Keeper, member: str, footprint: int) -> GateHold:
    """`member` warm in the keeper's set, as a worker enters it."""
    ticket = Gate(keeper.arena, FITTING_GROUP, member, lambda: footprint).queue(Priority.NORMAL)
    try:
        return ticket.take(member)
    finally:
        ticket.leave()


def said_footprint(keeper: Keeper, member: str) -> bytes:
    """The footprint `member` wrote into its want lock as it last queued."""
    path = group_dir(keeper.arena, FITTING_GROUP) / "members" / f"{member}.want.lock"
    return path.read_bytes()


def test_a_member_out_of_device_memory_tries_once_more_alone_and_is_served(
    tmp_path: Path, fitting_set: Keeper, caplog: pytest.LogCaptureFixture
) -> None:
    other = enter(fitting_set, "other", 40)
    backend = OutOfDeviceMemory(fitting_set, failures=1)
    worker = InProcess(tmp_path, backend, group=FITTING_GROUP)
    try:
        worker.until(lambda m: m.get("to") == "warm")  # loaded beside the other: 50 + 40 fit
        assert worker.ask("r", op="release")["result"] == {"state": "cold"}

        def leave_when_told() -> None:  # the retry alone makes the keeper withdraw the other
            wait_until(other.wanted, 10, "other told to leave")
            other.release()

        events: list[dict[str, Any]] = []

        def answer(message: dict[str, Any]) -> bool:
            events.append(message)
            return message.get("id") == "g" and "started" not in message

        leaving = threading.Thread(target=leave_when_told)
        leaving.start()
        with caplog.at_level(logging.WARNING, logger="arbiterd.worker.loop"):
            worker.writer.send(
                {"op": "generate", "id": "g", "request": {"kind": "completion", "prompt": "x"}}
            )
            reply = worker.until(answer)
        leaving.join(timeout=10)
        assert "result" in reply, reply
        # The first try beside the other; the retry alone, once the other had left.
        assert backend.beside == [["other"], []]
        warm_ups = [(m["from"], m["to"]) for m in events if m.get("event") == "residency"]
        assert warm_ups == [
            ("cold", "warming"),
            ("warming", "cold"),
            ("cold", "warming"),
            ("warming", "warm"),
        ]
        assert "out of device memory; it tries once more, alone on its device" in caplog.text
        # The retry said no footprint (the whole budget): the keeper counts it so while warm.
        assert said_footprint(fitting_set, "buggy") == b""
        assert ("buggy", True, None) in fitting_set.look()
        # Its next warm spell says its footprint again.
        assert worker.ask("r2", op="release")["result"] == {"state": "cold"}
        assert "result" in worker.generate("g2", "x")
        assert said_footprint(fitting_set, "buggy") == b"50"
    finally:
        worker.close()
        other.release()
    assert worker.raised == []


def test_a_member_out_of_device_memory_alone_too_gets_the_error_and_keeps_its_kv(
    tmp_path: Path, fitting_set: Keeper
) -> None:
    backend = OutOfDeviceMemory(fitting_set, failures=2)
    worker = InProcess(tmp_path, backend, group=FITTING_GROUP)
    try:
        worker.until(lambda m: m.get("to") == "warm")
        assert worker.ask("r", op="release")["result"] == {"state": "cold"}
        reply = worker.generate("g", "x")
        assert reply["error"]["code"] == "restore"
        assert "out of device memory" in reply["error"]["message"]
        assert backend.restores == 2  # the retry was the only one
        status = worker.ask("s", op="status")["result"]
        assert (status["state"], status["holds_token"]) == ("cold", False)
        assert status["host_kv_bytes"] == 10  # the KV released with it is kept
        # Alone was for the retry only: the next queue says its footprint again.
        assert "result" in worker.generate("g2", "x")
        assert said_footprint(fitting_set, "buggy") == b"50"
    finally:
        worker.close()
    assert worker.raised == []


@pytest.mark.parametrize(
    ("line", "request_id", "problem"),
    [
        (b'{"op": "dance", "id": "d1"}', "d1", "bad op 'dance'"),
        (b'{"op": "generate", "id": 7}', None, "a generate message without a string id"),
        (b'{"op": "generate", "id": "g1", "body": {', "g1", "not JSON"),
        (b'{"op": "generate", "id": "u1", "body": "\xff"}', "u1", "not UTF-8"),
        (b"[1, 2]", None, "not a JSON object"),
    ],
    ids=["bad-op", "no-id", "not-json", "not-utf8", "not-an-object"],
)
def test_a_malformed_message_is_answered_with_its_code_and_the_id_it_names(
    tmp_path: Path, line: bytes, request_id: str | None, problem: str
) -> None:
    worker = InProcess(tmp_path, FlakyRestore())
    worker.until(lambda m: m.get("to") == "warm")
    worker.send_line(line)
    reply = worker.until(lambda m: "error" in m)
    assert reply["id"] == request_id
    assert reply["error"]["code"] == "bad_message"
    assert problem in reply["error"]["message"]
    assert "result" in worker.generate("next", "the fox")  # the worker serves on
    worker.close()
    assert worker.raised == []


def test_a_request_whose_release_breaks_midway_ends_the_worker_and_frees_the_gpu(
    tmp_path: Path,
) -> None:
    """A pause for a higher class whose release raises leaves the model cooling with the token:
    nothing could be served and nobody would get the GPU, so the worker answers the request and
    exits (the daemon starts another)."""
    worker = InProcess(
        tmp_path, Buggy(breaks_releasing=True), priority=Priority.BATCH, min_hold_s=0.0
    )
    worker.until(lambda m: m.get("to") == "warm")
    worker.writer.send(
        {
            "op": "generate",
            "id": "long",
            "request": {"kind": "completion", "prompt": "until-paused"},
        }
    )
    # Queued behind the worker; the pause it asks for breaks; the worker's exit frees the GPU.
    with Arena(worker.arena).acquire("person", priority=Priority.INTERACTIVE, timeout_s=10):
        reply = worker.until(lambda m: m.get("id") == "long" and "started" not in m)
    assert reply["error"]["code"] == "internal_error"
    worker.thread.join(timeout=10)
    assert [str(exc) for exc in worker.raised] == [
        "buggy was left cooling (with the token) by a failed request"
    ]
    worker.close()


def test_a_pinned_model_keeps_the_gpu_until_unpinned(workers: Workers) -> None:
    pinned = workers.spawn("pinned")
    wait_state(pinned, "warm")
    assert pinned.request("pin") == {"pinned": True}
    other = workers.spawn("other")
    arena = Arena(workers.arena)
    wait_until(lambda: other.pid in arena.observe().waiter_pids, 10, "the other to wait")
    # Far beyond its 0.1 s minimum hold, a pinned model still holds the GPU.
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert pinned.status()["state"] == "warm"
    assert other.status()["state"] == "loading"
    assert pinned.request("unpin") == {"pinned": False}
    wait_state(other, "warm")
    assert pinned.status()["state"] == "cold"


class SlowToPrepare(FlakyRestore):
    """A backend whose requests take as long to tokenize as nobody cancels them (its restore
    works): it calls back between pieces, as the real tokenizer does."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces = 0

    def restore(self) -> Moved:
        self.warm = True
        return Moved(0.0, 100, 10, 0)

    def prepare(self, request: GenerateRequest, cancelled: Any) -> Prepared:
        while not cancelled():
            self.pieces += 1
            time.sleep(0.002)  # tokenizing one piece
        raise RequestError("cancelled while its prompt was tokenized")


def test_a_warm_worker_tokenizing_lets_a_waiter_in_at_its_turns_end_and_stops_on_cancel(
    tmp_path: Path,
) -> None:
    """The request it tokenizes is its turn's work (issue 43), so the waiter gets the GPU when
    the turn ends, between two pieces: not after the whole tokenizing (issue 10)."""
    ours, theirs = socket.socketpair()
    config = WorkerConfig(
        spec=ModelSpec(name="slow", path=Path("/x")),
        arena=tmp_path / "arena",
        turns=Turns(min_turn_s=0.2, max_turn_s=0.2),
    )
    backend = SlowToPrepare()
    thread = threading.Thread(target=Worker(config, backend, theirs, FAKE_ENGINE).run, daemon=True)
    thread.start()
    reader, writer = LineReader(ours), LineWriter(ours)

    def until(predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            message = reader.read()
            assert message is not None
            if predicate(message):
                return message

    until(lambda m: m.get("to") == "warm")
    writer.send({"op": "generate", "id": "big", "request": {"kind": "chat", "messages": [{}]}})
    wait_until(lambda: backend.pieces > 0, 10, "the tokenizing to begin")
    started = time.monotonic()
    with Arena(tmp_path / "arena").acquire("game", timeout_s=10):
        waited_s = time.monotonic() - started
        writer.send({"op": "cancel", "id": "c", "target": "big"})
        reply = until(lambda m: m.get("id") == "big" and "started" not in m)
    assert waited_s < 1.0  # the worker's 0.2 s turn, then the next piece
    assert reply["error"] == {
        "code": "bad_request",
        "message": "cancelled while its prompt was tokenized",
    }
    ours.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    theirs.close()


# -- what runs the model (issue 15) --------------------------------------------------------------


def test_the_hello_and_the_status_say_the_backend_and_the_engine(workers: Workers) -> None:
    worker = workers.spawn("m")
    hello = worker.hello
    assert hello is not None
    assert (hello.model, hello.pid) == ("m", worker.pid)
    # This machine's engine, as the worker's own llama.cpp reports it.
    assert hello.engine.to_json() == engine_info().to_json()
    # A reason exactly when the worker fell back to reload.
    assert (hello.backend, bool(hello.fallback_reason)) in {("in-place", False), ("reload", True)}
    status = worker.status()
    assert (status["backend"], status["fallback_reason"], status["engine"]) == (
        hello.backend,
        hello.fallback_reason,
        hello.engine.to_json(),
    )


class InPlaceDouble(FlakyRestore):
    kind = BackendKind.IN_PLACE
    fallback_reason = ""


def test_the_hello_carries_the_backends_kind_and_reason_and_the_engine(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    config = WorkerConfig(spec=ModelSpec(name="gpu", path=Path("/x")), arena=tmp_path / "arena")
    thread = threading.Thread(
        target=Worker(config, InPlaceDouble(), theirs, FAKE_ENGINE).run, daemon=True
    )
    thread.start()
    first = LineReader(ours).read()
    ours.close()  # the daemon is gone: the worker stops
    thread.join(timeout=10)
    theirs.close()
    assert first is not None
    assert first["hello"] == {
        "protocol": WORKER_PROTOCOL,
        "model": "gpu",
        "pid": os.getpid(),
        "backend": "in-place",
        "fallback_reason": "",
        "engine": {"offload": True, "devices": ["CPU: test cpu", "CUDA0: test gpu"]},
    }
    hello = WorkerHello.read(first["hello"])
    assert hello.engine == EngineReport(True, ("CPU: test cpu", "CUDA0: test gpu"))


GOOD_HELLO: dict[str, Any] = {
    "protocol": WORKER_PROTOCOL,
    "model": "m",
    "pid": 42,
    "backend": "reload",
    "fallback_reason": "a stock build",
    "engine": {"offload": False, "devices": ["CPU: test cpu"]},
}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"protocol": 1}, "protocol 1"),
        ({"pid": "42"}, "pid"),
        ({"backend": "magic"}, "unknown backend 'magic'"),
        ({"backend": None}, "unknown backend None"),
        ({"fallback_reason": None}, "fallback_reason"),
        ({"engine": None}, "engine is not an object"),
        ({"engine": {"offload": 1, "devices": []}}, "engine.offload"),
        ({"engine": {"offload": False, "devices": "CPU"}}, "engine.devices"),
    ],
)
def test_a_hello_that_is_not_ours_names_its_first_problem(
    change: dict[str, Any], problem: str
) -> None:
    assert WorkerHello.read(GOOD_HELLO).backend == "reload"
    with pytest.raises(ProtocolError, match=re.escape(problem)):
        WorkerHello.read({**GOOD_HELLO, **change})


def test_a_worker_that_dies_before_its_hello_fails_its_spawn_at_once(
    tmp_path: Path, tiny_model: Path
) -> None:
    config = WorkerConfig(spec=ModelSpec(name="m", path=tiny_model), arena=tmp_path / "arena")
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(tmp_path / "nowhere")}  # no engine to import
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker for m exited \(1\) before its hello"):
        BlockingWorker.spawn(config, env=env)
    assert time.monotonic() - started < HELLO_TIMEOUT_S / 2  # not the hello's whole timeout
