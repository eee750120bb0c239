"""A model without a chat template, served by a real daemon (issue 40): a chat to it is a 400
that names the config keys that fix it, where it used to be an empty answer with a 200;
Ollama's /api/generate completes its prompt as it is, as Ollama does, in its format when it
asks for one; and the fix the 400 names (a chat_format) makes the same GGUF chat."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, serving, tiny
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    spec = TinyModelSpec(chat_template="")
    model = write_tiny_llama(tmp_path_factory.mktemp("models") / "base.gguf", spec)
    models = {"base": tiny(model), "base-chatml": tiny(model, chat_format="chatml")}
    with serving(models) as running:
        yield running


@pytest.fixture
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url.removesuffix("/v1"), timeout=60) as client:
        yield client


def completed(http: httpx.Client, prompt: str) -> dict[str, Any]:
    body = {"model": "base", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def generated(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    options = {"num_predict": MAX_TOKENS, "temperature": 0}
    body = {"model": "base", "stream": False, "options": options, **fields}
    answer = http.post("/api/generate", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def test_a_chat_to_a_model_without_a_template_is_a_400_naming_the_keys_that_fix_it(
    http: httpx.Client,
) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    answer = http.post("/v1/chat/completions", json={"model": "base", "messages": messages})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "base has no chat template" in error["message"]
    assert "chat_format" in error["message"]
    assert "chat_template" in error["message"]
    assert "/v1/completions" in error["message"]
    ollama = http.post("/api/chat", json={"model": "base", "messages": messages, "stream": False})
    assert ollama.status_code == 400, ollama.text
    assert "base has no chat template" in ollama.json()["error"]["message"]


def test_ollama_generate_completes_the_prompt_as_it_is(http: httpx.Client) -> None:
    expected = completed(http, "The sky is")
    answer = generated(http, prompt="The sky is")
    assert answer["prompt_eval_count"] == expected["usage"]["prompt_tokens"]
    assert answer["response"] == expected["choices"][0]["text"]
    assert answer["eval_count"] == expected["usage"]["completion_tokens"]


def test_ollama_generate_puts_the_system_before_the_prompt(http: httpx.Client) -> None:
    expected = completed(http, "Answer briefly.\n\nThe sky is")
    answer = generated(http, prompt="The sky is", system="Answer briefly.")
    assert answer["prompt_eval_count"] == expected["usage"]["prompt_tokens"]
    assert answer["response"] == expected["choices"][0]["text"]


def test_the_same_gguf_with_a_chat_format_chats(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    body = {"model": "base-chatml", "messages": messages, "max_tokens": MAX_TOKENS}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"


def test_ollama_generate_without_a_template_follows_its_format(http: httpx.Client) -> None:
    answer = generated(http, prompt="Is the sky blue?", format={"type": "boolean"})
    assert isinstance(json.loads(answer["response"]), bool)
