"""How the tray starts a daemon that is not running: the systemd user unit when there is one,
else `arbiterd daemon` itself. Pure: it only says which command; the tray runs it detached.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from arbiterd.gui.autostart import arbiterd_command

UNIT = "arbiterd.service"


def _unit_dirs(env: Mapping[str, str]) -> list[Path]:
    """systemd's user unit search path (systemd.unit(5)), the directories a package or
    `arbiterd install` may have put the unit in."""
    home = Path(env.get("HOME") or Path.home())
    config = env.get("XDG_CONFIG_HOME") or str(home / ".config")
    data = env.get("XDG_DATA_HOME") or str(home / ".local" / "share")
    return [
        Path(config) / "systemd" / "user",
        Path("/etc/systemd/user"),
        Path(data) / "systemd" / "user",
        Path("/usr/local/lib/systemd/user"),
        Path("/usr/lib/systemd/user"),
    ]


def daemon_start_command(
    socket: Path | None = None,
    config: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """`systemctl --user start arbiterd.service` when the unit is installed (systemd then owns
    the daemon and restarts it), else `arbiterd daemon`. A tray given its own --socket or
    --config starts a daemon of its own with them: the unit would serve the default ones."""
    env = os.environ if env is None else env
    systemctl = shutil.which("systemctl")
    installed = any((directory / UNIT).is_file() for directory in _unit_dirs(env))
    if socket is None and config is None and systemctl is not None and installed:
        return [systemctl, "--user", "start", UNIT]
    argv = [arbiterd_command(), "daemon"]
    if socket is not None:
        argv += ["--socket", str(socket)]
    if config is not None:
        argv += ["--config", str(config)]
    return argv
