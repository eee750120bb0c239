"""flock(2) for the arena and its groups: the one module that imports `fcntl`.

Owns taking, probing and waiting for a lock on a descriptor; what each lock file means belongs
to token.py (the arena's token, want.lock and the queue) and groups.py (a group's gate).
Invariants kept here:
- EWOULDBLOCK/EAGAIN is contention, never an error (`try_flock`, `contended`).
- A wait that can be cancelled, timed out or lose patience blocks in a helper thread
  (`_LockRequest`), which gives back a lock granted after its caller gave up: nothing stays
  locked for nobody.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from arbiterd.arena.records import ArenaState
from arbiterd.errors import (
    AcquireCancelledError,
    AcquireTimeoutError,
    ArenaError,
    ArenaUnsupportedError,
)

SHARED = fcntl.LOCK_SH
EXCLUSIVE = fcntl.LOCK_EX
# How often a cancellable wait looks at its cancel event. Granting the token is not delayed by
# it: the waiting thread wakes as soon as the kernel grants the lock.
CANCEL_POLL_S = 0.05
# errno values with which a filesystem says it cannot do flock (NFS without a lock manager,
# some FUSE filesystems).
_NO_FLOCK_ERRNOS = {errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL, errno.ENOSYS}


def lock(fd: int, operation: int) -> None:
    """Take `operation` (SHARED or EXCLUSIVE) on `fd`, blocking until it is granted."""
    fcntl.flock(fd, operation)


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)


def check_flock(path: Path) -> None:
    """Refuse a folder whose filesystem cannot flock, with the fix (ArenaUnsupportedError)."""
    # Probe on the directory itself: nobody else ever locks it, so the probe cannot be
    # mistaken for a holder or a waiter.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:
        if exc.errno in _NO_FLOCK_ERRNOS:
            raise ArenaUnsupportedError(
                f"the filesystem of {path} does not support flock ({exc.strerror}); "
                "put the arena on a local filesystem such as $XDG_RUNTIME_DIR"
            ) from None
        raise ArenaError(f"flock on {path} failed: {exc.strerror}") from None
    finally:
        os.close(fd)


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


class Turn:
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

    def waiting(self, observe: Callable[[], ArenaState]) -> None:
        """The wait begins (said once)."""
        on_wait, self._on_wait = self._on_wait, None
        if on_wait is None:
            return
        before = self._before
        if before is None or before.holder_pid is None:  # taken since: look again, before
            before = observe()  # our own request can be granted and show up in it
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


def wait_for_lock(fd: int, operation: int, turn: Turn) -> int:
    """Block until `fd` holds `operation` (LOCK_EX on token.lock); return it, or raise and own
    nothing (`fd` closed)."""
    if turn.unbounded:
        try:
            fcntl.flock(fd, operation)
        except BaseException:
            os.close(fd)  # interrupted before the grant: nothing is held
            raise
        return fd
    granted = _wait(_LockRequest(fd, operation), turn, None)
    assert granted is not None  # without patience, a wait ends granted or raising
    return granted


@dataclass(frozen=True)
class Patience:
    """How a wait looks, now and then, at whether it is still worth it: `keep_waiting` is asked
    every `every_s` (a waiter behind a ticket that may be stopped, token.py)."""

    keep_waiting: Callable[[], bool]
    every_s: float


def wait_with_patience(fd: int, operation: int, turn: Turn, patience: Patience) -> int | None:
    """Block until `fd` holds `operation` (LOCK_SH on the ticket ahead) and return it, or
    return None once `patience` says to stop waiting; raise on a cancel or the deadline. Either
    way but the grant, nothing stays locked on our behalf (`fd` closed now, or by the helper
    thread should the lock be granted later)."""
    return _wait(_LockRequest(fd, operation), turn, patience)


def _wait(request: _LockRequest, turn: Turn, patience: Patience | None) -> int | None:
    longest = CANCEL_POLL_S if turn.cancel is not None else None
    if patience is not None:
        longest = patience.every_s if longest is None else min(longest, patience.every_s)
    next_look = math.inf if patience is None else time.monotonic() + patience.every_s
    try:
        while not request.wait(turn.slice_s(longest)):
            turn.check()
            if patience is None or time.monotonic() < next_look:
                continue
            if not patience.keep_waiting():
                if request.abandon():
                    return None
                return request.take()  # granted meanwhile: better than giving up
            next_look = time.monotonic() + patience.every_s
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
