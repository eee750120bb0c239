"""The docs' dashboard pictures are what their captions say (issue 30): scripts/docs-images.sh
renders each from the recording it names, and README.md's caption names the same one."""

from __future__ import annotations

import re
from pathlib import Path

from PySide6.QtGui import QImage
from pytestqt.qtbot import QtBot

from arbiterd.gui.app import main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "docs-images.sh"
# The share of sampled pixels that must match: the bands and the table are the picture; a
# machine with other fonts may draw the text a pixel apart.
SAME_PIXELS = 0.95


def rendered_by_script() -> dict[str, str]:
    """picture (under docs/) -> recording (under tests/gui/), as the script renders them."""
    return dict(re.findall(r"^render (\S+\.png) (\S+\.jsonl)$", SCRIPT.read_text(), re.M))


def test_the_script_renders_every_picture_from_a_recording_that_exists() -> None:
    pictures = rendered_by_script()
    assert "dashboard.png" in pictures
    for picture, recording in pictures.items():
        assert (ROOT / "docs" / picture).is_file(), picture
        assert (ROOT / "tests" / "gui" / recording).is_file(), recording


def test_the_readme_captions_the_dashboard_with_the_recording_it_is_rendered_from() -> None:
    readme = ROOT / "README.md"
    text = " ".join(readme.read_text().split())
    recording = f"tests/gui/{rendered_by_script()['dashboard.png']}"
    assert f"![The dashboard of {recording}, a sample session](docs/dashboard.png)" in text
    command = f"arbiterd tray --screenshot docs/dashboard.png --replay {recording}"
    assert f"`{command}`" in text
    assert "arbiterd demo --screenshot docs/dashboard.png" not in text  # it was not the demo's


def test_docs_dashboard_png_is_its_recording_rendered_now(qtbot: QtBot, tmp_path: Path) -> None:
    out = tmp_path / "dashboard.png"
    recording = ROOT / "tests" / "gui" / rendered_by_script()["dashboard.png"]
    assert main(["--screenshot", str(out), "--replay", str(recording)]) == 0
    now, committed = QImage(str(out)), QImage(str(ROOT / "docs" / "dashboard.png"))
    assert now.size() == committed.size()
    points = [(x, y) for x in range(0, now.width(), 4) for y in range(0, now.height(), 4)]
    same = sum(now.pixel(x, y) == committed.pixel(x, y) for x, y in points)
    assert same / len(points) >= SAME_PIXELS
