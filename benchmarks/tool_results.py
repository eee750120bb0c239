"""Tool results on a model whose template has no place for tools (issue 47): how often the
model answers a tool's result by calling the same tool again, with the generic rendering's
closing line (arbiterd.chattemplate.ANSWER_RESULTS) and without it, in one run on one daemon.

    python -m benchmarks.tool_results [--out FILE]

A daemon (tests.support.daemon: its own config, socket, arena and journal under /tmp) serves
SmolLM2-135M-Instruct (the embedded default's chat model, whose template knows no tools) on the
CPU. Each case is a user's question, the assistant's call of a tool and the tool's result; the
model answers greedily (temperature 0, so one run says it all):

- **ours**: the request as a client sends it (`tools`, the call, the `tool` message), rendered
  by the daemon's generic tool rendering; a re-call is an answer with `tool_calls`.
- **baseline**: the same conversation rendered as before ANSWER_RESULTS closed it (the
  rendering's messages, that line taken off the results turn), sent as a plain chat; a re-call
  is an answer that is a tool call's JSON ({"name": ..., "arguments": ...}).

Reported: each case's two answers, the re-calls of each side, and whether ours re-calls less.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx

from arbiterd.chattemplate import ANSWER_RESULTS, generic_tool_messages
from arbiterd.config import smollm_model_path
from benchmarks.common import load_average, machine, report
from tests.support.daemon import serving, tiny

MODEL = "smollm"
MAX_TOKENS = 60
REQUEST_TIMEOUT_S = 120.0

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ADD = {
    "name": "add",
    "description": "Add two numbers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]
# (question, tool called, its arguments, its result)
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("What's the weather in Paris?", "get_weather", {"city": "Paris"}, "18 C, sunny"),
    ("What is 2 plus 3? Use the add tool.", "add", {"a": 2, "b": 3}, "5"),
    ("How warm is it in Tokyo right now?", "get_weather", {"city": "Tokyo"}, "25 C, cloudy"),
    (
        "Find the weather in Berlin and tell me if I need a coat.",
        "get_weather",
        {"city": "Berlin"},
        "4 C, rain",
    ),
    ("Add 40 and 2 for me.", "add", {"a": 40, "b": 2}, "42"),
    ("Is it raining in London?", "get_weather", {"city": "London"}, "11 C, light rain"),
]


# -- pure parts ---------------------------------------------------------------------------------


def conversation(question: str, tool: str, arguments: dict[str, Any], result: str) -> list[Any]:
    """A question, the assistant's call of `tool` and its result, as a client sends them."""
    function = {"name": tool, "arguments": json.dumps(arguments)}
    call = {"id": "call_1", "type": "function", "function": function}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


def without_closing_line(messages: list[Any]) -> list[Any]:
    """The generic rendering's messages as they were before ANSWER_RESULTS closed results."""
    shaped = generic_tool_messages(messages, TOOLS)
    last = shaped[-1]
    closing = "\n\n" + ANSWER_RESULTS
    if not last["content"].endswith(closing):
        raise ValueError("the results turn does not end with ANSWER_RESULTS")
    return [*shaped[:-1], {**last, "content": last["content"].removesuffix(closing)}]


def is_call_text(text: str) -> bool:
    """Whether an answer's text is a tool call in the generic rendering's shape."""
    try:
        parsed = json.loads(text.strip())
    except json.JSONDecodeError:
        return False
    calls = parsed if isinstance(parsed, list) else [parsed]
    return bool(calls) and all(isinstance(c, dict) and "name" in c for c in calls)


# -- the run ------------------------------------------------------------------------------------


def _answer(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    body = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, **body}
    answer = http.post("/chat/completions", json=body)
    answer.raise_for_status()
    message: dict[str, Any] = answer.json()["choices"][0]["message"]
    return message


def measure() -> dict[str, Any]:
    load_before = load_average()
    table = tiny(smollm_model_path(), n_ctx=2048)
    cases: list[dict[str, Any]] = []
    with (
        serving({MODEL: table}) as daemon,
        httpx.Client(base_url=daemon.url, timeout=REQUEST_TIMEOUT_S) as http,
    ):
        for question, tool, arguments, result in CASES:
            messages = conversation(question, tool, arguments, result)
            ours = _answer(http, {"messages": messages, "tools": TOOLS})
            before = _answer(http, {"messages": without_closing_line(messages)})
            cases.append(
                {
                    "question": question,
                    "ours": {
                        "recalled": bool(ours.get("tool_calls")),
                        "answer": ours.get("content") or ours.get("tool_calls"),
                    },
                    "baseline": {
                        "recalled": is_call_text(before.get("content") or ""),
                        "answer": before.get("content"),
                    },
                }
            )
    ours_recalls = sum(case["ours"]["recalled"] for case in cases)
    baseline_recalls = sum(case["baseline"]["recalled"] for case in cases)
    return {
        "benchmark": "tool_results",
        "model": Path(table["path"]).name,
        "machine": machine(load_before),
        "cases": cases,
        "recalls": {"ours": ours_recalls, "baseline": baseline_recalls, "of": len(cases)},
        "goal": {"ours_recalls_less": ours_recalls < baseline_recalls},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = measure()
    report(result, args.out)
    return 0 if result["goal"]["ours_recalls_less"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
