"""Names of other processes, for humans: who holds the GPU and who waits. Read-only, via psutil."""

from __future__ import annotations

import time

import psutil

from arbiterd.arena import ArenaState


def process_name(pid: int) -> str | None:
    """The process's name, or None when it is gone or not ours to read."""
    try:
        return psutil.Process(pid).name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def holder_name(state: ArenaState) -> str | None:
    """The holder's own name (holder.json) when fresh, else its process name."""
    if state.holder is not None:
        return state.holder.name
    return None if state.holder_pid is None else process_name(state.holder_pid)


def describe_holder(state: ArenaState) -> str:
    """One line: "held by pid 12 (qwen, model qwen, for 3.2 s)" or "free"."""
    if state.holder_pid is None:
        return "free (about to be taken)"
    details = [holder_name(state) or "unknown"]
    if state.holder is not None:
        if state.holder.model:
            details.append(f"model {state.holder.model}")
        details.append(f"for {max(0.0, time.time() - state.holder.since):.1f} s")
    return f"held by pid {state.holder_pid} ({', '.join(details)})"
