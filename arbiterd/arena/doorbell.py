"""Sleeping until an arena's files say that someone may want the GPU, instead of probing the
locks on a timer (issue 29): `Doorbell`, one inotify instance (inotify-simple) and a wake pipe.

The protocol's truth stays the kernel's lock state: a ring says only "look now". Whoever waits
on a doorbell probes the locks after every ring, and once right after arming it, so whatever
happened before the watches existed is seen then. A ring may be for nothing (an observer that
opened want.lock, our own hand-over): a probe that finds nobody costs microseconds.

What rings (the `Bell`s a holder arms, token.py and groups.py):
- want.lock opened: every waiter of the documented protocol opens it before it locks it shared;
- a ticket renamed into queue/;
- a group's gate.lock and leave.lock opened or closed: a member leaves the gate by closing it,
  and the keeper opens and closes them (`ring`) after it changes their locks, since a flock
  call makes no inotify event.
A waiter opens want.lock *before* it locks it (the doc's shell example opens it, then starts
flock(1), a few ms later), so a probe at the ring may come too early. After each ring the
doorbell therefore rings again by itself for a while (FOLLOW_UPS_S: every ms for 16 ms, then
less and less often until half a second): some twenty probes of a few µs for each waiter.
A program that keeps want.lock open across its waits rings nothing; the caller's safety probe
(SAFETY_PROBE_S, a timeout on `wait`) serves it, as docs/arena-protocol.md says.

Where inotify cannot be had (the per-user instance or watch limit reached, a filesystem without
it), an armed doorbell rings every FALLBACK_PROBE_S, which is how often holders probed before
it existed, after one warning naming the limit: a holder never stops seeing waiters.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import math
import os
import select
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

from inotify_simple import INotify
from inotify_simple import flags as inotify_flags

log = logging.getLogger(__name__)

# How often a sleeping holder probes all the same: for programs that keep want.lock open across
# their waits, which ring no bell (docs/arena-protocol.md). Two seconds keeps a warm worker,
# pinged by the daemon every 7.5 s, under one wake-up a second.
SAFETY_PROBE_S = 2.0
# When an armed doorbell rings again by itself after a ring, in seconds after it: for the lock
# that follows the open.
FOLLOW_UPS_S = (*(ms / 1000 for ms in range(1, 17)), 0.032, 0.064, 0.128, 0.256, 0.512)
# How often an armed doorbell rings when inotify is not available (the probe interval holders
# used before issue 29).
FALLBACK_PROBE_S = 0.004
_READ_BYTES = 4096


class Change(enum.Flag):
    """What a bell rings on."""

    OPENED = enum.auto()  # the file was opened
    CLOSED = enum.auto()  # the file was closed
    ARRIVED = enum.auto()  # a name was renamed into the folder


_MASKS = {
    Change.OPENED: inotify_flags.OPEN,
    Change.CLOSED: inotify_flags.CLOSE_WRITE | inotify_flags.CLOSE_NOWRITE,
    Change.ARRIVED: inotify_flags.MOVED_TO,
}
# What the kernel says of a watch that is gone: its file or folder was removed (or its
# filesystem unmounted), or we removed it.
_GONE = inotify_flags.IGNORED | inotify_flags.DELETE_SELF


@dataclass(frozen=True)
class Bell:
    """A file or folder of an arena, and what change of it rings."""

    path: Path
    changes: Change

    @property
    def mask(self) -> int:
        mask = int(inotify_flags.DELETE_SELF)
        for change, bits in _MASKS.items():
            if change in self.changes:
                mask |= int(bits)
        return mask


def ring(path: Path) -> None:
    """Ring the bells on `path` (OPENED and CLOSED) by opening and closing it: for a lock
    changed on a descriptor that was already open, which inotify does not see."""
    # O_NONBLOCK: a FIFO planted at the name would otherwise block the open.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    with contextlib.suppress(OSError):  # a ring is a hint: waiters also probe on a timer
        os.close(os.open(path, flags))


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(message: str) -> None:
    """Log `message` once per process: a limit that is reached stays reached."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    log.warning("%s", message)


def _unavailable(exc: OSError, what: str) -> str:
    """Why inotify cannot watch `what`, naming the limit to raise where one was reached."""
    if exc.errno == errno.ENOSPC:
        why = "the inotify watch limit is reached (raise fs.inotify.max_user_watches)"
    elif exc.errno == errno.EMFILE:
        why = "the inotify instance limit is reached (raise fs.inotify.max_user_instances)"
    else:
        why = f"inotify cannot watch it ({exc.strerror})"
    return f"{what}: {why}; probing every {FALLBACK_PROBE_S * 1000:g} ms instead"


