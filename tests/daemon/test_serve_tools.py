"""A real daemon (issue 30): a config's chat_template is the one its chats are rendered with
and the one /api/show names, a model whose template has no place for tools makes a forced
call through the generic rendering, whole and streamed, and a bad template stops the daemon
before it starts, naming the model and the line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, serving, tiny

# The tiny model's own template wraps each turn in "<|role|>" markers; this one puts a long
# preamble first, which the prompt's token count shows.
PREAMBLE = "This preamble comes from the config's template. " * 4
BRACKETS = (
    PREAMBLE + "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    with serving(
        {"plain": tiny(tiny_model), "brackets": tiny(tiny_model, chat_template=BRACKETS)}
    ) as running:
        running.wait_ready()
        yield running


def _post(daemon: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(daemon.url.removesuffix("/v1") + path, json=body, timeout=60)


def test_the_configs_template_renders_the_chats_and_is_shown(daemon: Daemon) -> None:
    shown = _post(daemon, "/api/show", {"model": "brackets"}).json()
    assert shown["template"] == BRACKETS
    assert _post(daemon, "/api/show", {"model": "plain"}).json()["template"] != BRACKETS
    # The same chat, rendered by each template: the preamble is in one prompt only.
    counts = {}
    for model in ("plain", "brackets"):
        body = {"model": model, "messages": ASK, "max_tokens": 1}
        answer = _post(daemon, "/v1/chat/completions", body).json()
        counts[model] = answer["usage"]["prompt_tokens"]
    assert counts["brackets"] > counts["plain"] + len(PREAMBLE) // 4


def test_a_forced_call_on_a_template_without_tools_comes_back_whole_and_streamed(
    daemon: Daemon,
) -> None:
    body = {
        "model": "plain",
        "messages": ASK,
        "tools": [ADD],
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "max_tokens": 200,
    }
    whole = _post(daemon, "/v1/chat/completions", body).json()
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    assert set(json.loads(call["function"]["arguments"])) == {"a", "b"}
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    names = []
    with httpx.stream(
        "POST", daemon.url + "/chat/completions", json={**body, "stream": True}, timeout=60
    ) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: {"):
                for delta_call in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls", []):
                    names.append(delta_call.get("function", {}).get("name"))
    assert "add" in names


def test_a_template_that_does_not_parse_stops_the_daemon_naming_model_and_line(
    tmp_path: Path, tiny_model: Path
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f'[models.broken]\npath = "{tiny_model}"\n'
        "chat_template = '''{% for m in messages %}\n{{ m.content }'''\n",
        encoding="utf-8",
    )
    ran = subprocess.run(
        [sys.executable, "-m", "arbiterd", "daemon", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode != 0
    assert "models.broken.chat_template: line 2 of the chat template does not parse" in ran.stderr
