"""Ollama's requests as the OpenAI ones the daemon serves, and its answers back."""

from __future__ import annotations

from typing import Any

import pytest

from arbiterd.daemon.http import ollama
from arbiterd.errors import BadValueError
from arbiterd.states import RequestKind
from arbiterd.status import ModelStatus

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


def test_generate_without_a_template_is_the_prompt_after_its_system() -> None:
    body = {"model": "m", "prompt": "the fox", "system": "be brief"}
    assert ollama.plain_prompt(body) == "be brief\n\nthe fox"
    assert ollama.plain_prompt({**body, "system": ""}) == "the fox"


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({**CHAT, "options": {"mirostat": 2}}, "option 'mirostat'"),
        ({**CHAT, "format": "yaml"}, "'format'"),
        ({**CHAT, "stream": "yes"}, "'stream'"),
        ({"model": "m", "messages": [{"role": "user", "images": "aGk="}]}, "'images'"),
        ({"model": "m"}, "'messages'"),
        ([], "JSON object"),
    ],
)
def test_what_arbiterd_cannot_do_is_said(body: object, problem: str) -> None:
    with pytest.raises(BadValueError, match=problem):
        ollama.chat_request(body)


def test_a_chat_messages_images_become_image_parts_after_its_text() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "what", "images": ["aGk="]}]}
    _, openai, _ = ollama.chat_request(body)
    assert openai["messages"][0]["content"] == [
        {"type": "text", "text": "what"},
        {"type": "image_url", "image_url": {"url": "data:image;base64,aGk="}},
    ]
    with pytest.raises(BadValueError, match="/api/chat"):
        ollama.generate_request({"model": "m", "prompt": "what", "images": ["aGk="]})


def test_a_whole_answer_and_a_stream_end_with_the_counts() -> None:
    response = {
        "model": "m",
        "choices": [{"message": {"content": "hello"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2},
    }
    whole = ollama.answer(RequestKind.CHAT, "chat", response, 0.5)
    assert whole["message"] == {"role": "assistant", "content": "hello"}
    assert (whole["done"], whole["done_reason"]) == (True, "length")
    assert (whole["prompt_eval_count"], whole["eval_count"]) == (9, 2)
    assert whole["total_duration"] == 500_000_000
    piece = ollama.chunk(
        RequestKind.COMPLETION, "generate", {"model": "m", "choices": [{"text": "fo"}]}
    )
    assert piece is not None
    assert (piece["response"], piece["done"]) == ("fo", False)
    assert (
        ollama.chunk(RequestKind.CHAT, "chat", {"model": "m", "choices": [], "usage": {}}) is None
    )
    last = ollama.last_line("generate", "m", "stop", None, 1.0)
    assert (last["response"], last["done"], last["eval_count"]) == ("", True, 0)


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def test_tools_and_earlier_calls_become_openai_ones() -> None:
    messages = [
        {"role": "user", "content": "2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5", "tool_name": "add"},
    ]
    _, request, _ = ollama.chat_request({**CHAT, "messages": messages, "tools": [ADD]})
    assert request["tools"] == [ADD]
    assert request["messages"][1]["tool_calls"] == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
        }
    ]
    assert request["messages"][2] == {"role": "tool", "content": "5", "name": "add"}
    with pytest.raises(BadValueError, match="tool_calls"):
        ollama.chat_request({**CHAT, "messages": [{"role": "assistant", "tool_calls": [{}]}]})


def test_calls_come_back_with_their_arguments_as_objects() -> None:
    call = {
        "id": "call_x",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1}'},
    }
    response = {
        "model": "m",
        "choices": [
            {"message": {"content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}
        ],
        "usage": {},
    }
    whole = ollama.answer(RequestKind.CHAT, "chat", response, 0.1)
    assert whole["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}],
    }
    assert whole["done_reason"] == "stop"
    calls: dict[int, dict[str, Any]] = {}
    deltas = [
        {
            "index": 0,
            "id": "call_x",
            "type": "function",
            "function": {"name": "add", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"a": 1}'}},
    ]
    for delta in deltas:
        ollama.collect_calls({"choices": [{"delta": {"tool_calls": [delta]}}]}, calls)
    line = ollama.calls_line("m", calls)
    assert line["message"]["tool_calls"] == [{"function": {"name": "add", "arguments": {"a": 1}}}]
    assert line["done"] is False


def test_ps_lists_every_resident_model_and_the_vram_of_the_warm_one() -> None:
    models = tuple(
        ModelStatus.from_json(m)
        for m in (
            {"name": "a", "state": "warm", "vram_bytes": 100, "host_copy_bytes": 1000},
            {"name": "b", "state": "cold", "vram_bytes": 0, "host_copy_bytes": 1000},
            {"name": "c", "state": "failed"},
        )
    )
    listed = ollama.ps(models)["models"]
    assert [(m["model"], m["size_vram"], m["size"]) for m in listed] == [
        ("a:latest", 100, 1000),
        ("b:latest", 0, 1000),
    ]
    assert [m["model"] for m in ollama.tags(models)["models"]] == [
        "a:latest",
        "b:latest",
        "c:latest",
    ]


def test_tags_lists_each_alias_with_its_tag_and_ps_each_loaded_model_once() -> None:
    model = ModelStatus.from_json(
        {"name": "qwen", "aliases": ["llama3", "qwen2.5:7b"], "state": "cold"}
    )
    names = [(m["name"], m["model"], m["state"]) for m in ollama.tags((model,))["models"]]
    assert names == [
        ("qwen:latest", "qwen:latest", "cold"),
        ("llama3:latest", "llama3:latest", "cold"),
        ("qwen2.5:7b", "qwen2.5:7b", "cold"),
    ]
    assert [(m["name"], m["model"]) for m in ollama.ps((model,))["models"]] == [
        ("qwen:latest", "qwen:latest")
    ]


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


def test_show_has_ollamas_shape_with_the_trained_context_and_capabilities() -> None:
    model = ModelStatus.from_json(
        {
            "name": "chat",
            "n_ctx": 2048,
            "architecture": "llama",
            "trained_context": 8192,
            "chat_template": "{{ messages }}",
            "capabilities": ["completion", "chat", "tools"],
        }
    )
    shown = ollama.show(model)
    assert shown["model_info"] == {"general.architecture": "llama", "llama.context_length": 8192}
    assert shown["details"]["family"] == "llama"
    assert shown["details"]["families"] == ["llama"]
    assert shown["capabilities"] == ["completion", "chat", "tools"]
    assert shown["template"] == "{{ messages }}"
    assert shown["parameters"] == "num_ctx 2048"
    assert ollama.tags((model,))["models"][0]["capabilities"] == ["completion", "chat", "tools"]


def test_show_falls_back_to_the_served_context_when_the_gguf_says_none() -> None:
    model = ModelStatus.from_json({"name": "m", "n_ctx": 512, "architecture": "gemma3"})
    assert ollama.show(model)["model_info"]["gemma3.context_length"] == 512


@pytest.mark.parametrize(
    ("body", "model"), [({"model": "m:latest"}, "m:latest"), ({"name": "old"}, "old")]
)
def test_show_takes_the_model_or_the_name_older_clients_send(body: object, model: str) -> None:
    assert ollama.show_model(body) == model


@pytest.mark.parametrize("body", [{}, {"model": 3}, [], "m"])
def test_show_without_a_model_is_bad_input(body: object) -> None:
    with pytest.raises(BadValueError):
        ollama.show_model(body)
