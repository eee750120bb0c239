"""The supervisor in-process, with real tiny-model workers and a GPU reader that never frees."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from arbiterd.config import load_config
from arbiterd.daemon.models import lifecycle
from arbiterd.daemon.models.workerclient import BACKENDS, WorkerClient
from arbiterd.daemon.observe.metrics import Metrics
from arbiterd.daemon.observe.telemetry import DeviceMemory, ProcessMemory, ReaderSet, Reading
from arbiterd.daemon.supervisor import Supervisor
from arbiterd.offload import cpu_note, gpu_nodes, setup_script
from arbiterd.states import ControlCommand

GiB = 1 << 30


class LeakyGpu:
    """A reader for a driver that never gives memory back: each of our worker processes holds
    1 GiB on gpu0, warm or cold."""

    source = "leaky-test-gpu"

    def open(self) -> str | None:
        return None

    def close(self) -> None:
        return None

    def read(self) -> Reading:
        workers = [
            p.pid for p in psutil.Process().children() if "arbiterd.worker" in " ".join(p.cmdline())
        ]
        processes = tuple(ProcessMemory(pid, "gpu0", GiB, "python3") for pid in workers)
        used = GiB * len(processes)
        return Reading(
            devices=(DeviceMemory("gpu0", "test gpu", 8 * GiB, used),),
            processes=processes,
            measured=frozenset({"gpu0"}),
        )


def write_config(tmp_path: Path, model: Path) -> Path:
    config = tmp_path / "config.toml"
    config.write_text(
        "[daemon]\n"
        f'socket = "{tmp_path / "c.sock"}"\n'
        f'arena = "{tmp_path / "arena"}"\n'
        f'journal = "{tmp_path / "journal.sqlite3"}"\n'
        "[models.m]\n"
        f'path = "{model}"\n'
        "n_gpu_layers = 0\n"
    )
    return config


async def next_event(events: asyncio.Queue[dict[str, Any]], kind: str) -> dict[str, Any]:
    while True:
        event = await asyncio.wait_for(events.get(), timeout=30)
        if event["event"] == kind:
            return event


def test_a_release_that_does_not_free_vram_is_reported(tmp_path: Path, tiny_model: Path) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    tmp_path.chmod(0o700)
    config = load_config(write_config(tmp_path, tiny_model), env=env)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        supervisor = Supervisor(
            config, readers=ReaderSet((LeakyGpu(),), (), context_allowance_bytes=0)
        )
        await supervisor.start()
        try:
            events = supervisor.subscribe()
            await supervisor.command(ControlCommand.WARM, "m")
            await supervisor.command(ControlCommand.RELEASE, "m")
            leak = await next_event(events, "vram_not_freed")
            status = (await supervisor.status()).to_json()
            return leak, status
        finally:
            await supervisor.stop()

    leak, status = asyncio.run(scenario())
    assert leak["model"] == "m"
    assert leak["device"] == "gpu0"
    assert leak["bytes_after"] == GiB
    assert leak["expected_bytes"] == 0
    model = status["models"][0]
    assert model["state"] == "cold"
    assert model["cold_footprint_bytes"] == GiB  # what users see: it still holds 1 GiB
    assert model["vram_bytes"] == GiB
    assert status["telemetry"]["source"] == "leaky-test-gpu"


def test_a_spawn_that_fails_on_an_os_error_is_said_and_retried(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of file descriptors at the worst moment: socketpair raises EMFILE. The model must
    not stay 'starting' for good: a `could not start` event, then a retry that works."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    tmp_path.chmod(0o700)
    config = load_config(write_config(tmp_path, tiny_model), env=env)
    real_spawn = WorkerClient.spawn
    failures = iter([OSError(errno.EMFILE, "Too many open files")])

    async def spawn(*args: Any, **kwargs: Any) -> WorkerClient:
        for exc in failures:
            raise exc
        return await real_spawn(*args, **kwargs)

    monkeypatch.setattr(WorkerClient, "spawn", spawn)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        supervisor = Supervisor(config)
        events = supervisor.subscribe()
        await supervisor.start()
        try:
            failed = await next_event(events, "worker")
            starting = (await supervisor.status()).to_json()["models"][0]
            await next_event(events, "residency")  # the retried worker loaded its model
            return failed, starting
        finally:
            await supervisor.stop()

    failed, starting = asyncio.run(scenario())
    assert failed["reason"] == "could not start: EMFILE: Too many open files"
    assert failed["restart_in_s"] == 1.0
    assert starting["state"] == "restarting"
    assert starting["last_error"] == failed["reason"]


# -- what runs each model (issue 15) -----------------------------------------------------------


def backend_series(text: str) -> dict[tuple[str, str], float]:
    return {
        (sample.labels["model"], sample.labels["backend"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "arbiterd_backend"
        for sample in family.samples
    }


def test_a_models_backend_metric_follows_its_latest_worker() -> None:
    metrics = Metrics()
    metrics.set_backend("m", "reload")
    metrics.set_backend("n", "reload")
    metrics.set_backend("m", "in-place")
    assert backend_series(metrics.text().decode()) == {("m", "in-place"): 1.0, ("n", "reload"): 1.0}


def test_each_model_says_its_backend_and_the_cpu_cause_is_said_once_per_run(
    tmp_path: Path,
    tiny_model: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`gpu` and `gpu2` ask for every layer on the GPU, `cpu` for none. On an engine that
    cannot offload (this machine's CPU tier), the engine's status says why once, for this
    machine (offload.py), and the log says it once in the run: not per model, not per worker
    start; on one that can (a GPU machine), nothing is said of it."""
    monkeypatch.setattr(lifecycle, "RESTART_BACKOFF_S", (0.05,))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    tmp_path.chmod(0o700)
    path = write_config(tmp_path, tiny_model)
    text = path.read_text().replace("[models.m]", "[models.cpu]")
    gpu = "".join(
        f'[models.{n}]\npath = "{tiny_model}"\nn_gpu_layers = -1\n' for n in ("gpu", "gpu2")
    )
    path.write_text(text + gpu)
    config = load_config(path, env=env)
    caplog.set_level(logging.INFO, logger="arbiterd.daemon.supervisor")

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], str]:
        supervisor = Supervisor(config)
        events = supervisor.subscribe()
        await supervisor.start()
        try:
            first = (await supervisor.status()).to_json()
            await supervisor.status()  # the status says it again; the log does not
            os.kill(pid_of(first, "gpu"), signal.SIGKILL)
            await next_event(events, "worker")
            await supervisor.command(ControlCommand.WARM, "gpu")  # waits for the restarted worker
            again = (await supervisor.status()).to_json()
            return first, again, (await supervisor.metrics_text()).decode()
        finally:
            await supervisor.stop()

    first, again, metrics = asyncio.run(scenario())
    note = cpu_note(gpu_nodes(), first["engine"]["offload"], setup_script())
    for status in (first, again):
        models = {m["name"]: m for m in status["models"]}
        assert models["gpu"]["backend"] in BACKENDS
        assert models["gpu"]["backend"] == models["cpu"]["backend"]  # one engine for both
        assert "warning" not in models["gpu"]  # the engine's, not each model's
        engine = status["engine"]
        said = (engine["cpu_cause"], engine["cpu_note"])
        assert said == ((None, "") if note is None else (str(note.cause), note.text))
    assert pid_of(again, "gpu") != pid_of(first, "gpu")
    logged = [
        (r.levelno, r.getMessage()) for r in caplog.records if "run on the CPU" in r.getMessage()
    ]
    if note is None:
        assert logged == []
    else:  # once, though three workers started: gpu, gpu2 and gpu again
        assert logged == [
            (logging.WARNING if note.warning else logging.INFO, f"engine: {note.text}")
        ]
    backend = first["models"][0]["backend"]
    series = {("cpu", backend): 1.0, ("gpu", backend): 1.0, ("gpu2", backend): 1.0}
    assert backend_series(metrics) == series


