"""Names of other processes, for humans: who holds the GPU and who waits. Read-only, via psutil.

A wait for the GPU is said in the same words wherever it is shown (issue 30): the daemon's
notices to HTTP clients and its CLI commands (daemon/models/waiting.py), and `arbiterd run`:

    waiting for the GPU, held by game (arbiterd run, pid 4242), 2nd in queue
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil

from arbiterd.arena import ArenaState
from arbiterd.status import STEP_ASIDE_SUFFIX


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


def waiter_name(state: ArenaState, pid: int) -> str | None:
    """A waiter's own name (its ticket's label: a worker's is its model's) when its ticket has
    one, else its process name."""
    label = next((w.name for w in state.queue if w.pid == pid and w.name is not None), None)
    return label if label is not None else process_name(pid)


@dataclass(frozen=True)
class WaitNews:
    """One look at a wait: the holder as a person would name it, its pid (None: the token is
    between two holders), the waiter's place in the queue (1: next; None: it has no ticket of
    its own, e.g. a group's member waits at its group's gate), and how many tickets there are."""

    holder: str
    holder_pid: int | None
    place: int | None
    queued: int
    # waiters ahead whose process is stopped: they are passed over (issue 40 item 1)
    stopped_ahead: tuple[int, ...] = ()

    @property
    def text(self) -> str:
        where = "" if self.place is None else f", {ordinal(self.place)} in queue"
        if self.stopped_ahead:
            pids = ", ".join(str(pid) for pid in self.stopped_ahead)
            where += f" (passing over stopped pid {pids} ahead)"
        return f"waiting for the GPU, held by {self.holder}{where}"

    def to_json(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "holder_pid": self.holder_pid,
            "place": self.place,
            "queued": self.queued,
            "stopped_ahead": list(self.stopped_ahead),
            "text": self.text,
        }


def news_for(state: ArenaState, pid: int) -> WaitNews:
    """The wait of process `pid` (its ticket, if it has one) as `state` shows it."""
    place = next((i for i, waiter in enumerate(state.queue, 1) if waiter.pid == pid), None)
    ahead = state.queue[: place - 1] if place is not None else ()
    return WaitNews(
        holder=holder_label(state),
        holder_pid=state.holder_pid,
        place=place,
        queued=len(state.queue),
        stopped_ahead=tuple(w.pid for w in ahead if w.pid in state.stopped_pids),
    )


def holder_label(state: ArenaState) -> str:
    """The holder as a person names it: `game (arbiterd run, pid 4242)` for `arbiterd run`
    running its command, `gemma (pid 77)` for another holder that names itself in holder.json,
    the process name for one that does not (a program that took the lock with flock(1)); the
    pid is the token's live owner's."""
    pid = state.holder_pid
    if pid is None:
        return "nobody for the moment (it is being handed over)"
    info = state.holder
    if info is None:
        return f"{process_name(pid) or 'a process'} (pid {pid})"
    if info.name.endswith(STEP_ASIDE_SUFFIX):
        return info.name  # names the program the daemon holds it for, and its pid
    runs = "arbiterd run, " if info.command_pid is not None else ""
    return f"{info.name} ({runs}pid {pid})"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
