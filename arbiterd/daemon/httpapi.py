"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions (streamed as
server-sent events or not), /v1/embeddings, /health and /metrics.

Owns request validation, the bearer-token check, the refusal of users it does not serve (which
connections those are, arbiterd.daemon.httpserver decides), streaming, and the one mapping from
arbiterd's errors to the OpenAI error envelope `{"error": {"message", "type", "code", "param"}}`.
Talks to the daemon only through `Service`. Must never answer bad input with a 500 or a bare
string, never leave a stream open after its client has gone, and never import the engine
(llama_cpp loads native libraries the daemon process has no use for).

Guard ladder for a completion request: bearer token → body size (Content-Length, then the bytes
actually read) → JSON (every string valid Unicode, integers and nesting bounded: jsonbody.py) →
object → known keys → model → prompt/messages → each parameter → model exists. The service
gets `prompt` or `messages` plus only the engine's parameters. An embedding request: bearer
token → body size → JSON → object → known keys → model → input → encoding_format → dimensions →
user → model exists; the service gets `input`, a list of texts.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import re
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from arbiterd.arena import parse_priority
from arbiterd.daemon import images, jsonbody, ollama
from arbiterd.daemon.service import Service
from arbiterd.errors import ArbiterError, BadValueError, ErrorCode, UnknownModelError
from arbiterd.spec import COMPLETION_PARAMS, EMBEDDING, IMAGE_MARKER, MAX_IMAGES
from arbiterd.status import ModelStatus
from arbiterd.wire import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
# A chat request reaches its worker as one wire message: the body, its data: URLs replaced by
# markers, and body["images"] in base64. A worker answers a longer line with an error that names
# no request, which would leave the request waiting, so the images get what the largest body
# leaves. Images sent inline as PNG or JPEG fit by construction; a WebP goes as PNG, several
# times its size, and an image fetched from a URL (allow_image_urls) was never in the body.
MAX_IMAGES_MESSAGE_BYTES = MAX_MESSAGE_BYTES - MAX_BODY_BYTES
MAX_TOKENS_LIMIT = 1_000_000
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_TOP_K = 1_000_000  # above any vocabulary size
MAX_REPEAT_PENALTY = 10.0
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's seed is an int64
# Texts in one embedding request, as OpenAI allows; each must also fit the model's context.
MAX_EMBEDDING_INPUTS = 2048
# How long closing an abandoned stream may take (the service cancels the request in its worker).
STREAM_CLOSE_TIMEOUT_S = 10.0
# The text format prometheus_client.generate_latest() writes. prometheus_client >= 0.22 points
# CONTENT_TYPE_LATEST at version=1.0.0, which is only right after content negotiation.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_SHOWN_CHARS = 40  # of a rejected value, in an error message
SSE_DONE = b"data: [DONE]\n\n"
# "developer" is OpenAI's newer name for the system role; chat templates know only "system".
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls"})
# What a request may ask for at most: choices (generated one after the other), alternatives
# per token in logprobs, entries in logit_bias, tools offered. Each over its limit is a 400.
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOKEN_ID = 2**31 - 1  # llama.cpp's llama_token is an int32_t
MAX_TOOLS = 128
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as OpenAI's function names

# Error types and codes of the envelope, as OpenAI spells them where it has one.
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
INTERNAL_ERROR = "internal_error"  # a bug, ours or a worker's: the daemon's log has its traceback


