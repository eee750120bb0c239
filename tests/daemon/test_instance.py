"""One daemon per control socket: the single-instance lock, and twin daemons started at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiterd.cli.controlclient import ControlClient
from arbiterd.daemon.instance import LOCK_FILE, InstanceLock
from arbiterd.errors import AlreadyRunningError, DaemonError, DaemonNotRunningError
from tests.support.daemon import free_port

# Twin starts per test run; ARBITERD_FAULT_ROUNDS=50 for the figure.
ROUNDS = int(os.environ.get("ARBITERD_FAULT_ROUNDS", "6"))
HOLDER = """
import sys, time
from pathlib import Path
from arbiterd.daemon.instance import InstanceLock
lock = InstanceLock.acquire(Path(sys.argv[1]), {"http": "127.0.0.1:1"})
print("locked", flush=True)
time.sleep(60)
"""


@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ad-i-", dir="/tmp"))  # socket paths must be short
    yield path
    for item in sorted(path.rglob("*"), reverse=True):
        item.unlink() if not item.is_dir() else item.rmdir()
    path.rmdir()


def test_a_second_daemon_is_told_who_runs(folder: Path) -> None:
    sock = folder / "control.sock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(sock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(AlreadyRunningError) as caught:
            InstanceLock.acquire(sock, {"http": "127.0.0.1:2"})
        assert str(caught.value) == (
            f"another arbiterd is already running for {sock} (pid {holder.pid}, HTTP on "
            "127.0.0.1:1); stop it first (arbiterd shutdown), or give this one its own --socket"
        )
        assert caught.value.exit_code == 75
    finally:
        holder.kill()
        holder.communicate()
    InstanceLock.acquire(sock, {}).release()  # the kernel dropped the dead holder's lock


def test_released_lock_names_nobody(folder: Path) -> None:
    lock = InstanceLock.acquire(folder / "control.sock", {"http": "h:1"})
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (folder / LOCK_FILE).read_text() == ""


def test_a_symlink_planted_at_the_lock_is_refused(folder: Path) -> None:
    target = folder / "elsewhere"
    (folder / LOCK_FILE).symlink_to(target)
    with pytest.raises(DaemonError, match=f"cannot open {folder / LOCK_FILE}"):
        InstanceLock.acquire(folder / "control.sock", {})
    assert not target.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the file to another user")
def test_a_lock_file_of_another_user_is_refused(folder: Path) -> None:
    (folder / LOCK_FILE).write_text("")
    os.chown(folder / LOCK_FILE, 65534, 65534)
    with pytest.raises(DaemonError, match="owned by uid 65534, not by you; remove it"):
        InstanceLock.acquire(folder / "control.sock", {})


def _stale_socket(path: Path) -> None:
    """A socket file whose daemon died without removing it (as after SIGKILL)."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))


def _serves(path: Path) -> bool:
    try:
        with ControlClient.connect(path) as client:
            client.call("status")
    except DaemonNotRunningError:
        return False
    return True


@pytest.mark.slow
def test_twin_daemons_started_at_once_leave_one_serving_with_its_socket(
    folder: Path, tiny_model: Path
) -> None:
    sock = folder / "control.sock"
    config = folder / "config.toml"
    lost, losers = 0, []
    for _ in range(ROUNDS):
        config.write_text(
            f'[daemon]\nhttp = "127.0.0.1:{free_port()}"\nsocket = "{sock}"\n'
            f'arena = "{folder / "arena"}"\njournal = "{folder / "journal.sqlite3"}"\n'
            f'[models.m]\npath = "{tiny_model}"\nn_ctx = 256\nn_gpu_layers = 0\n'
        )
        _stale_socket(sock)
        argv = [sys.executable, "-m", "arbiterd", "daemon", "--config", str(config)]
        twins = [
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        try:
            loser = _first_to_exit(twins)
            _, stderr = loser.communicate()
            losers.append((loser.returncode, stderr.strip()))
            winner = twins[1 - twins.index(loser)]
            lost += not _wait_serving(sock, winner)
        finally:
            for twin in twins:
                twin.terminate()
                twin.communicate(timeout=60)
    assert lost == 0
    for code, message in losers:
        # Either the lock or, when the winner had already bound it, the port refused it.
        assert code in (75, 71), message
        assert message.startswith("arbiterd daemon: another arbiterd is already running") or (
            "is already in use" in message
        )


def _first_to_exit(twins: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for twin in twins:
            if twin.poll() is not None:
                return twin
        time.sleep(0.02)
    raise AssertionError("neither twin exited: both think they run")


def _wait_serving(sock: Path, winner: subprocess.Popen[str]) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and winner.poll() is None:
        if _serves(sock):
            return True
        time.sleep(0.05)
    return False
