"""Client libraries we did not write, against a real daemon of tiny models and SmolLM2-135M-
Instruct (whose template has no place for tools: the generic rendering offers them): the openai
SDK, LangChain, litellm and the ollama client, each as its users call it (tools, structured
output, logprobs, several choices, usage in streams, a model's capabilities)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from arbiterd.config import smollm_model_path
from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.tiny_gguf import TOOLS_CHAT_TEMPLATE, TinyModelSpec, write_tiny_llama

ADD: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
    },
}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2 + 3?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Daemon]:
    spec = TinyModelSpec(chat_template=TOOLS_CHAT_TEMPLATE)
    tools_model = write_tiny_llama(tmp_path_factory.mktemp("models") / "tools.gguf", spec)
    with serving(
        {
            "tools": tiny(tools_model),
            "plain": tiny(tiny_model),
            "strict": tiny(tiny_model, strict_api=True),
            "refusing": tiny(tiny_model, tools="refuse"),
            "smollm": tiny(smollm_model_path()),
        }
    ) as running:
        yield running


@pytest.fixture
def api(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai_client(daemon) as client:
        yield client


# -- the openai SDK ---------------------------------------------------------------------------


def test_openai_sdk_tool_calls_whole_and_streamed(api: openai.OpenAI) -> None:
    whole = api.chat.completions.create(
        model="tools", messages=ASK, tools=[ADD, WEATHER], tool_choice="required", max_tokens=150
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    made = choice.message.tool_calls[0]
    assert made.type == "function"
    assert made.function.name in ("add", "get_weather")
    json.loads(made.function.arguments)
    # The SDK's stream helper assembles the deltas and parses the arguments of strict tools.
    with api.chat.completions.stream(
        model="tools",
        messages=ASK,
        tools=[ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=150,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert call.function.name == "add"
    assert set(json.loads(call.function.arguments)) == {"a", "b"}
    assert final.choices[0].finish_reason == "tool_calls"


def test_openai_sdk_sends_back_a_call_and_its_result(api: openai.OpenAI) -> None:
    first = api.chat.completions.create(
        model="tools",
        messages=ASK,
        tools=[ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=150,
    )
    message = first.choices[0].message
    assert message.tool_calls
    history: list[Any] = [
        *ASK,
        message.model_dump(exclude_none=True),  # the assistant turn as the SDK keeps it
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"},
    ]
    follow_up = api.chat.completions.create(
        model="tools",
        messages=history,
        tools=[ADD],
        max_tokens=5,
        temperature=0,
    )
    assert follow_up.choices[0].message.role == "assistant"
    assert follow_up.usage is not None
    assert follow_up.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_openai_sdk_logprobs_choices_and_bias(api: openai.OpenAI) -> None:
    answer = api.chat.completions.create(
        model="plain",
        messages=ASK,
        max_tokens=4,
        temperature=0.8,
        logprobs=True,
        top_logprobs=2,
        n=2,
        seed=5,
        logit_bias={"300": 100},
    )
    assert [choice.index for choice in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.logprobs is not None
        entries = choice.logprobs.content or []
        assert len(entries) == 4
        assert all(len(entry.top_logprobs) == 2 for entry in entries)
        assert "".join(entry.token for entry in entries) == choice.message.content
        assert len({entry.token for entry in entries}) == 1  # the bias picked every token
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 8


def test_a_strict_model_refuses_what_another_ignores(api: openai.OpenAI) -> None:
    kept = api.chat.completions.with_raw_response.create(
        model="plain", messages=ASK, max_tokens=1, store=False, metadata={"a": "b"}
    )
    assert kept.headers["x-arbiterd-ignored"] == "metadata,store"
    with pytest.raises(openai.BadRequestError, match="strict_api"):
        api.chat.completions.create(model="strict", messages=ASK, max_tokens=1, store=False)


def test_openai_sdk_errors_name_what_was_wrong(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="refusing cannot be offered tools"):
        api.chat.completions.create(model="refusing", messages=ASK, tools=[ADD], max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        api.chat.completions.create(
            model="plain", messages=ASK, logprobs=True, top_logprobs=21, max_tokens=1
        )
    with pytest.raises(openai.BadRequestError, match="'n'"):
        api.chat.completions.create(model="plain", messages=ASK, n=17, max_tokens=1)
    bad_tool: Any = {"type": "function", "function": {"description": "no name"}}
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\].function.name"):
        api.chat.completions.create(model="tools", messages=ASK, tools=[bad_tool])


def test_the_ollama_client_sends_tools_and_a_history_of_calls(daemon: Daemon) -> None:
    import ollama  # noqa: PLC0415

    with ollama.Client(host=daemon.url.removesuffix("/v1"), timeout=60) as client:
        history: list[Any] = [
            {"role": "user", "content": "What is 2 + 3?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
            },
            {"role": "tool", "content": "5", "tool_name": "add"},
        ]
        offered = client.chat(
            model="tools", messages=history, tools=[dict(ADD)], options={"num_predict": 4}
        )
        bare = client.chat(model="tools", messages=history, options={"num_predict": 4})
        assert offered.done
        assert (offered.prompt_eval_count or 0) > (bare.prompt_eval_count or 0)  # tools rendered
        with pytest.raises(ollama.ResponseError, match="refusing cannot be offered tools"):
            client.chat(model="refusing", messages=history[:1], tools=[dict(ADD)])


def test_the_ollama_client_shows_a_models_context_template_and_capabilities(
    daemon: Daemon,
) -> None:
    import ollama  # noqa: PLC0415

    daemon.wait_ready()
    with ollama.Client(host=daemon.url.removesuffix("/v1"), timeout=60) as client:
        shown = client.show("smollm")
        assert shown.details is not None
        assert shown.details.family == "llama"
        assert shown.modelinfo is not None
        assert shown.modelinfo["general.architecture"] == "llama"
        assert shown.modelinfo["llama.context_length"] == 8192  # as SmolLM2's GGUF says
        assert shown.capabilities == ["completion", "chat", "tools"]
        assert shown.template is not None
        assert "<|im_start|>" in shown.template  # its own chat template
        assert shown.parameters == "num_ctx 2048"
        refusing = client.show("refusing:latest")
        assert refusing.capabilities == ["completion", "chat"]
        with pytest.raises(ollama.ResponseError, match="nonesuch"):
            client.show("nonesuch")
    tags = httpx.get(daemon.url.removesuffix("/v1") + "/api/tags", timeout=30).json()
    listed = {entry["model"]: entry["capabilities"] for entry in tags["models"]}
    assert listed["refusing:latest"] == ["completion", "chat"]
    assert listed["smollm:latest"] == ["completion", "chat", "tools"]
    with openai_client(daemon) as api:
        models = {model.id: model.model_dump() for model in api.models.list()}
    assert models["smollm"]["capabilities"] == ["completion", "chat", "tools"]


# -- LangChain --------------------------------------------------------------------------------


def test_langchain_bind_tools_and_structured_output(daemon: Daemon) -> None:
    from langchain_core.messages import AIMessageChunk  # noqa: PLC0415
    from langchain_openai import ChatOpenAI  # noqa: PLC0415 (heavy; only this test needs it)
    from pydantic import SecretStr  # noqa: PLC0415

    llm = ChatOpenAI(
        model="tools",
        base_url=daemon.url,
        api_key=SecretStr("unused"),
        max_retries=0,
        max_completion_tokens=150,
    )
    add: dict[str, Any] = dict(ADD)
    called = llm.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?")
    assert [call["name"] for call in called.tool_calls] == ["add"]
    assert set(called.tool_calls[0]["args"]) == {"a", "b"}
    streamed: AIMessageChunk | None = None
    for chunk in llm.bind_tools([add], tool_choice="add").stream("What is 2 + 3?"):
        assert isinstance(chunk, AIMessageChunk)
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    assert [call["name"] for call in streamed.tool_calls] == ["add"]
    schema = {"title": "answer", "description": "A ranked city", **SCHEMA}
    for method in ("json_schema", "function_calling"):
        structured = llm.with_structured_output(schema, method=method)
        result = structured.invoke("Which city is first?")
        assert isinstance(result, dict)
        assert set(result) == {"city", "rank"}
        assert isinstance(result["rank"], int)


def test_langchain_tools_on_a_model_whose_template_has_no_place_for_them(daemon: Daemon) -> None:
    from langchain_openai import ChatOpenAI  # noqa: PLC0415 (heavy; only these tests need it)
    from pydantic import SecretStr  # noqa: PLC0415

    llm = ChatOpenAI(
        model="smollm",
        base_url=daemon.url,
        api_key=SecretStr("unused"),
        max_retries=0,
        max_completion_tokens=100,
        temperature=0,
    )
    called = llm.bind_tools([dict(ADD)], tool_choice="add").invoke("What is 2 + 3?")
    assert [call["name"] for call in called.tool_calls] == ["add"]
    args = called.tool_calls[0]["args"]
    assert set(args) == {"a", "b"}
    assert all(isinstance(value, int) for value in args.values())
    schema = {"title": "answer", "description": "A ranked city", **SCHEMA}
    structured = llm.with_structured_output(schema, method="function_calling")
    result = structured.invoke("Which city is first?")
    assert isinstance(result, dict)
    assert set(result) == {"city", "rank"}
    assert isinstance(result["rank"], int)


# -- litellm ----------------------------------------------------------------------------------


def litellm_calls(*args: str) -> dict[str, Any]:
    """What tests/support/litellm_calls.py printed, run with `args`."""
    ran = subprocess.run(
        [sys.executable, "-m", "tests.support.litellm_calls", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).parents[2],
    )
    assert ran.returncode == 0, ran.stderr
    got: dict[str, Any] = json.loads(ran.stdout.splitlines()[-1])
    return got


def test_litellm_tools_json_schema_and_streamed_usage(daemon: Daemon) -> None:
    got = litellm_calls(daemon.url)
    assert got["call"]["name"] == "add"
    assert set(got["call"]["arguments"]) == {"a", "b"}
    assert set(got["shaped"]) == {"city", "rank"}
    assert got["streamed_completion_tokens"] == 3
    # SmolLM2's template has no place for tools: they are described in its system turn.
    assert got["generic_call"]["name"] == "add"
    assert set(got["generic_call"]["arguments"]) == {"a", "b"}


def test_litellm_ollama_providers_are_served_without_a_content_type(daemon: Daemon) -> None:
    # Both post their JSON with no Content-Type and no Origin (issue 40: a 415 on every call).
    got = litellm_calls(daemon.url.removesuffix("/v1"), "ollama")
    for provider in ("ollama", "ollama_chat"):
        assert got[provider]["finish_reason"] in {"stop", "length"}, provider
        assert 1 <= got[provider]["completion_tokens"] <= 3, provider
