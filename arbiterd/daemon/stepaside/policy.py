"""When the daemon steps aside for a program that does not take part, and when it comes back:
pure functions of what the lookout saw, the `[yield]` rules and the clock.

A program makes the daemon step aside when its name matches one of `programs` (a glob, matched
without case against its name, its argv[0]'s base name and its whole command line: ComfyUI runs
as `python main.py` from a ComfyUI folder) or when a reader measures it holding at least
`min_bytes` of device memory. Never for the daemon's own processes, nor, by memory, for the
programs of `ignore` (the desktop and browsers hold the GPU all the time). The step aside lasts
until the program exits; one caught by its memory alone also ends once its memory has stayed
below `min_bytes` for `grace_s`. A program the user resumed past (`arbiterd resume`) is passed
over until it exits.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace

from arbiterd.config import YieldRules
from arbiterd.daemon.stepaside.programs import Program
from arbiterd.render import format_bytes

ASKED = "asked for (arbiterd yield)"


@dataclass(frozen=True)
class Sighting:
    """A program the lookout saw, and the device memory a reader measured it holding (None:
    no reader measures it, or this look read names only)."""

    program: Program
    used_bytes: int | None = None


@dataclass(frozen=True)
class Aside:
    """The step aside in force: for whom, why, since when, and what it was last seen using."""

    pid: int
    start: int
    name: str
    reason: str
    since: float
    by_memory: bool  # caught by min_bytes alone: ends after grace_s below it
    used_bytes: int | None = None
    below_since: float | None = None  # when its memory was first seen back under min_bytes

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start)


def matches(program: Program, patterns: Iterable[str]) -> str | None:
    """The first of `patterns` that names `program`, or None."""
    names = {program.name.lower(), " ".join(program.cmdline).lower()}
    if program.cmdline:
        names.add(os.path.basename(program.cmdline[0]).lower())
    for pattern in patterns:
        lowered = pattern.lower()
        if any(fnmatch.fnmatchcase(name, lowered) for name in names):
            return pattern
    return None


def trigger(sighting: Sighting, rules: YieldRules) -> tuple[str, bool] | None:
    """Why `sighting` makes the daemon step aside, and whether by its memory alone; None when
    it does not."""
    named = matches(sighting.program, rules.programs)
    if named is not None:
        return f"named in [yield] programs ({named!r})", False
    used = sighting.used_bytes
    if (
        rules.min_bytes > 0
        and used is not None
        and used >= rules.min_bytes
        and matches(sighting.program, rules.ignore) is None
    ):
        return (
            f"holds {format_bytes(used)} of device memory "
            f"([yield] min_bytes is {format_bytes(rules.min_bytes)})"
        ), True
    return None


def next_aside(
    current: Aside | None,
    sightings: Iterable[Sighting],
    rules: YieldRules,
    *,
    own: Collection[int],
    passed: Collection[tuple[int, int]],
    now: float,
) -> Aside | None:
    """The step aside to be in force after this look: `current` carried on (with its memory
    brought up to date), ended, or handed to another program; or a new one. `own` are the
    daemon's pids, `passed` the programs resumed past (by Program.key)."""
    seen = {s.program.key: s for s in sightings}
    if current is not None:
        sighting = seen.get(current.key)
        if sighting is not None:
            carried = _carried(current, sighting, rules, now)
            if carried is not None:
                return carried
    if not rules.enabled:
        return None
    candidates = sorted(
        (s for s in seen.values() if s.program.pid not in own and s.program.key not in passed),
        key=lambda s: (s.program.start, s.program.pid),
    )
    for sighting in candidates:
        if current is not None and sighting.program.key == current.key:
            continue  # its step aside just ended
        why = trigger(sighting, rules)
        if why is not None:
            program = sighting.program
            return Aside(
                program.pid,
                program.start,
                program.name,
                why[0],
                now,
                by_memory=why[1],
                used_bytes=sighting.used_bytes,
            )
    return None


def _carried(current: Aside, sighting: Sighting, rules: YieldRules, now: float) -> Aside | None:
    """`current` after a look that saw its program still running; None once its memory has
    been under min_bytes for grace_s."""
    used = sighting.used_bytes
    if used is None:
        return current  # a names-only look, or no reader: nothing says it shrank
    if not current.by_memory or used >= rules.min_bytes:
        return replace(current, used_bytes=used, below_since=None)
    below_since = current.below_since if current.below_since is not None else now
    if now - below_since >= rules.grace_s:
        return None
    return replace(current, used_bytes=used, below_since=below_since)


def asked(program: Program, now: float) -> Aside:
    """The step aside `arbiterd yield --until-exit PID` asks for: until the program exits."""
    return Aside(program.pid, program.start, program.name, ASKED, now, by_memory=False)
