"""Fixtures of the tray tests: Qt without a display, short socket paths, a fake daemon.

QT_QPA_PLATFORM is set before anything imports Qt: the offscreen platform needs no display
(and has no system tray, which the tests inject where they want one).
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gui.fakes import FakeControlServer, GiB, model, status

SAMPLE_REPLAY = Path(__file__).parent / "replay-sample.jsonl"
# docs/tray.md's screenshots: two small models on a 24 GiB GPU, and one 14 GiB model on it.
SMALL_MODELS_REPLAY = Path(__file__).parent / "replay-small-models.jsonl"
LARGE_MODEL_REPLAY = Path(__file__).parent / "replay-large-model.jsonl"
# A vision model's projector, a group warm together, an unloaded model (issues 12 and 14).
MEMORY_VISION_REPLAY = Path(__file__).parent / "replay-memory-vision.jsonl"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a Unix socket path must fit in 108 bytes, and tmp_path
    may not."""
    path = Path(tempfile.mkdtemp(prefix="at", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def two_models() -> dict[str, object]:
    """alpha holds the GPU, warm and pinned; beta is cold and waits."""
    return status(
        model("alpha", "warm", pinned=True, resident_bytes=3 * GiB),
        model("beta", "cold", queue=2),
        holder="alpha",
        waiters=[{"pid": 77, "name": "beta"}],
    )


@pytest.fixture
def server(short_dir: Path, two_models: dict[str, object]) -> Iterator[FakeControlServer]:
    fake = FakeControlServer(short_dir / "control.sock", dict(two_models)).start()
    yield fake
    fake.stop()


@pytest.fixture
def autostart_env(tmp_path: Path) -> dict[str, str]:
    """An XDG environment in tmp_path, so no test touches the real ~/.config/autostart."""
    return {
        "HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_CONFIG_DIRS": str(tmp_path / "xdg"),
    }
