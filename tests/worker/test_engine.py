"""The reload backend on real llama.cpp (CPU): residency round trips keep the prompt cache."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from arbiterd.config import smollm_model_path
from arbiterd.errors import ContextOverflowError, ModelLoadError, RequestError, RestoreError
from arbiterd.request import GenerateRequest, ResponseFormat
from arbiterd.spec import KvPolicy, ModelSpec
from arbiterd.worker.engine import ReloadBackend
from arbiterd.worker.engine.backend import disk_read_bytes
from arbiterd.worker.engine.vocab import TOKENIZE_PIECE_BYTES
from arbiterd.worker.kvfile import KvState
from tests.support.pagecache import drop_page_cache
from tests.support.requests import request_for

PREFIX = " ".join(f"the fox {w} is not a dog" for w in ("one", "two", "three", "four") * 8)
SUFFIX = " and the cat is quick"


def greedy(prompt: str, max_tokens: int = 12) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def text_of(generation: object) -> str:
    response = generation.response  # type: ignore[attr-defined]
    return str(response["choices"][0]["text"])


@pytest.fixture
def backend(tiny_model: Path) -> Iterator[ReloadBackend]:
    engine = ReloadBackend(ModelSpec(name="tiny", path=tiny_model, n_ctx=1024, n_gpu_layers=0))
    engine.load()
    yield engine
    engine.close()


def test_round_trip_reuses_the_prompt_cache(backend: ReloadBackend) -> None:
    first = backend.generate(request_for("completion", greedy(PREFIX)), None)
    assert first.prompt_tokens >= 200
    assert first.prompt_tokens_evaluated == first.prompt_tokens
    released = backend.release(KvPolicy.HOST)
    assert released.kv_bytes > 0
    assert backend.resident_bytes() == 0
    restored = backend.restore()
    assert restored.kv_bytes == released.kv_bytes
    follow_up = backend.generate(request_for("completion", greedy(PREFIX + SUFFIX)), None)
    suffix_tokens = follow_up.prompt_tokens - first.prompt_tokens
    assert 0 < suffix_tokens < 10
    assert follow_up.prompt_tokens_evaluated <= suffix_tokens + 1


def test_usage_says_how_much_of_the_prompt_came_from_the_cache(backend: ReloadBackend) -> None:
    first = backend.generate(request_for("completion", greedy(PREFIX)), None).response["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = backend.generate(request_for("completion", greedy(PREFIX + SUFFIX)), None)
    cached = again.response["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == again.prompt_tokens - again.prompt_tokens_evaluated
    assert cached >= first["prompt_tokens"] - 1  # all of the first prompt but its last token


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_that_asks_ends_with_a_chunk_of_its_usage(
    backend: ReloadBackend, kind: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 3, "temperature": 0}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "the fox"}]
    else:
        body["prompt"] = "the fox"
    chunks: list[dict[str, Any]] = []
    plain = backend.generate(request_for(kind, body), chunks.append)
    assert all(chunk["choices"] for chunk in chunks)  # not asked: no usage chunk
    chunks.clear()
    asked = backend.generate(request_for(kind, {**body, "include_usage": True}), chunks.append)
    *text, last = chunks
    assert all(chunk["choices"] for chunk in text)
    assert last["choices"] == []
    assert last["usage"] == asked.response["usage"]
    assert last["usage"]["completion_tokens"] == plain.completion_tokens
    assert last["object"] == ("chat.completion.chunk" if kind == "chat" else "text_completion")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema of 1-4 required properties: integers, booleans, bounded strings,
    enums, short integer arrays and (twice at most) nested objects."""
    kinds = ["integer", "boolean", "string", "enum", "array"] + (["object"] if depth < 2 else [])
    properties: dict[str, Any] = {}
    for index in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            prop: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 8)}
        elif kind == "enum":
            prop = {"enum": [f"v{n}" for n in range(rng.randint(1, 4))]}
        elif kind == "array":
            prop = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
        elif kind == "object":
            prop = random_schema(rng, depth + 1)
        else:
            prop = {"type": kind}
        properties[f"p{index}"] = prop
    return {"type": "object", "properties": properties, "required": sorted(properties)}


