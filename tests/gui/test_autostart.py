"""The "Start at login" switch: the XDG autostart entry, read and written without Qt."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from arbiterd.gui import autostart

INSTALLED = (
    "[Desktop Entry]\n"
    "Type=Application\n"
    "Name=arbiterd tray\n"
    "Comment=Which model holds the GPU\n"
    "Exec=/opt/arbiterd/bin/arbiterd tray\n"
    "Icon=arbiterd\n"
    "X-GNOME-Autostart-enabled=true\n"
)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_entry_lives_in_xdg_config_home(autostart_env: dict[str, str]) -> None:
    expected = Path(autostart_env["XDG_CONFIG_HOME"]) / "autostart" / "arbiterd-tray.desktop"
    assert autostart.autostart_path(autostart_env) == expected


def test_a_relative_xdg_config_home_is_ignored(autostart_env: dict[str, str]) -> None:
    env = {**autostart_env, "XDG_CONFIG_HOME": "relative/config"}
    expected = Path(env["HOME"]) / ".config" / "autostart" / "arbiterd-tray.desktop"
    assert autostart.autostart_path(env) == expected


def test_no_entry_means_no_start_at_login(autostart_env: dict[str, str]) -> None:
    assert not autostart.is_enabled(autostart_env)


def test_switching_on_writes_the_entry_with_an_absolute_exec(
    autostart_env: dict[str, str],
) -> None:
    path = autostart.set_enabled(True, autostart_env, command="/usr/local/bin/arbiterd")
    assert path.read_text() == (
        "[Desktop Entry]\n"
        "Type=Application\n"
        "Name=arbiterd tray\n"
        "Exec=/usr/local/bin/arbiterd tray\n"
        "Icon=arbiterd\n"
        "X-GNOME-Autostart-enabled=true\n"
    )
    assert autostart.is_enabled(autostart_env)


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_exec_names_the_arbiterd_beside_the_interpreter_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = executable(tmp_path / "venv" / "bin" / "arbiterd")
    on_path = executable(tmp_path / "path" / "arbiterd")
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.setattr(sys, "executable", str(venv.parent / "python"))
    assert autostart.arbiterd_command() == str(venv)
    assert f"Exec={venv} tray\n" in autostart.desktop_entry()
    venv.unlink()
    assert autostart.arbiterd_command() == str(on_path)
    on_path.unlink()
    assert autostart.arbiterd_command() == "arbiterd"


@pytest.mark.parametrize("line", ["Hidden=true", "X-GNOME-Autostart-enabled=false"])
def test_hidden_or_gnome_disabled_means_off(autostart_env: dict[str, str], line: str) -> None:
    write(autostart.autostart_path(autostart_env), INSTALLED.replace("Icon=arbiterd", line))
    assert not autostart.is_enabled(autostart_env)


def test_switching_off_keeps_the_entry_and_marks_it_hidden(
    autostart_env: dict[str, str],
) -> None:
    path = write(autostart.autostart_path(autostart_env), INSTALLED)
    autostart.set_enabled(False, autostart_env)
    text = path.read_text()
    assert "Hidden=true\n" in text
    assert "X-GNOME-Autostart-enabled=false\n" in text
    assert "Exec=/opt/arbiterd/bin/arbiterd tray\n" in text  # the installed Exec is kept
    assert not autostart.is_enabled(autostart_env)


def test_off_then_on_gives_back_the_installed_entry_byte_for_byte(
    autostart_env: dict[str, str],
) -> None:
    path = write(autostart.autostart_path(autostart_env), INSTALLED)
    autostart.set_enabled(False, autostart_env)
    autostart.set_enabled(True, autostart_env)
    assert path.read_text() == INSTALLED


def test_a_user_entry_overrides_a_system_one(autostart_env: dict[str, str]) -> None:
    system = Path(autostart_env["XDG_CONFIG_DIRS"]) / "autostart" / "arbiterd-tray.desktop"
    write(system, INSTALLED)
    assert autostart.is_enabled(autostart_env)
    autostart.set_enabled(False, autostart_env)
    assert not autostart.is_enabled(autostart_env)
    assert system.read_text() == INSTALLED


def test_keys_of_other_groups_do_not_count(autostart_env: dict[str, str]) -> None:
    write(
        autostart.autostart_path(autostart_env),
        INSTALLED + "\n[Desktop Action quit]\nName=Quit\nHidden=true\n",
    )
    assert autostart.is_enabled(autostart_env)
    autostart.set_enabled(False, autostart_env)
    text = autostart.autostart_path(autostart_env).read_text()
    group, _, action = text.partition("[Desktop Action quit]")
    assert "Hidden=true" in group
    assert action == "\nName=Quit\nHidden=true\n"


def test_an_exec_path_with_spaces_is_quoted() -> None:
    entry = autostart.desktop_entry('/home/me/my apps/"x"/arbiterd')
    assert 'Exec="/home/me/my apps/\\\\"x\\\\"/arbiterd" tray\n' in entry
