"""The arena: one GPU's token, held with flock(2), and "someone wants it" kept as kernel lock state.

Owns every flock call on the token's files (only this module and groups.py, a group's gate
inside an arena, import `fcntl`), the files of an arena directory, and the reading of
`/proc/locks`. The protocol is specified in docs/arena-protocol.md;
in short:

    token.lock   LOCK_EX by the holder: a program is resident on the GPU iff it holds this
    want.lock    LOCK_SH by every waiter while it waits; dropped only after the token is owned
    holder.json  who holds the token (pid, name, model, since, command_pid); informational,
                 written by rename
    queue/       one ticket file per queued waiter, PRIORITY.SINCE_NS.PID.THREAD.ticket, held
                 LOCK_EX by it while it waits: the token goes to the first live ticket in the
                 order (arrival, put back one aging period per class below interactive). A
                 waiter waits for the ticket just ahead of it to go, and only the first one
                 blocks on token.lock. Programs that speak only token.lock + want.lock take no
                 ticket and race the first waiter.

Invariants kept here (each one cost a hang in an earlier design):
- Lock files are created once and never unlinked: unlinking splits later lockers across two
  inodes, and then two programs can hold "the" token at once.
- The holder asks "wanted?" with LOCK_EX|LOCK_NB on its *own* open file description of
  want.lock. flock locks belong to open file descriptions; a second flock on a description that
  already holds a lock converts that lock instead of conflicting with it.
- EWOULDBLOCK/EAGAIN is contention, never an error.
- A ticket is locked before it is visible (created under a dot name, locked, renamed) and
  unlinked before it is unlocked: a ticket file that is not locked is a dead waiter's, and any
  waiter may remove it.
- The order of two tickets never changes while both wait (QueuedWaiter.order is fixed by the
  name): a waiter only ever waits on a ticket ahead of it, so no two can wait on each other.
  (Issue 24: when aging reordered tickets as they waited, one that aged past the ticket it was
  blocked on was in turn waited on by that ticket's owner, both for good, the GPU free.)
- A process that dies holds nothing: the kernel drops its locks, so nothing can go stale except
  holder.json, which readers check against the live lock owner in /proc/locks. (A process it
  shared the locked description with, such as `arbiterd run`'s CMD, keeps the token alive.)
- Whoever can write an arena file can take, block or fake the token (issue 10 item 6). Every
  file is opened with O_NOFOLLOW and checked on the opened descriptor (fstat: no window between
  check and use): ours, regular, not writable by group or others; a refusal names the file and
  the one-line fix. Temp files are created with O_EXCL in the arena folder, which
  paths.ensure_private_dir keeps ours and 0700.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import fcntl
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

from arbiterd.errors import (
    AcquireCancelledError,
    AcquireTimeoutError,
    ArenaError,
    ArenaUnsupportedError,
    ArenaUnwritableError,
    BadValueError,
)
from arbiterd.paths import ensure_private_dir

TOKEN_FILE = "token.lock"  # noqa: S105 (a file name, not a password)
WANT_FILE = "want.lock"
HOLDER_FILE = "holder.json"
QUEUE_DIR = "queue"
TICKET_SUFFIX = ".ticket"
# A ticket stands in line as if it had come this much later for each class below interactive:
# a batch job is behind only the interactive requests that come within two of these after it.
# Every process of an arena must use the same value, or they disagree on the order.
PRIORITY_AGING_S = 30.0
FILE_MODE = 0o600
# Group or other write on an arena file lets another account take, block or fake the token.
# Read bits are harmless: nobody else can reach a file in the arena folder (0700).
_OTHERS_WRITE = 0o022
# holder.json is under 200 bytes; one longer than this is malformed and is not read whole.
HOLDER_FILE_MAX_BYTES = 64 * 1024
PROC_LOCKS = Path("/proc/locks")
# How often a cancellable wait looks at its cancel event. Granting the token is not delayed by
# it: the waiting thread wakes as soon as the kernel grants the lock.
CANCEL_POLL_S = 0.05
# How long hand_over() waits for a waiter to take the token, and how it polls meanwhile (the
# handoff itself takes microseconds; the bound covers a waiter that is descheduled).
HAND_OVER_TIMEOUT_S = 1.0
HAND_OVER_POLL_MIN_S = 0.00005
HAND_OVER_POLL_MAX_S = 0.002
# errno values with which a filesystem says it cannot do flock (NFS without a lock manager,
# some FUSE filesystems).
_NO_FLOCK_ERRNOS = {errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL, errno.ENOSYS}


class Priority(enum.StrEnum):
    """A waiter's class: a higher one is admitted first; within a class, arrival order."""

    INTERACTIVE = "interactive"  # a person waiting on the answer
    NORMAL = "normal"
    BATCH = "batch"  # work nobody watches

    @property
    def rank(self) -> int:
        return list(Priority).index(self)  # 0 first


