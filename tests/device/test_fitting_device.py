"""A fitting set on a real Vulkan device (issue 44): two tiny models on Vulkan0 (llvmpipe, which
cannot tell its memory: [devices.gpu0] memory says it) are warm on the device together and
alternate with no release; with room for one, each switch makes the other release in place,
and every answer is the one the model gave first."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiterd.native import ggml
from tests.daemon.test_serve_fitting import devices_table, fitting_set, measured_bytes
from tests.daemon.test_serve_groups import events_after, last_seq, releases, states
from tests.support.daemon import Daemon, openai_client, serving, tiny

ON_DEVICE: dict[str, Any] = {"n_gpu_layers": -1, "residency": "in-place", "min_hold_s": 0.02}
PROMPTS = {"a": "the fox", "b": "the dog"}
CLIENT_TIMEOUT_S = 120  # the first decode compiles llvmpipe's pipelines


@pytest.fixture(scope="module")
def daemon(vulkan0: ggml.Device, tiny_model: Path) -> Iterator[Daemon]:
    del vulkan0  # on it: the device tier's engine places gpu0 there
    models = {name: tiny(tiny_model, n_ctx=512, **ON_DEVICE) for name in PROMPTS}
    with serving(models, pasted=devices_table("1GiB")) as running:
        yield running


def ask(daemon: Daemon, model: str) -> str:
    with openai_client(daemon, timeout_s=CLIENT_TIMEOUT_S) as api:
        done = api.completions.create(
            model=model, prompt=PROMPTS[model], max_tokens=6, temperature=0
        )
    return done.choices[0].text


def alternate_warm_together(daemon: Daemon) -> None:
    """Ask a and b by turns: both stay warm, no handoff, no release, the same answers."""
    first = {name: ask(daemon, name) for name in PROMPTS}
    before = last_seq(daemon)
    for _ in range(3):
        for name in PROMPTS:
            assert ask(daemon, name) == first[name]
    assert states(daemon) == {"a": "warm", "b": "warm"}
    new = events_after(daemon, before)
    assert [e for e in new if e["event"] == "handoff"] == []
    assert releases(new, "a") == releases(new, "b") == 0
    assert sorted(fitting_set(daemon)["warm"]) == ["a", "b"]


def test_models_that_fit_are_warm_on_the_device_together(daemon: Daemon) -> None:
    alternate_warm_together(daemon)
    assert measured_bytes(daemon, "a", "gpu0") > 0
    assert measured_bytes(daemon, "b", "gpu0") > 0  # both models' buffers on Vulkan0 at once


def test_with_room_for_one_they_take_turns_releasing_in_place(daemon: Daemon) -> None:
    take_turns(daemon, "gpu0", devices_table)


def take_turns(
    daemon: Daemon,
    device: str,
    table: Callable[[int | str], str],
    after_each: Callable[[], None] = lambda: None,
) -> None:
    """With room for one (`table` of a budget, replacing the 1 GiB one), asking a and b by
    turns makes each release in place for the other, with the same answers; `after_each`
    switch, more checks."""
    first = {name: ask(daemon, name) for name in PROMPTS}
    one = max(measured_bytes(daemon, name, device) for name in PROMPTS)  # as the keeper counts
    text = daemon.config.read_text().replace(table("1GiB"), table(one + one // 2))
    daemon.config.write_text(text)
    with daemon.client() as client:
        client.call("reload")
    before = last_seq(daemon)
    for _ in range(2):
        for name in PROMPTS:
            assert ask(daemon, name) == first[name]
            assert fitting_set(daemon)["warm"] == [name]
            after_each()
    new = events_after(daemon, before)
    assert releases(new, "a") >= 1
    assert releases(new, "b") >= 1
