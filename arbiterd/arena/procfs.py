"""Reading the kernel's lock state: /proc/locks (who holds or waits for a flock on which inode),
/proc/PID/fdinfo (which process shares a locked open file description) and /proc/PID/stat (is
a waiter stopped). Reads only: it takes no lock and opens no arena file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC_LOCKS = Path("/proc/locks")


@dataclass(frozen=True)
class LockRecord:
    """One line of /proc/locks."""

    kind: str  # FLOCK, POSIX, OFDLCK, LEASE, ...
    mode: str  # READ or WRITE
    pid: int
    inode: tuple[int, int, int]  # (major, minor, inode number)
    blocked: bool  # a request waiting to be granted ("->" lines)


def parse_proc_locks(text: str) -> list[LockRecord]:
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
        records.append(LockRecord(kind, mode, pid, inode, blocked))
    return records


def inode_key(st: os.stat_result) -> tuple[int, int, int]:
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)


def flock_records(records: Iterable[LockRecord], inode: tuple[int, int, int]) -> list[LockRecord]:
    return [r for r in records if r.kind == "FLOCK" and r.inode == inode]


def alive(pid: int) -> bool:
    if pid <= 0:
        return False  # kill(2) would take 0 and below for process groups
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


# /proc/PID/stat's state letters of a stopped process (proc(5)): by a signal (SIGSTOP, SIGTSTP,
# SIGTTIN, SIGTTOU) or at a tracer's stop. A stopped process cannot take a lock: the kernel only
# wakes a flock waiter, which must then run to take the lock itself (fs/locks.c).
_STOPPED_STATES = frozenset("Tt")
# The state is the field after COMM, which is at most 64 bytes: it is within the first 128.
_STAT_READ_BYTES = 128


def stopped(pid: int) -> bool:
    """True when process `pid` is stopped; False when it runs, sleeps, or is gone.

    A stop by signal stops every thread of the process (a group stop), so the state of its
    main thread, /proc/PID/stat, says it for all."""
    if pid <= 0:
        return False
    # os.open and one read: a waiter asks this of the waiters ahead at each look at the queue,
    # and a file object costs several times as much.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # gone
        return False
    try:
        raw = os.read(fd, _STAT_READ_BYTES)
    except OSError:  # gone meanwhile
        return False
    finally:
        os.close(fd)
    # "PID (COMM) STATE ...": COMM may hold spaces and parentheses, so split at the last ')'.
    fields = raw.rpartition(b")")[2].split()
    return bool(fields) and fields[0].decode("ascii", "replace") in _STOPPED_STATES


def holds_flock(pid: int, inode: tuple[int, int, int]) -> bool:
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
