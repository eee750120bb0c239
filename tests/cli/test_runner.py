"""`arbiterd run` killed with SIGKILL: the token outlives the runner for as long as CMD runs
(issue 10 item 4); docs/examples/gpu-job.sh keeps the same promise in sh, with arena files that
pass arbiterd's checks (item 6)."""

from __future__ import annotations

import io
import os
import random
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from arbiterd.arena import Arena, Token
from arbiterd.cli.runner import run_holding_token
from arbiterd.errors import AcquireTimeoutError, ArenaUnwritableError
from tests.conftest import Processes
from tests.support.stamps import Hold, Overlap, open_holds, overlaps, read_holds
from tests.support.waiting import wait_until

ARBITERD = [sys.executable, "-m", "arbiterd"]
GPU_JOB = Path(__file__).parents[2] / "docs" / "examples" / "gpu-job.sh"

# A command that prints "ready PID" and runs until its stdin closes: the test says when it ends.
UNTIL_EOF = "import os, sys; print('ready', os.getpid(), flush=True); sys.stdin.read()"

# The fault test's command: stamps its hold (tests/support/stamps.py, tagged with its round)
# while it "uses the GPU" for hold_s seconds. Run with `python -S`: it needs no site-packages
# and starts in ~20 ms.
STAMPING_COMMAND = """
import os, sys, time
log, hold_s, tag = sys.argv[1], float(sys.argv[2]), sys.argv[3]
fd = os.open(log, os.O_WRONLY | os.O_APPEND)
os.write(fd, f"enter {os.getpid()} {time.monotonic_ns()} {tag}\\n".encode())
time.sleep(hold_s)
os.write(fd, f"exit {os.getpid()} {time.monotonic_ns()}\\n".encode())
"""
# Kills per run of the fault test; CI runs the default, ARBITERD_FAULT_ROUNDS=1000 a longer fuzz.
FAULT_ROUNDS = int(os.environ.get("ARBITERD_FAULT_ROUNDS", "100"))
RUNNERS_AT_ONCE = 3
COMMAND_HOLD_S = (0.01, 0.05)
# A kill is timed from the runner's start (any moment: starting, waiting, running CMD, releasing)
# or from its command's `enter` stamp (while CMD runs: the case that orphans it).
KILL_AFTER_START_S = (0.0, 0.6)
# How often the fault test's scheduler looks at its runners and the log.
SCHEDULER_POLL_S = 0.002


def start_runner(procs: Processes, arena: Arena, *args: str) -> subprocess.Popen[str]:
    return procs.start([*ARBITERD, "run", "--arena", str(arena.path), *args])


def read_ready(proc: subprocess.Popen[str]) -> int:
    """Wait for UNTIL_EOF's "ready PID" line; return the command's pid."""
    assert proc.stdout is not None
    word, pid = proc.stdout.readline().split()
    assert word == "ready"
    return int(pid)


def assert_token_held(arena: Arena) -> None:
    # timeout 0 makes acquire() answer at once: the token is free now, or it is not.
    with pytest.raises(AcquireTimeoutError):
        arena.acquire("probe", timeout_s=0)


def test_killed_runner_keeps_the_token_until_its_command_exits(
    arena: Arena, procs: Processes
) -> None:
    runner = start_runner(procs, arena, "--name", "game", "--", sys.executable, "-c", UNTIL_EOF)
    command_pid = read_ready(runner)
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=10)  # reaped: every file the runner had open is closed
    assert_token_held(arena)
    state = arena.observe()
    assert state.holder_pid == command_pid  # named although the pid that locked is gone
    assert state.holder is not None
    assert (state.holder.name, state.holder.pid) == ("game", runner.pid)
    assert runner.stdin is not None
    runner.stdin.close()  # the command's stdin too: it exits
    with arena.acquire("next", timeout_s=10):
        pass