class ApiError(Exception):
    """An HTTP error answered with the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.envelope(), status_code=self.status, headers=self.headers)


# -- validation -------------------------------------------------------------------------------


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong_type(key: str, expected: str, value: object) -> ApiError:
    return ApiError(
        400, f"'{key}' must be {expected}, got {_json_type(value)}", code="invalid_type", param=key
    )


def _shown(value: object) -> str:
    """A refused value as a message shows it: its repr, cut short."""
    shown = repr(value)
    return shown if len(shown) <= MAX_SHOWN_CHARS else shown[: MAX_SHOWN_CHARS - 3] + "..."


def _out_of_range(key: str, expected: str, value: object) -> ApiError:
    return ApiError(
        400, f"'{key}' must be {expected}, got {_shown(value)}", code="invalid_value", param=key
    )


def _integer(key: str, value: object, lo: int, hi: int) -> int:
    expected = f"an integer from {lo} to {hi}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(key, expected, value)
    if not lo <= value <= hi:
        raise _out_of_range(key, expected, value)
    return value


def _number(key: str, value: object, lo: float, hi: float, *, above_lo: bool = False) -> float:
    expected = (
        f"a number {'above' if above_lo else 'from'} {lo:g} {'up ' if above_lo else ''}to {hi:g}"
    )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong_type(key, expected, value)
    # Written so that NaN fails too (json.loads is told to refuse it, but be sure).
    if not (lo < value <= hi if above_lo else lo <= value <= hi):
        raise _out_of_range(key, expected, value)
    return value


def _stop(key: str, value: object) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    expected = f"a string or an array of at most {MAX_STOP_SEQUENCES} non-empty strings"
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
        raise ApiError(400, f"'{key}' must be {expected}", code="invalid_value", param=key)
    for stop in stops:
        # An empty stop string matches at once: every completion would come back empty.
        if not isinstance(stop, str) or not stop:
            raise ApiError(400, f"'{key}' must be {expected}", code="invalid_value", param=key)
    return stops


# A check for each of the engine's parameters (arbiterd.spec.COMPLETION_PARAMS, whose types
# these ranges refine); a test keeps the two in step.
ENGINE_CHECKS: dict[str, Callable[[str, object], object]] = {
    "max_tokens": partial(_integer, lo=1, hi=MAX_TOKENS_LIMIT),
    "temperature": partial(_number, lo=0.0, hi=2.0),
    "top_p": partial(_number, lo=0.0, hi=1.0),
    "top_k": partial(_integer, lo=0, hi=MAX_TOP_K),
    "min_p": partial(_number, lo=0.0, hi=1.0),
    # The penalty divides positive logits: zero would make them infinite.
    "repeat_penalty": partial(_number, lo=0.0, hi=MAX_REPEAT_PENALTY, above_lo=True),
    "presence_penalty": partial(_number, lo=-2.0, hi=2.0),
    "frequency_penalty": partial(_number, lo=-2.0, hi=2.0),
    "seed": partial(_integer, lo=SEED_MIN, hi=SEED_MAX),
    "stop": _stop,
}


@dataclass(frozen=True)
class _Ignored:
    """An OpenAI field arbiterd does not implement, accepted only with a value that changes
    nothing (OpenAI clients send some of them by default)."""

    harmless: Callable[[object], bool]
    expected: str


def _is_empty_dict(value: object) -> bool:
    return isinstance(value, dict) and not value


IGNORED_ANY = {
    "user": _Ignored(lambda v: isinstance(v, str), "a string"),
    # Bookkeeping of OpenAI's service: nothing to store or to file it under here.
    "store": _Ignored(lambda v: isinstance(v, bool), "a boolean"),
    "metadata": _Ignored(lambda v: isinstance(v, dict), "an object"),
    "service_tier": _Ignored(lambda v: isinstance(v, str), "a string"),
}
# The response header that names the fields a request sent which changed nothing here.
IGNORED_HEADER = "x-arbiterd-ignored"
# The request header that sets a request's class in the GPU queue (arbiterd.arena.Priority).
PRIORITY_HEADER = "x-arbiterd-priority"
IGNORED_CHAT = {
    **IGNORED_ANY,
    # The models arbiterd runs reason as their template makes them; the effort asks nothing more.
    "reasoning_effort": _Ignored(lambda v: isinstance(v, str), "a string"),
    # Text is all these models write; asking for only that changes nothing.
    "modalities": _Ignored(lambda v: v == ["text"], '["text"]'),
}
IGNORED_COMPLETION = {
    **IGNORED_ANY,
    "echo": _Ignored(lambda v: v is False, "false"),
    "best_of": _Ignored(lambda v: v == 1 and not isinstance(v, bool), "1"),
    "suffix": _Ignored(lambda v: v == "", "an empty string"),
}
# Fields that would change what the answer means if they were dropped: refused by name.
REFUSED = {
    "audio": "arbiterd's models answer in text only; audio output cannot be served",
    "prediction": "predicted outputs are not served",
    "web_search_options": "arbiterd's models cannot search the web",
}
COMMON_KEYS = frozenset(
    {"model", "stream", "stream_options", "n", "logprobs", "logit_bias", *ENGINE_CHECKS}
)
CHAT_KEYS = COMMON_KEYS | {
    "messages",
    "max_completion_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "top_logprobs",
    *IGNORED_CHAT,
    *REFUSED,
}
COMPLETION_KEYS = COMMON_KEYS | {"prompt", *IGNORED_COMPLETION}


@dataclass(frozen=True)
class CompletionRequest:
    """A validated request: what the service is asked, and how to answer."""

    model: str
    kind: str  # "chat" | "completion", as Service names them
    stream: bool
    body: dict[str, Any]  # prompt or messages, plus engine parameters only
    ignored: tuple[str, ...] = ()  # fields accepted that change nothing here (IGNORED_*)
    # A chat request's image parts, in order: (field, URL), checked against the model's
    # policy once the model is known (`_attach_images`), which puts body["images"].
    image_urls: tuple[tuple[str, str], ...] = ()


def _text_content(
    where: str, content: object, image_parts: list[tuple[str, str]] | None = None
) -> str:
    """A message's content: a string, or an array of text parts joined by newlines. With
    `image_parts` (a user message's), image_url parts are taken too: each becomes the engine's
    IMAGE_MARKER in the text, and its (field, URL) is appended to `image_parts` (issue 12)."""
    if isinstance(content, str):
        _refuse_marker(f"{where}.content", content)
        return content
    expected = 'a string or a non-empty array of {"type": "text", "text": ...} parts'
    if not isinstance(content, list) or not content:
        raise _wrong_type(f"{where}.content", expected, content)
    texts = []
    for index, part in enumerate(content):
        key = f"{where}.content[{index}]"
        if image_parts is not None and isinstance(part, dict) and part.get("type") == "image_url":
            image_parts.append((key, _image_url(key, part)))
            texts.append(IMAGE_MARKER)
            continue
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else None
            detail = f" (arbiterd serves text only, not {kind!r})" if isinstance(kind, str) else ""
            raise ApiError(
                400, f"'{key}' must be a text part{detail}", code="invalid_value", param=key
            )
        if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f'\'{key}\' must be {{"type": "text", "text": <string>}}',
                code="invalid_value",
                param=key,
            )
        _refuse_marker(f"{key}.text", part["text"])
        texts.append(part["text"])
    return "\n".join(texts)


def _image_url(key: str, part: dict[str, Any]) -> str:
    """The URL of an OpenAI image part: {"type": "image_url", "image_url": {"url": ...}} (an
    optional "detail" changes nothing here: the projector decides the resolution)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else None
    if (
        set(part) - {"type", "image_url"}
        or not isinstance(value, dict)
        or set(value) - {"url", "detail"}
        or not isinstance(url, str)
    ):
        raise ApiError(
            400,
            f'\'{key}\' must be {{"type": "image_url", "image_url": {{"url": <string>}}}}',
            code="invalid_value",
            param=key,
        )
    return url


def _refuse_marker(key: str, text: str) -> None:
    """The engine marks where an image goes with IMAGE_MARKER: a text holding it would be an
    image without one."""
    if IMAGE_MARKER in text:
        raise ApiError(
            400,
            f"'{key}' holds {IMAGE_MARKER!r}, which arbiterd reserves to mark images",
            code="invalid_value",
            param=key,
        )


def _messages(
    value: object, image_parts: list[tuple[str, str]] | None = None
) -> list[dict[str, Any]]:
    """Checked messages; the image parts of user messages are appended to `image_parts` (each
    its field and URL) and left as markers in the text (None: image parts are refused)."""
    if not isinstance(value, list) or not value:
        raise _wrong_type("messages", "a non-empty array of message objects", value)
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _wrong_type(where, "an object", message)
        unknown = sorted(set(message) - MESSAGE_KEYS)
        if unknown:
            raise ApiError(
                400,
                f"'{where}' has unsupported key {unknown[0]!r}; arbiterd accepts "
                + ", ".join(sorted(MESSAGE_KEYS)),
                code="invalid_value",
                param=f"{where}.{unknown[0]}",
            )
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(
                400,
                f"'{where}.role' must be one of {', '.join(map(repr, ROLES))}, got "
                + (repr(role) if isinstance(role, str) else _json_type(role)),
                code="invalid_value",
                param=f"{where}.role",
            )
        normal: dict[str, Any] = {"role": ROLES[role]}
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ApiError(
                    400,
                    f"'{where}.tool_calls' belongs in an assistant message, not a {role!r} one",
                    code="invalid_value",
                    param=f"{where}.tool_calls",
                )
            normal["tool_calls"] = _message_calls(f"{where}.tool_calls", calls)
        if calls and message.get("content") is None:
            normal["content"] = None  # a turn that only called tools
        else:
            takes_images = image_parts if role == "user" else None
            normal["content"] = _text_content(where, message.get("content"), takes_images)
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise _wrong_type(f"{where}.{key}", "a string", message[key])
                normal[key] = message[key]
        messages.append(normal)
    return messages


def _message_calls(where: str, calls: object) -> list[dict[str, Any]]:
    """The calls an earlier assistant turn made, as OpenAI spells them."""
    expected = (
        'an array of {"id": ..., "type": "function", '
        '"function": {"name": ..., "arguments": "<JSON text>"}}'
    )
    if not isinstance(calls, list):
        raise _wrong_type(where, expected, calls)
    checked = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise ApiError(
                400, f"'{where}[{index}]' must be {expected}", code="invalid_value", param=where
            )
        checked.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return checked


def _tools(value: object) -> list[dict[str, Any]]:
    """OpenAI's tools: functions only (a tool of another type would be dropped silently)."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise _wrong_type("tools", f"an array of at most {MAX_TOOLS} tools", value)
    tools, names = [], set()
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _wrong_type(where, 'an object {"type": "function", "function": {...}}', tool)
        kind = tool.get("type")
        if kind != "function":
            raise ApiError(
                400,
                f"'{where}.type' is {kind!r}: arbiterd runs only tools of type \"function\"",
                code="unsupported_value",
                param=f"{where}.type",
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _wrong_type(f"{where}.function", "an object with a name", function)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME_RE.fullmatch(name):
            raise ApiError(
                400,
                f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', got "
                + (repr(name) if isinstance(name, str) else _json_type(name)),
                code="invalid_value",
                param=f"{where}.function.name",
            )
        if name in names:
            raise ApiError(
                400,
                f"'{where}.function.name': two tools are named {name!r}",
                code="invalid_value",
                param=f"{where}.function.name",
            )
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _wrong_type(
                f"{where}.function.parameters", "a JSON schema (an object)", parameters
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _wrong_type(f"{where}.function.description", "a string", description)
        shaped: dict[str, Any] = {"name": name}
        if description is not None:
            shaped["description"] = description
        shaped["parameters"] = parameters or {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": shaped})
    return tools


def _tool_choice(value: object, tools: list[dict[str, Any]]) -> str | dict[str, Any] | None:
    """OpenAI's tool_choice, checked against the tools; None when it is the default."""
    if value is None:
        return None
    expected = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    if value in ("none", "auto", "required"):
        assert isinstance(value, str)
        if value == "required" and not tools:
            raise ApiError(
                400,
                "'tool_choice' is \"required\" but the request offers no tools",
                code="invalid_value",
                param="tool_choice",
            )
        return value
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400, f"'tool_choice' must be {expected}", code="invalid_value", param="tool_choice"
        )
    offered = [tool["function"]["name"] for tool in tools]
    if name not in offered:
        raise ApiError(
            400,
            f"'tool_choice' names the function {name!r}, which 'tools' does not offer"
            + (f" (it offers {', '.join(offered)})" if offered else ""),
            code="invalid_value",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


def _legacy_functions(given: dict[str, Any]) -> None:
    """Fold OpenAI's older `functions` and `function_call` into `tools` and `tool_choice`."""
    functions = given.pop("functions", None)
    call = given.pop("function_call", None)
    if functions is not None:
        if "tools" in given:
            raise ApiError(
                400, "give 'tools' or the older 'functions', not both", param="functions"
            )
        if not isinstance(functions, list):
            raise _wrong_type("functions", "an array of function objects", functions)
        given["tools"] = [{"type": "function", "function": function} for function in functions]
    if call is not None:
        if "tool_choice" in given:
            raise ApiError(
                400,
                "give 'tool_choice' or the older 'function_call', not both",
                param="function_call",
            )
        named = isinstance(call, dict) and isinstance(call.get("name"), str)
        given["tool_choice"] = (
            {"type": "function", "function": {"name": call["name"]}} if named else call
        )


def _logprobs(kind: str, given: dict[str, Any]) -> int | None:
    """How many alternatives to report per token; None for no log-probabilities. Chat asks with
    `logprobs: true` and `top_logprobs: K`, completions with `logprobs: K`."""
    if kind == "completion":
        if "logprobs" not in given:
            return None
        return _integer("logprobs", given["logprobs"], 0, MAX_TOP_LOGPROBS)
    wanted = given.get("logprobs", False)
    if not isinstance(wanted, bool):
        raise _wrong_type("logprobs", "a boolean", wanted)
    top = given.get("top_logprobs")
    if top is not None:
        _integer("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
        if not wanted:
            raise ApiError(
                400,
                "'top_logprobs' needs 'logprobs': true",
                code="invalid_value",
                param="top_logprobs",
            )
    return (top or 0) if wanted else None


def _logit_bias(value: object) -> dict[str, float]:
    expected = (
        f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids (as strings) to biases "
        "from -100 to 100"
    )
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise _wrong_type("logit_bias", expected, value)
    for key, bias in value.items():
        # Bounded before int(), which refuses more than 4,300 digits (issue 24).
        if (
            not key.isascii()
            or not key.isdigit()
            or len(key) > len(str(MAX_TOKEN_ID))
            or int(key) > MAX_TOKEN_ID
        ):
            raise ApiError(
                400,
                f"'logit_bias' must be {expected}; {_shown(key)} is not a token id",
                code="invalid_value",
                param="logit_bias",
            )
        _number(f"logit_bias.{key}", bias, -100.0, 100.0)
    return dict(value)


def _refused(given: dict[str, Any]) -> None:
    for key, reason in REFUSED.items():
        if key in given:
            raise ApiError(
                400, f"'{key}' is not supported: {reason}", code="unsupported_value", param=key
            )
    modalities = given.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ApiError(
            400,
            "'modalities' may only be [\"text\"]: arbiterd's models answer in text",
            code="unsupported_value",
            param="modalities",
        )


def _prompt(value: object) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise ApiError(
            400,
            "'prompt' must be a string or an array of exactly one string "
            "(arbiterd does not batch prompts)",
            code="invalid_value",
            param="prompt",
        )
    return value


def _max_completion_tokens(given: dict[str, Any]) -> None:
    """Fold chat's newer name for max_tokens into it."""
    alias = given.pop("max_completion_tokens", None)
    if alias is None:
        return
    ENGINE_CHECKS["max_tokens"]("max_completion_tokens", alias)
    if "max_tokens" in given and given["max_tokens"] != alias:
        raise ApiError(
            400,
            "'max_tokens' and 'max_completion_tokens' disagree; give one",
            code="invalid_value",
            param="max_completion_tokens",
        )
    given["max_tokens"] = alias


def _stream_option(given: dict[str, Any], ignored: dict[str, _Ignored]) -> bool:
    """Check the fields that shape the answer rather than the generation; True to stream."""
    for key, rule in ignored.items():
        if key in given and not rule.harmless(given[key]):
            raise ApiError(
                400,
                f"'{key}' is not supported: arbiterd accepts only {rule.expected} (or null)",
                code="unsupported_value",
                param=key,
            )
    stream = given.get("stream", False)
    if not isinstance(stream, bool):
        raise _wrong_type("stream", "a boolean", stream)
    return stream


def parse_request(kind: str, payload: object) -> CompletionRequest:
    """Validate one /v1/chat/completions ("chat") or /v1/completions ("completion") body."""
    if not isinstance(payload, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(payload)}")
    allowed, ignored = (
        (CHAT_KEYS, IGNORED_CHAT) if kind == "chat" else (COMPLETION_KEYS, IGNORED_COMPLETION)
    )
    unknown = sorted(set(payload) - allowed)
    if unknown:
        # OpenAI's wording, so clients that match on it keep working.
        raise ApiError(
            400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0]
        )
    # A null optional field is an absent one, as in OpenAI's API.
    given = {key: value for key, value in payload.items() if value is not None}
    model = given.get("model")
    if not isinstance(model, str) or not model:
        raise _wrong_type("model", "a model name (a non-empty string)", model)
    image_urls: list[tuple[str, str]] = []
    body: dict[str, Any] = (
        _chat_body(given, image_urls)
        if kind == "chat"
        else {"prompt": _prompt(given.get("prompt"))}
    )
    top_logprobs = _logprobs(kind, given)
    if top_logprobs is not None:
        body["logprobs"] = top_logprobs
    bias = _logit_bias(given.get("logit_bias"))
    if bias:
        body["logit_bias"] = bias
    if "n" in given:
        n = _integer("n", given["n"], 1, MAX_CHOICES)
        if n > 1:
            body["n"] = n
    for key in COMPLETION_PARAMS:  # only what the engine takes is passed on
        if key in given:
            body[key] = ENGINE_CHECKS[key](key, given[key])
    if body.get("stop") == []:
        del body["stop"]
    stream = _stream_option(given, ignored)
    if stream and _include_usage(given.get("stream_options")):
        body["stream_options"] = {"include_usage": True}  # a last chunk with the usage
    unused = tuple(sorted(key for key in given if key in ignored))
    return CompletionRequest(
        model=model,
        kind=kind,
        stream=stream,
        body=body,
        ignored=unused,
        image_urls=tuple(image_urls),
    )


def _chat_body(
    given: dict[str, Any], image_urls: list[tuple[str, str]] | None = None
) -> dict[str, Any]:
    """The chat-only part of a request as the engine takes it: messages, structured output and
    tools (a `tool_choice` of "none" offers none); image parts go to `image_urls`."""
    _refused(given)
    body: dict[str, Any] = {"messages": _messages(given.get("messages"), image_urls)}
    _max_completion_tokens(given)
    structured = _response_format(given.get("response_format"))
    if structured is not None:
        body["response_format"] = structured
    _legacy_functions(given)
    tools = _tools(given.get("tools"))
    choice = _tool_choice(given.get("tool_choice"), tools)
    parallel = given.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _wrong_type("parallel_tool_calls", "a boolean", parallel)
    if tools and choice != "none":
        body["tools"] = tools
        if choice is not None:
            body["tool_choice"] = choice
        if parallel is False:
            body["parallel_tool_calls"] = False
    return body


def _response_format(value: object) -> dict[str, Any] | None:
    """OpenAI's response_format as the engine takes it: None for text; json_object as it is;
    json_schema as json_object with its schema (a grammar made from it constrains the output,
    so it always parses and follows the schema, "strict" or not)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(value, dict) or kind not in ("text", "json_object", "json_schema"):
        raise ApiError(
            400,
            '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            code="invalid_value",
            param="response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    described = value.get("json_schema")
    schema = described.get("schema") if isinstance(described, dict) else None
    if not isinstance(schema, dict):
        raise _wrong_type("response_format.json_schema.schema", "a JSON schema (an object)", schema)
    return {"type": "json_object", "schema": schema}


def _include_usage(options: object) -> bool:
    """`stream_options.include_usage`; the option's other keys change nothing here."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise _wrong_type("stream_options.include_usage", "a boolean", include)
    return include


def _parse_json(raw: bytes) -> object:
    """The body as JSON whose every string is valid Unicode and every integer of a size int()
    takes (jsonbody.py), or a 400 naming the field."""
    try:
        return jsonbody.parse(raw)
    except jsonbody.BodyRefused as exc:
        raise ApiError(400, str(exc), code=exc.code, param=exc.param) from None


async def _read_body(request: Request, limit_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit_bytes`."""
    too_large = ApiError(
        413, f"the request body exceeds {limit_bytes} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "the Content-Length header is not a number")
        if int(declared) > limit_bytes:
            raise too_large
    body = bytearray()
    # Checked again while reading: a chunked body has no Content-Length, and one may lie.
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise too_large
    return bytes(body)


# -- embedding requests -----------------------------------------------------------------------

EMBEDDING_KEYS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    """A validated /v1/embeddings (or /api/embed) request."""

    kind: ClassVar[str] = EMBEDDING  # as Service names it
    model: str
    body: dict[str, Any]  # {"input": [text, ...]}
    base64: bool  # each vector as base64 of its little-endian float32s, not a list of numbers
    ignored: tuple[str, ...] = ()  # fields accepted that change nothing here ("user")


def parse_embedding_request(payload: object) -> EmbeddingRequest:
    """Validate one /v1/embeddings body (also /api/embed's, as ollama.py translates it)."""
    if not isinstance(payload, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(payload)}")
    unknown = sorted(set(payload) - EMBEDDING_KEYS)
    if unknown:
        raise ApiError(
            400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0]
        )
    given = {key: value for key, value in payload.items() if value is not None}
    model = given.get("model")
    if not isinstance(model, str) or not model:
        raise _wrong_type("model", "a model name (a non-empty string)", model)
    texts = _embedding_input(given.get("input"))
    encoding = given.get("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise ApiError(
            400,
            '\'encoding_format\' must be "float" or "base64"',
            code="invalid_value",
            param="encoding_format",
        )
    if "dimensions" in given:
        raise ApiError(
            400,
            "'dimensions' is not supported: arbiterd returns every vector at the length its"
            " model makes",
            code="unsupported_value",
            param="dimensions",
        )
    if "user" in given and not isinstance(given["user"], str):
        raise _wrong_type("user", "a string", given["user"])
    return EmbeddingRequest(
        model=model,
        body={"input": texts},
        base64=encoding == "base64",
        ignored=("user",) if "user" in given else (),
    )


def _embedding_input(value: object) -> list[str]:
    """'input': a string, or an array of 1 to MAX_EMBEDDING_INPUTS strings; none empty."""
    expected = f"a string or an array of 1 to {MAX_EMBEDDING_INPUTS} strings"
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list):
        raise _wrong_type("input", expected, value)
    if not texts or len(texts) > MAX_EMBEDDING_INPUTS:
        got = f"an array of {len(texts)}" if texts else "an empty array"
        raise ApiError(
            400,
            f"'input' must be {expected}, got {got}",
            code="invalid_value",
            param="input",
        )
    for index, text in enumerate(texts):
        where = "input" if isinstance(value, str) else f"input[{index}]"
        if not isinstance(text, str):
            # OpenAI also takes token arrays, which mean nothing to another model's vocabulary.
            raise _wrong_type(where, "a string (arbiterd takes text, not tokens)", text)
        if not text:
            raise ApiError(
                400,
                f"'{where}' is an empty string: nothing to embed",
                code="invalid_value",
                param=where,
            )
    return texts


def _encoded(response: dict[str, Any]) -> dict[str, Any]:
    """An embedding response with each vector as base64 of its little-endian float32s (the
    engine's numbers are float32 values: nothing is lost)."""
    data = []
    for item in response["data"]:
        vector = item["embedding"]
        packed = struct.pack(f"<{len(vector)}f", *vector)
        data.append({**item, "embedding": base64.b64encode(packed).decode("ascii")})
    return {**response, "data": data}


# -- errors -----------------------------------------------------------------------------------


def _unknown_model(model: str, names: list[str]) -> ApiError:
    available = ", ".join(names) if names else "none"
    return ApiError(
        404,
        f"The model {model!r} does not exist; available models: {available}",
        code="model_not_found",
        param="model",
    )


# OpenAI's error codes for ours; any other is "invalid_value" below 500, "model_unavailable" above.
# The HTTP status of every arbiterd error is errors.OUTCOMES's.
OPENAI_CODES: dict[ErrorCode, str] = {
    ErrorCode.CONTEXT_OVERFLOW: "context_length_exceeded",
    ErrorCode.INTERNAL: INTERNAL_ERROR,
}


def _api_error(exc: Exception, names: Callable[[], list[str]]) -> ApiError:
    """The one mapping from an exception to an HTTP error; unexpected ones are logged."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ClientDisconnect):
        return _client_left()
    if isinstance(exc, UnknownModelError):
        available = ", ".join(names()) or "none"
        return ApiError(
            404, f"{exc}; available models: {available}", code="model_not_found", param="model"
        )
    if isinstance(exc, ArbiterError):
        status = exc.http_status
        fallback = "invalid_value" if status < 500 else "model_unavailable"
        return ApiError(
            status,
            str(exc),
            type_=INVALID_REQUEST if status < 500 else SERVER_ERROR,
            code=OPENAI_CODES.get(exc.code, fallback),
        )
    log.error("unexpected error serving a request", exc_info=exc)
    return _internal_error()


def _internal_error() -> ApiError:
    return ApiError(
        500,
        "internal error; the daemon's log has the details",
        type_=SERVER_ERROR,
        code=INTERNAL_ERROR,
    )


def _client_left() -> ApiError:
    # Nobody reads this; the status is for the access log (nginx's "client closed request").
    return ApiError(499, "the client closed the request")


# -- streaming --------------------------------------------------------------------------------


def _sse(data: dict[str, Any]) -> bytes:
    return (
        b"data: "
        + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode(errors="replace")
        + b"\n\n"
    )


async def _unless_disconnected(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Run `work` (which must not raise) until it returns, or until the client disconnects, when
    it is cancelled. True if the client left first.

    Needed because uvicorn (ASGI spec 2.3) neither cancels a handler nor fails a send when the
    client goes away: only `receive()` tells, and only if someone is waiting on it. The body has
    been read by then, so the next message is the disconnect."""
    left = False
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            group.cancel_scope.cancel()

        group.start_soon(watch)
        await work()
        group.cancel_scope.cancel()
    return left


async def _close(chunks: AsyncIterator[dict[str, Any]]) -> None:
    """Close the service's iterator, so it cancels the request in its worker; shielded, as this
    runs while the response is being cancelled, and bounded."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    with anyio.move_on_after(STREAM_CLOSE_TIMEOUT_S, shield=True) as scope:
        try:
            await aclose()
        except Exception:
            log.exception("closing the service's chunk iterator failed")
    if scope.cancelled_caught:
        log.warning("closing the service's chunk iterator took over %s s", STREAM_CLOSE_TIMEOUT_S)


def _ndjson(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"


class EventStream(Response):
    """A streamed completion as server-sent events (or, for Ollama's routes, NDJSON lines),
    owning the service's chunk iterator from opening to closing.

    The first chunk is awaited before the status line is sent, so an error raised before it is
    an ordinary HTTP error. A later error becomes one `data: {"error": ...}` event, then
    `data: [DONE]` (NDJSON: one `{"error": MESSAGE}` line). If the client disconnects at any
    point, the pending read is cancelled and the iterator closed (the Service contract:
    closing early cancels the request)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        chunks: Callable[[], AsyncIterator[dict[str, Any]]],
        names: Callable[[], list[str]],
        *,
        ndjson: bool = False,
    ) -> None:
        # Not Response.__init__: it would render an empty body with Content-Length: 0.
        self.status_code = 200
        self.background = None
        self._open = chunks
        self._names = names
        self._line = _ndjson if ndjson else _sse
        self._end = b"" if ndjson else SSE_DONE
        self._ndjson = ndjson
        if ndjson:
            self.media_type = "application/x-ndjson"
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            chunks = self._open()
        except Exception as exc:  # a service may check eagerly, before its iterator runs
            await _api_error(exc, self._names).response()(scope, receive, send)
            return
        try:
            await _unless_disconnected(receive, partial(self._relay, chunks, scope, receive, send))
        finally:
            await _close(chunks)

    async def _relay(
        self, chunks: AsyncIterator[dict[str, Any]], scope: Scope, receive: Receive, send: Send
    ) -> None:
        try:
            try:
                first: bytes | None = self._line(await anext(chunks))
            except StopAsyncIteration:
                first = None
            except Exception as exc:
                await _api_error(exc, self._names).response()(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
            while True:
                try:
                    event = self._line(await anext(chunks))
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    failed = _api_error(exc, self._names)
                    error = (
                        _ndjson({"error": failed.message})
                        if self._ndjson
                        else (_sse(failed.envelope()))
                    )
                    await send({"type": "http.response.body", "body": error, "more_body": True})
                    break
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": self._end, "more_body": False})
        except OSError:
            return  # ASGI 2.4 servers report a gone client by failing `send`


# -- who is served ----------------------------------------------------------------------------


def _has_api_key(headers: Headers, api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    )


def refuse_stranger(app: ASGIApp, *, api_key: str, reason: str) -> ASGIApp:
    """`app` as served on a connection from a user it does not serve: a request that carries the
    API key goes on to `app`; any other is a 403 before routing, `reason` its message, and the
    connection is closed after it."""

    async def gate(scope: Scope, receive: Receive, send: Send) -> None:
        if api_key and _has_api_key(Headers(scope=scope), api_key):
            await app(scope, receive, send)
            return
        refusal = ApiError(403, reason, code="user_not_allowed", headers={"connection": "close"})
        await refusal.response()(scope, receive, send)

    return gate


# -- the app ----------------------------------------------------------------------------------


def create_app(
    service: Service, *, api_key: str = "", max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    """The HTTP API over `service`. With `api_key`, every route but /health requires
    `Authorization: Bearer <api_key>`."""
    created = int(time.time())
    app = FastAPI(title="arbiterd", docs_url=None, redoc_url=None, openapi_url=None)

    async def authorize(request: Request) -> None:
        if not api_key:
            return
        if not _has_api_key(request.headers, api_key):
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    guarded = [Depends(authorize)]

    async def on_api_error(request: Request, exc: Exception) -> Response:
        return _api_error(exc, names).response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        codes = {404: "not_found", 405: "method_not_allowed"}
        return ApiError(
            exc.status_code,
            str(exc.detail),
            code=codes.get(exc.status_code),
            headers=dict(exc.headers or {}),
        ).response()

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return ApiError(400, f"invalid request: {exc.errors()}").response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Starlette's ServerErrorMiddleware calls this, then re-raises for the server to log.
        return _internal_error().response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(ArbiterError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)

    def names() -> list[str]:
        return list(service.model_names())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        return Response(await service.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models", dependencies=guarded)
    async def list_models() -> dict[str, Any]:
        # Each alias an entry too: clients pick the model they were set up for from this list.
        models = (await service.status()).models
        data = [_model_object(m, n, created) for m in models for n in (m.name, *m.aliases)]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model:path}", dependencies=guarded)
    async def get_model(model: str) -> dict[str, Any]:
        name = service.resolve(model)
        report = (await service.status()).model(name) if name is not None else None
        if report is not None:
            return _model_object(report, model, created)
        raise _unknown_model(model, names())

    async def serve(request: Request, kind: str) -> Response:
        try:
            parsed = parse_request(kind, _parse_json(await _read_body(request, max_body_bytes)))
            _admit(service, request.headers, parsed, names)
            await _attach_images(service, parsed)
        except Exception as exc:
            return _api_error(exc, names).response()
        if parsed.stream:
            response: Response = EventStream(
                partial(service.stream, parsed.model, parsed.kind, parsed.body), names
            )
        else:
            outcome = await _complete(service, parsed, request.receive, names)
            response = outcome if isinstance(outcome, Response) else JSONResponse(outcome)
        if parsed.ignored:
            response.headers[IGNORED_HEADER] = ",".join(parsed.ignored)
        return response

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat")

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await serve(request, "completion")

    _add_embeddings_route(app, service, guarded, names, max_body_bytes)

    _add_ollama_routes(app, service, guarded, names, max_body_bytes)
    return app


def _admit(
    service: Service,
    headers: Headers,
    parsed: CompletionRequest | EmbeddingRequest,
    names: Callable[[], list[str]],
) -> None:
    """What every model route checks once a body parsed: the model exists (by name or alias),
    a strict model is not sent fields it would ignore, and the request's class in the GPU
    queue (its header) goes to the engine."""
    if service.resolve(parsed.model) is None:
        raise _unknown_model(parsed.model, names())
    _refuse_if_strict(service, parsed.model, parsed.ignored)
    _take_priority(headers, parsed.body)


async def _attach_images(service: Service, parsed: CompletionRequest) -> None:
    """Check a chat request's image parts against its model's policy (images.py) and pass them
    to the engine as body["images"], base64, in order. Each refusal is a 400 naming the part.
    images.load runs in threads: a URL may be fetched, a PNG is inflated to check it is whole,
    a WebP is converted to PNG."""
    if not parsed.image_urls:
        return
    policy = service.image_policy(parsed.model)
    if policy is None:
        raise ApiError(
            400,
            f"{parsed.model} takes no images: its config names no mmproj (a projector)",
            code="unsupported_value",
            param=parsed.image_urls[0][0],
        )
    if len(parsed.image_urls) > MAX_IMAGES:
        raise ApiError(
            400,
            f"a request may carry at most {MAX_IMAGES} images; this one has "
            f"{len(parsed.image_urls)}",
            code="invalid_image",
            param=parsed.image_urls[MAX_IMAGES][0],
        )
    loaded: list[str] = []
    total_bytes = 0
    for param, url in parsed.image_urls:
        try:
            image = await images.load(param, url, policy)
        except images.ImageRefused as exc:
            raise ApiError(400, str(exc), code="invalid_image", param=exc.param) from None
        loaded.append(base64.b64encode(image.data).decode("ascii"))
        total_bytes += len(loaded[-1])
        if total_bytes > MAX_IMAGES_MESSAGE_BYTES:
            raise ApiError(
                400,
                f"'{param}': the request's images come to more than "
                f"{MAX_IMAGES_MESSAGE_BYTES} bytes as the engine takes them (base64, a WebP "
                "converted to PNG); send fewer or smaller images",
                code="invalid_image",
                param=param,
            )
    parsed.body["images"] = loaded


def _take_priority(headers: Headers, body: dict[str, Any]) -> None:
    """The request's class in the GPU queue, from its PRIORITY_HEADER, into the engine's body;
    without the header the model's own class applies."""
    given = headers.get(PRIORITY_HEADER)
    if given is None:
        return
    try:
        body["priority"] = parse_priority(given.strip(), f"the {PRIORITY_HEADER} header").value
    except BadValueError as exc:
        raise ApiError(400, str(exc), code="invalid_value", param=PRIORITY_HEADER) from None


def _refuse_if_strict(service: Service, model: str, ignored: tuple[str, ...]) -> None:
    """A 400 for fields that change nothing, when the model has strict_api = true."""
    if ignored and service.strict_api(model):
        raise ApiError(
            400,
            f"{model} has strict_api = true, and these fields would change nothing: "
            + ", ".join(ignored),
            code="unsupported_value",
            param=ignored[0],
        )


def _model_object(model: ModelStatus, id_: str, created: int) -> dict[str, Any]:
    """OpenAI's model object for `id_`, the name of the status report `model` or another name
    for it, with what a client choosing a model can use beyond OpenAI's fields."""
    entry: dict[str, Any] = {
        "id": id_,
        "object": "model",
        "created": created,
        "owned_by": "arbiterd",
        "context_length": model.n_ctx,
        "state": model.state,
        "backend": model.backend,
    }
    if id_ == model.name:
        entry["aliases"] = list(model.aliases)
    else:
        entry["alias_of"] = model.name
    return entry


def _add_embeddings_route(
    app: FastAPI,
    service: Service,
    guarded: list[Any],
    names: Callable[[], list[str]],
    max_body_bytes: int,
) -> None:
    """OpenAI's POST /v1/embeddings: never streamed; base64 made here, from the engine's floats."""

    @app.post("/v1/embeddings", dependencies=guarded)
    async def embeddings(request: Request) -> Response:
        try:
            parsed = parse_embedding_request(_parse_json(await _read_body(request, max_body_bytes)))
            _admit(service, request.headers, parsed, names)
        except Exception as exc:
            return _api_error(exc, names).response()
        outcome = await _complete(service, parsed, request.receive, names)
        if isinstance(outcome, Response):  # an error, answered as such
            return outcome
        response = JSONResponse(_encoded(outcome) if parsed.base64 else outcome)
        if parsed.ignored:
            response.headers[IGNORED_HEADER] = ",".join(parsed.ignored)
        return response


def _add_ollama_routes(
    app: FastAPI,
    service: Service,
    guarded: list[Any],
    names: Callable[[], list[str]],
    max_body_bytes: int,
) -> None:
    """Ollama's API on the same port (daemon/ollama.py translates), for apps that speak only it."""

    @app.get("/api/version", dependencies=guarded)
    async def ollama_version() -> dict[str, Any]:
        return {"version": ollama.VERSION}

    @app.get("/api/tags", dependencies=guarded)
    async def ollama_tags() -> dict[str, Any]:
        return ollama.tags((await service.status()).models)

    @app.get("/api/ps", dependencies=guarded)
    async def ollama_ps() -> dict[str, Any]:
        return ollama.ps((await service.status()).models)

    async def serve_ollama(request: Request, route: str) -> Response:
        try:
            payload = _parse_json(await _read_body(request, max_body_bytes))
            translate = ollama.chat_request if route == "chat" else ollama.generate_request
            kind, openai, stream = translate(payload)
            parsed = parse_request(kind, openai)
            _admit(service, request.headers, parsed, names)
            await _attach_images(service, parsed)
        except Exception as exc:
            return _api_error(exc, names).response()
        started = time.monotonic()
        if stream:
            return EventStream(
                partial(_ollama_lines, service, parsed, route, started), names, ndjson=True
            )
        outcome = await _complete(service, parsed, request.receive, names)
        if isinstance(outcome, Response):  # an error, answered as such
            return outcome
        return JSONResponse(ollama.answer(kind, route, outcome, time.monotonic() - started))

    @app.post("/api/chat", dependencies=guarded)
    async def ollama_chat(request: Request) -> Response:
        return await serve_ollama(request, "chat")

    @app.post("/api/generate", dependencies=guarded)
    async def ollama_generate(request: Request) -> Response:
        return await serve_ollama(request, "generate")

    @app.post("/api/embed", dependencies=guarded)
    async def ollama_embed(request: Request) -> Response:
        try:
            payload = _parse_json(await _read_body(request, max_body_bytes))
            parsed = parse_embedding_request(ollama.embed_request(payload))
            _admit(service, request.headers, parsed, names)
        except Exception as exc:
            return _api_error(exc, names).response()
        started = time.monotonic()
        outcome = await _complete(service, parsed, request.receive, names)
        if isinstance(outcome, Response):  # an error, answered as such
            return outcome
        return JSONResponse(ollama.embed_answer(outcome, time.monotonic() - started))


async def _ollama_lines(
    service: Service, parsed: CompletionRequest, route: str, started: float
) -> AsyncIterator[dict[str, Any]]:
    """A streamed request's chunks as Ollama's lines, the counts in the last (the usage chunk
    the engine sends when asked)."""
    body = {**parsed.body, "stream_options": {"include_usage": True}}
    chunks = service.stream(parsed.model, parsed.kind, body)
    finish_reason, usage = None, None
    calls: dict[int, dict[str, Any]] = {}
    try:
        async for chunk in chunks:
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                finish_reason = choice.get("finish_reason") or finish_reason
            ollama.collect_calls(chunk, calls)
            line = ollama.chunk(parsed.kind, route, chunk)
            if line is not None:
                yield line
        if calls:
            yield ollama.calls_line(parsed.model, calls)
        yield ollama.last_line(
            route, parsed.model, finish_reason, usage, time.monotonic() - started
        )
    finally:
        await _close(chunks)


async def _complete(
    service: Service,
    parsed: CompletionRequest | EmbeddingRequest,
    receive: Receive,
    names: Callable[[], list[str]],
) -> dict[str, Any] | Response:
    """A non-streamed completion's response, or the error response to send instead; cancelled
    if the client leaves before it ends: a long generation nobody will read must not hold the
    model."""
    outcome: dict[str, Any] | Exception = ApiError(500, "the request did not run")

    async def work() -> None:
        nonlocal outcome
        try:
            outcome = await service.complete(parsed.model, parsed.kind, parsed.body)
        except Exception as exc:
            outcome = exc

    if await _unless_disconnected(receive, work):
        return _client_left().response()
    if isinstance(outcome, Exception):
        return _api_error(outcome, names).response()
    return outcome
