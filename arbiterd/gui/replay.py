"""Recorded sessions for `arbiterd tray --screenshot FILE --replay LOG`: JSON lines of status
snapshots and events, fed to a `TrayState` as if they had come from a daemon.

    {"at": 1718000000.0, "status": {...the status object...}}
    {"event": {"event": "handoff", "at": 1718000001.5, "from": "a", "to": "b", ...}}
    {"event": "hold", "at": 1718000002.0, "held": true}          a bare event works too

Owns the format and its parsing (the guard ladder: JSON → object → which kind → its time); the
error names the file and line. Never imports Qt.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiterd.errors import ReplayError
from arbiterd.events import Event, parse_event
from arbiterd.gui.state import TrayState


@dataclass(frozen=True)
class ReplayItem:
    at: float
    status: Mapping[str, Any] | None = None
    event: Event | None = None


def _time(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def parse_line(line: str) -> ReplayItem | None:
    """One line as an item, None for a blank line; ValueError says what is wrong."""
    if not line.strip():
        return None
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("a line must be a JSON object")
    if "status" in message:
        status, at = message["status"], _time(message.get("at"))
        if not isinstance(status, dict):
            raise ValueError('"status" must be an object')
        if at is None:
            raise ValueError('a status line needs "at", seconds since the epoch')
        return ReplayItem(at=at, status=status)
    event = message.get("event")
    if isinstance(event, str):  # a bare event
        event = message
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        raise ValueError('a line needs "status" or "event"')
    at = _time(event.get("at"))
    if at is None:
        raise ValueError('an event needs "at", seconds since the epoch')
    return ReplayItem(at=at, event=parse_event(event))


def load_replay(path: Path) -> list[ReplayItem]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReplayError(f"cannot read the replay {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ReplayError(f"the replay {path} is not UTF-8 text") from None
    items: list[ReplayItem] = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            item = parse_line(line)
        except ValueError as exc:  # json.JSONDecodeError is one too
            raise ReplayError(f"{path}:{number}: {exc}") from None
        if item is not None:
            items.append(item)
    if not items:
        raise ReplayError(f"the replay {path} holds no status and no event")
    return items


def apply_replay(state: TrayState, items: list[ReplayItem]) -> float:
    """Feed `items` to `state` in time order; returns the time of the last one (the replay's
    "now")."""
    for item in sorted(items, key=lambda i: i.at):
        if item.status is not None:
            state.apply_status(item.status, item.at)
        elif item.event is not None:
            state.apply_event(item.event)
    return max(item.at for item in items)
