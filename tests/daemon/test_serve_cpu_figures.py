"""What a real daemon on a machine without a GPU says of itself (issue 40): a warm CPU model is
booked at the bytes its worker holds, in /metrics and status alike; the device those figures
are of is called the CPU's host RAM, not gpu0; a model that waits for the GPU is named by its
model, with its request counted in QUEUE; and the history a dashboard asks for is its own
daemon's, not that of another daemon which shares the state folder."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from arbiterd.daemon.observe.journal import Journal
from tests.support.daemon import Daemon, arbiterd_cli, serving, tiny
from tests.support.waiting import wait_until

COMPLETION = {"prompt": "the fox", "max_tokens": 1}


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    # n_gpu_layers as a user leaves it (every layer asked for the GPU), and none to be had.
    models = {"alpha": tiny(tiny_model, n_gpu_layers=-1), "beta": tiny(tiny_model)}
    with serving(models) as running:
        yield running


def status_of(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as client:
        status: dict[str, Any] = client.call("status")
    return status


def model_of(status: dict[str, Any], name: str) -> dict[str, Any]:
    model: dict[str, Any] = next(m for m in status["models"] if m["name"] == name)
    return model


def complete(daemon: Daemon, model: str) -> httpx.Response:
    return httpx.post(f"{daemon.url}/completions", json={"model": model, **COMPLETION}, timeout=60)


def vram_gauge(daemon: Daemon, owner: str) -> float:
    text = httpx.get(daemon.url.removesuffix("/v1") + "/metrics", timeout=30).text
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "arbiterd_vram_bytes" and sample.labels.get("owner") == owner
    )


def test_a_warm_cpu_model_is_booked_at_what_its_worker_holds_on_host_ram(daemon: Daemon) -> None:
    # Loaded, then handed to beta and restored: each warm-up is booked at what it holds.
    for model in ("alpha", "beta", "alpha"):
        assert complete(daemon, model).status_code == 200
    wait_until(
        lambda: model_of(status_of(daemon), "alpha")["state"] == "warm", 30, "alpha to stay warm"
    )
    status = status_of(daemon)
    assert status["engine"]["offload"] is False, "this test is of a machine without a GPU"
    assert status["telemetry"]["source"] == "accounting"
    alpha = model_of(status, "alpha")
    assert alpha["resident_bytes"] > 0
    assert alpha["vram_bytes"] == alpha["resident_bytes"]
    assert vram_gauge(daemon, "alpha") == alpha["resident_bytes"]
    text = arbiterd_cli("status", "--socket", str(daemon.socket))
    assert "CPU (host RAM): " in text
    assert "gpu0" not in text


def test_a_waiting_model_is_named_by_its_model_and_its_request_is_in_its_queue(
    daemon: Daemon,
) -> None:
    with daemon.client() as client:
        client.call("hold")  # the GPU is yours: every model goes cold, and waits for it
    answers: list[int] = []
    waiting = threading.Thread(target=lambda: answers.append(complete(daemon, "alpha").status_code))
    waiting.start()
    try:

        def alpha_waits() -> bool:
            status = status_of(daemon)
            return model_of(status, "alpha")["queue"] >= 1 and bool(status["waiters"])

        wait_until(alpha_waits, 30, "alpha's request to wait for the GPU")
        status = status_of(daemon)
        pid = model_of(status, "alpha")["pid"]
        assert {"pid": pid, "name": "alpha"} in status["waiters"]
        text = arbiterd_cli("status", "--socket", str(daemon.socket))
        assert f"alpha (pid {pid})" in text
        arena = arbiterd_cli("arena", "status", "--arena", str(daemon.arena))
        assert f"waiters  alpha (pid {pid})" in arena
    finally:
        with daemon.client() as client:
            client.call("unhold")
        waiting.join(timeout=60)
    assert answers == [200]
    wait_until(lambda: model_of(status_of(daemon), "alpha")["queue"] == 0, 30, "alpha's queue")


def test_the_history_a_dashboard_gets_is_its_own_daemons(daemon: Daemon, tiny_model: Path) -> None:
    # Another daemon whose journal is the same file (one state folder, two configs).
    with serving({"gamma": tiny(tiny_model)}, journal=daemon.journal) as other:
        assert complete(other, "gamma").status_code == 200
        assert complete(daemon, "beta").status_code == 200
        with daemon.client() as client:
            ours = list(client.history())
        with other.client() as client:
            theirs = list(client.history())
    shared = Journal.open_readonly(daemon.journal)
    try:
        in_file = {e.model for e in shared.read()}
    finally:
        shared.close()
    assert {"alpha", "beta", "gamma"} <= in_file  # one file holds both daemons' events
    assert {e.get("model") for e in ours} >= {"alpha", "beta"}
    assert "gamma" not in {e.get("model") for e in ours}
    assert not [e for e in ours if "gamma" in (e.get("from"), e.get("to"))]
    assert {e.get("model") for e in theirs} - {None} == {"gamma"}