PRIORITY_CHOICES = ", ".join(p.value for p in Priority)


def parse_priority(text: str, where: str) -> Priority:
    """`text` as a Priority; BadValueError naming `where` and the allowed names."""
    try:
        return Priority(text)
    except ValueError:
        raise BadValueError(f"{where} must be one of {PRIORITY_CHOICES}, got {text!r}") from None


@dataclass(frozen=True)
class QueuedWaiter:
    """A live ticket in an arena's queue."""

    pid: int
    priority: Priority
    since_ns: int  # CLOCK_MONOTONIC when it queued (one clock for every process of a boot)
    file: str  # the ticket's file name, unique

    @property
    def place_ns(self) -> int:
        """Where it stands in line: its arrival, put back one aging period for each class below
        interactive. Aging is built in: a batch ticket that has waited two periods is ahead of
        every ticket that comes after, whatever its class."""
        return self.since_ns + self.priority.rank * round(PRIORITY_AGING_S * 1e9)

    @property
    def order(self) -> tuple[int, str]:
        """Its place in the queue, then its unique name. Fixed when it queues: two tickets never
        change places while they wait (see the module docstring for why that matters)."""
        return (self.place_ns, self.file)

    def competes_as(self, now_ns: int) -> Priority:
        """The class it has aged to by `now_ns`, one up per aging period waited: the highest
        class whose newcomers now queue behind it."""
        aged = int(self.waited_s(now_ns) // PRIORITY_AGING_S)
        return list(Priority)[max(0, self.priority.rank - aged)]

    @classmethod
    def from_file_name(cls, name: str) -> QueuedWaiter | None:
        """The waiter a ticket file names; None for a name that is not a ticket's."""
        parts = name.removesuffix(TICKET_SUFFIX).split(".")
        if not name.endswith(TICKET_SUFFIX) or len(parts) != 4:
            return None
        priority, since, pid, _thread = parts
        if priority not in {p.value for p in Priority} or not (since + pid).isdigit():
            return None
        return cls(int(pid), Priority(priority), int(since), name)

    def waited_s(self, now_ns: int) -> float:
        return max(0, now_ns - self.since_ns) / 1e9

    def to_json(self, now_ns: int) -> dict[str, object]:
        return {
            "pid": self.pid,
            "priority": self.priority.value,
            "ticket": self.since_ns,
            "competes_as": self.competes_as(now_ns).value,
            "waited_s": round(self.waited_s(now_ns), 3),
        }


@dataclass(frozen=True)
class HolderInfo:
    """What holder.json says about the holder."""

    pid: int  # the process that locked token.lock
    name: str
    model: str | None
    since: float  # seconds since the epoch
    # A command the holder runs on its token (`arbiterd run`'s CMD). It inherited the locked
    # open file description, so it keeps the token should the holder die first.
    command_pid: int | None = None

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "pid": self.pid,
            "name": self.name,
            "model": self.model,
            "since": self.since,
        }
        if self.command_pid is not None:
            data["command_pid"] = self.command_pid
        return data

    @classmethod
    def from_json(cls, raw: bytes) -> HolderInfo | None:
        """Parse holder.json; an empty (released) or malformed file means "no information"."""
        try:
            data = json.loads(raw) if raw.strip() else None
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        pid, name, model, since = (data.get(k) for k in ("pid", "name", "model", "since"))
        if not isinstance(pid, int) or not isinstance(name, str):
            return None
        if not isinstance(since, int | float):
            return None
        command_pid = data.get("command_pid")
        return cls(
            pid,
            name,
            model if isinstance(model, str) else None,
            float(since),
            command_pid if isinstance(command_pid, int) else None,
        )


