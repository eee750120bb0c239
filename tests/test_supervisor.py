"""The supervisor in-process, with real tiny-model workers and a GPU reader that never frees."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from arbiterd.config import load_config
from arbiterd.supervisor import Supervisor
from arbiterd.telemetry import DeviceMemory, ProcessMemory, ReaderSet, Reading
from arbiterd.workerclient import WorkerProcess

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
            await supervisor.command("warm", "m")
            await supervisor.command("release", "m")
            leak = await next_event(events, "vram_not_freed")
            status = await supervisor.status()
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
    real_spawn = WorkerProcess.spawn
    failures = iter([OSError(errno.EMFILE, "Too many open files")])

    def spawn(*args: Any, **kwargs: Any) -> WorkerProcess:
        for exc in failures:
            raise exc
        return real_spawn(*args, **kwargs)

    monkeypatch.setattr(WorkerProcess, "spawn", spawn)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        supervisor = Supervisor(config)
        events = supervisor.subscribe()
        await supervisor.start()
        try:
            failed = await next_event(events, "worker")
            starting = (await supervisor.status())["models"][0]
            await next_event(events, "residency")  # the retried worker loaded its model
            return failed, starting
        finally:
            await supervisor.stop()

    failed, starting = asyncio.run(scenario())
    assert failed["reason"] == "could not start: EMFILE: Too many open files"
    assert failed["restart_in_s"] == 1.0
    assert starting["state"] == "restarting"
    assert starting["last_error"] == failed["reason"]
