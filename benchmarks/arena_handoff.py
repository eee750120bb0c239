"""Handoff latency of the bare arena protocol, against a pipe wake-up measured in the same run.

One handoff: the holder's wanted() returns True (t0) -> hand_over() -> the waiter's acquire()
returns holding the token (t1). Two processes alternate --handoffs times; CLOCK_MONOTONIC is
system-wide, so stamps from both processes compare directly.

Baseline: the cost of waking a process blocked in read(2) on a pipe — the floor for any
cross-process handoff. The ratio says how far the protocol is from that floor.

    python -m benchmarks.arena_handoff [--handoffs 1000] [--dir DIR] [--out FILE]

The arena goes where arbiterd puts it, on a tmpfs ($XDG_RUNTIME_DIR, else /dev/shm): on ext4,
replacing holder.json by rename costs ~0.1 ms by itself (auto_da_alloc flushes the new file).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import tempfile
import time
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

from arbiterd.arena import Arena
from benchmarks.common import report, summary


def contender(
    arena_path: str, index: int, rounds: int, done: Synchronized[int], out: Connection
) -> None:
    """Hold, spin on wanted(), hand over; report (acquired_ns, seen_ns, index) per hold. Once
    the other contender is done (`done` counts those), nobody will want the token again: the
    holds left are made without waiting, so the run ends whatever the order of the holds."""
    arena = Arena(Path(arena_path))
    stamps = []
    for _ in range(rounds):
        token = arena.acquire("bench")
        acquired = time.monotonic_ns()
        seen = acquired
        while not token.wanted():
            if done.value:
                break
        else:
            seen = time.monotonic_ns()
        token.hand_over()
        stamps.append((acquired, seen, index))
    with done.get_lock():
        done.value += 1
    out.send(stamps)


def measure_arena(handoffs: int, base: Path) -> list[float]:
    ctx = get_context("spawn")
    rounds = handoffs // 2 + 1
    done = ctx.Value("i", 0)
    with tempfile.TemporaryDirectory(prefix="arbiterd-bench-", dir=base) as tmp:
        receivers, procs = [], []
        for index in range(2):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=contender, args=(tmp, index, rounds, done, send))
            proc.start()
            receivers.append(recv)
            procs.append(proc)
        holds = sorted(stamp for recv in receivers for stamp in recv.recv())
        for proc in procs:
            proc.join(timeout=60)
    # A handoff is a hold followed by the other contender's: hand_over makes the two alternate,
    # but on a loaded machine its wait for the token to change hands may run out.
    return [
        (nxt[0] - prev[1]) / 1e6 for prev, nxt in itertools.pairwise(holds) if nxt[2] != prev[2]
    ]


def pipe_echo(read_fd: int, write_fd: int, count: int) -> None:
    for _ in range(count):
        os.read(read_fd, 8)
        os.write(write_fd, time.monotonic_ns().to_bytes(8, "little"))


def measure_pipe(count: int) -> list[float]:
    """One-way wake-up latency: the echoing child stamps and writes, the blocked parent wakes."""
    ctx = get_context("fork")  # the child inherits the pipe fds; the parent has no threads
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    proc = ctx.Process(target=pipe_echo, args=(to_child_r, to_parent_w, count))
    proc.start()
    latencies = []
    for _ in range(count):
        os.write(to_child_w, b"go")
        sent = int.from_bytes(os.read(to_parent_r, 8), "little")
        latencies.append((time.monotonic_ns() - sent) / 1e6)
    proc.join(timeout=60)
    for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
        os.close(fd)
    return latencies


def default_dir() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or "/dev/shm")


def filesystem_type(path: Path) -> str:
    """The type of the mount holding `path`, from /proc/self/mounts (longest mount point wins)."""
    resolved = str(path.resolve())
    best, fstype = "", "unknown"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        mount = fields[1]
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, fstype = mount, fields[2]
    return fstype


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=default_dir(), help="where the arena goes")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    arena = summary(measure_arena(args.handoffs, args.dir), "ms")
    pipe = summary(measure_pipe(args.handoffs), "ms")
    result = {
        "benchmark": "arena_handoff",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "arena_dir": str(args.dir),
        "arena_fs": filesystem_type(args.dir),
        "arena_handoff": arena,
        "baseline_pipe_wakeup": pipe,
        "ratio_median": round(arena["median_ms"] / pipe["median_ms"], 2),
        "goal_median_ms": 1.0,
        "goal_met": arena["median_ms"] < 1.0,
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
