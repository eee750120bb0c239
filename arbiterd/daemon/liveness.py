"""Whether a warm worker still shows signs of life: the record of what the daemon heard, and the
pure decision on it (issue 24: a holder stopped with SIGSTOP, or stuck in a hung driver, kept
the arena token, and every model's requests waited on it without bound).

Owns `Heard`, what the daemon last heard of one worker (workerclient.WorkerClient keeps it), and
`judge`, a pure function of a `Heard`, the worker's residency and a clock: LIVE, SILENT (report
it: an event, the tray amber, `status`) or KILL (SIGKILL it: the kernel frees its token, which
moves on, and the lifecycle restarts it as after any crash). Never sends, kills or sleeps: the
supervisor asks every warm worker for its status each `ping_interval_s` and applies the
verdicts.

How the daemon knows the engine thread lives (worker/loop.py): the worker's io thread answers
status even mid-decode (ctypes releases the GIL in llama_decode) and says how old the engine
thread's last beat is; the engine thread beats each turn of its loop and before each decode
batch or tokenizer piece, and every event or chunk it sends is a beat too. Two cases look the
same to `judge`:
- the whole process is stopped (SIGSTOP, a frozen cgroup): the question goes unanswered;
- the engine thread is stuck in one native call (a hung GPU driver): the io thread answers, with
  a beat that keeps getting older.
Only a warm worker is judged: warm, it holds the token and runs nothing but requests, whose
steps each beat. Loading, warming and cooling are long native calls that do not beat (copying
tens of GB at disk speed), and a cold worker holds nothing another model waits for.

All times are `time.monotonic()`; the worker's beat age is measured on the same clock
(CLOCK_MONOTONIC is one clock for the whole system), and counts no system suspend.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any

# How long a worker may take to answer status before `arbiterd status`, the tray and
# /v1/models show what it said last, marked stale. Its io thread answers in microseconds, also
# mid-decode: a second is a process that is stopped, swapped out or starved.
STATUS_ANSWER_S = 1.0
# Status questions per holder_timeout_s: a healthy worker's last answer is at most a quarter
# of it old when judged, so it is never mistaken for a silent one.
PINGS_PER_TIMEOUT = 4


class Verdict(enum.Enum):
    LIVE = "live"  # it shows signs of life, or it is not warm
    SILENT = "silent"  # warm and silent for holder_timeout_s: reported
    KILL = "kill"  # still silent after a second holder_timeout_s: killed


@dataclass(frozen=True)
class Heard:
    """What the daemon last heard of one worker's life."""

    status: dict[str, Any]  # its last status; {} before the first
    answered_at: float  # when that status came (the worker's start before the first)
    # The engine thread's last beat the daemon knows of: from that status's `beat_age_s`, or a
    # later event or chunk (only the engine thread sends those).
    beat_at: float
    asked_at: float | None = None  # when the status question it has not answered was asked

    @classmethod
    def started(cls, now: float) -> Heard:
        return cls({}, now, now)

    def asked(self, now: float) -> Heard:
        return replace(self, asked_at=now)

    def answered(self, status: dict[str, Any], now: float) -> Heard:
        age = status.get("beat_age_s")
        beat_at = now  # a reply without a beat age: the answer itself is the sign of life
        if isinstance(age, int | float) and not isinstance(age, bool) and math.isfinite(age):
            beat_at = now - max(0.0, age)
        return Heard(status, now, max(self.beat_at, beat_at))

    def beat(self, now: float) -> Heard:
        return replace(self, beat_at=max(self.beat_at, now))


def silent_s(heard: Heard, now: float) -> float:
    """How long the worker's engine thread has shown no sign of life, as far as the daemon can
    tell at `now`: the beat age its last answer said or, while a question is unanswered, how
    long ago it was asked (or the engine last beat, if that came later), whichever is longer.
    Each is a span the daemon *knows* was silent, so this never exceeds the truth; it falls
    short of it by at most one ping interval, and a daemon that stalled before asking does not
    count its own stall against the worker."""
    silent = heard.answered_at - heard.beat_at
    if heard.asked_at is not None:
        silent = max(silent, now - max(heard.asked_at, heard.beat_at))
    return max(0.0, silent)


def judge(heard: Heard, *, warm: bool, now: float, timeout_s: float) -> Verdict:
    """What to do about a worker at `now`, with [daemon] holder_timeout_s = `timeout_s`."""
    if not warm:
        return Verdict.LIVE
    silent = silent_s(heard, now)
    if silent >= 2 * timeout_s:
        return Verdict.KILL
    if silent >= timeout_s:
        return Verdict.SILENT
    return Verdict.LIVE


def stale(heard: Heard, now: float) -> bool:
    """Whether the worker has left a status question unanswered for STATUS_ANSWER_S: asking
    again would only wait as long; what it said last is all there is."""
    return heard.asked_at is not None and now - heard.asked_at >= STATUS_ANSWER_S


def ping_interval_s(timeout_s: float) -> float:
    return timeout_s / PINGS_PER_TIMEOUT


def kill_reason(silent: float, timeout_s: float) -> str:
    """Why a silent holder was killed, as its requests' errors and its worker event say it."""
    return (
        f"killed: it held the GPU and showed no sign of life for {silent:.1f} s "
        f"(twice [daemon] holder_timeout_s = {timeout_s:g} s)"
    )
