"""records.py: device and arena names, and what a Reading says about a process."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbiterd.daemon.observe.telemetry import (
    ProcessMemory,
    Reading,
    arena_device_name,
    device_for_arena,
    device_index,
)
from tests.daemon.observe.telemetry.support import GiB


def test_devices_are_named_like_their_arenas() -> None:
    assert arena_device_name(0) == "gpu0"
    assert arena_device_name(3) == "gpu3"
    assert device_index("gpu12") == 12
    assert device_index("cpu") is None
    assert device_for_arena(Path("/run/user/1000/arbiterd/arena/gpu1")) == "gpu1"
    assert device_for_arena(Path("/tmp/my-arena")) == "gpu0"
    with pytest.raises(ValueError, match=">= 0"):
        arena_device_name(-1)


def test_a_process_missing_from_a_measured_device_holds_nothing_elsewhere_unknown() -> None:
    reading = Reading(
        processes=(
            ProcessMemory(1, "gpu0", 5 * GiB, "a"),
            ProcessMemory(2, "gpu0", None, "b"),
        ),
        measured=frozenset({"gpu0"}),
    )
    assert reading.process_bytes(1, "gpu0") == 5 * GiB
    assert reading.process_bytes(2, "gpu0") is None  # listed without a figure: unknown, not 0
    assert reading.process_bytes(3, "gpu0") == 0
    assert reading.process_bytes(3, "gpu1") is None  # nobody measures gpu1's processes
    assert reading.process_bytes(1) == 5 * GiB
