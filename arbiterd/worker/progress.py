"""The engine thread's progress through one long native call, as the io thread sees it (issue 40).

A load, a release or a restore copies up to tens of GB in llama.cpp calls that call nothing
back, so the engine thread cannot beat while it is in one (worker/loop.py); its CPU clock moving
on is the sign of life instead. Owns `NativeCall`, one such call as the engine thread entered
it, and `Progress`, the io thread's record of when it last saw the clock move in that call.
Reads another thread's clock (pthread_getcpuclockid(3), clock_gettime(2)); never sleeps, never
touches the engine.

Why the CPU clock: a copy costs CPU on the calling thread whatever the device (memcpy into a
staging buffer, page faults on the model file's mapping, a driver's submissions, send(2) and
recv(2) to an RPC server), however slow the disk or the bus; a call blocked on a server that
stopped answering, or on a fence that never signals, sleeps in the kernel, and a sleeping
thread's clock does not move at all (it counts only time on a CPU). What it cannot tell apart:
a driver that spins on the CPU while it waits for a hung device moves the clock like a copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class NativeCall:
    """One long native call, as the engine thread entered it: each is its own (compared by
    identity), so a look at a new call never counts the clock a previous one moved."""

    cpu_s: float  # the engine thread's CPU clock on entry (time.thread_time() there)
    at: float  # time.monotonic() on entry


class Progress:
    """When the engine thread's CPU clock was last seen to move in the current native call.
    Only the io thread uses it; the engine thread publishes the `NativeCall` it is in."""

    def __init__(self, engine_clock: int) -> None:
        self._clock = engine_clock  # time.pthread_getcpuclockid of the engine thread
        self._call: NativeCall | None = None
        self._cpu_s = 0.0
        self._at = 0.0

    def last_moved(self, call: NativeCall, now: float) -> float:
        """When the engine thread last made progress in `call`, as far as the looks tell: `now`
        if its clock moved since the last look (or since it entered the call, at the first),
        else the time of the last look that saw it move (its entry, if none did)."""
        if call is not self._call:
            self._call, self._cpu_s, self._at = call, call.cpu_s, call.at
        cpu_s = time.clock_gettime(self._clock)
        if cpu_s > self._cpu_s:
            self._cpu_s, self._at = cpu_s, now
        return self._at
