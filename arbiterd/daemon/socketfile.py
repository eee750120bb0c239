"""Unix socket files the daemon listens on (the control socket, the API socket): owns replacing a
stale file, binding with a private mode, and removing only the file this daemon bound.

Callers hold the daemon's single-instance lock (arbiterd.daemon.instance) while they replace a stale
file: two daemons that both found it dead could otherwise unlink each other's new socket.
Blocking (a probe waits up to PROBE_TIMEOUT_S): async callers run it in a thread.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

from arbiterd.errors import ArbiterError

PROBE_TIMEOUT_S = 1.0

Inode = tuple[int, int]


def clear_stale(path: Path, error: type[ArbiterError], live: str) -> None:
    """Remove a socket file left by a server that died; raise `error(live)` if one answers."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise error(f"{path} exists and is not a socket; move it away")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # nobody listens: left by a server that died
            return
        except TimeoutError:
            pass  # its backlog is full: something is alive there
    raise error(live)


def bind(
    path: Path, mode: int, error: type[ArbiterError], live: str
) -> tuple[socket.socket, Inode]:
    """A socket bound at `path` with `mode`, not yet listening, and the file's identity.

    Bound here rather than by asyncio.start_unix_server(path=...), which silently unlinks any
    socket already there, live or not. The mode is set before listen(2): until then a connect
    is refused, whatever mode the umask gave the file."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)
        st = os.stat(path)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise error(live) from None
        raise error(f"cannot listen on {path}: {exc.strerror or exc}") from None
    return sock, (st.st_dev, st.st_ino)


def unlink_own(path: Path, inode: Inode | None) -> None:
    """Remove `path` if it is still the file we bound (`inode`); never one that another server
    has bound at the same path since."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == inode:
        path.unlink()
