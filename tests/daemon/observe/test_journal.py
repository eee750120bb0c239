"""The event journal: storage, bounds, privacy, readers in other processes, typed records back,
and `--since` values."""

from __future__ import annotations

import os
import queue
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from arbiterd.daemon.observe.journal import (
    JOURNAL_SIZE_LIMIT_BYTES,
    SCHEMA_VERSION,
    Journal,
    JournalEvent,
    parse_since,
)
from arbiterd.errors import BadValueError, DaemonError
from arbiterd.events import HandoffEvent, HoldEvent, RequestEvent
from arbiterd.states import RequestStatus
from tests.conftest import Processes
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[3]

# Follows the journal from another process and prints "seq kind model" per event, then exits
# after argv[2] events.
FOLLOWER = """
import sys, threading
from pathlib import Path
from arbiterd.daemon.observe.journal import Journal

journal = Journal.open_readonly(Path(sys.argv[1]))
want = int(sys.argv[2])
seen = 0
for event in journal.follow(poll_s=0.01, stop=threading.Event()):
    print(event.seq, event.kind, event.model, flush=True)
    seen += 1
    if seen == want:
        break
journal.close()
"""


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    opened = Journal(tmp_path / "journal.db")
    yield opened
    opened.close()


def request(model: str, at: float, **extra: Any) -> dict[str, Any]:
    return {"event": "request", "model": model, "at": at, "status": "ok", **extra}


def count_rows(conn: sqlite3.Connection) -> int:
    rows: int = conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    return rows


def lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's stdout lines, read by a thread, so the test can wait with a deadline."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def pump() -> None:
        for line in stdout:
            lines.put(line.strip())

    threading.Thread(target=pump, name="follower-stdout", daemon=True).start()
    return lines


# -- storing and reading -----------------------------------------------------------------------


def test_append_and_read_round_trip_in_seq_order(journal: Journal) -> None:
    events = [
        request("gemma", 100.0, prompt_tokens=5),
        {"event": "hold", "at": 101.0, "held": True},
        {
            "event": "handoff",
            "at": 102.5,
            "from": "gemma",
            "to": "tiny",
            "release_s": 0.1,
            "wait_s": 0.0,
            "restore_s": 0.9,
        },
    ]
    seqs = [journal.append(event) for event in events]

    assert seqs == sorted(seqs)
    assert len(set(seqs)) == 3
    stored = journal.read()
    assert [e.seq for e in stored] == seqs
    assert [e.body for e in stored] == events
    assert [e.kind for e in stored] == ["request", "hold", "handoff"]
    assert [e.model for e in stored] == ["gemma", None, None]
    assert [e.at for e in stored] == [100.0, 101.0, 102.5]
    assert stored[0].to_json() == {**events[0], "seq": seqs[0]}


def test_append_fills_in_a_missing_at_and_leaves_the_callers_dict_alone(
    journal: Journal,
) -> None:
    event: dict[str, Any] = {"event": "hold", "held": False}
    before = time.time()
    journal.append(event)
    after = time.time()

    assert event == {"event": "hold", "held": False}
    (stored,) = journal.read()
    assert before <= stored.at <= after
    assert stored.body["at"] == stored.at


def test_append_refuses_an_event_without_a_kind(journal: Journal) -> None:
    with pytest.raises(BadValueError, match="'event' kind"):
        journal.append({"at": 1.0, "model": "gemma"})
    with pytest.raises(BadValueError, match="'event' kind"):
        journal.append({"event": 3})
    assert journal.read() == []