def test_a_config_that_asks_for_no_gpu_layers_has_no_cpu_note(
    tmp_path: Path, tiny_model: Path
) -> None:
    """n_gpu_layers = 0 everywhere: the CPU is what was asked for, nothing to explain."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    tmp_path.chmod(0o700)
    config = load_config(write_config(tmp_path, tiny_model), env=env)
    assert all(m.n_gpu_layers == 0 for m in config.models.values())

    async def scenario() -> dict[str, Any]:
        supervisor = Supervisor(config)
        await supervisor.start()
        try:
            return (await supervisor.status()).to_json()
        finally:
            await supervisor.stop()

    engine = asyncio.run(scenario())["engine"]
    assert (engine["cpu_cause"], engine["cpu_note"]) == (None, "")


def pid_of(status: dict[str, Any], name: str) -> int:
    pid: int = {m["name"]: m["pid"] for m in status["models"]}[name]
    return pid


def test_status_lists_every_model_as_starting_before_any_worker_starts(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The control socket answers before the workers start: a client asking then (the demo's
    wait for its models, the tray) sees the models to come, not a daemon without models."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    tmp_path.chmod(0o700)
    config = load_config(write_config(tmp_path, tiny_model), env=env)

    async def scenario() -> dict[str, Any]:
        supervisor = Supervisor(config, readers=ReaderSet((), (), context_allowance_bytes=0))
        return (await supervisor.status()).to_json()

    status = asyncio.run(scenario())
    assert [(m["name"], m["state"]) for m in status["models"]] == [("m", "starting")]
