"""Fill-in-the-middle end to end (issue 47 item 1): a completion with a `suffix`, through a real
daemon and the openai SDK, on the tiny llama made a code model (its GGUF names FIM tokens), as a
coding assistant sends one on every keystroke: streamed and not, each keystroke's request
cancelling the last, the prompt cache reused by the next; a model without FIM tokens answers a
400 naming what it lacks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionUserMessageParam

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


def test_a_code_model_says_it_fills_in_the_middle(daemon: Daemon, tiny_fim_model: Path) -> None:
    with daemon.client() as client:
        models = {m["name"]: m for m in client.call("status")["models"]}
    assert "fim" in models["coder"]["capabilities"]
    assert "fim" not in models["plain"]["capabilities"]
    assert models["coder"]["path"] == str(tiny_fim_model)  # its file, for a config of one's own


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
    dropping the last one's stream as the next goes out, while a chat streams on another
    model."""
    before = len(requests(daemon, "coder"))
    chat: list[str] = []

    def chat_streams() -> None:
        story: ChatCompletionUserMessageParam = {"role": "user", "content": "A long story."}
        stream = openai_client(daemon).chat.completions.create(
            model="plain", messages=[story], max_tokens=300, stream=True
        )
        chat.extend(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    chatting = threading.Thread(target=chat_streams)
    chatting.start()
    typed = CODE
    with httpx.Client(base_url=daemon.url, timeout=60) as http:
        for key in " a + b":
            typed += key
            body = {"model": "coder", "prompt": typed, "suffix": AFTER, "max_tokens": 200}
            with http.stream("POST", "/completions", json={**body, "stream": True}) as reply:
                assert reply.status_code == 200
                next(reply.iter_lines())  # the first chunk; then the next keystroke
            time.sleep(0.3)  # a person's pace between keystrokes: the load is the point
        last = http.post("/completions", json={**body, "max_tokens": 4})
        assert last.status_code == 200
    chatting.join(timeout=120)
    assert "".join(chat)  # the chat was answered all the while
    wait_until(lambda: len(requests(daemon, "coder")) >= before + 7, 30, "every request's end")
    ended = requests(daemon, "coder")[before:]
    assert sum(1 for e in ended if e["cancelled"]) >= 5
    # Each keystroke's prompt shares all but its last few tokens with the one before: the KV of
    # the common prefix is reused, and only the rest (the new text, the suffix and the FIM
    # tokens after it) is evaluated again.
    final = ended[-1]
    assert final["prompt_tokens_evaluated"] < final["prompt_tokens"] - 10


def infill(daemon: Daemon, body: dict[str, Any]) -> httpx.Response:
    """llama-server's /infill, at the daemon's root (not under /v1), as llama.vscode calls it."""
    return httpx.post(daemon.url.removesuffix("/v1") + "/infill", json=body, timeout=60)


def test_infill_answers_as_llama_server_and_serves_the_fim_model_unnamed(daemon: Daemon) -> None:
    """An editor sends no model name: the model with FIM tokens serves it. The answer's text
    is the same as the completion with that suffix gives."""
    api = openai_client(daemon)
    body = {"input_prefix": CODE, "input_suffix": AFTER, "n_predict": 6, "temperature": 0}
    done = infill(daemon, {**body, "cache_prompt": True, "t_max_predict_ms": 500})
    assert done.status_code == 200, done.text
    answer = done.json()
    same = api.completions.create(
        model="coder", prompt=CODE, suffix=AFTER, max_tokens=6, temperature=0
    )
    assert answer["content"] == same.choices[0].text
    assert (answer["stop"], answer["model"], answer["tokens_predicted"]) == (True, "coder", 6)
    assert answer["stop_type"] == "limit"
    assert same.usage is not None
    assert answer["tokens_evaluated"] == same.usage.prompt_tokens
    streamed = infill(daemon, {**body, "stream": True})
    lines = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    objects = [json.loads(line.removeprefix("data: ")) for line in lines]  # no [DONE]
    assert "".join(o["content"] for o in objects) == answer["content"]
    assert [o["stop"] for o in objects[-1:]] == [True]
    assert objects[-1]["tokens_predicted"] == 6


def test_infill_takes_the_projects_other_files_and_the_text_typed_after_the_prefix(
    daemon: Daemon,
) -> None:
    body = {"input_prefix": CODE, "input_suffix": AFTER, "n_predict": 2, "temperature": 0}
    plain = infill(daemon, body).json()
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    more = infill(daemon, {**body, "input_extra": extra, "prompt": " a"}).json()
    # The other file and the middle are read: the prompt has more tokens.
    assert more["tokens_evaluated"] > plain["tokens_evaluated"] + 10


def test_infill_refusals_name_the_field_or_what_the_model_lacks(daemon: Daemon) -> None:
    unknown = infill(daemon, {"input_prefix": CODE, "input_sufix": AFTER})
    assert unknown.status_code == 400
    assert "input_sufix" in unknown.json()["error"]["message"]
    wrong = infill(daemon, {"input_prefix": CODE, "input_extra": "util.py"})
    assert wrong.status_code == 400
    assert "input_extra" in wrong.json()["error"]["message"]
    plain = infill(daemon, {"model": "plain", "input_prefix": CODE, "input_suffix": AFTER})
    assert plain.status_code == 400
    assert "no fill-in-the-middle tokens" in plain.json()["error"]["message"]


def test_ollamas_show_names_fill_in_the_middle_insert(daemon: Daemon) -> None:
    root = daemon.url.removesuffix("/v1")
    shown = httpx.post(f"{root}/api/show", json={"model": "coder"}, timeout=30).json()
    assert "insert" in shown["capabilities"]
    assert "fim" not in shown["capabilities"]
