"""`arbiterd install` / `uninstall` into a temporary HOME, and the files validated by the tools
the desktop uses (desktop-file-validate, systemd-analyze verify)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from arbiterd.cli import install
from arbiterd.cli.install import (
    UNIT,
    Copy,
    Installer,
    autostart_path,
    copy_of_this_clone,
    manifest_path,
    placements,
    running_from_clone,
    venv_path,
)
from arbiterd.config import load_config
from arbiterd.errors import InstallError

# The templates as the source tree holds them.
PACKAGING = Path(__file__).resolve().parents[2] / "packaging"


class Systemctl:
    """Records `systemctl --user` calls and answers as a user manager would (or would not)."""

    def __init__(self, returncode: int = 0, stderr: str = "") -> None:
        self.calls: list[list[str]] = []
        self.returncode = returncode
        self.stderr = stderr

    def __call__(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(command)
        return subprocess.CompletedProcess(command, self.returncode, "", self.stderr)


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    """A user with nothing installed: HOME and the XDG directories under tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    return {"HOME": str(home), "PATH": os.environ["PATH"]}


def installer(
    env: dict[str, str], systemctl: Systemctl, **kwargs: Any
) -> tuple[Installer, list[str]]:
    lines: list[str] = []
    return Installer(env, run=systemctl, say=lines.append, **kwargs), lines


def written(env: dict[str, str]) -> dict[Path, str]:
    root = Path(env["HOME"])
    return {p: p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_dry_run_writes_nothing_and_says_everything(home: dict[str, str]) -> None:
    systemctl = Systemctl()
    tool, lines = installer(home, systemctl, dry_run=True)
    tool.install()
    assert written(home) == {}
    assert systemctl.calls == []
    assert any(line.startswith("would write") and UNIT in line for line in lines)
    assert "would run systemctl --user enable --now arbiterd.service" in lines


def test_install_writes_the_files_and_enables_the_service(home: dict[str, str]) -> None:
    systemctl = Systemctl()
    tool, _ = installer(home, systemctl)
    tool.install()
    files = written(home)
    unit = Path(home["HOME"]) / ".config/systemd/user/arbiterd.service"
    assert unit in files
    assert not [
        line for line in files[unit].splitlines() if line.startswith("Exec") and "@" in line
    ]
    assert f"ExecStart={Path(sys.executable).parent / 'arbiterd'} daemon" in files[unit]
    assert autostart_path(home) in files
    assert Path(home["HOME"]) / ".local/share/applications/arbiterd.desktop" in files
    assert Path(home["HOME"]) / ".local/share/icons/hicolor/scalable/apps/arbiterd.svg" in files
    assert manifest_path(home) in files
    assert systemctl.calls == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", UNIT],
    ]


def test_no_enable_writes_but_starts_nothing(home: dict[str, str]) -> None:
    systemctl = Systemctl()
    installer(home, systemctl)[0].install(enable=False)
    assert systemctl.calls == [["systemctl", "--user", "daemon-reload"]]


def test_install_twice_changes_nothing(home: dict[str, str]) -> None:
    installer(home, Systemctl())[0].install()
    first = written(home)
    tool, lines = installer(home, Systemctl())
    tool.install()
    assert written(home) == first
    assert all(not line.startswith("wrote") for line in lines)


def test_uninstall_removes_exactly_what_install_wrote(home: dict[str, str]) -> None:
    own = Path(home["HOME"]) / ".config/autostart/other-app.desktop"
    own.parent.mkdir(parents=True)
    own.write_text("[Desktop Entry]\nType=Application\nName=x\nExec=x\n")
    installer(home, Systemctl())[0].install()
    systemctl = Systemctl()
    installer(home, systemctl)[0].uninstall()
    assert list(written(home)) == [own]
    assert systemctl.calls[0] == ["systemctl", "--user", "disable", "--now", UNIT]
    installer(home, Systemctl())[0].uninstall()  # idempotent
    assert list(written(home)) == [own]


def folders(env: dict[str, str]) -> list[Path]:
    root = Path(env["HOME"])
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_dir())


def test_uninstall_removes_the_folders_install_made_and_keeps_the_others(
    home: dict[str, str],
) -> None:
    own = Path(home["HOME"]) / ".config/autostart/other-app.desktop"
    own.parent.mkdir(parents=True)
    own.write_text("[Desktop Entry]\nType=Application\nName=x\nExec=x\n")
    before = folders(home)
    installer(home, Systemctl())[0].install()
    assert len(folders(home)) > len(before)
    # The daemon ran meanwhile: its journal is in the state folder install made.
    journal = manifest_path(home).parent / "journal.sqlite3"
    journal.write_text("")
    tool, lines = installer(home, Systemctl())
    tool.uninstall()
    state = journal.parent.relative_to(home["HOME"])  # kept, with the folders above it
    assert folders(home) == sorted({*before, state, *state.parents} - {Path()})
    assert f"kept     {journal.parent} (it holds files of yours or arbiterd's journal)" in lines


