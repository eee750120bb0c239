"""The arena's records and interfaces: a waiter's ticket (and the label in it), the
holder as holder.json names it, a snapshot of an arena, and the three protocols a worker's way
to the GPU implements (the arena itself, or a group's gate). Pure data: no file, no lock.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from arbiterd.arena.doorbell import Bell
from arbiterd.states import PassOverReason, Priority

TICKET_SUFFIX = ".ticket"
# A ticket stands in line as if it had come this much later for each class below interactive:
# a batch job is behind only the interactive requests that come within two of these after it.
# Every process of an arena must use the same value, or they disagree on the order.
PRIORITY_AGING_S = 30.0


@dataclass(frozen=True)
class QueuedWaiter:
    """A live ticket in an arena's queue."""

    pid: int
    priority: Priority
    since_ns: int  # CLOCK_MONOTONIC when it queued (one clock for every process of a boot)
    file: str  # the ticket's file name, unique
    # Who waits, as its ticket's content names it (TicketLabel; None: it does not say).
    name: str | None = None
    model: str | None = None

    @property
    def place_ns(self) -> int:
        """Where it stands in line: its arrival, put back one aging period for each class below
        interactive. Aging is built in: a batch ticket that has waited two periods is ahead of
        every ticket that comes after, whatever its class."""
        return self.since_ns + self.priority.rank * round(PRIORITY_AGING_S * 1e9)

    @property
    def order(self) -> tuple[int, str]:
        """Its place in the queue, then its unique name. Fixed when it queues: two tickets never
        change places while they wait (arbiterd/arena/__init__.py says why that matters)."""
        return (self.place_ns, self.file)

    def competes_as(self, now_ns: int) -> Priority:
        """The class it has aged to by `now_ns`, one up per aging period waited: the highest
        class whose newcomers now queue behind it."""
        aged = int(self.waited_s(now_ns) // PRIORITY_AGING_S)
        return list(Priority)[max(0, self.priority.rank - aged)]

    @classmethod
    def from_file_name(cls, name: str) -> QueuedWaiter | None:
        """The waiter a ticket file names; None for a name that is not a ticket's."""
        parts = name.removesuffix(TICKET_SUFFIX).split(".")
        if not name.endswith(TICKET_SUFFIX) or len(parts) != 4:
            return None
        priority, since, pid, _thread = parts
        if priority not in {p.value for p in Priority} or not (since + pid).isdigit():
            return None
        return cls(int(pid), Priority(priority), int(since), name)

    def waited_s(self, now_ns: int) -> float:
        return max(0, now_ns - self.since_ns) / 1e9

    def labelled(self, raw: bytes) -> QueuedWaiter:
        """This waiter named by its ticket's content `raw` (TicketLabel's), when that names it."""
        label = TicketLabel.from_json(raw)
        if label is None or label.pid != self.pid:
            return self
        return dataclasses.replace(self, name=label.name, model=label.model)

    def to_json(self, now_ns: int) -> dict[str, object]:
        return {
            "pid": self.pid,
            "priority": self.priority.value,
            "ticket": self.since_ns,
            "competes_as": self.competes_as(now_ns).value,
            "waited_s": round(self.waited_s(now_ns), 3),
            "model": self.model,
        }


@dataclass(frozen=True)
class PassedOver:
    """A waiter ahead of us in the queue that we took the token before: it keeps its ticket
    and its place (arbiterd/arena/token.py says why), and is first again once it can take."""

    arena: Path
    waiter: QueuedWaiter
    reason: PassOverReason
    free_s: float  # how long the token was seen free while the waiter stood ahead (0: stopped)

    @property
    def text(self) -> str:
        """How a log line or `arbiterd run` says it."""
        if self.reason is PassOverReason.STOPPED:
            why = "its process is stopped"
        else:
            why = f"it left the free GPU untaken for {self.free_s:.1f} s"
        return f"passed over pid {self.waiter.pid}, ahead in the queue: {why}"


@dataclass(frozen=True)
class TicketLabel:
    """What a ticket's file holds: who waits, as holder.json names the holder (issue 40: a
    waiting worker was shown as "python (pid N)"). Informational, like holder.json: the order
    and liveness of a ticket are its name and its lock, and a ticket with no label (another
    program's, or one read while it is written) is named by its process."""

    pid: int
    name: str
    model: str | None

    def to_json(self) -> bytes:
        return json.dumps({"pid": self.pid, "name": self.name, "model": self.model}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> TicketLabel | None:
        """The label in `raw`; None for an empty or malformed one."""
        named = _named_process(raw)
        if named is None:
            return None
        pid, name, model, _ = named
        return cls(pid, name, model)


@dataclass(frozen=True)
class HolderInfo:
    """What holder.json says about the holder."""

    pid: int  # the process that locked token.lock
    name: str
    model: str | None
    since: float  # seconds since the epoch
    # A command the holder runs on its token (`arbiterd run`'s CMD). It inherited the locked
    # open file description, so it keeps the token should the holder die first.
    command_pid: int | None = None

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "pid": self.pid,
            "name": self.name,
            "model": self.model,
            "since": self.since,
        }
        if self.command_pid is not None:
            data["command_pid"] = self.command_pid
        return data

    @classmethod
    def from_json(cls, raw: bytes) -> HolderInfo | None:
        """Parse holder.json; an empty (released) or malformed file means "no information"."""
        named = _named_process(raw)
        if named is None:
            return None
        pid, name, model, data = named
        since, command_pid = data.get("since"), data.get("command_pid")
        if not isinstance(since, int | float):
            return None
        return cls(
            pid, name, model, float(since), command_pid if isinstance(command_pid, int) else None
        )


def _named_process(raw: bytes) -> tuple[int, str, str | None, dict[str, object]] | None:
    """The `pid`, `name` and `model` (None unless a string) that holder.json and a ticket's
    label both hold, and the whole object for the rest; None when `raw` is empty (released),
    not a JSON object, or lacks an int pid and a string name. Both files are informational:
    a malformed one is no information, never an error."""
    try:
        data = json.loads(raw) if raw.strip() else None
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    pid, name, model = (data.get(k) for k in ("pid", "name", "model"))
    if not isinstance(pid, int) or not isinstance(name, str):
        return None
    return pid, name, model if isinstance(model, str) else None, data


@dataclass(frozen=True)
class ArenaState:
    """A snapshot of an arena, read without touching its locks."""

    path: Path
    holder_pid: int | None  # the owner of token.lock, from /proc/locks (see observe())
    holder: HolderInfo | None  # holder.json, only when it names the live owner
    stale_holder: HolderInfo | None  # holder.json naming a pid that does not hold the token
    waiter_pids: tuple[int, ...]  # pids holding (or queued for) LOCK_SH on want.lock
    observed_ns: int  # CLOCK_MONOTONIC when read: how long the queue has waited, and aged
    queue: tuple[QueuedWaiter, ...] = ()  # the live tickets, first to be served first
    # pids of queued waiters whose process is stopped: every waiter behind passes them over
    stopped_pids: frozenset[int] = frozenset()


class Hold(Protocol):
    """The GPU held: the arena's token (`Token`), or a place inside a group's open gate."""

    def wanted(self) -> bool: ...  # someone the holder must yield to waits

    # What rings when wanted() may have become true (doorbell.py): a holder sleeps on them.
    def bells(self) -> tuple[Bell, ...]: ...

    def hand_over(self) -> None: ...  # let go to the waiters

    # A request begins on the GPU: a fitting set's keeper makes the member used least lately
    # leave first (groups.py); nothing for the arena's token.
    def used(self) -> None: ...

    @property
    def passed_over(self) -> tuple[PassedOver, ...]: ...  # whom the take went before

    def release(self) -> None: ...


class Place(Protocol):
    """A waiter's place in line (`Ticket`), kept across tries that a cancel interrupts."""

    def take(
        self,
        name: str,
        *,
        model: str | None = None,
        cancel: threading.Event | None = None,
        on_wait: Callable[[ArenaState], None] | None = None,
    ) -> Hold: ...

    def leave(self) -> None: ...


class Gateway(Protocol):
    """A way to the GPU, as a worker sees it: the arena itself, or a group's gate
    (groups.Gate)."""

    def queue(self, priority: Priority) -> Place: ...

    def observe(self) -> ArenaState: ...

    def first_class_waiting(self) -> int | None: ...
