"""`arbiterd tray` from its command line: --screenshot from a replay or a running daemon."""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import PySide6
import pytest
from PySide6.QtGui import QImage
from pytestqt.qtbot import QtBot

from arbiterd.gui import palette
from arbiterd.gui.app import _fetch_live, main, pyside_leaks_none, uses_xcb
from arbiterd.gui.dashboard import SCREENSHOT_SIZE
from arbiterd.gui.history import HISTORY_LEAD_S
from arbiterd.gui.replay import load_replay
from arbiterd.gui.state import TrayState
from tests.gui.conftest import (
    LARGE_MODEL_REPLAY,
    MEMORY_VISION_REPLAY,
    SAMPLE_REPLAY,
    SMALL_MODELS_REPLAY,
)
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
    models = palette.model_colours(["qwen-coder", "llama-chat"])
    for name in ("qwen-coder", "llama-chat"):
        assert models.of(name) in seen, name
    assert palette.OTHER in seen
    assert capsys.readouterr().out == f"wrote {out} (1120x820)\n"


def test_a_screenshot_of_the_running_daemon(
    qtbot: QtBot, server: FakeControlServer, tmp_path: Path
) -> None:
    out = tmp_path / "live.png"
    assert main(["--screenshot", str(out), "--socket", str(server.path)]) == 0
    assert palette.model_colours(["alpha", "beta"]).of("alpha") in colours(QImage(str(out)))
    # Its history came from the daemon it pictures (an empty one here): no file was read.
    assert any(r["command"] == "events" for r in server.requests_seen())


def test_a_screenshot_shows_the_history_of_the_daemon_it_is_connected_to(
    qtbot: QtBot, server: FakeControlServer
) -> None:
    now = time.time()
    handoff = {"event": "handoff", "at": now - 60, "from": "beta", "to": "alpha",
               "waited_from": now - 61, "wait_s": 0.5, "restore_s": 0.5}  # fmt: skip
    old = {**handoff, "at": now - 7200}  # before the window and its lead: not asked for
    server.journal(old, handoff)
    state = TrayState()
    _fetch_live(state, server.path)
    (record,) = state.history.handoffs
    assert (record.at, record.title) == (now - 60, "beta → alpha")
    assert state.status is not None
    assert state.status.holder_model == "alpha"
    (asked,) = [r for r in server.requests_seen() if r["command"] == "events"]
    window_start = now - state.history.window_s - HISTORY_LEAD_S
    assert window_start - 5 <= asked["since"] <= window_start + 5


def test_no_daemon_and_no_replay_is_a_clear_error(
    qtbot: QtBot, short_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "none.png"
    socket = short_dir / "nobody.sock"
    argv = ["--screenshot", str(out), "--socket", str(socket)]
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


def test_small_models_on_a_big_gpu_are_bands_in_the_screenshot(
    qtbot: QtBot, tmp_path: Path
) -> None:
    """Two models of 250 and 100 MiB on 24 GiB: each fills a band (tens of thousands of
    pixels), not the two-pixel line a whole-device axis drew."""
    out = tmp_path / "small.png"
    assert main(["--screenshot", str(out), "--replay", str(SMALL_MODELS_REPLAY)]) == 0
    image = QImage(str(out))
    models = palette.model_colours(["gemma-3-270m", "smollm2-135m"])
    counts = dict.fromkeys((models.of("gemma-3-270m"), models.of("smollm2-135m")), 0)
    for x in range(0, image.width(), 2):
        for y in range(0, image.height(), 2):
            colour = image.pixelColor(x, y)
            rgb = (colour.red(), colour.green(), colour.blue())
            if rgb in counts:
                counts[rgb] += 1
    assert len(counts) == 2  # two colours
    assert min(counts.values()) * 4 > 10_000, counts


@pytest.mark.parametrize("replay", [SMALL_MODELS_REPLAY, LARGE_MODEL_REPLAY, MEMORY_VISION_REPLAY])
def test_the_recordings_of_docs_tray_md_render_each_model_in_its_colour(
    qtbot: QtBot, tmp_path: Path, replay: Path
) -> None:
    out = tmp_path / "doc.png"
    assert main(["--screenshot", str(out), "--replay", str(replay)]) == 0
    last = [item.status for item in load_replay(replay) if item.status is not None][-1]
    names = [m["name"] for m in last["models"]]
    seen = colours(QImage(str(out)))
    for name in names:
        assert palette.model_colours(names).of(name) in seen, name


@pytest.mark.parametrize(
    ("environ", "xcb"),
    [
        ({"DISPLAY": ":0"}, True),
        ({"DISPLAY": ":0", "XDG_SESSION_TYPE": "x11"}, True),
        ({"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland"}, False),
        ({"QT_QPA_PLATFORM": "xcb", "XDG_SESSION_TYPE": "wayland"}, True),
        ({"QT_QPA_PLATFORM": "wayland;xcb"}, False),
        ({"QT_QPA_PLATFORM": "offscreen"}, False),
    ],
)
def test_qt_starts_on_xcb_outside_wayland_or_when_asked(environ: dict[str, str], xcb: bool) -> None:
    assert uses_xcb(environ) is xcb


def test_a_tray_without_qts_xcb_libraries_names_the_package_to_install(
    qtbot: QtBot,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Qt 6.5+ needs libxcb-cursor0, which many desktops lack: one line naming it, status 69,
    before any QApplication (whose failure would be an abort with Qt's own lines)."""

    def cdll(name: str) -> None:  # every other library of the plugin is there
        if name == "libxcb-cursor.so.0":
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    for name in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setenv("XDG_SESSION_TYPE", "x11")
    # A config that is not there: a tray that went past the check would stop on it instead.
    assert main(["--config", str(tmp_path / "no-config.toml")]) == 69
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert error.startswith("arbiterd tray: Qt cannot load its xcb platform plugin")
    assert error.rstrip().endswith("sudo apt install libxcb-cursor0)")


def test_pyside_keeps_its_references_to_none(qtbot: QtBot) -> None:
    # PySide6 6.12.0 on CPython 3.11 drops one on each Qt call that returns nothing; the process
    # (a tray running for days, this test run) aborts once None's count reaches zero. The tray
    # refuses to start on it; the fix is another PySide6 (!=6.12.0) or Python 3.12+.
    assert not pyside_leaks_none(), (
        f"PySide6 {PySide6.__version__} on Python {sys.version.split()[0]} leaks references to "
        "None: pin PySide6-Essentials!=6.12.0"
    )