class Doorbell:
    """An inotify instance and the bells armed on it. The thread that arms it waits on it; any
    thread may `wake` it."""

    def __init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._closed = False
        self._closing = threading.Lock()  # a wake() from another thread never writes to a
        # descriptor number that close() gave back (and the process may have reused)
        self._inotify: INotify | None = None
        self._fallback = ""  # why inotify is not used; "" while it is
        self._watches: dict[int, Bell] = {}
        self._armed = False
        self._follow_ups: list[float] = []  # CLOCK_MONOTONIC times to ring again, in order
        self._lost: set[Path] = set()  # watched paths removed under us, each said once
        try:
            self._inotify = INotify()
        except OSError as exc:
            self._fall_back(_unavailable(exc, "waiting for waiters of the GPU"))

    @property
    def fallback(self) -> str:
        """Why this doorbell probes on a timer instead of watching; "" when it watches."""
        return self._fallback

    def arm(self, bells: Iterable[Bell]) -> None:
        """Watch `bells`, instead of what was watched before."""
        self.disarm()
        self._armed = True
        if self._inotify is None:
            return
        for bell in bells:
            try:
                wd = self._inotify.add_watch(bell.path, bell.mask)
            except OSError as exc:
                self._fall_back(_unavailable(exc, f"watching {bell.path}"))
                self.disarm()
                self._armed = True
                return
            self._watches[wd] = bell

    def disarm(self) -> None:
        """Watch nothing: `wait` then returns only when woken or timed out."""
        self._armed = False
        self._follow_ups = []
        watches, self._watches = self._watches, {}
        if self._inotify is None:
            return
        for wd in watches:
            with contextlib.suppress(OSError):  # a watch the kernel already dropped
                self._inotify.rm_watch(wd)

    def wait(self, timeout_s: float | None) -> bool:
        """Block until a bell rings, `wake` is called, or `timeout_s` passes (None: no limit).
        True when rung or woken: the caller probes the locks either way."""
        if self._armed and self._inotify is None:
            timeout_s = FALLBACK_PROBE_S if timeout_s is None else min(timeout_s, FALLBACK_PROBE_S)
        now = time.monotonic()
        if self._follow_ups:
            follow_up_s = max(0.0, self._follow_ups[0] - now)
            timeout_s = follow_up_s if timeout_s is None else min(timeout_s, follow_up_s)
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if self._inotify is not None:
            poller.register(self._inotify.fileno(), select.POLLIN)
        timeout_ms = None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))
        ready = {fd for fd, _ in poller.poll(timeout_ms)}
        rang = False
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, _READ_BYTES):
                    pass
            rang = True
        if self._inotify is not None and self._inotify.fileno() in ready:
            rang = self._read_events() or rang
        if self._armed and self._inotify is None and not ready:
            rang = True  # the fallback's probe interval passed
        now = time.monotonic()
        if self._follow_ups and self._follow_ups[0] <= now:
            self._follow_ups = [t for t in self._follow_ups if t > now]
            rang = True
        return rang

    def _read_events(self) -> bool:
        """Read the pending events; True when one of them rings an armed bell."""
        assert self._inotify is not None  # only called with an inotify instance
        rang = False
        for event in self._inotify.read(timeout=0):
            if event.mask & inotify_flags.Q_OVERFLOW:
                rang = True  # some were lost: look
                continue
            bell = self._watches.get(event.wd)
            if bell is None:
                continue  # a watch we removed, saying so
            if event.mask & _GONE:
                self._watch_gone(event.wd, bell)
            rang = True
        if rang and self._armed:
            now = time.monotonic()
            self._follow_ups = [now + s for s in FOLLOW_UPS_S]
        return rang

    def _watch_gone(self, wd: int, bell: Bell) -> None:
        del self._watches[wd]
        if bell.path not in self._lost:
            self._lost.add(bell.path)
            log.warning(
                "%s was removed under us: a program that makes the arena again there takes "
                "a token of its own, and is not seen waiting here",
                bell.path,
            )

    def wake(self) -> None:
        """Make the current or next `wait` return. Any thread."""
        with self._closing:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):  # already woken: the pipe is full
                os.write(self._wake_w, b"\0")

    def close(self) -> None:
        """Idempotent; a `wake` after it does nothing."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self.disarm()
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _fall_back(self, reason: str) -> None:
        self._fallback = reason
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        _warn_once(reason)

    def __enter__(self) -> Doorbell:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Watched(Protocol):
    """A held token as a sleeper sees it (records.Hold's part)."""

    def wanted(self) -> bool: ...

    def bells(self) -> tuple[Bell, ...]: ...


def sleep_until_wanted(hold: Watched, doorbell: Doorbell, stop: threading.Event) -> bool:
    """Sleep on `doorbell` until someone wants `hold` (True) or `stop` is set (False; whoever
    sets it wakes the doorbell). Probes after every ring and every SAFETY_PROBE_S."""
    doorbell.arm(hold.bells())
    try:
        while not stop.is_set():
            if hold.wanted():
                return True
            doorbell.wait(SAFETY_PROBE_S)
        return False
    finally:
        doorbell.disarm()
