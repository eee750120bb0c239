"""A real process that plays a part in the arena protocol, driven by the arena tests.

    arena_actor.py ARENA hold NAME          acquire, print "acquired", release on stdin EOF
    arena_actor.py ARENA cycle LOG N        N rounds: acquire, stamp, hold until wanted, hand over
    arena_actor.py ARENA fuzz LOG STOPFILE  like cycle with random holds and classes, until
                                            STOPFILE
    arena_actor.py ARENA aging LOG STOPFILE AGING_S
                                            like fuzz with classes aging every AGING_S, holds
                                            of at most a millisecond, and every way to wait
    arena_actor.py ARENA turns LOG STOPFILE like aging (classes aging every TURN_AGING_S), each
                                            hold a turn: a random queue of short requests
                                            served as a worker does (worker/policy.py); at
                                            the end, prints the longest wait of each class
                                            as JSON
    arena_actor.py ARENA bare LOG STOPFILE  a program of the bare protocol (token.lock and
                                            want.lock, no ticket) that holds now and then

Stamps are lines `enter|exit PID MONOTONIC_NS` appended to LOG in the format of
tests/support/stamps.py: `enter` is written after the token is held and `exit` before it is
released, so overlapping intervals would mean two holders at once.
Exit status 3 means "stranded": a holder waited STRANDED_S for a waiter it was told exists.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import random
import sys
import threading
import time
from pathlib import Path

from arbiterd.arena import Arena, Token
from arbiterd.arena import records as arena_records
from arbiterd.errors import AcquireTimeoutError
from arbiterd.states import Priority
from arbiterd.worker.policy import HoldView, release_reason

STRANDED_S = 20.0
PROBE_INTERVAL_S = 0.0005
# The turns fuzz's scale (issue 43): the daemon's defaults divided by 100 and more, so that a
# run sees thousands of turns. Each bound is at least the quantum and at least the class's
# aging (rank x TURN_AGING_S), as config/daemontable.py and docs/scheduling.md ask of the real ones.
TURN_AGING_S = 0.05
TURN_QUANTUM_S = 0.02
TURN_BOUNDS_S = {Priority.INTERACTIVE: 0.05, Priority.NORMAL: 0.1, Priority.BATCH: 0.15}
TURN_MAX_QUEUE = 8
TURN_REQUEST_S = 0.002


def stamp(log_fd: int, what: str) -> None:
    os.write(log_fd, f"{what} {os.getpid()} {time.monotonic_ns()}\n".encode())


def hold_until_wanted(token: Token, max_s: float) -> bool:
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        if token.wanted():
            return True
        time.sleep(PROBE_INTERVAL_S)
    return False


def main() -> int:
    arena = Arena(Path(sys.argv[1]))
    mode = sys.argv[2]
    if mode == "hold":
        with arena.acquire(sys.argv[3]):
            print("acquired", flush=True)
            sys.stdin.read()
        return 0
    log_fd = os.open(sys.argv[3], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    if mode == "cycle":
        rounds = int(sys.argv[4])
        for i in range(rounds):
            token = arena.acquire("cycle")
            stamp(log_fd, "enter")
            # The last round may be the last hold of all: nobody will come for it.
            wanted = i == rounds - 1 or hold_until_wanted(token, STRANDED_S)
            stamp(log_fd, "exit")
            token.hand_over()
            if not wanted:
                return 3
        return 0
    stop = Path(sys.argv[4])
    rng = random.Random(os.getpid())
    if mode == "aging":
        arena_records.PRIORITY_AGING_S = float(sys.argv[5])
        return aging(arena, log_fd, stop, rng)
    if mode in ("turns", "bare"):
        arena_records.PRIORITY_AGING_S = TURN_AGING_S  # a bare program reads no queue: no matter
        return (
            turns(arena, log_fd, stop, rng)
            if mode == "turns"
            else bare(arena.path, log_fd, stop, rng)
        )
    while True:  # at least one hold: every contender must eventually be served
        token = arena.acquire("fuzz", priority=rng.choice(list(Priority)))
        stamp(log_fd, "enter")
        hold_until_wanted(token, rng.uniform(0.0, 0.03))
        stamp(log_fd, "exit")
        token.hand_over()
        if stop.exists():
            return 0
        time.sleep(rng.uniform(0.0, 0.005))


def aging(arena: Arena, log_fd: int, stop: Path, rng: random.Random) -> int:
    """Until STOPFILE: take the token in a random class and a random way, hold it up to 1 ms,
    hand it over, and at once queue again."""
    while True:
        token = take(arena, rng.choice(list(Priority)), rng)
        stamp(log_fd, "enter")
        time.sleep(rng.uniform(0.0, 0.001))  # the work done on the GPU
        stamp(log_fd, "exit")
        token.hand_over()
        if stop.exists():
            return 0


def turns(arena: Arena, log_fd: int, stop: Path, rng: random.Random) -> int:
    """Until STOPFILE: take the token in a random class and a random way, then serve a random
    queue of requests in one turn, deciding between two as the worker does: on while requests
    are left, until the quantum is spent or a ticket has waited its class's bound. Prints the
    longest wait of each class (JSON) at the end."""
    longest = dict.fromkeys(Priority, 0.0)
    while True:
        priority = rng.choice(list(Priority))
        asked = time.monotonic()
        token = take(arena, priority, rng)
        longest[priority] = max(longest[priority], time.monotonic() - asked)
        stamp(log_fd, "enter")
        warm, queued, served = time.monotonic(), rng.randint(1, TURN_MAX_QUEUE), 0
        while queued:
            wanted, held_s = token.wanted(), time.monotonic() - warm
            wait_left_s = math.inf
            if wanted and held_s < TURN_QUANTUM_S:  # read only where it can change the answer
                state = arena.observe()
                wait_left_s = min(
                    (
                        TURN_BOUNDS_S[w.priority] - w.waited_s(state.observed_ns)
                        for w in state.queue
                        if w.pid not in state.stopped_pids
                    ),
                    default=math.inf,
                )
            view = HoldView(
                wanted=wanted,
                held_s=held_s,
                idle_s=0.0,
                queued=queued,
                served_since_warm=served > 0,
                quantum_s=TURN_QUANTUM_S,
                wait_left_s=wait_left_s,
            )
            if release_reason(view, min_hold_s=0.0, idle_release_s=0.0) is not None:
                break
            time.sleep(rng.uniform(0.0, TURN_REQUEST_S))  # one request on the GPU
            queued, served = queued - 1, served + 1
        stamp(log_fd, "exit")
        token.hand_over()
        if stop.exists():
            print(json.dumps({p.value: s for p, s in longest.items()}), flush=True)
            return 0


def take(arena: Arena, priority: Priority, rng: random.Random) -> Token:
    """The token, waited for in one of the ways arbiterd's callers wait."""
    way = rng.randrange(4)
    if way == 0:  # a deadline (a helper thread waits, and the caller checks the clock)
        return arena.acquire("deadline", priority=priority, timeout_s=60)
    if way == 1:  # a cancel that never comes (the worker's warm-up)
        return arena.acquire("cancellable", priority=priority, cancel=threading.Event())
    if way == 2:  # an impatient try, then the same place without a bound (a kept ticket)
        ticket = arena.queue(priority)
        try:
            try:
                return arena.acquire("kept", ticket=ticket, timeout_s=rng.uniform(0.0, 0.01))
            except AcquireTimeoutError:
                return arena.acquire("kept", ticket=ticket)
        finally:
            ticket.leave()
    return arena.acquire("unbounded", priority=priority)  # `arbiterd run` without --timeout


def bare(path: Path, log_fd: int, stop: Path, rng: random.Random) -> int:
    """Until STOPFILE: the protocol's Acquire and Release with nothing else (no ticket, no
    holder.json, no handover), as the C example of docs/arena-protocol.md, with pauses."""
    want = os.open(path / "want.lock", os.O_RDWR | os.O_CLOEXEC)
    token = os.open(path / "token.lock", os.O_RDWR | os.O_CLOEXEC)
    while True:
        fcntl.flock(want, fcntl.LOCK_SH)
        fcntl.flock(token, fcntl.LOCK_EX)
        stamp(log_fd, "enter")
        fcntl.flock(want, fcntl.LOCK_UN)
        time.sleep(rng.uniform(0.0, 0.002))  # the work done on the GPU
        stamp(log_fd, "exit")
        fcntl.flock(token, fcntl.LOCK_UN)
        if stop.exists():
            return 0
        time.sleep(rng.uniform(0.0, 0.02))  # between two jobs


if __name__ == "__main__":
    sys.exit(main())
