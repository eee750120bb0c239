"""A real process that plays a part in the arena protocol, driven by the arena tests.

    arena_actor.py ARENA hold NAME          acquire, print "acquired", release on stdin EOF
    arena_actor.py ARENA cycle LOG N        N rounds: acquire, stamp, hold until wanted, hand over
    arena_actor.py ARENA fuzz LOG STOPFILE  like cycle with random holds and classes, until
                                            STOPFILE

Stamps are lines `enter|exit PID MONOTONIC_NS` appended to LOG in the format of
tests/support/stamps.py: `enter` is written after the token is held and `exit` before it is
released, so overlapping intervals would mean two holders at once.
Exit status 3 means "stranded": a holder waited STRANDED_S for a waiter it was told exists.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

from arbiterd.arena import Arena, Priority, Token

STRANDED_S = 20.0
PROBE_INTERVAL_S = 0.0005


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
    while True:  # at least one hold: every contender must eventually be served
        token = arena.acquire("fuzz", priority=rng.choice(list(Priority)))
        stamp(log_fd, "enter")
        hold_until_wanted(token, rng.uniform(0.0, 0.03))
        stamp(log_fd, "exit")
        token.hand_over()
        if stop.exists():
            return 0
        time.sleep(rng.uniform(0.0, 0.005))


if __name__ == "__main__":
    sys.exit(main())
