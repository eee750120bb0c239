"""Groups: models that hold the GPU together (issue 14). Owns a group's lock files inside an
arena and both sides of its protocol (specified in docs/arena-protocol.md § Groups):

    groups/NAME/gate.lock   LOCK_EX by the keeper while the group is shut: it does not hold the
                            arena's token for the group, or is about to let go of it;
                            LOCK_SH by each member while it is warm
    groups/NAME/want.lock   LOCK_SH by each member while it waits to become warm
    groups/NAME/leave.lock  LOCK_EX by the keeper from when the group must leave the GPU (an
                            outside waiter, or the keeper stops) until the token is gone
    groups/NAME/members/MEMBER.want.lock
                            LOCK_SH by the member while it waits; it holds the member's
                            footprint (device bytes, decimal text; empty: not known)
    groups/NAME/members/MEMBER.in.lock
                            LOCK_SH by the member while it is warm; it holds the member's
                            use (fitting.Use: the least used leaves first)
    groups/NAME/members/MEMBER.admit.lock
                            LOCK_EX by the keeper while the member may be warm (issue 44); it
                            holds the footprint the member was admitted for (`admitted_text`)

- The **keeper** (`Keeper`, a thread of the daemon) holds the arena's token on the group's
  behalf, as one holder named "group NAME". When a member waits, it queues for the token like
  any waiter, then opens the gate; every member may then be warm at once. It shuts the gate
  again (LOCK_EX: granted only once every member is cold) before it lets the token go: to a
  waiter from outside the group, or because no member is warm or waiting any more.
- A **member** (a worker, through `Gate`) enters the gate (LOCK_SH, granted unless it is
  shut) and stays only if the arena's live holder is its group's keeper: a gate no running
  keeper has shut is open too, and must not let anyone onto the GPU. Its "wanted?" probe is
  LOCK_SH|LOCK_NB on leave.lock: it goes cold by its own policy once the keeper says the group
  must leave, and does not re-enter the gate meanwhile, so the keeper can shut it. Only the
  keeper probes the arena's want.lock: two holders probing it with LOCK_EX|LOCK_NB at the same
  instant would each see the other's probe as a waiter (measured: members went cold for
  nobody), while shared probes never conflict with each other. So members never see each other
  and never hand the GPU to each other.
- **Admission** (issue 44): a member enters only while the keeper holds its admit.lock for the
  footprint it says now, and goes cold once the keeper lets go of it. The keeper admits by
  fitting.plan: every member that waits in a group without a budget (a static group: all are
  warm together); in a fitting set (a group with a budget, the daemon's automatic set of a
  device) those that fit beside the ones admitted, withdrawing the ones used least lately to
  make room, or to fit a budget that shrank (`set_budget`: the daemon follows the device's free
  memory). A member neither waiting nor warm has its admission withdrawn: each warm spell is
  admitted anew. So has one that waits again saying another footprint before the keeper saw it
  leave (a member that retries alone, worker/loop.py): an admission is for the bytes it was
  counted at.

Nobody polls (issue 29): each side sleeps on a doorbell (doorbell.py) armed on the files the
other side opens or closes, and probes the locks when it rings. A member waits to be warm on
gate.lock and leave.lock and, warm, on leave.lock; the keeper on the group's want.lock (a member
waiting), gate.lock being closed (a member leaving the gate) and, while it holds the token, the
arena's bells. A flock call makes no inotify event, so the keeper rings gate.lock and leave.lock
after it changes their locks.

Programs outside arbiterd see the arena protocol unchanged: one holder, one token.
`Gate` and its parts follow arena.Gateway, arena.Place and arena.Hold, so a worker is written
once for both ways to the GPU. Its flock calls are locks.py's, as the token's are.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from arbiterd.arena import fitting
from arbiterd.arena.doorbell import SAFETY_PROBE_S, Bell, Change, Doorbell, ring
from arbiterd.arena.locks import (
    CANCEL_POLL_S,
    EXCLUSIVE,
    SHARED,
    contended,
    lock,
    try_flock,
    unlock,
)
from arbiterd.arena.records import ArenaState, PassedOver
from arbiterd.arena.token import Arena
from arbiterd.config import GROUP_NAME_EXPECTED, GROUP_NAME_RE
from arbiterd.errors import (
    AcquireCancelledError,
    ArenaError,
    BadValueError,
    InvalidTransitionError,
)
from arbiterd.states import Priority

log = logging.getLogger(__name__)

GROUPS_DIR = "groups"
GATE_FILE = "gate.lock"
GROUP_WANT_FILE = "want.lock"
LEAVE_FILE = "leave.lock"
MEMBERS_DIR = "members"
# A member's own lock files, MEMBER + each suffix.
WANT = ".want.lock"
IN = ".in.lock"
ADMIT = ".admit.lock"
# The most a want lock's footprint text may be: a decimal byte count.
FOOTPRINT_MAX_BYTES = 32


class GateState(enum.Enum):
    """A group's gate, as its keeper's thread moves it (`Keeper._move`, GATE_TRANSITIONS):

        shut ──► open ──► leaving ──► shut    an outside waiter: the token is handed over
                  │  └──► stopping ──► shut   the keeper stops: the token is released
                  └──► shut                   no member warm or waiting: the token is released

    The keeper's own: members see the gate only by its locks (the module's docstring)."""

    SHUT = "shut"  # no token for the group: gate.lock LOCK_EX, nobody warm
    OPEN = "open"  # the keeper holds the arena's token: admitted members may be warm
    # leave.lock held (members go cold, none enters); the gate shuts once every member is cold.
    LEAVING = "leaving"  # for an outside waiter
    STOPPING = "stopping"  # for the keeper's stop


GATE_TRANSITIONS: dict[GateState, frozenset[GateState]] = {
    GateState.SHUT: frozenset({GateState.OPEN}),
    GateState.OPEN: frozenset({GateState.SHUT, GateState.LEAVING, GateState.STOPPING}),
    GateState.LEAVING: frozenset({GateState.SHUT}),
    GateState.STOPPING: frozenset({GateState.SHUT}),
}


def group_dir(arena: Arena, group: str) -> Path:
    """Where a group's lock files live, inside its arena."""
    if not GROUP_NAME_RE.fullmatch(group):
        raise BadValueError(f"group name {group!r}: expected {GROUP_NAME_EXPECTED}")
    return arena.path / GROUPS_DIR / group


