"""OpenAI's Responses API (POST /v1/responses) as the chat request the daemon already serves: a
body becomes an OpenAI chat body that openai_requests.py checks into the one GenerateRequest,
and the worker's chat answer (a completion, or its stream of chunks) becomes a response object
with output items, or the Responses stream's events.

Owns the Responses body's own fields (input items, instructions, tools in the Responses
spelling, max_output_tokens, text.format) and the daemon's memory of past responses for
`previous_response_id`: PastResponses, bounded to MAX_PAST_RESPONSES and to [daemon]
responses_budget bytes (issue 40: a few responses with images each held megabytes), the oldest
dropped, gone when the daemon stops. Every other check is openai_requests.py's.

Guard ladder for a body: object → known keys → truncation, include, reasoning →
previous_response_id → input items (each type) → instructions → tools → text.format → the
chat body (parse_request: model, messages, each parameter), its errors renamed to this body's
fields.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from arbiterd.config import RESPONSES_BUDGET_BYTES
from arbiterd.daemon.http.openai_requests import ApiError, ApiRequest, parse_request
from arbiterd.procs import WaitNews
from arbiterd.render import format_bytes
from arbiterd.states import RequestKind

log = logging.getLogger(__name__)

# How many past responses previous_response_id can name; the oldest is forgotten first.
MAX_PAST_RESPONSES = 256

# The body's keys: those translated here, and those passed on to the chat parser as they are.
OWN_KEYS = frozenset(
    {
        "input",
        "instructions",
        "previous_response_id",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "text",
        "truncation",
        "reasoning",
        "include",
    }
)
PASSED_KEYS = frozenset(
    {
        "model",
        "stream",
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "user",
        "store",
        "metadata",
        "service_tier",
    }
)
ROLES = ("user", "system", "developer", "assistant")


def _refuse(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


@dataclass(frozen=True)
class ResponsesRequest:
    """A parsed Responses body: the chat request to run, and what the answer says back."""

    api: ApiRequest
    conversation: tuple[dict[str, Any], ...]  # its turns without the instructions, to remember
    echo: dict[str, Any]  # the request's fields a response object repeats


class PastResponses:
    """The conversations of the last MAX_PAST_RESPONSES responses, by response id: each the
    turns that led to it and its answer, so a request naming it goes on from there.

    Bounded in bytes too: the text of all kept conversations (an image is its data: URL) stays
    within `budget_bytes`, the oldest forgotten first; a conversation larger than the whole
    budget is not kept at all, so naming it is the 404 a forgotten one gets. A chain of
    responses shares its earlier turns in memory, but each response counts them again: what is
    really kept is at most what is counted.

    Invariant: `_bytes` is the sum of `_sizes`, and it is at most `_budget_bytes`."""

    def __init__(
        self, limit: int = MAX_PAST_RESPONSES, budget_bytes: int = RESPONSES_BUDGET_BYTES
    ) -> None:
        self._limit = limit
        self._budget_bytes = budget_bytes
        self._turns: OrderedDict[str, tuple[dict[str, Any], ...]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._bytes = 0

    @property
    def bytes_(self) -> int:
        """The bytes of the conversations kept now, as the budget counts them."""
        return self._bytes

    def remember(self, response_id: str, turns: tuple[dict[str, Any], ...]) -> None:
        size = text_bytes(turns)
        if size > self._budget_bytes:
            log.info(
                "response %s not kept for previous_response_id: its conversation is %s, more "
                "than the whole [daemon] responses_budget (%s)",
                response_id,
                format_bytes(size),
                format_bytes(self._budget_bytes),
            )
            return
        self._turns[response_id] = turns
        self._sizes[response_id] = size
        self._bytes += size
        while len(self._turns) > self._limit or self._bytes > self._budget_bytes:
            oldest, _ = self._turns.popitem(last=False)
            self._bytes -= self._sizes.pop(oldest)

    def turns(self, response_id: str) -> tuple[dict[str, Any], ...]:
        try:
            return self._turns[response_id]
        except KeyError:
            raise ApiError(
                404,
                f"Previous response with id '{response_id}' not found (arbiterd keeps the last "
                f"{self._limit} responses while it runs, up to [daemon] responses_budget = "
                f"{format_bytes(self._budget_bytes)} of their conversations in all, and forgets "
                "the oldest first; send the whole conversation as 'input' instead)",
                code="previous_response_not_found",
                param="previous_response_id",
            ) from None


def text_bytes(value: object) -> int:
    """The UTF-8 bytes of every string in `value` (dicts, lists and tuples of JSON values): what
    a conversation keeps in memory, less the few bytes of each object around them."""
    count, pending = 0, [value]
    while pending:  # a loop, not recursion: the nesting depth is the client's choice
        item = pending.pop()
        if isinstance(item, str):
            # An image's data: URL is ASCII: its length is its bytes, counted without a copy.
            count += len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return count


# -- requests ---------------------------------------------------------------------------------


def parse_responses_request(payload: object, past: PastResponses) -> ResponsesRequest:
    """Validate one /v1/responses body into the chat request it asks for."""
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(payload) - OWN_KEYS - PASSED_KEYS)
    if unknown:
        raise ApiError(
            400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0]
        )
    given = {key: value for key, value in payload.items() if value is not None}
    _refuse_settings(given)
    previous = given.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _refuse("'previous_response_id' must be a string", "previous_response_id")
    earlier = past.turns(previous) if previous is not None else ()
    origins: list[str] = []
    turns = (*earlier, *_input(given.get("input"), origins))
    instructions = given.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _refuse("'instructions' must be a string", "instructions")
    system = ({"role": "system", "content": instructions},) if instructions else ()
    chat: dict[str, Any] = {key: given[key] for key in PASSED_KEYS if key in given}
    chat["messages"] = [*system, *turns]
    if "tools" in given:
        chat["tools"] = _tools(given["tools"])
    if "tool_choice" in given:
        chat["tool_choice"] = _tool_choice(given["tool_choice"])
    if "max_output_tokens" in given:
        chat["max_tokens"] = given["max_output_tokens"]
    form = _text_format(given.get("text"))
    if form is not None:
        chat["response_format"] = form
    # Where each chat turn came from, so that an error names the body's own field.
    sources = ["instructions"] * len(system) + ["previous_response_id"] * len(earlier) + origins
    try:
        api = parse_request(RequestKind.CHAT, chat)
    except ApiError as exc:
        raise _renamed(exc, sources) from None
    images = tuple((_field(param, sources), url) for param, url in api.image_urls)
    api = replace(api, image_urls=images)
    echo = {
        "instructions": instructions,
        "max_output_tokens": given.get("max_output_tokens"),
        "temperature": given.get("temperature", 1.0),
        "top_p": given.get("top_p", 1.0),
        "tools": given.get("tools", []),
        "tool_choice": given.get("tool_choice", "auto"),
        "parallel_tool_calls": given.get("parallel_tool_calls", True),
        "previous_response_id": previous,
        "text": given.get("text", {"format": {"type": "text"}}),
        "metadata": given.get("metadata", {}),
    }
    return ResponsesRequest(api=api, conversation=turns, echo=echo)


def _field(param: str, sources: list[str]) -> str:
    """A chat field's name as this body spells it: messages[3].content[1] is the part of the
    input item turn 3 came from; max_tokens is max_output_tokens."""
    if param.startswith("max_tokens"):
        return "max_output_tokens" + param.removeprefix("max_tokens")
    if not param.startswith("messages["):
        return param
    index, _, rest = param.removeprefix("messages[").partition("]")
    source = sources[int(index)] if index.isdigit() and int(index) < len(sources) else "input"
    return source + rest if source.startswith("input[") else source


def _renamed(exc: ApiError, sources: list[str]) -> ApiError:
    """A chat parser's error naming the field as this body spells it."""
    if exc.param is None:
        return exc
    field = _field(exc.param, sources)
    message = exc.message.replace(f"'{exc.param}", f"'{field}")
    if exc.param.startswith("max_tokens"):
        message = message.replace("'max_tokens'", "'max_output_tokens'")
    return ApiError(exc.status, message, type_=exc.type, code=exc.code, param=field)


