"""A benchmark's --help, as a user runs it: for the tests that check it names every option."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def benchmark_help(module: str) -> str:
    """The --help text of `python -m benchmarks.MODULE`, run from the repository root."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
