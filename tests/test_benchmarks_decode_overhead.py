"""benchmarks/decode_overhead.py on the tiny model: every figure it reports is measured."""

from __future__ import annotations

from pathlib import Path

from benchmarks.decode_overhead import SEQUENCES, measure


def test_it_times_the_decodes_and_the_rest_of_each_shape(tiny_model: Path) -> None:
    figures = measure(tiny_model, tokens=6, repeats=1)
    assert set(figures) == {f"sequences_{n}" for n in SEQUENCES}
    for n in SEQUENCES:
        (run,) = figures[f"sequences_{n}"]["runs"]
        assert run["generated_tokens"] == 6 * n
        # one decode per step, the prompts' included: at least one per token of the longest
        assert run["decode_calls"] >= 6
        assert 0 < run["decode_s"] < run["wall_s"]
        assert run["outside_decode_us_per_token"] > 0
        assert 0 < run["outside_share_of_wall"] < 1