def said_text(footprint: int | None) -> bytes:
    """A footprint as a member says it in its want lock: decimal bytes, empty when unknown."""
    return b"" if footprint is None else str(footprint).encode()


def admitted_text(footprint: int | None) -> bytes:
    """The footprint an admission is for, as the keeper writes it into the admit lock: the
    member's `said_text`, of one width always (written over the last in place, never cut short
    first: a member reading between a truncate and the write would read an unknown footprint)."""
    return said_text(footprint).rjust(FOOTPRINT_MAX_BYTES)


def keeper_name(group: str) -> str:
    """The name a group's keeper holds the arena's token by (holder.json's)."""
    return f"group {group}"


class _Files:
    """A group's lock files, created once and never unlinked (as the arena's own)."""

    def __init__(self, arena: Arena, group: str) -> None:
        self.arena = arena
        self.group = group
        path = group_dir(arena, group)
        arena.ensure_dir(path.parent)
        arena.ensure_dir(path)
        self.members_path = path / MEMBERS_DIR
        arena.ensure_dir(self.members_path)
        self.gate_path = path / GATE_FILE
        self.want_path = path / GROUP_WANT_FILE
        self.leave_path = path / LEAVE_FILE
        for lock_path in (self.gate_path, self.want_path, self.leave_path):
            os.close(arena.open_lock(lock_path, create=True))

    @property
    def holder_name(self) -> str:
        return keeper_name(self.group)

    def keeper_holds_token(self) -> bool:
        holder = self.arena.observe().holder  # only when it names the token's live owner
        return holder is not None and holder.name == self.holder_name

    def member_path(self, member: str, kind: str) -> Path:
        """A member's lock file of `kind` (WANT, IN or ADMIT)."""
        if not member or "/" in member or member.startswith("."):
            raise BadValueError(f"member name {member!r}: a model name")
        return self.members_path / f"{member}{kind}"

    def members(self) -> list[str]:
        """The members that ever waited, by their want lock files."""
        try:
            names = os.listdir(self.members_path)
        except FileNotFoundError:
            return []
        return sorted(n.removesuffix(WANT) for n in names if n.endswith(WANT))


