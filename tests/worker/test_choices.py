"""One choice from text chunks to OpenAI's chat and completion chunks, on plain dicts."""

from __future__ import annotations

import json
from typing import Any

from arbiterd.states import RequestKind
from arbiterd.worker.choices import Choice, TokenLogprob
from arbiterd.worker.toolcalls import CallReader


def text_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "tiny",
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
    }


def run(choice: Choice, pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    out = []
    for piece in pieces:
        out += choice.convert(text_chunk(piece))
    out += choice.convert(text_chunk("", finish))
    return out


def deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [chunk["choices"][0]["delta"] for chunk in chunks]


def test_a_chat_answer_streams_its_role_then_its_text() -> None:
    choice = Choice(RequestKind.CHAT, 0)
    chunks = run(choice, ["Hel", "lo"])
    assert deltas(chunks) == [{"role": "assistant"}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert choice.result() == {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": "Hello"},
        "logprobs": None,
    }


def test_a_call_becomes_the_deltas_the_openai_sdk_accumulates() -> None:
    choice = Choice(RequestKind.CHAT, 2, calls=CallReader(["add"]))
    chunks = run(choice, ["<tool_call>", '{"name": "add", "arguments": {"a": 1}}', "</tool_call>"])
    opened, filled = deltas(chunks)[1:3]
    call = opened["tool_calls"][0]
    assert call["index"] == 0
    assert call["id"].startswith("call_")
    assert call["type"] == "function"
    assert call["function"] == {"name": "add", "arguments": ""}
    assert filled == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert {chunk["choices"][0]["index"] for chunk in chunks} == {2}
    message = choice.result()["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": call["id"], "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    ]


def test_text_before_a_call_is_kept() -> None:
    choice = Choice(RequestKind.CHAT, 0, calls=CallReader(["add"]))
    run(choice, ["Sure. ", '<tool_call>{"name": "add", "arguments": {}}'])
    message = choice.result()["message"]
    assert message["content"] == "Sure. "
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["add"]


def test_chat_logprobs_ride_on_the_chunk_of_their_token() -> None:
    recorded: list[TokenLogprob] = []
    choice = Choice(RequestKind.CHAT, 0, logprobs=recorded)
    first = choice.convert(text_chunk("Hi"))  # the role chunk, then the text
    recorded.append(TokenLogprob(b"Hi", -0.5, ((b"Hi", -0.5), (b"Yo", -1.5))))
    second = choice.convert(text_chunk("!"))
    assert first[0]["choices"][0]["logprobs"] == {"content": [], "refusal": None}
    assert second[0]["choices"][0]["logprobs"]["content"] == [
        {
            "token": "Hi",
            "logprob": -0.5,
            "bytes": [72, 105],
            "top_logprobs": [
                {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]},
            ],
        }
    ]
    recorded.append(TokenLogprob(b"!", -0.25, ()))
    choice.convert(text_chunk("", "stop"))
    tokens = [entry["token"] for entry in choice.result()["logprobs"]["content"]]
    assert tokens == ["Hi", "!"]


def test_completion_logprobs_have_tokens_and_offsets() -> None:
    recorded: list[TokenLogprob] = []
    choice = Choice(RequestKind.COMPLETION, 0, logprobs=recorded)
    recorded += [TokenLogprob(b"ab", -1.0, ((b"ab", -1.0),)), TokenLogprob(b"c", -2.0, ())]
    chunk = choice.convert(text_chunk("abc"))[0]
    recorded.append(TokenLogprob(b"d", -3.0, ()))
    later = choice.convert(text_chunk("d", "length"))[0]
    assert chunk["choices"][0]["logprobs"] == {
        "tokens": ["ab", "c"],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"ab": -1.0}, {}],
        "text_offset": [0, 2],
    }
    assert later["choices"][0]["logprobs"]["text_offset"] == [3]
    whole = choice.result()
    assert whole["text"] == "abcd"
    assert whole["finish_reason"] == "length"
    assert whole["logprobs"]["text_offset"] == [0, 2, 3]


def test_a_broken_token_is_shown_replaced_with_its_bytes_kept() -> None:
    recorded = [TokenLogprob("é".encode()[:1], -1.0, ())]
    choice = Choice(RequestKind.CHAT, 0, logprobs=recorded)
    run(choice, ["x"])
    entry = choice.result()["logprobs"]["content"][0]
    assert entry["bytes"] == [0xC3]
    assert json.dumps(entry["token"])  # a valid string, the bytes alone say what it was
