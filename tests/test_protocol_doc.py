"""docs/examples/gpu-job.sh, the shell example of the protocol, against a live Python holder."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from arbiterd.arena import Arena
from tests.conftest import Processes
from tests.support.waiting import wait_until

GPU_JOB = Path(__file__).parents[1] / "docs" / "examples" / "gpu-job.sh"

# The job reports what the arena looks like while it runs, through arbiterd's own observer.
REPORT = (
    "import os, sys; from pathlib import Path; from arbiterd.arena import Arena; "
    "s = Arena(Path(os.environ['ARBITERD_ARENA'])).observe(); "
    "print(s.holder_pid, s.holder.name if s.holder else None, len(s.waiter_pids))"
)


def test_shell_script_waits_for_the_holder_and_is_seen_as_holder(
    arena: Arena, procs: Processes
) -> None:
    token = arena.acquire("model")
    env = dict(os.environ, ARBITERD_ARENA=str(arena.path), JOB_NAME="render")
    job = procs.start(["sh", str(GPU_JOB), sys.executable, "-c", REPORT], env=env)
    wait_until(token.wanted, 10, "the script to announce itself")
    handed = threading.Thread(target=token.hand_over)
    handed.start()
    out, err = job.communicate(timeout=30)
    handed.join(timeout=10)
    assert job.returncode == 0, err
    holder_pid, name, waiters = out.split()
    assert (int(holder_pid), name, waiters) == (job.pid, "render", "0")
    state = arena.observe()
    assert (state.holder_pid, state.waiter_pids) == (None, ())
    assert arena.read_holder_file() is None  # cleared on release


def test_shell_script_passes_the_exit_status_through(arena: Arena) -> None:
    env = dict(os.environ, ARBITERD_ARENA=str(arena.path))
    done = subprocess.run(["sh", str(GPU_JOB), "sh", "-c", "exit 9"], env=env, check=False)
    assert done.returncode == 9
