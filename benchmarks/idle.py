"""Idle means idle (issue 29): how often an idle daemon and its workers wake up, and the CPU
they burn meanwhile.

    python -m benchmarks.idle [--seconds 60] [--baseline-source DIR] [--source DIR] [--out FILE]

Starts `python -m arbiterd daemon` from --source (default: this checkout; tests.support.daemon:
its own config, socket, arena and journal in a private folder under /tmp) with four models on
the tests' tiny random GGUF (tests.support.tiny_gguf), each with tests.support.daemon.tiny's
keys (n_gpu_layers = 0: the CPU):
- `warm`, warmed through the control socket's `warm`: it holds the arena's GPU token, and
  nobody wants it, so it keeps it;
- `cold`, a model that waits for nothing;
- `member1` and `member2`, both cold, the group `pair` (`[groups.pair]`): its keeper, a thread
  of the daemon, holds nothing and waits for a member to want the GPU;
and the `[yield]` defaults (issue 45): the daemon looks for programs by name every scan_s.
Once every model is in that state (the daemon's status says so, the `warm` worker holds the
token and the group does not) and SETTLE_S have passed, it reads /proc every
SAMPLE_INTERVAL_S for --seconds, for the daemon and each of its children (the four workers,
named by the daemon's status), and nothing else touches the daemon meanwhile:
- context switches, voluntary and not, summed over the threads (/proc/PID/task/*/status): a
  thread is counted from its first read (0 for one that started later) to its last, so a thread
  that ended loses at most its last interval (threads_started, threads_ended say how many);
- CPU time: utime + stime of /proc/PID/stat, which covers every thread, those that ended too;
- the busiest threads (most switches): tid, name (/proc/PID/task/TID/comm; CPython 3.11 names
  no OS thread, so every Python thread reads "python", and tid == pid is the main thread) and
  wchan (where the kernel saw it sleep most often: hrtimer_nanosleep for a time.sleep,
  futex_do_wait for a timed lock or queue wait, ...).
Afterwards the status must still show the same workers in the same states, and the events
stored meanwhile are counted (by kind): a run in which something happened is not idle.

Goals (issue 29): at most GOAL_WAKEUPS_PER_S context switches per second per process, and at
most GOAL_CPU_PERCENT % of one core for all the processes together; each with its figure and
pass. With --baseline-source, that checkout is measured the same way first, in the same run,
and the ratios source / baseline are reported. Exits 1 when --source misses a goal (the JSON
is printed, and written, all the same).
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiterd.cli.controlclient import ControlClient
from benchmarks.common import (
    add_source_arguments,
    describe_source,
    events_after,
    last_seq,
    ratio,
    report,
    source_env,
)
from tests.support.daemon import serving, tiny
from tests.support.tiny_gguf import write_tiny_llama

WARM = "warm"
COLD = "cold"
GROUP = "pair"
MEMBERS = ("member1", "member2")
SETTLE_S = 3.0  # after the last change of state, before the first read
SAMPLE_INTERVAL_S = 1.0  # reads of /proc, by this process: they wake nothing in the daemon
STATE_TIMEOUT_S = 60.0  # for the models to reach their states
STATE_POLL_S = 0.05
BUSIEST_THREADS = 5
GOAL_WAKEUPS_PER_S = 1.0  # per process
GOAL_CPU_PERCENT = 0.2  # of one core, all the processes together


# -- pure parts: what /proc says, and what it adds up to ----------------------------------------


@dataclass(frozen=True)
class Switches:
    voluntary: int
    nonvoluntary: int

    @property
    def total(self) -> int:
        return self.voluntary + self.nonvoluntary


@dataclass(frozen=True)
class ThreadRead:
    name: str
    switches: Switches
    wchan: str  # "0" (or "") while it runs


@dataclass(frozen=True)
class ProcessRead:
    """One read of a process: when (time.monotonic), its CPU time in clock ticks (all its
    threads, ended ones too), and each of its live threads."""

    at_s: float
    cpu_ticks: int
    threads: Mapping[int, ThreadRead]


def parse_switches(status: str) -> Switches:
    """The context switches of a /proc/PID[/task/TID]/status text (proc(5))."""
    found: dict[str, int] = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            found[key] = int(value)
    if len(found) != 2:
        raise ValueError("/proc status: no voluntary_ctxt_switches / nonvoluntary_ctxt_switches")
    return Switches(found["voluntary_ctxt_switches"], found["nonvoluntary_ctxt_switches"])


def parse_cpu_ticks(stat: str) -> int:
    """utime + stime (clock ticks) of a /proc/PID/stat text: fields 14 and 15 (proc(5)), counted
    after the command name, which is in parentheses and may itself hold spaces and parentheses."""
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): field N is fields[N - 3].
    return int(fields[14 - 3]) + int(fields[15 - 3])


def process_figures(reads: Sequence[ProcessRead], ticks_per_s: float) -> dict[str, Any]:
    """Rates over the reads of one process, from its first read to its last (at least two)."""
    first, last = reads[0], reads[-1]
    elapsed_s = last.at_s - first.at_s
    if elapsed_s <= 0:
        raise ValueError("need two reads of a process, at different times")
    latest: dict[int, ThreadRead] = {}
    wchans: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for read in reads:
        for tid, thread in read.threads.items():
            latest[tid] = thread
            if thread.wchan not in ("", "0"):
                wchans[tid][thread.wchan] += 1
    counted: dict[int, Switches] = {}
    for tid, thread in latest.items():
        start = first.threads[tid].switches if tid in first.threads else Switches(0, 0)
        counted[tid] = Switches(
            thread.switches.voluntary - start.voluntary,
            thread.switches.nonvoluntary - start.nonvoluntary,
        )
    voluntary = sum(s.voluntary for s in counted.values())
    nonvoluntary = sum(s.nonvoluntary for s in counted.values())
    cpu_s = (last.cpu_ticks - first.cpu_ticks) / ticks_per_s
    busiest = sorted(
        (tid for tid in counted if counted[tid].total > 0), key=lambda t: -counted[t].total
    )
    return {
        "seconds": round(elapsed_s, 3),
        "switches_per_s": round((voluntary + nonvoluntary) / elapsed_s, 3),
        "voluntary_per_s": round(voluntary / elapsed_s, 3),
        "nonvoluntary_per_s": round(nonvoluntary / elapsed_s, 3),
        "cpu_s": round(cpu_s, 3),
        "cpu_percent_of_core": round(100 * cpu_s / elapsed_s, 4),
        "threads": len(last.threads),
        "threads_started": len(latest.keys() - first.threads.keys()),
        "threads_ended": len(latest.keys() - last.threads.keys()),
        "busiest_threads": [
            {
                "tid": tid,
                "name": latest[tid].name,
                "wchan": wchans[tid].most_common(1)[0][0] if wchans[tid] else None,
                "switches_per_s": round(counted[tid].total / elapsed_s, 3),
            }
            for tid in busiest[:BUSIEST_THREADS]
        ],
    }


def totals(processes: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    return {
        "switches_per_s": round(sum(p["switches_per_s"] for p in processes.values()), 3),
        "cpu_percent_of_core": round(sum(p["cpu_percent_of_core"] for p in processes.values()), 4),
    }


def goals(processes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Issue 29's goals against the figures of each process (process_figures)."""
    per_process = {name: p["switches_per_s"] <= GOAL_WAKEUPS_PER_S for name, p in processes.items()}
    worst = max(processes, key=lambda name: processes[name]["switches_per_s"])
    cpu = totals(processes)["cpu_percent_of_core"]
    wakeups_pass = all(per_process.values())
    cpu_pass = cpu <= GOAL_CPU_PERCENT
    return {
        "wakeups": {
            "goal": f"<= {GOAL_WAKEUPS_PER_S:g} wake-up (context switch) per second per process",
            "worst_process": worst,
            "worst_switches_per_s": processes[worst]["switches_per_s"],
            "per_process": per_process,
            "pass": wakeups_pass,
        },
        "cpu": {
            "goal": f"<= {GOAL_CPU_PERCENT:g} % of one core in total",
            "total_percent_of_core": cpu,
            "pass": cpu_pass,
        },
        "pass": wakeups_pass and cpu_pass,
    }


