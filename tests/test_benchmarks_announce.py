"""benchmarks/announce: its pure parts (the stamps of a traced gpu-job.sh, the release in the
daemon's events, the figures, goals and ratios) and its --help."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.announce import comparison, kind_figures, parse_trace, release_start
from tests.support.benchmark_help import benchmark_help

# What bash printed for `. gpu-job.sh true` with PS4='+${EPOCHREALTIME} ' (shortened paths).
TRACE = """\
+1796207418.662834 . docs/examples/gpu-job.sh true
++1796207418.662936 set -eu
++1796207418.662972 arena=/tmp/arena
+++1796207418.668995 umask
++1796207418.669342 job_umask=0022
++1796207418.669369 umask 077
++1796207418.669384 exec
++1796207418.669739 flock -s 8
++1796207418.670941 flock -x 9
++1796207418.672069 tmp=/tmp/arena/.holder.json.13661.tmp
+++1796207418.672410 basename true
++1796207418.676570 flock -u 8
++1796207418.677682 exec
++1796207418.681598 exit 0
"""


def test_the_trace_gives_the_stamps_before_the_open_the_lock_and_the_wait() -> None:
    assert parse_trace(TRACE) == {
        "open": 1796207418.669384,
        "lock": 1796207418.669739,
        "wait": 1796207418.670941,
        "held": 1796207418.672069,
    }


def test_a_trace_without_the_protocol_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="not a traced gpu-job"):
        parse_trace("+1.0 echo hi\n")
    with pytest.raises(ValueError, match="ends at"):
        parse_trace(TRACE[: TRACE.index("++1796207418.672069")])


def residency(model: str, from_: str, to: str, at: float) -> dict[str, Any]:
    return {"event": "residency", "model": model, "from": from_, "to": to, "at": at}


def test_the_release_start_is_the_first_warm_to_cooling_and_needs_its_end() -> None:
    events = [
        {"event": "wait", "model": "warm", "at": 1.0},
        residency("other", "warm", "cooling", 1.5),
        residency("warm", "warm", "cooling", 2.0),
    ]
    assert release_start(events, "warm") is None  # still cooling
    events.append(residency("warm", "cooling", "cold", 2.5))
    assert release_start(events, "warm") == (events[2], events[3])


def row(latency_ms: float, **extra: float) -> dict[str, Any]:
    return {
        "announce_to_release_start_ms": latency_ms,
        "announce_to_token_ms": latency_ms + 4,
        "release_s": 0.001,
        "reason": "wanted",
        **extra,
    }


def flock_row(open_ms: float, lock_ms: float, locked_ms: float) -> dict[str, Any]:
    return row(
        open_ms,
        lock_line_to_release_start_ms=lock_ms,
        locked_to_release_start_ms=locked_ms,
        flock_s_command_ms=lock_ms - locked_ms,
    )


def test_the_arbiterd_waiters_goal_is_on_its_median() -> None:
    figures = kind_figures([row(2.0), row(2.5), row(9.0)])
    assert figures["announce_to_release_start"]["median_ms"] == 2.5
    assert figures["announce_to_release_start"]["p99_ms"] == 9.0
    assert figures["goal"]["pass"] is False
    assert kind_figures([row(0.3), row(0.5), row(9.0)])["goal"]["pass"] is True
    assert "lock_to_release_start_bounds" not in figures
    assert figures["release_reasons"] == ["wanted"]


def test_the_flock_waiters_goal_is_on_the_bounds_of_its_lock() -> None:
    assert kind_figures([flock_row(1.4, 0.9, -0.3)])["goal"]["pass"] is True
    assert kind_figures([flock_row(4.0, 3.5, 2.3)])["goal"]["pass"] is False
    undecided = kind_figures([flock_row(2.0, 1.6, 0.4)])
    assert undecided["goal"]["pass"] is None
    bounds = undecided["lock_to_release_start_bounds"]
    assert (bounds["upper"]["median_ms"], bounds["lower"]["median_ms"]) == (1.6, 0.4)
    assert undecided["flock_s_command"]["median_ms"] == pytest.approx(1.2)


def test_ratios_are_ours_over_the_baseline_for_each_waiter_both_ran() -> None:
    ours = {"waiters": {"arbiterd": kind_figures([row(0.5)]), "new": kind_figures([row(1.0)])}}
    baseline = {"waiters": {"arbiterd": kind_figures([row(2.0)])}}
    assert comparison(ours, baseline) == {"arbiterd": {"median": 0.25, "p99": 0.25}}


def test_help_names_every_option() -> None:
    text = benchmark_help("announce")
    for option in ("--rounds", "--baseline-source", "--source", "--seed", "--out"):
        assert option in text
