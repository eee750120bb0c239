"""An arena directory and its token: `Arena` (the files, the queue, observing who holds and
who waits), `Ticket` (a waiter's place in the queue) and `Token` (the GPU held). What the files
mean and the invariants kept are in the package's docstring (arbiterd/arena/__init__.py); the
flock calls themselves are locks.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from arbiterd.arena.doorbell import Bell, Change
from arbiterd.arena.locks import (
    EXCLUSIVE,
    SHARED,
    Patience,
    Turn,
    check_flock,
    contended,
    lock,
    try_flock,
    unlock,
    wait_for_lock,
    wait_with_patience,
)
from arbiterd.arena.procfs import (
    PROC_LOCKS,
    alive,
    flock_records,
    holds_flock,
    inode_key,
    parse_proc_locks,
    stopped,
)
from arbiterd.arena.records import (
    TICKET_SUFFIX,
    ArenaState,
    HolderInfo,
    PassedOver,
    QueuedWaiter,
    TicketLabel,
)
from arbiterd.errors import ArenaError, ArenaUnwritableError, BadValueError
from arbiterd.paths import ensure_private_dir
from arbiterd.states import PassOverReason, Priority

log = logging.getLogger(__name__)

TOKEN_FILE = "token.lock"  # noqa: S105 (a file name, not a password)
WANT_FILE = "want.lock"
HOLDER_FILE = "holder.json"
QUEUE_DIR = "queue"
FILE_MODE = 0o600
# Group or other write on an arena file lets another account take, block or fake the token.
# Read bits are harmless: nobody else can reach a file in the arena folder (0700).
_OTHERS_WRITE = 0o022
# holder.json is under 200 bytes; one longer than this is malformed and is not read whole.
HOLDER_FILE_MAX_BYTES = 64 * 1024
TICKET_LABEL_MAX_BYTES = HOLDER_FILE_MAX_BYTES  # a ticket's label is holder.json's size
# How long hand_over() waits for a waiter to take the token, and how it polls meanwhile (the
# handoff itself takes microseconds; the bound covers a waiter that is descheduled).
HAND_OVER_TIMEOUT_S = 1.0
HAND_OVER_POLL_MIN_S = 0.00005
HAND_OVER_POLL_MAX_S = 0.002
# Passing over a waiter ahead that does not take the token (issue 40 item 1; the package's
# docstring has the rule). A live first waiter, blocked on token.lock, takes a free token within
# microseconds of the release, and within some hundred ms descheduled on a busy 2-core machine:
# one that leaves it free this long is not taking it (its process hangs, or holds its ticket
# while it does something else first). Each further live ticket ahead adds as much again, so
# that the second in line, not the third, passes a hung first one.
PASS_OVER_S = 1.5
# How often a waiter behind another looks at it (stopped?) and at the token (free?). A stop
# makes no event a waiter could sleep on; this is the one look on a timer, by waiters that are
# not first only. So the GPU is free at most this long behind a stopped waiter, and at most
# PASS_OVER_S and this behind one that hangs.
STALL_CHECK_S = 0.25


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
        check_flock(self.path)

    @property
    def want_path(self) -> Path:
        return self._want_path

    @property
    def queue_path(self) -> Path:
        return self._queue_path

    def bells(self) -> tuple[Bell, ...]:
        """What a waiter of this arena does first, for a holder to sleep on (doorbell.py):
        opening want.lock, which it then locks shared, or renaming its ticket into the queue."""
        return (Bell(self._want_path, Change.OPENED), Bell(self._queue_path, Change.ARRIVED))

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
        turn = Turn(timeout_s, cancel, on_wait, before)
        # The ticket announces us (its want.lock, one open per wait: each open rings the
        # holder's doorbell) before it queues, so the holder's probe sees us however long we
        # then wait.
        place = Ticket(self, priority) if ticket is None else ticket
        try:
            place.label(name, model)
            token_fd, passed = self._take_in_turn(place, turn)
        except BaseException:
            if ticket is None:
                place.leave()
            raise
        try:
            place.step_out()  # the next in the queue may now wait on token.lock
            try:
                return Token(self, token_fd, name=name, model=model, passed_over=passed)
            except BaseException:
                os.close(token_fd)
                raise
        finally:
            # The announcement dropped only now that the token is owned (or given up): a
            # waiter that let go of want.lock earlier could be overtaken and then wait unseen
            # by the next holder.
            place.leave()

    def queue(self, priority: Priority) -> Ticket:
        """A place in the queue, for `acquire(ticket=...)`; leave() it when giving up."""
        return Ticket(self, priority)

    def _take_in_turn(self, place: Ticket, turn: Turn) -> tuple[int, tuple[PassedOver, ...]]:
        """A new fd holding token.lock, taken once `place` is first in the queue but for the
        waiters passed over on the way, who come with it."""
        passing = _Passing(self.path)
        while True:
            ahead = self._waiting_ahead(place.waiter, passing)
            if ahead:
                turn.waiting(self.observe)
                self._wait_behind(ahead, turn, passing)
                continue
            token_fd = self._open(self._token_path)
            if not try_flock(token_fd, EXCLUSIVE):
                try:
                    turn.waiting(self.observe)
                except BaseException:
                    os.close(token_fd)
                    raise
                token_fd = wait_for_lock(token_fd, EXCLUSIVE, turn)
            if not self._waiting_ahead(place.waiter, passing):
                return token_fd, passing.passed()
            # A waiter of a higher class came meanwhile, or one we passed over for its stop
            # runs again: it goes first.
            os.close(token_fd)

    def first_class_waiting(self) -> int | None:
        """The class rank (with aging) of the first live waiter in the queue that is not
        stopped; None when nobody queues. For a holder to tell whether someone more urgent than
        its work waits."""
        now = time.monotonic_ns()
        live = [w for w in self._live(self._tickets(), remove_dead=False) if not stopped(w.pid)]
        return min(waiter.competes_as(now).rank for waiter in live) if live else None

    def _waiting_ahead(self, mine: QueuedWaiter, passing: _Passing) -> list[QueuedWaiter]:
        """The live waiters before `mine` in the queue, in order, up to the last one that
        `passing` does not pass over (it is the one to wait on): empty when `mine` goes next.
        Tickets of dead waiters are removed on the way."""
        # By name first: the first waiter, the one a handoff waits for, reads no lock state.
        named = [w for w in self._tickets(sweep=True) if w.order < mine.order]
        before = self._live(named, remove_dead=True) if named else []
        ahead = sorted((w for w in before if not passing.left_untaken(w)), key=lambda w: w.order)
        # Whether a waiter is stopped is read for the nearest ones only, until one is not: that
        # is the one waited on, and those before it are its own business.
        while ahead and passing.skips(ahead[-1]):
            ahead.pop()
        return ahead

    def _wait_behind(self, ahead: list[QueuedWaiter], turn: Turn, passing: _Passing) -> None:
        """Return once the last of `ahead` (the waiters before us, in order) has left the
        queue (it got the token, gave up, or died), or once we pass it over: it is stopped, or
        the token lay free while it stood (PASS_OVER_S for each of `ahead`, who are then all
        passed over).

        Nothing else needs a look at the queue meanwhile: the ticket waited on stays ahead of
        us (the order never changes), and a newcomer placed before us is found at the next
        look, once it has gone. So the wait is on the kernel's lock state, and on one look
        every STALL_CHECK_S at that waiter and the token, which no event would tell us of."""
        waited_on = ahead[-1]
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        path = self._queue_path / waited_on.file
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
        free_since: float | None = None  # CLOCK_MONOTONIC when the token was first seen free
        verdict: list[tuple[QueuedWaiter, PassOverReason, float]] = []  # whom we pass, why

        def keep_waiting() -> bool:
            nonlocal free_since
            if stopped(waited_on.pid):
                verdict.append((waited_on, PassOverReason.STOPPED, 0.0))
                return False
            now = time.monotonic()
            if not self._token_free():
                free_since = None
                return True
            free_since = now if free_since is None else free_since
            if now - free_since < PASS_OVER_S * len(ahead):
                return True
            verdict.extend((w, PassOverReason.NOT_TAKING, now - free_since) for w in ahead)
            return False

        # Granted when its owner unlocks, which it does only after unlinking the ticket.
        granted = wait_with_patience(fd, SHARED, turn, Patience(keep_waiting, STALL_CHECK_S))
        if granted is not None:
            os.close(granted)  # it left after all, if at the last moment: nobody passed
            return
        for waiter, reason, free_s in verdict:
            passing.pass_over(waiter, reason, free_s)

    def _token_free(self) -> bool:
        """Nobody holds token.lock, by /proc/locks: a look that takes no lock, so that it can
        never be what keeps a waiter from the token."""
        records = parse_proc_locks(PROC_LOCKS.read_text(encoding="ascii", errors="replace"))
        token_ino = inode_key(os.stat(self._token_path))
        return not any(not r.blocked for r in flock_records(records, token_ino))

    def _wanted_by_a_live_waiter(self) -> bool:
        """Someone who is not stopped holds or asks for LOCK_SH on want.lock, by /proc/locks;
        for a holder whose probe found want.lock locked. A stopped waiter wants nothing it
        could take: a holder that released for it would leave the GPU free for nobody."""
        records = parse_proc_locks(PROC_LOCKS.read_text(encoding="ascii", errors="replace"))
        want_ino = inode_key(os.stat(self._want_path))
        wanting = {r.pid for r in flock_records(records, want_ino) if r.mode == "READ"}
        if not wanting:
            return True  # what the probe met was no waiter's (another holder's probe): as ever
        # pid 0: a process of another pid namespace, whose state we cannot read: it wants.
        return any(not stopped(pid) for pid in wanting)

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
                if made_by is not None and not alive(made_by.pid):
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
            if inode_key(st) in locked:
                live.append(waiter)
            elif remove_dead and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._queue_path / waiter.file)
        return live

    def observe(self) -> ArenaState:
        """Who holds the token and who waits, from /proc/locks, without touching any lock."""
        records = parse_proc_locks(PROC_LOCKS.read_text(encoding="ascii", errors="replace"))
        token_ino = inode_key(os.stat(self._token_path))
        want_ino = inode_key(os.stat(self._want_path))
        lockers = [r.pid for r in flock_records(records, token_ino) if not r.blocked]
        waiters = sorted(
            {r.pid for r in flock_records(records, want_ino) if r.mode == "READ" and r.pid > 0}
        )
        info = self.read_holder_file()
        holder_pid = lockers[0] if lockers else None
        # The kernel records the pid that *asked* for the lock (0 once that pid is freed, seen
        # from another pid namespace), but the lock lives as long as any process holds the
        # locked description open: a shell script that locked through flock(1) on its own fd,
        # the CMD of an `arbiterd run` killed with SIGKILL. holder.json names such processes;
        # it is believed only for one that really holds the lock.
        if holder_pid is not None and info is not None and not alive(holder_pid):
            heirs = (pid for pid in (info.command_pid, info.pid) if pid is not None)
            holder_pid = next((p for p in heirs if holds_flock(p, token_ino)), holder_pid)
        if holder_pid == 0:
            holder_pid = None  # held, by a process nobody can name
        named = () if info is None else (info.pid, info.command_pid)
        fresh = holder_pid is not None and holder_pid in named
        observed_ns = time.monotonic_ns()
        live = self._live(self._tickets(), remove_dead=False)
        queued = sorted((self._labelled(w) for w in live), key=lambda w: w.order)
        stopped_pids = frozenset(w.pid for w in queued if stopped(w.pid))
        return ArenaState(
            path=self.path,
            holder_pid=holder_pid,
            holder=info if fresh else None,
            stale_holder=None if fresh else info,
            waiter_pids=tuple(waiters),
            observed_ns=observed_ns,
            queue=tuple(queued),
            stopped_pids=stopped_pids,
        )

    def _labelled(self, waiter: QueuedWaiter) -> QueuedWaiter:
        """`waiter` named as its ticket's label says; as it is when the ticket has none, is
        gone, or is not a file of ours (never followed, never blocked on: O_NOFOLLOW and
        O_NONBLOCK as for holder.json)."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self._queue_path / waiter.file, flags)
        except OSError:
            return waiter
        with open(fd, "rb") as file:
            try:
                _check_arena_file(self._queue_path / waiter.file, os.fstat(fd))
            except ArenaUnwritableError:
                return waiter
            raw = file.read(TICKET_LABEL_MAX_BYTES + 1)
        return waiter.labelled(raw)

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


