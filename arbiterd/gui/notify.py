"""Desktop notifications for failures: org.freedesktop.Notifications, one bubble replacing the last.

Owns the notification call and its bookkeeping: which events notify (`render.failure` decides),
and the id of the bubble on screen, passed as `replaces_id` so a new failure replaces it instead
of stacking (the Desktop Notifications Specification: Notify returns the id, and a non-zero
`replaces_id` replaces that notification in place).

Why not QtDBus: Notify's signature is `susssasa{sv}i`, and PySide6 cannot marshal a D-Bus
uint32 — its QVariant of a Python int is an int32 ("i"), `QDBusArgument << int` only binds the
uint16 overload ("q"), and an empty list goes out as "av". Every server checks the signature
(GDBus in GNOME Shell, dunst and mako; QtDBus in Plasma) and refuses such a call. So the call
goes through `busctl` (systemd), or `gdbus` (GLib) where busctl is missing, run with QProcess and
never waited for on the GUI thread. Without a session bus or either tool, failures are logged.

    FailureNotifier.event(event)   one daemon event; notifies when it is a failure
    NotificationSink               the call itself (tests put a recording fake here)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final, Protocol

from PySide6.QtCore import QObject, QProcess, QTimer

from arbiterd import render
from arbiterd.events import Event

log = logging.getLogger(__name__)

APP_NAME: Final = "arbiterd"
APP_ICON: Final = "arbiterd"
BUS_NAME: Final = "org.freedesktop.Notifications"
OBJECT_PATH: Final = "/org/freedesktop/Notifications"
INTERFACE: Final = "org.freedesktop.Notifications"
SIGNATURE: Final = "susssasa{sv}i"
EXPIRE_MS: Final = -1  # the server's default
CALL_TIMEOUT_S: Final = 5.0

OnId = Callable[[int | None], None]


class NotificationSink(Protocol):
    def notify(self, summary: str, body: str, replaces_id: int, on_id: OnId) -> None:
        """Show one notification replacing `replaces_id` (0: none); call `on_id` with the id the
        server gave it, or None when it could not be shown."""
        ...


def _gvariant_string(text: str) -> str:
    """`text` as a GVariant text-format string literal, so gdbus never reads it as another type."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return f'"{escaped}"'


def notify_command(tool: str, summary: str, body: str, replaces_id: int) -> list[str]:
    """The argv that calls Notify with `tool` ("busctl" or "gdbus", a name or a path)."""
    if Path(tool).name == "busctl":
        return [
            tool, "--user", f"--timeout={CALL_TIMEOUT_S:g}", "call", "--",
            BUS_NAME, OBJECT_PATH, INTERFACE, "Notify", SIGNATURE,
            APP_NAME, str(replaces_id), APP_ICON, summary, body,
            "0",  # actions: an empty array
            "0",  # hints: an empty dictionary
            str(EXPIRE_MS),
        ]  # fmt: skip
    return [
        tool, "call", "--session", "--timeout", f"{CALL_TIMEOUT_S:.0f}",
        "--dest", BUS_NAME, "--object-path", OBJECT_PATH, "--method", f"{INTERFACE}.Notify", "--",
        _gvariant_string(APP_NAME), f"uint32 {replaces_id}", _gvariant_string(APP_ICON),
        _gvariant_string(summary), _gvariant_string(body), "@as []", "@a{sv} {}",
        f"int32 {EXPIRE_MS}",
    ]  # fmt: skip


def parse_notify_reply(output: str) -> int | None:
    """The id in busctl's `u 42` or gdbus's `(uint32 42,)`."""
    found = re.findall(r"\d+", output)
    return int(found[-1]) if found else None


def session_bus_available(env: Mapping[str, str] | None = None) -> bool:
    """Whether a session bus can be found without autolaunching one (dbus-launch needs X11)."""
    env = os.environ if env is None else env
    if env.get("DBUS_SESSION_BUS_ADDRESS"):
        return True
    runtime = env.get("XDG_RUNTIME_DIR", "")
    return bool(runtime) and Path(runtime, "bus").exists()


class BusNotifications(QObject):
    """Notify through `busctl` or `gdbus`, one QProcess per call, reaped when it ends."""

    def __init__(self, tool: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.tool = tool
        self._running: set[QProcess] = set()

    @classmethod
    def find(cls, parent: QObject | None = None) -> BusNotifications | None:
        """A sink when a session bus and a tool to reach it are there, else None (and why is
        logged)."""
        if not session_bus_available():
            log.info("tray: no D-Bus session bus; failures are logged, not notified")
            return None
        for name in ("busctl", "gdbus"):
            tool = shutil.which(name)
            if tool is not None:
                return cls(tool, parent)
        log.info("tray: neither busctl nor gdbus found; failures are logged, not notified")
        return None

    def notify(self, summary: str, body: str, replaces_id: int, on_id: OnId) -> None:
        argv = notify_command(self.tool, summary, body, replaces_id)
        process = QProcess(self)
        self._running.add(process)
        timer = QTimer(process)
        timer.setSingleShot(True)
        timer.timeout.connect(process.kill)

        def finished(code: int, status: QProcess.ExitStatus) -> None:
            timer.stop()
            self._running.discard(process)
            output = bytes(process.readAllStandardOutput().data()).decode(errors="replace")
            error = bytes(process.readAllStandardError().data()).decode(errors="replace").strip()
            process.deleteLater()
            if status != QProcess.ExitStatus.NormalExit or code != 0:
                log.warning("tray: could not notify (%s): %s", Path(self.tool).name, error)
                on_id(None)
            else:
                on_id(parse_notify_reply(output))

        def failed(error: QProcess.ProcessError) -> None:
            if error == QProcess.ProcessError.FailedToStart:
                finished(-1, QProcess.ExitStatus.CrashExit)

        process.finished.connect(finished)
        process.errorOccurred.connect(failed)
        timer.start(int((CALL_TIMEOUT_S + 1) * 1000))
        process.start(argv[0], argv[1:])

    def close(self) -> None:
        for process in list(self._running):
            process.kill()
            process.waitForFinished(1000)


class FailureNotifier:
    """Turns failure events into notifications, one bubble at a time: the next replaces it.

    Calls go one after another, so each carries the id the previous one got; failures that come
    while a call is on its way are folded into one notification sent when it returns."""

    def __init__(self, sink: NotificationSink | None) -> None:
        self.sink = sink
        self.last_id = 0  # the bubble on screen, as the server numbered it
        self._busy = False
        self._pending: list[tuple[str, str]] = []

    @property
    def busy(self) -> bool:
        """Whether a call is on its way (the next one waits for its id)."""
        return self._busy

    def event(self, event: Event) -> bool:
        """Notify if `event` is a failure; True when it was one."""
        failure = render.failure(event)
        if failure is None:
            return False
        summary, body = failure
        log.warning("arbiterd: %s: %s", summary, body)
        if self.sink is None:
            return True
        self._pending.append(failure)
        self._next()
        return True

    def _next(self) -> None:
        if self._busy or not self._pending or self.sink is None:
            return
        if len(self._pending) == 1:
            summary, body = self._pending[0]
        else:
            summary = f"{len(self._pending)} failures"
            body = "\n".join(f"{s}: {b}" for s, b in self._pending)
        self._pending.clear()
        self._busy = True
        self.sink.notify(summary, body, self.last_id, self._on_id)

    def _on_id(self, notification_id: int | None) -> None:
        self._busy = False
        if notification_id:
            self.last_id = notification_id
        self._next()
