"""A real process that takes several devices' arenas as one model does (arbiterd.arena.devices),
driven by tests/arena/test_devices.py.

    devices_actor.py SPEC

SPEC is JSON: {"stop": STOPFILE, "devices": [[DEVICE_ID, ARENA_DIR, LOG], ...], "order": ORDER}
(ORDER "canonical", or "reversed" to break the order on purpose). Until STOPFILE
exists: take every device (over_devices: a single device takes its arena's own path) in a random
class and a random way, stamp `enter` in each device's LOG, hold up to 3 ms or until wanted,
stamp `exit` in each LOG, hand over, pause up to 5 ms. Stamps are tests/support/stamps.py's
format; a foreign program of one arena is arena_actor.py's `bare` mode.

The ways to wait are the ones that let go of part: a timeout or a cancel that may come while
some tokens are held, after which the same place is taken again (as a worker retries).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path

from arbiterd.arena import Arena, Devices, DevicesPlace, Gateway, Hold, Place, Ticket, over_devices
from arbiterd.errors import AcquireCancelledError, AcquireTimeoutError
from arbiterd.states import Priority

PROBE_INTERVAL_S = 0.0005
HOLD_MAX_S = 0.003
PAUSE_MAX_S = 0.005
# An impatient try gives up after up to this much, often while it holds part of the devices.
IMPATIENT_MAX_S = 0.02


def stamp(log_fds: list[int], what: str) -> None:
    line = f"{what} {os.getpid()} {time.monotonic_ns()}\n".encode()
    for fd in log_fds:
        os.write(fd, line)


def take(gateway: Gateway, rng: random.Random) -> Hold:
    """Every device, waited for in one of the ways arbiterd's callers wait."""
    priority = rng.choice(list(Priority))
    place = gateway.queue(priority)
    try:
        way = rng.randrange(3)
        if way == 0:  # the worker's warm-up: a cancel that never comes
            return place.take("cancellable", cancel=threading.Event())
        if way == 1:  # impatient, then the same place without a bound
            try:
                return impatient(gateway, place, rng.uniform(0.0, IMPATIENT_MAX_S))
            except AcquireTimeoutError:
                return place.take("kept")
        while True:  # cancelled now and then by something else, retried (a worker's wake)
            cancel = threading.Event()
            timer = threading.Timer(rng.uniform(0.0, IMPATIENT_MAX_S), cancel.set)
            timer.start()
            try:
                return place.take("woken", cancel=cancel)
            except AcquireCancelledError:
                continue
            finally:
                timer.cancel()
    finally:
        place.leave()


def impatient(gateway: Gateway, place: Place, timeout_s: float) -> Hold:
    """A try bounded by `timeout_s`: on several devices, the place's own bound; on one, the
    arena's (its ticket's take has none)."""
    if isinstance(place, DevicesPlace):
        return place.take("impatient", timeout_s=timeout_s)
    assert isinstance(gateway, Arena)
    assert isinstance(place, Ticket)
    return gateway.acquire("impatient", ticket=place, timeout_s=timeout_s)


def main() -> int:
    spec = json.loads(sys.argv[1])
    stop = Path(spec["stop"])
    devices = [(device, Arena(Path(arena))) for device, arena, _log in spec["devices"]]
    gateway = over_devices(devices)
    if spec.get("order") == "reversed" and isinstance(gateway, Devices):
        # Only for the test that shows what a broken order does: a deadlock.
        gateway.parts = gateway.parts[::-1]
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    log_fds = [os.open(log, flags, 0o600) for _device, _arena, log in spec["devices"]]
    rng = random.Random(os.getpid())
    while True:  # at least one hold: every contender must eventually be served
        hold = take(gateway, rng)
        stamp(log_fds, "enter")
        deadline = time.monotonic() + rng.uniform(0.0, HOLD_MAX_S)
        while time.monotonic() < deadline and not hold.wanted():
            time.sleep(PROBE_INTERVAL_S)
        stamp(log_fds, "exit")
        hold.hand_over()
        if stop.exists():
            return 0
        time.sleep(rng.uniform(0.0, PAUSE_MAX_S))


if __name__ == "__main__":
    sys.exit(main())