class _Passing:
    """The waiters one take of the token passes over, each logged once (issue 40 item 1)."""

    def __init__(self, arena_path: Path) -> None:
        self._arena_path = arena_path
        self._passed: dict[str, PassedOver] = {}  # by ticket file

    def left_untaken(self, waiter: QueuedWaiter) -> bool:
        """True when `waiter` was passed over for leaving the free token untaken: for the rest
        of this take, whatever it does."""
        passed = self._passed.get(waiter.file)
        return passed is not None and passed.reason is PassOverReason.NOT_TAKING

    def skips(self, waiter: QueuedWaiter) -> bool:
        """True when we go before `waiter`: it is stopped now, or it left the token free for
        the bound. One passed over for a stop that runs again is first again."""
        if stopped(waiter.pid):
            self.pass_over(waiter, PassOverReason.STOPPED, 0.0)
            return True
        passed = self._passed.get(waiter.file)
        if passed is not None and passed.reason is PassOverReason.STOPPED:
            del self._passed[waiter.file]  # resumed: we did not go before it after all
            log.info(
                "%s: pid %d, passed over while stopped, runs again", self._arena_path, waiter.pid
            )
            return False
        return passed is not None

    def pass_over(self, waiter: QueuedWaiter, reason: PassOverReason, free_s: float) -> None:
        if waiter.file in self._passed:
            return
        passed = PassedOver(self._arena_path, waiter, reason, round(free_s, 3))
        self._passed[waiter.file] = passed
        log.warning("%s: %s; it keeps its place", self._arena_path, passed.text)

    def passed(self) -> tuple[PassedOver, ...]:
        return tuple(self._passed.values())


