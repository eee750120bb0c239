"""Waiting on conditions with a deadline: the tests' replacement for bare sleeps."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.005


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll `condition` until it is truthy; fail the test with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)
