"""arbiterd as a wheel: pip builds it without a warning, and `arbiterd install` works from it,
away from any source tree (issue 16: it answered rc 73, reading its templates from packaging/)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
# What a source tree holds that a build must not see: environments, caches, earlier builds.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
)


@dataclass(frozen=True)
class Wheel:
    unpacked: Path
    build_output: str


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Wheel:
    """The wheel pip builds from a copy of the checkout, unpacked as pip would install it."""
    source = tmp_path_factory.mktemp("source") / "arbiterd"
    shutil.copytree(CHECKOUT, source, symlinks=True, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    # Without build isolation: the test environment's setuptools, and no index to reach.
    pip_wheel = ["pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check"]
    done = subprocess.run(
        [sys.executable, "-m", *pip_wheel, "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("arbiterd-*.whl")
    unpacked = tmp_path_factory.mktemp("site-packages")
    with zipfile.ZipFile(built) as archive:
        archive.extractall(unpacked)
    return Wheel(unpacked, done.stdout + done.stderr)


@pytest.mark.slow
def test_building_the_wheel_warns_about_nothing(wheel: Wheel) -> None:
    # The project's own metadata once drew a setuptools deprecation warning on every build.
    warnings = [line for line in wheel.build_output.splitlines() if re.search("warn", line, re.I)]
    assert warnings == [], wheel.build_output


@pytest.mark.slow
def test_install_works_from_the_wheel_outside_the_source_tree(wheel: Wheel, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    # A systemctl that only records what it is asked: the test reaches no user manager.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "systemctl.calls"
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    systemctl.chmod(0o755)
    env = {
        "HOME": str(home),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(wheel.unpacked),
    }

    def python(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=60,
            check=False,
        )

    where = python("-c", "import arbiterd.cli.install; print(arbiterd.cli.install.__file__)")
    assert where.stdout.startswith(str(wheel.unpacked)), where.stdout + where.stderr
    done = python("-m", "arbiterd", "install", "--no-enable")
    assert done.returncode == 0, done.stdout + done.stderr
    unit = home / ".config/systemd/user/arbiterd.service"
    assert f"ExecStart={Path(sys.executable).parent / 'arbiterd'} daemon" in unit.read_text()
    assert "Exec=" in (home / ".config/autostart/arbiterd-tray.desktop").read_text()
    assert (home / ".local/share/applications/arbiterd.desktop").is_file()
    assert (home / ".local/share/icons/hicolor/scalable/apps/arbiterd.svg").is_file()
    assert calls.read_text() == "--user daemon-reload\n"
