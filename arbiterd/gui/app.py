"""`arbiterd tray`: the entry point. Owns the command line, the QApplication (and the check
that Qt can start on the desktop, before it), and the one-shot `--screenshot` render; the
running app itself is `tray.TrayApp`.

    arbiterd tray [--socket PATH] [--config PATH] [-v]
    arbiterd tray --screenshot FILE.png [--replay FILE] [--socket PATH] [--config PATH]

`main(argv)` takes the arguments after "tray" and returns the exit status; an ArbiterError is
one line on stderr and its exit status, as everywhere in the CLI.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication

from arbiterd.config import load_daemon_config
from arbiterd.errors import (
    ArbiterError,
    BrokenQtError,
    DaemonNotRunningError,
    MissingQtPlatformError,
    NoDisplayError,
    ScreenshotError,
    UsageError,
)
from arbiterd.events import Event
from arbiterd.gui.connection import DaemonConnection
from arbiterd.gui.dashboard import SCREENSHOT_SIZE, DashboardWindow
from arbiterd.gui.history import HISTORY_LEAD_S
from arbiterd.gui.launch import daemon_start_command
from arbiterd.gui.notify import BusNotifications
from arbiterd.gui.replay import apply_replay, load_replay
from arbiterd.gui.state import TrayState
from arbiterd.gui.tray import TrayApp

log = logging.getLogger(__name__)

# How long --screenshot waits for a running daemon's first status and its history.
SCREENSHOT_CONNECT_S: Final = 5.0
# Python runs its signal handlers only between bytecodes: while Qt's loop waits in C++, a timer
# lets Ctrl-C and SIGTERM through.
SIGNAL_POLL_MS: Final = 200


# What Qt's xcb platform plugin (libqxcb.so and libQt6XcbQpa.so.6, their DT_NEEDED) loads from
# the system, with the Debian/Ubuntu package of each: PySide6's wheels bring Qt, not these. A
# missing one makes Qt print its own error and abort (qFatal, which Python cannot catch), and
# that error names libxcb-cursor0 (needed since Qt 6.5) even when another one is missing (seen
# with PySide6 6.11.3 and libxcb-icccm4 missing).
XCB_LIBRARIES: Final = (
    ("libxcb-cursor.so.0", "libxcb-cursor0"),
    ("libxcb-icccm.so.4", "libxcb-icccm4"),
    ("libxcb-image.so.0", "libxcb-image0"),
    ("libxcb-keysyms.so.1", "libxcb-keysyms1"),
    ("libxcb-randr.so.0", "libxcb-randr0"),
    ("libxcb-render-util.so.0", "libxcb-render-util0"),
    ("libxcb-render.so.0", "libxcb-render0"),
    ("libxcb-shape.so.0", "libxcb-shape0"),
    ("libxcb-shm.so.0", "libxcb-shm0"),
    ("libxcb-sync.so.1", "libxcb-sync1"),
    ("libxcb-util.so.1", "libxcb-util1"),
    ("libxcb-xfixes.so.0", "libxcb-xfixes0"),
    ("libxcb-xkb.so.1", "libxcb-xkb1"),
    ("libxcb.so.1", "libxcb1"),
    ("libxkbcommon-x11.so.0", "libxkbcommon-x11-0"),
    ("libxkbcommon.so.0", "libxkbcommon0"),
    ("libX11-xcb.so.1", "libx11-xcb1"),
    ("libX11.so.6", "libx11-6"),
)


def pyside_leaks_none() -> bool:
    """Whether this PySide6 drops a reference to None on each Qt call that returns nothing.

    PySide6 6.12.0 does on CPython 3.11 (seen here; 6.11.3 does not, and from 3.12 on None is
    immortal, PEP 683): None's count, about 5000 at start, reaches zero after that many calls
    and the process aborts with "Fatal Python error: none_dealloc". A tray that redraws every
    second gets there within the hour."""
    if sys.version_info >= (3, 12):
        return False
    timer = QTimer()
    before = sys.getrefcount(None)
    for _ in range(8):
        timer.setInterval(1)
    return sys.getrefcount(None) < before


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arbiterd tray",
        description="The tray icon and dashboard: who holds the GPU, who waits, every handoff.",
    )
    parser.add_argument("--socket", type=Path, metavar="PATH", help="control socket path")
    parser.add_argument("--config", type=Path, metavar="PATH", help="config naming the socket")
    parser.add_argument(
        "--screenshot", type=Path, metavar="FILE.png", help="render the dashboard to a PNG, exit"
    )
    parser.add_argument(
        "--replay",
        type=Path,
        metavar="FILE",
        help="with --screenshot: render a recorded log (JSON lines of status and events)",
    )
    parser.add_argument(
        "--dashboard", action="store_true", help="open the dashboard window at start (menu entry)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the tray does")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="arbiterd tray %(levelname)s: %(message)s",
    )
    try:
        if args.replay is not None and args.screenshot is None:
            raise UsageError("--replay renders a recording: use it with --screenshot FILE.png")
        if args.screenshot is not None:
            return screenshot(args)
        return run_tray(args)
    except ArbiterError as exc:
        print(f"arbiterd tray: {exc}", file=sys.stderr)
        return exc.exit_code


def _socket_path(args: argparse.Namespace) -> Path:
    if args.socket is not None:
        return Path(args.socket)
    return load_daemon_config(args.config).socket


def _application() -> QApplication:
    existing = QApplication.instance()
    if isinstance(existing, QApplication):
        return existing
    app = QApplication(["arbiterd tray"])
    app.setApplicationName("arbiterd")
    app.setDesktopFileName("arbiterd")
    return app


# -- the tray --------------------------------------------------------------------------------------


def uses_xcb(environ: Mapping[str, str]) -> bool:
    """Whether Qt will start on its xcb platform: QT_QPA_PLATFORM's first choice when set,
    else xcb outside a Wayland session (in one, Qt 6 tries wayland first)."""
    choice = environ.get("QT_QPA_PLATFORM", "")
    if choice:
        return choice.split(";")[0].split(":")[0] == "xcb"
    return environ.get("XDG_SESSION_TYPE") != "wayland"


def _loads(soname: str) -> bool:
    """Whether the dynamic loader finds `soname`; loading it is what Qt would do next anyway."""
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def check_qt_platform(environ: Mapping[str, str]) -> None:
    """MissingQtPlatformError naming the packages to install when Qt would start on xcb and
    cannot load it; called before the QApplication, whose failure would be an abort."""
    if not uses_xcb(environ):
        return
    missing = [package for soname, package in XCB_LIBRARIES if not _loads(soname)]
    if missing:
        raise MissingQtPlatformError(
            "Qt cannot load its xcb platform plugin: install the system "
            f"{'package' if len(missing) == 1 else 'packages'} it needs "
            f"(Debian/Ubuntu: sudo apt install {' '.join(missing)})"
        )


def run_tray(args: argparse.Namespace) -> int:
    if not (
        os.environ.get("QT_QPA_PLATFORM")
        or os.environ.get("DISPLAY")
        or os.environ.get("WAYLAND_DISPLAY")
    ):
        # Qt would abort (qFatal) without a display; say so in one line instead.
        raise NoDisplayError(
            "no display: the tray needs a desktop session (--screenshot FILE.png renders the "
            "dashboard without one)"
        )
    check_qt_platform(os.environ)
    socket = _socket_path(args)
    app = _application()
    if pyside_leaks_none():
        raise BrokenQtError(
            "this PySide6 drops a reference to None on every Qt call that returns nothing "
            "(PySide6 6.12.0 on Python 3.11), so a long-running tray would abort; install "
            "another version (pip install 'PySide6-Essentials!=6.12.0') or use Python 3.12+"
        )
    app.setQuitOnLastWindowClosed(False)
    connection = DaemonConnection(socket)
    tray = TrayApp(
        connection,
        notifications=BusNotifications.find(),
        daemon_command=lambda: daemon_start_command(args.socket, args.config),
    )
    if args.dashboard:
        tray.show_dashboard()
    previous = {
        signum: signal.signal(signum, lambda *_: app.quit())
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    ticker = QTimer()
    ticker.timeout.connect(lambda: None)
    ticker.start(SIGNAL_POLL_MS)
    try:
        tray.start()
        return app.exec()
    finally:
        ticker.stop()
        tray.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# -- --screenshot ----------------------------------------------------------------------------------


def screenshot(args: argparse.Namespace) -> int:
    output: Path = args.screenshot
    if output.suffix.lower() != ".png":
        raise UsageError(f"--screenshot writes a PNG: give a FILE.png, not {output}")
    # The picture must not depend on the desktop it is taken on, or need one.
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    app = _application()
    state = TrayState()
    if args.replay is not None:
        now = apply_replay(state, load_replay(args.replay))
    else:
        now = _fetch_live(state, _socket_path(args))
    dashboard = DashboardWindow()
    try:
        # Never shown: grab() lays out and paints a hidden widget at its size.
        dashboard.resize(SCREENSHOT_SIZE)
        dashboard.refresh(state, now)
        dashboard.ensurePolished()
        layout = dashboard.layout()
        if layout is not None:
            layout.activate()
        app.processEvents()
        image = dashboard.grab()
        if not image.save(str(output), "PNG"):
            raise ScreenshotError(f"cannot write the screenshot {output}")
    finally:
        dashboard.close()
        dashboard.deleteLater()
    print(f"wrote {output} ({image.width()}x{image.height()})")
    return 0


def _fetch_live(state: TrayState, socket: Path) -> float:
    """Fill `state` from the running daemon's history and one status of it; returns now.
    DaemonNotRunningError when no daemon answers within SCREENSHOT_CONNECT_S."""
    connection = DaemonConnection(socket)
    loop = QEventLoop()
    failure: list[str] = []
    statuses: list[dict[str, object]] = []
    histories: list[list[Event]] = []

    def on_connected(_hello: object) -> None:
        since = time.time() - state.history.window_s - HISTORY_LEAD_S
        connection.request_history(since)

    def on_status(status: dict[str, object]) -> None:
        statuses.append(status)
        if histories:
            loop.quit()

    def on_history(events: list[Event]) -> None:
        histories.append(events)
        if statuses:
            loop.quit()

    def on_disconnected(reason: str) -> None:
        failure.append(reason)
        loop.quit()

    def on_timeout() -> None:
        failure.append(f"no answer within {SCREENSHOT_CONNECT_S:.0f} s")
        loop.quit()

    connection.connected.connect(on_connected)
    connection.status_received.connect(on_status)
    connection.history_received.connect(on_history)
    connection.disconnected.connect(on_disconnected)
    timer = QTimer()
    timer.setSingleShot(True)
    timer.timeout.connect(on_timeout)
    timer.start(int(SCREENSHOT_CONNECT_S * 1000))
    try:
        connection.start()
        if not failure:  # a refused connect may fail at once
            loop.exec()
    finally:
        timer.stop()
        connection.stop()
        connection.deleteLater()
    for event in histories[0] if histories else []:
        state.apply_event(event)
    if statuses:  # after the history, which is older
        state.apply_status(statuses[0], time.time())
    if state.status is None:
        reason = failure[0] if failure else "no status"
        raise DaemonNotRunningError(
            f"cannot reach arbiterd on {socket} ({reason}); start it, or render a recording "
            "with --replay FILE"
        )
    return time.time()
