"""The daemon's event stream: every event is stamped, counted, journaled and fanned out here.

Owns the subscribers' queues (bounded: a subscriber that falls behind misses events, and the
control server notices its full queue and drops it) and the order of the three duties of a
published event: the metrics see it, the journal keeps it (a full disk never takes the daemon
down), the subscribers get it. Live figures (`vram`) go to the subscribers only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from arbiterd.daemon.journal import Journal
from arbiterd.daemon.metrics import Metrics
from arbiterd.events import Event

log = logging.getLogger(__name__)

SUBSCRIBER_QUEUE = 1000


class EventBus:
    def __init__(self, metrics: Metrics, journal: Journal | None) -> None:
        self._metrics = metrics
        self._journal = journal
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()

    def publish(self, event: Event) -> Event:
        """Stamp `event` (when it has no time yet), count it, journal it, fan it out; returns
        the stamped event."""
        if event.at is None:
            event = replace(event, at=time.time())
        self._metrics.observe(event)
        if self._journal is not None:
            try:
                self._journal.append(event)
            except Exception:  # a full disk must not take the daemon down
                log.exception("could not journal an event")
        self._fan_out(event.to_json())
        return event

    def live(self, event: Event) -> None:
        """Send `event` to the subscribers only: live figures are not history."""
        self._fan_out(event.to_json())

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(events)
        return events

    def unsubscribe(self, events: asyncio.Queue[dict[str, Any]]) -> None:
        self._subscribers.discard(events)

    @property
    def watched(self) -> bool:
        """Whether anyone subscribes (the VRAM sampler then reads every second)."""
        return bool(self._subscribers)

    def _fan_out(self, message: dict[str, Any]) -> None:
        for events in list(self._subscribers):
            if not events.full():  # a full one: the control server drops that subscriber
                events.put_nowait(message)
