"""benchmarks.rpc_handoff runs (issue 27's figures): one round on the tiny model over two real
RPC servers, so the benchmark that gives the note its numbers cannot rot unseen."""

from __future__ import annotations

from pathlib import Path

from benchmarks import rpc_handoff


def test_the_rpc_handoff_benchmark_measures_a_round_trip_and_its_baseline(
    tmp_path: Path, tiny_model: Path
) -> None:
    figures = rpc_handoff.measure(tiny_model, rounds=1, prefix_tokens=40, folder=tmp_path)
    assert figures["handoff"]["count"] == figures["baseline_kill_reload_reprefill"]["count"] == 1
    assert figures["weights_bytes"] > 0
    assert figures["restore_bytes_over_rpc"] > figures["weights_bytes"]  # the KV came back too
    assert figures["transfer_rates_first_server"]["device"].startswith("RPC")
    assert figures["prompt_tokens_evaluated_after_round_trip"] <= 3  # " and 0" + 1
    assert figures["first_token_after_restore"]["median_s"] <= figures["handoff"]["median_s"]
    assert figures["same_text_as_warm"] is True
    assert all(
        c < w
        for c, w in zip(
            figures["server_anon_cold_bytes"], figures["server_anon_warm_bytes"], strict=True
        )
    )