def test_an_install_from_a_clone_says_the_service_runs_from_it(home: dict[str, str]) -> None:
    assert running_from_clone() == PACKAGING.parent  # these tests run from the source tree
    tool, lines = installer(home, Systemctl())
    tool.install()
    assert any(
        line.startswith("note     the service runs")
        and f"from the clone at {PACKAGING.parent}" in line
        for line in lines
    )


def test_a_config_found_models_are_served_and_it_is_never_overwritten(
    home: dict[str, str], tiny_model: Path, tiny_mmproj: Path
) -> None:
    models = Path(home["HOME"]) / "models"
    models.mkdir()
    shutil.copy(tiny_model, models / "qwen-7b.gguf")
    shutil.copy(tiny_mmproj, models / "qwen-7b-mmproj.gguf")  # a projector is not a model
    installer(home, Systemctl())[0].install()
    config_file = Path(home["HOME"]) / ".config/arbiterd/config.toml"
    env = {**home, "XDG_RUNTIME_DIR": str(Path(home["HOME"]))}
    Path(home["HOME"]).chmod(0o700)
    config = load_config(config_file, env=env)
    assert list(config.models) == ["arbiterd-tiny-llama"]  # its GGUF's general.name
    assert config.models["arbiterd-tiny-llama"].path == models / "qwen-7b.gguf"
    config_file.write_text(config_file.read_text() + "\n# mine\n")
    tool, lines = installer(home, Systemctl())
    tool.install()
    assert config_file.read_text().endswith("# mine\n")
    assert any(line.startswith("kept") and "config.toml" in line for line in lines)
    installer(home, Systemctl())[0].uninstall()
    assert config_file.exists()  # changed by the user since install: kept


def test_without_models_no_config_is_written(home: dict[str, str]) -> None:
    models = Path(home["HOME"]) / "models"
    models.mkdir()
    (models / "broken.gguf").write_bytes(b"GGUF")  # cut off: no model, and said so
    tool, lines = installer(home, Systemctl())
    tool.install()
    assert not (Path(home["HOME"]) / ".config/arbiterd/config.toml").exists()
    assert f"note     skipped {models / 'broken.gguf'}: it is a truncated GGUF file" in " ".join(
        lines
    )
    skipped = next(line for line in lines if "embedded default" in line)
    assert f"no GGUF found in {Path(home['HOME']) / '.ollama/models'}, " in skipped


def test_without_a_user_manager_it_says_what_to_do(home: dict[str, str]) -> None:
    systemctl = Systemctl(1, "Failed to connect to bus: No medium found")
    tool, lines = installer(home, systemctl)
    tool.install()
    assert len(systemctl.calls) == 1  # stops after the first failure
    assert any("No medium found" in line and "arbiterd daemon" in line for line in lines)
    assert autostart_path(home).exists()  # the files are written all the same


