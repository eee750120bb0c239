"""The daemon's durable event journal: one SQLite file in WAL mode, bounded in size.

Owns the journal database (its schema, its version, its trimming) and the reading of `--since`
values (`parse_since`). It never decides what an event means: it stores the daemon's event
objects (arbiterd/events.py lists them) as they come, and reads them back as stored; their
records (`JournalEvent.event`) come from arbiterd.events, their human lines from arbiterd.render.

Invariants kept here:
- One writer connection per Journal, shared between threads (`check_same_thread=False`) and used
  only under `_lock`; a reader in another process opens its own read-only connection. WAL mode is
  what lets that reader see committed appends without ever blocking the writer
  (https://sqlite.org/wal.html, "readers do not block writers and a writer does not block readers").
- `seq` is AUTOINCREMENT, so a seq is never reused, even after trimming every row
  (https://sqlite.org/autoinc.html); followers resume from the last seq they saw.
- Rows are deleted only oldest-first (`seq <= cutoff`), so the rows always form a suffix of the
  seqs ever issued, and `newest - oldest + 1` bounds their count without a COUNT(*).
- The file is 0600 in a 0700 directory: events name models and programs of one user. The
  directory is checked as the runtime folder is (paths.ensure_private_dir: a loose one is
  refused with its fix); the file is created O_EXCL|O_NOFOLLOW 0600, an existing one (and its
  -wal and -shm) opened O_NOFOLLOW, checked to be ours and put back to 0600 with fchmod, all
  before SQLite opens them; SQLite then creates -wal and -shm with the database file's mode.
- Each row names the daemon that wrote it (`daemon`: its control socket, one daemon per socket,
  daemon/instance.py), so two daemons that share the state folder, and so the journal, each read
  back their own history (issue 40: a dashboard showed the other daemon's handoffs). The column
  was added after schema 1 shipped, as a nullable column an older arbiterd neither reads nor
  fills, so the version stays 1: a journal of an older daemon gets the column when a newer one
  opens it, its earlier rows with none (they belong to no daemon's history).
- A damaged journal never stops the daemon (issue 24): a file SQLite calls not a database or
  corrupt, as it is opened or checked (PRAGMA quick_check), is moved aside with its -wal and
  -shm as `<name>.corrupt-<time>` (the evidence kept, a warning logged) and a fresh one is
  started. A journal of a newer schema is not damaged: it is refused and left alone.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from datetime import time as dt_time
from pathlib import Path
from typing import Any

from arbiterd.errors import BadValueError, DaemonError
from arbiterd.events import Event, parse_event
from arbiterd.paths import ensure_private_dir

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1  # kept in PRAGMA user_version; a newer file is refused, never rewritten
DEFAULT_MAX_EVENTS = 100_000
TRIM_BATCH = 1000  # rows deleted at once when over the bound (at most a tenth of the bound)
BUSY_TIMEOUT_S = 5.0  # how long a statement waits for another process's write lock
CHECKPOINT_BUSY_MS = 100  # a checkpoint after a trim waits this long for readers, then gives up
JOURNAL_SIZE_LIMIT_BYTES = 4 * 1024 * 1024  # the -wal file is cut back to this after checkpoints
FOLLOW_BATCH = 500  # rows read per query while following
PRIVATE_FILE_MODE = 0o600
# The SQLite files beside the database: its write-ahead log and its shared-memory index.
COMPANIONS = ("-wal", "-shm")
# What SQLite says of a damaged file (https://sqlite.org/rescode.html), as primary codes: the
# file is not a database (its header is not SQLite's) or the database is corrupt.
_DAMAGED = frozenset({26, 11})  # SQLITE_NOTADB, SQLITE_CORRUPT
_SQLITE_HEADER = b"SQLite format 3\x00"  # every database file's first 16 bytes

_SCHEMA = (
    "CREATE TABLE events ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " at REAL NOT NULL,"
    " kind TEXT NOT NULL,"
    " model TEXT,"
    " body TEXT NOT NULL,"
    " daemon TEXT)",
    "CREATE INDEX events_at ON events (at)",
)
# The column a journal made before rows named their daemon lacks (added as it is opened).
_ADD_DAEMON = "ALTER TABLE events ADD COLUMN daemon TEXT"


@dataclass(frozen=True)
class JournalEvent:
    """One stored event: `body` is the event object as it was appended (with "at" filled in)."""

    seq: int
    at: float  # seconds since the epoch
    kind: str
    model: str | None
    body: dict[str, Any]

    @property
    def event(self) -> Event:
        """The body as its record (arbiterd.events); a malformed body reads as far as it can."""
        return parse_event(self.body)

    def to_json(self) -> dict[str, Any]:
        return {**self.body, "seq": self.seq}


class Journal:
    """The event journal at `path`; `Journal(path)` opens it for appending, creating it if needed.

    `daemon` names the daemon whose events it appends (its control socket): each row carries it,
    and `own_events` reads back only those rows. `open_readonly(path)` opens an existing journal
    for `read`/`follow` only, e.g. from the CLI while the daemon writes.
    """

    path: Path
    max_events: int
    readonly: bool
    daemon: str | None
    _oldest_seq: int | None  # a lower bound of the oldest row's seq; None: no row yet

    def __init__(
        self, path: Path, *, max_events: int = DEFAULT_MAX_EVENTS, daemon: str | None = None
    ) -> None:
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise BadValueError(f"max_events must be a positive integer, not {max_events!r}")
        self._setup(path, max_events, readonly=False)
        self.daemon = daemon
        ensure_private_dir(self.path.parent, DaemonError)
        try:
            self._open_for_writing()
        except _Damaged as damaged:
            moved = _move_aside(self.path)
            log.warning(
                "the journal %s is damaged (%s): moved aside as %s; a fresh journal starts",
                self.path,
                damaged,
                moved,
            )
            self._open_for_writing()  # a fresh file: damaged again is an error, not a loop

    def _open_for_writing(self) -> None:
        """Open (creating it if needed) the file at `path` as a journal; _Damaged when SQLite
        finds it damaged, DaemonError for anything else that goes wrong."""
        _open_private_files(self.path)
        if _not_sqlite(self.path):
            # Before SQLite sees it: on a file it calls not a database, it would reset the -shm
            # and delete the -wal as it closes, and they are part of what is moved aside.
            raise _Damaged("its header is not SQLite's")
        self._conn = self._connect(str(self.path), uri=False)
        try:
            # Journal mode must be set outside a transaction; it is persistent in the file.
            self._conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a power cut may lose the last commits, never corrupt the file
            # (https://sqlite.org/pragma.html#pragma_synchronous).
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT_BYTES}")
            # Every page's structure, without matching indexes to their tables: milliseconds
            # for a journal at its bound, and a damaged page is found now, not by each append.
            problems = [row[0] for row in self._conn.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise _Damaged("; ".join(problems[:3]))
            self._create_schema()
            self._oldest_seq = self._conn.execute("SELECT MIN(seq) FROM events").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            if _damaged(exc):
                raise _Damaged(str(exc)) from exc
            raise DaemonError(f"journal {self.path}: {exc}") from exc
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def open_readonly(cls, path: Path) -> Journal:
        """Open an existing journal for reading only; works while another process appends."""
        self = cls.__new__(cls)
        self._setup(path, DEFAULT_MAX_EVENTS, readonly=True)
        self.daemon = None
        if not self.path.exists():
            raise DaemonError(f"no journal at {self.path} (has the daemon run yet?)")
        # mode=ro: this connection can never write, so a reader cannot disturb the daemon's file.
        self._conn = self._connect(self.path.resolve().as_uri() + "?mode=ro", uri=True)
        try:
            version = self._user_version()
            if version == 0:
                raise DaemonError(f"{self.path} is not an arbiterd journal (no schema yet)")
            self._check_version(version)
        except sqlite3.Error as exc:
            self._conn.close()
            raise DaemonError(f"journal {self.path}: {exc}") from exc
        except BaseException:
            self._conn.close()
            raise
        return self

    def _setup(self, path: Path, max_events: int, *, readonly: bool) -> None:
        self.path = Path(path)
        self.max_events = max_events
        self.readonly = readonly
        # Trim in batches so most appends only insert; the bound is kept exactly all the same.
        batch = max(1, min(TRIM_BATCH, max_events // 10))
        self._keep_after_trim = max(1, max_events - batch)
        self._oldest_seq = None
        self._trimmed_since_checkpoint = 0
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, target: str, *, uri: bool) -> sqlite3.Connection:
        try:
            # isolation_level=None: no implicit transactions; appends use BEGIN IMMEDIATE, so a
            # writer takes the write lock up front instead of failing to upgrade a read lock.
            return sqlite3.connect(
                target,
                uri=uri,
                timeout=BUSY_TIMEOUT_S,
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise DaemonError(f"cannot open the journal {self.path}: {exc}") from exc

    def _user_version(self) -> int:
        version: int = self._conn.execute("PRAGMA user_version").fetchone()[0]
        return version

    def _check_version(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise DaemonError(
                f"the journal {self.path} has schema version {version}, newer than this arbiterd"
                f" understands ({SCHEMA_VERSION}); upgrade arbiterd or move the file away"
            )

    def _create_schema(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            # Read under the write lock: two daemons starting at once create the table once.
            version = self._user_version()
            self._check_version(version)
            if version == 0:
                for statement in _SCHEMA:
                    self._conn.execute(statement)
                self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            elif "daemon" not in self._columns():
                self._conn.execute(_ADD_DAEMON)
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _columns(self) -> set[str]:
        return {row[1] for row in self._conn.execute("PRAGMA table_info(events)").fetchall()}

    # -- writing -------------------------------------------------------------------------------

    def append(self, event: Event | Mapping[str, Any]) -> int:
        """Store one event (a record, or its object); returns its seq. Fills in "at" (now) when
        it is missing.

        A value JSON cannot hold is stored as its str(): the journal is a record, and never a
        reason to lose an event.
        """
        body = event.to_json() if isinstance(event, Event) else dict(event)
        kind = body.get("event")
        if not isinstance(kind, str) or not kind:
            raise BadValueError(f"a journal event needs an 'event' kind string, got {kind!r}")
        at = body.get("at")
        if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
            at = time.time()
            body["at"] = at
        model = body.get("model")
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), default=str)
        with self._lock:
            self._check_writable()
            try:
                return self._insert(
                    float(at), kind, model if isinstance(model, str) else None, text, self.daemon
                )
            except sqlite3.Error as exc:
                raise DaemonError(f"cannot append to the journal {self.path}: {exc}") from exc

    def _insert(
        self, at: float, kind: str, model: str | None, text: str, daemon: str | None
    ) -> int:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            cursor = conn.execute(
                "INSERT INTO events (at, kind, model, body, daemon) VALUES (?, ?, ?, ?, ?)",
                (at, kind, model, text, daemon),
            )
            seq = cursor.lastrowid
            assert seq is not None  # an INSERT into a rowid table always sets it
            if self._oldest_seq is None:
                self._oldest_seq = conn.execute("SELECT MIN(seq) FROM events").fetchone()[0]
            deleted = 0
            if seq - self._oldest_seq + 1 > self.max_events:
                cutoff = seq - self._keep_after_trim
                deleted = conn.execute("DELETE FROM events WHERE seq <= ?", (cutoff,)).rowcount
                self._oldest_seq = cutoff + 1
        except BaseException:
            conn.execute("ROLLBACK")
            # The cached oldest seq may be ahead of the rolled-back state; ask the file again.
            self._oldest_seq = conn.execute("SELECT MIN(seq) FROM events").fetchone()[0]
            raise
        conn.execute("COMMIT")
        if deleted > 0:
            # A checkpoint costs an fsync (milliseconds): under a small bound, trims come every
            # few appends, so checkpoint once per TRIM_BATCH rows trimmed, not per trim.
            self._trimmed_since_checkpoint += deleted
            if self._trimmed_since_checkpoint >= min(TRIM_BATCH, self.max_events):
                self._trimmed_since_checkpoint = 0
                self._checkpoint()
        return seq

    def _checkpoint(self) -> None:
        """Fold the WAL into the database and truncate it, so the -wal file stays small too.

        TRUNCATE waits on the busy handler for readers (https://sqlite.org/c3ref/wal_checkpoint_v2
        .html); a short wait keeps the daemon's loop responsive, and a busy checkpoint is simply
        tried again after the next TRIM_BATCH rows are trimmed.
        """
        conn = self._conn
        conn.execute(f"PRAGMA busy_timeout={CHECKPOINT_BUSY_MS}")
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise DaemonError(f"the journal {self.path} was opened read-only")

    def _check_open(self) -> None:
        if self._closed:
            raise DaemonError(f"the journal {self.path} is closed")

    # -- reading -------------------------------------------------------------------------------

    def read(
        self,
        *,
        since: float | None = None,
        after_seq: int | None = None,
        limit: int | None = None,
        kinds: Collection[str] | None = None,
        daemon: str | None = None,
    ) -> list[JournalEvent]:
        """Events in seq order: at or after `since` (epoch seconds), with seq above `after_seq`,
        of one of `kinds`, written by `daemon`, the first `limit` of them. Every filter is
        optional."""
        if limit is not None and limit < 0:
            raise BadValueError(f"limit must not be negative, got {limit}")
        clauses: list[str] = []
        params: list[object] = []
        if since is not None:
            clauses.append("at >= ?")
            params.append(float(since))
        if after_seq is not None:
            clauses.append("seq > ?")
            params.append(int(after_seq))
        if kinds is not None:
            wanted = sorted(set(kinds))
            if not wanted:
                return []
            clauses.append(f"kind IN ({', '.join('?' * len(wanted))})")
            params.extend(wanted)
        if daemon is not None:
            clauses.append("daemon = ?")
            params.append(daemon)
        sql = "SELECT seq, at, kind, model, body FROM events"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        rows = self._query(sql, params)
        return [_row_event(row) for row in rows]

    def own_events(
        self, *, since: float | None, after_seq: int | None, limit: int
    ) -> list[JournalEvent]:
        """The events this journal's daemon appended (`read` with `daemon`), as the control
        socket's `events` answers them: another daemon that shares the file keeps its own.
        A journal opened with no `daemon` reads every row."""
        return self.read(since=since, after_seq=after_seq, limit=limit, daemon=self.daemon)

    def follow(
        self,
        *,
        since: float | None = None,
        after_seq: int | None = None,
        poll_s: float = 0.2,
        stop: threading.Event | None = None,
    ) -> Iterator[JournalEvent]:
        """Yield the stored events from `since` (or after `after_seq`; from the first when both
        are None), then each new one as any process appends it, until `stop` is set.

        `since` only picks the starting point, and it is picked now, not at the first `next()`:
        later events are followed by seq, so a clock that steps back does not hide them.
        """
        if poll_s <= 0:
            raise BadValueError(f"poll_s must be positive, got {poll_s}")
        last = after_seq
        if since is not None:
            start = self._seq_before(float(since))
            last = start if last is None else max(last, start)
        return self._follow_after(last, poll_s, stop)

    def _follow_after(
        self, last: int | None, poll_s: float, stop: threading.Event | None
    ) -> Iterator[JournalEvent]:
        while stop is None or not stop.is_set():
            batch = self.read(after_seq=last, limit=FOLLOW_BATCH)
            for event in batch:
                yield event
                last = event.seq
                if stop is not None and stop.is_set():
                    return
            if len(batch) < FOLLOW_BATCH:  # caught up: wait for the next append
                if stop is None:
                    time.sleep(poll_s)
                elif stop.wait(poll_s):
                    return

    def _seq_before(self, since: float) -> int:
        """The seq after which the events at or after `since` begin."""
        rows = self._query(
            "SELECT COALESCE((SELECT MIN(seq) FROM events WHERE at >= ?) - 1,"
            " (SELECT MAX(seq) FROM events), 0)",
            [since],
        )
        seq: int = rows[0][0]
        return seq

    def _query(self, sql: str, params: list[object]) -> list[tuple[Any, ...]]:
        with self._lock:
            self._check_open()
            try:
                return self._conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise DaemonError(f"cannot read the journal {self.path}: {exc}") from exc

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection; idempotent. The last connection to close folds the WAL back."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _row_event(row: tuple[Any, ...]) -> JournalEvent:
    seq, at, kind, model, text = row
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if not isinstance(body, dict):  # only a hand-edited file gets here; show it, do not crash
        body = {"event": kind, "at": at, "raw": text}
    return JournalEvent(seq=seq, at=at, kind=kind, model=model, body=body)


class _Damaged(Exception):
    """The journal's file is damaged (SQLite's words, or quick_check's, are the message)."""


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in _DAMAGED  # an extended code's low byte


