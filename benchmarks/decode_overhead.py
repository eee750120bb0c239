"""What a generated token costs outside llama_decode (issue 42): on a GPU, where llama.cpp
decodes a 7B model's token in ~8-15 ms, the engine's own per-token work (planning the batch,
sampling, stop strings, chunks) is what sets how far arbiterd falls behind the engine it wraps.

    python -m benchmarks.decode_overhead [--model PATH] [--tokens 64] [--repeats 3] [--out FILE]

One in-place backend on the CPU (every CPU's thread), its requests run through the decoder as
the worker runs them (`begin`, then `step` until each has ended), streamed to a sink that keeps
the chunks. Every `llama_decode` call is timed; the rest of each run is the cost outside it. For
1 and for 4 sequences at once (distinct prompts, greedy, --tokens each): wall time, time in
llama_decode, and the time outside it per generated token in microseconds and as a share of
the wall time (llama_decode's own time is the baseline), the median of --repeats runs (each
after a warm-up run of the same shape).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp

from arbiterd.config import embedded_model_path
from arbiterd.errors import ArbiterError
from arbiterd.spec import ModelSpec
from arbiterd.worker.engine import Generation, select_backend
from arbiterd.worker.engine.backend import LlamaBackend
from arbiterd.worker.engine.records import never
from benchmarks.common import load_average, machine, report
from tests.support.requests import request_for

SEQUENCES = (1, 4)
PROMPT = "a story about the {n} lighthouse keepers and the storm that came over the bay"


class DecodeClock:
    """Times every llama_decode while installed (the decoder calls it through llama_cpp)."""

    def __init__(self) -> None:
        self.spent_s = 0.0
        self.calls = 0
        self._decode: Callable[..., int] = llama_cpp.llama_decode

    def __enter__(self) -> DecodeClock:
        def timed(ctx: Any, batch: Any) -> int:
            started = time.perf_counter()
            try:
                return self._decode(ctx, batch)
            finally:
                self.spent_s += time.perf_counter() - started
                self.calls += 1

        llama_cpp.llama_decode = timed
        return self

    def __exit__(self, *exc: object) -> None:
        llama_cpp.llama_decode = self._decode


def run_batch(backend: LlamaBackend, sequences: int, tokens: int, tag: str) -> dict[str, Any]:
    """`sequences` greedy requests begun together and stepped to their end, timed."""
    chunks: list[dict[str, Any]] = []
    with DecodeClock() as clock:
        started = time.perf_counter()
        for n in range(sequences):
            body = {"prompt": PROMPT.format(n=f"{tag} {n}"), "max_tokens": tokens}
            prepared = backend.prepare(request_for("completion", {**body, "temperature": 0}), never)
            backend.begin(str(n), prepared, chunks.append, never)
        ended: dict[str, Generation | ArbiterError] = {}
        while len(ended) < sequences:
            ended.update(backend.step())
        wall_s = time.perf_counter() - started
    generated = 0
    for outcome in ended.values():
        if not isinstance(outcome, Generation):
            raise outcome
        generated += outcome.completion_tokens
    outside_s = wall_s - clock.spent_s
    return {
        "wall_s": round(wall_s, 4),
        "decode_s": round(clock.spent_s, 4),
        "decode_calls": clock.calls,
        "generated_tokens": generated,
        "outside_decode_us_per_token": round(outside_s / generated * 1e6, 1),
        # the baseline, measured in the same run: llama_decode's own time
        "outside_share_of_wall": round(outside_s / wall_s, 4),
        "tokens_per_s": round(generated / wall_s, 2),
    }


def measure(model: Path, tokens: int, repeats: int) -> dict[str, Any]:
    backend = select_backend(
        ModelSpec(name="m", path=model, n_ctx=4096, n_gpu_layers=0, parallel=max(SEQUENCES))
    )
    assert isinstance(backend, LlamaBackend)
    backend.load()
    try:
        figures: dict[str, Any] = {}
        for sequences in SEQUENCES:
            run_batch(backend, sequences, tokens, "warm-up")
            runs = [run_batch(backend, sequences, tokens, f"run {r}") for r in range(repeats)]
            figures[f"sequences_{sequences}"] = {
                "outside_decode_us_per_token": statistics.median(
                    r["outside_decode_us_per_token"] for r in runs
                ),
                "outside_share_of_wall": statistics.median(
                    r["outside_share_of_wall"] for r in runs
                ),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                "runs": runs,
            }
        return figures
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_overhead",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
    )
    parser.add_argument("--model", type=Path, help="a GGUF (default: the demo's gemma-3-270m)")
    parser.add_argument("--tokens", type=int, default=64, help="generated per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each shape (median)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats: at least 1")
    model = args.model or embedded_model_path()
    load_before = load_average()
    result = {
        "benchmark": "decode_overhead",
        "model": str(model.name),
        "how": "the in-place backend's decoder on the CPU, every llama_decode timed; the rest "
        "of each run (batch planning, sampling, stop strings, chunks) per generated token",
        "figures": measure(model, args.tokens, args.repeats),
        "machine": machine(load_before),
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
