"""Embeddings on real llama.cpp (CPU): the tiny llama as an embedding model, mean-pooled."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from arbiterd.errors import ContextOverflowError, ModelLoadError, RequestError
from arbiterd.request import GenerateRequest
from arbiterd.spec import KvPolicy, ModelSpec
from arbiterd.worker.engine import ReloadBackend
from tests.support.requests import request_for
from tests.support.tiny_gguf import DEFAULT_SPEC

N_CTX = 32
TEXTS = ["the fox", "hello world", "the fox"]


def never() -> bool:
    return False


def vectors(response: dict[str, Any]) -> list[list[float]]:
    return [item["embedding"] for item in response["data"]]


def words(n: int) -> str:
    """A text of n tokens after BOS: each " the" is one token of the tiny vocabulary."""
    return " ".join(["the"] * n)


@pytest.fixture
def embedder(tiny_embedding_model: Path) -> Iterator[ReloadBackend]:
    spec = ModelSpec(
        name="embed", path=tiny_embedding_model, n_ctx=N_CTX, n_gpu_layers=0, embedding=True
    )
    engine = ReloadBackend(spec)
    engine.load()
    yield engine
    engine.close()


def test_each_input_is_one_unit_vector_as_wide_as_the_model(embedder: ReloadBackend) -> None:
    made = embedder.generate(request_for("embedding", {"inputs": TEXTS}), None)
    response = made.response
    assert response["object"] == "list"
    assert response["model"] == "embed"
    assert [(item["object"], item["index"]) for item in response["data"]] == [
        ("embedding", 0),
        ("embedding", 1),
        ("embedding", 2),
    ]
    first, second, again = vectors(response)
    assert len(first) == DEFAULT_SPEC.n_embd
    for vector in (first, second):
        assert math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-6)
    assert first == again  # the same text, the same vector
    assert first != second
    # BOS + "the fox" is 3 tokens, BOS + "hello world" 3 too: all counted, none generated.
    assert response["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert (made.prompt_tokens, made.prompt_tokens_evaluated, made.completion_tokens) == (9, 9, 0)
    assert not made.cancelled


def test_the_vector_is_llama_cpp_pythons_own_normalized(
    embedder: ReloadBackend, tiny_embedding_model: Path
) -> None:
    ours = vectors(
        embedder.generate(
            request_for("embedding", {"inputs": ["the quick brown fox"]}), None
        ).response
    )
    reference = llama_cpp.Llama(
        model_path=str(tiny_embedding_model), n_ctx=N_CTX, embedding=True, verbose=False
    )
    try:
        theirs = reference.embed("the quick brown fox", normalize=True)
    finally:
        reference.close()
    assert len(ours[0]) == len(theirs)
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(ours[0], theirs, strict=True))


def test_a_round_trip_through_the_host_gives_the_same_vectors(embedder: ReloadBackend) -> None:
    before = vectors(embedder.generate(request_for("embedding", {"inputs": TEXTS}), None).response)
    embedder.release(KvPolicy.HOST)
    assert embedder.resident_bytes() == 0
    embedder.restore()
    assert (
        vectors(embedder.generate(request_for("embedding", {"inputs": TEXTS}), None).response)
        == before
    )


def test_an_input_that_fills_the_context_fits_and_one_token_more_is_refused_cold(
    tiny_embedding_model: Path,
) -> None:
    spec = ModelSpec(name="embed", path=tiny_embedding_model, n_ctx=N_CTX, embedding=True)
    engine = ReloadBackend(spec)
    engine.open()  # the vocabulary only: nothing is loaded
    try:
        full = engine.prepare(request_for("embedding", {"inputs": [words(N_CTX - 1)]}), never)
        assert [len(tokens) for tokens in full.inputs] == [N_CTX]
        with pytest.raises(ContextOverflowError, match=r"input\[1\] is 33 tokens long"):
            engine.prepare(request_for("embedding", {"inputs": ["x", words(N_CTX)]}), never)
        with pytest.raises(ContextOverflowError, match=r"input\[0\]: .* bytes exceeds"):
            engine.prepare(request_for("embedding", {"inputs": ["fox" * 10_000]}), never)
        assert engine.resident_bytes() == 0
    finally:
        engine.close()


def test_every_input_that_fits_the_context_is_embedded(embedder: ReloadBackend) -> None:
    made = embedder.generate(request_for("embedding", {"inputs": [words(N_CTX - 1), "fox"]}), None)
    assert made.prompt_tokens == N_CTX + 2


@pytest.mark.parametrize(
    ("wire", "problem"),
    [
        ({"kind": "embedding", "inputs": "the fox"}, "'inputs' must be a list"),
        ({"kind": "embedding", "inputs": ["the fox", 7]}, r"'inputs\[1\]' must be a string"),
    ],
)
def test_malformed_input_is_a_request_error(wire: dict[str, Any], problem: str) -> None:
    # The edge refuses empty inputs (tests/daemon/http/test_app_embeddings.py); the wire form
    # refuses what is not a list of strings.
    with pytest.raises(RequestError, match=problem):
        GenerateRequest.from_json(wire)


def test_an_embedding_model_serves_nothing_else(embedder: ReloadBackend) -> None:
    with pytest.raises(RequestError, match=r"'embed' is an embedding model: .* not chat"):
        embedder.prepare(
            request_for("chat", {"messages": [{"role": "user", "content": "hi"}]}), never
        )
    with pytest.raises(RequestError, match="not completions"):
        embedder.prepare(request_for("completion", {"prompt": "the fox"}), never)


def test_a_generative_model_makes_no_embeddings(tiny_model: Path) -> None:
    engine = ReloadBackend(ModelSpec(name="tiny", path=tiny_model, n_ctx=N_CTX))
    engine.open()
    try:
        with pytest.raises(RequestError, match="'tiny' is not an embedding model"):
            engine.prepare(request_for("embedding", {"inputs": ["the fox"]}), never)
    finally:
        engine.close()


def test_a_model_that_pools_nothing_cannot_be_loaded_for_embeddings(tiny_model: Path) -> None:
    engine = ReloadBackend(
        ModelSpec(name="tiny", path=tiny_model, n_ctx=N_CTX, n_gpu_layers=0, embedding=True)
    )
    try:
        with pytest.raises(ModelLoadError, match="its pooling type is none"):
            engine.load()
    finally:
        engine.close()


def test_a_cancel_stops_between_two_inputs(embedder: ReloadBackend) -> None:
    prepared = embedder.prepare(request_for("embedding", {"inputs": TEXTS}), never)
    asked: list[int] = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 1  # the first input runs, the second is cancelled

    made = embedder.run(prepared, None, cancelled)
    assert made.cancelled
    assert len(made.response["data"]) == 1
    assert made.prompt_tokens == 3
