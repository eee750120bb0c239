"""A vision model's projector just in time (issue 12), on the tests' tiny model and projector in
this process, through the in-place backend (the arbiterd engine build).

Per round, a new image (so it is encoded, never found in the prompt cache):

- jit: the image request on a model whose projector comes on only to encode: the projector's
  load, encode and free times (its `encoder` steps) and the whole request's; then a follow-up
  text turn that sends the conversation again with its image: the prompt tokens it evaluated
  against its suffix (what the first turn's prompt did not have), and its device bytes, which
  hold no projector (the bytes kept off the device on the text path, against the same model
  with `encoder = "resident"`).
- beside vs swap: the same image request under no budget (the projector beside the weights)
  and under a budget one byte short of the warm model and its projector together (the weights
  leave while it encodes, the KV stays): the peak bytes each reports (`peak_bytes`, the
  engine's accounting), its time, the swap's release and restore times, the ratio swap /
  beside, and whether the greedy answers are the same.

On the CPU the "device" bytes are the host buffers the engine counts (llama.cpp's compute
buffers dominate them on a model this small); the projector's compute buffers are counted by
neither path.

    python -m benchmarks.vision [--rounds 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from arbiterd.spec import ModelSpec, Residency
from arbiterd.worker.engine import Generation, InPlaceBackend, select_backend
from arbiterd.worker.vision import MARKER
from benchmarks.common import report, summary
from tests.support.images import png
from tests.support.requests import request_for
from tests.support.tiny_gguf import write_tiny_llama
from tests.support.tiny_mmproj import TinyProjectorSpec, write_tiny_mmproj

QUESTION = f"look {MARKER} what is it"
MAX_TOKENS = 6
N_CTX = 1024


def chat(turns: list[tuple[str, str]], image: bytes) -> dict[str, Any]:
    return {
        "messages": [{"role": role, "content": text} for role, text in turns],
        "images": [base64.b64encode(image).decode()],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def eye(model: Path, mmproj: Path, *, resident: bool = False, budget: int = 0) -> InPlaceBackend:
    spec = ModelSpec(
        name="eye",
        path=model,
        n_ctx=N_CTX,
        n_gpu_layers=0,
        mmproj=mmproj,
        encoder_resident=resident,
        residency=Residency.IN_PLACE,
    )
    engine = select_backend(spec, vram_budget=budget)
    if not isinstance(engine, InPlaceBackend):
        raise SystemExit("needs the arbiterd engine build (scripts/setup.sh installs it)")
    engine.load()
    return engine


def timed(call: Callable[[], Generation]) -> tuple[Generation, float]:
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def step_s(generation: Generation, action: str) -> float:
    return sum(s.duration_s or 0.0 for s in generation.encoder_steps if s.action == action)


def answer(generation: Generation) -> str:
    return str(generation.response["choices"][0]["message"]["content"])


def jit_rounds(model: Path, mmproj: Path, rounds: int) -> dict[str, Any]:
    engine = eye(model, mmproj)
    resident = eye(model, mmproj, resident=True)
    load, encode, free, request, evaluated, suffix = [], [], [], [], [], []
    text_bytes = resident_text_bytes = 0
    try:
        for index in range(rounds):
            image = png(48, 40, seed=index)
            body = chat([("user", QUESTION)], image)
            first, took = timed(partial(engine.generate, request_for("chat", body), None))
            if [s.action for s in first.encoder_steps] != ["load", "encode", "free"]:
                raise SystemExit(f"round {index}: {first.encoder_steps}")
            load.append(step_s(first, "load"))
            encode.append(step_s(first, "encode"))
            free.append(step_s(first, "free"))
            request.append(took)
            turns = [("user", QUESTION), ("assistant", answer(first)), ("user", "and the dog")]
            follow = engine.generate(request_for("chat", chat(turns, image)), None)
            evaluated.append(follow.prompt_tokens_evaluated)
            suffix.append(follow.prompt_tokens - first.prompt_tokens)
            text_bytes = engine.resident_bytes()  # a text turn's: no projector
            resident.generate(request_for("chat", chat(turns, image)), None)
            resident_text_bytes = resident.resident_bytes()
    finally:
        engine.close()
        resident.close()
    return {
        "projector_load": summary(load, "s"),
        "projector_encode": summary(encode, "s"),
        "projector_free": summary(free, "s"),
        "image_request": summary(request, "s"),
        "follow_up_text_turn": {
            "prompt_tokens_evaluated": summary([float(n) for n in evaluated], "tokens"),
            "suffix_tokens": summary([float(n) for n in suffix], "tokens"),
            "evaluated_at_most_suffix_plus_1": all(
                e <= s + 1 for e, s in zip(evaluated, suffix, strict=True)
            ),
        },
        "text_path_device_bytes": {
            "jit": text_bytes,
            "resident": resident_text_bytes,
            "kept_off_the_device": resident_text_bytes - text_bytes,
            "projector_file_bytes": mmproj.stat().st_size,
        },
    }


def path_rounds(model: Path, mmproj: Path, rounds: int) -> dict[str, Any]:
    probe = eye(model, mmproj)
    budget = probe.resident_bytes() + mmproj.stat().st_size - 1
    probe.close()
    beside, swap = eye(model, mmproj), eye(model, mmproj, budget=budget)
    runs: dict[str, dict[str, list[float]]] = {
        name: {"request_s": [], "peak_bytes": [], "release_s": [], "restore_s": []}
        for name in ("beside", "swap")
    }
    same = True
    try:
        for index in range(rounds):
            image = png(48, 40, seed=1000 + index)
            answers = []
            # Alternated, so neither path always runs on a cache the other warmed.
            order = [("beside", beside), ("swap", swap)]
            for name, engine in order if index % 2 == 0 else order[::-1]:
                body = chat([("user", QUESTION)], image)
                generation, took = timed(partial(engine.generate, request_for("chat", body), None))
                paths = {s.path for s in generation.encoder_steps}
                if paths != {name}:
                    raise SystemExit(f"round {index}: {name} ran {paths}")
                run = runs[name]
                run["request_s"].append(took)
                run["peak_bytes"].append(float(generation.encoder_steps[-1].peak_bytes or 0))
                run["release_s"].append(step_s(generation, "release"))
                run["restore_s"].append(step_s(generation, "restore"))
                answers.append(answer(generation))
            same = same and answers[0] == answers[1]
    finally:
        beside.close()
        swap.close()
    median = {name: statistics.median(run["request_s"]) for name, run in runs.items()}
    return {
        "budget_bytes": budget,
        "beside": {
            "peak_bytes": int(max(runs["beside"]["peak_bytes"])),
            "request": summary(runs["beside"]["request_s"], "s"),
        },
        "swap": {
            "peak_bytes": int(max(runs["swap"]["peak_bytes"])),
            "within_budget": max(runs["swap"]["peak_bytes"]) <= budget,
            "request": summary(runs["swap"]["request_s"], "s"),
            "weights_release": summary(runs["swap"]["release_s"], "s"),
            "weights_restore": summary(runs["swap"]["restore_s"], "s"),
        },
        "swap_over_beside": {
            "request_time_median": round(median["swap"] / median["beside"], 3),
            "peak_bytes": round(
                max(runs["swap"]["peak_bytes"]) / max(runs["beside"]["peak_bytes"]), 3
            ),
        },
        "same_greedy_answers": same,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ad-vision-", dir="/tmp") as tmp:
        model = write_tiny_llama(Path(tmp) / "tiny.gguf")
        mmproj = write_tiny_mmproj(Path(tmp) / "tiny-mmproj.gguf")
        result = {
            "benchmark": "vision",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "model": {"file_bytes": model.stat().st_size, "n_ctx": N_CTX, "n_gpu_layers": 0},
            "projector": {
                "file_bytes": mmproj.stat().st_size,
                "image_tokens": TinyProjectorSpec().n_image_tokens,
            },
            "rounds": args.rounds,
            "jit": jit_rounds(model, mmproj, args.rounds),
            "beside_vs_swap": path_rounds(model, mmproj, args.rounds),
        }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
