"""Reading tool calls out of model text, on plain strings, in every spelling models use."""

from __future__ import annotations

import json

import pytest

from arbiterd.worker.toolcalls import (
    CallReader,
    call_schema,
    parse_calls,
    template_takes_tools,
)
from tests.support.tiny_gguf import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE

NAMES = ("get_weather", "add")


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```',
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',
        '{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}',
    ],
)
def test_each_spelling_of_a_call_is_read(text: str) -> None:
    calls = parse_calls(text, NAMES)
    assert calls is not None
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert calls[0].id.startswith("call_")


def test_several_calls_are_read_in_order() -> None:
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    calls = parse_calls(text, NAMES)
    assert calls is not None
    assert [call.name for call in calls] == ["add", "get_weather"]
    assert len({call.id for call in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "delete_everything", "arguments": {}}',  # a tool the request did not offer
        '{"name": "add", "arguments": [1, 2]}',  # arguments that are not an object
        '{"name": "add", "arguments": {"a": 1}',  # cut short
        '{"answer": 42}',  # JSON, but no call
        '{"name": "add", "arguments": {}} and then some prose',
        "",
    ],
)
def test_what_is_not_calls_of_these_tools_is_not_read_as_calls(text: str) -> None:
    assert parse_calls(text, NAMES) is None


def feed_all(reader: CallReader, pieces: list[str]) -> str:
    return "".join(reader.feed(piece) for piece in pieces)


def test_text_streams_at_once_and_a_call_after_it_is_held() -> None:
    reader = CallReader(NAMES)
    pieces = [
        "Let me ",
        "check.",
        " <tool",
        '_call>{"name": "add", ',
        '"arguments": {"a": 1, "b": 2}}',
    ]
    shown = feed_all(reader, [*pieces, "</tool_call>"])
    assert shown == "Let me check. "
    rest, calls = reader.finish()
    assert rest == ""
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("add", {"a": 1, "b": 2})
    ]


def test_text_that_only_looks_like_a_marker_is_let_through_at_the_end() -> None:
    reader = CallReader(NAMES)
    shown = feed_all(reader, ["a <to", "ol and more"])
    assert shown == "a <tool and more"
    assert reader.finish() == ("", [])


def test_an_answer_that_starts_with_json_but_is_no_call_comes_back_as_text() -> None:
    reader = CallReader(NAMES)
    assert feed_all(reader, ["  {", '"answer": 42}']) == ""
    assert reader.finish() == ('  {"answer": 42}', [])


def test_json_quoted_later_in_an_answer_streams_as_text() -> None:
    reader = CallReader(NAMES)
    text = 'The call looks like {"name": "add", "arguments": {}}.'
    assert feed_all(reader, [text]) == text
    assert reader.finish() == ("", [])


def test_a_code_fence_that_is_not_json_streams_as_text() -> None:
    reader = CallReader(NAMES)
    assert feed_all(reader, ["``", "`python\nprint(1)\n```"]) == "```python\nprint(1)\n```"


def test_a_forced_answer_is_held_whole_and_read_as_calls() -> None:
    reader = CallReader(NAMES, forced=True)
    assert feed_all(reader, ['{"name": "add",', ' "arguments": {"a": 1, "b": 2}}']) == ""
    _, calls = reader.finish()
    assert [call.name for call in calls] == ["add"]


def test_without_parallel_calls_only_the_first_counts() -> None:
    reader = CallReader(NAMES, parallel=False)
    feed_all(
        reader, ['[{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {}}]']
    )
    _, calls = reader.finish()
    assert [call.name for call in calls] == ["add"]


def test_templates_that_read_tools_are_told_apart() -> None:
    assert template_takes_tools(TOOLS_CHAT_TEMPLATE)
    assert not template_takes_tools(CHAT_TEMPLATE)
    assert not template_takes_tools("{% if tools %}")  # does not parse


def test_the_call_schema_names_the_tool_and_holds_its_parameters() -> None:
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [
        {"type": "function", "function": {"name": "add", "parameters": parameters}},
        {"type": "function", "function": {"name": "now"}},
    ]
    one = call_schema(tools, "add")
    assert one["properties"] == {"name": {"const": "add"}, "arguments": parameters}
    assert one["required"] == ["name", "arguments"]
    either = call_schema(tools, None)
    assert [option["properties"]["name"]["const"] for option in either["anyOf"]] == ["add", "now"]
    assert either["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
