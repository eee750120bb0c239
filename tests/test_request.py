"""The one request record: its wire form reads back as itself, and a malformed one is refused
field by field, never a crash."""

from __future__ import annotations

from typing import Any

import pytest

from arbiterd.errors import RequestError
from arbiterd.request import (
    GenerateRequest,
    Infill,
    ResponseFormat,
    Sampling,
    Tool,
    ToolChoice,
)
from arbiterd.spec import COMPLETION_PARAMS
from arbiterd.states import Priority, RequestKind

WEATHER = Tool(
    name="get_weather",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    description="The weather in a city",
)
EVERY_FIELD = GenerateRequest(
    RequestKind.CHAT,
    messages=({"role": "user", "content": "the fox <__media__>"},),
    plain_prompt="the fox",
    sampling=Sampling(max_tokens=8, temperature=0.5, top_k=40, seed=7, stop=("\n", "END")),
    logit_bias={15: -100.0, 2: 2.5},
    logprobs=3,
    n=2,
    response_format=ResponseFormat({"type": "object"}),
    tools=(WEATHER,),
    tool_choice=ToolChoice.FUNCTION,
    tool_name="get_weather",
    parallel_tool_calls=False,
    images=("aGVsbG8=",),
    priority=Priority.BATCH,
    include_usage=True,
)


@pytest.mark.parametrize(
    "request_",
    [
        EVERY_FIELD,
        GenerateRequest(RequestKind.COMPLETION, prompt="the fox"),
        GenerateRequest(
            RequestKind.COMPLETION,
            prompt="def f(",
            infill=Infill("):", middle="x", extra=(("a.py", "A = 1"), ("a.py", "B = 2"))),
        ),
        GenerateRequest(RequestKind.COMPLETION, prompt="", sampling=Sampling(top_p=0.9)),
        GenerateRequest(RequestKind.EMBEDDING, inputs=("the fox", "the dog")),
        GenerateRequest(
            RequestKind.CHAT,
            messages=({"role": "user", "content": "hi"},),
            tools=(WEATHER,),
            tool_choice=ToolChoice.REQUIRED,
        ),
        GenerateRequest(
            RequestKind.CHAT,
            messages=({"role": "user", "content": "hi"},),
            response_format=ResponseFormat(),
        ),
    ],
    ids=[
        "every-field",
        "completion",
        "infill",
        "sampled",
        "embedding",
        "required-call",
        "json-object",
    ],
)
def test_a_request_reads_back_from_its_wire_form_as_itself(request_: GenerateRequest) -> None:
    assert GenerateRequest.from_json(request_.to_json()) == request_


def test_sampling_names_the_engine_parameters() -> None:
    assert set(Sampling.__dataclass_fields__) == set(COMPLETION_PARAMS)


def test_the_wire_form_holds_only_what_differs_from_the_default() -> None:
    assert GenerateRequest(RequestKind.COMPLETION, prompt="x").to_json() == {
        "kind": "completion",
        "prompt": "x",
    }


def test_the_wire_form_is_the_records_own_fields() -> None:
    assert EVERY_FIELD.to_json() == {
        "kind": "chat",
        "messages": [{"role": "user", "content": "the fox <__media__>"}],
        "plain_prompt": "the fox",
        "sampling": {
            "max_tokens": 8,
            "temperature": 0.5,
            "top_k": 40,
            "seed": 7,
            "stop": ["\n", "END"],
        },
        "logit_bias": {"15": -100.0, "2": 2.5},
        "logprobs": 3,
        "n": 2,
        "response_format": {"schema": {"type": "object"}},
        "tools": [
            {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "description": "The weather in a city",
            }
        ],
        "tool_choice": "function",
        "tool_name": "get_weather",
        "parallel_tool_calls": False,
        "images": ["aGVsbG8="],
        "priority": "batch",
        "include_usage": True,
    }


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        ([], "a request must be an object"),
        ({"prompt": "x"}, "'kind' is missing"),
        ({"kind": "poem", "prompt": "x"}, "'kind' must be one of completion, chat, embedding"),
        ({"kind": "completion", "model": "m"}, "unknown field 'model'"),
        ({"kind": "completion", "prompt": 3}, "'prompt' must be a string"),
        ({"kind": "chat", "messages": {}}, "'messages' must be a list"),
        ({"kind": "chat", "messages": ["hi"]}, r"'messages\[0\]' must be an object"),
        ({"kind": "embedding", "inputs": "the fox"}, "'inputs' must be a list"),
        ({"kind": "embedding", "inputs": ["the fox", 7]}, r"'inputs\[1\]' must be a string"),
        (
            {"kind": "completion", "sampling": {"max_tokens": "many"}},
            "'sampling.max_tokens' must be",
        ),
        ({"kind": "completion", "sampling": {"max_tokens": 1.5}}, "must be an integer, got float"),
        ({"kind": "completion", "sampling": {"temperature": True}}, "'sampling.temperature' must"),
        ({"kind": "completion", "sampling": {"best_of": 2}}, "unknown field 'sampling.best_of'"),
        ({"kind": "completion", "sampling": {"stop": "\n"}}, "'sampling.stop' must be a list"),
        ({"kind": "completion", "n": "2"}, "'n' must be an integer"),
        ({"kind": "completion", "logprobs": False}, "'logprobs' must be an integer"),
        ({"kind": "completion", "logit_bias": {"1" * 5000: 1}}, "which is not an integer"),
        ({"kind": "completion", "logit_bias": {"\u00b2": 1}}, "which is not an integer"),
        ({"kind": "completion", "logit_bias": {"5": "up"}}, "'logit_bias.5' must be a number"),
        (
            {"kind": "chat", "response_format": {"type": "xml"}},
            "unknown field 'response_format.type'",
        ),
        ({"kind": "chat", "tools": [{"type": "web"}]}, "unknown field 'tools\\[0\\].type'"),
        ({"kind": "chat", "tools": [{"parameters": {}}]}, r"'tools\[0\].name' is missing"),
        ({"kind": "chat", "tool_choice": "any"}, "'tool_choice' must be one of"),
        (
            {"kind": "completion", "infill": {"suffix": "x", "extra": [["a"]]}},
            "must be a list of 2",
        ),
        ({"kind": "chat", "images": "aGk="}, "'images' must be a list"),
        ({"kind": "chat", "plain_prompt": 1}, "'plain_prompt' must be a string"),
        ({"kind": "completion", "priority": "urgent"}, "'priority' must be one of"),
        ({"kind": "completion", "include_usage": 1}, "'include_usage' must be a boolean"),
    ],
)
def test_a_malformed_request_is_refused_naming_its_field(wire: Any, message: str) -> None:
    with pytest.raises(RequestError, match=message) as refused:
        GenerateRequest.from_json(wire)
    assert len(str(refused.value)) < 200  # a refused value is shown cut short