class Ticket:
    """A place in an arena's queue: a ticket file this thread holds LOCK_EX until it steps out
    or leaves. A ticket also announces its waiter (LOCK_SH on want.lock) until it leaves: a
    holder sees it from the moment it queues, even before it calls acquire(), and until its
    waiter owns the token. It is the waiter's one open of want.lock for the whole wait, kept
    across the tries a cancel interrupts (an open rings the holder's doorbell: one per wait,
    docs/arena-protocol.md, "Sleeping until wanted")."""

    def __init__(self, arena: Arena, priority: Priority) -> None:
        self._labelled = False  # its file names its waiter (label)
        want_fd = arena._open(arena._want_path)
        try:
            # Blocks only for the microseconds a holder's probe holds LOCK_EX.
            lock(want_fd, SHARED)
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

    def label(self, name: str, model: str | None) -> None:
        """Name the waiter in the ticket's file (records.TicketLabel), once: observers then
        show it by `name`, not by its process's name. The file is ours and locked by us alone;
        a reader that catches it half written reads no label and names the process instead."""
        fd = self._fd
        if fd is None or self._labelled:
            return
        try:
            os.pwrite(fd, TicketLabel(os.getpid(), name, model).to_json(), 0)
        except OSError as exc:  # a full disk: the wait goes on, its waiter named by its process
            log.warning("%s: could not name the waiter in its ticket: %s", self._path, exc)
        self._labelled = True

    def _enter(self, arena: Arena, priority: Priority) -> None:
        since = time.monotonic_ns()
        name = f"{priority.value}.{since}.{os.getpid()}.{threading.get_ident()}{TICKET_SUFFIX}"
        temp = arena._queue_path / f".{name}.tmp"
        fd = arena._create_temp(temp)
        try:
            lock(fd, EXCLUSIVE)  # a new inode: never contended
            os.rename(temp, arena._queue_path / name)  # visible only once locked
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        self.waiter = QueuedWaiter(os.getpid(), priority, since, name)
        self._path = arena._queue_path / name
        self._fd: int | None = fd

    def step_out(self) -> None:
        """Leave the queue, still announced: its waiter has the token, and the next in line
        may wait on token.lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)  # before the unlock: an unlocked ticket is a dead waiter's
        os.close(fd)

    def leave(self) -> None:
        """Leave the queue and stop announcing. Idempotent."""
        self.step_out()
        want_fd, self._want_fd = self._want_fd, None
        if want_fd is not None:
            os.close(want_fd)


class Token:
    """The held token of one arena. Owns the locked token fd, the probe fd and holder.json."""

    def __init__(
        self,
        arena: Arena,
        token_fd: int,
        *,
        name: str,
        model: str | None,
        passed_over: tuple[PassedOver, ...] = (),
    ) -> None:
        self.arena = arena
        self.info = HolderInfo(pid=os.getpid(), name=name, model=model, since=time.time())
        # The waiters ahead in the queue that this token was taken before (issue 40 item 1),
        # for the holder to report: a worker's event, `arbiterd run`'s line.
        self.passed_over = passed_over
        self._fd: int | None = token_fd
        # Our own description of want.lock for the probe (see arbiterd/arena/__init__.py).
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

    def rename(self, name: str) -> None:
        """Name the holder anew in holder.json: the daemon's hold, handed from one program it
        holds the GPU for to the next, keeps its token."""
        if self._fd is None:
            raise ArenaError("rename() on a released token")
        self.info = dataclasses.replace(self.info, name=name)
        self.arena._write_holder_file(self.info)

    def wanted(self) -> bool:
        """True when some other program waits for the token (holds want.lock shared) and is
        not stopped (issue 40 item 1: Arena._wanted_by_a_live_waiter says why)."""
        if self._fd is None:
            raise ArenaError("wanted() on a released token")
        # The probe first: it costs microseconds, and nobody waits most of the time.
        return contended(self._probe_fd, EXCLUSIVE) and self.arena._wanted_by_a_live_waiter()

    def bells(self) -> tuple[Bell, ...]:
        """The arena's (Arena.bells). Our own probe's descriptor was opened before anyone
        watched, so it rings nothing."""
        return self.arena.bells()

    def used(self) -> None:
        """Nothing to say: who used the token last matters only inside a group (Hold)."""

    def hand_over(self, timeout_s: float = HAND_OVER_TIMEOUT_S) -> None:
        """Release to the programs waiting now: return once one of them holds the token, nobody
        waits any more (or only stopped waiters, who cannot take it), or `timeout_s` passed.

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
            while contended(want_fd, EXCLUSIVE) and not contended(token_fd, SHARED):
                if time.monotonic() >= deadline:
                    return
                # Nobody took it after some ms: maybe only stopped waiters want it, and none of
                # them can take it (issue 40 item 1). Read only then: /proc/locks costs a
                # hundred times the probes, on the CPU the waiter needs to take the token.
                if pause_s == HAND_OVER_POLL_MAX_S and not self.arena._wanted_by_a_live_waiter():
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
        except ArenaUnwritableError:
            if self.arena.path.exists():
                raise
            # Removed under us (the doorbell said so): nobody can read a holder.json there.
            log.warning("%s: the arena folder is gone; released all the same", self.arena.path)
        finally:
            os.close(self._probe_fd)
            unlock(fd)
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
