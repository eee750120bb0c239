"""Waiting on conditions with a deadline: the tests' replacement for bare sleeps.

`wait_until` polls from a thread; `until` is its asyncio form, which lets the loop run
meanwhile; `to_first_wait` starts a coroutine and returns once it waits for something, the
condition a test means when it checks that a wait is pending (rather than yielding to the loop a
counted number of times, which ties the test to how many awaits the product makes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

POLL_S = 0.005
_T = TypeVar("_T")


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll `condition` until it is truthy; fail the test with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)


async def until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """`wait_until` inside a running loop: the loop's other tasks run while it polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(POLL_S)


async def to_first_wait(coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
    """A task running `coro`, returned once the coroutine has run up to its first wait for
    something (or ended: then the task is done). A task's step runs without interruption from
    `begun.set()` until the coroutine suspends, so when the caller wakes the coroutine is parked
    in that wait, however many awaits that do not suspend it made on the way."""
    begun = asyncio.Event()

    async def run() -> _T:
        begun.set()
        return await coro

    task = asyncio.get_running_loop().create_task(run())
    await begun.wait()
    return task
