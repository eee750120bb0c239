"""Several requests decoded in one batch (issue 42), on the real engine (CPU): each answers as it
would alone, a cancel frees its sequence at the next step, a prompt that cannot fit fails alone,
and a release and restore with sequences in flight resumes each of them where it was. Then the
same through a worker process, requests sent at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiterd.errors import ArbiterError, ContextOverflowError
from arbiterd.spec import KvPolicy, ModelSpec, Residency, WorkerConfig
from arbiterd.worker.engine import Generation, InPlaceBackend, Moved, select_backend
from arbiterd.worker.engine.records import never
from tests.support.blocking_worker import BlockingWorker
from tests.support.requests import request_for

N_CTX = 2048
PROMPTS = {
    "fox": "the quick brown fox is not a dog " * 6,
    "cat": "a cat sat on the mat and looked at the " * 5,
    "sea": "waves roll over the grey sea while gulls " * 5,
    "owl": "an owl in the old oak tree says " * 7,
}
# How far a token's log-probability may move when it is decoded in a batch of several
# sequences instead of alone: llama.cpp's CPU kernels sum in another order for another batch
# shape (its own batch-size nondeterminism), which moves the last bits of a float32.
LOGPROB_TOLERANCE = 1e-3


def greedy(prompt: str, max_tokens: int = 24) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2}


def answer(generation: Generation | ArbiterError) -> tuple[str, list[float]]:
    """An answer's text and its tokens' log-probabilities."""
    assert isinstance(generation, Generation), generation
    choice = generation.response["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def assert_same(together: Generation | ArbiterError, alone: Generation) -> None:
    text, logprobs = answer(together)
    alone_text, alone_logprobs = answer(alone)
    assert text == alone_text
    assert logprobs == pytest.approx(alone_logprobs, abs=LOGPROB_TOLERANCE)


def in_place(model: Path, parallel: int = 4, n_gpu_layers: int = 0) -> InPlaceBackend:
    spec = ModelSpec(
        name="m",
        path=model,
        n_ctx=N_CTX,
        n_gpu_layers=n_gpu_layers,
        residency=Residency.IN_PLACE,
        parallel=parallel,
    )
    chosen = select_backend(spec)
    assert isinstance(chosen, InPlaceBackend), "the engine is not the arbiterd build"
    return chosen


@pytest.fixture
def backend(tiny_model: Path) -> Iterator[InPlaceBackend]:
    chosen = in_place(tiny_model)
    chosen.load()
    yield chosen
    chosen.close()


def alone(
    model: Path, bodies: dict[str, dict[str, Any]], n_gpu_layers: int = 0
) -> dict[str, Generation]:
    """Each request on a fresh model of one sequence, one after the other."""
    single = in_place(model, parallel=1, n_gpu_layers=n_gpu_layers)
    single.load()
    try:
        return {
            key: single.generate(request_for("completion", b), None) for key, b in bodies.items()
        }
    finally:
        single.close()


def together(
    backend: InPlaceBackend,
    bodies: dict[str, dict[str, Any]],
    *,
    cancelled: dict[str, Callable[[], bool]] | None = None,
    between: Callable[[int], None] | None = None,
) -> dict[str, Generation | ArbiterError]:
    """Every request begun at once, then stepped until each has ended; `between` is called
    after each step with the step's number."""
    for key, body in bodies.items():
        prepared = backend.prepare(request_for("completion", body), never)
        backend.begin(key, prepared, None, (cancelled or {}).get(key, never))
    ended: dict[str, Generation | ArbiterError] = {}
    steps = 0
    while len(ended) < len(bodies):
        ended.update(backend.step())
        steps += 1
        if between is not None:
            between(steps)
    return ended


def test_each_request_of_a_batch_answers_as_it_would_alone(
    backend: InPlaceBackend, tiny_model: Path
) -> None:
    bodies = {key: greedy(prompt) for key, prompt in PROMPTS.items()}
    running: list[int] = []
    ended = together(backend, bodies, between=lambda _: running.append(backend.generating))
    assert max(running) == len(bodies)  # all four decoded in the same steps
    expected = alone(tiny_model, bodies)
    for key in bodies:
        assert_same(ended[key], expected[key])


