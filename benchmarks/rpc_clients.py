"""What serving several clients costs (`arbiterd rpc-server --clients N`, rpcserver/front.py):
one model with every layer on an RPC server on this machine, on ggml's own server and on the
front, one after the other in one run. The front passes each connection's bytes to a server
process of its own: measured here are its cost on a release/restore round trip (the restore
reconnects, so it is served by a process started ahead, after the probe that precedes it took
another) and on decoding (every token's graph crosses the front twice), and the greedy text,
which must be the same.

    python -m benchmarks.rpc_clients [--model GGUF] [--rounds 5] [--tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arbiterd.config import embedded_model_path
from arbiterd.native import rpc
from arbiterd.spec import KvPolicy, ModelSpec, Residency
from arbiterd.worker.engine import InPlaceBackend, select_backend
from arbiterd.worker.engine.backend import LlamaBackend
from benchmarks.common import load_average, machine, ratio, report, summary
from tests.support.requests import request_for
from tests.support.rpcservers import start_server

PROMPT = "Q: Name the planets of the solar system, in order.\nA:"
SETTLE_S = 1.5  # after a restore: the front's processes started ahead are ready again


def decode(backend: LlamaBackend, tokens: int) -> tuple[float, str]:
    """Generated tokens per second of one greedy request (its prompt cached), and its text."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    started = time.perf_counter()
    answer = backend.generate(request_for("completion", body), None)
    seconds = time.perf_counter() - started
    return answer.completion_tokens / seconds, answer.response["choices"][0]["text"]


def side(model: Path, clients: int, rounds: int, tokens: int, folder: Path) -> dict[str, Any]:
    server = start_server(folder, clients=clients)
    try:
        spec = ModelSpec(
            name="m",
            path=model,
            n_ctx=1024,
            residency=Residency.IN_PLACE,
            devices=(server.device,),
        )
        backend = select_backend(spec)
        assert isinstance(backend, InPlaceBackend), "the engine is not the arbiterd build"
        backend.load()
        decode(backend, tokens)  # the prompt cached, the first graphs built
        rates, restores, texts = [], [], []
        for _ in range(rounds):
            rate, text = decode(backend, tokens)
            rates.append(rate)
            texts.append(text)
            backend.release(KvPolicy.HOST)
            time.sleep(SETTLE_S)
            started = time.perf_counter()
            rpc.probe(server.endpoint)  # as a worker asks before it restores (placement.py)
            backend.restore()
            restores.append(time.perf_counter() - started)
        backend.close()
    finally:
        server.kill()
    return {
        "clients": clients,
        "decode_tokens_per_s": summary(rates, "tok/s"),
        "probe_and_restore": summary(restores, "s"),
        "texts": sorted(set(texts)),
    }


def measure(model: Path, rounds: int, tokens: int) -> dict[str, Any]:
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="arbiterd-rpc-clients-") as folder:
        ggml = side(model, 1, rounds, tokens, Path(folder))
        front = side(model, 4, rounds, tokens, Path(folder))
    return {
        "benchmark": "rpc_clients",
        "model": model.name,
        "rounds": rounds,
        "tokens": tokens,
        "machine": machine(load_before),
        "ggml_server": ggml,
        "front_of_4_clients": front,
        "decode_front_over_ggml": ratio(
            front["decode_tokens_per_s"]["median_tok/s"],
            ggml["decode_tokens_per_s"]["median_tok/s"],
        ),
        "restore_front_over_ggml": ratio(
            front["probe_and_restore"]["median_s"], ggml["probe_and_restore"]["median_s"]
        ),
        "same_text": ggml["texts"] == front["texts"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: the demo's gemma-3-270m)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = args.model or embedded_model_path()  # the demo's, assembled on demand (253 MB)
    report(measure(model, args.rounds, args.tokens), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
