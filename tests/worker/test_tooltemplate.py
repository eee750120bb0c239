"""Tools on a model whose chat template has no place for them, and a chat template from the
config instead of the GGUF's (issue 30): the pure renderings on plain data, then what the
engine renders on real llama.cpp (CPU) with the tiny model, whose template knows no tools."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiterd.chattemplate import ANSWER_RESULTS, generic_tool_messages, template_problem
from arbiterd.errors import RequestError
from arbiterd.request import Tool, ToolChoice
from arbiterd.spec import Capability, ModelSpec, capabilities
from arbiterd.worker.engine import ReloadBackend
from tests.support.requests import request_for
from tests.support.tiny_gguf import CHAT_TEMPLATE

WEATHER = Tool(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
)
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
CALLED: list[dict[str, Any]] = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
]


# -- the generic rendering, on plain data -----------------------------------------------------


def test_the_tools_go_in_a_system_turn_of_their_own_before_the_others() -> None:
    shaped = generic_tool_messages(list(ASK), [WEATHER.template_form()])
    assert shaped[0]["role"] == "system"
    assert json.dumps(WEATHER.template_form()["function"]) in shaped[0]["content"]
    assert '{"name": ' in shaped[0]["content"]  # the answer shape that calls one
    assert shaped[1:] == ASK


def test_the_tools_join_the_system_turn_the_request_has() -> None:
    shaped = generic_tool_messages(
        [{"role": "system", "content": "Be brief."}, *ASK], [WEATHER.template_form()]
    )
    assert len(shaped) == 2
    assert shaped[0]["content"].startswith("Be brief.\n\n")
    assert "get_weather" in shaped[0]["content"]


def test_earlier_calls_and_results_become_turns_any_template_renders() -> None:
    shaped = generic_tool_messages(CALLED, [WEATHER.template_form()])
    assert [m["role"] for m in shaped] == ["system", "user", "assistant", "user"]
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert json.loads(shaped[2]["content"]) == call
    # Two results in a row are one user turn: templates that make roles alternate render it.
    # The answer follows them: they end by asking for it (not for the same call again).
    assert shaped[3]["content"] == (
        "The result of get_weather (call_1): sunny\nThe result of get_weather (call_1): 12 C"
        f"\n\n{ANSWER_RESULTS}"
    )


def test_only_the_results_the_answer_follows_ask_for_it() -> None:
    later = [*CALLED, {"role": "assistant", "content": "Sunny, 12 C."}, *ASK]
    shaped = generic_tool_messages(later, [WEATHER.template_form()])
    assert [m["role"] for m in shaped] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert ANSWER_RESULTS not in json.dumps(shaped)


# -- checking a template from the config ------------------------------------------------------


def test_a_template_that_parses_and_prompts_the_assistant_passes() -> None:
    assert template_problem(CHAT_TEMPLATE) == ""


def test_a_template_that_does_not_parse_is_named_by_its_line() -> None:
    problem = template_problem("{{ bos_token }}\n{% for m in messages %}\n{{ m.content }")
    assert problem.startswith("line 3 of the chat template does not parse")


def test_a_template_without_a_generation_prompt_is_refused() -> None:
    problem = template_problem("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert "renders no generation prompt" in problem


def test_a_template_that_raises_on_one_user_turn_is_refused_with_its_line() -> None:
    template = "{% if add_generation_prompt %}x{% endif %}\n{{ raise_exception('no users') }}"
    problem = template_problem(template)
    assert problem.startswith("line 2 of the chat template fails to render")
    assert "no users" in problem


def test_capabilities_follow_the_template_the_config_and_the_kind() -> None:
    spec = ModelSpec(name="m", path=Path("m.gguf"))
    assert capabilities(spec, has_chat_template=True) == (
        Capability.COMPLETION,
        Capability.CHAT,
        Capability.TOOLS,
    )
    assert capabilities(spec, has_chat_template=False) == (Capability.COMPLETION,)
    refused = ModelSpec(name="m", path=Path("m.gguf"), tools=False, mmproj=Path("p.gguf"))
    assert capabilities(refused, has_chat_template=True) == (
        Capability.COMPLETION,
        Capability.CHAT,
        Capability.VISION,
    )
    embeds = ModelSpec(name="m", path=Path("m.gguf"), embedding=True)
    assert capabilities(embeds, has_chat_template=True) == (Capability.EMBEDDING,)


# -- on the engine ----------------------------------------------------------------------------


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[ReloadBackend]:
    backend = ReloadBackend(ModelSpec(name="plain", path=tiny_model, n_ctx=1024, n_gpu_layers=0))
    backend.load()
    try:
        yield backend
    finally:
        backend.close()


def _prompt(backend: ReloadBackend, body: dict[str, Any]) -> str:
    prepared = backend.prepare(request_for("chat", body), lambda: False)
    return backend._require_llm().detokenize(prepared.prompt_tokens).decode()


def test_a_template_without_tools_gets_them_in_the_system_turn(engine: ReloadBackend) -> None:
    prompt = _prompt(engine, {"messages": CALLED, "tools": [WEATHER]})
    assert prompt.index("<|system|>") < prompt.index("get_weather") < prompt.index("<|user|>")
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt  # the call
    assert "The result of get_weather (call_1): sunny" in prompt
    assert engine.capabilities() == (Capability.COMPLETION, Capability.CHAT, Capability.TOOLS)


def test_a_forced_call_on_such_a_template_is_made_by_the_grammar(engine: ReloadBackend) -> None:
    prepared = engine.prepare(
        request_for(
            "chat", {"messages": ASK, "tools": [WEATHER], "tool_choice": ToolChoice.REQUIRED}
        ),
        lambda: False,
    )
    assert prepared.forced_call
    assert prepared.completion["grammar"] is not None


@pytest.mark.parametrize("choice", [ToolChoice.AUTO, ToolChoice.REQUIRED])
@pytest.mark.parametrize(
    "parameters",
    [{"type": "odd"}, {"type": "object", "properties": {"a\fb": {"type": "string"}}}],
    ids=["unknown-type", "unparsable-grammar"],
)
def test_a_tool_whose_parameters_cannot_be_followed_is_refused_by_name(
    engine: ReloadBackend, choice: ToolChoice, parameters: dict[str, Any]
) -> None:
    # docs/security.md cites this check (issue 24); it went with the refusing template of the
    # tests before issue 30 and lives here, where tools reach the model.
    broken = Tool(name="broken", parameters=parameters)
    body = {"messages": ASK, "tools": [WEATHER, broken], "tool_choice": choice}
    with pytest.raises(RequestError, match=r"tool 'broken''s parameters cannot be followed"):
        engine.prepare(request_for("chat", body), lambda: False)


def test_a_model_whose_config_refuses_tools_refuses_them(tiny_model: Path) -> None:
    spec = ModelSpec(name="plain", path=tiny_model, n_ctx=512, n_gpu_layers=0, tools=False)
    backend = ReloadBackend(spec)
    backend.load()
    try:
        with pytest.raises(RequestError, match=r'plain cannot be offered tools: .*"refuse"'):
            backend.prepare(
                request_for("chat", {"messages": ASK, "tools": [WEATHER]}), lambda: False
            )
        assert Capability.TOOLS not in backend.capabilities()
    finally:
        backend.close()


def test_a_template_from_the_config_replaces_the_ggufs(tiny_model: Path) -> None:
    template = (
        "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[ANSWER]{% endif %}"
    )
    spec = ModelSpec(
        name="plain", path=tiny_model, n_ctx=512, n_gpu_layers=0, chat_template=template
    )
    backend = ReloadBackend(spec)
    backend.load()
    try:
        prompt = _prompt(backend, {"messages": ASK})
        assert "[USER] What is the weather in Oslo?\n[ANSWER]" in prompt
        assert "<|user|>" not in prompt  # the GGUF's template is not used
        info = backend.model_info()
        assert info is not None
        assert info.chat_template == template
    finally:
        backend.close()


# gemma-3's rules, in short: a system turn is folded into the first user turn, user and model
# turns must alternate, and there is no tool role.
ALTERNATING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ first if loop.first else '' }}{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_a_template_whose_roles_must_alternate_renders_a_history_of_calls(
    tiny_model: Path,
) -> None:
    spec = ModelSpec(
        name="alternating",
        path=tiny_model,
        n_ctx=2048,  # the tiny vocabulary spells JSON a byte a token
        n_gpu_layers=0,
        chat_template=ALTERNATING_TEMPLATE,
    )
    backend = ReloadBackend(spec)
    backend.load()
    try:
        prompt = _prompt(backend, {"messages": CALLED, "tools": [WEATHER]})
        assert prompt.count("<start_of_turn>user") == 2  # both results in one user turn
        assert prompt.index("get_weather") < prompt.index("What is the weather in Oslo?")
        assert prompt.endswith("<start_of_turn>model\n")
    finally:
        backend.close()
