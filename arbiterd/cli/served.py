"""What arbiterd serves, as `arbiterd models` lists it beside the models found: the running
daemon's models, as its status says, else those of the config a daemon would load now (the
embedded default's where there is no file). Reads the status or the config; changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiterd.cli.controlclient import ControlClient
from arbiterd.config import configured_models, default_config_path, load_daemon_config
from arbiterd.errors import DaemonNotRunningError, RuntimeDirError
from arbiterd.status import DaemonStatus


@dataclass(frozen=True)
class ServedModel:
    name: str
    aliases: tuple[str, ...]
    path: Path  # its GGUF, as the config names it


@dataclass(frozen=True)
class Served:
    """The models served, and by what: the running daemon (`pid`), else its config file
    (`config`), else the embedded default (neither)."""

    models: tuple[ServedModel, ...]
    pid: int | None = None
    config: Path | None = None

    @property
    def by(self) -> str:
        """Who serves them, as a heading says it."""
        if self.pid is not None:
            return f"served by the running daemon (pid {self.pid})"
        if self.config is not None:
            return f"served by {self.config} once arbiterd runs (it is not running)"
        return (
            "served by the embedded default once arbiterd runs (it is not running; "
            f"no config at {default_config_path()})"
        )

    def to_json(self) -> dict[str, Any]:
        """`served` of `arbiterd models --json`; its keys are a public interface."""
        return {
            "pid": self.pid,
            "config": None if self.config is None else str(self.config),
            "models": [
                {"name": m.name, "aliases": list(m.aliases), "path": str(m.path)}
                for m in self.models
            ],
        }

    def name_of(self, path: Path) -> str | None:
        """The name a served model of the file at `path` is served under (the same file by
        another path too: a symlink, an Ollama blob); None when none is."""
        found = _identity(path)
        for model in self.models:
            if found is not None and _identity(model.path) == found:
                return model.name
        return None


def served(config: Path | None) -> Served:
    """What the daemon of `config` (None: the default path) serves: asked of it where it runs,
    else read from the config. Raises ConfigError for a config that cannot be read."""
    try:
        socket = load_daemon_config(config).socket
        with ControlClient.connect(socket) as client:
            pid = client.peer_pid()
            status = DaemonStatus.from_json(client.call("status"))
    except (DaemonNotRunningError, RuntimeDirError):
        return configured(config)
    return Served(
        tuple(ServedModel(m.name, m.aliases, Path(m.path)) for m in status.models), pid=pid
    )


def configured(config: Path | None) -> Served:
    """What a daemon of `config` (None: the default path) would serve, read from the config.
    Raises ConfigError for a config that cannot be read."""
    source, models = configured_models(config)
    return Served(
        tuple(ServedModel(m.name, m.aliases, m.path) for m in models.values()), config=source
    )


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
