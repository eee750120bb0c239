"""The tray's "Start at login" switch: the XDG autostart entry `arbiterd-tray.desktop`.

Owns reading and writing that one file in `$XDG_CONFIG_HOME/autostart/` (the Desktop Application
Autostart Specification). Never imports Qt, never touches another file. The entry is disabled,
by that spec and by GNOME's extension of it, when it says `Hidden=true` or
`X-GNOME-Autostart-enabled=false`; a user entry overrides a system one of the same name in
`$XDG_CONFIG_DIRS/autostart/` (default /etc/xdg), so switching off writes a user file with those
keys rather than deleting it (deleting would let a system-wide entry start the tray again).

Switching edits only those two keys of an existing file and keeps every other line as it is, so
an entry written by `arbiterd install` comes back byte for byte when switched off and on again.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

FILE_NAME = "arbiterd-tray.desktop"
GROUP = "[Desktop Entry]"
HIDDEN_KEY = "Hidden"
GNOME_ENABLED_KEY = "X-GNOME-Autostart-enabled"
DEFAULT_CONFIG_DIRS = "/etc/xdg"


def _config_home(env: Mapping[str, str]) -> Path:
    value = env.get("XDG_CONFIG_HOME", "")
    if value and os.path.isabs(value):  # the spec: a relative value is invalid, ignore it
        return Path(value)
    return Path(env.get("HOME") or Path.home()) / ".config"


def autostart_path(env: Mapping[str, str] | None = None) -> Path:
    """The user's entry: `$XDG_CONFIG_HOME/autostart/arbiterd-tray.desktop`."""
    return _config_home(os.environ if env is None else env) / "autostart" / FILE_NAME


def _system_paths(env: Mapping[str, str]) -> list[Path]:
    dirs = env.get("XDG_CONFIG_DIRS", "") or DEFAULT_CONFIG_DIRS
    return [Path(d) / "autostart" / FILE_NAME for d in dirs.split(":") if os.path.isabs(d)]


def arbiterd_command() -> str:
    """The absolute path of the `arbiterd` script of the running interpreter (its venv's bin/
    first, then PATH); the bare name when neither has one."""
    beside = Path(sys.executable).parent / "arbiterd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("arbiterd") or "arbiterd"


def _quote_exec_arg(arg: str) -> str:
    """Quote one Exec argument as the Desktop Entry spec says: reserved characters mean double
    quotes, inside which `"`, `` ` ``, `$` and `\\` are escaped with a backslash."""
    arg = arg.replace("%", "%%")  # a lone % starts a field code (%f, %u, ...)
    reserved = set(" \t\n\"'\\><~|&;$*?#()`")
    if arg and not set(arg) & reserved:
        return arg
    escaped = "".join("\\" + c if c in '"`$\\' else c for c in arg)
    # The desktop file's own string escaping doubles each backslash again.
    return '"' + escaped.replace("\\", "\\\\") + '"'


def desktop_entry(command: str | None = None) -> str:
    """The entry written when there is none yet; `command` defaults to `arbiterd_command()`."""
    exe = _quote_exec_arg(command or arbiterd_command())
    return (
        f"{GROUP}\n"
        "Type=Application\n"
        "Name=arbiterd tray\n"
        f"Exec={exe} tray\n"
        "Icon=arbiterd\n"
        f"{GNOME_ENABLED_KEY}=true\n"
    )


def _entry_enabled(text: str) -> bool:
    """Whether the [Desktop Entry] group of `text` leaves autostart on."""
    in_group = False
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            in_group = line == GROUP
            continue
        if not in_group or "=" not in line or line.startswith("#"):
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        if key == HIDDEN_KEY and value.lower() == "true":
            return False
        if key == GNOME_ENABLED_KEY and value.lower() == "false":
            return False
    return True


def is_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the tray starts at login: the user's entry decides when there is one, else the
    first system entry; no entry at all means no."""
    env = os.environ if env is None else env
    for path in (autostart_path(env), *_system_paths(env)):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            continue
        except OSError:
            return False  # unreadable: the session cannot start it either
        return _entry_enabled(text)
    return False


def _with_switch(text: str, enabled: bool) -> str:
    """`text` with the two keys set for `enabled`, every other line kept in place."""
    lines = text.splitlines()
    out: list[str] = []
    in_group = False
    group_end: int | None = None  # where a missing key is inserted: the end of the group
    seen_gnome = False
    for raw in lines:
        stripped = raw.strip()
        if stripped.startswith("["):
            if in_group and group_end is None:
                group_end = _before_blank_tail(out)
            in_group = stripped == GROUP
            out.append(raw)
            continue
        if in_group and "=" in stripped and not stripped.startswith("#"):
            key = stripped.split("=", 1)[0].strip()
            if key == HIDDEN_KEY:
                continue  # dropped; written back below when switching off
            if key == GNOME_ENABLED_KEY:
                seen_gnome = True
                out.append(f"{GNOME_ENABLED_KEY}={'true' if enabled else 'false'}")
                continue
        out.append(raw)
    if in_group and group_end is None:
        group_end = _before_blank_tail(out)
    if group_end is None:  # no [Desktop Entry] group at all: not ours to patch
        return desktop_entry() if enabled else _with_switch(desktop_entry(), False)
    extra: list[str] = []
    if not seen_gnome:
        extra.append(f"{GNOME_ENABLED_KEY}={'true' if enabled else 'false'}")
    if not enabled:
        extra.append(f"{HIDDEN_KEY}=true")
    out[group_end:group_end] = extra
    return "\n".join(out) + "\n"


def _before_blank_tail(lines: list[str]) -> int:
    """The index just after the last non-blank line: keys go before a group's blank tail."""
    end = len(lines)
    while end > 0 and not lines[end - 1].strip():
        end -= 1
    return end


def set_enabled(
    enabled: bool, env: Mapping[str, str] | None = None, command: str | None = None
) -> Path:
    """Switch starting at login on or off; returns the file written. Writes a new file by
    rename, so the session never reads half an entry. OSError when it cannot be written."""
    path = autostart_path(env)
    try:
        current: str | None = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        current = None
    if current is None:
        text = desktop_entry(command)
        if not enabled:
            text = _with_switch(text, False)
    else:
        text = _with_switch(current, enabled)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
