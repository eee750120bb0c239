"""The Responses API's mapping (daemon/http/responses.py): bodies to the chat request the daemon
runs, chat answers and chunks to response objects and stream events, and the bounded memory of
past responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from arbiterd.daemon.http.openai_requests import ApiError
from arbiterd.daemon.http.responses import (
    PastResponses,
    answer,
    events,
    parse_responses_request,
    text_bytes,
)
from arbiterd.request import ToolChoice
from arbiterd.spec import IMAGE_MARKER

ADD = {
    "type": "function",
    "name": "add",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
}
PNG = "data:image/png;base64,iVBORw0KGgo="


def _completion(content: str | None, finish: str = "stop", calls: list[Any] | None = None) -> Any:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    }


def unexpected(exc: Exception) -> ApiError:
    raise AssertionError(f"no error expected, got {exc!r}")


def test_a_string_input_and_instructions_are_a_system_and_a_user_turn() -> None:
    parsed = parse_responses_request(
        {
            "model": "m",
            "input": "hi",
            "instructions": "Be brief.",
            "max_output_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
        },
        PastResponses(),
    )
    request = parsed.api.request
    assert request.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    )
    assert request.sampling.max_tokens == 9
    assert request.sampling.temperature == 0.5
    assert request.sampling.top_p == 0.9
    assert parsed.conversation == ({"role": "user", "content": "hi"},)


def test_message_items_take_text_and_image_parts() -> None:
    content = [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": PNG},
    ]
    parsed = parse_responses_request(
        {"model": "m", "input": [{"type": "message", "role": "user", "content": content}]},
        PastResponses(),
    )
    assert parsed.api.image_urls == (("input[0].content[1]", PNG),)


def test_function_calls_and_their_outputs_are_an_assistant_turn_and_tool_turns() -> None:
    items = [
        {"role": "user", "content": "add"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":1}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a":2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ]
    parsed = parse_responses_request(
        {
            "model": "m",
            "input": items,
            "tools": [ADD],
            "tool_choice": {"type": "function", "name": "add"},
        },
        PastResponses(),
    )
    request = parsed.api.request
    assistant, tool = request.messages[1], request.messages[2]
    assert [call["id"] for call in assistant["tool_calls"]] == ["c1", "c2"]
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "1"}
    assert [t.name for t in request.tools] == ["add"]
    assert request.tool_choice is ToolChoice.FUNCTION


@pytest.mark.parametrize(
    ("items", "named"),
    [
        ([{"type": "reasoning", "id": "r"}], "'reasoning'"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "'input_file'"),
    ],
)
def test_an_item_or_part_type_not_served_is_a_400_naming_it(items: list[Any], named: str) -> None:
    with pytest.raises(ApiError, match=named) as refused:
        parse_responses_request({"model": "m", "input": items}, PastResponses())
    assert refused.value.status == 400


def test_a_chat_check_names_the_responses_field() -> None:
    with pytest.raises(ApiError, match="'max_output_tokens'") as refused:
        parse_responses_request(
            {"model": "m", "input": "x", "max_output_tokens": 0}, PastResponses()
        )
    assert refused.value.param == "max_output_tokens"


def test_previous_response_id_goes_on_from_the_remembered_conversation() -> None:
    past = PastResponses()
    first = parse_responses_request({"model": "m", "input": "hi"}, past)
    made = answer(first, _completion("hello"), past)
    second = parse_responses_request(
        {"model": "m", "input": "again", "previous_response_id": made["id"]}, past
    )
    assert second.api.request.messages == (
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    )


def test_past_responses_are_bounded_and_an_unknown_one_is_404() -> None:
    past = PastResponses(limit=2)
    for name in ("a", "b", "c"):
        past.remember(name, ({"role": "user", "content": name},))
    assert past.turns("c") == ({"role": "user", "content": "c"},)
    with pytest.raises(ApiError, match="'a' not found") as missing:
        past.turns("a")
    assert missing.value.status == 404


def test_a_conversation_counts_the_utf8_bytes_of_its_strings() -> None:
    turns = ({"role": "user", "content": [{"type": "text", "text": "h\u00e9"}]},)
    assert text_bytes(turns) == len("role") + len("user") + len("content") + len("type") + len(
        "text"
    ) + len("text") + len("h\u00e9".encode())


def test_an_answer_has_its_items_usage_and_status() -> None:
    parsed = parse_responses_request({"model": "m", "input": "x", "tools": [ADD]}, PastResponses())
    call = {"id": "c9", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    made = answer(parsed, _completion(None, "tool_calls", [call]), PastResponses())
    assert [item["type"] for item in made["output"]] == ["function_call"]
    assert made["output"][0]["call_id"] == "c9"
    assert made["usage"]["input_tokens"] == 12
    assert made["usage"]["output_tokens"] == 3
    assert made["usage"]["total_tokens"] == 15
    assert made["status"] == "completed"
    cut = answer(parsed, _completion("abc", "length"), PastResponses())
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_streamed_chunks_become_numbered_events_ending_in_the_whole_response() -> None:
    parsed = parse_responses_request({"model": "m", "input": "x"}, PastResponses())

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        for piece in ("Hel", "lo"):
            yield {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
        yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        yield {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}

    async def collect() -> list[dict[str, Any]]:
        streamed = [event async for event in events(parsed, chunks(), PastResponses(), unexpected)]
        return [event for event in streamed if isinstance(event, dict)]

    streamed = asyncio.run(collect())
    assert [event["sequence_number"] for event in streamed] == list(range(len(streamed)))
    assert [event["type"] for event in streamed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = streamed[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["output_tokens"] == 2
    assert final["id"] == streamed[0]["response"]["id"]


@pytest.mark.parametrize(
    ("status", "code"), [(503, "server_error"), (400, "invalid_prompt")], ids=["server", "request"]
)
def test_a_chat_that_fails_on_the_way_ends_in_response_failed(status: int, code: str) -> None:
    parsed = parse_responses_request({"model": "m", "input": "x"}, PastResponses())

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        yield {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
        raise RuntimeError("the daemon is shutting down")

    def failed(exc: Exception) -> ApiError:
        return ApiError(status, f"mapped: {exc}")

    async def collect() -> list[dict[str, Any]]:
        streamed = [event async for event in events(parsed, chunks(), PastResponses(), failed)]
        return [event for event in streamed if isinstance(event, dict)]

    streamed = asyncio.run(collect())
    assert [event["sequence_number"] for event in streamed] == list(range(len(streamed)))
    assert [event["type"] for event in streamed][-2:] == [
        "response.output_text.delta",
        "response.failed",
    ]
    response = streamed[-1]["response"]
    assert response["status"] == "failed"
    assert response["error"] == {"code": code, "message": "mapped: the daemon is shutting down"}
    assert response["id"] == streamed[0]["response"]["id"]


def test_an_error_names_the_input_item_not_the_chat_turn() -> None:
    # Turn 0 is the instructions and the two calls are one turn: the text is input[2]'s.
    items = [
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
        {"role": "user", "content": [{"type": "input_text", "text": IMAGE_MARKER}]},
    ]
    with pytest.raises(ApiError, match=r"'input\[2\]\.content\[0\]\.text'") as refused:
        parse_responses_request(
            {"model": "m", "instructions": "sys", "input": items}, PastResponses()
        )
    assert refused.value.param == "input[2].content[0].text"