class Gate:
    """A member's way to the GPU: through its group's gate instead of the arena's token.
    `footprint()` says the device bytes the member holds warm (None: not known yet), for the
    keeper of a fitting set to count; asked each time it queues."""

    def __init__(
        self,
        arena: Arena,
        group: str,
        member: str,
        footprint: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._files = _Files(arena, group)
        self.arena = arena
        self.member = member
        self._footprint = footprint
        self.use = fitting.Use()  # kept across warm spells; each hold adds its requests
        for kind in (WANT, IN, ADMIT):
            os.close(arena.open_lock(self._files.member_path(member, kind), create=True))

    def queue(self, priority: Priority) -> GateTicket:
        """A place among the group's waiters (the keeper queues in the arena for all of them:
        `priority` does not change its class, the group's configured one)."""
        del priority
        return GateTicket(self, self._footprint())

    def observe(self) -> ArenaState:
        """The arena as a member sees it: its own keeper holding the token is the group's
        GPU, nobody to wait for (so a warm-up through an open gate is no handoff)."""
        state = self.arena.observe()
        if state.holder is not None and state.holder.name == self._files.holder_name:
            return dataclasses.replace(state, holder_pid=None, holder=None)
        return state

    def first_class_waiting(self) -> int | None:
        """The class of the first waiter in the arena's queue: all of them are outside the
        group (members wait at the gate), so a higher one may preempt a member."""
        return self.arena.first_class_waiting()


class GateTicket:
    """A member waiting to be warm: holds its own want lock (which says its footprint) and the
    group's want.lock shared until it leaves."""

    def __init__(self, gate: Gate, footprint: int | None) -> None:
        files = self._files = gate._files
        self._gate = gate
        self._member = member = gate.member
        fds: list[int] = []
        try:
            own = files.arena.open_lock(files.member_path(member, WANT))
            fds.append(own)
            os.ftruncate(own, 0)
            os.pwrite(own, said_text(footprint), 0)  # before the lock: the keeper reads it then
            lock(own, SHARED)
            group = files.arena.open_lock(files.want_path)
            fds.append(group)
            lock(group, SHARED)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._want_fds: tuple[int, ...] | None = tuple(fds)
        self._admitted_text = admitted_text(footprint)  # what its admission must be for

    def take(
        self,
        name: str,
        *,
        model: str | None = None,
        cancel: threading.Event | None = None,
        on_wait: Callable[[ArenaState], None] | None = None,
    ) -> GateHold:
        """Wait for the gate to be open with the group not leaving and this member admitted for
        the footprint it says, and enter it (LOCK_SH). Raises AcquireCancelledError when
        `cancel` is set; the ticket stays."""
        del name, model  # the keeper is the arena's holder; members are named by the daemon
        if self._want_fds is None:
            raise ArenaError("take() on a ticket that left")
        files = self._files
        admit_path = files.member_path(self._member, ADMIT)
        before = files.arena.observe() if on_wait is not None else None
        if before is not None and before.holder and before.holder.name == files.holder_name:
            # The group has the GPU: waiting to be admitted is no wait for another holder.
            before = on_wait = None
        fds = {
            "gate": files.arena.open_lock(files.gate_path),
            "leave": files.arena.open_lock(files.leave_path),
            "admit": files.arena.open_lock(admit_path),
            "in": files.arena.open_lock(files.member_path(self._member, IN)),
        }
        doorbell = Doorbell()
        try:
            # The keeper rings each after it changes its lock; armed before the first look.
            doorbell.arm(
                (
                    Bell(files.gate_path, Change.OPENED),
                    Bell(files.leave_path, Change.OPENED),
                    Bell(admit_path, Change.OPENED),
                )
            )
            # How long a sleep may last: a cancel is an Event, which no doorbell hears.
            nap_s = SAFETY_PROBE_S if cancel is None else CANCEL_POLL_S
            while True:
                if (
                    not contended(fds["leave"], SHARED)
                    # For what it says now: an admission for another footprint, one it had
                    # before the keeper saw it leave, is not its own. The text first: the
                    # keeper writes it before it locks, and never while it holds the lock.
                    and os.pread(fds["admit"], FOOTPRINT_MAX_BYTES, 0) == self._admitted_text
                    and contended(fds["admit"], SHARED)  # the keeper holds it: admitted
                    and try_flock(fds["gate"], SHARED)
                ):
                    # Open means "not shut": a gate no keeper has shut yet (or any more) is
                    # open too. Inside it, the token must be the keeper's: it cannot go while
                    # we are in (the keeper shuts the gate first).
                    if files.keeper_holds_token():
                        lock(fds["in"], SHARED)  # warm before it stops waiting: never neither
                        hold = GateHold(self._gate, fds, files.leave_path, admit_path)
                        fds = {}  # the hold owns them now
                        self.leave()
                        return hold
                    unlock(fds["gate"])
                if on_wait is not None and before is not None:
                    on_wait(before)
                    on_wait = None
                doorbell.wait(nap_s)
                if cancel is not None and cancel.is_set():
                    raise AcquireCancelledError("gave up waiting for the group's gate")
        finally:
            doorbell.close()
            for fd in fds.values():
                os.close(fd)

    def leave(self) -> None:
        """Stop waiting. Idempotent."""
        fds, self._want_fds = self._want_fds, None
        for fd in fds or ():
            os.close(fd)


class GateHold:
    """A warm member's place inside the open gate (LOCK_SH on gate.lock and its in.lock)."""

    def __init__(self, gate: Gate, fds: dict[str, int], leave_path: Path, admit_path: Path) -> None:
        self._gate = gate
        self._fds: dict[str, int] | None = fds  # gate, leave, admit, in
        self._leave_path = leave_path
        self._admit_path = admit_path
        # A member waits at its gate, in no queue: it passes nobody over (its keeper may).
        self.passed_over: tuple[PassedOver, ...] = ()

    def wanted(self) -> bool:
        """True when the member must leave the GPU: someone outside the group waits, or its
        keeper stops (leave.lock), or the keeper withdrew its admission to make room for
        another member (admit.lock let go)."""
        if self._fds is None:
            raise ArenaError("wanted() on a released gate hold")
        return contended(self._fds["leave"], SHARED) or not contended(self._fds["admit"], SHARED)

    def bells(self) -> tuple[Bell, ...]:
        """The keeper rings leave.lock and admit.lock once it has changed them."""
        return (Bell(self._leave_path, Change.OPENED), Bell(self._admit_path, Change.OPENED))

    def used(self) -> None:
        """A request begins: the member's use, in its in.lock, says so to the keeper (the least
        used leaves first)."""
        if self._fds is None:
            return
        gate = self._gate
        gate.use = gate.use.began(time.time())
        os.pwrite(self._fds["in"], gate.use.to_text(), 0)

    def hand_over(self) -> None:
        """Leave the gate; the keeper hands the token over once every member has."""
        self.release()

    def release(self) -> None:
        """Leave the gate. Idempotent."""
        fds, self._fds = self._fds, None
        if fds is None:
            return
        # in.lock before gate.lock: the keeper, woken by the gate's close, sees it cold.
        for key in ("in", "admit", "leave", "gate"):
            os.close(fds[key])  # closing drops our locks


class Keeper:
    """Holds the arena's token for one group while its members want the GPU, and admits them
    (fitting.plan: `budget` None admits every member that waits; a budget, those that fit);
    a daemon thread.

    `on_change(holding)` is called from the thread when it takes or lets go of the token."""

    def __init__(
        self,
        arena: Arena,
        group: str,
        *,
        priority: Priority = Priority.NORMAL,
        budget: int | None = None,
        on_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._files = _Files(arena, group)
        self.arena = arena
        self.group = group
        self.priority = priority
        self.budget = budget
        self.tolerance = 0  # bytes the admitted may hold past the budget (fitting.plan)
        self._on_change = on_change
        # The thread's own: each admitted member's admit.lock descriptor (held LOCK_EX) and the
        # footprint it was admitted for; when each waiting member was first seen waiting.
        self._admitted: dict[str, tuple[int, int | None]] = {}
        self._waiting_since: dict[str, float] = {}
        self.withdrawals = 0  # admissions withdrawn to make room
        self._over: set[str] = set()  # members said to be larger than the budget
        self._stop = threading.Event()
        self._doorbell: Doorbell | None = None  # the thread's, made by start(); stop() wakes it
        self._gate = GateState.SHUT  # written by the thread alone (_move); read by any
        self.handoffs = 0  # how often it let the token go to an outside waiter
        self.failure = ""  # why its thread ended early; "" while it runs or stopped cleanly
        self._thread = threading.Thread(target=self._run, name=f"group-{group}", daemon=True)

    @property
    def gate(self) -> GateState:
        return self._gate

    @property
    def holding(self) -> bool:
        """Whether it holds the arena's token for the group now."""
        return self._gate is not GateState.SHUT

    def set_budget(self, budget: int, tolerance: int = 0) -> None:
        """A fitting set's new budget (its device's room changed), applied at once: members
        that no longer fit it, with `tolerance` bytes to spare, leave, the least used first;
        waiters that now fit come in. From any thread."""
        if (budget, tolerance) == (self.budget, self.tolerance):
            return
        self.budget, self.tolerance = budget, tolerance
        if self._doorbell is not None:
            self._doorbell.wake()

    def start(self) -> None:
        self._doorbell = Doorbell()
        self._thread.start()

    def stop(self) -> None:
        """Let go of the token once every member is cold, and end the thread. Blocks until
        then: members still warm are told to leave and go cold by their policy."""
        self._stop.set()
        if self._doorbell is not None:
            self._doorbell.wake()
        self._thread.join()

    def _run(self) -> None:
        files = self._files
        gate_fd = files.arena.open_lock(files.gate_path)
        waiters_fd = files.arena.open_lock(files.want_path)
        leave_fd = files.arena.open_lock(files.leave_path)
        doorbell = self._doorbell
        assert doorbell is not None  # made by start()
        try:
            # A member waiting opens want.lock, and one leaving the gate closes gate.lock.
            doorbell.arm(
                (
                    Bell(files.want_path, Change.OPENED),
                    Bell(files.gate_path, Change.CLOSED),
                    *self.arena.bells(),
                )
            )
            # Shut while we hold no token. A member of an earlier daemon may still be leaving.
            lock(gate_fd, EXCLUSIVE)
            while not self._stop.is_set():
                if not contended(waiters_fd, EXCLUSIVE):
                    # Members open want.lock anew for each wait: no safety probe needed.
                    doorbell.wait(None)
                    continue
                try:
                    token = self.arena.acquire(
                        files.holder_name, priority=self.priority, cancel=self._stop
                    )
                except AcquireCancelledError:
                    break
                self._move(GateState.SHUT, GateState.OPEN)
                try:
                    self._hold(gate_fd, waiters_fd, leave_fd, token.wanted)
                finally:
                    left = self._gate
                    self._move(left, GateState.SHUT)
                    if left is GateState.LEAVING:
                        self.handoffs += 1
                        token.hand_over()
                    else:
                        token.release()
                    unlock(leave_fd)  # the next holding starts fresh
        except Exception as exc:  # a thread's end: said in status, not lost in a traceback
            log.exception("group %s: its keeper stopped", self.group)
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            doorbell.close()
            os.close(leave_fd)
            os.close(waiters_fd)
            os.close(gate_fd)

    def _hold(
        self, gate_fd: int, waiters_fd: int, leave_fd: int, outside_waits: Callable[[], bool]
    ) -> None:
        """Open the gate and keep it open while the group may use the GPU; return with it shut
        (every member cold), the state saying why: still OPEN (nobody wants it any more),
        LEAVING (an outside waiter) or STOPPING. From the moment it must leave, leave.lock says
        so to the members (the caller unlocks it)."""
        files, doorbell = self._files, self._doorbell
        assert doorbell is not None  # made by start()
        unlock(gate_fd)
        ring(files.gate_path)  # members waiting for the gate look now
        try:
            while True:
                nap_s = SAFETY_PROBE_S
                if self._gate is GateState.OPEN:
                    if outside_waits():
                        self._leave(GateState.LEAVING, leave_fd)
                    elif self._stop.is_set():
                        self._leave(GateState.STOPPING, leave_fd)
                    else:
                        self._admit(time.monotonic())
                        if contended(waiters_fd, EXCLUSIVE):
                            # A member waits to come in: nothing to shut until it has left.
                            doorbell.wait(nap_s)
                            continue
                if try_flock(gate_fd, EXCLUSIVE):  # fails while a member is warm
                    if self._gate is not GateState.OPEN or not contended(waiters_fd, EXCLUSIVE):
                        return
                    unlock(gate_fd)  # one came as we shut: open again
                    ring(files.gate_path)
                # Until an outside waiter or a member leaving the gate rings; the safety probe
                # is for outside programs that keep the arena's want.lock open across their
                # waits.
                doorbell.wait(nap_s)
        finally:
            self._withdraw(list(self._admitted))  # the next holding admits anew

    def _leave(self, why: GateState, leave_fd: int) -> None:
        """open → `why` (LEAVING or STOPPING): leave.lock tells the members to go cold."""
        self._move(GateState.OPEN, why)
        lock(leave_fd, EXCLUSIVE)  # blocks only for a member's probe (microseconds)
        ring(self._files.leave_path)  # warm members go cold now

    def _admit(self, now: float) -> None:
        """Look at every member and apply fitting.plan: admit (lock each one's admit.lock) and
        withdraw (let go of it), ringing each admit.lock changed."""
        files = self._files
        seen: list[fitting.Member] = []
        for name in files.members():
            waiting, warm, footprint, use = self._look_at(name)
            if self.budget and footprint and footprint > self.budget and name not in self._over:
                self._over.add(name)
                log.warning(
                    "group %s: %s takes %d bytes, more than the budget of %d: it is warm alone",
                    self.group,
                    name,
                    footprint,
                    self.budget,
                )
            if waiting:
                self._waiting_since.setdefault(name, now)
            else:
                self._waiting_since.pop(name, None)
            seen.append(
                fitting.Member(
                    name=name,
                    footprint=footprint,
                    warm=warm,
                    waiting=waiting,
                    admitted=name in self._admitted,
                    waiting_since=self._waiting_since.get(name, now),
                    use=use,
                )
            )
        # Each warm spell is admitted anew: a member neither waiting nor warm is done, and one
        # that waits again saying another footprint (it left and came back before we looked)
        # is planned for what it says now.
        self._withdraw(
            [
                m.name
                for m in seen
                if m.admitted
                and not m.warm
                and (not m.waiting or m.footprint != self._admitted[m.name][1])
            ]
        )
        live = [dataclasses.replace(m, admitted=m.name in self._admitted) for m in seen]
        plan = fitting.plan(self.budget, live, time.time(), tolerance=self.tolerance)
        if plan.withdraw:
            self.withdrawals += len(plan.withdraw)
            log.info(
                "group %s: making room, %s to leave", self.group, ", ".join(sorted(plan.withdraw))
            )
        self._withdraw(sorted(plan.withdraw))
        said = {m.name: m.footprint for m in live}
        for name in sorted(plan.admit):
            path = files.member_path(name, ADMIT)
            fd = files.arena.open_lock(path, create=True)
            os.pwrite(fd, admitted_text(said[name]), 0)  # before the lock, as the member reads
            lock(fd, EXCLUSIVE)  # only the keeper takes it so: a member's probe, microseconds
            self._admitted[name] = (fd, said[name])
            ring(path)

    def look(self) -> list[tuple[str, bool, int | None]]:
        """Each member now, for status: its name, whether it is warm, and the footprint it
        says. From any thread: it only probes, on descriptors of its own."""
        return [(name, *self._look_at(name)[1:3]) for name in self._files.members()]

    def _look_at(self, name: str) -> tuple[bool, bool, int | None, fitting.Use]:
        """Whether a member waits, whether it is warm, the footprint it says, and its use
        (GateHold.used)."""
        files = self._files
        want_fd = files.arena.open_lock(files.member_path(name, WANT), create=True)
        in_fd = files.arena.open_lock(files.member_path(name, IN), create=True)
        try:
            waiting = contended(want_fd, EXCLUSIVE)
            warm = contended(in_fd, EXCLUSIVE)
            # Written as it last queued: what it holds while warm too.
            text = os.pread(want_fd, FOOTPRINT_MAX_BYTES, 0)
            use = fitting.Use.from_text(os.pread(in_fd, fitting.USE_TEXT_MAX_BYTES, 0))
        finally:
            os.close(in_fd)
            os.close(want_fd)
        footprint = int(text) if text.isdigit() else None
        return waiting, warm, footprint, use

    def _withdraw(self, names: list[str]) -> None:
        for name in names:
            entry = self._admitted.pop(name, None)
            if entry is not None:
                os.close(entry[0])  # drops the LOCK_EX: the member goes cold
                ring(self._files.member_path(name, ADMIT))

    def _move(self, expected: GateState, new: GateState) -> None:
        """The gate from `expected` to `new`: the one place its state changes, from the thread.
        Raises InvalidTransitionError for a move GATE_TRANSITIONS does not list; tells
        `on_change` when the group takes or lets go of the token."""
        if self._gate is not expected or new not in GATE_TRANSITIONS[expected]:
            raise InvalidTransitionError(
                f"group {self.group}: gate {self._gate.value}, not {expected.value} → {new.value}"
            )
        holding = self.holding
        self._gate = new
        if self._on_change is not None and self.holding != holding:
            self._on_change(self.group, self.holding)
