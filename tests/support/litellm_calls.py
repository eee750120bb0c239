"""litellm's calls to a daemon, in a process of their own: `python -m tests.support.litellm_calls
URL` (the OpenAI API's, ending in /v1) or `... URL ollama` (the daemon's root, for litellm's
Ollama providers) prints what came back as one JSON object. litellm leaves an event loop and
logging threads behind in the process that imports it, which the test process must not
inherit."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ADD = {
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
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def _litellm() -> Any:
    # litellm reads its model price list from the internet at import unless told not to.
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm  # noqa: PLC0415

    return litellm


def ollama_providers(url: str) -> dict[str, Any]:
    """A completion through each of litellm's Ollama providers: `ollama/` posts /api/generate,
    `ollama_chat/` /api/chat, both with no Content-Type (issue 40)."""
    litellm = _litellm()
    answers = {
        provider: litellm.completion(
            model=f"{provider}/plain", messages=ASK, api_base=url, max_tokens=3
        )
        for provider in ("ollama", "ollama_chat")
    }
    return {
        provider: {
            "finish_reason": answer.choices[0].finish_reason,
            "completion_tokens": answer.usage.completion_tokens,
        }
        for provider, answer in answers.items()
    }


def main(url: str) -> dict[str, Any]:
    litellm = _litellm()
    common: dict[str, Any] = {"api_base": url, "api_key": "unused", "max_tokens": 150}
    called = litellm.completion(
        model="openai/tools", messages=ASK, tools=[ADD], tool_choice="required", **common
    )
    call = called.choices[0].message.tool_calls[0]
    generic = litellm.completion(
        model="openai/smollm",
        messages=ASK,
        tools=[ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        **common,
    )
    generic_call = generic.choices[0].message.tool_calls[0]
    shaped = litellm.completion(
        model="openai/plain",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        **common,
    )
    chunks = list(
        litellm.completion(
            model="openai/plain",
            messages=ASK,
            stream=True,
            stream_options={"include_usage": True},
            **{**common, "max_tokens": 3},
        )
    )
    usage = [chunk.usage for chunk in chunks if getattr(chunk, "usage", None)]
    return {
        "call": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
        "generic_call": {
            "name": generic_call.function.name,
            "arguments": json.loads(generic_call.function.arguments),
        },
        "shaped": json.loads(shaped.choices[0].message.content),
        "streamed_completion_tokens": usage[-1].completion_tokens if usage else None,
    }


if __name__ == "__main__":
    calls = ollama_providers if sys.argv[2:] == ["ollama"] else main
    print(json.dumps(calls(sys.argv[1])))
