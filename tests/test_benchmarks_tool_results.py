"""benchmarks/tool_results: its pure parts (the conversation a client sends, the rendering
before ANSWER_RESULTS, what counts as a re-call) and its --help."""

from __future__ import annotations

import json

from arbiterd.chattemplate import ANSWER_RESULTS, generic_tool_messages
from benchmarks.tool_results import TOOLS, conversation, is_call_text, without_closing_line
from tests.support.benchmark_help import benchmark_help


def test_the_baseline_is_the_rendering_without_its_closing_line() -> None:
    messages = conversation("What is 2 plus 3?", "add", {"a": 2, "b": 3}, "5")
    ours = generic_tool_messages(messages, TOOLS)
    before = without_closing_line(messages)
    assert ours[:-1] == before[:-1]
    assert ours[-1]["content"] == before[-1]["content"] + "\n\n" + ANSWER_RESULTS
    assert before[-1]["content"] == "The result of add (call_1): 5"


def test_a_re_call_is_an_answer_that_is_a_calls_json() -> None:
    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert is_call_text(json.dumps(call))
    assert is_call_text(" " + json.dumps([call, call]) + "\n")
    assert not is_call_text("The result of add is 5.")
    assert not is_call_text('{"answer": 5}')
    assert not is_call_text("[]")


def test_help_names_its_options() -> None:
    assert "--out" in benchmark_help("tool_results")