@dataclass(frozen=True)
class ArenaState:
    """A snapshot of an arena, read without touching its locks."""

    path: Path
    holder_pid: int | None  # the owner of token.lock, from /proc/locks (see observe())
    holder: HolderInfo | None  # holder.json, only when it names the live owner
    stale_holder: HolderInfo | None  # holder.json naming a pid that does not hold the token
    waiter_pids: tuple[int, ...]  # pids holding (or queued for) LOCK_SH on want.lock
    observed_ns: int  # CLOCK_MONOTONIC when read: how long the queue has waited, and aged
    queue: tuple[QueuedWaiter, ...] = ()  # the live tickets, first to be served first


@dataclass(frozen=True)
class _LockRecord:
    """One line of /proc/locks."""

    kind: str  # FLOCK, POSIX, OFDLCK, LEASE, ...
    mode: str  # READ or WRITE
    pid: int
    inode: tuple[int, int, int]  # (major, minor, inode number)
    blocked: bool  # a request waiting to be granted ("->" lines)


def parse_proc_locks(text: str) -> list[_LockRecord]:
    """Parse /proc/locks (fs/locks.c `lock_get_status`); lines it does not understand are skipped.

    Granted:  `2: FLOCK  ADVISORY  WRITE 4321 00:1a:789 0 EOF`
    Blocked:  `2: -> FLOCK  ADVISORY  READ  4322 00:1a:790 0 EOF`
    """
    records = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        blocked = fields[1] == "->"
        rest = fields[2:] if blocked else fields[1:]
        if len(rest) < 5:
            continue
        kind, _advisory, mode, pid_text, dev_ino = rest[:5]
        parts = dev_ino.split(":")
        try:
            pid = int(pid_text)
            inode = (int(parts[0], 16), int(parts[1], 16), int(parts[2]))
        except (ValueError, IndexError):
            continue
        records.append(_LockRecord(kind, mode, pid, inode, blocked))
    return records


def _inode_key(st: os.stat_result) -> tuple[int, int, int]:
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)


def _flock_records(
    records: Iterable[_LockRecord], inode: tuple[int, int, int]
) -> list[_LockRecord]:
    return [r for r in records if r.kind == "FLOCK" and r.inode == inode]


class Hold(Protocol):
    """The GPU held: the arena's token (`Token`), or a place inside a group's open gate."""

    def wanted(self) -> bool: ...  # someone the holder must yield to waits

    def hand_over(self) -> None: ...  # let go to the waiters

    def release(self) -> None: ...


class Place(Protocol):
    """A waiter's place in line (`Ticket`), kept across tries that a cancel interrupts."""

    def take(
        self,
        name: str,
        *,
        model: str | None = None,
        cancel: threading.Event | None = None,
        on_wait: Callable[[ArenaState], None] | None = None,
    ) -> Hold: ...

    def leave(self) -> None: ...


class Gateway(Protocol):
    """A way to the GPU, as a worker sees it: the arena itself, or a group's gate
    (groups.Gate)."""

    def queue(self, priority: Priority) -> Place: ...

    def observe(self) -> ArenaState: ...

    def first_class_waiting(self) -> int | None: ...