def test_each_daemon_that_shares_the_journal_reads_back_only_its_own_events(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    with (
        Journal(path, daemon="/run/user/1000/arbiterd/control.sock") as ours,
        Journal(path, daemon="/tmp/other/control.sock") as theirs,
    ):
        ours.append(request("gemma", 100.0))
        theirs.append({"event": "handoff", "at": 101.0, "from": "a", "to": "b"})
        ours.append({"event": "hold", "at": 102.0, "held": True})
        mine = ours.own_events(since=None, after_seq=None, limit=10)
        assert [e.kind for e in mine] == ["request", "hold"]
        assert [e.kind for e in theirs.own_events(since=101.0, after_seq=None, limit=10)] == [
            "handoff"
        ]
        assert len(ours.read()) == 3  # the file itself holds every daemon's rows


def test_a_journal_made_before_rows_named_their_daemon_is_kept_and_named_from_now_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    conn = sqlite3.connect(path)  # the schema as arbiterd wrote it before issue 40
    conn.execute(
        "CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL,"
        " kind TEXT NOT NULL, model TEXT, body TEXT NOT NULL)"
    )
    conn.execute(
        "INSERT INTO events (at, kind, model, body) VALUES (1.0, 'hold', NULL, ?)",
        ('{"event":"hold","at":1.0,"held":true}',),
    )
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    conn.commit()
    conn.close()

    with Journal(path, daemon="/run/control.sock") as journal:
        journal.append(request("gemma", 2.0))
        assert [e.kind for e in journal.read()] == ["hold", "request"]
        # The older row belongs to no daemon's history.
        assert [e.kind for e in journal.own_events(since=None, after_seq=None, limit=10)] == [
            "request"
        ]
    with Journal.open_readonly(path) as reader:  # a reader of the file sees every row still
        assert len(reader.read()) == 2


def test_stored_events_read_back_as_records(journal: Journal) -> None:
    journal.append(request("gemma", 100.0, prompt_tokens=5))
    journal.append({"event": "handoff", "at": 101.0, "from": "gemma", "to": "tiny",
                    "release_s": 0.1, "wait_s": 0.0, "restore_s": 0.9})  # fmt: skip
    records = [stored.event for stored in journal.read()]
    assert records == [
        RequestEvent(at=100.0, model="gemma", prompt_tokens=5, status=RequestStatus.OK),
        HandoffEvent(
            at=101.0, from_model="gemma", to_model="tiny", release_s=0.1, wait_s=0.0, restore_s=0.9
        ),
    ]


def test_a_record_is_stored_as_its_object_and_gets_a_time(journal: Journal) -> None:
    before = time.time()
    journal.append(HoldEvent(held=True))
    (stored,) = journal.read()
    assert stored.kind == "hold"
    assert before <= stored.at <= time.time()
    assert stored.body == {"event": "hold", "at": stored.at, "held": True}
    assert stored.event == HoldEvent(at=stored.at, held=True)


def test_a_hand_edited_row_still_reads_as_a_record(journal: Journal) -> None:
    journal.append({"event": "hold", "at": 5.0, "held": True})
    with sqlite3.connect(journal.path) as conn:
        conn.execute("UPDATE events SET body = 'not json'")
    conn.close()
    (stored,) = journal.read()
    assert stored.body == {"event": "hold", "at": 5.0, "raw": "not json"}
    assert stored.event == HoldEvent(at=5.0)


def test_a_value_json_cannot_hold_is_stored_as_text(journal: Journal) -> None:
    journal.append({"event": "worker", "at": 1.0, "path": Path("/models/gemma.gguf")})
    assert journal.read()[0].body["path"] == "/models/gemma.gguf"


def test_read_filters_by_since_after_seq_kinds_and_limit(journal: Journal) -> None:
    seqs = [
        journal.append(request("gemma", 10.0)),
        journal.append({"event": "hold", "at": 20.0, "held": True}),
        journal.append(request("tiny", 30.0)),
        journal.append({"event": "worker", "at": 40.0, "model": "tiny", "code": 1}),
        journal.append(request("gemma", 50.0)),
    ]

    assert [e.seq for e in journal.read(since=30.0)] == seqs[2:]
    assert [e.seq for e in journal.read(after_seq=seqs[3])] == seqs[4:]
    assert [e.seq for e in journal.read(kinds={"request"})] == [seqs[0], seqs[2], seqs[4]]
    assert [e.seq for e in journal.read(kinds=["hold", "worker"])] == seqs[1:2] + seqs[3:4]
    assert journal.read(kinds=[]) == []
    assert [e.seq for e in journal.read(limit=2)] == seqs[:2]
    assert [e.seq for e in journal.read(since=20.0, kinds=["request"], limit=1)] == [seqs[2]]
    assert [e.seq for e in journal.read(since=15.0, after_seq=seqs[2])] == seqs[3:]
    assert journal.read(limit=0) == []
    with pytest.raises(BadValueError, match="limit"):
        journal.read(limit=-1)


# -- bounds --------------------------------------------------------------------------------------


def test_the_journal_keeps_at_most_max_events_and_drops_the_oldest(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    with Journal(path, max_events=50) as journal:
        counter = sqlite3.connect(path)  # counts as another process would, not via the journal
        try:
            for i in range(1, 1001):
                journal.append(request("gemma", float(i), i=i))
                assert count_rows(counter) <= 50
        finally:
            counter.close()

        kept = journal.read()
        assert kept[-1].body["i"] == 1000
        assert kept[0].body["i"] > 1000 - 50
        assert [e.seq for e in kept] == list(range(kept[0].seq, 1001))


def test_a_bound_of_one_keeps_the_newest_event(tmp_path: Path) -> None:
    with Journal(tmp_path / "journal.db", max_events=1) as journal:
        for i in range(5):
            journal.append(request("gemma", float(i), i=i))
        assert [e.body["i"] for e in journal.read()] == [4]


def test_a_bound_below_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadValueError, match="max_events"):
        Journal(tmp_path / "journal.db", max_events=0)


def test_the_files_stop_growing_once_the_bound_is_reached(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    wal = tmp_path / "journal.db-wal"
    with Journal(path, max_events=200) as journal:
        pad = "x" * 200
        for i in range(1000):
            journal.append(request("gemma", float(i), pad=pad))
        full_size = path.stat().st_size
        for i in range(2000):
            journal.append(request("gemma", float(i), pad=pad))
            if i % 10 == 0:
                assert wal.stat().st_size <= JOURNAL_SIZE_LIMIT_BYTES

        # Trimmed pages are reused, so the database file itself does not grow at all.
        assert path.stat().st_size <= full_size


# -- the file ------------------------------------------------------------------------------------


def test_events_survive_a_restart_and_seqs_are_never_reused(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    with Journal(path, max_events=5) as journal:
        for i in range(20):
            journal.append(request("gemma", float(i), i=i))
        before = journal.read()

    with Journal(path, max_events=5) as journal:
        assert journal.read() == before
        # Every row up to 15 was trimmed; AUTOINCREMENT still never hands out a seq again.
        assert journal.append(request("gemma", 21.0)) == 21


def test_the_journal_is_in_wal_mode_with_normal_sync(journal: Journal) -> None:
    journal.append(request("gemma", 1.0))
    conn = sqlite3.connect(journal.path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()
    assert journal._conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def test_the_files_are_private_even_under_a_permissive_umask(tmp_path: Path) -> None:
    path = tmp_path / "state" / "arbiterd" / "journal.db"
    old_umask = os.umask(0)
    try:
        with Journal(path) as journal:
            journal.append(request("gemma", 1.0))
            for name in ("journal.db", "journal.db-wal", "journal.db-shm"):
                mode = stat.S_IMODE((path.parent / name).stat().st_mode)
                assert mode == 0o600, f"{name} is {mode:o}"
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700


def test_a_journal_from_a_newer_arbiterd_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    Journal(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()

    with pytest.raises(DaemonError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
        Journal(path)
    with pytest.raises(DaemonError, match="newer"):
        Journal.open_readonly(path)

    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    finally:
        conn.close()


def corrupt_copies(folder: Path) -> list[Path]:
    return sorted(folder.glob("journal.db.corrupt-*"))


def test_a_damaged_journal_header_is_moved_aside_with_its_wal_and_shm_and_a_fresh_one_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "journal.db"
    damaged = b"not sqlite at all, " * 100
    path.write_bytes(damaged)
    (tmp_path / "journal.db-wal").write_bytes(b"old wal")
    (tmp_path / "journal.db-shm").write_bytes(b"old shm")
    with Journal(path) as journal:
        assert journal.read() == []
        assert journal.append(request("gemma", 1.0)) == 1
    kept = corrupt_copies(tmp_path)
    assert [p.name.split(".corrupt-")[1].count("-") for p in kept] == [0, 1, 1]  # db, -shm, -wal
    moved = kept[0]
    assert moved.read_bytes() == damaged  # the evidence, as it was
    assert Path(f"{moved}-wal").read_bytes() == b"old wal"
    assert Path(f"{moved}-shm").read_bytes() == b"old shm"
    [warning] = [r for r in caplog.records if "is damaged (" in r.getMessage()]
    assert warning.levelname == "WARNING"
    assert f"moved aside as {moved}; a fresh journal starts" in warning.getMessage()
    assert "its header is not SQLite's" in warning.getMessage()


def test_a_journal_with_a_damaged_page_is_moved_aside_too(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    with Journal(path) as journal:
        for i in range(500):
            journal.append(request("gemma", float(i), pad="x" * 200))
    page = 4096
    assert path.stat().st_size > 4 * page
    with path.open("r+b") as f:  # a table page in the middle: its header and cells
        f.seek(2 * page)
        f.write(b"\xff" * page)
    with Journal(path) as journal:
        assert journal.read() == []
    assert len(corrupt_copies(tmp_path)) == 1


def test_a_journal_damaged_twice_within_a_second_keeps_both_copies(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    for n in range(2):
        path.write_bytes(b"damaged %d" % n * 100)
        Journal(path).close()
    # Two names, whether the second came within the same second (a ".2") or not.
    contents = sorted(p.read_bytes()[:9] for p in corrupt_copies(tmp_path))
    assert contents == [b"damaged 0", b"damaged 1"]


def test_a_loose_state_folder_is_refused_with_its_fix(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o755)
    with pytest.raises(DaemonError, match=rf"mode 0755; it must be 0700 \(chmod 700 {state}\)"):
        Journal(state / "journal.db")
    assert list(state.iterdir()) == []  # nothing written into it


def test_a_loose_journal_and_its_wal_and_shm_are_made_0600_when_opened(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "journal.db"
    old = os.umask(0o022)
    try:
        with Journal(path) as journal:
            journal.append(request("gemma", 1.0))
            # A reader keeps the -wal and -shm as the writer closes (the last one removes them).
            reader = sqlite3.connect(path)
            reader.execute("SELECT COUNT(*) FROM events").fetchone()
        names = ("journal.db", "journal.db-wal", "journal.db-shm")
        for name in names:
            (tmp_path / name).chmod(0o644)  # as an older arbiterd, or a copy, left them
        with Journal(path) as journal:
            assert [e.model for e in journal.read()] == ["gemma"]
            for name in names:
                mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
                assert mode == 0o600, f"{name} is {mode:o}"
        reader.close()
    finally:
        os.umask(old)
    said = [r.getMessage() for r in caplog.records if "had mode 0644" in r.getMessage()]
    assert len(said) == 3


def test_a_symlink_at_the_journal_is_refused_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.db"
    target.write_bytes(b"")
    target.chmod(0o644)
    (tmp_path / "journal.db").symlink_to(target)
    with pytest.raises(DaemonError, match="is a symbolic link; move it away"):
        Journal(tmp_path / "journal.db")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # not touched through the link


def test_a_closed_journal_refuses_appends_and_closes_twice(journal: Journal) -> None:
    journal.close()
    journal.close()
    with pytest.raises(DaemonError, match="closed"):
        journal.append(request("gemma", 1.0))
    with pytest.raises(DaemonError, match="closed"):
        journal.read()


# -- readers and writers -------------------------------------------------------------------------


def test_a_read_only_journal_reads_but_never_writes(journal: Journal) -> None:
    journal.append(request("gemma", 1.0))
    with Journal.open_readonly(journal.path) as reader:
        assert [e.model for e in reader.read()] == ["gemma"]
        with pytest.raises(DaemonError, match="read-only"):
            reader.append(request("tiny", 2.0))
    assert len(journal.read()) == 1


def test_opening_a_missing_journal_read_only_says_so(tmp_path: Path) -> None:
    with pytest.raises(DaemonError, match="no journal at"):
        Journal.open_readonly(tmp_path / "missing.db")
    assert not (tmp_path / "missing.db").exists()


def test_a_follower_in_another_process_sees_later_appends(
    journal: Journal, procs: Processes
) -> None:
    journal.append(request("gemma", 1.0))
    journal.append(request("tiny", 2.0))
    proc = procs.start(
        [sys.executable, "-c", FOLLOWER, str(journal.path), "5"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = lines_of(proc)
    # The stored events first: once both are printed, the follower is polling for new ones.
    assert lines.get(timeout=30) == "1 request gemma"
    assert lines.get(timeout=10) == "2 request tiny"

    journal.append({"event": "hold", "at": 3.0, "held": True})
    assert lines.get(timeout=10) == "3 hold None"
    journal.append(request("gemma", 4.0))
    journal.append({"event": "worker", "at": 5.0, "model": "tiny", "code": -9})
    assert lines.get(timeout=10) == "4 request gemma"
    assert lines.get(timeout=10) == "5 worker tiny"
    assert proc.wait(timeout=10) == 0


def test_follow_starts_at_since_and_ends_when_stopped(journal: Journal) -> None:
    journal.append(request("gemma", 10.0))
    journal.append(request("tiny", 20.0))
    seen: list[JournalEvent] = []
    stop = threading.Event()

    def follow() -> None:
        seen.extend(journal.follow(since=15.0, poll_s=0.01, stop=stop))

    follower = threading.Thread(target=follow, name="follower")
    follower.start()
    try:
        wait_until(lambda: len(seen) == 1, 10, "the stored event since 15")
        journal.append(request("gemma", 30.0))
        wait_until(lambda: len(seen) == 2, 10, "the new event")
    finally:
        stop.set()
        follower.join(timeout=10)
    assert not follower.is_alive()
    assert [e.at for e in seen] == [20.0, 30.0]


def test_follow_from_a_since_after_every_event_yields_only_new_ones(journal: Journal) -> None:
    journal.append(request("gemma", 10.0))
    stop = threading.Event()
    events = journal.follow(since=1e12, poll_s=0.01, stop=stop)
    journal.append(request("tiny", 5.0))  # a clock that stepped back is still followed
    assert next(events).model == "tiny"
    stop.set()
    assert list(events) == []


def test_appends_from_many_threads_all_land(journal: Journal) -> None:
    threads, per_thread = 8, 100
    start = threading.Barrier(threads)
    seqs: list[list[int]] = [[] for _ in range(threads)]

    def append(t: int) -> None:
        start.wait(timeout=10)
        for i in range(per_thread):
            seqs[t].append(journal.append({"event": "request", "thread": t, "i": i}))

    workers = [
        threading.Thread(target=append, args=(t,), name=f"appender-{t}") for t in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    assert not any(worker.is_alive() for worker in workers)

    stored = journal.read()
    assert len(stored) == threads * per_thread
    assert sorted(seq for mine in seqs for seq in mine) == [e.seq for e in stored]
    for t in range(threads):
        assert [e.body["i"] for e in stored if e.body["thread"] == t] == list(range(per_thread))


# -- --since -------------------------------------------------------------------------------------

NOW = datetime(2024, 6, 10, 15, 0, 0).timestamp()  # local time, as a user types it


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", NOW - 30),
        ("10m", NOW - 600),
        ("2h", NOW - 7200),
        ("1d", NOW - 86400),
        ("1w", NOW - 7 * 86400),
        ("1.5h", NOW - 5400),
        ("1h30m", NOW - 5400),
        (" 5m ", NOW - 300),
        ("0s", NOW),
        ("1718000000", 1718000000.0),
        ("1718000000.25", 1718000000.25),
        ("2024-06-10T12:00:00+00:00", 1718020800.0),
        ("2024-06-10T12:00:00Z", 1718020800.0),
        ("2024-06-10 14:00:00+02:00", 1718020800.0),
        ("2024-06-10T12:00:00", datetime(2024, 6, 10, 12).timestamp()),
        ("2024-06-10", datetime(2024, 6, 10).timestamp()),
        ("12:00", datetime(2024, 6, 10, 12).timestamp()),
        ("18:30", datetime(2024, 6, 9, 18, 30).timestamp()),  # later than now: yesterday's
    ],
)
def test_parse_since_reads_epochs_dates_times_and_durations(text: str, expected: float) -> None:
    assert parse_since(text, now=NOW) == pytest.approx(expected)


def test_parse_since_defaults_now_to_the_clock() -> None:
    before = time.time()
    since = parse_since("10m")
    assert before - 600 <= since <= time.time() - 600


def test_parse_since_of_an_aware_datetime_matches_its_instant() -> None:
    moment = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_since(moment.isoformat()) == moment.timestamp()


@pytest.mark.parametrize(
    "text",
    ["", "   ", "yesterday", "-5m", "10x", "5mm", "m", "nan", "inf", "1e9", "2024-13-01", "12:61"],
)
def test_parse_since_refuses_anything_else_clearly(text: str) -> None:
    with pytest.raises(BadValueError, match=r"expected seconds since the epoch .* 10m"):
        parse_since(text, now=NOW)