def _not_sqlite(path: Path) -> bool:
    """Whether the file at `path` (checked by _open_private_files: ours, not a link) has bytes
    but not SQLite's header string (https://sqlite.org/fileformat.html, 1.3); an empty file is
    a journal SQLite has yet to write."""
    with open(path, "rb") as f:
        head = f.read(len(_SQLITE_HEADER))
    return bool(head) and head != _SQLITE_HEADER


def _move_aside(path: Path) -> Path:
    """Rename the damaged journal at `path`, and its -wal and -shm, to `<path>.corrupt-<time>`
    (and that name's -wal and -shm, so SQLite reads them together); returns the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while any(Path(f"{target}{suffix}").exists() for suffix in ("", *COMPANIONS)):
        n += 1  # damaged twice within a second: keep both
        target = path.with_name(f"{path.name}.corrupt-{stamp}.{n}")
    for suffix in ("", *COMPANIONS):
        try:
            os.rename(f"{path}{suffix}", f"{target}{suffix}")
        except FileNotFoundError:
            continue  # no -wal or -shm: nothing was being written
        except OSError as exc:
            raise DaemonError(
                f"the journal {path} is damaged and cannot be moved aside: {exc.strerror}; "
                "move it away"
            ) from None
    return target


def _open_private_files(path: Path) -> None:
    """Before SQLite opens the journal: create it 0600 (SQLite would use 0644 & ~umask), or
    check the one there, and its -wal and -shm, to be regular files of ours, and put their mode
    back to 0600 (a journal copied in, or made by an older arbiterd, may be 0644)."""
    _private_file(path, create=True)
    for suffix in COMPANIONS:
        _private_file(Path(f"{path}{suffix}"), create=False)


def _private_file(path: Path, *, create: bool) -> None:
    # O_NOFOLLOW: a symlink planted at the name is refused (ELOOP), never followed.
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags | (os.O_CREAT | os.O_EXCL if create else 0), PRIVATE_FILE_MODE)
        except FileExistsError:
            fd = os.open(path, flags)
    except FileNotFoundError:
        return  # an absent -wal or -shm: SQLite creates it with the database's mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DaemonError(f"{path} is a symbolic link; move it away") from None
        raise DaemonError(f"cannot open the journal file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)  # the file opened, not whatever the name means by now
        if not stat.S_ISREG(st.st_mode):
            raise DaemonError(f"{path} is not a regular file; move it away")
        if st.st_uid != os.getuid():
            raise DaemonError(f"{path} is owned by uid {st.st_uid}, not by you; move it away")
        if stat.S_IMODE(st.st_mode) != PRIVATE_FILE_MODE:
            # A umask may narrow O_CREAT's mode; an old file may be wider. Either way: 0600.
            if st.st_mode & 0o077:
                log.warning(
                    "%s had mode %04o: made %04o", path, stat.S_IMODE(st.st_mode), PRIVATE_FILE_MODE
                )
            os.fchmod(fd, PRIVATE_FILE_MODE)
    finally:
        os.close(fd)


# -- --since values ----------------------------------------------------------------------------

_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?\s*[smhdw]\s*)+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_EPOCH = re.compile(r"\d+(?:\.\d*)?")
SINCE_FORMS = (
    "seconds since the epoch (1718000000), an ISO-8601 date or time (2024-06-10T12:00:00,"
    " 2024-06-10, 12:00), or a duration ago (30s, 10m, 2h, 1d, 1h30m)"
)


def parse_since(text: str, now: float | None = None) -> float:
    """A `--since` value as seconds since the epoch.

    Accepts an epoch number, an ISO-8601 datetime or date (naive ones are local time), a time of
    day (its last occurrence, local), or a duration before `now` such as "10m" or "1h30m".
    """
    value = text.strip()
    if not value:
        raise BadValueError(f"an empty time; expected {SINCE_FORMS}")
    if _DURATION.fullmatch(value):
        seconds = sum(float(n) * _UNIT_S[unit] for n, unit in _DURATION_PART.findall(value))
        return (time.time() if now is None else now) - seconds
    if _EPOCH.fullmatch(value):
        return float(value)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        pass
    else:
        return moment.timestamp()  # a naive datetime is taken as local time
    try:
        clock = dt_time.fromisoformat(value)
    except ValueError:
        pass
    else:
        # The last time the clock read so: "--since 23:00" just after midnight means yesterday.
        now_s = time.time() if now is None else now
        today = date.fromtimestamp(now_s)
        moment = datetime.combine(today, clock)
        if moment.timestamp() > now_s:
            moment = datetime.combine(today - timedelta(days=1), clock)
        return moment.timestamp()
    raise BadValueError(f"cannot read {text!r} as a time; expected {SINCE_FORMS}")
