"""OpenAI's request bodies as the one record the daemon serves (arbiterd.request.GenerateRequest),
built once at the HTTP edge; Ollama's routes come here too, as ollama.py translates them.

Owns the field-by-field checks of a body and the OpenAI error envelope (`ApiError`) each
refusal is: a 400 naming the field, as OpenAI words it where it has words. What a check needs
of the model (its vocabulary, grammar compiler, context, template) is the engine's; what it
needs of the config (does the model exist, is it strict, does it take images) app.py asks
the service once the body parsed.

Guard ladder for a completion request: object → known keys → model → prompt/messages → each
parameter. An embedding request: object → known keys → model → input → encoding_format →
dimensions → user.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse

from arbiterd.errors import BadValueError
from arbiterd.request import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_TOKEN_ID,
    MAX_TOP_LOGPROBS,
    GenerateRequest,
    Infill,
    ResponseFormat,
    Sampling,
    Tool,
    ToolChoice,
    shown,
)
from arbiterd.spec import COMPLETION_PARAMS, IMAGE_MARKER
from arbiterd.states import Priority, RequestKind, parse_priority

MAX_TOKENS_LIMIT = 1_000_000
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_TOP_K = 1_000_000  # above any vocabulary size
MAX_REPEAT_PENALTY = 10.0
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's seed is an int64
# Texts in one embedding request, as OpenAI allows; each must also fit the model's context.
MAX_EMBEDDING_INPUTS = 2048

# "developer" is OpenAI's newer name for the system role; chat templates know only "system".
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls"})
# What a request may ask for at most beyond arbiterd.request's limits: entries in logit_bias,
# tools offered. Each over its limit is a 400.
MAX_LOGIT_BIAS_ENTRIES = 1024
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


def _out_of_range(key: str, expected: str, value: object) -> ApiError:
    return ApiError(
        400, f"'{key}' must be {expected}, got {shown(value)}", code="invalid_value", param=key
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


IGNORED_ANY = {
    "user": _Ignored(lambda v: isinstance(v, str), "a string"),
    # Bookkeeping of OpenAI's service: nothing to store or to file it under here.
    "store": _Ignored(lambda v: isinstance(v, bool), "a boolean"),
    "metadata": _Ignored(lambda v: isinstance(v, dict), "an object"),
    "service_tier": _Ignored(lambda v: isinstance(v, str), "a string"),
}
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
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "suffix", *IGNORED_COMPLETION}


@dataclass(frozen=True)
class ApiRequest:
    """A parsed body: the record the service is asked to run, and how the edge answers it."""

    model: str  # as the client named it (an alias, an Ollama tag): the response says it back
    request: GenerateRequest
    # The configured model's name, once app.py's `_admit` looked the model up (the service
    # runs the request on it); "" until then.
    name: str = ""
    stream: bool = False
    ignored: tuple[str, ...] = ()  # fields accepted that change nothing here (IGNORED_*)
    # A chat request's image parts, in order: (field, URL), checked against the model's
    # policy once the model is known (app.py's `_load_images`), which fills request.images.
    image_urls: tuple[tuple[str, str], ...] = ()
    # An embedding request's: each vector as base64 of its little-endian float32s, not a list
    # of numbers.
    base64: bool = False


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


def _tools(value: object) -> tuple[Tool, ...]:
    """OpenAI's tools: functions only (a tool of another type would be dropped silently)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise _wrong_type("tools", f"an array of at most {MAX_TOOLS} tools", value)
    tools: list[Tool] = []
    names: set[str] = set()
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
        tools.append(
            Tool(
                name=name,
                parameters=parameters or {"type": "object", "properties": {}},
                description=description,
            )
        )
    return tuple(tools)


def _tool_choice(value: object, tools: tuple[Tool, ...]) -> tuple[ToolChoice | None, str]:
    """OpenAI's tool_choice, checked against the tools, and the function it names; None for
    "none" (no tools are offered then)."""
    if value is None:
        return ToolChoice.AUTO, ""
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
        return (None if value == "none" else ToolChoice(value)), ""
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400, f"'tool_choice' must be {expected}", code="invalid_value", param="tool_choice"
        )
    offered = [tool.name for tool in tools]
    if name not in offered:
        raise ApiError(
            400,
            f"'tool_choice' names the function {name!r}, which 'tools' does not offer"
            + (f" (it offers {', '.join(offered)})" if offered else ""),
            code="invalid_value",
            param="tool_choice",
        )
    return ToolChoice.FUNCTION, name


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


def _logprobs(kind: RequestKind, given: dict[str, Any]) -> int | None:
    """How many alternatives to report per token; None for no log-probabilities. Chat asks with
    `logprobs: true` and `top_logprobs: K`, completions with `logprobs: K`."""
    if kind is RequestKind.COMPLETION:
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


