"""Fairness of the arena's queue for six contenders, against the bare protocol (token.lock +
want.lock, no tickets) measured in the same run.

Each contender process asks for the token, holds it for a random 0.2-2 ms, releases it and asks
again at once, until the run has --handoffs holds. Every hold is stamped (CLOCK_MONOTONIC is
system-wide) and checked afterwards:

- overlapping holders (two holds whose intervals intersect): must be 0;
- stranded contenders (one that never finished): must be 0;
- the longest wait against the issue's bound, (N - 1) x the longest hold + 50 ms;
- Jain's fairness index of the hold time each contender got ((sum x)^2 / (n sum x^2), 1 = equal).

Then priorities: 100 times, a holder holds while 4 batch waiters queue and then 1 interactive
waiter; the interactive one must be admitted next every time.

    python -m benchmarks.arena_fairness [--handoffs 10000] [--contenders 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import os
import random
import sys
import tempfile
import threading
import time
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

from arbiterd.arena import Arena
from arbiterd.states import Priority
from benchmarks.common import report, summary

MIN_HOLD_S, MAX_HOLD_S = 0.0002, 0.002
BOUND_SLACK_S = 0.050
PRIORITY_TRIALS = 100

Hold = tuple[int, int, int, int]  # (contender, asked_ns, got_ns, released_ns)


def contender(
    arena_path: str,
    index: int,
    *,
    queued: bool,
    holds: Synchronized[int],
    goal: int,
    out: Connection,
) -> None:
    """Ask, hold, release, ask again, until `holds` (shared) reaches `goal`; send the stamps."""
    rng = random.Random(index)
    arena = Arena(Path(arena_path))
    stamps: list[Hold] = []
    while True:
        asked = time.monotonic_ns()
        if queued:
            token = arena.acquire(f"c{index}")
            got = time.monotonic_ns()
            time.sleep(rng.uniform(MIN_HOLD_S, MAX_HOLD_S))
            released = time.monotonic_ns()
            token.release()
        else:
            got, released = _bare_hold(Path(arena_path), rng)
        stamps.append((index, asked, got, released))
        with holds.get_lock():
            holds.value += 1
            if holds.value >= goal:
                break
    out.send(stamps)


def _bare_hold(path: Path, rng: random.Random) -> tuple[int, int]:
    """One hold by the protocol without tickets: announce, block on token.lock, hold."""
    want = os.open(path / "want.lock", os.O_RDWR | os.O_CLOEXEC)
    token = os.open(path / "token.lock", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(want, fcntl.LOCK_SH)
        fcntl.flock(token, fcntl.LOCK_EX)
        got = time.monotonic_ns()
        os.close(want)
        want = -1
        time.sleep(rng.uniform(MIN_HOLD_S, MAX_HOLD_S))
        released = time.monotonic_ns()
        return got, released
    finally:
        if want >= 0:
            os.close(want)
        os.close(token)


def run(arena_path: Path, contenders: int, goal: int, *, queued: bool) -> dict[str, Any]:
    ctx = get_context("spawn")
    holds = ctx.Value("i", 0)
    pipes = [ctx.Pipe(duplex=False) for _ in range(contenders)]
    procs = [
        ctx.Process(
            target=contender,
            args=(str(arena_path), i),
            kwargs={"queued": queued, "holds": holds, "goal": goal, "out": pipes[i][1]},
        )
        for i in range(contenders)
    ]
    for proc in procs:
        proc.start()
    stamps: list[Hold] = []
    stranded = 0
    for (receive, _), proc in zip(pipes, procs, strict=True):
        if receive.poll(600):
            stamps += receive.recv()
        else:
            stranded += 1
            proc.kill()
        proc.join(timeout=30)
    return analyse(stamps, contenders, stranded)


def analyse(stamps: list[Hold], contenders: int, stranded: int) -> dict[str, Any]:
    ordered = sorted(stamps, key=lambda hold: hold[2])
    overlaps = sum(1 for a, b in itertools.pairwise(ordered) if b[2] < a[3])
    # From one release to the next holder's start: what a handoff costs.
    gaps = [(b[2] - a[3]) / 1e6 for a, b in itertools.pairwise(ordered)]
    waits = [(got - asked) / 1e9 for _, asked, got, _ in stamps]
    held = [(released - got) / 1e9 for _, _, got, released in stamps]
    per_contender = [0.0] * contenders
    for index, _, got, released in stamps:
        per_contender[index] += (released - got) / 1e9
    jain = sum(per_contender) ** 2 / (contenders * sum(x * x for x in per_contender))
    bound_s = (contenders - 1) * max(held) + BOUND_SLACK_S
    return {
        "holds": len(stamps),
        "overlapping_holders": overlaps,
        "stranded_contenders": stranded,
        "wait": summary([w * 1000 for w in waits], "ms"),
        "hold": summary([h * 1000 for h in held], "ms"),
        "handoff_gap": summary(gaps, "ms"),
        "max_wait_ms": round(max(waits) * 1000, 3),
        "bound_ms": round(bound_s * 1000, 3),
        "max_wait_within_bound": max(waits) <= bound_s,
        "waits_over_bound": sum(1 for w in waits if w > bound_s),
        "jain_index_hold_time": round(jain, 4),
        "hold_s_per_contender": [round(x, 3) for x in per_contender],
    }


def priority_trials(arena_path: Path, trials: int) -> dict[str, Any]:
    """How often an interactive waiter that queued behind 4 batch waiters is admitted next."""
    arena = Arena(arena_path)
    admitted_next = 0
    waiters = [*((f"b{i}", Priority.BATCH) for i in range(4)), ("person", Priority.INTERACTIVE)]
    for _ in range(trials):
        holder = arena.acquire("holder")
        order: list[str] = []
        threads = []
        for name, priority in waiters:
            queued_before = len(arena.observe().queue)
            thread = threading.Thread(target=_admit, args=(arena, name, priority, order))
            thread.start()
            threads.append(thread)
            while len(arena.observe().queue) <= queued_before:
                time.sleep(0.0005)
        holder.release()
        for thread in threads:
            thread.join(timeout=30)
        admitted_next += order[0] == "person"
    return {"trials": trials, "interactive_admitted_next": admitted_next}


def _admit(arena: Arena, name: str, priority: Priority, order: list[str]) -> None:
    token = arena.acquire(name, priority=priority)
    order.append(name)  # one holder at a time: no two threads append at once
    token.release()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=10_000)
    parser.add_argument("--contenders", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or "/dev/shm")
    with tempfile.TemporaryDirectory(prefix="arbiterd-fairness-", dir=base) as tmp:
        queued = run(Path(tmp) / "queued", args.contenders, args.handoffs, queued=True)
        Arena(Path(tmp) / "bare")  # the same files, made the same way
        bare = run(Path(tmp) / "bare", args.contenders, args.handoffs, queued=False)
        priorities = priority_trials(Path(tmp) / "priorities", PRIORITY_TRIALS)
    result = {
        "benchmark": "arena_fairness",
        "contenders": args.contenders,
        "hold_range_ms": [MIN_HOLD_S * 1000, MAX_HOLD_S * 1000],
        "queue": queued,
        "bare_protocol_baseline": bare,
        "max_wait_ratio_queue_to_bare": round(queued["max_wait_ms"] / bare["max_wait_ms"], 3),
        "priorities": priorities,
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
