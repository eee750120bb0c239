"""A real daemon with two models on a Vulkan device (issue 25): requests through the openai SDK
hand the device from one model to the other in place — each release copies the weights' device
buffers to a host shadow and frees them, each restore allocates them again and copies them back,
with the prompt's KV saved to the host and set back — and every answer comes out as it did
before any handoff. Preemption pauses a generation on the device and resumes it identically; a
worker that dies on the device mid-decode fails its request, names its last words, and restarts,
while the other model keeps the device.

Answers are compared exactly, text and each token's logprob. A request that evaluates its whole
prompt (a worker's first) and one that finds all but the prompt's last token in its prompt cache
(every later one: the restore sets the KV back, and one token is decoded again) put the last
token through the device in batches of different sizes, which gives logits that differ in their
last bits; so each is compared with a reference of its own kind.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import Completion

from arbiterd.native import ggml
from tests.daemon.models.test_workerclient import dying_env
from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.last_words.sitecustomize import WORDS
from tests.support.waiting import wait_until

# Each model's prompt: two models that answered each other's requests would show.
PROMPTS = {"alpha": "the fox", "beta": "the dog"}
ON_DEVICE: dict[str, Any] = {"n_gpu_layers": -1, "residency": "in-place"}
# The first decode of a machine compiles llvmpipe's pipelines (~20 s for the tiny model).
CLIENT_TIMEOUT_S = 120
EVENT_TIMEOUT_S = 60
# A generation long enough to be under way when another request comes (~15 ms a token on
# llvmpipe with 2 cores), short enough to keep the file's run time down.
LONG_TOKENS = 400
ROUNDS = 4


@dataclass(frozen=True)
class Answer:
    text: str
    logprobs: tuple[float | None, ...]  # each token's, compared exactly


@dataclass(frozen=True)
class References:
    """A model's answer to its prompt as a worker's first request (the whole prompt evaluated)
    and as a later one (its prompt cached)."""

    fresh: Answer
    cached: Answer


def ask(api: openai.OpenAI, model: str, max_tokens: int = 8, **extra: Any) -> Answer:
    done = api.completions.create(
        model=model,
        prompt=PROMPTS[model],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        **extra,
    )
    first = done.choices[0]
    assert first.logprobs is not None
    assert first.logprobs.token_logprobs is not None
    return Answer(first.text, tuple(first.logprobs.token_logprobs))


def status(daemon: Daemon) -> dict[str, dict[str, Any]]:
    with daemon.client() as client:
        models: list[dict[str, Any]] = client.call("status")["models"]
    return {model["name"]: model for model in models}


def journal_since(daemon: Daemon, since: float, kind: str) -> list[dict[str, Any]]:
    with daemon.client() as client:
        return [e for e in client.history(since=since) if e["event"] == kind]


@pytest.fixture(scope="module")
def trigger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file whose creation makes alpha's worker write a GGML_ASSERT line and abort
    (tests/support/last_words), as a native crash in the engine does."""
    return tmp_path_factory.mktemp("last-words") / "die"


@pytest.fixture(scope="module")
def daemon(vulkan0: ggml.Device, tiny_model: Path, trigger: Path) -> Iterator[Daemon]:
    env = {**dying_env(trigger), "ARBITERD_TEST_LAST_WORDS_MODEL": "alpha"}
    models = {
        # alpha's class is batch, so that a normal request to beta preempts its generations.
        "alpha": tiny(tiny_model, priority="batch", **ON_DEVICE),
        "beta": tiny(tiny_model, **ON_DEVICE),
    }
    with serving(models, env=env) as running:
        yield running


