"""benchmarks/groups: its pure parts (counting releases, handoffs and waits in the daemon's
events, the figures and ratios) and its --help."""

from __future__ import annotations

from typing import Any

from benchmarks.groups import (
    alternation_figures,
    comparison,
    durations,
    game_summary,
    handoffs,
    releases,
    waits,
)
from tests.support.benchmark_help import benchmark_help


def residency(model: str, from_: str, to: str) -> dict[str, Any]:
    return {"event": "residency", "model": model, "from": from_, "to": to, "duration_s": 0.01}


EVENTS = [
    residency("a", "warm", "cooling"),
    residency("a", "cooling", "cold"),
    {"event": "handoff", "from": "a", "to": "b"},
    residency("b", "warming", "warm"),
    {"event": "wait", "model": "a", "holder_name": "game"},
    residency("b", "cooling", "cold"),
    residency("a", "cooling", "cold"),
    {"event": "request", "model": "a"},
]


def test_a_release_is_a_residency_event_from_cooling_to_cold_of_that_model() -> None:
    assert (releases(EVENTS, "a"), releases(EVENTS, "b"), releases(EVENTS, "c")) == (2, 1, 0)


def test_durations_are_those_of_one_models_edge() -> None:
    assert durations(EVENTS, "a", "cooling", "cold") == [0.01, 0.01]
    assert durations(EVENTS, "b", "warming", "warm") == [0.01]
    assert durations(EVENTS, "b", "warming", "cold") == []


def test_handoffs_and_waits_keep_who_and_to_whom() -> None:
    assert handoffs(EVENTS) == [["a", "b"]]
    assert waits(EVENTS) == [["a", "game"]]


def test_alternation_counts_releases_per_member_and_every_handoff() -> None:
    figures = alternation_figures([0.3, 0.1, 0.2], 0.75, EVENTS)
    assert figures["requests"] == 3
    assert figures["wall_s"] == 0.75
    assert figures["latency"]["median_s"] == 0.2
    assert figures["releases"] == {"a": 2, "b": 1}
    assert figures["releases_total"] == 3
    assert (figures["handoffs"], figures["handoff_pairs"]) == (1, [["a", "b"]])
    assert alternation_figures([0.1], 0.1, [])["releases_total"] == 0


def test_the_ratios_are_group_over_baseline() -> None:
    group = alternation_figures([0.1, 0.1], 1.0, [])
    baseline = alternation_figures([0.4, 0.4], 4.0, EVENTS)
    assert comparison(group, baseline) == {"wall_ratio": 0.25, "median_latency_ratio": 0.25}


def run(a: int, b: int, wait_s: float, warm_s: float) -> dict[str, Any]:
    return {"releases": {"a": a, "b": b}, "game_wait_s": wait_s, "warm_again_s": warm_s}


def test_the_game_summary_says_whether_every_round_released_each_member_once() -> None:
    summary = game_summary([run(1, 1, 0.2, 0.5), run(1, 1, 0.4, 0.7), run(1, 1, 0.3, 0.6)])
    assert summary == {
        "rounds": 3,
        "game_wait_median_s": 0.3,
        "warm_again_median_s": 0.6,
        "one_release_per_member_every_round": True,
    }
    assert not game_summary([run(1, 1, 0.2, 0.5), run(2, 1, 0.2, 0.5)])[
        "one_release_per_member_every_round"
    ]
    assert not game_summary([run(1, 0, 0.2, 0.5)])["one_release_per_member_every_round"]


def test_help_names_every_option() -> None:
    text = benchmark_help("groups")
    for option in ("--rounds", "--game-rounds", "--out"):
        assert option in text
