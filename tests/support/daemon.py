"""A real arbiterd daemon in a subprocess, on private paths, for integration tests."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import openai

from arbiterd.cli.controlclient import ControlClient
from arbiterd.errors import DaemonNotRunningError
from arbiterd.tomltable import toml_key

START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def serving(models: dict[str, dict[str, Any]], **options: Any) -> Iterator[Daemon]:
    """A daemon of `models` (Daemon's arguments), once every model has left starting and
    loading; stopped and its folder removed after, also when it never got ready."""
    running = Daemon(models, **options)
    try:
        running.wait_ready()
        yield running
    finally:
        running.cleanup()


def openai_client(daemon: Daemon, timeout_s: float = 60) -> openai.OpenAI:
    """The openai SDK on `daemon`'s HTTP API, without retries (a test sees the first answer)."""
    return openai.OpenAI(base_url=daemon.url, api_key="unused", max_retries=0, timeout=timeout_s)


def tiny(
    path: Path, *, n_ctx: int = 2048, min_hold_s: float = 0.05, **extra: Any
) -> dict[str, Any]:
    """A [models.NAME] table for a tiny test model on the CPU, holding the GPU briefly so that
    handoffs are quick; `extra` adds or overrides keys."""
    return {"path": path, "n_ctx": n_ctx, "n_gpu_layers": 0, "min_hold_s": min_hold_s, **extra}


class Daemon:
    """`python -m arbiterd daemon --config FILE` with its own socket, arena and journal.

    The directory is short (under /tmp) because a Unix socket path must fit in 108 bytes."""

    def __init__(
        self,
        models: dict[str, dict[str, Any]],
        *,
        api_key: str = "",
        env: dict[str, str] | None = None,
        port: int | None = None,
        daemon_keys: dict[str, Any] | None = None,
        groups: dict[str, list[str]] | None = None,
        open_files: tuple[int, int] | None = None,
        journal: Path | None = None,
        yield_keys: dict[str, Any] | None = None,
        pasted: str = "",
    ) -> None:
        """`daemon_keys` are more [daemon] keys; `groups` each [groups.NAME]'s models;
        `yield_keys` the [yield] table's (issue 45: by default the daemon steps aside for
        nothing in a test, whatever runs on the machine; {} writes no table, the daemon's
        defaults apply); `pasted` is TOML put at the file's end as a user pastes it;
        `open_files` the daemon's RLIMIT_NOFILE at start, (soft, hard); `journal` where the
        journal is (its folder holds the prompt caches too), when not in the daemon's folder."""
        limit = None
        if open_files is not None:
            limit = partial(resource.setrlimit, resource.RLIMIT_NOFILE, open_files)
        self.dir = Path(tempfile.mkdtemp(prefix="ad-", dir="/tmp"))
        self.port = port or free_port()
        self.socket = self.dir / "control.sock"
        self.api_socket = self.dir / "api.sock"  # the default: beside the control socket
        self.arena = self.dir / "arena"
        self.journal = journal or self.dir / "journal.sqlite3"
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = self.dir / "daemon.log"
        self.config = self.dir / "config.toml"
        self.config.write_text(
            self._toml(models, api_key, daemon_keys or {}, groups or {}, yield_keys) + pasted
        )
        with self.log.open("w") as log:  # the child keeps its own copy of the fd
            self.process = subprocess.Popen(
                [sys.executable, "-m", "arbiterd", "daemon", "--config", str(self.config)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
                # One C call between fork and exec: it takes no lock another thread could hold.
                preexec_fn=limit,  # noqa: PLW1509
            )

    def _toml(
        self,
        models: dict[str, dict[str, Any]],
        api_key: str,
        daemon_keys: dict[str, Any],
        groups: dict[str, list[str]],
        yield_keys: dict[str, Any] | None,
    ) -> str:
        lines = [
            "[daemon]",
            f'http = "127.0.0.1:{self.port}"',
            f'socket = "{self.socket}"',
            f'arena = "{self.arena}"',
            f'journal = "{self.journal}"',
            f'api_key = "{api_key}"',
            *(f"{key} = {_toml_value(value)}" for key, value in daemon_keys.items()),
        ]
        # Before the models: a test may add keys to the last model's table at the file's end.
        rules = {"enabled": False} if yield_keys is None else yield_keys
        if rules:  # {}: no table, the daemon's defaults
            lines += ["", "[yield]", *(f"{key} = {_toml_value(v)}" for key, v in rules.items())]
        for name, keys in models.items():
            lines += ["", f"[models.{toml_key(name)}]"]
            lines += [f"{key} = {_toml_value(value)}" for key, value in keys.items()]
        for name, members in groups.items():
            lines += ["", f"[groups.{name}]", f"models = {_toml_value(members)}"]
        return "\n".join(lines) + "\n"

    def client(self) -> ControlClient:
        return ControlClient.connect(self.socket)

    def wait_ready(self, states: Iterable[str] = ("warm", "cold", "failed")) -> dict[str, Any]:
        """Wait until the control socket answers and every model has left starting/loading."""
        wanted = set(states)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"daemon exited early:\n{self.log.read_text()}")
            try:
                with self.client() as client:
                    status: dict[str, Any] = client.call("status")
                models = status["models"]  # every daemon serves one at least: none yet is not ready
                if models and all(m["state"] in wanted for m in models):
                    return status
            except DaemonNotRunningError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon not ready:\n{self.log.read_text()}")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def cleanup(self) -> None:
        self.stop()
        for path in sorted(self.dir.rglob("*"), reverse=True):
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()
        self.dir.rmdir()


def _toml_value(value: Any) -> str:
    if isinstance(value, str | Path):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml_value, value)) + "]"
    if isinstance(value, dict):  # an inline table
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return str(value)


def environment_without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}


def arbiterd_cli(*args: str) -> str:
    """What `arbiterd ARGS` prints, run as a user runs it (a process of its own); it must
    succeed."""
    done = subprocess.run(
        [sys.executable, "-m", "arbiterd", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout
