"""A vision model end to end (issue 12): the real `openai` SDK sends an image to a daemon whose
tiny model has a tiny projector; the encoder's steps come out as events; a follow-up turn
reuses the prompt cache through the image."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletionUserMessageParam
from prometheus_client.parser import text_string_to_metric_families

from arbiterd.cli.controlclient import ControlClient
from tests.support.daemon import Daemon, openai_client, serving
from tests.support.daemon import tiny as tiny_table
from tests.support.images import png, webp
from tests.support.waiting import wait_until

QUESTION = "what is in this picture"


# The tiny model as every test here runs it.
tiny = partial(tiny_table, n_ctx=1024)


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tiny_mmproj: Path) -> Iterator[Daemon]:
    with serving(
        {"eye": tiny(tiny_model, mmproj=tiny_mmproj), "plain": tiny(tiny_model)}
    ) as running:
        yield running


@pytest.fixture
def api(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai_client(daemon) as client:
        yield client


def user_turn(image: bytes, media_type: str = "image/png") -> ChatCompletionUserMessageParam:
    url = f"data:{media_type};base64,{base64.b64encode(image).decode()}"
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }


def encoder_steps(listener: ControlClient, request_events: int) -> list[dict[str, Any]]:
    """The encoder events `listener` (subscribed) got until `request_events` requests ended."""
    seen: list[dict[str, Any]] = []
    ended = 0
    for event in listener.events(timeout_s=30):
        if event["event"] == "encoder":
            seen.append(event)
        ended += event["event"] == "request" and event.get("model") == "eye"
        if ended == request_events:
            return seen
    raise AssertionError(f"only {ended} request events within 30 s")


def test_an_image_is_answered_and_a_follow_up_reuses_its_cache(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    image = png(48, 40)
    with daemon.client() as listener:
        listener.call("subscribe")
        first = api.chat.completions.create(
            model="eye", messages=[user_turn(image)], max_tokens=5, temperature=0
        )
        answer = first.choices[0].message.content
        assert answer
        follow = api.chat.completions.create(
            model="eye",
            messages=[
                user_turn(image),
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "and the dog"},
            ],
            max_tokens=5,
            temperature=0,
        )
        steps = encoder_steps(listener, 2)
    assert first.usage is not None
    assert follow.usage is not None
    assert follow.usage.prompt_tokens_details is not None
    cached = follow.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= first.usage.prompt_tokens - 1  # the first prompt, its image included
    # the first request loaded, encoded and freed the projector; the follow-up needed none
    assert [s["action"] for s in steps] == ["load", "encode", "free"]
    assert len({s["id"] for s in steps}) == 1
    load, encode, free = steps
    assert load["bytes"] == free["bytes"] > 0
    assert encode["images"] == 1
    assert all(s["duration_s"] >= 0 for s in steps)


def test_an_image_to_a_model_without_a_projector_is_a_bad_request(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="plain takes no images"):
        api.chat.completions.create(model="plain", messages=[user_turn(png())], max_tokens=2)


def test_a_corrupt_image_is_a_bad_request_and_the_model_keeps_serving(
    api: openai.OpenAI,
) -> None:
    broken = png()[:-40]
    with pytest.raises(openai.BadRequestError, match="PNG"):
        api.chat.completions.create(model="eye", messages=[user_turn(broken)], max_tokens=2)
    text = api.chat.completions.create(
        model="eye", messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert text.choices[0].message.content is not None


def test_an_image_request_streams(api: openai.OpenAI) -> None:
    stream = api.chat.completions.create(
        model="eye",
        messages=[user_turn(png(seed=9))],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens > 4  # the image's positions count in the prompt


def test_a_webp_is_answered_as_its_png_is(api: openai.OpenAI) -> None:
    # The edge converts the WebP to PNG: the worker's decoder (stb_image) cannot read WebP.
    as_png = api.chat.completions.create(
        model="eye", messages=[user_turn(png(48, 40, seed=21))], max_tokens=3, temperature=0
    )
    as_webp = api.chat.completions.create(
        model="eye",
        messages=[user_turn(webp(48, 40, lossless=True, seed=21), "image/webp")],
        max_tokens=3,
        temperature=0,
    )
    assert as_webp.choices[0].message.content
    assert as_png.usage is not None
    assert as_webp.usage is not None
    assert as_webp.usage.prompt_tokens == as_png.usage.prompt_tokens  # the image's positions too


def test_metrics_count_the_projector_loads(daemon: Daemon, api: openai.OpenAI) -> None:
    api.chat.completions.create(model="eye", messages=[user_turn(png(seed=11))], max_tokens=1)

    def loads() -> float:
        text = httpx.get(daemon.url.removesuffix("/v1") + "/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "arbiterd_encoder_loads_total" and sample.labels == {
                    "model": "eye"
                }:
                    return float(sample.value)
        return 0.0

    # events reach the metrics asynchronously
    wait_until(lambda: loads() >= 1, 30, 'arbiterd_encoder_loads_total{model="eye"} >= 1')


def test_ollamas_chat_takes_images_too(daemon: Daemon) -> None:
    client = ollama.Client(host=daemon.url.removesuffix("/v1"), timeout=60)
    try:
        answer = client.chat(
            model="eye",
            messages=[{"role": "user", "content": QUESTION, "images": [png(seed=12)]}],
            options={"num_predict": 3, "temperature": 0},
        )
    finally:
        client.close()  # type: ignore[no-untyped-call]  # ollama leaves it unannotated
    assert answer.message.content
    assert (answer.prompt_eval_count or 0) > 4  # the image's positions count


def test_a_tight_vram_budget_swaps_the_weights_out_while_the_projector_encodes(
    tiny_model: Path, tiny_mmproj: Path
) -> None:
    # [daemon] vram_budget reaches the worker: 1 MiB is less than the tiny model's 6 MiB of
    # weights, KV and compute buffers, so its projector can only come on with the weights off.
    tight = Daemon(
        {"eye": tiny(tiny_model, mmproj=tiny_mmproj)}, daemon_keys={"vram_budget": 1 << 20}
    )
    try:
        tight.wait_ready()
        with (
            tight.client() as listener,
            openai.OpenAI(base_url=tight.url, api_key="unused", max_retries=0) as client,
        ):
            listener.call("subscribe")
            answer = client.chat.completions.create(
                model="eye", messages=[user_turn(png())], max_tokens=5, temperature=0
            )
            steps = []  # a request's encoder events follow its request event
            for event in listener.events(timeout_s=30):
                steps += [event] if event["event"] == "encoder" else []
                if steps and steps[-1]["action"] == "restore":
                    break
    finally:
        tight.cleanup()
    assert answer.choices[0].message.content
    assert [s["action"] for s in steps] == ["release", "load", "encode", "free", "restore"]
    assert {s["path"] for s in steps} == {"swap"}
    assert "exceed the budget of 1.0 MiB" in steps[0]["reason"]