@pytest.fixture(scope="module")
def api(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai_client(daemon, timeout_s=CLIENT_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def references(daemon: Daemon, api: openai.OpenAI) -> dict[str, References]:
    """Each model's first answer and its first from a cached prompt, each after a handoff."""
    fresh = {name: ask(api, name) for name in PROMPTS}
    return {name: References(fresh[name], ask(api, name)) for name in PROMPTS}


def test_both_models_run_on_the_vulkan_device_in_place(
    daemon: Daemon, vulkan0: ggml.Device
) -> None:
    with daemon.client() as client:
        report = client.call("status")
    assert report["engine"]["offload"] is True
    assert vulkan0.label in report["engine"]["devices"]
    # No note that the models run on the CPU: the engine offloads their layers.
    assert (report["engine"]["cpu_cause"], report["engine"]["cpu_note"]) == (None, "")
    for model in report["models"]:
        assert (model["backend"], model["fallback_reason"]) == ("in-place", ""), model


def test_two_models_alternating_on_the_device_hand_it_over_in_place_and_answer_as_at_first(
    daemon: Daemon, api: openai.OpenAI, references: dict[str, References], tiny_model: Path
) -> None:
    since = time.time()
    (holder,) = [name for name, model in status(daemon).items() if model["state"] == "warm"]
    order = ["alpha", "beta"] * ROUNDS
    answers = [(name, ask(api, name)) for name in order]
    for name, answer in answers:
        assert answer.text == references[name].fresh.text  # as its first answer
        assert answer == references[name].cached
    expected = order[1:] if order[0] == holder else order
    # Each request to the model that was cold handed the device over: one handoff each.
    wait_until(
        lambda: len(journal_since(daemon, since, "handoff")) >= len(expected),
        EVENT_TIMEOUT_S,
        "a handoff per request",
    )
    handoffs = journal_since(daemon, since, "handoff")
    assert [(h["from"], h["to"]) for h in handoffs] == [
        ("beta" if to == "alpha" else "alpha", to) for to in expected
    ]
    assert {h["release_reason"] for h in handoffs} == {"wanted"}
    residency = journal_since(daemon, since, "residency")
    releases = [e for e in residency if (e["from"], e["to"]) == ("cooling", "cold")]
    restores = [e for e in residency if (e["from"], e["to"]) == ("warming", "warm")]
    assert len(releases) == len(restores) == len(handoffs)
    # Every release took the same weights off the device and every restore put them back: the
    # device buffers only (the token embeddings stay in host memory, so less than the file).
    weights = {e["weights_bytes"] for e in releases + restores}
    assert len(weights) == 1, weights
    (weights_bytes,) = weights
    assert 0 < weights_bytes < tiny_model.stat().st_size
    # The prompt's KV went to the host with each release and came back with the next restore.
    assert all(e["kv_bytes"] > 0 for e in releases + restores)
    for handoff, restore in zip(handoffs, restores, strict=True):
        assert restore["model"] == handoff["to"]
        assert handoff["restored_bytes"] == restore["weights_bytes"] + restore["kv_bytes"]
    models = status(daemon)
    warm = models[order[-1]]
    cold = models[order[0]]
    assert (warm["state"], cold["state"]) == ("warm", "cold")
    assert warm["resident_bytes"] > weights_bytes
    # Nothing of the cold model is left on the device, and nothing of its weights is its own:
    # they come back from the daemon's host copy of the file, which no release copied to.
    assert cold["resident_bytes"] == 0
    assert cold["host_weights_bytes"] == 0
    assert all(e["file_bytes"] == weights_bytes for e in releases + restores)
    assert all(e["copied_bytes"] == 0 for e in releases)


def test_a_batch_generation_preempted_on_the_device_resumes_identically(
    daemon: Daemon, api: openai.OpenAI, references: dict[str, References]
) -> None:
    ask(api, "alpha", max_tokens=1)  # its prompt cached: the reference decodes as the stream
    reference = ask(api, "alpha", max_tokens=LONG_TOKENS)
    assert len(reference.logprobs) == LONG_TOKENS
    ask(api, "beta", max_tokens=1)  # alpha goes cold: the stream starts with a restore
    since = time.time()
    started = threading.Event()
    text: list[str] = []
    logprobs: list[float | None] = []
    finished: list[str] = []

    def stream_the_long_job() -> None:
        chunks = api.completions.create(
            model="alpha",
            prompt=PROMPTS["alpha"],
            max_tokens=LONG_TOKENS,
            temperature=0,
            logprobs=1,
            stream=True,
        )
        for chunk in chunks:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                got = chunk.choices[0].logprobs
                if got is not None and got.token_logprobs is not None:
                    logprobs.extend(got.token_logprobs)
            started.set()
        finished.append("alpha")

    thread = threading.Thread(target=stream_the_long_job, name="long-job")
    thread.start()
    try:
        assert started.wait(CLIENT_TIMEOUT_S)
        interrupting = ask(api, "beta", extra_headers={"x-arbiterd-priority": "interactive"})
        finished.append("beta")
    finally:
        thread.join(timeout=CLIENT_TIMEOUT_S)
    assert finished == ["beta", "alpha"]
    assert interrupting == references["beta"].cached
    assert Answer("".join(text), tuple(logprobs)) == reference
    wait_until(
        lambda: len(journal_since(daemon, since, "handoff")) >= 3,
        EVENT_TIMEOUT_S,
        "the handoffs to beta and back",
    )
    handoffs = journal_since(daemon, since, "handoff")
    assert [(h["from"], h["to"], h["release_reason"]) for h in handoffs] == [
        ("beta", "alpha", "wanted"),  # the stream's start
        ("alpha", "beta", "preempted"),
        ("beta", "alpha", "wanted"),  # the resume
    ]
    paused = next(
        e
        for e in journal_since(daemon, since, "residency")
        if (e["model"], e["to"], e["reason"]) == ("alpha", "cold", "preempted")
    )
    # The generation's KV so far left the device with the weights, and came back with them.
    assert paused["kv_bytes"] > 0
    assert handoffs[2]["restored_bytes"] == paused["weights_bytes"] + paused["kv_bytes"]


def read_until_it_fails(
    stream: openai.Stream[Completion], *, then_after_chunks: int, do: Callable[[], object]
) -> None:
    """Read `stream` to its end, calling `do` once that many chunks came."""
    with stream:
        for received, _chunk in enumerate(stream, start=1):
            if received == then_after_chunks:
                do()


def test_a_worker_that_aborts_mid_decode_on_the_device_fails_its_request_and_restarts(
    daemon: Daemon, api: openai.OpenAI, references: dict[str, References], trigger: Path
) -> None:
    before = status(daemon)
    pid = before["alpha"]["pid"]
    since = time.time()
    try:
        stream = api.completions.create(
            model="alpha", prompt=PROMPTS["alpha"], max_tokens=LONG_TOKENS, stream=True
        )
        # Three chunks in, alpha's worker aborts, as on a GGML_ASSERT in a decode.
        with pytest.raises(openai.APIError) as failed:
            read_until_it_fails(stream, then_after_chunks=3, do=trigger.touch)
        # The request names why: the signal and the worker's last words.
        said = failed.value.message
        assert "worker for alpha exited during" in said
        assert f"killed by signal {signal.SIGABRT}; its last words: GGML_ASSERT" in said
        wait_until(
            lambda: any(e["pid"] == pid for e in journal_since(daemon, since, "worker")),
            EVENT_TIMEOUT_S,
            "alpha's worker's exit",
        )
        (exit_,) = [e for e in journal_since(daemon, since, "worker") if e["pid"] == pid]
        assert (exit_["model"], exit_["code"]) == ("alpha", -signal.SIGABRT)
        assert exit_["reason"] == f"killed by signal {signal.SIGABRT}"
        assert exit_["last_words"][-1] == WORDS.decode().rstrip()
        # While the trigger exists no worker of alpha can live (each one aborts at start):
        # beta has the device to itself, and answers as before.
        assert ask(api, "beta") == references["beta"].cached
    finally:
        trigger.unlink(missing_ok=True)
    after = daemon.wait_ready()  # alpha back, from a new worker
    (alpha,) = [model for model in after["models"] if model["name"] == "alpha"]
    assert alpha["pid"] != pid
    assert alpha["restarts"] > before["alpha"]["restarts"]
    failures = [
        e
        for e in journal_since(daemon, since, "request")
        if e["model"] == "alpha" and e["status"] == "error"
    ]
    assert len(failures) == 1
    assert f"killed by signal {signal.SIGABRT}; its last words: GGML_ASSERT" in failures[0]["error"]
    # The new worker's first request evaluates the whole prompt; the next finds it cached.
    assert ask(api, "alpha") == references["alpha"].fresh
    assert ask(api, "alpha") == references["alpha"].cached
    assert ask(api, "beta") == references["beta"].cached
