"""Folders arbiterd creates are private at every level, whatever the umask (issue 16, item 1)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiterd.errors import ArenaUnwritableError, DaemonError
from arbiterd.paths import ensure_private_dir, make_private_dirs
from tests.support.daemon import free_port

ARBITERD = [sys.executable, "-m", "arbiterd"]
COMMAND_TIMEOUT_S = 60


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("umask_022")
def test_every_created_level_is_0700_under_umask_022(tmp_path: Path) -> None:
    make_private_dirs(tmp_path / "a" / "b" / "c", DaemonError)
    for level in ("a", "a/b", "a/b/c"):
        assert _mode(tmp_path / level) == 0o700, level


def test_a_umask_that_masks_the_owner_still_gives_a_usable_folder(tmp_path: Path) -> None:
    old = os.umask(0o277)
    try:
        make_private_dirs(tmp_path / "a" / "b", DaemonError)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a") == 0o700
    assert _mode(tmp_path / "a" / "b") == 0o700


def test_existing_parents_are_left_as_they_are(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    make_private_dirs(shared / "mine", DaemonError)
    assert _mode(shared) == 0o755
    assert _mode(shared / "mine") == 0o700


def test_a_loose_existing_folder_is_refused_with_the_fix(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    with pytest.raises(ArenaUnwritableError, match=rf"mode 0755.*\(chmod 700 {loose}\)"):
        ensure_private_dir(loose, ArenaUnwritableError)


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(DaemonError, match="is not a directory"):
        ensure_private_dir(tmp_path / "file", DaemonError)


def test_a_folder_that_cannot_be_created_names_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(DaemonError, match=f"cannot create {tmp_path / 'file' / 'sub'}"):
        make_private_dirs(tmp_path / "file" / "sub", DaemonError)


@pytest.fixture
def fresh_xdg(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A login's environment: a fresh 0700 runtime dir (as logind makes it) and empty
    config/state homes, nothing of arbiterd's in them yet."""
    runtime = Path("/tmp") / f"ad-xdg-{os.getpid()}-{tmp_path.name[-12:]}"  # socket paths: short
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "ARBITERD_ARENA"}
    env.update(
        XDG_RUNTIME_DIR=str(runtime),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        XDG_STATE_HOME=str(tmp_path / "state"),
    )
    yield env
    for path in sorted(runtime.rglob("*"), reverse=True):
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    runtime.rmdir()


def _arbiterd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ARBITERD, *args],
        env=env,
        umask=0o022,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )


@pytest.mark.slow
def test_daemon_run_and_arena_status_start_under_umask_022(
    fresh_xdg: dict[str, str], tiny_model: Path
) -> None:
    env = fresh_xdg
    config = Path(env["XDG_CONFIG_HOME"]) / "arbiterd" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(
        f'[daemon]\nhttp = "127.0.0.1:{free_port()}"\n\n'
        f'[models.tiny]\npath = "{tiny_model}"\nn_ctx = 256\n'
    )
    status = _arbiterd(env, "arena", "status", "--json")
    assert status.returncode == 0, status.stderr
    run = _arbiterd(env, "run", "--", "true")
    assert run.returncode == 0, run.stderr

    daemon = subprocess.Popen(
        [*ARBITERD, "daemon"],
        env=env,
        umask=0o022,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        answer = _wait_for_status(env, daemon)
        assert "tiny" in answer.stdout
    finally:
        daemon.terminate()
        _, stderr = daemon.communicate(timeout=COMMAND_TIMEOUT_S)
    assert daemon.returncode == 0, stderr

    runtime = Path(env["XDG_RUNTIME_DIR"])
    for folder in (
        runtime / "arbiterd",
        runtime / "arbiterd" / "arena",
        runtime / "arbiterd" / "arena" / "gpu0",
        Path(env["XDG_STATE_HOME"]),
        Path(env["XDG_STATE_HOME"]) / "arbiterd",
    ):
        assert _mode(folder) == 0o700, folder


def _wait_for_status(
    env: dict[str, str], daemon: subprocess.Popen[str]
) -> subprocess.CompletedProcess[str]:
    """`arbiterd status` until the daemon answers (it exits 69 while nothing listens)."""
    while True:
        answer = _arbiterd(env, "status")
        if answer.returncode == 0:
            return answer
        if daemon.poll() is not None:
            _, stderr = daemon.communicate()
            raise AssertionError(f"daemon exited {daemon.returncode}:\n{stderr}")
        assert answer.returncode == 69, answer.stderr
