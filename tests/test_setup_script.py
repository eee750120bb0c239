"""scripts/setup.sh against a throwaway environment whose python stands in for pip: what a person
sees while the engine builds, when pip fails, and when nothing changed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"

# The venv's python as setup.sh drives it: `-m pip wheel ... -w DIR llama-cpp-python==V` builds
# the engine for $BUILD_S seconds, printing what pip prints when its output is not a terminal,
# records the CMAKE_ARGS it was given, and leaves a wheel in DIR (or exits $PIP_STATUS);
# `-m pip install` succeeds.
FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$(dirname "$0")/calls"
case "$*" in
*" wheel "*)
    echo "CMAKE_ARGS=$CMAKE_ARGS" >> "$(dirname "$0")/calls"
    echo "Collecting llama-cpp-python==0.3.36"
    echo "  Building wheel for llama-cpp-python (pyproject.toml): started"
    sleep "$BUILD_S"
    if [ "$PIP_STATUS" -ne 0 ]; then
        echo "  Building wheel for llama-cpp-python (pyproject.toml): finished with status 'error'"
        echo "ERROR: Failed building wheel for llama-cpp-python"
        exit "$PIP_STATUS"
    fi
    echo "  Building wheel for llama-cpp-python (pyproject.toml): finished with status 'done'"
    args=("$@")
    for ((i = 0; i < ${#args[@]}; i++)); do
        [ "${args[i]}" = -w ] && dir="${args[i + 1]}"
    done
    mkdir -p "$dir" && touch "$dir/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    ;;
*" -e "*)
    echo "Successfully installed arbiterd-0.1.0"
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
    venv: Path, *, build_s: float = 0, pip_status: int = 0, extras: str = "engine,dev"
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(venv.parent),
        "XDG_CACHE_HOME": str(venv.parent / "cache"),
        "ARBITERD_EXTRAS": extras,
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
        r"later runs reuse the built wheel",
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


def pip_calls(venv: Path) -> list[str]:
    """What setup asked pip to do (it also asks the venv's python for its cache tag)."""
    return [c for c in (venv / "bin" / "calls").read_text().splitlines() if "-m pip" in c]


def test_setup_says_nothing_when_nothing_changed(venv: Path) -> None:
    assert setup(venv).returncode == 0
    calls = pip_calls(venv)
    done = setup(venv)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert pip_calls(venv) == calls


def _fresh_venv(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    (path / "bin").mkdir(parents=True)
    python = path / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return path


def test_the_engine_is_built_once_and_reused_by_a_new_environment(
    venv: Path, tmp_path: Path
) -> None:
    assert setup(venv).returncode == 0
    other = _fresh_venv(tmp_path, "other")
    done = setup(other)
    assert done.returncode == 0, done.stderr
    assert "building llama-cpp-python" not in done.stderr
    calls = (other / "bin" / "calls").read_text()
    assert " wheel " not in calls
    assert "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl" in calls


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="AMX is an x86-64 extension")
def test_the_engine_is_built_without_amx(venv: Path) -> None:
    assert setup(venv).returncode == 0
    calls = (venv / "bin" / "calls").read_text()
    assert "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" in calls


def test_asking_for_more_extras_installs_them_and_fewer_installs_nothing(venv: Path) -> None:
    assert setup(venv, extras="engine,dev,demo").returncode == 0
    calls = pip_calls(venv)
    fewer = setup(venv, extras="engine,demo")
    assert (fewer.returncode, fewer.stderr) == (0, "")
    assert pip_calls(venv) == calls
    more = setup(venv, extras="engine,gui")
    assert more.returncode == 0, more.stderr
    assert "[engine,gui]" in (venv / "bin" / "calls").read_text()
