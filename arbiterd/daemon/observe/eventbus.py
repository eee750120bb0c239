"""The daemon's event stream: every event is stamped, counted, journaled and fanned out here.

Owns the subscribers' queues (bounded: a subscriber that falls behind misses events, and the
control server notices its full queue and drops it) and the order of the three duties of a
published event: the metrics see it, the journal keeps it (a full disk never takes the daemon
down), the subscribers get it. Live figures (`vram`) go to the subscribers only.

A journal that cannot write (a full disk, an I/O error) is said in one line, then once per
JOURNAL_FAILURE_LOG_S with how many events it lost meanwhile, and once more when it writes
again (issue 24: each failure used to log a 16-line traceback, and a full disk fails them all).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from arbiterd.daemon.observe.journal import Journal
from arbiterd.daemon.observe.metrics import Metrics
from arbiterd.errors import ArbiterError
from arbiterd.events import Event

log = logging.getLogger(__name__)

SUBSCRIBER_QUEUE = 1000
JOURNAL_FAILURE_LOG_S = 60.0


class EventBus:
    def __init__(
        self,
        metrics: Metrics,
        journal: Journal | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._journal = journal
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._clock = clock
        self._unjournaled = 0  # events lost since the journal last wrote
        self._unjournaled_said = 0  # of those, the ones a log line counted
        self._failure_said_at: float | None = None  # None: the journal writes

    def publish(self, event: Event) -> Event:
        """Stamp `event` (when it has no time yet), count it, journal it, fan it out; returns
        the stamped event."""
        if event.at is None:
            event = replace(event, at=time.time())
        self._metrics.observe(event)
        if self._journal is not None:
            self._keep(self._journal, event)
        self._fan_out(event.to_json())
        return event

    def _keep(self, journal: Journal, event: Event) -> None:
        """Journal `event`; a journal that cannot write must not take the daemon down, nor
        fill its log (the module's docstring)."""
        try:
            journal.append(event)
        except ArbiterError as exc:
            self._unjournaled += 1
            now = self._clock()
            if self._failure_said_at is None:
                log.warning(
                    "could not journal a %s event: %s; events are not kept until it writes "
                    "again (said once every %.0f s)",
                    event.kind,
                    exc,
                    JOURNAL_FAILURE_LOG_S,
                )
            elif now - self._failure_said_at >= JOURNAL_FAILURE_LOG_S:
                log.warning(
                    "the journal still cannot write: %d events not kept in the last %.0f s: %s",
                    self._unjournaled - self._unjournaled_said,
                    now - self._failure_said_at,
                    exc,
                )
            else:
                return
            self._failure_said_at, self._unjournaled_said = now, self._unjournaled
            return
        if self._failure_said_at is not None:
            log.warning("the journal writes again; %d events were not kept", self._unjournaled)
            self._unjournaled = self._unjournaled_said = 0
            self._failure_said_at = None

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
