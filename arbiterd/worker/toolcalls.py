"""Tool calls between OpenAI's fields and a model's text: which chat templates take tools, the
JSON schema that makes a model call one, and reading the calls back out of what it wrote.

Owns the formats models write calls in. Templates that take tools (a Jinja template that reads
the `tools` variable) teach the model one of a few spellings, all a JSON object with the name
and the arguments (or "parameters"), or a list of them:
    <tool_call>{"name": ..., "arguments": {...}}</tool_call>    Hermes, Qwen 2.5/3, many others
    [TOOL_CALLS][{"name": ..., "arguments": {...}}]               Mistral
    <|python_tag|>{"name": ..., "parameters": {...}}              Llama 3.1+
    {"name": ..., "arguments": {...}}                              the bare object, at the start
(the bare object is also what arbiterd/chattemplate.py's generic rendering asks of a model whose
template has no place for tools).
A call is read only when every JSON value there is a call of a tool the request offered;
anything else stays the assistant's text. A call must start at a marker, or with the first
character of the answer: text that merely quotes JSON later on stays text.

Pure: imports neither llama_cpp nor the daemon, so it is tested on plain strings.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Where a call starts, and what may close it; in the order models use them.
START_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<function_call>")
END_MARKERS = ("</tool_call>", "</function_call>", "<|eom_id|>", "<|eot_id|>")
JSON_FENCE = "```json"
FENCE = "```"


@dataclass(frozen=True)
class ToolCall:
    """One call, as OpenAI's message carries it: the arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def template_takes_tools(template: str) -> bool:
    """Whether a Jinja chat template reads the `tools` variable (False when it does not parse:
    llama-cpp-python reports that when it renders)."""
    try:
        parsed = ImmutableSandboxedEnvironment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """A JSON schema whose instances are one call: of the tool `name`, or of any tool (OpenAI's
    tool_choice "required"). The grammar made from it lets the model write nothing else."""
    chosen = [tool for tool in tools if name is None or tool["function"]["name"] == name]
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for tool in chosen
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_calls(text: str, names: Iterable[str]) -> list[ToolCall] | None:
    """The calls `text` holds (from its start marker on, or from its start), or None when it is
    not calls of these tools."""
    known = set(names)
    rest = _strip_wrapping(text.strip())
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = _call(item, known)
            if call is None:
                return None
            calls.append(call)
        rest = _strip_wrapping(rest[end:].lstrip(" \t\r\n,;"))
    return calls or None


def _strip_wrapping(text: str) -> str:
    """`text` without the markers and code fences around and between calls."""
    changed = True
    while changed:
        changed = False
        for marker in (*START_MARKERS, *END_MARKERS, JSON_FENCE, FENCE):
            if text.startswith(marker):
                text, changed = text[len(marker) :].lstrip(), True
    return text


def _call(item: object, known: set[str]) -> ToolCall | None:
    if not isinstance(item, dict):
        return None
    function = item.get("function") if isinstance(item.get("function"), dict) else item
    assert isinstance(function, dict)
    name = function.get("name")
    arguments = function.get("arguments", function.get("parameters", {}))
    if not isinstance(name, str) or name not in known:
        return None
    if isinstance(arguments, str):  # already JSON text; it must be an object
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    identity = item.get("id")
    return ToolCall(
        id=identity if isinstance(identity, str) and identity else new_call_id(),
        name=name,
        arguments=json.dumps(arguments, ensure_ascii=False),
    )


class CallReader:
    """Splits one answer, as it streams, into the text to show at once and the part that may be
    tool calls, held back until the answer ends. `forced`: the whole answer is calls (a grammar
    made it so); without `parallel` only the first call counts."""

    def __init__(self, names: Iterable[str], *, forced: bool = False, parallel: bool = True):
        self._names = tuple(names)
        self._parallel = parallel
        self._held = ""
        self._calling = forced  # a call may have started: hold everything from here on
        self._spoke = False  # text other than whitespace has been let through

    def feed(self, text: str) -> str:
        """The text that can be shown now."""
        pending = self._held + text
        if self._calling:
            self._held = pending
            return ""
        starts = [at for at in map(pending.find, START_MARKERS) if at >= 0]
        if starts:
            at = min(starts)
            self._held, self._calling = pending[at:], True
            return pending[:at]
        if not self._spoke:
            lead = pending.lstrip()
            if not lead or JSON_FENCE.startswith(lead):
                self._held = pending  # too early to tell
                return ""
            if lead[0] in "{[" or lead.startswith(JSON_FENCE):
                self._held, self._calling = pending, True
                return ""
        keep = _marker_prefix_length(pending)
        shown, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._spoke = self._spoke or bool(shown.strip())
        return shown

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The answer's end: the text still held (when it was not calls) and the calls."""
        held, self._held = self._held, ""
        if self._calling:
            calls = parse_calls(held, self._names)
            if calls:
                return "", calls if self._parallel else calls[:1]
        return held, []


def _marker_prefix_length(text: str) -> int:
    """How many characters at the end of `text` could begin a start marker."""
    longest = 0
    for marker in START_MARKERS:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