def test_command_that_leaves_a_child_behind_is_released_when_it_exits(
    arena: Arena, tmp_path: Path
) -> None:
    # The child inherits the token's descriptor; the runner's unlock releases it for everyone.
    left = tmp_path / "left.pid"
    script = f"sleep 60 </dev/null >/dev/null 2>&1 & echo $! >{left}"
    done = subprocess.run(
        [*ARBITERD, "run", "--arena", str(arena.path), "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    child = int(left.read_text())
    try:
        assert done.returncode == 0, done.stderr
        assert os.path.exists(f"/proc/{child}")  # still running, its fd still open
        with arena.acquire("next", timeout_s=0):
            pass
        assert arena.read_holder_file() is None
    finally:
        os.kill(child, signal.SIGKILL)


def test_command_runs_when_holder_file_cannot_name_it(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(token: Token, pid: int) -> None:
        raise ArenaUnwritableError("holder.json: planted")

    monkeypatch.setattr(Token, "record_command", refuse)
    stderr = io.StringIO()
    status = run_holding_token(
        arena, ["sh", "-c", "exit 4"], name=None, timeout_s=None, stderr=stderr
    )
    assert status == 4
    assert stderr.getvalue() == "arbiterd run: holder.json not updated: holder.json: planted\n"
    assert arena.observe().holder_pid is None


def test_shell_example_makes_files_that_pass_the_checks_under_umask_002(arena: Arena) -> None:
    fresh = arena.path.parent / "fresh"
    env = dict(os.environ, ARBITERD_ARENA=str(fresh))
    old = os.umask(0o002)  # per-user groups: files would be 0664, group-writable
    try:
        done = subprocess.run(["sh", str(GPU_JOB), "true"], env=env, timeout=30, check=False)
    finally:
        os.umask(old)
    assert done.returncode == 0
    for name in ("token.lock", "want.lock", "holder.json"):
        assert stat.S_IMODE((fresh / name).stat().st_mode) == 0o600, name
    Arena(fresh)  # accepted


def test_killed_shell_example_keeps_the_token_until_its_job_exits(
    arena: Arena, procs: Processes
) -> None:
    env = dict(os.environ, ARBITERD_ARENA=str(arena.path))
    job = procs.start(["sh", str(GPU_JOB), sys.executable, "-c", UNTIL_EOF], env=env)
    read_ready(job)
    os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=10)
    assert_token_held(arena)
    assert job.stdin is not None
    job.stdin.close()
    with arena.acquire("next", timeout_s=10):
        pass


@dataclass
class Victim:
    """One `arbiterd run` of the fault test and when it is to be killed."""

    proc: subprocess.Popen[bytes]
    tag: str
    delay_s: float
    anchor_ns: int | None  # when the delay started counting; None: at its command's `enter`


class LogTail:
    """The tags of `enter` stamps appended to the log since the last look."""

    def __init__(self, log: Path) -> None:
        self._file = log.open("rb")
        self._partial = b""

    def new_tags(self) -> set[str]:
        data = self._partial + self._file.read()
        *lines, self._partial = data.split(b"\n")  # a line still being written waits
        return {fields[3].decode() for fields in map(bytes.split, lines) if len(fields) == 4}

    def close(self) -> None:
        self._file.close()


@pytest.mark.timeout(60 + FAULT_ROUNDS)
def test_runner_killed_at_random_moments_never_lets_its_command_share_the_gpu(
    arena: Arena, procs: Processes, tmp_path: Path
) -> None:
    log = tmp_path / "stamps.log"
    log.touch()
    stop = tmp_path / "stop"
    rng = random.Random(20_250_10)
    # Another holder that wants the token whenever it does not hold it: it enters the moment
    # the kernel lets it, so a command left running without the token is overlapped at once.
    contender = procs.actor(arena, "fuzz", str(log), str(stop))
    log_fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    tail = LogTail(log)
    live: list[Victim] = []
    killed_ns: dict[str, int] = {}
    rounds = completed = 0
    started = time.monotonic()
    try:
        while len(killed_ns) < FAULT_ROUNDS:
            while len(live) < RUNNERS_AT_ONCE:
                rounds += 1
                live.append(spawn_victim(arena, log, f"r{rounds}", rng))
            entered = tail.new_tags()
            now = time.monotonic_ns()
            for victim in list(live):
                if victim.proc.poll() is not None:  # its command ended before the kill came
                    live.remove(victim)
                    completed += 1
                    continue
                if victim.anchor_ns is None and victim.tag in entered:
                    victim.anchor_ns = now
                if victim.anchor_ns is not None and now >= victim.anchor_ns + victim.delay_s * 1e9:
                    # Stamped before the kill, as tests/test_arena.py's fuzz does.
                    killed_ns[victim.tag] = time.monotonic_ns()
                    os.write(log_fd, f"kill {victim.proc.pid} {killed_ns[victim.tag]}\n".encode())
                    victim.proc.kill()
                    victim.proc.wait(timeout=10)
                    live.remove(victim)
            time.sleep(SCHEDULER_POLL_S)
    finally:
        for victim in live:
            victim.proc.kill()
            victim.proc.wait(timeout=10)
        tail.close()
        os.close(log_fd)
    stop.touch()
    assert contender.wait(timeout=30) == 0, "the contender was stranded (3) or crashed"
    # Every orphaned command holds the token until it exits: once we hold it, all are done.
    with arena.acquire("last", timeout_s=10):
        wait_until(lambda: not open_holds(log), 10, "orphaned commands to finish")
    elapsed_s = time.monotonic() - started

    holds = read_holds(log)
    commands = [hold for hold in holds if hold.tag]
    orphans = [hold for hold in commands if killed_ns.get(hold.tag, hold.end_ns) < hold.end_ns]
    found = overlaps(holds)
    print(
        f"runner kill fault: {len(killed_ns)} kills ({len(orphans)} while CMD ran), "
        f"{completed} runs completed, {len(commands)} commands, "
        f"{len(holds) - len(commands)} contender holds, {len(found)} overlaps, {elapsed_s:.1f} s"
    )
    assert found == [], describe_overlaps(found)
    assert any(not hold.tag for hold in holds), "the contender was never served"
    assert len(orphans) >= FAULT_ROUNDS // 4, "too few kills hit a running command to tell"


def spawn_victim(arena: Arena, log: Path, tag: str, rng: random.Random) -> Victim:
    hold_s = rng.uniform(*COMMAND_HOLD_S)
    after_enter = rng.random() < 0.5
    command = [sys.executable, "-S", "-c", STAMPING_COMMAND, str(log), f"{hold_s:.3f}", tag]
    proc = subprocess.Popen(
        [*ARBITERD, "run", "--arena", str(arena.path), "--name", tag, "--", *command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if after_enter:
        return Victim(proc, tag, rng.uniform(0, hold_s), None)
    return Victim(proc, tag, rng.uniform(*KILL_AFTER_START_S), time.monotonic_ns())


def describe_overlaps(found: list[Overlap]) -> str:
    def who(hold: Hold) -> str:
        return f"command {hold.tag} (pid {hold.pid})" if hold.tag else f"contender {hold.pid}"

    worst = max(found, key=lambda o: o.overlap_ms)
    return (
        f"{len(found)} overlaps; worst {worst.overlap_ms:.1f} ms: {who(worst.second)} entered "
        f"while {who(worst.first)} held"
    )
