"""`arbiterd tray` from its command line: --screenshot from a replay or a running daemon."""

from __future__ import annotations

import sys
from pathlib import Path

import PySide6
import pytest
from PySide6.QtGui import QImage
from pytestqt.qtbot import QtBot

from arbiterd.gui import palette
from arbiterd.gui.app import main, pyside_leaks_none
from arbiterd.gui.dashboard import SCREENSHOT_SIZE
from tests.gui.conftest import SAMPLE_REPLAY
from tests.gui.fakes import FakeControlServer


def colours(image: QImage) -> set[tuple[int, int, int]]:
    """Every colour on a coarse grid over the image."""
    found = set()
    for x in range(0, image.width(), 7):
        for y in range(0, image.height(), 7):
            colour = image.pixelColor(x, y)
            found.add((colour.red(), colour.green(), colour.blue()))
    return found


def test_a_screenshot_of_a_replay(
    qtbot: QtBot, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dashboard.png"
    assert main(["--screenshot", str(out), "--replay", str(SAMPLE_REPLAY)]) == 0
    image = QImage(str(out))
    assert (image.width(), image.height()) == (SCREENSHOT_SIZE.width(), SCREENSHOT_SIZE.height())
    assert out.stat().st_size > 20_000  # a real picture, not a blank one
    seen = colours(image)
    for name in ("qwen-coder", "llama-chat"):
        assert palette.model_colour(name) in seen, name
    assert palette.OTHER in seen
    assert capsys.readouterr().out == f"wrote {out} (1120x820)\n"


def test_a_screenshot_of_the_running_daemon(
    qtbot: QtBot, server: FakeControlServer, tmp_path: Path
) -> None:
    out = tmp_path / "live.png"
    journal = tmp_path / "no-journal.sqlite3"  # none yet: the picture still comes
    argv = ["--screenshot", str(out), "--socket", str(server.path), "--journal", str(journal)]
    assert main(argv) == 0
    assert palette.model_colour("alpha") in colours(QImage(str(out)))


def test_no_daemon_and_no_replay_is_a_clear_error(
    qtbot: QtBot, short_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "none.png"
    socket = short_dir / "nobody.sock"
    argv = ["--screenshot", str(out), "--socket", str(socket), "--journal", str(tmp_path / "j")]
    assert main(argv) == 69
    error = capsys.readouterr().err
    assert error.startswith(f"arbiterd tray: cannot reach arbiterd on {socket}")
    assert "--replay FILE" in error
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--replay", "x.jsonl"], 64, "use it with --screenshot"),
        (["--screenshot", "x.jpg", "--replay", "x.jsonl"], 64, "writes a PNG"),
        (["--screenshot", "x.png", "--replay", "/nonexistent.jsonl"], 65, "cannot read the replay"),
    ],
)
def test_bad_arguments_are_one_line_and_an_exit_status(
    qtbot: QtBot, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str
) -> None:
    assert main(argv) == code
    error = capsys.readouterr().err
    assert error.startswith("arbiterd tray: ")
    assert message in error
    assert error.count("\n") == 1


def test_pyside_keeps_its_references_to_none(qtbot: QtBot) -> None:
    # PySide6 6.12.0 on CPython 3.11 drops one on each Qt call that returns nothing; the process
    # (a tray running for days, this test run) aborts once None's count reaches zero. The tray
    # refuses to start on it; the fix is another PySide6 (!=6.12.0) or Python 3.12+.
    assert not pyside_leaks_none(), (
        f"PySide6 {PySide6.__version__} on Python {sys.version.split()[0]} leaks references to "
        "None: pin PySide6-Essentials!=6.12.0"
    )
