"""Fill-in-the-middle end to end (issue 47 item 1): a completion with a `suffix`, through a real
daemon and the openai SDK, on the tiny llama made a code model (its GGUF names FIM tokens), as a
coding assistant sends one on every keystroke: streamed and not, each keystroke's request
cancelling the last, the prompt cache reused by the next; a model without FIM tokens answers a
400 naming what it lacks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.waiting import wait_until

CODE = "def add(a, b):\n    return"
AFTER = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def daemon(tiny_fim_model: Path, tiny_model: Path) -> Iterator[Daemon]:
    models = {"coder": tiny(tiny_fim_model), "plain": tiny(tiny_model)}
    with serving(models) as running:
        yield running


def requests(daemon: Daemon, model: str) -> list[dict[str, Any]]:
    with daemon.client() as client:
        found = client.call("events", limit=500)["events"]
    return [e for e in found if e["event"] == "request" and e["model"] == model]


def test_a_code_model_says_it_fills_in_the_middle(daemon: Daemon) -> None:
    with daemon.client() as client:
        models = {m["name"]: m for m in client.call("status")["models"]}
    assert "fim" in models["coder"]["capabilities"]
    assert "fim" not in models["plain"]["capabilities"]


def test_a_completion_with_a_suffix_fills_in_the_middle(daemon: Daemon) -> None:
    api = openai_client(daemon)
    filled = api.completions.create(
        model="coder", prompt=CODE, suffix=AFTER, max_tokens=6, temperature=0
    )
    plain = api.completions.create(model="coder", prompt=CODE, max_tokens=6, temperature=0)
    assert filled.choices[0].text
    # The prompt holds the suffix and the three FIM tokens: more tokens than the code alone.
    assert filled.usage is not None
    assert plain.usage is not None
    assert filled.usage.prompt_tokens > plain.usage.prompt_tokens + 3
    streamed = api.completions.create(
        model="coder", prompt=CODE, suffix=AFTER, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == filled.choices[0].text


def test_a_model_without_fim_tokens_answers_400_naming_them(daemon: Daemon) -> None:
    api = openai_client(daemon)
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="plain", prompt=CODE, suffix=AFTER, max_tokens=4)
    assert "no fill-in-the-middle tokens" in str(refused.value)
    # An empty suffix is no suffix, as OpenAI's: completed as before.
    done = api.completions.create(model="plain", prompt=CODE, suffix="", max_tokens=2)
    assert done.choices[0].text is not None


def test_keystrokes_cancel_the_last_request_and_reuse_its_prompt(daemon: Daemon) -> None:
    """The coding-assistant pattern: a request every 0.3 s, each one typed further, the editor
    dropping the last one's stream as the next goes out."""
    before = len(requests(daemon, "coder"))
    typed = CODE
    with httpx.Client(base_url=daemon.url, timeout=60) as http:
        for key in " a + b":
            typed += key
            body = {"model": "coder", "prompt": typed, "suffix": AFTER, "max_tokens": 200}
            with http.stream("POST", "/completions", json={**body, "stream": True}) as reply:
                assert reply.status_code == 200
                next(reply.iter_lines())  # the first chunk; then the next keystroke
            time.sleep(0.3)
        last = http.post("/completions", json={**body, "max_tokens": 4})
        assert last.status_code == 200
    wait_until(lambda: len(requests(daemon, "coder")) >= before + 7, 30, "every request's end")
    ended = requests(daemon, "coder")[before:]
    assert sum(1 for e in ended if e["cancelled"]) >= 5
    # Each keystroke's prompt shares all but its last few tokens with the one before: the KV of
    # the common prefix is reused, and only the rest (the new text, the suffix and the FIM
    # tokens after it) is evaluated again.
    final = ended[-1]
    assert final["prompt_tokens_evaluated"] < final["prompt_tokens"] - 10
