"""A process's peak resident memory, as the kernel counts it: VmHWM in /proc/PID/status, and
clear_refs to start counting afresh (proc(5): writing 5 resets the peak to the current RSS)."""

from __future__ import annotations

from pathlib import Path


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_bytes(pid: int) -> int:
    """The most resident memory `pid` has had since it started or its peak was last reset."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # in kB
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")
