"""Hold intervals stamped by real processes into one log, and the check that no two overlap.

The writers are processes that cannot import this module (tests/support/arena_actor.py, the
commands of tests/cli/test_runner.py), so the format is the interface. A line is
`enter|exit|kill PID MONOTONIC_NS [TAG]`, appended with O_APPEND in one write (so lines from
several processes never interleave). `enter` is written once the token is held, `exit` before
it is released, `kill` by the test just before it SIGKILLs PID; TAG is free text a writer may
add to `enter`. CLOCK_MONOTONIC is system-wide, so stamps from different processes compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, order=True)
class Hold:
    """One process's hold of the token, [start_ns, end_ns]."""

    start_ns: int
    end_ns: int
    pid: int
    tag: str = ""


@dataclass(frozen=True)
class Overlap:
    """Two holds at once: `second` entered while `first` still held."""

    first: Hold
    second: Hold

    @property
    def overlap_ms(self) -> float:
        return (min(self.first.end_ns, self.second.end_ns) - self.second.start_ns) / 1e6


def open_holds(log: Path) -> dict[int, int]:
    """pid -> start_ns of every hold entered but not yet exited or killed."""
    entered: dict[int, int] = {}
    for what, pid, ns, _tag in _lines(log):
        if what == "enter":
            entered[pid] = ns
        else:
            entered.pop(pid, None)
    return entered


def read_holds(log: Path) -> list[Hold]:
    """Every hold, sorted by start; an enter without exit (killed holder) is open-ended."""
    open_: dict[int, tuple[int, str]] = {}
    killed: dict[int, Hold | None] = {}  # pid -> the hold its kill stamp closed
    holds = []
    for what, pid, ns, tag in _lines(log):
        if what == "enter":
            assert pid not in open_, f"pid {pid} entered twice"
            open_[pid] = (ns, tag)
        elif what == "exit" and pid in open_:
            start, start_tag = open_.pop(pid)
            holds.append(Hold(start, ns, pid, start_tag))
        elif what == "exit":
            # The victim stamped its exit between the kill stamp and its death: the hold it
            # closed lasted until now.
            cut = killed.get(pid)
            assert cut is not None, f"pid {pid} exited without entering"
            holds[holds.index(cut)] = Hold(cut.start_ns, ns, pid, cut.tag)
        else:  # "kill", stamped just before SIGKILL: a hold in progress ended by then
            killed[pid] = None
            if pid in open_:
                start, start_tag = open_.pop(pid)
                cut = Hold(start, ns, pid, start_tag)
                killed[pid] = cut
                holds.append(cut)
    # A victim can still stamp "enter" between the kill stamp and its death; it died holding.
    holds += [Hold(start, start, pid, tag) for pid, (start, tag) in open_.items() if pid in killed]
    assert killed.keys() >= open_.keys(), f"holds never closed: {open_}"
    return sorted(holds)


def overlaps(holds: list[Hold]) -> list[Overlap]:
    """Every hold that began before an earlier-started one had ended."""
    found = []
    latest: Hold | None = None  # of the holds so far, the one that ends last
    for hold in sorted(holds):
        if latest is not None and hold.start_ns < latest.end_ns:
            found.append(Overlap(latest, hold))
        if latest is None or hold.end_ns > latest.end_ns:
            latest = hold
    return found


def _lines(log: Path) -> list[tuple[str, int, int, str]]:
    parsed = []
    for line in log.read_text().splitlines():
        what, pid, ns, *tag = line.split(maxsplit=3)
        assert what in {"enter", "exit", "kill"}, f"unknown stamp {line!r}"
        parsed.append((what, int(pid), int(ns), tag[0] if tag else ""))
    return parsed
