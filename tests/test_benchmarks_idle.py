"""benchmarks/idle: its pure parts (reading /proc texts, the rates over a run's reads, the
goals and ratios, the idle state it waits for) and its --help."""

from __future__ import annotations

import os
from typing import Any

import pytest

from benchmarks.idle import (
    ProcessRead,
    Switches,
    ThreadRead,
    comparison,
    goals,
    idle_state_reached,
    parse_cpu_ticks,
    parse_switches,
    process_figures,
    read_process,
)
from tests.support.benchmark_help import benchmark_help

STATUS = """\
Name:\tpython
Threads:\t3
voluntary_ctxt_switches:\t1200
nonvoluntary_ctxt_switches:\t34
"""


def test_switches_are_read_from_a_status_text() -> None:
    assert parse_switches(STATUS) == Switches(1200, 34)
    assert parse_switches(STATUS).total == 1234
    with pytest.raises(ValueError, match="ctxt_switches"):
        parse_switches("Name:\tpython\n")


def test_cpu_ticks_are_utime_plus_stime_whatever_the_command_name() -> None:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    tail = "S 1 2 3 0 -1 4194304 10 0 0 0 250 75 0 0 20 0 3 0"
    assert parse_cpu_ticks(f"4242 (python) {tail}") == 325
    assert parse_cpu_ticks(f"4242 (a) (b c) {tail}") == 325


def test_this_process_reads_with_its_own_thread() -> None:
    read = read_process(os.getpid())
    assert os.getpid() in read.threads
    assert read.threads[os.getpid()].switches.total >= 0
    assert read.cpu_ticks >= 0


def thread(switches: int, wchan: str = "futex_do_wait", name: str = "python") -> ThreadRead:
    return ThreadRead(name, Switches(switches, 0), wchan)


def test_rates_count_each_thread_from_its_first_read_to_its_last() -> None:
    reads = [
        ProcessRead(10.0, 100, {1: thread(1000), 2: thread(50, "hrtimer_nanosleep")}),
        ProcessRead(11.0, 150, {1: thread(1010), 2: thread(550, "0"), 3: thread(4)}),
        # Thread 3 ended after its read above; thread 4 started after the first read.
        ProcessRead(
            12.0, 200, {1: thread(1020), 2: thread(1050, "hrtimer_nanosleep"), 4: thread(2)}
        ),
    ]
    figures = process_figures(reads, ticks_per_s=100)
    assert figures["seconds"] == 2.0
    assert figures["switches_per_s"] == (20 + 1000 + 4 + 2) / 2
    assert (figures["cpu_s"], figures["cpu_percent_of_core"]) == (1.0, 50.0)
    assert (figures["threads"], figures["threads_started"], figures["threads_ended"]) == (3, 2, 1)
    busiest = figures["busiest_threads"]
    assert [b["tid"] for b in busiest] == [2, 1, 3, 4]
    assert busiest[0] == {
        "tid": 2,
        "name": "python",
        "wchan": "hrtimer_nanosleep",  # "0" (running when read) is no place
        "switches_per_s": 500.0,
    }


def test_a_thread_that_never_switched_is_not_among_the_busiest() -> None:
    reads = [ProcessRead(0.0, 0, {1: thread(7)}), ProcessRead(5.0, 0, {1: thread(7)})]
    figures = process_figures(reads, ticks_per_s=100)
    assert (figures["switches_per_s"], figures["busiest_threads"]) == (0.0, [])


def test_rates_need_two_reads_apart() -> None:
    with pytest.raises(ValueError, match="two reads"):
        process_figures([ProcessRead(1.0, 0, {})], ticks_per_s=100)


def process(switches_per_s: float, cpu_percent: float) -> dict[str, Any]:
    return {"switches_per_s": switches_per_s, "cpu_percent_of_core": cpu_percent}


def test_goals_are_per_process_wakeups_and_total_cpu() -> None:
    quiet = {"daemon": process(0.5, 0.05), "warm": process(1.0, 0.1)}
    met = goals(quiet)
    assert (met["wakeups"]["pass"], met["cpu"]["pass"], met["pass"]) == (True, True, True)
    assert met["wakeups"]["worst_process"] == "warm"
    busy = goals({"daemon": process(484.0, 2.6), "warm": process(0.2, 0.0)})
    assert busy["wakeups"]["per_process"] == {"daemon": False, "warm": True}
    assert (busy["wakeups"]["pass"], busy["cpu"]["pass"], busy["pass"]) == (False, False, False)
    cpu_only = goals({"daemon": process(1.0, 0.15), "warm": process(1.0, 0.1)})
    assert (cpu_only["wakeups"]["pass"], cpu_only["cpu"]["pass"]) == (True, False)
    assert cpu_only["cpu"]["total_percent_of_core"] == 0.25


def test_ratios_are_ours_over_the_baseline_per_process_and_in_total() -> None:
    ours = {"processes": {"daemon": process(1.0, 0.1), "new": process(1.0, 0.1)}}
    ours["total"] = process(2.0, 0.2)
    baseline = {"processes": {"daemon": process(500.0, 0.0)}, "total": process(800.0, 4.0)}
    assert comparison(ours, baseline) == {
        "processes": {"daemon": {"switches_per_s": 0.002, "cpu_percent_of_core": None}},
        "total": {"switches_per_s": 0.0025, "cpu_percent_of_core": 0.05},
    }


def status(states: dict[str, str], holder: int | None, group_holds: bool = False) -> dict[str, Any]:
    pids = {"warm": 10, "cold": 11, "member1": 12, "member2": 13}
    return {
        "models": [{"name": n, "state": s, "pid": pids[n]} for n, s in states.items()],
        "holder": None if holder is None else {"pid": holder, "name": "warm"},
        "groups": [{"name": "pair", "holds_token": group_holds}],
        "waiters": [],
    }


IDLE = {"warm": "warm", "cold": "cold", "member1": "cold", "member2": "cold"}


def test_idle_is_warm_holding_the_token_and_everything_else_cold() -> None:
    assert idle_state_reached(status(IDLE, holder=10))
    assert not idle_state_reached(status(IDLE, holder=None))
    assert not idle_state_reached(status(IDLE, holder=12, group_holds=True))
    assert not idle_state_reached(status({**IDLE, "member1": "warm"}, holder=10))
    assert not idle_state_reached(status({**IDLE, "warm": "warming"}, holder=10))


def test_help_names_every_option() -> None:
    text = benchmark_help("idle")
    for option in ("--seconds", "--baseline-source", "--source", "--out"):
        assert option in text