def follows(value: Any, schema: dict[str, Any]) -> bool:
    """Whether `value` follows one of random_schema's schemas."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        return isinstance(value, dict) and all(
            key in value and follows(value[key], sub) for key, sub in schema["properties"].items()
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= 3
            and all(isinstance(item, int) and not isinstance(item, bool) for item in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema["maxLength"]
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, bool)


def test_a_hundred_random_schemas_give_json_that_follows_each_of_them(
    backend: ReloadBackend,
) -> None:
    # The tiny model's weights are random: only the grammar made from the schema makes it
    # write JSON at all, so every output that parses and follows its schema is the grammar's.
    rng = random.Random(17)
    for _ in range(100):
        schema = random_schema(rng)
        body = {
            "messages": [{"role": "user", "content": "answer in JSON"}],
            "max_tokens": 400,
            "temperature": 0,
            "response_format": ResponseFormat(schema),
        }
        result = backend.generate(request_for("chat", body), None).response["choices"][0]
        assert result["finish_reason"] == "stop", (schema, result)
        answer = json.loads(result["message"]["content"])
        assert follows(answer, schema), (schema, answer)


@pytest.mark.parametrize(
    "response_format",
    [
        ResponseFormat({"type": "no such type"}),
        ResponseFormat({"$ref": "#/nowhere"}),
        # The converter writes these property names as GBNF that llama.cpp cannot parse: the
        # NULL sampler it makes of them was a SIGSEGV at the first token (issue 24).
        *(
            ResponseFormat({"properties": {name: {"type": "string"}}})
            for name in ("a\fb", "a\bb", 'a"b')
        ),
    ],
)
def test_a_response_format_that_cannot_be_followed_is_a_request_error(
    backend: ReloadBackend, response_format: ResponseFormat
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
    with pytest.raises(RequestError, match=r"response_format|JSON schema"):
        backend.generate(request_for("chat", body), None)


def test_greedy_output_is_identical_after_a_round_trip(backend: ReloadBackend) -> None:
    before = text_of(backend.generate(request_for("completion", greedy(PREFIX)), None))
    backend.release(KvPolicy.HOST)
    backend.restore()
    after = backend.generate(request_for("completion", greedy(PREFIX)), None)
    assert text_of(after) == before
    assert after.prompt_tokens_evaluated == 1  # only the last token is decoded again


def test_greedy_output_matches_a_fresh_process(backend: ReloadBackend, tiny_model: Path) -> None:
    backend.generate(request_for("completion", greedy(PREFIX)), None)
    backend.release(KvPolicy.HOST)
    backend.restore()
    warm_text = text_of(backend.generate(request_for("completion", greedy(PREFIX + SUFFIX)), None))
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from arbiterd.worker.engine import ReloadBackend
        from arbiterd.request import GenerateRequest
        from arbiterd.spec import ModelSpec
        spec = ModelSpec(name="t", path=Path(sys.argv[1]), n_ctx=1024, n_gpu_layers=0)
        backend = ReloadBackend(spec)
        backend.load()
        body = {
            "kind": "completion",
            "prompt": sys.argv[2],
            "sampling": {"max_tokens": 12, "temperature": 0},
        }
        result = backend.generate(GenerateRequest.from_json(body), None)
        sys.stdout.write(result.response["choices"][0]["text"])
        """
    )
    fresh = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model), PREFIX + SUFFIX],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert fresh.stdout == warm_text


def test_a_kept_prompt_cache_restores_into_a_new_backend(
    backend: ReloadBackend, tiny_model: Path
) -> None:
    first = backend.generate(request_for("completion", greedy(PREFIX)), None)
    expected = text_of(backend.generate(request_for("completion", greedy(PREFIX + SUFFIX)), None))
    kept = backend.kept_kv()
    assert kept is not None
    backend.close()  # as an unloaded worker exits
    fresh = ReloadBackend(ModelSpec(name="tiny", path=tiny_model, n_ctx=1024, n_gpu_layers=0))
    fresh.load()
    try:
        fresh.adopt_kv(kept)
        again = fresh.generate(request_for("completion", greedy(PREFIX + SUFFIX)), None)
    finally:
        fresh.close()
    assert text_of(again) == expected
    assert again.prompt_tokens > first.prompt_tokens
    assert again.prompt_tokens_evaluated == 1  # its whole prompt came from the kept cache


def test_a_cold_model_keeps_the_cache_it_saved_on_release(backend: ReloadBackend) -> None:
    backend.generate(request_for("completion", greedy(PREFIX)), None)
    backend.release(KvPolicy.HOST)
    kept = backend.kept_kv()
    assert kept is not None
    assert kept.data
    backend.restore()
    backend.release(KvPolicy.DROP)
    assert backend.kept_kv() is None