def comparison(ours: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """ours / baseline of the switch rate and the CPU share, per process both runs have and in
    total (None where the baseline's is 0)."""

    def ratios(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, float | None]:
        return {
            "switches_per_s": ratio(a["switches_per_s"], b["switches_per_s"]),
            "cpu_percent_of_core": ratio(a["cpu_percent_of_core"], b["cpu_percent_of_core"]),
        }

    processes = ours["processes"]
    theirs = baseline["processes"]
    return {
        "processes": {
            name: ratios(processes[name], theirs[name]) for name in processes if name in theirs
        },
        "total": ratios(ours["total"], baseline["total"]),
    }


# -- reading /proc --------------------------------------------------------------------------------


def read_text(path: Path) -> str | None:
    """The file's text, None when its thread or process is gone."""
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None


def read_process(pid: int) -> ProcessRead:
    """Reads /proc/PID: the process's CPU time and each thread's switches, name and wchan."""
    at_s = time.monotonic()
    base = Path(f"/proc/{pid}")
    threads: dict[int, ThreadRead] = {}
    for task in (base / "task").iterdir():
        status = read_text(task / "status")
        name = read_text(task / "comm")
        wchan = read_text(task / "wchan")
        if status is None or name is None:
            continue  # the thread ended meanwhile
        threads[int(task.name)] = ThreadRead(name.strip(), parse_switches(status), wchan or "")
    return ProcessRead(at_s, parse_cpu_ticks((base / "stat").read_text()), threads)


def children(pid: int) -> list[int]:
    """The process's children (/proc/PID/task/TID/children, Linux 3.5 with CONFIG_PROC_CHILDREN;
    empty without)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = read_text(task / "children")
        found += [int(child) for child in (text or "").split()]
    return found


def sample(pids: Mapping[str, int], seconds: float) -> dict[str, list[ProcessRead]]:
    """Reads every process each SAMPLE_INTERVAL_S for `seconds`: the first read at once, the last
    at `seconds`."""
    reads: dict[str, list[ProcessRead]] = {name: [] for name in pids}
    started = time.monotonic()
    ticks = 0
    while True:
        for name, pid in pids.items():
            reads[name].append(read_process(pid))
        if time.monotonic() - started >= seconds:
            return reads
        ticks += 1
        next_s = started + min(ticks * SAMPLE_INTERVAL_S, seconds)
        time.sleep(max(0.0, next_s - time.monotonic()))  # a schedule, not a wait on an event


# -- the daemon -----------------------------------------------------------------------------------


def status(control: Path) -> dict[str, Any]:
    with ControlClient.connect(control) as client:
        found: dict[str, Any] = client.call("status")
        return found


def idle_state_reached(found: Mapping[str, Any]) -> bool:
    """Whether a daemon status shows the idle state this benchmark measures: `warm` warm and
    holding the token, every other model cold, no group holding the token, nobody waiting."""
    states = {m["name"]: m["state"] for m in found["models"]}
    pids = {m["name"]: m["pid"] for m in found["models"]}
    wanted = {WARM: "warm", COLD: "cold", **dict.fromkeys(MEMBERS, "cold")}
    holder = found.get("holder") or {}
    return (
        states == wanted
        and holder.get("pid") == pids[WARM]
        and not any(g["holds_token"] for g in found["groups"])
        and not found["waiters"]
    )


def measure(source: Path, model: Path, seconds: float) -> dict[str, Any]:
    """One daemon from `source`, set up idle, read for `seconds`."""
    models = {name: tiny(model) for name in (WARM, COLD, *MEMBERS)}
    load_before = [round(x, 2) for x in os.getloadavg()]
    # yield_keys={}: the [yield] defaults, as a user runs it (issue 45: its look by name
    # every scan_s is an idle cost too).
    groups = {GROUP: list(MEMBERS)}
    with serving(models, env=source_env(source), groups=groups, yield_keys={}) as daemon:
        with ControlClient.connect(daemon.socket, timeout_s=STATE_TIMEOUT_S) as client:
            client.call("warm", model=WARM)
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while not idle_state_reached(found := status(daemon.socket)):
            if time.monotonic() > deadline:
                raise SystemExit(f"the models did not reach their states: {found}")
            time.sleep(STATE_POLL_S)
        seq = last_seq(daemon.socket)
        workers = {m["name"]: m["pid"] for m in found["models"]}
        pid = daemon.process.pid
        others = {f"child {c}": c for c in children(pid) if c not in workers.values()}
        pids = {"daemon": pid, **workers, **others}
        time.sleep(SETTLE_S)  # let what the last change started finish: a duration, no event
        reads = sample(pids, seconds)
        after = status(daemon.socket)
        kinds = collections.Counter(str(e.get("event")) for e in events_after(daemon.socket, seq))
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    processes = {
        name: {"pid": pids[name], **process_figures(r, ticks_per_s)} for name, r in reads.items()
    }
    return {
        "source": describe_source(source),
        "processes": processes,
        "total": totals(processes),
        "goals": goals(processes),
        "still_idle_after": idle_state_reached(after)
        and {m["name"]: m["pid"] for m in after["models"]} == workers,
        "events_meanwhile": dict(kinds),
        # On a machine shared with other work, its load wakes nothing here but delays what
        # wakes (nonvoluntary switches, late timers): how busy the CPUs were.
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to read (> 0)")
    add_source_arguments(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")
    with tempfile.TemporaryDirectory(prefix="ad-idle-") as tmp:
        model = write_tiny_llama(Path(tmp) / "tiny.gguf")
        baseline = (
            None
            if args.baseline_source is None
            else measure(args.baseline_source.resolve(), model, args.seconds)
        )
        ours = measure(args.source.resolve(), model, args.seconds)
    result: dict[str, Any] = {
        "benchmark": "idle",
        "how": (
            "a daemon with 4 models on the tests' tiny GGUF (n_gpu_layers 0): 'warm' holds the "
            f"token, 'cold' and the group '{GROUP}' ({', '.join(MEMBERS)}) are cold; after "
            f"{SETTLE_S:g} s idle, /proc read every {SAMPLE_INTERVAL_S:g} s: context switches "
            "summed over /proc/PID/task/*/status, CPU = utime + stime of /proc/PID/stat"
        ),
        "seconds": args.seconds,
        "host": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": sys.version.split()[0],
        },
        "goal": {
            "wakeups_per_s_per_process_max": GOAL_WAKEUPS_PER_S,
            "cpu_percent_of_core_total_max": GOAL_CPU_PERCENT,
        },
        "result": ours,
    }
    if baseline is not None:
        result["baseline"] = baseline
        result["result_over_baseline"] = comparison(ours, baseline)
    report(result, args.out)
    return 0 if ours["goals"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
