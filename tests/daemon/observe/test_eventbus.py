"""The event bus: each published event stamped, counted, journaled and fanned out, in that order."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from arbiterd.daemon.observe import eventbus
from arbiterd.daemon.observe.eventbus import EventBus
from arbiterd.daemon.observe.journal import Journal
from arbiterd.daemon.observe.metrics import Metrics
from arbiterd.events import (
    Event,
    HandoffEvent,
    RequestEvent,
    ResidencyEvent,
    VramEvent,
    WorkerEvent,
)
from arbiterd.states import RequestStatus, ResidencyState


def metric(metrics: Metrics, name: str, **labels: str) -> float | None:
    """The value of one sample of the metrics' text (what a scrape sees); None: no such sample."""
    for family in text_string_to_metric_families(metrics.text().decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def drain(events: asyncio.Queue[dict[str, Any]]) -> list[dict[str, Any]]:
    got = []
    while not events.empty():
        got.append(events.get_nowait())
    return got


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    return Journal(tmp_path / "journal.sqlite3")


def test_an_event_without_a_time_is_stamped_now_and_one_with_a_time_keeps_it() -> None:
    bus = EventBus(Metrics(), None)
    before = time.time()
    stamped = bus.publish(WorkerEvent(model="m", code=-9))
    after = time.time()
    assert stamped.at is not None
    assert before <= stamped.at <= after
    assert stamped == WorkerEvent(at=stamped.at, model="m", code=-9)
    assert bus.publish(WorkerEvent(at=12.5, model="m")).at == 12.5


def test_subscribers_get_the_stamped_event_as_it_is_sent() -> None:
    bus = EventBus(Metrics(), None)
    first, second = bus.subscribe(), bus.subscribe()
    stamped = bus.publish(RequestEvent(model="m", request_id="r1", status=RequestStatus.OK))
    assert drain(first) == drain(second) == [stamped.to_json()]


def test_the_metrics_see_every_published_event() -> None:
    metrics = Metrics()
    bus = EventBus(metrics, None)
    bus.publish(RequestEvent(model="m", request_id="r1", status=RequestStatus.ERROR, error="boom"))
    bus.publish(
        ResidencyEvent(model="m", from_state=ResidencyState.WARMING, to_state=ResidencyState.WARM)
    )
    bus.publish(HandoffEvent(from_model="a", to_model="m", wait_s=0.5, restore_s=0.25))
    bus.publish(WorkerEvent(model="m", code=-9, restart_in_s=2.0))
    assert metric(metrics, "arbiterd_requests_total", model="m", status="error") == 1.0
    assert metric(metrics, "arbiterd_model_resident", model="m") == 1.0
    assert metric(metrics, "arbiterd_handoffs_total") == 1.0
    assert metric(metrics, "arbiterd_handoff_seconds_sum") == 0.75
    assert metric(metrics, "arbiterd_worker_restarts_total", model="m") == 1.0


def test_the_journal_keeps_each_published_event_with_its_stamp(journal: Journal) -> None:
    bus = EventBus(Metrics(), journal)
    first = bus.publish(WorkerEvent(model="m", code=1, reason="exited with code 1"))
    second = bus.publish(RequestEvent(at=5.0, model="m", request_id="r1", status=RequestStatus.OK))
    assert [stored.event for stored in journal.read()] == [first, second]


def test_a_journal_that_cannot_write_stops_neither_the_metrics_nor_the_subscribers(
    journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()
    bus = EventBus(metrics, journal)
    events = bus.subscribe()
    journal.close()  # every append now raises, as on a full disk
    stamped = bus.publish(RequestEvent(model="m", request_id="r1", status=RequestStatus.OK))
    assert drain(events) == [stamped.to_json()]
    assert metric(metrics, "arbiterd_requests_total", model="m", status="ok") == 1.0
    [said] = [r for r in caplog.records if r.name == "arbiterd.daemon.observe.eventbus"]
    assert said.getMessage().startswith(
        f"could not journal a request event: the journal {journal.path} is closed; "
    )
    assert said.exc_info is None  # one line, no traceback


# Publishes events through a bus whose journal's file may not grow (RLIMIT_FSIZE: each write
# past the limit fails with EFBIG, as on a full disk), the clock one second further for each,
# then lets it grow again; the bus's log lines go to stderr.
FULL_DISK = """
import logging, resource, sys
from pathlib import Path
from arbiterd.daemon.observe.eventbus import EventBus
from arbiterd.daemon.observe.journal import Journal
from arbiterd.daemon.observe.metrics import Metrics
from arbiterd.events import RequestEvent

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
now = [0.0]
journal = Journal(Path(sys.argv[1]))
bus = EventBus(Metrics(), journal, clock=lambda: now[0])
bus.publish(RequestEvent(model="m", request_id="before", status="ok"))
grown = max(Path(f"{sys.argv[1]}{s}").stat().st_size for s in ("", "-wal"))
resource.setrlimit(resource.RLIMIT_FSIZE, (grown, resource.RLIM_INFINITY))
for i in range(100):
    bus.publish(RequestEvent(model="m", request_id=f"lost-{i}", status="ok"))
    now[0] += 1.0
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
bus.publish(RequestEvent(model="m", request_id="after", status="ok"))
print(" ".join(e.body["id"] for e in journal.read()))
journal.close()
"""


def test_a_full_disk_is_said_once_a_minute_in_one_line_and_its_end_once(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path / "journal.sqlite3")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.split() == ["before", "after"]
    said = [line for line in done.stderr.splitlines() if "arbiterd.daemon.observe.eventbus" in line]
    assert len(said) == 3, done.stderr
    assert said[0].startswith(
        "WARNING arbiterd.daemon.observe.eventbus could not journal a request event"
    )
    assert "events not kept in the last 60 s" in said[1]
    assert said[1].split("still cannot write: ")[1].startswith("60 events")
    assert said[2].endswith("the journal writes again; 100 events were not kept")
    assert "Traceback" not in done.stderr


def test_live_figures_reach_the_subscribers_only(journal: Journal) -> None:
    metrics = Metrics()
    bus = EventBus(metrics, journal)
    events = bus.subscribe()
    before = metrics.text()
    vram = VramEvent(at=7.0, source="accounting", models=(("m", 1024),))
    bus.live(vram)
    assert drain(events) == [vram.to_json()]
    assert journal.read() == []
    assert metrics.text() == before


def test_a_full_subscriber_misses_events_and_the_others_still_get_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(eventbus, "SUBSCRIBER_QUEUE", 2)
    bus = EventBus(Metrics(), None)
    slow, fast = bus.subscribe(), bus.subscribe()
    sent: list[Event] = []
    for n in range(3):
        sent.append(
            bus.publish(RequestEvent(model="m", request_id=f"r{n}", status=RequestStatus.OK))
        )
        assert drain(fast) == [sent[-1].to_json()]
    assert slow.full()
    assert drain(slow) == [sent[0].to_json(), sent[1].to_json()]  # the third found it full
    bus.publish(RequestEvent(model="m", request_id="r3", status=RequestStatus.OK))
    assert len(drain(slow)) == 1  # once it has room again, it gets the next one


def test_an_unsubscribed_queue_gets_nothing_more_and_watched_says_whether_anyone_listens() -> None:
    bus = EventBus(Metrics(), None)

    def watched() -> bool:  # read anew each time, as the VRAM sampler does
        return bus.watched

    assert not watched()
    first, second = bus.subscribe(), bus.subscribe()
    assert watched()
    bus.unsubscribe(first)
    bus.publish(WorkerEvent(model="m"))
    assert drain(first) == []
    assert len(drain(second)) == 1
    bus.unsubscribe(second)
    bus.unsubscribe(second)  # twice is harmless
    assert not watched()


def test_the_metrics_and_the_journal_have_an_event_before_the_subscribers_hear_of_it(
    journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client told of an event can scrape /metrics or page the history and find it there."""
    metrics = Metrics()
    bus = EventBus(metrics, journal)
    seen_when_sent: list[tuple[float | None, int]] = []
    events = bus.subscribe()
    put = events.put_nowait

    def put_and_look(item: dict[str, Any]) -> None:
        counted = metric(metrics, "arbiterd_requests_total", model="m", status="ok")
        seen_when_sent.append((counted, len(journal.read())))
        put(item)

    monkeypatch.setattr(events, "put_nowait", put_and_look)
    bus.publish(RequestEvent(model="m", request_id="r1", status=RequestStatus.OK))
    assert seen_when_sent == [(1.0, 1)]
