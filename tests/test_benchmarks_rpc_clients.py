"""benchmarks/rpc_clients: its --help (the measurement runs real servers and a model: a
benchmark, not a test)."""

from __future__ import annotations

from tests.support.benchmark_help import benchmark_help


def test_help_names_its_options() -> None:
    text = benchmark_help("rpc_clients")
    for option in ("--model", "--rounds", "--tokens", "--out"):
        assert option in text