def test_a_kept_cache_that_does_not_fit_leaves_the_context_empty(
    backend: ReloadBackend, tiny_model: Path
) -> None:
    backend.generate(request_for("completion", greedy(PREFIX)), None)
    kept = backend.kept_kv()
    assert kept is not None
    backend.close()
    other = ReloadBackend(ModelSpec(name="tiny", path=tiny_model, n_ctx=128, n_gpu_layers=0))
    other.load()
    try:
        with pytest.raises(RestoreError):
            other.adopt_kv(KvState(kept.tokens, kept.data[: len(kept.data) // 2]))
        with pytest.raises(RestoreError):
            other.adopt_kv(kept)  # more tokens than its context holds
        again = other.generate(request_for("completion", greedy("the fox")), None)
    finally:
        other.close()
    assert again.prompt_tokens_evaluated == again.prompt_tokens  # a full prefill


def test_dropping_the_kv_means_a_full_prefill(backend: ReloadBackend) -> None:
    first = backend.generate(request_for("completion", greedy(PREFIX)), None)
    assert backend.release(KvPolicy.DROP).kv_bytes == 0
    assert backend.restore().kv_bytes == 0
    again = backend.generate(request_for("completion", greedy(PREFIX)), None)
    assert again.prompt_tokens_evaluated == first.prompt_tokens


def test_restore_reads_nothing_from_disk_with_the_host_copy(backend: ReloadBackend) -> None:
    backend.generate(request_for("completion", greedy(PREFIX)), None)
    backend.release(KvPolicy.HOST)
    drop_page_cache(backend.spec.path)
    before = disk_read_bytes()
    moved = backend.restore()
    assert moved.disk_read_bytes == 0
    assert disk_read_bytes() - before == 0


def test_without_the_host_copy_a_restore_reads_the_file_again(tiny_model: Path) -> None:
    # The counter-check: the same measurement does see a disk read when there is one.
    engine = ReloadBackend(
        ModelSpec(name="t", path=tiny_model, n_ctx=256, n_gpu_layers=0, host_copy=False)
    )
    engine.load()
    try:
        engine.release(KvPolicy.HOST)
        drop_page_cache(tiny_model)
        assert engine.restore().disk_read_bytes > 0
    finally:
        engine.close()


def never() -> bool:
    return False


def test_a_cancel_stops_generation_before_the_next_decode(backend: ReloadBackend) -> None:
    chunks: list[dict[str, object]] = []
    request = backend.prepare(request_for("completion", greedy(PREFIX, max_tokens=50)), never)
    result = backend.run(request, chunks.append, lambda: len(chunks) >= 3)
    assert result.cancelled
    assert len(chunks) == 3
    assert result.completion_tokens < 50


def test_a_cancel_stops_a_long_prompt_between_batches(tiny_model: Path) -> None:
    engine = ReloadBackend(ModelSpec(name="t", path=tiny_model, n_ctx=4096, n_gpu_layers=0))
    engine.load()
    try:
        long_prompt = greedy(" ".join([PREFIX] * 10), max_tokens=4)
        asked = 0

        def after_one_batch() -> bool:
            nonlocal asked
            asked += 1
            return asked > 1

        stopped = engine.run(
            engine.prepare(request_for("completion", long_prompt), never), None, after_one_batch
        )
        assert stopped.cancelled
        assert (stopped.prompt_tokens_evaluated, stopped.completion_tokens) == (512, 0)
        # What was decoded before the cancel stays usable: the rest is evaluated, no more.
        again = engine.generate(request_for("completion", long_prompt), None)
        assert again.prompt_tokens > 2000
        assert again.prompt_tokens_evaluated == again.prompt_tokens - 512
    finally:
        engine.close()


def test_a_request_is_prepared_while_the_model_is_cold(backend: ReloadBackend) -> None:
    warm = backend.generate(request_for("completion", greedy(PREFIX)), None)
    backend.release(KvPolicy.HOST)
    request = backend.prepare(request_for("completion", greedy(PREFIX)), never)
    assert backend.resident_bytes() == 0
    assert len(request.prompt_tokens) == warm.prompt_tokens
    backend.restore()
    assert text_of(backend.run(request, None, never)) == text_of(warm)


def test_prepared_chat_is_what_create_chat_completion_runs(
    backend: ReloadBackend, tiny_model: Path
) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello </s> the fox"},
    ]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0}
    ours = backend.generate(request_for("chat", body), None).response
    library = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=1024, n_gpu_layers=0, verbose=False)
    try:
        theirs = library.create_chat_completion(messages=messages, max_tokens=6, temperature=0)
    finally:
        library.close()
    assert ours["choices"][0]["message"] == theirs["choices"][0]["message"]  # type: ignore[index]
    # The same counts; ours also says how much of the prompt the cache held (here: none).
    assert ours["usage"] == {
        **theirs["usage"],  # type: ignore[index]
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_a_chat_format_that_cannot_render_is_a_request_error(tiny_model: Path) -> None:
    spec = ModelSpec(name="t", path=tiny_model, n_ctx=256, n_gpu_layers=0, chat_format="nope")
    engine = ReloadBackend(spec)
    engine.load()
    try:
        with pytest.raises(RequestError, match="nope"):
            engine.prepare(
                request_for("chat", {"messages": [{"role": "user", "content": "hi"}]}), never
            )
    finally:
        engine.close()


def tokenizer_texts(specials: list[bytes], count: int, size: int) -> list[bytes]:
    """Texts that stress the cuts: special tokens, pieces of them, words, runs of whitespace."""
    rng = random.Random(10)
    pieces = [b"hello", b" world", b"<", b"</", b"s>", b"\n", b"\t", b" ", "\u00e9".encode()]
    pieces += [special[:cut] for special in specials for cut in (1, len(special) // 2) if cut]
    texts = []
    for _ in range(count):
        parts: list[bytes] = []
        length = 0
        while length < size:
            parts.append(rng.choice(specials) if rng.random() < 0.3 else rng.choice(pieces))
            length += len(parts[-1])
        texts.append(b"".join(parts))
    return texts


def check_pieces_match_one_call(model: Path, specials: list[bytes], count: int) -> None:
    engine = ReloadBackend(ModelSpec(name="m", path=model, n_ctx=1 << 20, n_gpu_layers=0))
    engine.open()  # the vocabulary alone: no weights
    library = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    try:
        for text in tokenizer_texts(specials, count, size=3 * TOKENIZE_PIECE_BYTES):
            calls = tokenize_calls(engine, text.decode())
            expected = library.tokenize(text, add_bos=True, special=True)
            assert calls.tokens == expected
            assert calls.count >= 3  # really in pieces
    finally:
        library.close()
        engine.close()


@dataclass
class Calls:
    tokens: list[int]
    count: int


def tokenize_calls(engine: ReloadBackend, prompt: str) -> Calls:
    """The prompt's tokens as `prepare` makes them, and how many llama_tokenize calls it took."""
    original = llama_cpp.llama_tokenize
    count = 0

    def counting(*args: Any) -> int:
        nonlocal count
        count += 1
        return int(original(*args))

    llama_cpp.llama_tokenize = counting
    try:
        tokens = engine.prepare(request_for("completion", {"prompt": prompt}), never).prompt_tokens
    finally:
        llama_cpp.llama_tokenize = original
    return Calls(tokens, count)


def test_a_long_prompt_is_tokenized_in_pieces_as_one_call_would(tiny_model: Path) -> None:
    check_pieces_match_one_call(tiny_model, [b"<s>", b"</s>", b"<unk>", b"\n"], count=5)


def test_a_bpe_vocabulary_is_tokenized_in_pieces_as_one_call_would() -> None:
    specials = [b"<|im_start|>", b"<|im_end|>", b"<|endoftext|>", b"\n", b"  "]
    check_pieces_match_one_call(smollm_model_path(), specials, count=3)


@pytest.mark.slow
def test_gemma_is_tokenized_in_pieces_as_one_call_would(gemma_model: Path) -> None:
    # gemma-3's vocabulary makes runs of newlines and spaces special tokens too.
    specials = [b"<start_of_turn>", b"<end_of_turn>", b"\n", b"\n\n\n", b"    ", b"<unused7>"]
    check_pieces_match_one_call(gemma_model, specials, count=3)


def test_too_many_messages_are_refused_before_anything_is_rendered(backend: ReloadBackend) -> None:
    messages = [{"role": "user", "content": "word"}] * 100_000  # issue 10's 3.4 MB request
    started = time.monotonic()
    with pytest.raises(ContextOverflowError, match="100000 messages exceed"):
        backend.prepare(request_for("chat", {"messages": messages}), never)
    assert time.monotonic() - started < 0.5


def test_a_text_too_long_for_the_context_is_refused_unread(backend: ReloadBackend) -> None:
    calls = 0

    def cancelled() -> bool:
        nonlocal calls
        calls += 1
        return False

    with pytest.raises(ContextOverflowError, match="characters exceed"):
        backend.prepare(request_for("completion", {"prompt": "word " * 700_000}), cancelled)
    message = [{"role": "user", "content": "word " * 700_000}]
    with pytest.raises(ContextOverflowError, match="characters exceed"):
        backend.prepare(request_for("chat", {"messages": message}), cancelled)
    assert calls == 0  # never got as far as the tokenizer's first piece


def test_tokenizing_stops_once_the_context_is_full(tiny_model: Path) -> None:
    engine = ReloadBackend(ModelSpec(name="t", path=tiny_model, n_ctx=4096, n_gpu_layers=0))
    engine.open()
    calls = 0

    def cancelled() -> bool:
        nonlocal calls
        calls += 1
        return False

    try:
        # Within the character limit (4096 x 8), but 16,000 tokens: one piece is enough.
        with pytest.raises(ContextOverflowError, match="context window"):
            engine.prepare(request_for("completion", {"prompt": "a " * 16_000}), cancelled)
        assert calls == 1
    finally:
        engine.close()


def test_a_cancel_stops_tokenizing_between_pieces(tiny_model: Path) -> None:
    engine = ReloadBackend(ModelSpec(name="t", path=tiny_model, n_ctx=1 << 20, n_gpu_layers=0))
    engine.open()
    try:
        calls = 0

        def after_two_pieces() -> bool:
            nonlocal calls
            calls += 1
            return calls > 2

        with pytest.raises(RequestError, match="cancelled"):
            engine.prepare(
                request_for("completion", {"prompt": "the fox </s> " * 100_000}), after_two_pieces
            )
        assert calls == 3
    finally:
        engine.close()


def test_chat_requests_use_the_models_template(backend: ReloadBackend) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    result = backend.generate(request_for("chat", body), None)
    message = result.response["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert result.completion_tokens >= 1


def test_prompt_longer_than_the_context_is_a_request_error(tiny_model: Path) -> None:
    engine = ReloadBackend(ModelSpec(name="t", path=tiny_model, n_ctx=64, n_gpu_layers=0))
    engine.load()
    try:
        with pytest.raises(ContextOverflowError, match="context window"):
            engine.generate(request_for("completion", greedy(PREFIX)), None)
        assert (
            text_of(engine.generate(request_for("completion", greedy("the fox", 2)), None))
            is not None
        )
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        ({"kind": "completion", "prompt": 3}, "'prompt' must be a string"),
        ({"kind": "completion", "sampling": {"max_tokens": "many"}}, "'sampling.max_tokens' must"),
        ({"kind": "completion", "sampling": {"temperature": True}}, "'sampling.temperature' must"),
    ],
)
def test_bad_parameters_are_request_errors(wire: dict[str, object], message: str) -> None:
    # What the worker reads off the wire; the ranges (max_tokens at least 1) are the edge's
    # (tests/daemon/http/test_openai_requests.py).
    with pytest.raises(RequestError, match=message):
        GenerateRequest.from_json(wire)


def test_missing_and_corrupt_models_fail_to_load(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot open model file"):
        ReloadBackend(ModelSpec(name="m", path=tmp_path / "missing.gguf")).load()
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ModelLoadError, match="cannot load"):
        ReloadBackend(ModelSpec(name="m", path=corrupt, n_gpu_layers=0)).load()


def test_a_context_too_large_fails_to_load_with_a_clear_error(tiny_model: Path) -> None:
    for n_ctx, message in ((1 << 32, "n_ctx must be between"), (0, "n_ctx must be between")):
        spec = ModelSpec(name="m", path=tiny_model, n_ctx=n_ctx, n_gpu_layers=0)
        with pytest.raises(ModelLoadError, match=message):
            ReloadBackend(spec).load()


@pytest.mark.slow
def test_gemma_round_trip_keeps_the_prompt_cache_and_the_output(gemma_model: Path) -> None:
    engine = ReloadBackend(
        ModelSpec(name="gemma", path=gemma_model, n_ctx=1024, n_gpu_layers=0, n_threads=2)
    )
    engine.load()
    try:
        first = engine.generate(request_for("completion", greedy(PREFIX, 8)), None)
        assert first.prompt_tokens >= 200
        engine.release(KvPolicy.HOST)
        drop_page_cache(gemma_model)
        restored = engine.restore()
        assert restored.disk_read_bytes == 0
        again = engine.generate(request_for("completion", greedy(PREFIX, 8)), None)
        assert text_of(again) == text_of(first)
        assert again.prompt_tokens_evaluated == 1
        follow_up = engine.generate(request_for("completion", greedy(PREFIX + SUFFIX, 8)), None)
        suffix_tokens = follow_up.prompt_tokens - first.prompt_tokens
        assert follow_up.prompt_tokens_evaluated <= suffix_tokens + 1
    finally:
        engine.close()
