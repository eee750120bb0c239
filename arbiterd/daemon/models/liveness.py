"""Whether a worker that holds the arena token still shows signs of life: the record of what the
daemon heard, and the pure decision on it (issue 24: a holder stopped with SIGSTOP, or stuck in a
hung driver, kept the token, and every model's requests waited on it without bound; issue 40: so
did a worker stopped while warming, and one cooling on an RPC server that stopped answering).

Owns `Heard`, what the daemon last heard of one worker (workerclient.WorkerClient keeps it),
`holds_token`, whether a worker in a given state holds a token another model may wait for, and
`judge`, a pure function of a `Heard`, that and a clock: LIVE, SILENT (report it: an event, the
tray amber, `status`) or KILL (SIGKILL it: the kernel frees its token, which moves on, and the
lifecycle restarts it as after any crash). Never sends, kills or sleeps: holderwatch.py asks
every holder for its status each `ping_interval_s` and applies the verdicts.

How the daemon knows the engine thread lives (worker/loop.py): the worker's io thread answers
status even mid-decode (ctypes releases the GIL in llama_decode) and says how old the engine
thread's last beat is; the engine thread beats each turn of its loop and before each decode
batch or tokenizer piece, and every event or chunk it sends is a beat too. A load, a release or
a restore is one long native call (tens of GB copied at disk or bus speed) that calls back
nothing: while the engine thread is inside one, the io thread counts its CPU clock moving on as
a beat (a copy costs CPU: memcpy, page faults, a driver's submissions; a call blocked on a
server that stopped answering, or on a fence that never signals, sleeps in the kernel and its
clock stands still). Two cases look the same to `judge`:
- the whole process is stopped (SIGSTOP, a frozen cgroup): the question goes unanswered;
- the engine thread is stuck in one native call (a hung GPU driver, a stopped RPC server): the
  io thread answers, with a beat that keeps getting older.
What it cannot tell from progress: a driver that spins on the CPU while it waits for a hung
device inside a load, release or restore moves the clock and stays LIVE (in a decode, where
the beat is the engine's own callback, it does not).

A worker is judged only while it holds a token (`holds_token`): a waiter's silence stalls no
one this module can free (the queue passes over it, arena/), and a cold worker holds nothing.

What a kill in a handoff keeps: the daemon's host copy of the model file (the next worker loads
from it, reading nothing from disk) and a prompt cache an earlier unload left in its state file
(worker/keptkv.py). The killed worker's own prompt cache goes with it: cooling, it was still on
the device (on an RPC server, the copy off the server is what hung); warming, its host copy
lived in the worker. A restore never starts on a server that does not answer: the worker
probes it first (rpc.probe, within rpc.PROBE_TIMEOUT_S) and stays cold with its KV. While the
server stays silent the new worker's load fails the same probe, so the model shows `failed`,
naming the server, and loads again once it answers.

All times are `time.monotonic()`; the worker's beat age is measured on the same clock
(CLOCK_MONOTONIC is one clock for the whole system), and counts no system suspend.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, replace

from arbiterd.reply import WorkerStatus
from arbiterd.states import ResidencyState

# How long a worker may take to answer status before `arbiterd status`, the tray and
# /v1/models show what it said last, marked stale. Its io thread answers in microseconds, also
# mid-decode: a second is a process that is stopped, swapped out or starved.
STATUS_ANSWER_S = 1.0
# Status questions per holder_timeout_s: a healthy worker's last answer is at most a quarter
# of it old when judged, so it is never mistaken for a silent one.
PINGS_PER_TIMEOUT = 4


class Verdict(enum.Enum):
    LIVE = "live"  # it shows signs of life, or it holds no token
    SILENT = "silent"  # holds a token and silent for holder_timeout_s: reported
    KILL = "kill"  # still silent after a second holder_timeout_s: killed


@dataclass(frozen=True)
class Heard:
    """What the daemon last heard of one worker's life."""

    status: WorkerStatus  # its last status; WorkerStatus() (nothing said) before the first
    answered_at: float  # when that status came (the worker's start before the first)
    # The engine thread's last beat the daemon knows of: from that status's `beat_age_s`, or a
    # later event or chunk (only the engine thread sends those).
    beat_at: float
    asked_at: float | None = None  # when the status question it has not answered was asked

    @classmethod
    def started(cls, now: float) -> Heard:
        return cls(WorkerStatus(), now, now)

    def asked(self, now: float) -> Heard:
        return replace(self, asked_at=now)

    def answered(self, status: WorkerStatus, now: float) -> Heard:
        age = status.beat_age_s  # finite or None, as the field codec reads it
        beat_at = now  # a reply without a beat age: the answer itself is the sign of life
        if age is not None:
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


# The states in which a worker holds its token from start to end: it takes the token before it
# leaves cold (warming) and lets go of it only once cold again (cooling, then cold).
HOLDING_STATES = frozenset({ResidencyState.WARMING, ResidencyState.WARM, ResidencyState.COOLING})


def holds_token(state: ResidencyState | None, *, pid: int, holders: Collection[int]) -> bool:
    """Whether a worker `pid` whose residency is `state` holds a token another model may wait
    for. Warming, warm and cooling always do. A loading worker is first a waiter in the queue,
    then the holder; no event says when it took the token, so the kernel does: `holders`, the
    pids that hold its devices' tokens (arena observe(): /proc/locks)."""
    if state in HOLDING_STATES:
        return True
    return state is ResidencyState.LOADING and pid in holders


def judge(heard: Heard, *, holds: bool, now: float, timeout_s: float) -> Verdict:
    """What to do about a worker at `now`, with [daemon] holder_timeout_s = `timeout_s`;
    `holds`: it holds a token (`holds_token`)."""
    if not holds:
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


def kill_reason(silent: float, timeout_s: float, state: ResidencyState) -> str:
    """Why a silent holder was killed, as its requests' errors and its worker event say it: a
    handoff that hung (warming, cooling, loading) says which."""
    during = "" if state is ResidencyState.WARM else f" while {state.value}"
    return (
        f"killed: it held the GPU and showed no sign of life for {silent:.1f} s{during} "
        f"(twice [daemon] holder_timeout_s = {timeout_s:g} s)"
    )
