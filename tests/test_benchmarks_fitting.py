"""benchmarks/fitting: its pure parts (a side's figures, a footprint read from status, the
alternation, the latency ratio) and its --help."""

from __future__ import annotations

import itertools
from typing import Any

from benchmarks.fitting import (
    alternation,
    footprint_bytes,
    latency_ratio,
    side_figures,
)
from tests.support.benchmark_help import benchmark_help


def residency(model: str, from_: str, to: str) -> dict[str, str]:
    return {"event": "residency", "model": model, "from": from_, "to": to}


def test_a_sides_figures_count_releases_per_request() -> None:
    latencies = {"a": [0.1, 0.3, 0.2], "b": [0.5]}
    events = [residency("a", "cooling", "cold"), residency("b", "cooling", "cold")]
    figures = side_figures(latencies, events, withdrawals=2)
    assert figures["requests"] == {"a": 3, "b": 1}
    assert figures["releases"] == {"a": 1, "b": 1}
    assert figures["releases_per_request"] == 0.5
    assert figures["latency"]["a"]["median_s"] == 0.2
    assert figures["withdrawals"] == 2


def test_a_footprint_is_what_the_keeper_counts_off_the_host_else_on_it() -> None:
    entry = {"weights_bytes": 1, "kv_bytes": 2, "compute_bytes": 3}
    host = {**entry, "device": "cpu", "compute_bytes": 100}
    status = {
        "models": [
            {"name": "a", "footprint": {"measured": [host, {**entry, "device": "rpc:h:1"}]}},
            {"name": "b", "footprint": {"measured": [host]}},
            {"name": "c", "footprint": {"measured": []}},
        ]
    }
    counted = [footprint_bytes(status, name) for name in "abc"]
    assert counted == [6, 103, 0]


def test_help_names_its_options() -> None:
    text = benchmark_help("fitting")
    assert "--seconds" in text
    assert "--out" in text


def test_the_alternating_client_asks_the_pair_by_turns_and_the_third_now_and_then() -> None:
    assert list(itertools.islice(alternation(), 11)) == [
        "gemma",
        "smollm",
        "gemma",
        "smollm",
        "tiny",
        "gemma",
        "smollm",
        "gemma",
        "smollm",
        "tiny",
        "gemma",
    ]


def test_the_latency_ratio_is_the_geometric_mean_of_each_models() -> None:
    def side(**medians: float) -> dict[str, Any]:
        return {"latency": {m: {"median_s": v} for m, v in medians.items()}}

    assert latency_ratio(side(a=2.0, b=0.5), side(a=1.0, b=1.0)) == 1.0
    assert latency_ratio(side(a=1.1, b=1.1), side(a=1.0, b=1.0)) == 1.1
    assert latency_ratio(side(a=1.0), side(b=1.0)) is None
