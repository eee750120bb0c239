"""Embeddings from a real daemon: the `openai` SDK and the `ollama` client against a tiny
embedding model beside a chat model, sharing the GPU through the arena."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from arbiterd.daemon.observe.journal import Journal
from tests.support.daemon import Daemon, openai_client, serving
from tests.support.tiny_gguf import DEFAULT_SPEC

EMBED_N_CTX = 64
TEXTS = ["the fox", "hello world", "the fox"]


def model(path: Path, **extra: Any) -> dict[str, Any]:
    return {"path": path, "n_ctx": 512, "n_gpu_layers": 0, "min_hold_s": 0.05, **extra}


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tiny_embedding_model: Path) -> Iterator[Daemon]:
    with serving(
        {
            "chat": model(tiny_model),
            # An embedding model by its GGUF, which names a pooling type: no key says so.
            "embed": model(tiny_embedding_model, n_ctx=EMBED_N_CTX),
            # Said to embed, but its GGUF pools nothing: it fails to load, saying why.
            "nopool": model(tiny_model, embedding=True),
        }
    ) as running:
        yield running


@pytest.fixture
def api(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai_client(daemon) as client:
        yield client


def test_the_openai_sdk_gets_unit_vectors_as_floats_and_as_base64(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    floats = api.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    assert floats.model == "embed"
    assert [item.index for item in floats.data] == [0, 1, 2]
    first, second, again = (item.embedding for item in floats.data)
    assert len(first) == DEFAULT_SPEC.n_embd  # the model's width
    assert math.isclose(math.fsum(x * x for x in first), 1.0, rel_tol=1e-6)
    assert first == again  # the same input twice, the same vector
    assert first != second
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (9, 9)
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    decoded = api.embeddings.create(model="embed", input="the fox")
    assert decoded.data[0].embedding == first
    raw = httpx.post(
        daemon.url + "/embeddings",
        json={"model": "embed", "input": ["the fox"], "encoding_format": "base64"},
        timeout=60,
    )
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(first)}f", packed)) == first


def test_the_ollama_client_embeds_as_the_openai_route_does(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    client = ollama.Client(host=daemon.url.removesuffix("/v1"), timeout=60)
    try:
        answer = client.embed(model="embed", input=["the fox", "hello world"])
        single = client.embed(model="embed", input="the fox")
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(model="embed", messages=[{"role": "user", "content": "hi"}], stream=False)
    finally:
        client.close()  # type: ignore[no-untyped-call]  # ollama leaves it unannotated
    openai_vectors = [
        item.embedding
        for item in api.embeddings.create(
            model="embed", input=["the fox", "hello world"], encoding_format="float"
        ).data
    ]
    assert [list(vector) for vector in answer.embeddings] == openai_vectors
    assert [list(vector) for vector in single.embeddings] == openai_vectors[:1]
    assert answer.model == "embed"
    assert answer.prompt_eval_count == 6
    assert answer.total_duration is not None
    assert answer.total_duration > 0
    assert refused.value.status_code == 400
    assert "'embed' is an embedding model" in str(refused.value)


def test_a_request_of_the_wrong_kind_is_a_400_that_says_which(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="'chat' is not an embedding model"):
        api.embeddings.create(model="chat", input="the fox")
    with pytest.raises(openai.BadRequestError, match="'embed' is an embedding model"):
        api.chat.completions.create(
            model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match="not completions"):
        api.completions.create(model="embed", prompt="the fox", max_tokens=2)


def test_an_input_longer_than_the_context_is_a_400_naming_it(api: openai.OpenAI) -> None:
    too_long = " ".join(["the"] * EMBED_N_CTX)  # with BOS, one token more than the context
    with pytest.raises(openai.BadRequestError, match=r"input\[1\] is 65 tokens long") as caught:
        api.embeddings.create(model="embed", input=["the fox", too_long])
    assert caught.value.code == "context_length_exceeded"


def test_a_model_said_to_embed_that_pools_nothing_fails_with_its_reason(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    with daemon.client() as client:
        status = client.call("status")
    (nopool,) = [m for m in status["models"] if m["name"] == "nopool"]
    assert nopool["state"] == "failed"
    assert "its pooling type is none" in nopool["last_error"]
    with pytest.raises(openai.InternalServerError, match="pooling type is none") as caught:
        api.embeddings.create(model="nopool", input="the fox")
    assert caught.value.status_code == 503


def test_embeddings_hand_the_gpu_over_and_are_counted_and_journaled(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    with daemon.client() as listener:
        listener.call("subscribe")
        for _ in range(2):
            api.embeddings.create(model="embed", input=TEXTS)
            api.completions.create(model="chat", prompt="the fox", max_tokens=2)
        events = []
        for event in listener.events(timeout_s=30):
            events.append(event)
            if sum(e["event"] == "request" for e in events) == 4:
                break
    handoffs = {(e["from"], e["to"]) for e in events if e["event"] == "handoff"}
    assert {("chat", "embed"), ("embed", "chat")} <= handoffs  # the arena, like any model
    embedded = [e for e in events if e["event"] == "request" and e["model"] == "embed"]
    assert [(e["status"], e["prompt_tokens"], e["completion_tokens"]) for e in embedded] == [
        ("ok", 9, 0),
        ("ok", 9, 0),
    ]
    metrics = httpx.get(daemon.url.removesuffix("/v1") + "/metrics", timeout=30).text
    assert 'arbiterd_requests_total{model="embed",status="ok"}' in metrics
    assert 'arbiterd_prompt_tokens_evaluated_total{model="embed"}' in metrics
    journal = Journal.open_readonly(daemon.journal)
    try:
        journaled = {e.body.get("id") for e in journal.read(kinds=["request"])}
    finally:
        journal.close()
    assert {e["id"] for e in embedded} <= journaled
