"""scripts/setup.sh against a throwaway environment whose python stands in for pip: what a person
sees while the engine builds, when pip fails, and when nothing changed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"

# The venv's python as setup.sh drives it: `-m pip install ...`. The editable install of arbiterd
# builds the engine for $BUILD_S seconds, printing what pip prints when its output is not a
# terminal, then exits $PIP_STATUS.
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/calls"
case "$*" in
*" -e "*)
    echo "Collecting llama-cpp-python==0.3.36"
    echo "  Building wheel for llama-cpp-python (pyproject.toml): started"
    sleep "$BUILD_S"
    if [ "$PIP_STATUS" -ne 0 ]; then
        echo "  Building wheel for llama-cpp-python (pyproject.toml): finished with status 'error'"
        echo "ERROR: Failed building wheel for llama-cpp-python"
        exit "$PIP_STATUS"
    fi
    echo "  Building wheel for llama-cpp-python (pyproject.toml): finished with status 'done'"
    echo "Successfully installed arbiterd-0.1.0 llama-cpp-python-0.3.36"
    ;;
esac
"""


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    path = tmp_path / "venv"
    (path / "bin").mkdir(parents=True)
    python = path / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return path


def setup(
    venv: Path, *, build_s: float = 0, pip_status: int = 0
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "ARBITERD_VENV": str(venv),
        "BUILD_S": str(build_s),
        "PIP_STATUS": str(pip_status),
    }
    return subprocess.run(
        ["bash", "-c", f"source {SETUP}"],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )


def test_setup_says_what_it_builds_and_that_later_runs_reuse_it(venv: Path) -> None:
    done = setup(venv, build_s=3)
    assert done.returncode == 0, done.stderr
    assert re.search(
        r"^setup: building llama-cpp-python [0-9.]+, the inference engine, from source;.*"
        r"later runs reuse pip's cached wheel",
        done.stderr,
        re.M,
    ), done.stderr
    assert "Collecting" not in done.stderr  # pip's own lines stay in its log
    assert "Successfully installed" in (venv / "setup.log").read_text()
    assert re.search(r"^setup: ready in 0 min 0[0-9] s$", done.stderr, re.M), done.stderr
    assert (venv / ".arbiterd-installed").exists()


def test_setup_that_fails_shows_the_end_of_pips_log(venv: Path) -> None:
    done = setup(venv, pip_status=1)
    assert done.returncode == 1
    assert "ERROR: Failed building wheel for llama-cpp-python" in done.stderr
    assert str(venv / "setup.log") in done.stderr
    assert not (venv / ".arbiterd-installed").exists()


def test_setup_says_nothing_when_nothing_changed(venv: Path) -> None:
    assert setup(venv).returncode == 0
    calls = (venv / "bin" / "calls").read_text()
    done = setup(venv)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert (venv / "bin" / "calls").read_text() == calls
