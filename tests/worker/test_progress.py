"""The engine thread's progress through one long native call, seen from another thread (issue
40): a thread that copies moves its CPU clock, one blocked in the kernel does not."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from arbiterd.worker.progress import NativeCall, Progress
from tests.support.waiting import wait_until

LOOK_TIMEOUT_S = 10.0


@contextmanager
def engine_thread(work: Callable[[], None]) -> Iterator[tuple[Progress, NativeCall]]:
    """A thread that enters a native call and runs `work` in it; its Progress and call."""
    entered: list[tuple[int, NativeCall]] = []
    ready = threading.Event()

    def engine() -> None:
        entered.append(
            (
                time.pthread_getcpuclockid(threading.get_ident()),
                NativeCall(time.thread_time(), time.monotonic()),
            )
        )
        ready.set()
        work()

    thread = threading.Thread(target=engine, name="engine-double")
    thread.start()
    try:
        assert ready.wait(LOOK_TIMEOUT_S)
        clock, call = entered[0]
        yield Progress(clock), call
    finally:
        thread.join(timeout=LOOK_TIMEOUT_S)


def read_one(fd: int) -> None:
    os.read(fd, 1)


def test_a_call_blocked_in_the_kernel_stops_moving_and_stays_where_it_stopped() -> None:
    read_end, write_end = os.pipe()
    try:
        # A read with no writer yet: the thread sleeps in the kernel, as one blocked on the
        # socket of an RPC server that stopped answering does.
        with engine_thread(lambda: read_one(read_end)) as (progress, call):
            looks = iter(range(1, 1_000_000))
            seen = [progress.last_moved(call, call.at + next(looks))]

            def still() -> bool:  # two looks in a row saw the clock stand
                seen.append(progress.last_moved(call, call.at + next(looks)))
                return seen[-1] == seen[-2]

            wait_until(still, LOOK_TIMEOUT_S, "the blocked thread's clock to stand still")
            stopped_at = seen[-1]
            for _ in range(50):
                assert progress.last_moved(call, call.at + next(looks)) == stopped_at
            os.write(write_end, b"x")
    finally:
        os.close(write_end)
        os.close(read_end)


def test_a_call_that_works_keeps_moving() -> None:
    stop = threading.Event()

    def copy() -> None:  # a copy costs CPU however slow it goes
        while not stop.is_set():
            bytes(64 * 1024)

    with engine_thread(copy) as (progress, call):

        def moves_by(now: float) -> None:
            wait_until(
                lambda: progress.last_moved(call, now) == now,
                LOOK_TIMEOUT_S,
                "the working thread's clock to move",
            )

        try:
            moves_by(call.at + 1000.0)
            moves_by(call.at + 2000.0)
            moves_by(call.at + 3000.0)
        finally:
            stop.set()


def test_each_call_is_looked_at_from_its_own_entry() -> None:
    clock = time.pthread_getcpuclockid(threading.get_ident())
    progress = Progress(clock)
    first = NativeCall(0.0, 10.0)  # this thread's clock has moved since: progress
    assert progress.last_moved(first, 20.0) == 20.0
    # A new call, entered at a reading the clock has not reached: nothing moved since its
    # entry, whatever was seen of the call before.
    second = NativeCall(time.clock_gettime(clock) + 3600.0, 30.0)
    assert progress.last_moved(second, 40.0) == 30.0
