"""A stand-in for the desktop's notification server, run as its own process by test_notify.

It owns org.freedesktop.Notifications on the bus in DBUS_SESSION_BUS_ADDRESS, introspects as
the real servers do (GNOME Shell's interface XML, without Qt annotations), and answers each
Notify with a fresh id, or with replaces_id when that is not 0 (as the specification says).
Each call is printed as one JSON line: {"signature": ..., "replaces_id": ..., "summary": ...}.
"""

from __future__ import annotations

import itertools
import json
import sys

from PySide6.QtCore import QCoreApplication
from PySide6.QtDBus import QDBusConnection, QDBusMessage, QDBusVirtualObject

SERVICE = "org.freedesktop.Notifications"
PATH = "/org/freedesktop/Notifications"
XML = (
    '<node><interface name="org.freedesktop.Notifications"><method name="Notify">'
    '<arg type="s" direction="in"/><arg type="u" direction="in"/>'
    '<arg type="s" direction="in"/><arg type="s" direction="in"/>'
    '<arg type="s" direction="in"/><arg type="as" direction="in"/>'
    '<arg type="a{sv}" direction="in"/><arg type="i" direction="in"/>'
    '<arg type="u" direction="out"/></method></interface></node>'
)


class Notifications(QDBusVirtualObject):
    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count(7)

    def introspect(self, path: str) -> str:
        return XML

    def handleMessage(self, message: QDBusMessage, connection: QDBusConnection) -> bool:
        if message.member() == "Introspect":
            connection.send(message.createReply(XML))
            return True
        if message.member() != "Notify":
            return False
        args = message.arguments()
        replaces_id = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
        notification_id = replaces_id or next(self.ids)
        record = {
            "signature": message.signature(),
            "replaces_id": replaces_id,
            "summary": args[3] if len(args) > 3 else None,
            "body": args[4] if len(args) > 4 else None,
            "id": notification_id,
        }
        print(json.dumps(record), flush=True)
        connection.send(message.createReply(notification_id))
        return True


def main() -> int:
    app = QCoreApplication(sys.argv)
    bus = QDBusConnection.sessionBus()
    server = Notifications()
    if not bus.registerService(SERVICE) or not bus.registerVirtualObject(PATH, server):
        print(json.dumps({"error": bus.lastError().message()}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