class Arena:
    """An arena directory. Cheap to construct; holds no file descriptor between calls."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._token_path = path / TOKEN_FILE
        self._want_path = path / WANT_FILE
        self._holder_path = path / HOLDER_FILE
        self._queue_path = path / QUEUE_DIR
        self._prepare()

    def _prepare(self) -> None:
        ensure_private_dir(self.path, ArenaUnwritableError)
        ensure_private_dir(self._queue_path, ArenaUnwritableError)
        for lock_path in (self._token_path, self._want_path):
            os.close(self._open(lock_path, create=True))
        self.read_holder_file()  # refuses one that is not ours alone, as _open does
        self._check_flock()

    @property
    def want_path(self) -> Path:
        return self._want_path

    def ensure_dir(self, path: Path) -> None:
        """A folder of the arena, made ours alone as the arena's own (for groups.py)."""
        ensure_private_dir(path, ArenaUnwritableError)

    def open_lock(self, path: Path, *, create: bool = False) -> int:
        """A lock file of the arena opened as its own are (for groups.py)."""
        return self._open(path, create=create)

    def _open(self, path: Path, *, create: bool = False) -> int:
        """Open a lock file read-write, refused unless it is ours alone (_check_arena_file)."""
        # O_CREAT without O_TRUNC: creating is idempotent and never replaces the inode.
        # O_NOFOLLOW: a symlink planted at the name is refused, never followed (nor created
        # through, which O_CREAT on a dangling link would do).
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
        try:
            fd = os.open(path, flags, FILE_MODE)
        except OSError as exc:
            raise _open_error(path, exc) from None
        try:
            _check_arena_file(path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_flock(self) -> None:
        # Probe on the directory itself: nobody else ever locks it, so the probe cannot be
        # mistaken for a holder or a waiter.
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            if exc.errno in _NO_FLOCK_ERRNOS:
                raise ArenaUnsupportedError(
                    f"the filesystem of {self.path} does not support flock ({exc.strerror}); "
                    "put the arena on a local filesystem such as $XDG_RUNTIME_DIR"
                ) from None
            raise ArenaError(f"flock on {self.path} failed: {exc.strerror}") from None
        finally:
            os.close(fd)

    def acquire(
        self,
        name: str,
        *,
        model: str | None = None,
        priority: Priority = Priority.NORMAL,
        ticket: Ticket | None = None,
        timeout_s: float | None = None,
        cancel: threading.Event | None = None,
        on_wait: Callable[[ArenaState], None] | None = None,
    ) -> Token:
        """Wait for the token in turn and return it held; holder.json is written before
        waiters learn.

        The turn is a place in the queue: `ticket`, which the caller made to keep its place
        across attempts that a cancel interrupts, or a new one of `priority`. Getting the token
        uses the ticket up; giving up keeps a given ticket and leaves a new one.
        `timeout_s` bounds the wait (AcquireTimeoutError); setting `cancel` gives up
        (AcquireCancelledError). Either way nothing stays locked on our behalf. `on_wait` is
        called once, when the wait begins, with a snapshot taken before we announced
        ourselves: a holder that releases as soon as it sees a waiter is gone by the time the
        wait begins, and the snapshot still names it.
        """
        if timeout_s is not None and timeout_s < 0:
            raise BadValueError(f"timeout must be >= 0 seconds, got {timeout_s}")
        before = self.observe() if on_wait is not None else None
        turn = _Turn(timeout_s, cancel, on_wait, before)
        want_fd = self._open(self._want_path)
        try:
            # Announce first, so the holder's probe sees us however long we then wait. Blocks
            # only for the microseconds a holder's probe holds LOCK_EX.
            fcntl.flock(want_fd, fcntl.LOCK_SH)
            place = Ticket(self, priority) if ticket is None else ticket
            try:
                token_fd = self._take_in_turn(place, turn)
            except BaseException:
                if ticket is None:
                    place.leave()
                raise
            place.leave()  # the next in the queue may now wait on token.lock
            try:
                return Token(self, token_fd, name=name, model=model)
            except BaseException:
                os.close(token_fd)
                raise
        finally:
            # Dropped only now that the token is owned (or given up): a waiter that let go of
            # want.lock earlier could be overtaken and then wait unseen by the next holder.
            os.close(want_fd)

    def queue(self, priority: Priority) -> Ticket:
        """A place in the queue, for `acquire(ticket=...)`; leave() it when giving up."""
        return Ticket(self, priority)

    def _take_in_turn(self, place: Ticket, turn: _Turn) -> int:
        """A new fd holding token.lock, taken once `place` is first in the queue."""
        while True:
            ahead = self._ahead(place.waiter)
            if ahead is not None:
                turn.waiting(self)
                self._wait_behind(ahead, turn)
                continue
            token_fd = self._open(self._token_path)
            try:
                fcntl.flock(token_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    turn.waiting(self)
                except BaseException:
                    os.close(token_fd)
                    raise
                token_fd = _wait_for_lock(token_fd, fcntl.LOCK_EX, turn)
            if self._ahead(place.waiter) is None:
                return token_fd
            os.close(token_fd)  # a waiter of a higher class came meanwhile: it goes first

    def first_class_waiting(self) -> int | None:
        """The class rank (with aging) of the first live waiter in the queue; None when nobody
        queues. For a holder to tell whether someone more urgent than its work waits."""
        now = time.monotonic_ns()
        live = self._live(self._tickets(), remove_dead=False)
        return min(waiter.competes_as(now).rank for waiter in live) if live else None

    def _ahead(self, mine: QueuedWaiter) -> QueuedWaiter | None:
        """The live waiter just before `mine` in the queue; None when `mine` is first. Tickets
        of dead waiters are removed on the way."""
        # By name first: the first waiter, the one a handoff waits for, reads no lock state.
        named = [w for w in self._tickets(sweep=True) if w.order < mine.order]
        before = self._live(named, remove_dead=True) if named else []
        return max(before, key=lambda w: w.order) if before else None

    def _wait_behind(self, ahead: QueuedWaiter, turn: _Turn) -> None:
        """Return once `ahead` has left the queue: it got the token, gave up, or died.

        Nothing else needs a look at the queue meanwhile: `ahead` stays ahead of us (the order
        never changes), and a newcomer placed before us is found at the next look, once `ahead`
        has gone. So the wait is on the kernel's lock state alone, with no timer but the
        cancel's."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        path = self._queue_path / ahead.file
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return  # gone already
        except OSError as exc:
            raise _open_error(path, exc) from None
        try:
            _check_arena_file(path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        # Granted when its owner unlocks, which it does only after unlinking the ticket.
        os.close(_wait_for_lock(fd, fcntl.LOCK_SH, turn))

    def _tickets(self, *, sweep: bool = False) -> list[QueuedWaiter]:
        """The waiters the queue's file names name, live or not; with `sweep`, the temp files
        of waiters killed while they made their ticket are removed on the way."""
        waiters = []
        for name in os.listdir(self._queue_path):
            waiter = QueuedWaiter.from_file_name(name)
            if waiter is not None:
                waiters.append(waiter)
            elif sweep and name.startswith(".") and name.endswith(TICKET_SUFFIX + ".tmp"):
                made_by = QueuedWaiter.from_file_name(name[1:].removesuffix(".tmp"))
                if made_by is not None and not _alive(made_by.pid):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._queue_path / name)
        return waiters

    def _live(self, waiters: list[QueuedWaiter], *, remove_dead: bool) -> list[QueuedWaiter]:
        """Those of `waiters` (listed by _tickets) whose ticket is locked by its waiter."""
        # Names first, locks second: a ticket is locked before its name appears, so every name
        # listed has its lock in the /proc/locks read after, unless its waiter has gone.
        named = []
        for waiter in waiters:
            try:
                st = os.lstat(self._queue_path / waiter.file)
            except FileNotFoundError:
                continue
            named.append((waiter, st))
        records = parse_proc_locks(PROC_LOCKS.read_text(encoding="ascii", errors="replace"))
        locked = {r.inode for r in records if r.kind == "FLOCK" and r.mode == "WRITE"}
        live = []
        for waiter, st in named:
            if _inode_key(st) in locked:
                live.append(waiter)
            elif remove_dead and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._queue_path / waiter.file)
        return live

    def observe(self) -> ArenaState:
        """Who holds the token and who waits, from /proc/locks, without touching any lock."""
        records = parse_proc_locks(PROC_LOCKS.read_text(encoding="ascii", errors="replace"))
        token_ino = _inode_key(os.stat(self._token_path))
        want_ino = _inode_key(os.stat(self._want_path))
        lockers = [r.pid for r in _flock_records(records, token_ino) if not r.blocked]
        waiters = sorted(
            {r.pid for r in _flock_records(records, want_ino) if r.mode == "READ" and r.pid > 0}
        )
        info = self.read_holder_file()
        holder_pid = lockers[0] if lockers else None
        # The kernel records the pid that *asked* for the lock (0 once that pid is freed, seen
        # from another pid namespace), but the lock lives as long as any process holds the
        # locked description open: a shell script that locked through flock(1) on its own fd,
        # the CMD of an `arbiterd run` killed with SIGKILL. holder.json names such processes;
        # it is believed only for one that really holds the lock.
        if holder_pid is not None and info is not None and not _alive(holder_pid):
            heirs = (pid for pid in (info.command_pid, info.pid) if pid is not None)
            holder_pid = next((p for p in heirs if _holds_flock(p, token_ino)), holder_pid)
        if holder_pid == 0:
            holder_pid = None  # held, by a process nobody can name
        named = () if info is None else (info.pid, info.command_pid)
        fresh = holder_pid is not None and holder_pid in named
        observed_ns = time.monotonic_ns()
        live = self._live(self._tickets(), remove_dead=False)
        queued = sorted(live, key=lambda w: w.order)
        return ArenaState(
            path=self.path,
            holder_pid=holder_pid,
            holder=info if fresh else None,
            stale_holder=None if fresh else info,
            waiter_pids=tuple(waiters),
            observed_ns=observed_ns,
            queue=tuple(queued),
        )

    def read_holder_file(self) -> HolderInfo | None:
        """holder.json; None when missing or malformed, refused like a lock file when it is not
        ours alone (it names the process others wait for)."""
        # O_NONBLOCK: opening a FIFO planted at the name would otherwise wait for a writer.
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self._holder_path, flags)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _open_error(self._holder_path, exc) from None
        with open(fd, "rb") as file:
            _check_arena_file(self._holder_path, os.fstat(fd))
            raw = file.read(HOLDER_FILE_MAX_BYTES + 1)
        return HolderInfo.from_json(raw)

    def _write_holder_file(self, info: HolderInfo | None) -> None:
        # tmp + rename: a reader sees the old content or the new, never half of it. rename(2)
        # replaces whatever is at holder.json, a symlink included, without following it.
        data = b"" if info is None else json.dumps(info.to_json()).encode()
        tmp = self._holder_temp_path()
        fd = self._create_temp(tmp)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, self._holder_path)

    def _holder_temp_path(self) -> Path:
        # One name per thread of a live process: two writers never share one.
        return self.path / f".{HOLDER_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"

    def _create_temp(self, path: Path) -> int:
        """Create `path` anew, 0600: O_EXCL never opens what is already there, a symlink
        included (open(2)), so nothing is ever written through a planted one.

        Only a crash of an earlier process with our pid and thread id, mid-write, leaves a file
        at our name: such a file passes _check_arena_file and is removed. Anything else there
        was put by someone else, and is refused."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(path, flags, FILE_MODE)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ArenaUnwritableError(f"cannot create {path}: {exc.strerror}") from None
        with contextlib.suppress(FileNotFoundError):
            _check_arena_file(path, os.lstat(path))
            os.unlink(path)  # removes the name; unlink(2) never follows a symlink
        try:
            return os.open(path, flags, FILE_MODE)
        except OSError as exc:
            raise ArenaUnwritableError(f"cannot create {path}: {exc.strerror}") from None


class Ticket:
    """A place in an arena's queue: a ticket file this thread holds LOCK_EX until it leaves.
    A ticket also announces its waiter (LOCK_SH on want.lock): a holder sees it from the
    moment it queues, even before it calls acquire()."""

    def __init__(self, arena: Arena, priority: Priority) -> None:
        want_fd = arena._open(arena._want_path)
        try:
            fcntl.flock(want_fd, fcntl.LOCK_SH)
            self._enter(arena, priority)
        except BaseException:
            os.close(want_fd)
            raise
        self._want_fd: int | None = want_fd
        self._arena = arena

    def take(
        self,
        name: str,
        *,
        model: str | None = None,
        cancel: threading.Event | None = None,
        on_wait: Callable[[ArenaState], None] | None = None,
    ) -> Token:
        """The token, in this ticket's turn (Arena.acquire with this ticket)."""
        return self._arena.acquire(name, model=model, ticket=self, cancel=cancel, on_wait=on_wait)

    def _enter(self, arena: Arena, priority: Priority) -> None:
        since = time.monotonic_ns()
        name = f"{priority.value}.{since}.{os.getpid()}.{threading.get_ident()}{TICKET_SUFFIX}"
        temp = arena._queue_path / f".{name}.tmp"
        fd = arena._create_temp(temp)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a new inode: never contended
            os.rename(temp, arena._queue_path / name)  # visible only once locked
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        self.waiter = QueuedWaiter(os.getpid(), priority, since, name)
        self._path = arena._queue_path / name
        self._fd: int | None = fd

    def leave(self) -> None:
        """Leave the queue. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)  # before the unlock: an unlocked ticket is a dead waiter's
        os.close(fd)
        want_fd, self._want_fd = self._want_fd, None
        if want_fd is not None:
            os.close(want_fd)


class Token:
    """The held token of one arena. Owns the locked token fd, the probe fd and holder.json."""

    def __init__(self, arena: Arena, token_fd: int, *, name: str, model: str | None) -> None:
        self.arena = arena
        self.info = HolderInfo(pid=os.getpid(), name=name, model=model, since=time.time())
        self._fd: int | None = token_fd
        # Our own description of want.lock for the probe (see the module docstring).
        self._probe_fd = arena._open(arena._want_path)
        try:
            arena._write_holder_file(self.info)
        except BaseException:
            os.close(self._probe_fd)
            raise

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def fd(self) -> int:
        """The locked token.lock descriptor, for a command to inherit (subprocess's pass_fds).

        flock locks belong to the open file description, and the kernel unlocks one only once
        every process sharing it has closed it (flock(2)): the command keeps the token should
        we die. release() still unlocks it at once, for everyone who shares it.
        """
        if self._fd is None:
            raise ArenaError("fd of a released token")
        return self._fd

    def record_command(self, pid: int) -> None:
        """Name in holder.json the command `pid` that inherited `fd`, so that observers can
        name it once we are gone."""
        if self._fd is None:
            raise ArenaError("record_command() on a released token")
        self.info = dataclasses.replace(self.info, command_pid=pid)
        self.arena._write_holder_file(self.info)

    def wanted(self) -> bool:
        """True when some other program waits for the token (holds want.lock shared)."""
        if self._fd is None:
            raise ArenaError("wanted() on a released token")
        return contended(self._probe_fd, fcntl.LOCK_EX)

    def hand_over(self, timeout_s: float = HAND_OVER_TIMEOUT_S) -> None:
        """Release to the programs waiting now: return once one of them holds the token, nobody
        waits any more, or `timeout_s` passed.

        flock is not FIFO: a releaser that calls acquire() again at once usually wins the race
        against the waiter the kernel is still waking, and the waiter starves. Waiting here for
        the token to change hands makes two busy contenders strictly alternate.
        """
        if self._fd is None:
            raise ArenaError("hand_over() on a released token")
        want_fd = self.arena._open(self.arena._want_path)
        token_fd = self.arena._open(self.arena._token_path)
        try:
            self.release()
            deadline = time.monotonic() + timeout_s
            pause_s = HAND_OVER_POLL_MIN_S
            while contended(want_fd, fcntl.LOCK_EX) and not contended(token_fd, fcntl.LOCK_SH):
                if time.monotonic() >= deadline:
                    return
                time.sleep(pause_s)
                pause_s = min(2 * pause_s, HAND_OVER_POLL_MAX_S)
        finally:
            os.close(want_fd)
            os.close(token_fd)

    def release(self) -> None:
        """Clear holder.json, then unlock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self.arena._write_holder_file(None)
        finally:
            os.close(self._probe_fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> Token:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False  # kill(2) would take 0 and below for process groups
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _holds_flock(pid: int, inode: tuple[int, int, int]) -> bool:
    """True when a descriptor of `pid` holds the exclusive flock on `inode`.

    /proc/PID/fdinfo/FD lists, on `lock:` lines, the locks of that fd's own open file
    description (proc(5)), whoever asked for them; /proc/locks names only the asker.
    """
    fdinfo = Path(f"/proc/{pid}/fdinfo")
    try:
        fds = os.listdir(fdinfo)
    except OSError:  # gone, or not ours to read
        return False
    for fd in fds:
        try:
            text = (fdinfo / fd).read_text(encoding="ascii", errors="replace")
        except OSError:
            continue  # closed meanwhile
        locks = [
            line.removeprefix("lock:") for line in text.splitlines() if line.startswith("lock:")
        ]
        if any(
            r.kind == "FLOCK" and r.mode == "WRITE" and r.inode == inode
            for r in parse_proc_locks("\n".join(locks))
        ):
            return True
    return False


def _check_arena_file(path: Path, st: os.stat_result) -> None:
    """Refuse an arena file that is not ours alone, with the one-line fix.

    `st` is the fstat of the opened descriptor, so what is checked is what is used, or the
    lstat of a name about to be removed.
    """
    if stat.S_ISLNK(st.st_mode):
        raise ArenaUnwritableError(_symlink_refusal(path))
    if not stat.S_ISREG(st.st_mode):
        raise ArenaUnwritableError(f"{path} is not a regular file (rm -r {path})")
    uid = os.getuid()
    if st.st_uid != uid:
        raise ArenaUnwritableError(
            f"{path} is owned by uid {st.st_uid}, not by you (uid {uid}); "
            f"remove it while nothing uses the arena (rm {path})"
        )
    if st.st_mode & _OTHERS_WRITE:
        raise ArenaUnwritableError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; others could take or fake the "
            f"GPU token through it (chmod 600 {path})"
        )


def _open_error(path: Path, exc: OSError) -> ArenaUnwritableError:
    if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
        return ArenaUnwritableError(_symlink_refusal(path))
    return ArenaUnwritableError(f"cannot open {path}: {exc.strerror}")


def _symlink_refusal(path: Path) -> str:
    return f"{path} is a symbolic link; arbiterd follows none in an arena (rm {path})"


def try_flock(fd: int, operation: int) -> bool:
    """Take `operation` without blocking; False when another description conflicts (for
    groups.py too)."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def contended(fd: int, operation: int) -> bool:
    """Try `operation` without blocking and undo it: True when another description conflicts
    (for groups.py too)."""
    if not try_flock(fd, operation):
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


class _Turn:
    """One acquire's limits and its one `on_wait` call."""

    def __init__(
        self,
        timeout_s: float | None,
        cancel: threading.Event | None,
        on_wait: Callable[[ArenaState], None] | None,
        before: ArenaState | None,
    ) -> None:
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.cancel = cancel
        self._on_wait = on_wait
        self._before = before

    def waiting(self, arena: Arena) -> None:
        """The wait begins (said once)."""
        on_wait, self._on_wait = self._on_wait, None
        if on_wait is None:
            return
        before = self._before
        if before is None or before.holder_pid is None:  # taken since: look again, before
            before = arena.observe()  # our own request can be granted and show up in it
        on_wait(before)

    def slice_s(self, longest: float | None) -> float | None:
        """How long to block before checking the cancel and the deadline again; None: until
        granted."""
        wait_s = longest
        if self.deadline is not None:
            remaining = max(0.0, self.deadline - time.monotonic())
            wait_s = remaining if wait_s is None else min(wait_s, remaining)
        return wait_s

    @property
    def unbounded(self) -> bool:
        """Neither a cancel nor a deadline: a wait may block in flock itself (a signal handler
        that raises still interrupts it), without a helper thread between the grant and us."""
        return self.cancel is None and self.deadline is None

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise AcquireCancelledError("gave up waiting for the GPU token")
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise AcquireTimeoutError(f"the GPU token was not free within {self.timeout_s:g} s")


def _wait_for_lock(fd: int, operation: int, turn: _Turn) -> int:
    """Block until `fd` holds `operation` (LOCK_EX on token.lock, LOCK_SH on the ticket ahead);
    return it, or raise and own nothing (`fd` closed)."""
    if turn.unbounded:
        try:
            fcntl.flock(fd, operation)
        except BaseException:
            os.close(fd)  # interrupted before the grant: nothing is held
            raise
        return fd
    request = _LockRequest(fd, operation)
    poll_s = CANCEL_POLL_S if turn.cancel is not None else None
    try:
        while not request.wait(turn.slice_s(poll_s)):
            turn.check()
    except BaseException:
        # Also on KeyboardInterrupt: lock waits are interruptible in the main thread.
        if not request.abandon():
            request.discard()  # granted in the meantime: give it straight back
        raise
    return request.take()


class _LockRequest:
    """One blocking flock (LOCK_EX on token.lock, LOCK_SH on the ticket ahead), made in a thread
    so the caller can stop waiting.

    A thread blocked in flock(2) can only be woken by the grant: Python retries EINTR, and only
    the main thread runs signal handlers. So a request the caller gives up is *abandoned*: if the
    kernel grants it later, the thread unlocks and closes at once, holding the token for nobody.
    """

    def __init__(self, fd: int, operation: int) -> None:
        self._fd = fd
        self._operation = operation
        self._mutex = threading.Lock()
        self._granted = threading.Event()
        self._abandoned = False
        self._error: OSError | None = None
        threading.Thread(target=self._run, name="arena-lock-wait", daemon=True).start()

    def _run(self) -> None:
        try:
            fcntl.flock(self._fd, self._operation)
        except OSError as exc:
            self._error = exc
        with self._mutex:
            if self._abandoned:
                os.close(self._fd)  # closing the only fd of the description drops its lock
            self._granted.set()

    def wait(self, timeout_s: float | None) -> bool:
        return self._granted.wait(timeout_s)

    def take(self) -> int:
        if self._error is not None:
            os.close(self._fd)
            raise ArenaError(f"waiting for the token failed: {self._error.strerror}")
        return self._fd

    def discard(self) -> None:
        """Close a granted request's fd, which drops its lock."""
        os.close(self._fd)

    def abandon(self) -> bool:
        """Give the request up. False when it was granted first: then the caller owns `take()`."""
        with self._mutex:
            if self._granted.is_set():
                return False
            self._abandoned = True
            return True
