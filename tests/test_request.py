"""The one request record: its wire form reads back as itself, and a malformed one is refused
field by field, never a crash."""

from __future__ import annotations

from typing import Any

import pytest

from arbiterd.errors import RequestError
from arbiterd.request import GenerateRequest, ResponseFormat, Sampling, Tool, ToolChoice
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
    ids=["every-field", "completion", "sampled", "embedding", "required-call", "json-object"],
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


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        ([], "a request must be an object"),
        ({"kind": "poem", "prompt": "x"}, "unknown request kind 'poem'"),
        ({"kind": "completion", "prompt": 3}, "'prompt' must be a string"),
        ({"kind": "chat", "messages": []}, "'messages' must be a non-empty list"),
        ({"kind": "embedding", "input": "the fox"}, "'input' must be a non-empty list of strings"),
        ({"kind": "completion", "prompt": "x", "max_tokens": "many"}, "'max_tokens' must be int"),
        ({"kind": "completion", "prompt": "x", "max_tokens": 0}, "at least 1"),
        ({"kind": "completion", "prompt": "x", "temperature": True}, "'temperature' must be"),
        ({"kind": "completion", "prompt": "x", "stop": [""]}, "'stop' must be a list"),
        ({"kind": "completion", "prompt": "x", "n": 17}, "'n' must be an integer from 1 to 16"),
        ({"kind": "completion", "prompt": "x", "logprobs": 21}, "'logprobs' must be from 0 to"),
        (
            {"kind": "completion", "prompt": "x", "logit_bias": {"1" * 5000: 1}},
            r"'logit_bias' names '1111+\.\.\., which is not a token id",
        ),
        (
            {"kind": "completion", "prompt": "x", "logit_bias": {"\u00b2": 1}},
            "which is not a token id",
        ),
        (
            {"kind": "completion", "prompt": "x", "logit_bias": {"5": 101}},
            r"'logit_bias.5' must be from -100 to 100",
        ),
        (
            {"kind": "chat", "messages": [{}], "response_format": {"type": "xml"}},
            "'response_format' must be",
        ),
        ({"kind": "chat", "messages": [{}], "tools": [{"type": "web"}]}, "'tools' must be a list"),
        (
            {"kind": "chat", "messages": [{}], "tool_choice": "required"},
            "the request offers no tools",
        ),
        (
            {
                "kind": "chat",
                "messages": [{}],
                "tools": [WEATHER.to_json()],
                "tool_choice": {"type": "function", "function": {"name": "add"}},
            },
            "'tool_choice' names 'add', which is not among the tools: get_weather",
        ),
        ({"kind": "completion", "prompt": "x", "images": ["aGk="]}, "images go in chat"),
        ({"kind": "chat", "messages": [{}], "images": "aGk="}, "'images' must be a list"),
        ({"kind": "chat", "messages": [{}], "plain_prompt": 1}, "'plain_prompt' must be a string"),
        ({"kind": "completion", "prompt": "x", "priority": "urgent"}, "'priority' must be one"),
        (
            {"kind": "completion", "prompt": "x", "stream_options": {"include_usage": 1}},
            "'stream_options' must be an object",
        ),
    ],
)
def test_a_malformed_request_is_refused_naming_its_field(wire: Any, message: str) -> None:
    with pytest.raises(RequestError, match=message) as refused:
        GenerateRequest.from_json(wire)
    assert len(str(refused.value)) < 200  # a refused value is shown cut short
