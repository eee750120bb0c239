"""One daemon per control socket: owns the single-instance lock a daemon holds for its whole life.

The lock is `daemon.lock` beside the control socket (in the daemon's private runtime folder),
taken before the daemon touches the socket, the HTTP port or any model: a second daemon on the
same socket says who runs and exits, and only the lock's owner may replace a stale socket file
(two daemons that both found the socket dead could otherwise each replace the other's).

It is a POSIX record lock (`os.lockf`), not the arena's flock: a record lock belongs to the
process that took it, so it can never outlive this daemon in a child (a worker forked but not
yet exec'd), and the kernel drops it the moment the daemon dies, however it dies. Its one trap —
closing *any* descriptor of the file drops it — cannot spring: nothing else here opens this file.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from arbiterd.errors import AlreadyRunningError, DaemonError
from arbiterd.paths import ensure_private_dir

LOCK_FILE = "daemon.lock"
MAX_INFO_BYTES = 4096


class InstanceLock:
    """Held from `acquire` until `release` (or the process's death)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, socket_path: Path, info: dict[str, Any]) -> InstanceLock:
        """Take the lock of the daemon serving `socket_path`, and record `info` (pid, http)
        in it for the next daemon's message. Raises AlreadyRunningError naming who runs."""
        folder = socket_path.parent
        ensure_private_dir(folder, DaemonError)
        path = folder / LOCK_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise DaemonError(f"cannot open {path}: {exc.strerror}") from None
        try:
            _check_owned(path, os.fstat(fd))
            try:
                os.lockf(fd, os.F_TLOCK, 0)
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise DaemonError(f"cannot lock {path}: {exc.strerror}") from None
                raise AlreadyRunningError(_who_runs(fd, socket_path)) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), **info}).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # the next reader must not name a daemon that is gone
            os.close(self._fd)  # drops the lock
            self._fd = None


def _check_owned(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise DaemonError(f"{path} is not a regular file; remove it")
    if st.st_uid != os.getuid():
        raise DaemonError(f"{path} is owned by uid {st.st_uid}, not by you; remove it")


def _who_runs(fd: int, socket_path: Path) -> str:
    try:
        raw = json.loads(os.pread(fd, MAX_INFO_BYTES, 0) or b"{}")
    except ValueError:
        raw = {}
    info = raw if isinstance(raw, dict) else {}
    who = f"pid {info['pid']}" if isinstance(info.get("pid"), int) else "another process"
    http = f", HTTP on {info['http']}" if isinstance(info.get("http"), str) else ""
    return (
        f"another arbiterd is already running for {socket_path} ({who}{http}); "
        "stop it first (arbiterd shutdown), or give this one its own --socket"
    )
