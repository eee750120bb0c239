"""Ollama's requests as the OpenAI ones the daemon serves, and its answers back."""

from __future__ import annotations

from typing import Any

import pytest

from arbiterd.daemon import ollama
from arbiterd.errors import BadValueError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object"}


def test_a_chat_streams_by_default_and_its_options_become_sampling_parameters() -> None:
    options = {"temperature": 0.2, "num_predict": 7, "seed": 3, "stop": ["x"], "num_ctx": 4096}
    kind, request, stream = ollama.chat_request({**CHAT, "options": options, "keep_alive": "5m"})
    assert (kind, stream) == ("chat", True)
    assert request == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.2,
        "max_tokens": 7,
        "seed": 3,
        "stop": ["x"],
    }  # num_ctx is the config's, keep_alive changes nothing here


def test_num_predict_minus_one_is_the_default_length() -> None:
    _, request, _ = ollama.chat_request({**CHAT, "options": {"num_predict": -1}})
    assert "max_tokens" not in request


@pytest.mark.parametrize(
    ("wanted", "response_format"),
    [
        ("json", {"type": "json_object"}),
        (
            {"type": "object"},
            {
                "type": "json_schema",
                "json_schema": {"name": "format", "schema": {"type": "object"}},
            },
        ),
    ],
)
def test_format_is_a_response_format(wanted: object, response_format: dict[str, Any]) -> None:
    _, request, _ = ollama.chat_request({**CHAT, "format": wanted, "stream": False})
    assert request["response_format"] == response_format


def test_generate_applies_the_chat_template_unless_raw() -> None:
    body = {"model": "m", "prompt": "the fox", "system": "be brief"}
    assert ollama.generate_request(body) == (
        "chat",
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "the fox"},
            ],
        },
        True,
    )
    assert ollama.generate_request({**body, "raw": True, "stream": False}) == (
        "completion",
        {"model": "m", "prompt": "the fox"},
        False,
    )


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({**CHAT, "options": {"mirostat": 2}}, "option 'mirostat'"),
        ({**CHAT, "format": "yaml"}, "'format'"),
        ({**CHAT, "stream": "yes"}, "'stream'"),
        ({"model": "m", "messages": [{"role": "user", "images": ["aGk="]}]}, "images"),
        ({"model": "m"}, "'messages'"),
        ([], "JSON object"),
    ],
)
def test_what_arbiterd_cannot_do_is_said(body: object, problem: str) -> None:
    with pytest.raises(BadValueError, match=problem):
        ollama.chat_request(body)


def test_a_whole_answer_and_a_stream_end_with_the_counts() -> None:
    response = {
        "model": "m",
        "choices": [{"message": {"content": "hello"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2},
    }
    whole = ollama.answer("chat", "chat", response, 0.5)
    assert whole["message"] == {"role": "assistant", "content": "hello"}
    assert (whole["done"], whole["done_reason"]) == (True, "length")
    assert (whole["prompt_eval_count"], whole["eval_count"]) == (9, 2)
    assert whole["total_duration"] == 500_000_000
    piece = ollama.chunk("completion", "generate", {"model": "m", "choices": [{"text": "fo"}]})
    assert piece is not None
    assert (piece["response"], piece["done"]) == ("fo", False)
    assert ollama.chunk("chat", "chat", {"model": "m", "choices": [], "usage": {}}) is None
    last = ollama.last_line("generate", "m", "stop", None, 1.0)
    assert (last["response"], last["done"], last["eval_count"]) == ("", True, 0)


def test_ps_lists_every_resident_model_and_the_vram_of_the_warm_one() -> None:
    models: list[dict[str, Any]] = [
        {"name": "a", "state": "warm", "vram_bytes": 100, "host_copy_bytes": 1000},
        {"name": "b", "state": "cold", "vram_bytes": 0, "host_copy_bytes": 1000},
        {"name": "c", "state": "failed"},
    ]
    listed = ollama.ps(models)["models"]
    assert [(m["model"], m["size_vram"], m["size"]) for m in listed] == [
        ("a", 100, 1000),
        ("b", 0, 1000),
    ]
    assert [m["model"] for m in ollama.tags(models)["models"]] == ["a", "b", "c"]


def test_embed_takes_model_input_and_dimensions_and_only_the_configs_options() -> None:
    body = {
        "model": "m",
        "input": ["a", "b"],
        "truncate": True,  # accepted: an input too long for the context is refused anyway
        "keep_alive": "5m",
        "options": {"num_ctx": 512},
        "dimensions": 8,  # passed on, for the OpenAI parser to refuse by name
    }
    assert ollama.embed_request(body) == {"model": "m", "input": ["a", "b"], "dimensions": 8}
    with pytest.raises(BadValueError, match="option 'temperature' does not apply to embeddings"):
        ollama.embed_request({"model": "m", "input": "a", "options": {"temperature": 0}})
    with pytest.raises(BadValueError, match="'truncate' must be a boolean"):
        ollama.embed_request({"model": "m", "input": "a", "truncate": 1})


def test_an_embedding_answer_is_ollamas() -> None:
    response = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [0.5, 0.5]},
            {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]},
        ],
        "model": "m",
        "usage": {"prompt_tokens": 6, "total_tokens": 6},
    }
    assert ollama.embed_answer(response, 0.25) == {
        "model": "m",
        "embeddings": [[0.5, 0.5], [1.0, 0.0]],
        "total_duration": 250_000_000,
        "load_duration": 0,
        "prompt_eval_count": 6,
    }
