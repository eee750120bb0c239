"""The tray app and dashboard (PySide6). Only a client of the control socket: the daemon never
imports this package, and nothing outside it imports Qt."""
