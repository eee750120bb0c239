"""Priorities end to end: a real daemon, the openai SDK, the x-arbiterd-priority header. An
interactive question to one model pauses another model's long batch generation, whose text
comes out as an uninterrupted run's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.daemon import Daemon, openai_client, serving
from tests.support.daemon import tiny as tiny_table

# The tiny model as every test here runs it.
tiny = partial(tiny_table, min_hold_s=0.02)


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    with serving(
        {"batchy": tiny(tiny_model, priority="batch"), "person": tiny(tiny_model)}
    ) as running:
        yield running


@pytest.fixture
def api(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai_client(daemon, timeout_s=120) as client:
        yield client


def test_an_interactive_request_pauses_a_batch_generation(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    long_job: dict[str, Any] = {
        "model": "batchy",
        "prompt": "the fox",
        "max_tokens": 1500,
        "temperature": 0,
    }
    reference = api.completions.create(**long_job).choices[0].text
    api.completions.create(model="person", prompt="the dog", max_tokens=1)  # batchy goes cold
    started = threading.Event()
    pieces: list[str] = []
    finished: list[str] = []

    def stream_the_long_job() -> None:
        for chunk in api.completions.create(**long_job, stream=True):
            pieces.append(chunk.choices[0].text if chunk.choices else "")
            started.set()
        finished.append("batchy")

    thread = threading.Thread(target=stream_the_long_job)
    thread.start()
    assert started.wait(60)
    api.completions.create(
        model="person",
        prompt="the dog",
        max_tokens=4,
        extra_headers={"x-arbiterd-priority": "interactive"},
    )
    finished.append("person")
    thread.join(timeout=120)
    assert finished == ["person", "batchy"]
    assert "".join(pieces) == reference
    with daemon.client() as client:
        events = client.call("events", limit=200)["events"]
    paused = [
        e for e in events if e["event"] == "handoff" and e.get("release_reason") == "preempted"
    ]
    assert [(e["from"], e["to"]) for e in paused] == [("batchy", "person")]


def test_an_unknown_priority_is_a_400_naming_the_allowed_ones(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="interactive, normal, batch"):
        api.completions.create(
            model="person",
            prompt="x",
            max_tokens=1,
            extra_headers={"x-arbiterd-priority": "urgent"},
        )
