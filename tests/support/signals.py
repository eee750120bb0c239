"""Stopping a process as a frozen one looks (issue 24), and knowing when the kernel has."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.support.waiting import wait_until


def _all_stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped: SIGSTOP takes effect in each thread as the
    kernel next schedules it, after `kill` returned (a busy process may answer meanwhile)."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        # The state follows the command name, which is in parentheses and may hold spaces.
        if stat.read_text().rpartition(")")[2].split()[0] != "T":
            return False
    return True


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once all its threads are stopped."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: _all_stopped(pid), timeout_s, f"pid {pid} to stop")
