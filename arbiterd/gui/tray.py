"""The tray app: the icon, its menu, the dashboard and the notifications, wired to a connection.

Owns the app's one `TrayState` and everything that shows it. Status and events update the
state at once; what shows it (icon, tooltip, menu, dashboard) is redrawn at most once a second
(`REFRESH_INTERVAL_S`), and the menu only when what it lists changed and it is not open.

    connection ─ status/events/history ─► TrayState ─► icon, tooltip, menu, dashboard   (≤ 1 Hz)
                        events ─► FailureNotifier ─► desktop notification
    menu / dashboard ─ commands ─► connection (one short connection per command)

With no system tray (GNOME without the AppIndicator extension) the dashboard opens instead,
and the tray is looked for again every `TRAY_POLL_MS`; the icon is added once one appears.
Everything the desktop provides (tray, process start, autostart file, quitting) is injected, so
the tests drive the app without a desktop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from PySide6.QtCore import QObject, QProcess, QTimer, QUrl
from PySide6.QtGui import QAction, QDesktopServices, QIcon, QPixmap
from PySide6.QtWidgets import QApplication, QMenu, QSystemTrayIcon

from arbiterd import render
from arbiterd.config import default_config_path
from arbiterd.events import Event
from arbiterd.gui import autostart, palette
from arbiterd.gui.connection import DaemonConnection
from arbiterd.gui.dashboard import DashboardWindow
from arbiterd.gui.history import HISTORY_LEAD_S
from arbiterd.gui.icon import make_icon, qcolor
from arbiterd.gui.launch import daemon_start_command
from arbiterd.gui.notify import FailureNotifier, NotificationSink
from arbiterd.gui.state import IconLook, TrayState
from arbiterd.status import ModelStatus

log = logging.getLogger(__name__)

REFRESH_INTERVAL_S: Final = 1.0  # the issue: the tray updates at most about once a second
TRAY_POLL_MS: Final = 5000
FILL_STEPS: Final = 20  # the icon's fill moves in 5 % steps, so it is not redrawn for noise


def _start_detached(program: str, args: list[str]) -> bool:
    started, _pid = QProcess.startDetached(program, args)
    return bool(started)


def _open_file(path: Path) -> bool:
    """Open `path` in the desktop's application for it (an editor, for a .toml)."""
    return QDesktopServices.openUrl(QUrl.fromLocalFile(str(path)))


def _swatch(colour: palette.RGB) -> QIcon:
    pixmap = QPixmap(12, 12)
    pixmap.fill(qcolor(colour))
    return QIcon(pixmap)


