"""The engine thread's progress through one long native call, as the io thread sees it (issue 40).

A load, a release or a restore copies up to tens of GB in llama.cpp calls that call nothing
back, so the engine thread cannot beat while it is in one (worker/loop.py); its CPU clock moving
on is the sign of life instead. Owns `NativeCall`, one such call as the engine thread entered
it, `Progress`, the io thread's record of when it last saw the clock move in that call, and
`Beat`, the engine thread's last sign of life as the io thread answers it in status (its
`beat_age_s`). Reads another thread's clock (pthread_getcpuclockid(3), clock_gettime(2));
never sleeps, never touches the engine.

Why the CPU clock: a copy costs CPU on the calling thread whatever the device (memcpy into a
staging buffer, page faults on the model file's mapping, a driver's submissions, send(2) and
recv(2) to an RPC server), however slow the disk or the bus; a call blocked on a server that
stopped answering, or on a fence that never signals, sleeps in the kernel, and a sleeping
thread's clock does not move at all (it counts only time on a CPU). What it cannot tell apart:
a driver that spins on the CPU while it waits for a hung device moves the clock like a copy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

_T = TypeVar("_T")


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


class Beat:
    """The engine thread's last sign of life. The engine thread beats each turn of its loop and
    before each decode batch and tokenizer piece (`now`), waits on other processes inside
    `waiting_for_others`, and makes each long native call through `native_call`; the io thread
    reads `age_s` for status. Shared by the two threads through single reference assignments."""

    def __init__(self) -> None:
        self._at = time.monotonic()
        self._waiting = False  # it sleeps on the doorbell or waits in the queue for the token
        # The load, release or restore the engine thread is in, and the io thread's look at its
        # progress (made in `started`, on the engine thread, whose clock it reads).
        self._native: NativeCall | None = None
        self._progress: Progress | None = None

    def started(self) -> None:
        """On the engine thread, before the io thread starts: whose CPU clock counts."""
        self._progress = Progress(time.pthread_getcpuclockid(threading.get_ident()))

    def now(self) -> None:
        self._at = time.monotonic()

    @contextlib.contextmanager
    def waiting_for_others(self) -> Iterator[None]:
        """The engine thread waits on what other processes do (a bell, the token): alive, as
        its status says, however long that takes."""
        self._waiting = True
        try:
            yield
        finally:
            self._at = time.monotonic()  # first: the io thread never sees a beat that old
            self._waiting = False

    def native_call(self, call: Callable[[], _T]) -> _T:
        """`call`: a load, release or restore (or the kept KV set back), one long native call
        that beats by its CPU clock."""
        self._at = time.monotonic()
        self._native = NativeCall(time.thread_time(), self._at)
        try:
            return call()
        finally:
            # The beat first: the io thread never sees the call gone and its entry's beat.
            self._at = time.monotonic()
            self._native = None

    def age_s(self) -> float:
        """How old the engine thread's last sign of life is, as the io thread answers status:
        0 while it waits on another process (the doorbell, the queue for the token), which no
        hung driver does; inside a load, release or restore, its CPU clock moving on counts."""
        if self._waiting:
            return 0.0
        now = time.monotonic()
        beat, native, progress = self._at, self._native, self._progress
        if native is not None and progress is not None:
            beat = max(beat, progress.last_moved(native, now))
        return round(now - beat, 3)
