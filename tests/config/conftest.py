"""What the config tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A private environment: HOME and a 0700 XDG_RUNTIME_DIR under tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return {"HOME": str(home), "XDG_RUNTIME_DIR": str(run)}
