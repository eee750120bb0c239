"""Another local user for the tests of who may reach the daemon: a forked child that becomes
uid NOBODY, and a bare HTTP client it can run.

A fork, not a new interpreter: this one may live where NOBODY cannot read (a venv under /root).
For the same reason the child may use only what is already imported here: it makes requests
with `socket` alone, and sends back its result pickled through a pipe.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401 (a host name passed to socket calls is encoded with it)
import os
import pickle
import selectors
import signal
import socket
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

NOBODY = 65534
CHILD_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 10.0
_CHUNK_BYTES = 65536

T = TypeVar("T")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")


def as_user(uid: int, action: Callable[[], T]) -> T:
    """`action()` run in a forked child whose uid and gid are `uid`, with no supplementary
    groups; its result comes back, and its exception as an AssertionError with the traceback."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that a forked child of a threaded process may find a lock held
        # for good. The child here runs only socket calls and leaves with os._exit.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_fd)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            outcome: tuple[bool, object] = (True, action())
        except BaseException:
            outcome = (False, traceback.format_exc())
        with os.fdopen(write_fd, "wb") as out:
            pickle.dump(outcome, out)
        os._exit(0)
    os.close(write_fd)
    try:
        data = _read_all(read_fd, CHILD_TIMEOUT_S)
    finally:
        os.close(read_fd)
        if data is None:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if data is None:
        raise AssertionError(f"the child as uid {uid} did not finish in {CHILD_TIMEOUT_S} s")
    ok, result = pickle.loads(data)  # our own child wrote it
    if not ok:
        raise AssertionError(f"the child as uid {uid} failed:\n{result}")
    return result  # type: ignore[no-any-return]


def _read_all(fd: int, timeout_s: float) -> bytes | None:
    """Everything until EOF, or None after `timeout_s`."""
    data = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while selector.select(timeout_s):
            chunk = os.read(fd, _CHUNK_BYTES)
            if not chunk:
                return bytes(data)
            data += chunk
    return None


def tcp(port: int) -> Callable[[], socket.socket]:
    return lambda: socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT_S)


def unix(path: Path) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(REQUEST_TIMEOUT_S)
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
        return sock

    return connect


def request(
    connect: Callable[[], socket.socket],
    method: str,
    path: str,
    *,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a new connection; the status and the body of its answer."""
    # localhost: a name the TCP port answers to (arbiterd.daemon.http.browsers); api.sock takes any.
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    with connect() as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        answer = bytearray()
        while chunk := sock.recv(_CHUNK_BYTES):
            answer += chunk
    head, _, content = bytes(answer).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), content


def refused_errno(action: Callable[[], Any]) -> int | None:
    """The errno `action` fails with, or None when it succeeds."""
    try:
        action()
    except OSError as exc:
        return exc.errno
    return None