def test_a_cancelled_request_frees_its_sequence_at_the_next_step(backend: InPlaceBackend) -> None:
    bodies = {key: greedy(prompt, max_tokens=200) for key, prompt in PROMPTS.items()}
    cancel = threading.Event()
    running: dict[int, int] = {}

    def between(step: int) -> None:
        running[step] = backend.generating
        if step == 5:
            cancel.set()

    ended = together(backend, bodies, cancelled={"cat": cancel.is_set}, between=between)
    cancelled = ended["cat"]
    assert isinstance(cancelled, Generation)
    assert cancelled.cancelled
    assert 0 < cancelled.completion_tokens < 200
    assert running[5] == 4
    assert running[6] == 3
    for key in ("fox", "sea", "owl"):
        finished = ended[key]
        assert isinstance(finished, Generation)
        assert not finished.cancelled
        assert finished.completion_tokens == 200


def test_a_prompt_that_cannot_fit_fails_alone(backend: InPlaceBackend, tiny_model: Path) -> None:
    bodies = {key: greedy(prompt) for key, prompt in list(PROMPTS.items())[:3]}
    for key, body in bodies.items():
        backend.begin(key, backend.prepare(request_for("completion", body), never), None, never)
    backend.step()
    too_long = request_for("completion", greedy("word " * N_CTX))
    with pytest.raises(ContextOverflowError):
        backend.begin("long", backend.prepare(too_long, never), None, never)
    ended: dict[str, Generation | ArbiterError] = {}
    while len(ended) < len(bodies):
        ended.update(backend.step())
    expected = alone(tiny_model, bodies)
    for key in bodies:
        assert_same(ended[key], expected[key])


@pytest.mark.parametrize("kv", [KvPolicy.HOST, KvPolicy.DEVICE])
def test_sequences_in_flight_resume_after_a_release_and_restore(
    backend: InPlaceBackend, tiny_model: Path, kv: KvPolicy
) -> None:
    bodies = {key: greedy(prompt, max_tokens=40) for key, prompt in PROMPTS.items()}
    released: list[Moved] = []

    def between(step: int) -> None:
        if step == 6:  # the prompts are in and every sequence has generated some
            assert backend.generating == len(bodies)
            released.append(backend.release(kv))
            backend.restore()

    ended = together(backend, bodies, between=between)
    # The KV went to the host and came back (HOST), or stayed where it was (DEVICE).
    assert (released[0].kv_bytes > 0) is (kv is KvPolicy.HOST)
    expected = alone(tiny_model, bodies)
    for key in bodies:
        assert_same(ended[key], expected[key])


def test_a_worker_decodes_requests_sent_at_once_together(tmp_path: Path, tiny_model: Path) -> None:
    spec = ModelSpec(name="m", path=tiny_model, n_ctx=N_CTX, n_gpu_layers=0, parallel=4)
    worker = BlockingWorker.spawn(WorkerConfig(spec=spec, arena=tmp_path / "arena"))
    try:
        bodies = {key: greedy(prompt, max_tokens=300) for key, prompt in PROMPTS.items()}
        results: dict[str, dict[str, Any]] = {}

        def send(key: str) -> None:
            request = request_for("completion", bodies[key])
            results[key] = worker.generate(request, request_id=key, timeout_s=120)

        threads = [threading.Thread(target=send, args=(key,)) for key in bodies]
        for thread in threads:
            thread.start()
        seen = 0
        while any(thread.is_alive() for thread in threads):
            seen = max(seen, worker.status()["sequences"])
        for thread in threads:
            thread.join()
        assert seen > 1  # decoded together, not one after another
        solo = {key: worker.generate(request_for("completion", b)) for key, b in bodies.items()}
        for key in bodies:
            choice, alone_choice = (r["response"]["choices"][0] for r in (results[key], solo[key]))
            assert choice["text"] == alone_choice["text"]
            assert results[key]["completion_tokens"] == 300
        assert worker.status()["sequences"] == 0
    finally:
        worker.kill()
