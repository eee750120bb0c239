"""One choice of a completion, from llama-cpp-python's text chunks to what OpenAI clients read:
chat chunks (the role, the text, tool-call deltas, the finish reason) or completion chunks,
each with the log-probabilities of the tokens it carries, and the whole choice at the end.

Owns the shape of a choice in streams and responses. The engine feeds it the text chunks of one
decoded sequence, shaped as llama-cpp-python's, and the log-probabilities of their tokens.
Pure: no llama_cpp, so it is tested on plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from arbiterd.states import RequestKind
from arbiterd.worker.toolcalls import CallReader, ToolCall


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token: its bytes, its log-probability under the model, and the most likely
    tokens at its place (bytes, log-probability), most likely first."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...]


def _text(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")


class Choice:
    """One choice: `convert` each text chunk as it comes, `result` at the end. `logprobs` is the
    list the sampler appends to (None: not asked for); `calls` reads tool calls out of a chat
    answer (None: the request offered no tools)."""

    def __init__(
        self,
        kind: RequestKind,
        index: int,
        *,
        calls: CallReader | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        self.kind = kind
        self.index = index
        self.finish_reason: str | None = None
        self.tool_calls: list[ToolCall] = []
        self._calls = calls
        self._recorded = logprobs
        self._reported: list[TokenLogprob] = []
        self._pieces: list[str] = []
        self._started = False

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def convert(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks to send for one of llama-cpp-python's text-completion chunks."""
        given = chunk["choices"][0]
        finish = given.get("finish_reason")
        text = given.get("text") or ""
        if self.kind is RequestKind.COMPLETION:
            self._pieces.append(text)
            if finish is not None:
                self.finish_reason = finish
            return [self._completion_chunk(chunk, text, finish)]
        out = []
        if not self._started:
            self._started = True
            out.append(self._chat_chunk(chunk, {"role": "assistant"}, None, logprobs=False))
        shown = self._calls.feed(text) if self._calls is not None else text
        if shown:
            self._pieces.append(shown)
            out.append(self._chat_chunk(chunk, {"content": shown}, None))
        if finish is None:
            return out
        if self._calls is not None:
            rest, self.tool_calls = self._calls.finish()
            if rest:
                self._pieces.append(rest)
                out.append(self._chat_chunk(chunk, {"content": rest}, None))
            for position, call in enumerate(self.tool_calls):
                opened = {**call.to_json(), "index": position}
                opened["function"] = {"name": call.name, "arguments": ""}
                out.append(self._chat_chunk(chunk, {"tool_calls": [opened]}, None))
                filled = {"index": position, "function": {"arguments": call.arguments}}
                out.append(self._chat_chunk(chunk, {"tool_calls": [filled]}, None))
        self.finish_reason = "tool_calls" if self.tool_calls else finish
        out.append(self._chat_chunk(chunk, {}, self.finish_reason))
        return out

    def result(self) -> dict[str, Any]:
        """The choice in a response that is not streamed."""
        self._take_logprobs()  # any the last chunk did not carry
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason}
        if self.kind is RequestKind.CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": self.text}
            if self.tool_calls:
                message["content"] = self.text or None
                message["tool_calls"] = [call.to_json() for call in self.tool_calls]
            choice["message"] = message
        else:
            choice["text"] = self.text
        choice["logprobs"] = None if self._recorded is None else self._logprobs(self._reported)
        return choice

    def _chat_chunk(
        self,
        chunk: dict[str, Any],
        delta: dict[str, Any],
        finish: str | None,
        *,
        logprobs: bool = True,
    ) -> dict[str, Any]:
        entries = self._take_logprobs() if logprobs else []
        return {
            "id": "chat" + chunk["id"],
            "object": "chat.completion.chunk",
            "created": chunk["created"],
            "model": chunk["model"],
            "choices": [
                {
                    "index": self.index,
                    "delta": delta,
                    "logprobs": None if self._recorded is None else self._logprobs(entries),
                    "finish_reason": finish,
                }
            ],
        }

    def _completion_chunk(
        self, chunk: dict[str, Any], text: str, finish: str | None
    ) -> dict[str, Any]:
        entries = self._take_logprobs()
        return {
            "id": chunk["id"],
            "object": "text_completion",
            "created": chunk["created"],
            "model": chunk["model"],
            "choices": [
                {
                    "index": self.index,
                    "text": text,
                    "logprobs": None if self._recorded is None else self._logprobs(entries),
                    "finish_reason": finish,
                }
            ],
        }

    def _take_logprobs(self) -> list[TokenLogprob]:
        if not self._recorded:
            return []
        taken = self._recorded[:]
        del self._recorded[:]
        self._reported += taken
        return taken

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        if self.kind is RequestKind.CHAT:
            return {
                "content": [
                    {
                        "token": _text(entry.token),
                        "logprob": entry.logprob,
                        "bytes": list(entry.token),
                        "top_logprobs": [
                            {"token": _text(token), "logprob": logprob, "bytes": list(token)}
                            for token, logprob in entry.top
                        ],
                    }
                    for entry in entries
                ],
                "refusal": None,
            }
        before = self._reported[: len(self._reported) - len(entries)]
        offsets, at = [], sum(len(_text(entry.token)) for entry in before)
        for entry in entries:
            offsets.append(at)
            at += len(_text(entry.token))
        return {
            "tokens": [_text(entry.token) for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{_text(t): lp for t, lp in entry.top} for entry in entries],
            "text_offset": offsets,
        }
