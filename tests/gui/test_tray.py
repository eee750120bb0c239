"""The tray app against a fake daemon: its menu, icon, actions, dashboard, notifications."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QMenu, QSystemTrayIcon
from pytestqt.qtbot import QtBot

from arbiterd.gui import autostart, palette
from arbiterd.gui.connection import DaemonConnection
from arbiterd.gui.dashboard import DashboardWindow
from arbiterd.gui.launch import daemon_start_command
from arbiterd.gui.tray import TrayApp
from arbiterd.offload import cpu_note
from tests.gui.fakes import FakeControlServer, GiB, RecordingSink, model, status

WAIT_MS = 5000
RGB = tuple[int, int, int]


class Desktop:
    """What the desktop gives the app, recorded: a tray that may come and go, process starts,
    quitting."""

    def __init__(self, tray: bool) -> None:
        self.tray = tray
        self.started: list[list[str]] = []
        self.quits = 0

    def start_detached(self, program: str, args: list[str]) -> bool:
        self.started.append([program, *args])
        return True

    def quit(self) -> None:
        self.quits += 1


AppFactory = Callable[..., TrayApp]


@pytest.fixture
def make_app(
    qtbot: QtBot, server: FakeControlServer, autostart_env: dict[str, str]
) -> Iterator[AppFactory]:
    apps: list[TrayApp] = []

    def make(desktop: Desktop | None = None, **options: Any) -> TrayApp:
        desktop = desktop or Desktop(tray=True)
        connection = DaemonConnection(
            server.path, status_interval_ms=50, reconnect_first_s=0.05, reconnect_max_s=0.2
        )
        options.setdefault("notifications", RecordingSink())
        app = TrayApp(
            connection,
            tray_available=lambda: desktop.tray,
            start_detached=desktop.start_detached,
            autostart_env=autostart_env,
            quit_app=desktop.quit,
            refresh_interval_s=0.02,
            tray_poll_ms=50,
            **options,
        )
        apps.append(app)
        app.start()
        return app

    yield make
    for app in apps:
        app.stop()
        app.connection.deleteLater()
        app.deleteLater()


def tray_of(app: TrayApp) -> QSystemTrayIcon | None:
    """app.tray, read anew (mypy would keep an earlier narrowing of the attribute)."""
    return app.tray


def text_of(app: TrayApp, name: str) -> str:
    action = app.actions.get(name)
    return "" if action is None else action.text()


def wait_for_text(qtbot: QtBot, app: TrayApp, name: str, expected: str) -> None:
    qtbot.waitUntil(lambda: text_of(app, name) == expected, timeout=WAIT_MS)


def icon_colour(tray: QSystemTrayIcon) -> RGB:
    """The colour of the icon's frame, halfway down its left edge."""
    image = tray.icon().pixmap(64, 64).toImage()
    colour = image.pixelColor(4, 32)
    return (colour.red(), colour.green(), colour.blue())


# -- the menu --------------------------------------------------------------------------------------


def test_the_menu_lists_each_model_with_its_state_and_vram(
    qtbot: QtBot, make_app: AppFactory
) -> None:
    app = make_app()
    wait_for_text(qtbot, app, "model:alpha", "alpha — warm, 3.0 GiB · pinned")
    assert text_of(app, "model:beta") == "beta — cold, 0 B · 2 queued"
    assert text_of(app, "headline") == "GPU: alpha"
    assert text_of(app, "waiters") == "waiting: beta (pid 77)"
    assert app.actions["pin:alpha"].isChecked()
    assert not app.actions["pin:beta"].isChecked()
    assert not app.actions["hold"].isChecked()
    assert not app.actions["autostart"].isChecked()
    assert "start-daemon" not in app.actions
    # Each model's submenu holds its actions.
    submenu = app.actions["model:alpha"].menu()
    assert isinstance(submenu, QMenu)
    assert [a.text() for a in submenu.actions()] == ["Warm", "Release", "Pin"]
    top = [a.text() for a in app.menu.actions() if a.text()]
    assert top[-6:] == [
        "Hold GPU (game mode)",
        "Open dashboard",
        "Open config",
        "Start at login",
        "Stop daemon",
        "Quit",
    ]