class TrayApp(QObject):
    def __init__(
        self,
        connection: DaemonConnection,
        *,
        notifications: NotificationSink | None = None,
        tray_available: Callable[[], bool] = QSystemTrayIcon.isSystemTrayAvailable,
        start_detached: Callable[[str, list[str]], bool] = _start_detached,
        daemon_command: Callable[[], list[str]] | None = None,
        autostart_env: Mapping[str, str] | None = None,
        open_file: Callable[[Path], bool] = _open_file,
        quit_app: Callable[[], None] = QApplication.quit,
        clock: Callable[[], float] = time.time,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        tray_poll_ms: int = TRAY_POLL_MS,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.connection = connection
        self.state = TrayState()
        self.notifier = FailureNotifier(notifications)
        self.tray: QSystemTrayIcon | None = None
        self.dashboard: DashboardWindow | None = None
        self.menu = QMenu()
        self.actions: dict[str, QAction] = {}  # by name: "warm:alpha", "hold", "quit", …
        self.message = ""  # the last command's error, shown until the next command succeeds
        self._tray_available = tray_available
        self._start_detached = start_detached
        self._daemon_command = daemon_command or daemon_start_command
        self._autostart_env = autostart_env
        self._open_file = open_file
        self._quit_app = quit_app
        self._clock = clock
        self._refresh_interval_s = refresh_interval_s
        self._last_refresh = -float("inf")  # time.monotonic of the last redraw
        self._menu_key: object = None
        self._menu_stale = False
        self._look: IconLook | None = None
        self._stopping = False
        self._refresh_timer = QTimer(self)
        self._refresh_timer.setSingleShot(True)
        self._refresh_timer.timeout.connect(self.refresh_now)
        self._tray_poll = QTimer(self)
        self._tray_poll.setInterval(tray_poll_ms)
        self._tray_poll.timeout.connect(self._look_for_tray)
        self.menu.aboutToShow.connect(self._menu_about_to_show)
        self.menu.aboutToHide.connect(self._menu_hidden)
        connection.connected.connect(self._on_connected)
        connection.disconnected.connect(self._on_disconnected)
        connection.status_received.connect(self._on_status)
        connection.event_received.connect(self._on_event)
        connection.history_received.connect(self._on_history)
        connection.command_finished.connect(self._on_command_finished)
        connection.command_failed.connect(self._on_command_failed)

    # -- lifetime ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._tray_available():
            self._add_tray()
        else:
            log.info("tray: no system tray; showing the dashboard instead")
            self.show_dashboard()
            self._tray_poll.start()
        self.refresh_now()
        self.connection.start()

    def stop(self) -> None:
        """Close the connection, the windows and the icon; once (quitting calls it too)."""
        if self._stopping:
            return
        self._stopping = True
        self.connection.stop()
        self._refresh_timer.stop()
        self._tray_poll.stop()
        if self.tray is not None:
            self.tray.hide()
        dashboard, self.dashboard = self.dashboard, None
        if dashboard is not None:
            dashboard.close()
            dashboard.deleteLater()
        self.menu.deleteLater()  # a top-level widget: nothing else owns it
        close = getattr(self.notifier.sink, "close", None)
        if callable(close):
            close()

    def quit(self) -> None:
        self.stop()
        self._quit_app()

    def _add_tray(self) -> None:
        tray = QSystemTrayIcon(self)
        tray.setContextMenu(self.menu)
        tray.activated.connect(self._on_tray_activated)
        self.tray = tray
        self._look = None
        self.refresh_now()
        tray.show()

    def _look_for_tray(self) -> None:
        if self.tray is None and self._tray_available():
            log.info("tray: a system tray appeared; adding the icon")
            self._tray_poll.stop()
            self._add_tray()

    def _on_tray_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        # Left click where the desktop reports it; the menu holds every action anyway.
        if reason == QSystemTrayIcon.ActivationReason.Trigger:
            if self.dashboard is not None and self.dashboard.isVisible():
                self.dashboard.hide()
            else:
                self.show_dashboard()

    # -- from the daemon -----------------------------------------------------------------------

    def request_history(self) -> None:
        """Ask the daemon for its journal's last minutes, so a fresh window is not empty; events
        already seen are skipped when they come."""
        since = self._clock() - self.state.history.window_s - HISTORY_LEAD_S
        self.connection.request_history(since)

    def _on_history(self, events: list[Event]) -> None:
        for event in events:
            self.state.apply_event(event)
        self.state.history.trim(self._clock())
        self.schedule_refresh()

    def _on_connected(self, _hello: dict[str, Any]) -> None:
        log.info("tray: connected to arbiterd on %s", self.connection.path)
        self.request_history()

    def _on_disconnected(self, reason: str) -> None:
        self.state.set_unreachable(reason)
        self.schedule_refresh()

    def _on_status(self, status: dict[str, Any]) -> None:
        self.state.apply_status(status, self._clock())
        self.schedule_refresh()

    def _on_event(self, event: Event) -> None:
        if self.state.apply_event(event):
            self.notifier.event(event)
            self.schedule_refresh()

    def _on_command_finished(self, _request_id: int, _command: str, _data: object) -> None:
        self._set_message("")

    def _on_command_failed(self, _request_id: int, command: str, message: str, code: str) -> None:
        self._set_message(f"{command} failed: {message}")
        if self.tray is not None and self.tray.isVisible():
            self.tray.showMessage(
                f"arbiterd: {command} failed", message, QSystemTrayIcon.MessageIcon.Warning
            )

    def _set_message(self, text: str) -> None:
        self.message = text
        if self.dashboard is not None:
            self.dashboard.show_message(text)
        self.schedule_refresh()

    # -- actions -------------------------------------------------------------------------------

    def send(self, command: str, model: str | None = None) -> int:
        return self.connection.send_command(command, model)

    def show_dashboard(self) -> DashboardWindow:
        if self.dashboard is None:
            dashboard = DashboardWindow()
            dashboard.command_requested.connect(self.send)
            dashboard.start_daemon_requested.connect(self.start_daemon)
            dashboard.closed.connect(self._on_dashboard_closed)
            self.dashboard = dashboard
        else:
            self.request_history()
        self.dashboard.show_message(self.message)
        self.dashboard.refresh(self.state, self._clock())
        self.dashboard.show()
        self.dashboard.raise_()
        self.dashboard.activateWindow()
        return self.dashboard

    def _on_dashboard_closed(self) -> None:
        if self.tray is None and not self._stopping:
            self.quit()  # without a tray, the dashboard is the app

    def start_daemon(self) -> None:
        argv = self._daemon_command()
        log.info("tray: starting the daemon: %s", " ".join(argv))
        if self._start_detached(argv[0], argv[1:]):
            self._set_message(f"starting the daemon ({' '.join(argv)})…")
            self.connection.retry_now()
        else:
            self._set_message(f"could not start the daemon: {' '.join(argv)}")

    def open_config(self) -> None:
        """The config file in the desktop's editor; where there is none yet, how to get one."""
        path = default_config_path(self._autostart_env)
        if not path.exists():
            self._set_message(
                f"no config at {path} yet: `arbiterd install` writes a starter with your GGUFs"
            )
        elif not self._open_file(path):
            self._set_message(f"could not open {path}")

    def set_autostart(self, enabled: bool) -> None:
        try:
            path = autostart.set_enabled(enabled, self._autostart_env)
        except OSError as exc:
            self._set_message(f"could not change the autostart entry: {exc}")
        else:
            log.info("tray: start at login %s (%s)", "on" if enabled else "off", path)
        self._menu_key = None
        self.schedule_refresh()

    # -- showing the state ---------------------------------------------------------------------

    def schedule_refresh(self) -> None:
        """Redraw soon: now if the last redraw is a second old, else when it will be."""
        if self._refresh_timer.isActive():
            return
        due_s = self._last_refresh + self._refresh_interval_s - time.monotonic()
        self._refresh_timer.start(int(max(0.0, due_s) * 1000))

    def refresh_now(self) -> None:
        self._last_refresh = time.monotonic()
        now = self._clock()
        self.state.history.trim(now)  # also while no window shows it: the tray runs for days
        look = self.state.icon_look(now)
        look = replace(look, fill=round(look.fill * FILL_STEPS) / FILL_STEPS)
        if self.tray is not None:
            if look != self._look:
                self.tray.setIcon(make_icon(look))
                self._look = look
            self.tray.setToolTip(self.state.tooltip(now))
        if self.menu.isVisible():
            self._menu_stale = True
        else:
            self._rebuild_menu()
        if self.dashboard is not None and self.dashboard.isVisible():
            self.dashboard.refresh(self.state, now)

    def _menu_about_to_show(self) -> None:
        if "autostart" in self.actions:
            self.actions["autostart"].setChecked(autostart.is_enabled(self._autostart_env))

    def _menu_hidden(self) -> None:
        if self._menu_stale:
            # After the hide: a triggered action still runs on the menu as it was.
            self._menu_stale = False
            QTimer.singleShot(0, self, self._rebuild_menu)

    def _menu_signature(self, autostart_on: bool) -> object:
        state, status = self.state, self.state.status
        colours = state.colours()
        models = tuple(
            (
                m.name,
                colours.of(m.name),
                m.state,
                m.pinned,
                render.format_bytes(m.device_bytes),
                m.queue,
                m.backend,
                m.fallback_reason,
            )
            for m in (status.models if status is not None else ())
        )
        return (
            state.reachable,
            state.unreachable_reason,
            state.holder_text(),
            state.vram_text(),
            state.waiters_text(),
            state.engine_text(),
            tuple(state.notices()),
            models,
            status.hold if status is not None else False,
            status.stepped_aside if status is not None else None,
            autostart_on,
            self.message,
        )

    def _rebuild_menu(self) -> None:
        autostart_on = autostart.is_enabled(self._autostart_env)
        key = self._menu_signature(autostart_on)
        if key == self._menu_key:
            return
        self._menu_key = key
        menu, state, status = self.menu, self.state, self.state.status
        menu.clear()
        for submenu in menu.findChildren(QMenu):
            submenu.deleteLater()
        self.actions = {}

        def add(name: str, text: str, *, enabled: bool = True) -> QAction:
            action = menu.addAction(text)
            action.setObjectName(name)
            action.setEnabled(enabled)
            self.actions[name] = action
            return action

        if not state.reachable or status is None:
            add("headline", "daemon not running", enabled=False)
            add("reason", state.unreachable_reason, enabled=False)
            add("start-daemon", "Start daemon").triggered.connect(self.start_daemon)
        else:
            add("headline", state.holder_text(), enabled=False)
            add("vram", state.vram_text(), enabled=False)
            add("waiters", state.waiters_text(), enabled=False)
            engine = state.engine_text()
            if engine is not None:
                add("engine", engine, enabled=False)
            for notice in state.notices():  # once for all models: one engine, one machine
                add("engine-warning", f"⚠ {notice}", enabled=False)
            menu.addSeparator()
            for model in status.models:
                self._add_model_menu(model)
            menu.addSeparator()
            hold = add("hold", "Hold GPU (game mode)")
            hold.setCheckable(True)
            hold.setChecked(status.hold)
            hold.triggered.connect(lambda checked: self.send("hold" if checked else "unhold"))
            aside = status.stepped_aside
            if aside is not None:  # issue 45: the program may hold the device forever
                resume = add("resume", f"Resume models (stepped aside for {aside.program})")
                resume.triggered.connect(lambda: self.send("resume"))
        if self.message:
            add("message", f"⚠ {self.message}", enabled=False)
        menu.addSeparator()
        add("dashboard", "Open dashboard").triggered.connect(self.show_dashboard)
        add("open-config", "Open config").triggered.connect(self.open_config)
        login = add("autostart", "Start at login")
        login.setCheckable(True)
        login.setChecked(autostart_on)
        login.triggered.connect(self.set_autostart)
        menu.addSeparator()
        if state.reachable and status is not None:
            add("stop-daemon", "Stop daemon").triggered.connect(lambda: self.send("shutdown"))
        add("quit", "Quit").triggered.connect(self.quit)

    def _add_model_menu(self, model: ModelStatus) -> None:
        name = model.name
        title = f"{name} — {model.state}"
        if not model.unloaded:  # an unloaded model holds nothing: no "0 B" to read into
            title += f", {render.format_bytes(model.device_bytes)}"
        if model.pinned:
            title += " · pinned"
        if model.queue:
            title += f" · {model.queue} queued"
        if model.backend:
            title += f" · {model.backend}"
        submenu = self.menu.addMenu(_swatch(self.state.colours().of(name)), title)
        submenu.menuAction().setObjectName(f"model:{name}")
        self.actions[f"model:{name}"] = submenu.menuAction()
        notes = []  # what runs the model, as lines to read above its actions
        if model.fallback_reason:
            notes.append(("backend", f"backend {model.backend}: {model.fallback_reason}"))
        for kind, text in notes:
            note = submenu.addAction(text)
            note.setObjectName(f"{kind}:{name}")
            note.setEnabled(False)
            self.actions[f"{kind}:{name}"] = note
        if notes:
            submenu.addSeparator()
        for command, text in (("warm", "Warm"), ("release", "Release")):
            action = submenu.addAction(text)
            action.setObjectName(f"{command}:{name}")
            action.triggered.connect(lambda _=False, c=command: self.send(c, name))
            self.actions[f"{command}:{name}"] = action
        pin = submenu.addAction("Pin")
        pin.setObjectName(f"pin:{name}")
        pin.setCheckable(True)
        pin.setChecked(model.pinned)
        pin.triggered.connect(lambda checked: self.send("pin" if checked else "unpin", name))
        self.actions[f"pin:{name}"] = pin