def _logit_bias(value: object) -> dict[int, float]:
    expected = (
        f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids (as strings) to biases "
        "from -100 to 100"
    )
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise _wrong_type("logit_bias", expected, value)
    biases = {}
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
                f"'logit_bias' must be {expected}; {shown(key)} is not a token id",
                code="invalid_value",
                param="logit_bias",
            )
        biases[int(key)] = _number(f"logit_bias.{key}", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return biases


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


def _infill(suffix: object) -> Infill | None:
    """A completion's `suffix`: the text after the point to fill in; "" or absent: none."""
    if not isinstance(suffix, str):
        raise _wrong_type("suffix", "a string", suffix)
    return Infill(suffix) if suffix else None


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


def parse_request(kind: RequestKind, payload: object) -> ApiRequest:
    """Validate one /v1/chat/completions (CHAT) or /v1/completions (COMPLETION) body."""
    if not isinstance(payload, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(payload)}")
    chat = kind is RequestKind.CHAT
    allowed, ignored = (CHAT_KEYS, IGNORED_CHAT) if chat else (COMPLETION_KEYS, IGNORED_COMPLETION)
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
    request = (
        _chat_request(given, image_urls)
        if chat
        else GenerateRequest(
            RequestKind.COMPLETION,
            prompt=_prompt(given.get("prompt")),
            infill=_infill(given.get("suffix", "")),
        )
    )
    logprobs = _logprobs(kind, given)
    logit_bias = _logit_bias(given.get("logit_bias"))
    n = _integer("n", given["n"], 1, MAX_CHOICES) if "n" in given else 1
    # Only what the engine takes is passed on.
    sampling: dict[str, Any] = {
        key: ENGINE_CHECKS[key](key, given[key]) for key in COMPLETION_PARAMS if key in given
    }
    sampling["stop"] = tuple(sampling.get("stop", ()))
    stream = _stream_option(given, ignored)
    # A streamed request may ask for a last chunk with the usage.
    include_usage = stream and _include_usage(given.get("stream_options"))
    return ApiRequest(
        model=model,
        request=replace(
            request,
            sampling=Sampling(**sampling),
            logit_bias=logit_bias,
            logprobs=logprobs,
            n=n,
            include_usage=include_usage,
        ),
        stream=stream,
        ignored=tuple(sorted(key for key in given if key in ignored)),
        image_urls=tuple(image_urls),
    )


def _chat_request(given: dict[str, Any], image_urls: list[tuple[str, str]]) -> GenerateRequest:
    """The chat-only part of a request: messages, structured output and tools (a `tool_choice`
    of "none" offers none); image parts go to `image_urls`."""
    _refused(given)
    messages = _messages(given.get("messages"), image_urls)
    _max_completion_tokens(given)
    response_format = _response_format(given.get("response_format"))
    _legacy_functions(given)
    tools = _tools(given.get("tools"))
    choice, name = _tool_choice(given.get("tool_choice"), tools)
    parallel = given.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _wrong_type("parallel_tool_calls", "a boolean", parallel)
    offered = bool(tools) and choice is not None
    return GenerateRequest(
        RequestKind.CHAT,
        messages=tuple(messages),
        response_format=response_format,
        tools=tools if offered else (),
        tool_choice=choice if offered and choice is not None else ToolChoice.AUTO,
        tool_name=name if offered else "",
        parallel_tool_calls=not offered or parallel is not False,
    )


def _response_format(value: object) -> ResponseFormat | None:
    """OpenAI's response_format: None for text; json_object as it is; json_schema as a JSON
    object with its schema (a grammar made from it constrains the output, so it always parses
    and follows the schema, "strict" or not)."""
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
        return ResponseFormat()
    described = value.get("json_schema")
    schema = described.get("schema") if isinstance(described, dict) else None
    if not isinstance(schema, dict):
        raise _wrong_type("response_format.json_schema.schema", "a JSON schema (an object)", schema)
    return ResponseFormat(schema)


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


# -- embedding requests -----------------------------------------------------------------------

EMBEDDING_KEYS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
ENCODING_FORMATS = ("float", "base64")


def parse_embedding_request(payload: object) -> ApiRequest:
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
    return ApiRequest(
        model=model,
        request=GenerateRequest(RequestKind.EMBEDDING, inputs=tuple(texts)),
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


def parse_priority_header(given: str | None) -> Priority | None:
    """The request's class in the GPU queue, from its PRIORITY_HEADER; None without the
    header: the model's own class applies."""
    if given is None:
        return None
    try:
        return parse_priority(given.strip(), f"the {PRIORITY_HEADER} header")
    except BadValueError as exc:
        raise ApiError(400, str(exc), code="invalid_value", param=PRIORITY_HEADER) from None
