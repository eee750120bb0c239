"""The HTTP edge builds the one request record once: an OpenAI body, or an Ollama body as
ollama.py translates it, becomes the GenerateRequest the worker runs, with no dialect between."""

from __future__ import annotations

import pytest

from arbiterd.daemon.http import ollama
from arbiterd.daemon.http.openai_requests import (
    ApiError,
    parse_embedding_request,
    parse_priority_header,
    parse_request,
)
from arbiterd.request import GenerateRequest, ResponseFormat, Sampling, Tool, ToolChoice
from arbiterd.states import Priority, RequestKind

ASK = [{"role": "user", "content": "the weather?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}


def test_a_chat_body_becomes_the_record_with_every_field_typed() -> None:
    parsed = parse_request(
        RequestKind.CHAT,
        {
            "model": "m",
            "messages": [{"role": "developer", "content": "be brief"}, *ASK],
            "max_completion_tokens": 8,
            "temperature": 0,
            "stop": "\n",
            "n": 2,
            "logprobs": True,
            "top_logprobs": 3,
            "logit_bias": {"15": -100},
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
            "parallel_tool_calls": False,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert (parsed.model, parsed.stream, parsed.ignored) == ("m", True, ())
    assert parsed.request == GenerateRequest(
        RequestKind.CHAT,
        messages=({"role": "system", "content": "be brief"}, *ASK),
        sampling=Sampling(max_tokens=8, temperature=0, stop=("\n",)),
        logit_bias={15: -100.0},
        logprobs=3,
        n=2,
        tools=(Tool(name="weather", parameters=SCHEMA),),
        tool_choice=ToolChoice.FUNCTION,
        tool_name="weather",
        parallel_tool_calls=False,
        include_usage=True,
    )


def test_a_json_schema_is_a_response_format_with_its_schema() -> None:
    body = {
        "model": "m",
        "messages": ASK,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    }
    assert parse_request(RequestKind.CHAT, body).request.response_format == ResponseFormat(SCHEMA)


def test_a_tool_choice_of_none_offers_no_tools() -> None:
    body = {"model": "m", "messages": ASK, "tools": [WEATHER], "tool_choice": "none"}
    request = parse_request(RequestKind.CHAT, body).request
    assert (request.tools, request.tool_choice) == ((), ToolChoice.AUTO)


def test_a_completion_asks_for_logprobs_by_count_and_usage_only_when_streamed() -> None:
    body = {"model": "m", "prompt": ["Once"], "logprobs": 2, "stream_options": {}}
    parsed = parse_request(RequestKind.COMPLETION, body)
    assert parsed.request == GenerateRequest(RequestKind.COMPLETION, prompt="Once", logprobs=2)


def test_an_ollama_chat_is_the_same_record_as_its_openai_twin() -> None:
    kind, openai, stream = ollama.chat_request(
        {"model": "m", "messages": ASK, "options": {"num_predict": 5}, "format": "json"}
    )
    twin = {
        "model": "m",
        "messages": ASK,
        "max_tokens": 5,
        "response_format": {"type": "json_object"},
    }
    assert (kind, stream) == (RequestKind.CHAT, True)
    assert parse_request(kind, openai).request == parse_request(RequestKind.CHAT, twin).request


def test_an_embedding_body_becomes_the_record_of_its_texts() -> None:
    parsed = parse_embedding_request(
        {"model": "m", "input": "the fox", "encoding_format": "base64"}
    )
    assert parsed.request == GenerateRequest(RequestKind.EMBEDDING, inputs=("the fox",))
    assert parsed.base64


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (RequestKind.CHAT, {"model": "m", "messages": []}, "messages"),
        (RequestKind.COMPLETION, {"model": "m", "prompt": "x", "n": 17}, "n"),
        (
            RequestKind.COMPLETION,
            {"model": "m", "prompt": "x", "logit_bias": {"x": 1}},
            "logit_bias",
        ),
        (
            RequestKind.CHAT,
            {"model": "m", "messages": ASK, "tool_choice": "required"},
            "tool_choice",
        ),
    ],
)
def test_each_bad_field_is_a_400_naming_it(kind: RequestKind, body: object, param: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_request(kind, body)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_the_priority_header_is_read_once_at_the_edge() -> None:
    assert parse_priority_header(None) is None
    assert parse_priority_header(" batch ") is Priority.BATCH
    with pytest.raises(ApiError, match="x-arbiterd-priority"):
        parse_priority_header("urgent")
