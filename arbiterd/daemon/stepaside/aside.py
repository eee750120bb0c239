"""The step aside in force, on the daemon's loop: what the lookout saw goes through the pure
policy (policy.py), and a change is acted on here: the daemon's hold taken on the program's
behalf (every model releases in place and stays cold), an event for the journal, the tray and
`arbiterd events`, and the hold given back when it ends.

Owns `aside` (the step aside in force, or None) and the programs resumed past. The program's
exit is seen at once through a pidfd (pidfd_open(2)) read by the loop, not at the next look.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from arbiterd.arena import Arena
from arbiterd.config import YieldRules
from arbiterd.daemon.stepaside.hold import DaemonHold
from arbiterd.daemon.stepaside.lookout import Lookout, Measure
from arbiterd.daemon.stepaside.policy import Aside, Sighting, asked, next_aside
from arbiterd.daemon.stepaside.programs import DEV, PROCFS, Program, descendants, read_program
from arbiterd.errors import ArbiterError, ControlError
from arbiterd.events import Event, StepAsideEvent
from arbiterd.render import format_bytes
from arbiterd.status import STEP_ASIDE_SUFFIX, SteppedAside

log = logging.getLogger(__name__)

HOLD_REASON = "aside"


def hold_label(aside: Aside) -> str:
    """The holder's name in holder.json while the daemon holds the GPU for `aside`'s program."""
    return f"{aside.name} (pid {aside.pid}{STEP_ASIDE_SUFFIX}"


class StepAside:
    def __init__(
        self,
        rules: YieldRules,
        hold: DaemonHold,
        publish: Callable[[Event], object],
        measure: Measure,
        *,
        measured_by: str = "",
        arena: Arena | None = None,
        dev: Path = DEV,
        procfs: Path = PROCFS,
    ) -> None:
        self.rules = rules
        self._measured_by = measured_by  # the readers of other programs' memory; "": none
        self._hold = hold
        self._publish = publish
        self._measure = measure
        self._arena = arena  # gpu0's: a program that holds its token takes part
        self._dev = dev
        self._procfs = procfs
        self.lookout = self._new_lookout()
        self.aside: Aside | None = None
        self._passed: set[tuple[int, int]] = set()  # resumed past: not again until they exit
        self._exit_fd: int | None = None
        self._taking: asyncio.Task[None] | None = None

    def _new_lookout(self) -> Lookout:
        return Lookout(
            self._on_look,
            measure=self._measure,
            scan_s=self.rules.scan_s,
            by_name=bool(self.rules.programs),
            dev=self._dev,
            procfs=self._procfs,
            nodes=self.rules.nodes or None,
        )

    def start(self) -> None:
        if self.rules.enabled:
            self.lookout.start()

    async def apply(self, rules: YieldRules) -> None:
        """A reload's [yield]: the next look applies it; the lookout starts again when what it
        watches or how often it looks changed. A step aside in force goes on: its program
        still runs (`arbiterd resume` ends it)."""
        if rules == self.rules:
            return
        old, self.rules = self.rules, rules
        if (old.enabled, old.scan_s, bool(old.programs), old.nodes) != (
            rules.enabled,
            rules.scan_s,
            bool(rules.programs),
            rules.nodes,
        ):
            await self.lookout.close()
            self.lookout = self._new_lookout()
            self.start()
        elif rules.enabled:
            self.lookout.look(whole=True)
        log.info("[yield] changed: %s", self.describe())

    async def close(self) -> None:
        await self.lookout.close()
        self._watch_exit(None)
        if self._taking is not None:
            self._taking.cancel()
            await asyncio.gather(self._taking, return_exceptions=True)

    def describe(self) -> str:
        if not self.rules.enabled:
            return "off ([yield] enabled = false)"
        nodes = ", ".join(str(n) for n in self.lookout.nodes) or "no GPU device nodes"
        how = "inotify" if self.lookout.watching else f"a look every {self.rules.scan_s:g} s"
        memory = (
            f"memory by {self._measured_by}"
            if self._measured_by
            else "names only: no reader measures other programs' memory here"
        )
        return f"watching {nodes} ({how}); {memory}"

    def status(self) -> SteppedAside | None:
        aside = self.aside
        if aside is None:
            return None
        return SteppedAside(
            program=aside.name,
            pid=aside.pid,
            reason=aside.reason,
            since=aside.since,
            used_bytes=aside.used_bytes,
        )

    # -- commands -----------------------------------------------------------------------------

    async def yield_to(self, pid: int) -> dict[str, object]:
        """`arbiterd yield --until-exit PID`: step aside for that program until it exits."""
        program = await asyncio.to_thread(self._program, pid)
        if program is None:
            raise ControlError(f"no process {pid} of yours is running")
        if self.aside is None or self.aside.key != program.key:
            self._passed.discard(program.key)
            why = f"arbiterd yield asked for {program.name} (pid {program.pid})"
            self._become(asked(program, time.time()), why=why)
        await self._held()
        return {"stepped_aside": self.status_json()}

    def resume(self) -> dict[str, object]:
        """`arbiterd resume`: end the step aside in force; its program is passed over until it
        exits."""
        aside = self.aside
        if aside is not None:
            self._passed.add(aside.key)
            self._become(None, why="resumed by the user")
        return {"stepped_aside": None, "resumed": aside is not None}

    def status_json(self) -> dict[str, object] | None:
        status = self.status()
        return None if status is None else status.to_json()

    # -- what the lookout saw -------------------------------------------------------------------

    def _on_look(self, sightings: tuple[Sighting, ...], whole: bool, began: float) -> None:
        if self.aside is not None and self.aside.since > began:
            return  # began before the step aside in force (a yield's): it may not list its program
        programs = [s.program for s in sightings]
        own = descendants(programs, os.getpid()) | self._taking_part(programs)
        self._passed &= {p.key for p in programs}  # a program that exited is forgotten
        current = self.aside
        # A look by name carries no memory figures (None): it can only see a program gone.
        new = next_aside(
            current, sightings, self.rules, own=own, passed=self._passed, now=time.time()
        )
        if new != current:
            gone = current is not None and current.key not in {p.key for p in programs}
            why = "it exited" if gone else f"it stayed under min_bytes for {self.rules.grace_s:g} s"
            self._become(new, why=why)

    def _taking_part(self, programs: list[Program]) -> set[int]:
        """The processes that hold the GPU's token by the protocol (a bare-protocol program, the
        command of `arbiterd run -- blender`) and those below them: they took their turn, and
        the daemon does not step aside for them too."""
        if self._arena is None:
            return set()
        try:
            state = self._arena.observe()
        except (ArbiterError, OSError):
            return set()  # the next look may read it
        roots = {state.holder_pid} - {None, os.getpid()}
        if state.holder is not None and state.holder.command_pid is not None:
            roots.add(state.holder.command_pid)
        found: set[int] = set()
        for root in roots:
            assert root is not None
            found |= descendants(programs, root)
        return found

    def _become(self, new: Aside | None, *, why: str) -> None:
        old, self.aside = self.aside, new
        if old is not None and (new is None or new.key != old.key):
            log.info("no longer stepped aside for %s (pid %d): %s", old.name, old.pid, why)
            self._publish(
                StepAsideEvent(
                    aside=False, program=old.name, pid=old.pid, reason=old.reason, why=why
                )
            )
        if new is not None and (old is None or new.key != old.key):
            used = "" if new.used_bytes is None else f", {format_bytes(new.used_bytes)}"
            log.info("stepping aside for %s (pid %d%s): %s", new.name, new.pid, used, new.reason)
            self._publish(
                StepAsideEvent(
                    aside=True,
                    program=new.name,
                    pid=new.pid,
                    reason=new.reason,
                    used_bytes=new.used_bytes,
                )
            )
        if old is not None and new is not None and old.key == new.key:
            return  # the same program, its memory measured again
        self._watch_exit(new)
        if new is None:
            if self._hold.give_back(HOLD_REASON):
                log.info("the models may take the GPU again")
        elif old is None:
            self._taking = asyncio.get_running_loop().create_task(
                self._take(new), name="step-aside"
            )
        else:  # handed to another program: the token stays, holder.json names the new one
            self._hold.relabel(HOLD_REASON, hold_label(new))

    async def _held(self) -> None:
        """Wait until the hold for the step aside in force is taken (or it ended)."""
        taking = self._taking
        if taking is not None:
            await asyncio.shield(taking)

    async def _take(self, aside: Aside) -> None:
        try:
            await self._hold.take(HOLD_REASON, hold_label(aside))
            if self.aside is not None and self.aside.key != aside.key:  # handed on meanwhile
                self._hold.relabel(HOLD_REASON, hold_label(self.aside))
        except ArbiterError as exc:
            if self.aside is not None:  # not a wait given up because the step aside ended
                log.warning("could not take the GPU for %s: %s", aside.name, exc)

    def _watch_exit(self, aside: Aside | None) -> None:
        """Watch `aside`'s program's pidfd (none: stop watching): its exit ends the step aside
        at once."""
        loop = asyncio.get_running_loop()
        if self._exit_fd is not None:
            loop.remove_reader(self._exit_fd)
            os.close(self._exit_fd)
            self._exit_fd = None
        if aside is None:
            return
        try:
            fd = os.pidfd_open(aside.pid)
        except OSError:
            self.lookout.look(whole=False)  # already gone: the look sees it
            return
        self._exit_fd = fd
        loop.add_reader(fd, self._exited, aside.key)

    def _exited(self, key: tuple[int, int]) -> None:
        if self.aside is not None and self.aside.key == key:
            # Passed over until a look no longer lists it: it is gone, whatever /proc says.
            self._passed.add(key)
            self._become(None, why="it exited")
            self.lookout.look(whole=True)  # another program may be waiting to be stepped for

    def _program(self, pid: int) -> Program | None:
        return read_program(pid, procfs=self._procfs)
