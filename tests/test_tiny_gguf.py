"""Checks that the tiny GGUF generator yields models llama.cpp can run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama

TEXT = "Hello world, the quick brown fox is not a dog."


def _load(path: Path) -> Any:
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, n_gpu_layers=0, verbose=False, seed=0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return _load(path)


def test_write_is_deterministic(tmp_path: Path) -> None:
    first = write_tiny_llama(tmp_path / "a.gguf")
    second = write_tiny_llama(tmp_path / "b.gguf")
    assert first.read_bytes() == second.read_bytes()
    assert 500_000 <= first.stat().st_size <= 1_000_000


def test_tokenize_round_trip(tiny_model: Any) -> None:
    tokens = tiny_model.tokenize(TEXT.encode())
    assert tokens[0] == tiny_model.token_bos()
    assert tiny_model.token_bos() not in tokens[1:]
    assert tiny_model.detokenize(tokens).decode() == TEXT


def test_greedy_generation_is_deterministic(tiny_model: Any) -> None:
    outputs = []
    for _ in range(2):
        result = tiny_model.create_completion(TEXT, max_tokens=16, temperature=0.0)
        outputs.append(result["choices"][0]["text"])
    assert outputs[0] == outputs[1]
    assert outputs[0] != ""
    assert outputs[0].isprintable()


def test_chat_completion_uses_template(tiny_model: Any) -> None:
    result = tiny_model.create_chat_completion(
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello."},
        ],
        max_tokens=8,
        temperature=0.0,
    )
    message = result["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert isinstance(message["content"], str)
    assert result["usage"]["prompt_tokens"] > 0


def test_layer_count_changes_file_and_both_load(tmp_path: Path) -> None:
    small = write_tiny_llama(tmp_path / "l1.gguf", TinyModelSpec(n_layer=1))
    large = write_tiny_llama(tmp_path / "l3.gguf", TinyModelSpec(n_layer=3))
    assert small.stat().st_size < large.stat().st_size
    for path, n_layer in ((small, 1), (large, 3)):
        llm = _load(path)
        assert llm.metadata["llama.block_count"] == str(n_layer)
        assert llm.tokenize(b"the") != []
