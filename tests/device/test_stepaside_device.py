"""Stepping aside on the Vulkan device (issue 45): a model warm on Vulkan0 releases in place when
a foreign Vulkan program starts (tests/support/vulkan_game.py: real device buffers through the
engine's Vulkan backend, no part in the protocol); llvmpipe opens no device node, so a
`[yield] programs` rule naming it catches it. The memory the release freed is read from the
engine's own accounting (the release's `resident_bytes`), the program copies to and from the
device while the daemon holds the GPU for it, and once it exits the model comes back and
answers as it did before."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from arbiterd.native import ggml
from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.waiting import wait_until

ON_DEVICE: dict[str, Any] = {"n_gpu_layers": -1, "residency": "in-place"}
CLIENT_TIMEOUT_S = 120
EVENT_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def daemon(
    vulkan0: ggml.Device, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    # No node to watch, as on a machine whose only Vulkan device is llvmpipe (also where a
    # GPU's nodes are there: this test's program runs on llvmpipe all the same).
    absent = tmp_path_factory.mktemp("nodes") / "renderD128"
    rules = {"programs": ["*vulkan_game*"], "scan_s": 0.5, "nodes": [absent]}
    with serving({"m": tiny(tiny_model, n_ctx=512, **ON_DEVICE)}, yield_keys=rules) as running:
        yield running


def ask(api: openai.OpenAI) -> str:
    done = api.completions.create(model="m", prompt="the fox", max_tokens=8, temperature=0)
    return done.choices[0].text


def status(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as client:
        found: dict[str, Any] = client.call("status")
    return found


def events(daemon: Daemon) -> list[dict[str, Any]]:
    with daemon.client() as client:
        found: list[dict[str, Any]] = client.call("events", limit=500)["events"]
    return found


def released(daemon: Daemon) -> list[dict[str, Any]]:
    return [
        e
        for e in events(daemon)
        if e["event"] == "residency" and (e["from"], e["to"]) == ("cooling", "cold")
    ]


def test_a_foreign_vulkan_program_makes_the_model_step_aside_and_it_comes_back(
    daemon: Daemon, vulkan0: ggml.Device
) -> None:
    api = openai_client(daemon, CLIENT_TIMEOUT_S)
    before = ask(api)
    warm = status(daemon)["models"][0]
    assert warm["state"] == "warm"
    assert warm["resident_bytes"] > 0
    releases = len(released(daemon))
    game = subprocess.Popen(
        [sys.executable, "-m", "tests.support.vulkan_game"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert game.stdout is not None
        said = next(line for line in game.stdout if line.startswith(("on ", "no device")))
        assert said.strip() == f"on {vulkan0.label}"
        wait_until(lambda: status(daemon)["stepped_aside"] is not None, EVENT_TIMEOUT_S, "aside")
        aside = status(daemon)["stepped_aside"]
        assert aside["pid"] == game.pid
        assert aside["reason"] == "named in [yield] programs ('*vulkan_game*')"
        wait_until(lambda: len(released(daemon)) > releases, EVENT_TIMEOUT_S, "the release")
        release = released(daemon)[-1]
        # The engine's own figures: what the worker still holds on the device once released.
        assert release["resident_bytes"] < warm["resident_bytes"] / 2
        holder = status(daemon)["holder"]
        assert holder["name"] == f"{aside['program']} (pid {game.pid}; arbiterd stepped aside)"
        # The program works on the device while the daemon holds the GPU for it.
        assert next(line for line in game.stdout if line.strip() == "copied")
        assert status(daemon)["models"][0]["state"] == "cold"
    finally:
        if game.stdin is not None:
            game.stdin.close()
        game.wait(timeout=60)
        if game.stdout is not None:
            game.stdout.close()
    assert game.returncode == 0
    wait_until(lambda: status(daemon)["stepped_aside"] is None, EVENT_TIMEOUT_S, "the return")
    assert ask(api) == before
    assert status(daemon)["models"][0]["state"] == "warm"