def _refuse_settings(given: dict[str, Any]) -> None:
    """Fields that change nothing only with the values they have by default."""
    if given.get("truncation", "disabled") != "disabled":
        raise _refuse(
            "'truncation' may only be \"disabled\": arbiterd does not drop turns to fit",
            "truncation",
            "unsupported_value",
        )
    if given.get("include", []) != []:
        raise _refuse(
            "'include' is not supported: arbiterd has no extra output to include",
            "include",
            "unsupported_value",
        )
    reasoning = given.get("reasoning", {})
    if not isinstance(reasoning, dict) or reasoning.get("summary") is not None:
        raise _refuse(
            "'reasoning' must be an object without 'summary': reasoning summaries are not served",
            "reasoning",
            "unsupported_value",
        )


def _input(value: object, origins: list[str]) -> list[dict[str, Any]]:
    """The input as chat turns: a string is one user turn; an array holds message items and
    function_call / function_call_output items. The item each turn came from is appended to
    `origins`."""
    if isinstance(value, str):
        origins.append("input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _refuse("'input' must be a string or a non-empty array of input items", "input")
    turns: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _refuse(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            turns.append(_message(where, item))
            origins.append(where)
        elif kind == "function_call":
            call = _function_call(where, item)
            last = turns[-1] if turns else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
        elif kind == "function_call_output":
            turns.append(_function_output(where, item))
            origins.append(where)
        else:
            raise _refuse(
                f"'{where}.type' is {kind!r}: arbiterd serves input items of type \"message\", "
                '"function_call" and "function_call_output"',
                f"{where}.type",
                "unsupported_value",
            )
    return turns


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise _refuse(f"'{where}.role' must be one of {', '.join(map(repr, ROLES))}", where)
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        raise _refuse(f"'{where}.content' must be a string or a non-empty array of parts", where)
    return {
        "role": role,
        "content": [_part(f"{where}.content[{i}]", p) for i, p in enumerate(content)],
    }


def _part(where: str, part: object) -> dict[str, Any]:
    """A content part as the chat parser takes it: text parts as text, images as image_url."""
    if not isinstance(part, dict):
        raise _refuse(f"'{where}' must be an object", where)
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise _refuse(f"'{where}.text' must be a string", f"{where}.text")
        return {"type": "text", "text": text}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise _refuse(
                f"'{where}.image_url' must be a URL (a data: URL, or http(s) where the model "
                "allows image URLs); file_id images are not served",
                f"{where}.image_url",
            )
        return {"type": "image_url", "image_url": {"url": url}}
    raise _refuse(
        f"'{where}.type' is {kind!r}: arbiterd serves content parts of type \"input_text\", "
        '"input_image" and "output_text"',
        f"{where}.type",
        "unsupported_value",
    )


def _function_call(where: str, item: dict[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not all(isinstance(field, str) for field in (call_id, name, arguments)):
        raise _refuse(
            f"'{where}' must be a function_call with string call_id, name and arguments", where
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_output(where: str, item: dict[str, Any]) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not isinstance(output, str):
        raise _refuse(
            f"'{where}' must be a function_call_output with string call_id and output", where
        )
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _tools(value: object) -> list[dict[str, Any]]:
    """Responses' function tools (name, parameters at the top level) in chat's spelling."""
    if not isinstance(value, list):
        raise _refuse("'tools' must be an array of function tools", "tools")
    tools = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or kind != "function":
            raise _refuse(
                f"'{where}.type' is {kind!r}: arbiterd runs only tools of type \"function\"",
                f"{where}.type",
                "unsupported_value",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: object) -> object:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _text_format(value: object) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    if value is None:
        return None
    form = value.get("format") if isinstance(value, dict) else None
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if not isinstance(form, dict) or kind not in ("text", "json_object", "json_schema"):
        raise _refuse(
            '\'text.format\' must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "name": ..., "schema": {...}}',
            "text.format",
        )
    if kind == "json_schema":
        if not isinstance(form.get("schema"), dict):
            raise _refuse(
                "'text.format.schema' must be a JSON schema (an object)", "text.format.schema"
            )
        return {"type": "json_schema", "json_schema": {"schema": form.get("schema")}}
    return {"type": kind}


# -- answers ----------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    prompt = (usage or {}).get("prompt_tokens", 0)
    completion = (usage or {}).get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if text else [],
    }


def _call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.get("id") or _new_id("call"),
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _envelope(
    response_id: str,
    model: str,
    echo: dict[str, Any],
    output: list[dict[str, Any]],
    *,
    status: str,
    usage: dict[str, Any] | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    incomplete = status == "incomplete"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "truncation": "disabled",
        "usage": _usage(usage) if usage is not None or finish_reason else None,
        **echo,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _turns_of(output: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """A response's output items as the chat turn a later request goes on from."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    elif not text:
        turn["content"] = ""
    return (turn,)


def answer(
    parsed: ResponsesRequest, completion: dict[str, Any], past: PastResponses
) -> dict[str, Any]:
    """A chat completion as the response object, remembered for previous_response_id."""
    choice = completion["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(_message_item(_new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(_new_id("fc"), call))
    response_id = _new_id("resp")
    past.remember(response_id, (*parsed.conversation, *_turns_of(output)))
    return _envelope(
        response_id,
        parsed.api.model,
        parsed.echo,
        output,
        status=_status(choice.get("finish_reason")),
        usage=completion.get("usage") or {},
        finish_reason=choice.get("finish_reason"),
    )


class _Events:
    """The numbered events of one streamed response."""

    def __init__(self) -> None:
        self._number = 0

    def __call__(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._number, **fields}
        self._number += 1
        return event


def _failed_event(
    event: _Events, response_id: str, parsed: ResponsesRequest, error: ApiError
) -> dict[str, Any]:
    """response.failed, for a stream whose chat failed with `error` (as the HTTP edge maps it):
    of the Responses API's error codes, only these two fit an error a chat ends with."""
    code = "server_error" if error.status >= 500 else "invalid_prompt"
    response = _envelope(
        response_id,
        parsed.api.model,
        parsed.echo,
        [],
        status="failed",
        usage=None,
        finish_reason=None,
    )
    return event(
        "response.failed", response={**response, "error": {"code": code, "message": error.message}}
    )


def _text_events(event: _Events, index: int, item_id: str, text: str) -> Iterator[dict[str, Any]]:
    where = {"item_id": item_id, "output_index": index, "content_index": 0}
    yield event("response.output_text.done", **where, text=text, logprobs=[])
    part = {"type": "output_text", "text": text, "annotations": []}
    yield event("response.content_part.done", **where, part=part)
    yield event("response.output_item.done", output_index=index, item=_message_item(item_id, text))


def _add_call_pieces(delta: dict[str, Any], calls: dict[int, dict[str, Any]]) -> None:
    """A chunk's pieces of tool calls added to the calls they belong to, by index."""
    for piece in delta.get("tool_calls") or []:
        call = calls.setdefault(
            piece["index"], {"id": "", "function": {"name": "", "arguments": ""}}
        )
        call["id"] = piece.get("id") or call["id"]
        function = piece.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


async def events(
    parsed: ResponsesRequest,
    chunks: AsyncIterator[dict[str, Any] | WaitNews],
    past: PastResponses,
    failed: Callable[[Exception], ApiError],
) -> AsyncIterator[dict[str, Any] | WaitNews]:
    """A streamed chat's chunks (the usage chunk last) as the Responses stream's events: the
    text as it comes, each tool call once it is whole, then response.completed; the news of a
    wait for the GPU passed on as it comes. A chat that fails on the way (the daemon shutting
    down, issue 30) ends in response.failed instead, with the error that `failed` (the HTTP
    edge's mapping) makes of it."""
    event = _Events()
    response_id = _new_id("resp")
    model = parsed.api.model

    start = _envelope(
        response_id, model, parsed.echo, [], status="in_progress", usage=None, finish_reason=None
    )
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    output: list[dict[str, Any]] = []
    text_id, text = "", ""
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] | None = None
    finish_reason = None
    try:
        async for chunk in chunks:
            if isinstance(chunk, WaitNews):
                yield chunk
                continue
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                finish_reason = choice.get("finish_reason") or finish_reason
                delta = choice.get("delta") or {}
                _add_call_pieces(delta, calls)
                if not delta.get("content"):
                    continue
                if not text_id:
                    text_id = _new_id("msg")
                    item = _message_item(text_id, "", "in_progress")
                    yield event("response.output_item.added", output_index=0, item=item)
                    part = {"type": "output_text", "text": "", "annotations": []}
                    yield event(
                        "response.content_part.added",
                        item_id=text_id,
                        output_index=0,
                        content_index=0,
                        part=part,
                    )
                text += delta["content"]
                yield event(
                    "response.output_text.delta",
                    item_id=text_id,
                    output_index=0,
                    content_index=0,
                    delta=delta["content"],
                    logprobs=[],
                )
    except Exception as exc:  # mapped by `failed`, the edge's one mapping
        yield _failed_event(event, response_id, parsed, failed(exc))
        return
    if text_id:
        for done in _text_events(event, 0, text_id, text):
            yield done
        output.append(_message_item(text_id, text))
    for key in sorted(calls):
        index = len(output)
        item = _call_item(_new_id("fc"), calls[key])
        arguments = item["arguments"]
        yield event(
            "response.output_item.added",
            output_index=index,
            item={**item, "arguments": "", "status": "in_progress"},
        )
        where = {"item_id": item["id"], "output_index": index}
        yield event("response.function_call_arguments.delta", **where, delta=arguments)
        yield event("response.function_call_arguments.done", **where, arguments=arguments)
        yield event("response.output_item.done", output_index=index, item=item)
        output.append(item)
    past.remember(response_id, (*parsed.conversation, *_turns_of(output)))
    status = _status(finish_reason)
    final = _envelope(
        response_id,
        model,
        parsed.echo,
        output,
        status=status,
        usage=usage or {},
        finish_reason=finish_reason,
    )
    yield event(f"response.{status}", response=final)
