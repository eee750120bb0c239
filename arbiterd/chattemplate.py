"""Chat templates a config gives and tools a template has no place for: the check a
`chat_template` / `chat_template_file` passes at config load, and the generic rendering that
offers tools to a model whose template never reads them (issue 30).

The generic rendering is llama.cpp's server's for such templates, in arbiterd's call format:
the tools are described in the system turn, with the one answer shape that calls one, a JSON
object {"name": ..., "arguments": {...}} (toolcalls.call_schema, which a forced tool_choice's
grammar constrains the answer to; toolcalls.CallReader reads it back either way). Earlier
calls in the conversation become the assistant's text in that shape, and tool results a user
turn that names the tool, so templates that know only user/assistant/system still render them;
results the answer follows end by asking for that answer (ANSWER_RESULTS).

Shared and pure: imports jinja2 only, so arbiterd/config checks templates without llama.cpp and
the worker (engine/prepare.py) renders tools with the same module.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Closes tool results that the answer follows. Without it, SmolLM2-135M-Instruct called the
# same tool again after its result, 6 times of 6 (benchmarks/tool_results.py measures it).
ANSWER_RESULTS = "With these results, answer my request above in plain words."
# What a template is rendered with when it is checked: one user turn.
SAMPLE_MESSAGES = ({"role": "user", "content": "Hello"},)


class _GenerationTag(jinja2.ext.Extension):
    """Hugging Face's `{% generation %}` tag, passed through as llama-cpp-python does."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    # The settings llama-cpp-python's Jinja2ChatFormatter renders with.
    return ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )


def template_problem(template: str) -> str:
    """Why `template` cannot serve as a chat template, as one line naming the line of the
    template at fault where there is one; "" when it parses and renders a generation prompt
    (the text after the last turn that makes the model answer as the assistant)."""
    environment = _environment()
    try:
        compiled = environment.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        return f"line {exc.lineno} of the chat template does not parse: {exc.message}"

    def render(add_generation_prompt: bool) -> str:
        def raise_exception(message: str) -> str:
            raise ValueError(message)

        return compiled.render(
            messages=list(SAMPLE_MESSAGES),
            bos_token="",
            eos_token="",
            add_generation_prompt=add_generation_prompt,
            raise_exception=raise_exception,
        )

    try:
        with_prompt, without = render(True), render(False)
    except Exception as exc:  # a template's raise_exception() or any error of its own
        line = _template_line(exc)
        at = f"line {line} of " if line else ""
        return f"{at}the chat template fails to render one user turn: {exc}"
    if with_prompt == without or not with_prompt.startswith(without):
        return (
            "the chat template renders no generation prompt: with add_generation_prompt it must"
            " add the assistant's turn after the messages"
        )
    return ""


def _template_line(exc: BaseException) -> int | None:
    """The template's line an error while rendering came from (Jinja's traceback rewriting
    names it "<template>")."""
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def generic_tool_messages(messages: list[Any], tools: list[dict[str, Any]]) -> list[Any]:
    """`messages` with `tools` described in the system turn (the first message when it is a
    system message, else a new one before the others), and earlier calls and tool results as
    text the template prints whatever roles it knows."""
    described = _tools_text(tools)
    names: dict[str, str] = {}  # call id → the tool it called, to name each result
    shaped: list[Any] = []
    results_open = False  # the last turn is tool results, which the next one joins
    for message in messages:
        is_result = isinstance(message, dict) and message.get("role") == "tool"
        if not isinstance(message, dict):
            shaped.append(message)
        elif is_result and results_open:
            # Consecutive results are one turn: templates that insist on alternating user
            # and assistant turns render them.
            shaped[-1] = {
                **shaped[-1],
                "content": shaped[-1]["content"] + "\n" + _result_text(message, names),
            }
        elif is_result:
            shaped.append({"role": "user", "content": _result_text(message, names)})
        elif message.get("role") == "assistant" and message.get("tool_calls"):
            shaped.append({"role": "assistant", "content": _calls_text(message, names)})
        else:
            shaped.append(message)
        results_open = is_result
    if results_open:  # the answer comes next: to the results, not the same call again
        shaped[-1] = {**shaped[-1], "content": shaped[-1]["content"] + "\n\n" + ANSWER_RESULTS}
    first = shaped[0] if shaped else None
    if isinstance(first, dict) and first.get("role") == "system":
        content = first.get("content")
        if isinstance(content, list):
            merged: Any = [*content, {"type": "text", "text": "\n\n" + described}]
        else:
            merged = f"{content or ''}\n\n{described}".lstrip("\n")
        return [{**first, "content": merged}, *shaped[1:]]
    return [{"role": "system", "content": described}, *shaped]


def _tools_text(tools: list[dict[str, Any]]) -> str:
    functions = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "You can call these tools (one JSON description a line):\n"
        f"{functions}\n\n"
        "To call one, answer with nothing but a JSON object of this shape:\n"
        '{"name": "<the tool\'s name>", "arguments": {<its parameters>}}\n'
        "Otherwise answer as usual."
    )


def _calls_text(message: dict[str, Any], names: dict[str, str]) -> str:
    """An assistant turn's calls as the answer that makes them, each call's id noted in
    `names` with the tool it called."""
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        if isinstance(call.get("id"), str) and isinstance(function.get("name"), str):
            names[call["id"]] = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # shown as the client sent it
                arguments = json.loads(arguments)
        calls.append({"name": function.get("name"), "arguments": arguments})
    shown = calls[0] if len(calls) == 1 else calls
    content = message.get("content")
    text = json.dumps(shown, ensure_ascii=False)
    return f"{content}\n{text}" if isinstance(content, str) and content else text


def _result_text(message: dict[str, Any], names: dict[str, str]) -> str:
    """A tool result as a line naming the tool (by the call it answers) and the call's id."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    call_id = message.get("tool_call_id")
    name = message.get("name") or (names.get(call_id) if isinstance(call_id, str) else None)
    if name and call_id:
        return f"The result of {name} ({call_id}): {content or ''}"
    return f"The result of {name or call_id or 'the tool'}: {content or ''}"
