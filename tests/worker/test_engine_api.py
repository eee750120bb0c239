"""What the engine makes of the API's richer requests, on real llama.cpp (CPU) and a tiny model
whose template takes tools: tool calls, log-probabilities, logit bias and several choices."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiterd.errors import RequestError
from arbiterd.request import (
    MAX_TOKEN_ID,
    GenerateRequest,
    ResponseFormat,
    Tool,
    ToolChoice,
)
from arbiterd.spec import ModelSpec
from arbiterd.states import RequestKind
from arbiterd.worker.engine import ReloadBackend
from tests.support.requests import request_for
from tests.support.tiny_gguf import TOOLS_CHAT_TEMPLATE, TinyModelSpec, write_tiny_llama

WEATHER = Tool(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
)
ADD = Tool(
    name="add",
    parameters={
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "integer"},
        },
        "required": ["a", "b"],
    },
)
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
# Greedy, and no penalty: the sampled token is the most likely one.
PLAIN = {"temperature": 0, "repeat_penalty": 1.0}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(chat_template=TOOLS_CHAT_TEMPLATE)
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tools.gguf", spec)


@pytest.fixture
def backend(tools_model: Path) -> Iterator[ReloadBackend]:
    engine = ReloadBackend(ModelSpec(name="tiny", path=tools_model, n_ctx=1024, n_gpu_layers=0))
    engine.load()
    yield engine
    engine.close()


def chat(backend: ReloadBackend, **body: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    chunks: list[dict[str, Any]] = []
    generation = backend.generate(
        request_for("chat", {"messages": ASK, "max_tokens": 150, **body}), chunks.append
    )
    return generation.response, chunks


def streamed_calls(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls as the openai SDK assembles them from the deltas."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls") or []:
            call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
            if "id" in delta:
                call["id"], call["type"] = delta["id"], delta["type"]
            call["function"]["name"] += delta["function"].get("name", "")
            call["function"]["arguments"] += delta["function"].get("arguments", "")
    return [calls[index] for index in sorted(calls)]


@pytest.mark.parametrize(
    ("choice", "name"), [(ToolChoice.REQUIRED, ""), (ToolChoice.FUNCTION, "add")]
)
def test_a_required_call_is_made_and_follows_the_tools_schema(
    backend: ReloadBackend, choice: ToolChoice, name: str
) -> None:
    response, chunks = chat(
        backend, tools=[WEATHER, ADD], tool_choice=choice, tool_name=name, **PLAIN
    )
    answer = response["choices"][0]
    assert answer["finish_reason"] == "tool_calls"
    assert answer["message"]["content"] is None
    (call,) = answer["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    if name:
        assert call["function"]["name"] == "add"
    if call["function"]["name"] == "add":
        assert set(arguments) == {"a", "b"}
        assert all(isinstance(value, int) for value in arguments.values())
    else:
        assert set(arguments) == {"city"}
        assert len(arguments["city"]) <= 12
    assert streamed_calls(chunks) == [{**call, "type": "function"}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_with_auto_the_tiny_model_answers_in_text(backend: ReloadBackend) -> None:
    response, chunks = chat(backend, tools=[WEATHER], max_tokens=8, **PLAIN)
    answer = response["choices"][0]
    assert "tool_calls" not in answer["message"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == answer["message"]["content"] != ""


def test_the_tools_and_earlier_calls_are_rendered_by_the_template(backend: ReloadBackend) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    prepared = backend.prepare(
        request_for("chat", {"messages": history, "tools": [WEATHER]}), lambda: False
    )
    vocab_text = backend._require_llm().detokenize(prepared.prompt_tokens).decode()
    assert '"name": "get_weather"' in vocab_text  # the tool, from the template's tools loop
    # the call's arguments as an object (rendered by tojson), not as a JSON string
    assert '"arguments": {"city": "Oslo"}' in vocab_text
    assert "<|tool|>\nsunny" in vocab_text


def test_a_forced_call_and_a_response_format_together_are_refused(backend: ReloadBackend) -> None:
    with pytest.raises(RequestError, match="response_format"):
        chat(
            backend,
            tools=[WEATHER],
            tool_choice=ToolChoice.REQUIRED,
            response_format=ResponseFormat(),
        )


def test_logprobs_come_with_every_token_and_name_the_greedy_choice(
    backend: ReloadBackend,
) -> None:
    response, chunks = chat(backend, logprobs=3, max_tokens=6, **PLAIN)
    answer = response["choices"][0]
    entries = answer["logprobs"]["content"]
    assert len(entries) == response["usage"]["completion_tokens"] == 6
    assert "".join(entry["token"] for entry in entries) == answer["message"]["content"]
    for entry in entries:
        assert entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3
        best = entry["top_logprobs"][0]
        assert (best["token"], best["logprob"]) == (entry["token"], entry["logprob"])
        assert [t["logprob"] for t in entry["top_logprobs"]] == sorted(
            (t["logprob"] for t in entry["top_logprobs"]), reverse=True
        )
    streamed = [
        e
        for c in chunks
        if c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == entries


def test_completion_logprobs_are_in_the_completions_shape(backend: ReloadBackend) -> None:
    body = {"prompt": "the quick fox", "max_tokens": 4, "logprobs": 2, **PLAIN}
    logprobs = backend.generate(request_for("completion", body), None).response["choices"][0][
        "logprobs"
    ]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 4
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])  # two tokens may share a text
    assert logprobs["text_offset"][0] == 0


def test_a_logit_bias_steers_the_sampler(backend: ReloadBackend) -> None:
    body = {"prompt": "the quick fox", "max_tokens": 5, **PLAIN}
    free = backend.generate(request_for("completion", body), None).response["choices"][0]["text"]
    forced_token = 300
    forced = backend.generate(
        request_for("completion", {**body, "logit_bias": {forced_token: 100.0}}), None
    ).response["choices"][0]["text"]
    piece = backend._require_llm().detokenize([forced_token]).decode()
    assert forced == piece * 5 != free


# A key that is no token id at all ("1" * 5000, "\u00b2") the record's codec refuses
# (tests/test_request.py); an id is checked here, against the model's vocabulary.
@pytest.mark.parametrize(
    "token", [512, MAX_TOKEN_ID, -1], ids=["past-the-vocabulary", "largest-id", "negative"]
)
def test_a_logit_bias_for_a_token_the_model_lacks_is_refused(
    backend: ReloadBackend, token: int
) -> None:
    request = GenerateRequest(RequestKind.COMPLETION, prompt="x", logit_bias={token: 1.0})
    with pytest.raises(RequestError, match="ids are 0 to 511") as refused:
        backend.generate(request, None)
    assert len(str(refused.value)) < 200


def test_several_choices_differ_share_the_prompt_and_repeat_with_a_seed(
    backend: ReloadBackend,
) -> None:
    body = {"prompt": "the quick fox", "max_tokens": 8, "temperature": 1.5, "n": 3, "seed": 11}
    first = backend.generate(request_for("completion", body), None).response
    again = backend.generate(request_for("completion", body), None).response
    texts = [choice["text"] for choice in first["choices"]]
    assert [choice["index"] for choice in first["choices"]] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert [choice["text"] for choice in again["choices"]] == texts
    usage = first["usage"]
    assert usage["prompt_tokens"] < 10  # the prompt counted once
    assert usage["completion_tokens"] == 3 * 8


def test_several_chat_choices_stream_under_one_id(backend: ReloadBackend) -> None:
    response, chunks = chat(backend, n=2, max_tokens=3, temperature=1.0, seed=3)
    assert {chunk["id"] for chunk in chunks} == {response["id"]}
    assert [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]] == [
        0,
        1,
    ]
    assert len(response["choices"]) == 2