def test_the_menu_follows_the_daemon(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    app = make_app()
    wait_for_text(qtbot, app, "model:beta", "beta — cold, 0 B · 2 queued")
    server.status = status(
        model("alpha", "cold"),
        model("beta", "warm", resident_bytes=GiB // 2),
        holder="arbiterd hold",
        hold=True,
    )
    wait_for_text(qtbot, app, "model:beta", "beta — warm, 512.0 MiB")
    assert text_of(app, "headline") == "GPU held for you (game mode)"
    assert app.actions["hold"].isChecked()


def test_the_menu_names_a_group_holding_the_gpu_and_an_unloaded_model_without_bytes(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    server.status = status(
        model("alpha", "warm", resident_bytes=GiB),
        model("beta", "warm", resident_bytes=GiB // 2),
        model("gamma", "unloaded"),
        holder="group rag",
        groups=[{"name": "rag", "models": ["alpha", "beta"], "holds_token": True}],
    )
    app = make_app()
    wait_for_text(qtbot, app, "headline", "GPU: group rag — alpha, beta")
    assert text_of(app, "model:gamma") == "gamma — unloaded"
    assert text_of(app, "model:alpha") == "alpha — warm, 1.0 GiB"


def test_menu_actions_send_the_right_commands(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    app = make_app()
    wait_for_text(qtbot, app, "model:alpha", "alpha — warm, 3.0 GiB · pinned")
    app.actions["warm:beta"].trigger()
    app.actions["release:alpha"].trigger()
    app.actions["pin:beta"].trigger()  # unpinned: pins
    app.actions["pin:alpha"].trigger()  # pinned: unpins
    app.actions["hold"].trigger()  # not held: holds
    expected = Counter(
        [
            ("warm", "beta"),
            ("release", "alpha"),
            ("pin", "beta"),
            ("unpin", "alpha"),
            ("hold", None),
        ]
    )
    qtbot.waitUntil(lambda: Counter(server.commands_seen()) == expected, timeout=WAIT_MS)

    server.status = {**server.status, "hold": True}
    qtbot.waitUntil(app.actions["hold"].isChecked, timeout=WAIT_MS)
    app.actions["hold"].trigger()
    qtbot.waitUntil(lambda: server.commands_seen()[-1:] == [("unhold", None)], timeout=WAIT_MS)


def test_a_refused_command_is_shown(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    server.refuse["warm"] = ("beta failed to load: no such file", "EngineError")
    app = make_app()
    wait_for_text(qtbot, app, "model:beta", "beta — cold, 0 B · 2 queued")
    app.actions["warm:beta"].trigger()
    wait_for_text(qtbot, app, "message", "⚠ warm failed: beta failed to load: no such file")
    dashboard = app.show_dashboard()
    assert dashboard.message.text() == "warm failed: beta failed to load: no such file"
    # The next command that works clears it.
    app.actions["release:beta"].trigger()
    qtbot.waitUntil(lambda: "message" not in app.actions, timeout=WAIT_MS)
    assert not dashboard.message.isVisible()


def test_start_at_login_toggles_the_autostart_entry(
    qtbot: QtBot, make_app: AppFactory, autostart_env: dict[str, str]
) -> None:
    app = make_app()
    qtbot.waitUntil(lambda: "autostart" in app.actions, timeout=WAIT_MS)
    app.actions["autostart"].trigger()
    assert autostart.is_enabled(autostart_env)
    assert "X-GNOME-Autostart-enabled=true" in autostart.autostart_path(autostart_env).read_text()
    qtbot.waitUntil(app.actions["autostart"].isChecked, timeout=WAIT_MS)
    app.actions["autostart"].trigger()
    assert not autostart.is_enabled(autostart_env)
    assert "Hidden=true" in autostart.autostart_path(autostart_env).read_text()
    qtbot.waitUntil(lambda: not app.actions["autostart"].isChecked(), timeout=WAIT_MS)


def test_quit_stops_the_app(qtbot: QtBot, make_app: AppFactory) -> None:
    desktop = Desktop(tray=True)
    app = make_app(desktop)
    qtbot.waitUntil(lambda: app.connection.is_connected, timeout=WAIT_MS)
    app.actions["quit"].trigger()
    assert desktop.quits == 1
    assert not app.connection.is_connected


# -- the icon --------------------------------------------------------------------------------------


def test_the_icon_and_tooltip_show_the_holder(qtbot: QtBot, make_app: AppFactory) -> None:
    app = make_app()
    tray = app.tray
    assert tray is not None
    qtbot.waitUntil(lambda: "GPU: alpha" in tray.toolTip(), timeout=WAIT_MS)
    assert icon_colour(tray) == palette.model_colours(["alpha", "beta"]).of("alpha")
    assert tray.toolTip().splitlines()[1:] == [
        "memory: 3.0 GiB (models' own count)",  # no engine or device said: not called VRAM
        "waiting: beta (pid 77)",
    ]


def test_redraws_come_at_most_once_per_interval(
    qtbot: QtBot, server: FakeControlServer, autostart_env: dict[str, str]
) -> None:
    redraws: list[float] = []

    class CountingTrayApp(TrayApp):
        def refresh_now(self) -> None:
            redraws.append(time.monotonic())
            super().refresh_now()

    connection = DaemonConnection(server.path, status_interval_ms=20)
    app = CountingTrayApp(
        connection,
        tray_available=lambda: True,
        autostart_env=autostart_env,
        refresh_interval_s=0.3,
    )
    try:
        app.start()
        qtbot.waitUntil(lambda: server.subscribers == 1, timeout=WAIT_MS)
        for n in range(50):
            server.push_event({"event": "hold", "at": 1000.0 + n, "held": n % 2 == 0})
        qtbot.waitUntil(lambda: len(redraws) >= 5, timeout=WAIT_MS)
    finally:
        app.stop()
        connection.deleteLater()
        app.deleteLater()
    gaps = [b - a for a, b in itertools.pairwise(redraws[1:])]  # after start()'s redraw
    assert min(gaps) >= 0.28, gaps


# -- without a daemon ------------------------------------------------------------------------------


def test_an_unreachable_daemon_turns_red_and_offers_to_start_it(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    desktop = Desktop(tray=True)
    app = make_app(desktop, daemon_command=lambda: daemon_start_command(server.path))
    qtbot.waitUntil(lambda: "model:alpha" in app.actions, timeout=WAIT_MS)
    server.stop()
    qtbot.waitUntil(lambda: "start-daemon" in app.actions, timeout=WAIT_MS)
    assert app.tray is not None
    assert text_of(app, "headline") == "daemon not running"
    assert icon_colour(app.tray) == palette.RED
    assert app.tray.toolTip().startswith("arbiterd — daemon not running")
    assert "model:alpha" not in app.actions

    app.actions["start-daemon"].trigger()
    ((program, *args),) = desktop.started
    assert Path(program).name == "arbiterd"
    assert args == ["daemon", "--socket", str(server.path)]
    # The daemon comes up: the app finds it again.
    server.start()
    wait_for_text(qtbot, app, "headline", "GPU: alpha")
    assert icon_colour(app.tray) == palette.model_colours(["alpha", "beta"]).of("alpha")


# -- without a tray --------------------------------------------------------------------------------


def test_without_a_tray_the_dashboard_opens_and_the_icon_comes_later(
    qtbot: QtBot, make_app: AppFactory
) -> None:
    desktop = Desktop(tray=False)
    app = make_app(desktop)
    assert app.tray is None
    assert app.dashboard is not None
    assert app.dashboard.isVisible()
    qtbot.waitUntil(lambda: app.dashboard is not None and "alpha" in app.dashboard.cards)
    desktop.tray = True  # the user enabled the AppIndicator extension
    qtbot.waitUntil(lambda: app.tray is not None, timeout=WAIT_MS)
    tray = tray_of(app)
    assert tray is not None
    assert tray.isVisible()
    assert tray.contextMenu() is app.menu


def test_without_a_tray_closing_the_dashboard_quits(qtbot: QtBot, make_app: AppFactory) -> None:
    desktop = Desktop(tray=False)
    app = make_app(desktop)
    assert app.dashboard is not None
    app.dashboard.close()
    assert desktop.quits == 1


def test_with_a_tray_closing_the_dashboard_keeps_running(
    qtbot: QtBot, make_app: AppFactory
) -> None:
    desktop = Desktop(tray=True)
    app = make_app(desktop)
    assert app.dashboard is None
    app.actions["dashboard"].trigger()
    dashboard = app.show_dashboard()  # the same window, shown again
    assert dashboard.isVisible()
    dashboard.close()
    assert desktop.quits == 0


def test_the_menu_names_each_models_backend_the_engine_and_its_warning_once(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    note = cpu_note(("/dev/dri/renderD128",), False, None)
    assert note is not None
    server.status = status(
        model("alpha", "warm", backend="in-place", resident_bytes=GiB, devices=["gpu0"]),
        model("beta", backend="reload", fallback_reason="a stock build", devices=["rpc:h:1"]),
        holder="alpha",
        engine={
            "offload": False,
            "devices": ["CPU: test cpu"],
            "cpu_cause": str(note.cause),
            "cpu_note": note.text,
        },
    )
    app = make_app()
    wait_for_text(qtbot, app, "model:alpha", "alpha — warm, 1.0 GiB · in-place")
    assert text_of(app, "model:beta") == "beta — cold, 0 B · reload"
    assert text_of(app, "engine") == "engine: CPU only (this engine cannot offload to a GPU)"
    assert text_of(app, "engine-warning") == f"⚠ {note.text}"  # once, not under each model
    assert not app.actions["engine-warning"].isEnabled()  # a line to read, not an action
    assert text_of(app, "vram") == "RAM: 1.0 GiB (models' own count)"
    beta = app.actions["model:beta"].menu()
    assert isinstance(beta, QMenu)
    assert [a.text() for a in beta.actions() if not a.isSeparator()] == [
        "backend reload: a stock build",
        "Warm",
        "Release",
        "Pin",
    ]
    alpha = app.actions["model:alpha"].menu()
    assert isinstance(alpha, QMenu)
    assert [a.text() for a in alpha.actions()] == ["Warm", "Release", "Pin"]
    dashboard = app.show_dashboard()
    qtbot.waitUntil(lambda: set(dashboard.cards) == {"alpha", "beta"}, timeout=WAIT_MS)
    card = dashboard.cards["beta"]
    assert card.queue.text() == "queue: 0 · reload backend · on rpc:h:1"
    assert card.queue.toolTip() == "a stock build"
    assert card.vram.text() == "RAM: 0 B"
    for each in dashboard.cards.values():
        assert not each.error.isVisibleTo(dashboard)  # on no card: once, in the banner
    assert dashboard.warning.text() == f"⚠ {note.text}"


# -- the dashboard ---------------------------------------------------------------------------------


def test_the_dashboard_shows_cards_and_steers_the_daemon(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    app = make_app()
    dashboard = app.show_dashboard()
    qtbot.waitUntil(lambda: set(dashboard.cards) == {"alpha", "beta"}, timeout=WAIT_MS)
    alpha = dashboard.cards["alpha"]
    assert alpha.state.text() == "state: warm · holds the GPU"
    assert alpha.vram.text() == "memory: 3.0 GiB"
    assert alpha.pin.isChecked()
    assert dashboard.headline.text() == "GPU: alpha"
    dashboard.cards["beta"].warm.click()
    dashboard.hold_button.click()
    qtbot.waitUntil(
        lambda: Counter(server.commands_seen()) == Counter([("warm", "beta"), ("hold", None)]),
        timeout=WAIT_MS,
    )


def test_the_dashboard_shows_the_history_of_the_daemon_it_is_connected_to(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    now = time.time()
    handoff = {"event": "handoff", "at": now - 60, "from": "alpha", "to": "beta",
               "holder_pid": 41, "waited_from": now - 61, "wait_s": 0.4, "release_s": 0.3,
               "restore_s": 0.6, "restored_bytes": GiB}  # fmt: skip
    wait = {"event": "wait", "at": now - 30, "model": "alpha", "holder_pid": 9,
            "holder_name": "steam", "waited_from": now - 42, "wait_s": 12.0}  # fmt: skip
    server.journal(
        {**handoff, "at": now - 7200},  # two hours ago: out of the window
        handoff,
        {"event": "request", "at": now - 55, "model": "beta", "prompt_tokens_evaluated": 17},
        wait,
    )
    app = make_app()
    qtbot.waitUntil(lambda: len(app.state.history.handoffs) == 2, timeout=WAIT_MS)
    dashboard: DashboardWindow = app.show_dashboard()

    def row(index: int) -> list[str]:
        items = [dashboard.table.item(index, c) for c in range(dashboard.table.columnCount())]
        return [item.text() if item is not None else "" for item in items][1:]

    assert dashboard.table.rowCount() == 2  # newest first
    assert row(0) == ["alpha waited behind steam (pid 9)", "—", "12.00 s", "—", "12.00 s", "—",
                      "—"]  # fmt: skip
    assert row(1) == ["alpha → beta", "0.30 s", "0.40 s", "0.60 s", "1.00 s", "1.0 GiB", "17"]
    markers = dashboard.timeline.marker_positions()
    assert [record.to_model for _x, record in markers] == ["beta", "alpha"]
    # The same handoff arriving live (the daemon publishes what it journals) is not doubled.
    server.push_event(handoff)
    server.push_event({"event": "hold", "at": now, "held": True})  # after it, on the same line
    qtbot.waitUntil(lambda: len(app.state.history.holds) == 1, timeout=WAIT_MS)
    dashboard.refresh(app.state)
    assert dashboard.table.rowCount() == 2


# -- notifications ---------------------------------------------------------------------------------


def test_failures_notify_each_replacing_the_last(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    sink = RecordingSink()
    app = make_app(notifications=sink)
    qtbot.waitUntil(lambda: server.subscribers == 1, timeout=WAIT_MS)
    server.push_event({"event": "handoff", "at": 1.0, "from": "alpha", "to": "beta"})
    server.push_event({"event": "vram_not_freed", "at": 2.0, "model": "alpha", "bytes_after": GiB})
    server.push_event({"event": "worker", "at": 3.0, "model": "beta", "pid": 9, "code": -9,
                       "reason": "killed by signal 9", "restart_in_s": 1.0})  # fmt: skip
    server.push_event({"event": "residency", "at": 4.0, "model": "beta", "from": "loading",
                       "to": "failed", "reason": "out of memory"})  # fmt: skip
    qtbot.waitUntil(lambda: len(sink.calls) == 3, timeout=WAIT_MS)
    assert sink.calls == [
        ("VRAM not freed", "alpha released the GPU but 1.0 GiB are still in use", 0),
        ("Worker crashed", "beta: killed by signal 9; restarting in 1 s", 101),
        ("Model failed", "beta failed: out of memory", 101),
    ]
    assert app.notifier.last_id == 101


# -- starting the daemon ---------------------------------------------------------------------------


def test_the_daemon_starts_through_its_unit_when_one_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    systemctl = bin_dir / "systemctl"
    systemctl.write_text("#!/bin/sh\n")
    systemctl.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert daemon_start_command(env=env)[1:] == ["daemon"]  # no unit yet
    unit = tmp_path / "config" / "systemd" / "user" / "arbiterd.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\n")
    assert daemon_start_command(env=env) == [
        str(systemctl),
        "--user",
        "start",
        "arbiterd.service",
    ]
    # A tray pointed at its own socket or config starts a daemon with them, not the unit.
    socket, config = tmp_path / "s.sock", tmp_path / "c.toml"
    argv = daemon_start_command(socket, config, env=env)
    assert argv[1:] == ["daemon", "--socket", str(socket), "--config", str(config)]


def test_the_menu_resumes_a_step_aside_and_stops_the_daemon(
    qtbot: QtBot, make_app: AppFactory, server: FakeControlServer
) -> None:
    """Issues 45 and 47: the cases the rules miss, and stopping without a terminal."""
    server.status = {
        **server.status,
        "stepped_aside": {"program": "blender", "pid": 5151, "reason": "named"},
    }
    app = make_app()
    wait_for_text(qtbot, app, "resume", "Resume models (stepped aside for blender)")
    app.actions["resume"].trigger()
    app.actions["stop-daemon"].trigger()
    expected = Counter([("resume", None), ("shutdown", None)])
    qtbot.waitUntil(lambda: Counter(server.commands_seen()) == expected, timeout=WAIT_MS)


def test_open_config_opens_the_file_or_says_how_to_get_one(
    qtbot: QtBot, make_app: AppFactory, autostart_env: dict[str, str]
) -> None:
    opened: list[Path] = []

    def open_file(path: Path) -> bool:
        opened.append(path)
        return True

    app = make_app(open_file=open_file)
    qtbot.waitUntil(lambda: "open-config" in app.actions, timeout=WAIT_MS)
    config = Path(autostart_env["XDG_CONFIG_HOME"]) / "arbiterd" / "config.toml"
    app.actions["open-config"].trigger()
    assert opened == []
    assert app.message == (
        f"no config at {config} yet: `arbiterd install` writes a starter with your GGUFs"
    )
    config.parent.mkdir(parents=True)
    config.write_text('[models.m]\npath = "/m.gguf"\n')
    app.actions["open-config"].trigger()
    assert opened == [config]
