"""A model split over two llama.cpp RPC servers on this machine (issue 27), in one run: the
in-place handoff (release with the KV kept on the host, restore, the next request's first
token) against the baseline of the same split killed and loaded again, its prompt evaluated
again to its first token; whether the greedy text after each round trip is the warm model's;
the bytes a restore moves over RPC against the weights' bytes, and the restore's time against
those bytes at the upload rate ggml's own tensor_set reaches on the same RPC device in the same run
(arbiterd.native.ggml.transfer_rates, measured while the model is released); each server's
resident anonymous memory (RssAnon: its clients' buffers, not the engine's code pages) warm
and cold; the prompt tokens evaluated after a round trip.

The servers are `arbiterd rpc-server` processes (ggml's server, serving the CPU) on 127.0.0.1.

    python -m benchmarks.rpc_handoff [--model GGUF] [--rounds 5] [--prefix-tokens 1000] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arbiterd.native import ggml, libllama, rpc
from arbiterd.spec import KvPolicy, ModelSpec, Residency
from arbiterd.worker.engine import InPlaceBackend, select_backend
from arbiterd.worker.engine.backend import LlamaBackend
from benchmarks.common import ratio, report, summary
from tests.support.requests import request_for
from tests.support.rpcservers import RpcServer, rpc_servers

TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun"
TRANSFER_BYTES = 64 * 1024 * 1024


def prompt_of(tokens: int) -> str:
    """About `tokens` tokens of text (one word is about one token for gemma's vocabulary)."""
    words = TEXT.split()
    return " ".join(words[i % len(words)] for i in range(tokens))


def spec_for(model: Path, servers: list[RpcServer], n_ctx: int) -> ModelSpec:
    return ModelSpec(
        name="split",
        path=model,
        n_ctx=n_ctx,
        residency=Residency.IN_PLACE,
        devices=tuple(server.device for server in servers),
    )


def ask(backend: LlamaBackend, text: str) -> tuple[float, int, str]:
    """One greedy streamed request: the seconds to its first token (what a handoff is timed
    to, as in benchmarks.worker_handoff), the prompt tokens it evaluated and its text."""
    body = {"prompt": text, "max_tokens": 4, "temperature": 0}
    chunks: list[tuple[float, dict[str, Any]]] = []
    started = time.perf_counter()
    answer = backend.generate(
        request_for("completion", body), lambda chunk: chunks.append((time.perf_counter(), chunk))
    )
    assert chunks, "the request streamed no chunk"
    said = "".join(chunk["choices"][0]["text"] for _, chunk in chunks if chunk.get("choices"))
    return chunks[0][0] - started, answer.prompt_tokens_evaluated, said


def rpc_device_name(server: RpcServer) -> str:
    """ggml's name (RPC0, RPC1, ...) of `server`'s first device, registered in this process:
    by its handle, not its place, since a process may have registered servers since gone."""
    library = libllama.loaded_libllama()
    handle = rpc.register_server(library, server.endpoint)[0]
    return next(d.name for d in ggml.devices(library) if d.handle == handle)


def let_go(server: RpcServer) -> int:
    """The server's resident anonymous memory once it has let go of the client that just
    disconnected: it frees a client's buffers when it sees the connection close, and answers
    the next client (this probe) only after that."""
    rpc.probe(server.endpoint)
    return server.anon_bytes()


def measure(model: Path, rounds: int, prefix_tokens: int, folder: Path) -> dict[str, Any]:
    prefix = prompt_of(prefix_tokens)
    n_ctx = prefix_tokens + 512
    with rpc_servers(folder, 2) as servers:
        cold_anon = [server.anon_bytes() for server in servers]
        backend = select_backend(spec_for(model, servers, n_ctx))
        assert isinstance(backend, InPlaceBackend), "the engine is not the arbiterd build"
        backend.load()
        ask(backend, prefix)  # the prefix is cached
        # What the model says to each round's prompt without a round trip: a round trip must
        # change nothing. (A fresh load evaluates the prompt in other batch shapes, whose
        # rounding may change a near tie: it is no control.)
        warm_texts = [ask(backend, prefix + f" and {n}")[2] for n in range(rounds)]
        handoffs, releases, restores, firsts, evaluated = [], [], [], [], []
        warm_anon, released_anon = [], []
        restore_bytes = weights = 0
        texts = []
        for n in range(rounds):
            warm_anon.append([server.anon_bytes() for server in servers])
            started = time.perf_counter()
            released = backend.release(KvPolicy.HOST)
            release_s = time.perf_counter() - started
            released_anon.append([let_go(server) for server in servers])
            if n == 0:
                # Measured with the model released: the servers are free for another client.
                rates = ggml.transfer_rates(
                    libllama.loaded_libllama(), rpc_device_name(servers[0]), TRANSFER_BYTES
                )
            started = time.perf_counter()
            restored = backend.restore()
            restore_s = time.perf_counter() - started
            seconds, tokens, text = ask(backend, prefix + f" and {n}")
            handoffs.append(release_s + restore_s + seconds)
            releases.append(release_s)
            restores.append(restore_s)
            firsts.append(seconds)
            evaluated.append(tokens)
            texts.append(text)
            restore_bytes = restored.weights_bytes + restored.kv_bytes
            weights = released.weights_bytes
        backend.close()
        baselines = []
        for n in range(rounds):
            started = time.perf_counter()
            fresh = select_backend(spec_for(model, servers, n_ctx))
            assert isinstance(fresh, InPlaceBackend)
            fresh.load()
            loaded_s = time.perf_counter() - started
            seconds, _, _ = ask(fresh, prefix + f" and {n}")
            baselines.append(loaded_s + seconds)  # to its first token, as a handoff is
            fresh.close()
    upload = rates.upload_bytes_per_s
    freed = [
        min(
            (w[i] - r[i]) / max(1, w[i] - cold_anon[i])
            for w, r in zip(warm_anon, released_anon, strict=True)
        )
        for i in range(2)
    ]
    return {
        "benchmark": "rpc_handoff",
        "model": model.name,
        "servers": 2,
        "rounds": rounds,
        "prefix_tokens": prefix_tokens,
        "handoff": summary(handoffs, "s"),
        "baseline_kill_reload_reprefill": summary(baselines, "s"),
        "baseline_over_handoff": ratio(statistics.median(baselines), statistics.median(handoffs)),
        "goal_baseline_over_handoff": 10.0,
        "release": summary(releases, "s"),
        "restore": summary(restores, "s"),
        "first_token_after_restore": summary(firsts, "s"),
        "restore_bytes_over_rpc": restore_bytes,
        "weights_bytes": weights,
        "restore_bytes_over_weights": ratio(restore_bytes, weights),
        "transfer_rates_first_server": rates.to_json(),
        "restore_over_bytes_at_upload_rate": ratio(
            statistics.median(restores), restore_bytes / upload
        ),
        "goal_restore_over_bytes_at_upload_rate": 2.0,
        "server_anon_cold_bytes": cold_anon,
        "server_anon_warm_bytes": warm_anon[-1],
        "server_anon_released_bytes": released_anon[-1],
        "server_share_freed_min": [round(share, 4) for share in freed],
        "goal_server_share_freed": 0.9,
        "prompt_tokens_evaluated_after_round_trip": max(evaluated),
        "same_text_as_warm": texts == warm_texts,
        "texts_after_round_trips": texts,
        "goal_prompt_tokens_evaluated": "<= suffix + 1 (the suffix ' and N': 2 tokens)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: the demo's gemma-3-270m)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from arbiterd.config import embedded_model_path  # noqa: PLC0415 (253 MB, on demand)

        model = embedded_model_path()
    with tempfile.TemporaryDirectory(prefix="arbiterd-rpc-bench-") as folder:
        report(measure(model, args.rounds, args.prefix_tokens, Path(folder)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
