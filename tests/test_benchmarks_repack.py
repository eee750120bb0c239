"""benchmarks/repack.py on a small Q4_0 model: the real engine, repacking on and off."""

from __future__ import annotations

from pathlib import Path

from benchmarks import repack
from tests.support.benchmark_help import benchmark_help
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama

# Q4_0 layers the CPU repacks (AVX2, NEON): ~9 MB of them.
SMALL_Q4_0 = TinyModelSpec(n_layer=2, n_embd=1024, n_ff=4096, n_vocab=1024, quantized=True)


def test_help_names_every_option() -> None:
    shown = benchmark_help("repack")
    for option in ("--model", "--rounds", "--threads", "--out"):
        assert option in shown


def test_repacked_weights_are_the_process_own_memory_and_mapped_ones_are_not(
    tmp_path: Path,
) -> None:
    model = write_tiny_llama(tmp_path / "q4_0.gguf", SMALL_Q4_0)
    measured = repack.measure(model, rounds=1, threads=1)
    on, off = measured["median"]["repack"], measured["median"]["no_repack"]
    assert on["prompt_tokens"] == off["prompt_tokens"] > 100
    assert min(on["decode_tokens_per_s"], off["decode_tokens_per_s"]) > 0
    # Repacked layers are copies the process owns (beside its KV and compute buffers, which
    # it owns either way); without repacking they are the file's pages.
    assert measured["repack_own_memory_bytes"] > model.stat().st_size / 3
    assert set(measured["repack_speedup"]) == {"prompt", "decode"}
