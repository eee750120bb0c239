"""The OpenAI-compatible HTTP API against a Service double: in-process through httpx's ASGI
transport, and over a real socket (uvicorn) with the openai SDK and with clients that leave."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.types import ASGIApp, Message, Scope

from arbiterd.config import model_key
from arbiterd.daemon.http.app import IGNORED_HEADER, create_app, refuse_stranger
from arbiterd.daemon.http.openai_requests import ENGINE_CHECKS
from arbiterd.daemon.service import ImagePolicy, ServedModel, Service
from arbiterd.errors import (
    ContextOverflowError,
    EngineError,
    InternalError,
    ModelLoadError,
    RequestError,
    UnknownModelError,
    WorkerError,
)
from arbiterd.procs import WaitNews
from arbiterd.request import GenerateRequest
from arbiterd.spec import COMPLETION_PARAMS
from arbiterd.states import BackendKind, ResidencyState
from arbiterd.status import DaemonStatus, ModelStatus
from tests.support.requests import wire_of
from tests.support.waiting import wait_until

MODELS = ["tiny", "small"]
ALIASES = {"tiny": ["gpt-4o-mini", "qwen2.5:7b"], "small": []}
LISTED = ["tiny", "gpt-4o-mini", "qwen2.5:7b", "small"]  # /v1/models's ids, aliases after each
PIECES = ["Hel", "lo"]
METRICS = b"# TYPE arbiterd_requests_total counter\narbiterd_requests_total 3.0\n"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": "Once"}
KEY = "sekrit"
DEADLINE_S = 10.0


class FakeService:
    """A Service double: canned OpenAI objects, chosen failures, and a record of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.error: Exception | None = None  # from complete(), and stream() before any chunk
        self.error_after: tuple[int, Exception] | None = None  # stream(): after N chunks
        self.eager_error: Exception | None = None  # from stream() itself, not its iterator
        self.block_after: int | None = None  # wait forever after N chunks; complete() too
        self.closed = threading.Event()  # stream() was closed or cancelled by its consumer
        self.cancelled = threading.Event()  # complete() was cancelled
        self.streams: list[AsyncIterator[dict[str, Any]]] = []
        self.strict: set[str] = set()  # models with strict_api = true
        self.vision: dict[str, ImagePolicy] = {}  # models with an mmproj
        self.embedders: set[str] = set()  # embedding models

    def model_names(self) -> list[str]:
        return list(MODELS)

    def model(self, asked: str) -> ServedModel | None:
        for name in MODELS:
            if model_key(asked) in {model_key(n) for n in (name, *ALIASES[name])}:
                return ServedModel(
                    name,
                    embedding=name in self.embedders,
                    strict_api=name in self.strict,
                    images=self.vision.get(name),
                )
        return None

    async def complete(self, model: str, request: GenerateRequest) -> dict[str, Any]:
        kind, body = wire_of(request)
        self.calls.append((model, kind, body))
        if self.error is not None:
            raise self.error
        if self.block_after is not None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        text = "".join(PIECES)
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        if kind == "chat":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return _response("chat.completion", model, choice, usage)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
        return _response("text_completion", model, choice, usage)

    def stream(self, model: str, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        kind, body = wire_of(request)
        self.calls.append((model, kind, body))
        if self.eager_error is not None:
            raise self.eager_error
        chunks = self._chunks(model, kind)
        # Held, so that only its consumer closes it early, never the garbage collector.
        self.streams.append(chunks)
        return chunks

    async def _chunks(self, model: str, kind: str) -> AsyncIterator[dict[str, Any]]:
        try:
            if self.error is not None:
                raise self.error
            for index, piece in enumerate([*PIECES, None]):
                if self.block_after == index:
                    await asyncio.Event().wait()
                if self.error_after is not None and self.error_after[0] == index:
                    raise self.error_after[1]
                yield _chunk(kind, model, piece)
        except (GeneratorExit, asyncio.CancelledError):
            self.closed.set()
            raise

    async def status(self) -> DaemonStatus:
        models = tuple(
            ModelStatus(
                name=name,
                aliases=tuple(ALIASES[name]),
                n_ctx=2048,
                state=ResidencyState.WARM if name == "tiny" else ResidencyState.COLD,
                backend=BackendKind.IN_PLACE,
                vram_bytes=100 if name == "tiny" else 0,
                host_copy_bytes=1000,
            )
            for name in MODELS
        )
        return DaemonStatus(models=models)

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        return asyncio.Queue()

    def unsubscribe(self, events: asyncio.Queue[dict[str, Any]]) -> None:
        pass

    async def command(
        self,
        name: str,
        model: str | None = None,
        on_news: Callable[[WaitNews], None] | None = None,
        *,
        pid: int | None = None,
    ) -> dict[str, Any]:
        return {}

    async def metrics_text(self) -> bytes:
        return METRICS


def _response(obj: str, model: str, choice: dict[str, Any], usage: Any = None) -> dict[str, Any]:
    response = {"id": "x-1", "object": obj, "created": 1, "model": model, "choices": [choice]}
    if usage is not None:
        response["usage"] = usage
    return response


def _chunk(kind: str, model: str, piece: str | None) -> dict[str, Any]:
    """A chunk carrying `piece`, or the last one (finish_reason) for None."""
    finish = None if piece is not None else "stop"
    if kind == "chat":
        delta = {"role": "assistant", "content": piece} if piece is not None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return _response("chat.completion.chunk", model, choice)
    choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
    return _response("text_completion", model, choice)


def call(
    app: ASGIApp,
    method: str,
    path: str,
    *,
    body: object = None,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """One request through the app in process; `body` is sent as JSON, `content` as is."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(
                method,
                path,
                json=body if content is None else None,
                content=content,
                headers=headers,
            )

    return asyncio.run(go())


def assert_error(response: httpx.Response, status: int, **expected: object) -> dict[str, Any]:
    """The response is `status` with the OpenAI error envelope; returns its "error" object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    assert set(payload) == {"error"}
    error: dict[str, Any] = payload["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert isinstance(error["message"], str)
    assert error["message"]
    for key, value in expected.items():
        assert error[key] == value, (key, error)
    return error


def events(response: httpx.Response) -> list[Any]:
    """The data of each server-sent event: parsed JSON, or the string "[DONE]"."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == ""  # every event ends with a blank line
    data = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        text = block.removeprefix("data: ")
        data.append(text if text == "[DONE]" else json.loads(text))
    return data


def http_scope(path: str, body: bytes) -> Scope:
    """The ASGI scope of a POST of `body` to `path`, for driving the app by hand."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def app(service: FakeService) -> FastAPI:
    return create_app(service)


# -- what is served -----------------------------------------------------------------------------


def test_the_double_is_a_service() -> None:
    double: Service = FakeService()  # mypy checks the double against the protocol
    assert double.model_names() == MODELS


def test_models_lists_the_configured_models_and_each_alias(app: FastAPI) -> None:
    response = call(app, "GET", "/v1/models")
    assert response.status_code == 200
    payload = response.json()
    assert payload["object"] == "list"
    assert [model["id"] for model in payload["data"]] == LISTED
    for model in payload["data"]:
        assert model["object"] == "model"
        assert model["owned_by"] == "arbiterd"
        assert isinstance(model["created"], int)
        assert model["context_length"] == 2048
        assert model["backend"] == "in-place"
    tiny, mini, tagged, small = payload["data"]
    assert (tiny["aliases"], tiny["state"]) == (ALIASES["tiny"], "warm")
    assert "alias_of" not in tiny
    assert (mini["alias_of"], mini["state"], tagged["alias_of"]) == ("tiny", "warm", "tiny")
    assert "aliases" not in mini
    assert (small["aliases"], small["state"]) == ([], "cold")
    assert call(app, "GET", "/v1/models/small").json() == small
    assert call(app, "GET", "/v1/models/gpt-4o-mini").json() == mini
    assert call(app, "GET", "/v1/models/qwen2.5:7b").json() == tagged
    # Ollama's default tag names the same model, as the name asked for.
    assert call(app, "GET", "/v1/models/small:latest").json() == {
        **{k: v for k, v in small.items() if k != "aliases"},
        "id": "small:latest",
        "alias_of": "small",
    }
    assert_error(call(app, "GET", "/v1/models/nope"), 404, code="model_not_found")
    assert_error(call(app, "GET", "/v1/models/qwen2.5"), 404, code="model_not_found")


def test_an_alias_is_served_and_answered_as_asked(app: FastAPI, service: FakeService) -> None:
    chat = call(app, "POST", "/v1/chat/completions", body={**CHAT, "model": "gpt-4o-mini"})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "gpt-4o-mini"
    body = {**COMPLETION, "model": "qwen2.5:7b", "stream": True}
    streamed = events(call(app, "POST", "/v1/completions", body=body))
    assert {chunk["model"] for chunk in streamed[:-1]} == {"qwen2.5:7b"}
    ollama = call(app, "POST", "/api/chat", body={**CHAT, "model": "tiny:latest", "stream": False})
    assert ollama.json()["model"] == "tiny:latest"
    # The edge looked the alias up once: the service is asked with the model's name, and the
    # answer names the model as asked.
    assert [model for model, _, _ in service.calls] == ["tiny", "tiny", "tiny"]


def test_ollama_lists_every_name_and_alias_as_ollama_names_them(app: FastAPI) -> None:
    tagged = ["tiny:latest", "gpt-4o-mini:latest", "qwen2.5:7b", "small:latest"]
    listed = call(app, "GET", "/api/tags").json()["models"]
    assert [m["name"] for m in listed] == [m["model"] for m in listed] == tagged
    loaded = call(app, "GET", "/api/ps").json()["models"]  # each model once, aliases not
    assert (
        [m["name"] for m in loaded]
        == [m["model"] for m in loaded]
        == [
            "tiny:latest",
            "small:latest",
        ]
    )


def test_health_and_metrics(app: FastAPI) -> None:
    assert call(app, "GET", "/health").json() == {"status": "ok"}
    response = call(app, "GET", "/metrics")
    assert response.status_code == 200
    assert response.content == METRICS
    assert response.headers["content-type"] == CONTENT_TYPE_PLAIN_0_0_4


def test_chat_completion_gets_only_engine_parameters(app: FastAPI, service: FakeService) -> None:
    request = {
        **CHAT,
        "max_completion_tokens": 16,
        "temperature": None,  # null is absent
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "stop": "END",
        "frequency_penalty": 0.5,
        "presence_penalty": 0,
        "n": 1,
        "stream": False,
        # Known OpenAI fields with values that change nothing: accepted, not passed on.
        "user": "someone",
        "logit_bias": {},
        "response_format": {"type": "text"},
        "stream_options": {"include_usage": True},
        "logprobs": False,
        "tools": [],
        "tool_choice": "none",
        "modalities": ["text"],
        "store": False,
        "metadata": {"project": "notes"},
        "reasoning_effort": "low",
    }
    response = call(app, "POST", "/v1/chat/completions", body=request)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello"
    # ... and named, so a client can tell what it asked for that nobody did
    assert response.headers["x-arbiterd-ignored"] == (
        "metadata,modalities,reasoning_effort,store,user"
    )
    assert service.calls == [
        (
            "tiny",
            "chat",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "sampling": {
                    "max_tokens": 16,
                    "top_p": 0.9,
                    "top_k": 40,
                    "seed": 7,
                    "stop": ["END"],
                    "frequency_penalty": 0.5,
                    "presence_penalty": 0,
                },
            },
        )
    ]


def test_messages_are_normalised(app: FastAPI, service: FakeService) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "name": "bot"},
        {"role": "tool", "content": "42", "tool_call_id": "call-1"},
    ]
    response = call(app, "POST", "/v1/chat/completions", body={**CHAT, "messages": messages})
    assert response.status_code == 200, response.text
    assert service.calls[0][2]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok", "name": "bot"},
        {"role": "tool", "content": "42", "tool_call_id": "call-1"},
    ]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tools_and_the_history_of_calls_reach_the_engine(
    app: FastAPI, service: FakeService
) -> None:
    call_made = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        MESSAGE,
        {"role": "assistant", "content": None, "tool_calls": [call_made]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    request = {
        **CHAT,
        "messages": messages,
        "tools": [WEATHER, {"type": "function", "function": {"name": "now"}}],
        "tool_choice": {"type": "function", "function": {"name": "now"}},
        "parallel_tool_calls": False,
    }
    response = call(app, "POST", "/v1/chat/completions", body=request)
    assert response.status_code == 200, response.text
    assert IGNORED_HEADER not in response.headers
    assert service.calls[0][2] == {
        "messages": [MESSAGE, messages[1], messages[2]],
        # The wire form of a Tool record spells what OpenAI's "function" object does.
        "tools": [
            WEATHER["function"],
            {"name": "now", "parameters": {"type": "object", "properties": {}}},
        ],
        "tool_choice": "function",
        "tool_name": "now",
        "parallel_tool_calls": False,
    }


def test_a_strict_model_refuses_the_fields_it_would_ignore(
    app: FastAPI, service: FakeService
) -> None:
    service.strict.add("tiny")
    error = assert_error(
        call(app, "POST", "/v1/chat/completions", body={**CHAT, "store": True, "user": "u"}),
        400,
        param="store",
    )
    assert "strict_api" in error["message"]
    assert "store, user" in error["message"]
    assert service.calls == []
    assert call(app, "POST", "/v1/chat/completions", body=CHAT).status_code == 200


def test_a_priority_header_sets_the_requests_class_in_the_gpu_queue(
    app: FastAPI, service: FakeService
) -> None:
    headers = {"x-arbiterd-priority": "interactive"}
    assert call(app, "POST", "/v1/chat/completions", body=CHAT, headers=headers).status_code == 200
    assert service.calls[0][2]["priority"] == "interactive"
    error = assert_error(
        call(
            app, "POST", "/v1/completions", body=COMPLETION, headers={"x-arbiterd-priority": "now"}
        ),
        400,
        param="x-arbiterd-priority",
    )
    assert "must be one of interactive, normal, batch" in error["message"]


def test_a_tool_choice_of_none_offers_no_tools(app: FastAPI, service: FakeService) -> None:
    request = {**CHAT, "tools": [WEATHER], "tool_choice": "none"}
    assert call(app, "POST", "/v1/chat/completions", body=request).status_code == 200
    assert service.calls[0][2] == {"messages": [MESSAGE]}


def test_the_older_functions_fields_become_tools(app: FastAPI, service: FakeService) -> None:
    request = {**CHAT, "functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}
    assert call(app, "POST", "/v1/chat/completions", body=request).status_code == 200
    assert service.calls[0][2]["tools"] == [WEATHER["function"]]
    assert service.calls[0][2]["tool_choice"] == "function"
    assert service.calls[0][2]["tool_name"] == "get_weather"


def test_logprobs_logit_bias_and_choices_reach_the_engine(
    app: FastAPI, service: FakeService
) -> None:
    chat = {**CHAT, "logprobs": True, "top_logprobs": 3, "logit_bias": {"15": -100}, "n": 2}
    assert call(app, "POST", "/v1/chat/completions", body=chat).status_code == 200
    completion = {**COMPLETION, "logprobs": 0, "n": 1}
    assert call(app, "POST", "/v1/completions", body=completion).status_code == 200
    plain = {**CHAT, "logprobs": False}
    assert call(app, "POST", "/v1/chat/completions", body=plain).status_code == 200
    assert [body for _, _, body in service.calls] == [
        {"messages": [MESSAGE], "logprobs": 3, "logit_bias": {"15": -100}, "n": 2},
        {"prompt": "Once", "logprobs": 0},
        {"messages": [MESSAGE]},
    ]


def test_completion_takes_a_prompt_or_a_list_of_one(app: FastAPI, service: FakeService) -> None:
    first = call(app, "POST", "/v1/completions", body={**COMPLETION, "max_tokens": 4})
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == "Hello"
    second = call(app, "POST", "/v1/completions", body={**COMPLETION, "prompt": ["Twice"]})
    assert second.status_code == 200, second.text
    assert [body for _, _, body in service.calls] == [
        {"prompt": "Once", "sampling": {"max_tokens": 4}},
        {"prompt": "Twice"},
    ]
    assert [kind for _, kind, _ in service.calls] == ["completion", "completion"]


def test_engine_checks_cover_exactly_the_engine_parameters() -> None:
    assert set(ENGINE_CHECKS) == set(COMPLETION_PARAMS)


# -- bad input --------------------------------------------------------------------------------

MESSAGE = {"role": "user", "content": "hi"}
BAD_CHAT: list[tuple[str, dict[str, Any], str]] = [
    ("unknown field", {"foo": 1}, "foo"),
    ("missing model", {"model": None}, "model"),
    ("model not a string", {"model": 5}, "model"),
    ("empty model", {"model": ""}, "model"),
    ("no messages", {"messages": None}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("messages a string", {"messages": "hi"}, "messages"),
    ("message not an object", {"messages": ["hi"]}, "messages[0]"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("missing role", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("content null", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    (
        "image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]",
    ),
    (
        "text part without text",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0]",
    ),
    (
        "tool calls in a user message",
        {"messages": [{**MESSAGE, "tool_calls": []}]},
        "messages[0].tool_calls",
    ),
    (
        "a call without arguments",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}],
                }
            ]
        },
        "messages[0].tool_calls",
    ),
    ("max_tokens bool", {"max_tokens": True}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -1}, "max_tokens"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens absurd", {"max_tokens": 10**30}, "max_tokens"),
    ("max_tokens string", {"max_tokens": "10"}, "max_tokens"),
    ("max_tokens float", {"max_tokens": 1.5}, "max_tokens"),
    ("max_completion_tokens zero", {"max_completion_tokens": 0}, "max_completion_tokens"),
    (
        "max_tokens aliases disagree",
        {"max_tokens": 5, "max_completion_tokens": 6},
        "max_completion_tokens",
    ),
    ("temperature too high", {"temperature": 2.5}, "temperature"),
    ("temperature negative", {"temperature": -0.1}, "temperature"),
    ("temperature a string", {"temperature": "hot"}, "temperature"),
    ("temperature bool", {"temperature": True}, "temperature"),
    ("top_p above one", {"top_p": 1.5}, "top_p"),
    ("repeat_penalty zero", {"repeat_penalty": 0}, "repeat_penalty"),
    ("five stops", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stop a number", {"stop": [1]}, "stop"),
    ("empty stop", {"stop": ""}, "stop"),
    ("n over the limit", {"n": 17}, "n"),
    ("n zero", {"n": 0}, "n"),
    ("n bool", {"n": True}, "n"),
    ("stream a string", {"stream": "yes"}, "stream"),
    ("seed a float", {"seed": 1.5}, "seed"),
    ("seed beyond int64", {"seed": 2**64}, "seed"),
    ("logit_bias not a token id", {"logit_bias": {"the": 5}}, "logit_bias"),
    ("logit_bias beyond 100", {"logit_bias": {"7": -101}}, "logit_bias.7"),
    ("logit_bias a list", {"logit_bias": [1]}, "logit_bias"),
    ("logprobs a number", {"logprobs": 3}, "logprobs"),
    ("top_logprobs over 20", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("a tool of another type", {"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    (
        "a tool with no name",
        {"tools": [{"type": "function", "function": {}}]},
        "tools[0].function.name",
    ),
    (
        "a tool name with spaces",
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools[0].function.name",
    ),
    (
        "two tools of one name",
        {"tools": [{"type": "function", "function": {"name": "f"}}] * 2},
        "tools[1].function.name",
    ),
    (
        "parameters not a schema",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters",
    ),
    (
        "tool_choice names a tool not offered",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool_choice a word", {"tool_choice": "always"}, "tool_choice"),
    (
        "tools and functions",
        {"tools": [], "functions": [{"name": "f"}]},
        "functions",
    ),
    ("parallel_tool_calls a string", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("audio output", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("audio modality", {"modalities": ["text", "audio"]}, "modalities"),
    ("prompt in chat", {"prompt": "x"}, "prompt"),
]
BAD_COMPLETION: list[tuple[str, dict[str, Any], str]] = [
    ("missing prompt", {"prompt": None}, "prompt"),
    ("two prompts", {"prompt": ["a", "b"]}, "prompt"),
    ("token ids", {"prompt": [1, 2]}, "prompt"),
    ("prompt a number", {"prompt": 5}, "prompt"),
    ("messages in completions", {"messages": [MESSAGE]}, "messages"),
    ("chat alias in completions", {"max_completion_tokens": 5}, "max_completion_tokens"),
    ("echo", {"echo": True}, "echo"),
    ("best_of", {"best_of": 2}, "best_of"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        *[
            pytest.param("/v1/chat/completions", {**CHAT, **b}, p, id=f"chat-{i}")
            for i, b, p in BAD_CHAT
        ],
        *[
            pytest.param("/v1/completions", {**COMPLETION, **b}, p, id=f"completion-{i}")
            for i, b, p in BAD_COMPLETION
        ],
    ],
)
def test_bad_parameters_are_400_with_the_envelope(
    app: FastAPI, service: FakeService, path: str, body: dict[str, Any], param: str
) -> None:
    for stream in (False, True):
        error = assert_error(
            call(app, "POST", path, body={**body, "stream": body.get("stream", stream)}),
            400,
            type="invalid_request_error",
            param=param,
        )
        assert param.partition(".")[0].partition("[")[0] in error["message"]
    assert service.calls == []


def test_unknown_field_uses_openais_wording(app: FastAPI) -> None:
    response = call(app, "POST", "/v1/chat/completions", body={**CHAT, "zz": 1, "aa": 2})
    error = assert_error(response, 400, param="aa")
    assert error["message"] == "Unrecognized request argument supplied: aa, zz"


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"{not json", id="malformed"),
        pytest.param(b"", id="empty"),
        pytest.param(b'{"model": "\xff"}', id="not-utf8"),
        pytest.param(b'{"model": "tiny", "prompt": "x", "temperature": NaN}', id="nan"),
        pytest.param(b"[" * 100_000, id="nested-too-deep"),
        pytest.param(b"[1, 2]", id="array"),
        pytest.param(b'"text"', id="string"),
    ],
)
def test_bodies_that_are_not_json_objects_are_400(
    app: FastAPI, service: FakeService, raw: bytes
) -> None:
    headers = {"content-type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = call(app, "POST", path, content=raw, headers=headers)
        assert_error(response, 400, type="invalid_request_error", param=None)
    assert service.calls == []


# What no body may hold, on every route that takes one (issue 24): each a 400 naming the field,
# before any route reads it (a lone surrogate used to end the worker, or be a 500 in a key).
LONE = "ab\ud800cd"
HUGE = "9" * 5000  # an integer literal json.dumps cannot write, int() cannot read
UNREADABLE_BODIES = [
    pytest.param("/v1/completions", {**COMPLETION, "prompt": LONE}, "prompt", id="prompt"),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": LONE}]},
        "messages[0].content",
        id="content",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
        "messages[0].content[0].text",
        id="text-part",
    ),
    pytest.param("/v1/chat/completions", {**CHAT, "metadata": {LONE: 1}}, "metadata", id="key"),
    pytest.param("/v1/chat/completions", {**CHAT, LONE: 1}, None, id="key-of-the-body"),
    pytest.param("/v1/chat/completions", {**CHAT, "stop": ["\udfff"]}, "stop[0]", id="stop"),
    pytest.param("/v1/embeddings", {"model": "tiny", "input": ["a", LONE]}, "input[1]", id="input"),
    pytest.param(
        "/api/chat",
        {"model": "tiny", "messages": [{"role": "user", "content": LONE}]},
        "messages[0].content",
        id="ollama-chat",
    ),
    pytest.param(
        "/api/generate", {"model": "tiny", "prompt": LONE}, "prompt", id="ollama-generate"
    ),
    pytest.param("/api/embed", {"model": "tiny", "input": LONE}, "input", id="ollama-embed"),
    pytest.param("/v1/completions", {**COMPLETION, "seed": "HUGE"}, "seed", id="seed"),
    pytest.param("/v1/chat/completions", {**CHAT, "n": "HUGE"}, "n", id="n"),
    pytest.param(
        "/v1/chat/completions", {**CHAT, "max_tokens": "HUGE"}, "max_tokens", id="max_tokens"
    ),
    pytest.param(
        "/v1/chat/completions", {**CHAT, "logit_bias": {"7": "HUGE"}}, "logit_bias.7", id="bias"
    ),
    pytest.param(
        "/api/generate",
        {"model": "tiny", "prompt": "x", "options": {"num_predict": "HUGE"}},
        "options.num_predict",
        id="ollama-num_predict",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), UNREADABLE_BODIES)
def test_a_lone_surrogate_or_a_huge_integer_anywhere_is_a_400_naming_its_field(
    app: FastAPI, service: FakeService, path: str, body: dict[str, Any], param: str | None
) -> None:
    # ensure_ascii writes a surrogate as its escape, as a client that sends one does.
    raw = json.dumps(body).replace('"HUGE"', HUGE).encode()
    response = call(app, "POST", path, content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, 400, type="invalid_request_error", param=param)
    assert ("lone surrogate" if HUGE.encode() not in raw else "5000 digits") in error["message"]
    assert service.calls == []


@pytest.mark.parametrize(
    "key", ["1" * 5000, "2147483648", "99999999999", "\u00b2"], ids=["5000", "2^31", "11", "sup2"]
)
def test_a_logit_bias_key_that_is_no_token_id_is_a_400_without_int_of_it(
    app: FastAPI, service: FakeService, key: str
) -> None:
    response = call(app, "POST", "/v1/chat/completions", body={**CHAT, "logit_bias": {key: 1}})
    error = assert_error(response, 400, code="invalid_value", param="logit_bias")
    assert len(error["message"]) < 200  # the key is shown cut short
    assert service.calls == []


def test_unknown_model_is_404_listing_the_models(app: FastAPI, service: FakeService) -> None:
    for stream in (False, True):
        response = call(app, "POST", "/v1/chat/completions", body={**CHAT, "model": "nope"})
        error = assert_error(response, 404, code="model_not_found", param="model")
        assert "'nope'" in error["message"]
        assert "tiny, small" in error["message"]
        response = call(
            app, "POST", "/v1/completions", body={**COMPLETION, "model": "x", "stream": stream}
        )
        assert_error(response, 404, code="model_not_found")
    assert service.calls == []


def test_body_over_the_limit_is_413(service: FakeService) -> None:
    app = create_app(service, max_body_bytes=200)
    big = {**COMPLETION, "prompt": "x" * 300}
    assert_error(call(app, "POST", "/v1/completions", body=big), 413, code="request_too_large")

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
        for part in (b'{"model": "tiny", "prompt": "', b"x" * 150, b"x" * 150, b'"}'):
            yield part

    async def send_chunked() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", content=chunked())

    response = asyncio.run(send_chunked())
    assert "content-length" not in response.request.headers
    assert_error(response, 413, code="request_too_large")
    assert service.calls == []
    fits = call(app, "POST", "/v1/completions", body={**COMPLETION, "prompt": "x" * 100})
    assert fits.status_code == 200


def test_unknown_routes_and_methods_keep_the_envelope(app: FastAPI) -> None:
    assert_error(call(app, "GET", "/v1/nothing"), 404, code="not_found")
    response = call(app, "GET", "/v1/chat/completions")
    assert_error(response, 405, code="method_not_allowed")
    assert "POST" in response.headers["allow"]


# -- the API key ----------------------------------------------------------------------------------


def test_api_key_guards_everything_but_health(service: FakeService) -> None:
    app = create_app(service, api_key=KEY)
    good = {"authorization": f"Bearer {KEY}"}
    for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}):
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
            ("POST", "/v1/chat/completions", CHAT),
            ("POST", "/v1/completions", COMPLETION),
        ):
            response = call(app, method, path, body=body, headers=headers)
            assert_error(response, 401, code="invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
    assert service.calls == []
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/v1/models", headers=good).status_code == 200
    assert call(app, "GET", "/metrics", headers=good).content == METRICS
    assert call(app, "POST", "/v1/completions", body=COMPLETION, headers=good).status_code == 200


# -- errors from the service ----------------------------------------------------------------------

SERVICE_ERRORS = [
    pytest.param(
        ContextOverflowError("prompt of 9000 tokens > 8192"),
        400,
        "context_length_exceeded",
        id="overflow",
    ),
    pytest.param(RequestError("bad grammar"), 400, "invalid_value", id="request"),
    pytest.param(WorkerError("worker exited"), 503, "model_unavailable", id="worker"),
    pytest.param(EngineError("engine failed"), 503, "model_unavailable", id="engine"),
    pytest.param(ModelLoadError("corrupt GGUF"), 503, "model_unavailable", id="load"),
    pytest.param(UnknownModelError("no model 'tiny'"), 404, "model_not_found", id="unknown-model"),
    # A worker's bug met by one request (issue 24): that request's error, the worker lives on.
    pytest.param(
        InternalError("internal error in the worker of tiny (ValueError)"),
        500,
        "internal_error",
        id="internal",
    ),
]


@pytest.mark.parametrize(("exc", "status", "code"), SERVICE_ERRORS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream-before-first-chunk"])
def test_service_errors_map_to_statuses(
    app: FastAPI, service: FakeService, *, exc: Exception, status: int, code: str, stream: bool
) -> None:
    service.error = exc
    response = call(app, "POST", "/v1/chat/completions", body={**CHAT, "stream": stream})
    error = assert_error(response, status, code=code)
    assert str(exc) in error["message"]
    assert len(service.calls) == 1
    if isinstance(exc, UnknownModelError):
        assert "tiny, small" in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream-before-first-chunk"])
def test_unexpected_errors_are_500_and_logged(
    app: FastAPI, service: FakeService, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    service.error = RuntimeError("a bug")
    with caplog.at_level(logging.ERROR, logger="arbiterd.daemon.http.app"):
        response = call(app, "POST", "/v1/completions", body={**COMPLETION, "stream": stream})
    assert_error(response, 500, type="server_error", code="internal_error")
    [record] = caplog.records
    assert record.exc_info is not None
    assert record.exc_info[1] is service.error


def test_service_checking_eagerly_before_streaming_gets_the_same_mapping(
    app: FastAPI, service: FakeService
) -> None:
    service.eager_error = UnknownModelError("no model 'tiny'")
    response = call(app, "POST", "/v1/chat/completions", body={**CHAT, "stream": True})
    assert_error(response, 404, code="model_not_found")


def test_a_bug_outside_the_completion_routes_is_a_500_envelope(service: FakeService) -> None:
    async def broken() -> bytes:
        raise RuntimeError("a bug")

    service.metrics_text = broken  # type: ignore[method-assign]

    async def scrape() -> httpx.Response:
        # The server logs what Starlette re-raises after answering; here it must not escape.
        transport = httpx.ASGITransport(app=create_app(service), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/metrics")

    assert_error(asyncio.run(scrape()), 500, type="server_error")


def test_client_leaving_while_sending_the_body_is_not_an_error(
    app: FastAPI, service: FakeService, caplog: pytest.LogCaptureFixture
) -> None:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    with caplog.at_level(logging.WARNING):
        asyncio.run(app(http_scope("/v1/completions", b'{"model": "tiny"}'), receive, send))
    assert sent[0]["status"] == 499
    assert caplog.records == []
    assert service.calls == []


# -- streaming ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "request_body", "kind"),
    [
        ("/v1/chat/completions", CHAT, "chat"),
        ("/v1/completions", COMPLETION, "completion"),
    ],
)
def test_stream_sends_each_chunk_then_done(
    app: FastAPI, service: FakeService, path: str, request_body: dict[str, Any], kind: str
) -> None:
    response = call(app, "POST", path, body={**request_body, "stream": True, "max_tokens": 3})
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-cache"
    data = events(response)
    assert data == [*(_chunk(kind, "tiny", piece) for piece in [*PIECES, None]), "[DONE]"]
    [(model, got_kind, body)] = service.calls
    assert (model, got_kind) == ("tiny", kind)
    assert "stream" not in body
    assert body["sampling"]["max_tokens"] == 3
    assert not service.closed.is_set()


@pytest.mark.parametrize(
    ("response_format", "passed"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {}),  # a JSON object, no schema
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
            {"schema": {"type": "object"}},
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "n", "strict": True, "schema": {"type": "integer"}},
            },
            {"schema": {"type": "integer"}},
        ),
    ],
)
def test_a_response_format_goes_to_the_engine_as_a_json_object_with_its_schema(
    app: FastAPI, service: FakeService, response_format: object, passed: object
) -> None:
    body = {**CHAT, "response_format": response_format}
    assert call(app, "POST", "/v1/chat/completions", body=body).status_code == 200
    [(_, _, sent)] = service.calls
    assert sent.get("response_format") == passed


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "xml"}, "response_format"),
        ("json", "response_format"),
        (
            {"type": "json_schema", "json_schema": {"name": "n"}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_response_format_arbiterd_cannot_follow_is_a_400(
    app: FastAPI, response_format: object, param: str
) -> None:
    body = {**CHAT, "response_format": response_format}
    response = call(app, "POST", "/v1/chat/completions", body=body)
    assert_error(response, 400, param=param)


@pytest.mark.parametrize(
    ("path", "request_body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
)
def test_a_stream_names_the_fields_that_changed_nothing(
    app: FastAPI, path: str, request_body: dict[str, Any]
) -> None:
    body = {**request_body, "stream": True, "service_tier": "auto", "user": "me"}
    response = call(app, "POST", path, body=body)
    assert response.status_code == 200
    assert response.headers["x-arbiterd-ignored"] == "service_tier,user"
    plain = call(app, "POST", path, body={**request_body, "stream": True})
    assert "x-arbiterd-ignored" not in plain.headers


@pytest.mark.parametrize(
    ("path", "request_body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
)
def test_a_stream_that_asks_for_its_usage_passes_the_option_on(
    app: FastAPI, service: FakeService, path: str, request_body: dict[str, Any]
) -> None:
    options = {"include_usage": True, "include_obfuscation": False}
    body = {**request_body, "stream": True, "stream_options": options}
    assert call(app, "POST", path, body=body).status_code == 200
    plain = {**request_body, "stream_options": {"include_usage": True}}  # not streamed: no chunk
    assert call(app, "POST", path, body=plain).status_code == 200
    [(_, _, streamed), (_, _, answered)] = service.calls
    assert streamed["include_usage"] is True
    assert "include_usage" not in answered


@pytest.mark.parametrize(
    ("path", "request_body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
)
@pytest.mark.parametrize(
    ("options", "param"),
    [("yes", "stream_options"), ({"include_usage": "yes"}, "stream_options.include_usage")],
)
def test_malformed_stream_options_are_a_400(
    app: FastAPI, path: str, request_body: dict[str, Any], options: object, param: str
) -> None:
    body = {**request_body, "stream": True, "stream_options": options}
    assert_error(call(app, "POST", path, body=body), 400, code="invalid_type", param=param)


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [*SERVICE_ERRORS, pytest.param(RuntimeError("a bug"), 500, "internal_error", id="unexpected")],
)
def test_error_mid_stream_is_an_error_event_then_done(
    app: FastAPI, service: FakeService, exc: Exception, status: int, code: str | None
) -> None:
    service.error_after = (1, exc)
    response = call(app, "POST", "/v1/chat/completions", body={**CHAT, "stream": True})
    assert response.status_code == 200
    first, error, done = events(response)
    assert first == _chunk("chat", "tiny", PIECES[0])
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "code", "param"}
    assert error["error"]["code"] == code
    assert error["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert done == "[DONE]"


def test_send_failing_closes_the_service_stream(app: FastAPI, service: FakeService) -> None:
    """ASGI 2.4 servers report a gone client by failing `send` and may never say so through
    `receive`: the stream must still be closed, not left suspended for the garbage collector."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    scope = http_scope("/v1/chat/completions", body)
    requests: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[Message] = []

    async def receive() -> Message:
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # never tells of the disconnect
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            raise OSError("the client went away")

    async def serve() -> bool:
        await asyncio.wait_for(app(scope, receive, send), DEADLINE_S)
        # Asked here: asyncio.run closes leftover generators itself when it ends.
        return service.closed.is_set()

    assert asyncio.run(serve()), "the stream was left open"
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body"]


# -- over a real socket ----------------------------------------------------------------------------


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Serve `app` with uvicorn on a free port in a thread; yields the base URL."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http="h11",
        ws="none",
        lifespan="off",
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), DEADLINE_S, "uvicorn to start")
        assert server.started, "uvicorn exited before it started"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=DEADLINE_S)
        assert not thread.is_alive(), "uvicorn did not stop"


def test_openai_sdk_against_a_real_server(service: FakeService) -> None:
    app = create_app(service, api_key=KEY)
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    with (
        serving(app) as url,
        openai.OpenAI(
            base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=DEADLINE_S
        ) as client,
    ):
        chat = client.chat.completions.create(
            model="tiny", messages=messages, max_completion_tokens=8, temperature=0.2
        )
        assert chat.choices[0].message.content == "Hello"
        chunks = client.chat.completions.create(model="small", messages=messages, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "Hello"
        completion = client.completions.create(model="tiny", prompt="Once", max_tokens=4)
        assert completion.choices[0].text == "Hello"
        pieces = client.completions.create(model="tiny", prompt="Once", stream=True)
        assert "".join(chunk.choices[0].text for chunk in pieces) == "Hello"
        assert [model.id for model in client.models.list()] == LISTED
        by_alias = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
        assert by_alias.model == "gpt-4o-mini"

        with pytest.raises(openai.NotFoundError, match="available models: tiny, small"):
            client.chat.completions.create(model="nope", messages=messages)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model="tiny", prompt="x", max_tokens=0)
        service.error_after = (1, WorkerError("worker exited"))
        with pytest.raises(openai.APIError, match="worker exited"):
            for _ in client.chat.completions.create(model="tiny", messages=messages, stream=True):
                pass
        with (
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as stranger,
            pytest.raises(openai.AuthenticationError),
        ):
            stranger.models.list()
    assert [body for _, _, body in service.calls][:3] == [
        {"messages": messages, "sampling": {"max_tokens": 8, "temperature": 0.2}},
        {"messages": messages},
        {"prompt": "Once", "sampling": {"max_tokens": 4}},
    ]


def test_client_leaving_mid_stream_closes_the_service_stream(service: FakeService) -> None:
    service.block_after = 1  # one chunk, then nothing until cancelled
    with serving(create_app(service)) as url, httpx.Client(base_url=url) as client:
        with client.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as response:
            assert response.status_code == 200
            first = next(response.iter_lines())
            assert json.loads(first.removeprefix("data: ")) == _chunk("chat", "tiny", PIECES[0])
        # Leaving the block with the response unread closes the connection.
        wait_until(service.closed.is_set, DEADLINE_S, "the service's stream to be closed")


def test_client_leaving_before_the_first_chunk_closes_the_service_stream(
    service: FakeService,
) -> None:
    service.block_after = 0
    with serving(create_app(service)) as url, httpx.Client(base_url=url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        wait_until(service.closed.is_set, DEADLINE_S, "the service's stream to be closed")


def test_client_leaving_a_whole_completion_cancels_it(service: FakeService) -> None:
    service.block_after = 0
    with serving(create_app(service)) as url, httpx.Client(base_url=url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=COMPLETION)
        wait_until(service.cancelled.is_set, DEADLINE_S, "the completion to be cancelled")


# -- users it does not serve ----------------------------------------------------------------------

ROUTES = [
    ("GET", "/health", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/models", None),
    ("GET", "/v1/nothing", None),
    ("POST", "/v1/completions", COMPLETION),
]


def test_a_stranger_is_refused_with_the_envelope_before_routing(
    app: FastAPI, service: FakeService
) -> None:
    gate = refuse_stranger(app, api_key="", reason="arbiterd serves uid 1000 only")
    for method, path, body in ROUTES:
        for headers in (None, {"authorization": f"Bearer {KEY}"}):  # no key is set
            response = call(gate, method, path, body=body, headers=headers)
            assert_error(
                response,
                403,
                message="arbiterd serves uid 1000 only",
                type="invalid_request_error",
                code="user_not_allowed",
            )
            assert response.headers["connection"] == "close"
    assert service.calls == []


def test_the_api_key_takes_a_stranger_past_the_refusal(service: FakeService) -> None:
    gate = refuse_stranger(create_app(service, api_key=KEY), api_key=KEY, reason="not yours")
    good = {"authorization": f"Bearer {KEY}"}
    for method, path, body in ROUTES:
        assert_error(call(gate, method, path, body=body), 403, code="user_not_allowed")
        wrong = {"authorization": "Bearer wrong"}
        assert_error(call(gate, method, path, body=body, headers=wrong), 403)
    assert service.calls == []
    assert call(gate, "GET", "/health", headers=good).status_code == 200
    assert call(gate, "GET", "/metrics", headers=good).content == METRICS
    assert call(gate, "POST", "/v1/completions", body=COMPLETION, headers=good).status_code == 200
    assert_error(call(gate, "GET", "/v1/nothing", headers=good), 404, code="not_found")
