"""`arbiterd shutdown` against a real daemon, and how it tells a systemd unit's daemon."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from arbiterd.cli.commands import unit_in_cgroup
from tests.support.daemon import serving, tiny


def shutdown(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "arbiterd", "shutdown", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_shutdown_stops_the_daemon_and_waits_for_it_to_close_its_journal_and_exit(
    tiny_model: Path,
) -> None:
    with serving({"alpha": tiny(tiny_model)}) as daemon:
        with daemon.client() as client:
            client.timeout_s = 60
            client.call("warm", model="alpha")
        done = shutdown("--socket", str(daemon.socket))
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"arbiterd stopped (pid {daemon.process.pid})\n"
        # Waited for: the daemon has exited, and with 0, when the command returns.
        assert daemon.process.poll() == 0
        assert not daemon.socket.exists()
        # Closed cleanly: SQLite folds its write-ahead log back in and removes it.
        assert daemon.journal.exists()
        assert not Path(f"{daemon.journal}-wal").exists()
    again = shutdown("--socket", str(daemon.socket))
    assert again.returncode == 69  # nobody to stop
    assert "arbiterd is not running" in again.stderr


def test_a_negative_timeout_is_refused_before_anything_is_asked(tmp_path: Path) -> None:
    done = shutdown("--socket", str(tmp_path / "none.sock"), "--timeout", "-1")
    assert done.returncode == 65
    assert "--timeout must be a non-negative number" in done.stderr


def test_the_unit_a_daemon_runs_in_is_read_from_its_cgroup() -> None:
    unit = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/arbiterd.service\n"
    assert unit_in_cgroup(unit) == "arbiterd.service"
    shell = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/vte-spawn-1.scope\n"
    assert unit_in_cgroup(shell) is None
    assert unit_in_cgroup("0::/\n") is None