def test_desktop_files_are_valid(home: dict[str, str]) -> None:
    validate = shutil.which("desktop-file-validate")
    assert validate is not None, "desktop-file-utils is installed by scripts/test.sh"
    installer(home, Systemctl())[0].install()
    for placement in placements(home):
        if placement.target.suffix == ".desktop":
            done = subprocess.run(
                [validate, str(placement.target)], capture_output=True, text=True, check=False
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert done.stdout == "", done.stdout  # not even a hint


def test_the_unit_passes_systemd_analyze_verify(home: dict[str, str], tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd is installed by scripts/test.sh"
    installer(home, Systemctl())[0].install()
    unit = next(p.target for p in placements(home) if p.target.name == UNIT)
    # System mode works without a running manager (--user needs one, which CI lacks).
    done = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = unit.read_text()
    for line in (
        "Type=notify",
        "Restart=on-failure",
        "NoNewPrivileges=true",
        "WantedBy=default.target",
    ):
        assert line in text


def test_the_units_comment_is_written_as_the_template_has_it(home: dict[str, str]) -> None:
    installer(home, Systemctl())[0].install()
    unit = next(p.target for p in placements(home) if p.target.name == UNIT)
    template = PACKAGING / "systemd" / UNIT

    def comments(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("#")]

    assert comments(unit.read_text()) == comments(template.read_text())
    assert "`arbiterd install` writes this file, with @ARBITERD@\n" in unit.read_text()


def test_uninstall_without_a_user_manager_says_there_is_no_service_to_stop(
    home: dict[str, str],
) -> None:
    no_manager = Systemctl(1, "Failed to connect to bus: No medium found")
    installer(home, no_manager)[0].install()
    tool, lines = installer(home, no_manager)
    tool.uninstall()
    (note,) = [line for line in lines if line.startswith("note")]
    assert "No medium found" in note
    assert "no service to stop" in note
    assert "start `arbiterd daemon`" not in note
    assert written(home) == {}  # the files go all the same


def test_uninstall_with_nothing_installed_says_so_and_runs_nothing(
    home: dict[str, str],
) -> None:
    systemctl = Systemctl()
    tool, lines = installer(home, systemctl)
    tool.uninstall()
    assert systemctl.calls == []
    assert lines == [f"nothing to undo: no record of an install in {manifest_path(home)}"]


def test_arbiterds_own_folders_are_private_under_umask_022(
    home: dict[str, str], tiny_model: Path
) -> None:
    models = Path(home["HOME"]) / "models"
    models.mkdir()
    shutil.copy(tiny_model, models / "m.gguf")
    old = os.umask(0o022)
    try:
        installer(home, Systemctl())[0].install()
    finally:
        os.umask(old)
    root = Path(home["HOME"])
    for folder in (".config/arbiterd", ".local/state", ".local/state/arbiterd"):
        assert stat.S_IMODE((root / folder).stat().st_mode) == 0o700, folder
    # The desktop's own folders are made as the desktop makes them.
    assert stat.S_IMODE((root / ".config/autostart").stat().st_mode) == 0o755


def test_install_copy_puts_this_clone_in_a_venv_of_its_own_that_the_unit_runs(
    home: dict[str, str],
) -> None:
    # Real: a venv, the clone built into a wheel, installed there. Without its dependencies,
    # which pip would take from the package index (the engine from its cache).
    copy = replace(copy_of_this_clone(home), with_deps=False)
    venv = venv_path(home)
    assert copy.venv == venv
    tool, lines = installer(home, Systemctl())
    tool.install(copy=copy)
    unit = next(p.target for p in placements(home) if p.target.name == UNIT).read_text()
    assert f"ExecStart={venv}/bin/arbiterd daemon" in unit
    assert os.access(venv / "bin" / "arbiterd", os.X_OK)
    probe = (
        "import importlib.metadata as m, importlib.resources as r, arbiterd; "
        "print(arbiterd.__file__); print(m.version('arbiterd')); "
        "print((r.files('arbiterd') / '_packaging/systemd/arbiterd.service').is_file())"
    )
    shown = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout.split()
    assert shown[0].startswith(str(venv))  # the copy's code, not the clone's
    assert shown[2] == "True"  # with the templates the next install --copy renders
    assert any(
        line.startswith(f"note     the service runs {venv}/bin/arbiterd, a copy of the clone at")
        for line in lines
    )
    tool.uninstall()
    assert not venv.exists()
    assert not venv.parent.exists()  # $XDG_DATA_HOME/arbiterd: install made it, nothing else


def test_install_copy_with_its_dependencies_pins_the_engine_pip_built_here(
    tmp_path: Path,
) -> None:
    copy = Copy(
        Path("/src/arbiterd"),
        tmp_path / "venv",
        ("engine", "gui"),
        ("llama-cpp-python==0.3.36",),
    )
    steps = copy.steps(tmp_path / "wheels")
    python = str(tmp_path / "venv" / "bin" / "python")
    wheel = str(tmp_path / "wheels" / "arbiterd-*.whl")
    assert steps[0] == [sys.executable, "-m", "venv", str(tmp_path / "venv")]
    assert steps[1][-1] == "/src/arbiterd"
    assert steps[2][:4] == [python, "-m", "pip", "install"]
    assert steps[2][-2:] == [f"{wheel}[engine,gui]", "llama-cpp-python==0.3.36"]
    assert steps[3][-3:] == ["--force-reinstall", "--no-deps", wheel]


def test_install_copy_dry_run_says_each_step_and_makes_nothing(home: dict[str, str]) -> None:
    tool, lines = installer(home, Systemctl(), dry_run=True)
    tool.install(copy=copy_of_this_clone(home))
    assert not venv_path(home).exists()
    assert sum(line.startswith("would run ") and "pip" in line for line in lines) == 3


def test_install_copy_of_an_arbiterd_that_is_no_clone_is_refused(
    home: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(install, "running_from_clone", lambda: None)
    with pytest.raises(InstallError, match="run `arbiterd install` without --copy"):
        copy_of_this_clone(home)


def test_dry_run_shows_the_starter_config_it_would_write(
    home: dict[str, str], tiny_model: Path
) -> None:
    """Issue 47: read before it is written, so a user sees what install would serve."""
    models = Path(home["HOME"]) / "models"
    models.mkdir()
    shutil.copyfile(tiny_model, models / "coder.gguf")
    tool, lines = installer(home, Systemctl(), dry_run=True)
    tool.install()
    config = Path(home["HOME"]) / ".config/arbiterd/config.toml"
    at = lines.index(f"would write    {config}")
    shown = lines[at + 1]
    assert shown.startswith("    # arbiterd configuration")
    assert f'    path = "{models / "coder.gguf"}"' in shown.splitlines()
    assert not config.exists()
