"""The contention run (issue 43, "Numbers"): two models, --clients-per-model concurrent clients
each (default 3), each request a ~300-token prompt and 16 generated tokens, for --seconds
(default 45); arbiterd against llama.cpp's own llama-server, measured one after another in the
same run.

    python -m benchmarks.contention [--seconds 45] [--clients-per-model 3]
        [--model gemma|tiny] [--sides arbiterd,ceiling,router] [--threads N]
        [--source CHECKOUT] [--out FILE]

Three sides, each with the same clients sending the same requests, one side at a time (on a
machine of 2 cores two servers decoding at once would measure each other):
- arbiterd: a daemon (tests.support.daemon, from --source's checkout) serving models "a" and
  "b" on the same file, with the daemon's default policy keys (min_hold_s and the others
  unset) and n_ctx CTX_PER_SEQUENCE on the CPU; half the clients send to "a", half to "b".
- ceiling: every client on one model that never switches: `llama-server -np N` (N = all the
  clients, one slot each, CTX_PER_SEQUENCE per slot), which decodes the clients' requests in
  one batch. Until arbiterd runs a model's queued requests as a batch (the parallel-requests
  issue) this is a batched ceiling that arbiterd's one-request-at-a-time model cannot reach;
  the JSON says so.
- router: llama-server's router mode (--models-preset: "a" and "b" on the same file, a slot per
  client of each, --models-max 1), what a user whose two models do not fit together runs: a
  request for the model not loaded stops the loaded one's server and starts the other's.
llama-server is the stock one built from the llama.cpp vendored in the engine's pinned
llama-cpp-python (benchmarks/llama_server.py builds and caches it; a side that needs it builds
it first when it is not cached). Both run on --threads threads (default: every CPU), arbiterd's
models through n_threads.

Before its clock starts each side answers a, b, a, b (one request at a time; the ceiling: one),
so that every model has loaded, and arbiterd's have released and restored once. Then each client
(a thread with its own httpx client, a connection per request: see `connection`) sends one
non-streamed /v1/completions after another (max_tokens MAX_TOKENS, temperature 0) until
--seconds have passed; those in flight then finish and count. Every prompt begins with its
request and client number, then PROMPT_WORDS words drawn by a generator seeded with them: no two
requests share more than their first few tokens, so no server's prompt cache takes a prefill
away (a per-client prefix would let arbiterd's and llama-server's caches skip most of it, and
measure the caches rather than the sharing); each request costs a full prefill of ~300 tokens
everywhere, and the three sides get the same prompts.

Figures per side: requests (total, by model, errors by kind and the first few), generated tokens
(the answers' usage.completion_tokens) and prompt tokens, generated tokens per second of the run
(first request sent -> last answer), latency per request as its client saw it (send -> whole
answer: median = p50, p99 nearest rank, max), and other_load: the CPU time other programs took
while the side ran, from its server's start to its end (the sides run one after another, and a
machine shared with other work gives each a different share). arbiterd's also: handoffs
(arbiterd_handoffs_total from /metrics, after - before the clients), handoffs per request, the
mean handoff, and the worst wait: the longest wait_s of the daemon's handoff and wait events
during the run (a model waiting for the GPU token). Then the ratios arbiterd / ceiling and
arbiterd / router (generated tokens per second), and the issue's goals, each with its figure and
pass: tokens/s >= 0.8 x the ceiling and >= 1.5 x the router, p99 <= 10 s, handoffs per request
<= 0.1, 0 errors. The run exits 1 when a goal fails or is not measured (the JSON is printed, and
written, all the same).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks import llama_server
from benchmarks.common import (
    add_peer_arguments,
    describe_source,
    events_after,
    last_seq,
    load_average,
    machine,
    nearest_rank,
    report,
    source_env,
)
from benchmarks.load_run import handoff_figures, metrics_text, model_file, scrape
from benchmarks.worker_handoff import CpuMeter
from tests.support.daemon import Daemon

MODELS = ("a", "b")
SIDES = ("arbiterd", "ceiling", "router")
MAX_TOKENS = 16
# ~300 gemma-3 tokens: the words below are one token each, with their spaces; the JSON reports
# the measured mean.
PROMPT_WORDS = 290
WORDS = (
    *("the", "river", "stone", "light", "morning", "harbor", "boat", "wind", "green", "house"),
    *("road", "city", "market", "bread", "water", "field", "tree", "mountain", "summer"),
    *("winter", "night", "window", "door", "garden", "letter", "story", "paper", "table"),
    *("chair", "music", "voice", "friend", "father", "mother", "child", "school", "teacher"),
    *("book", "cloud", "rain", "snow", "fire", "horse", "bird", "fish", "forest", "valley"),
    *("bridge", "tower", "castle", "village", "street", "station", "train", "ship"),
)
CTX_PER_SEQUENCE = 1024  # a request's ~320 tokens, with room; the same on every side
REQUEST_TIMEOUT_S = 300.0  # a request may wait behind the other model's whole queue
ERRORS_KEPT = 5
ERROR_TEXT_CHARS = 300
# The goals (issue 43, "Numbers").
CEILING_RATIO_MIN = 0.8
ROUTER_RATIO_MIN = 1.5
P99_MAX_S = 10.0
HANDOFFS_PER_REQUEST_MAX = 0.1


# -- pure parts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it: `status` is the HTTP status or "exception", `error` is
    "" for a completion, else what went wrong; the tokens are the answer's usage (0 on error)."""

    model: str
    sent_s: float  # since the clients started
    latency_s: float
    status: str
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


def prompt(client: int, request: int, length: int) -> str:
    """The prompt of a client's request: its request and client number, then `length` words
    drawn from them (PROMPT_WORDS: ~300 tokens)."""
    draw = random.Random(client * 1_000_003 + request)
    words = " ".join(draw.choice(WORDS) for _ in range(length))
    return f"{request} {client}: {words}"


def side_figures(outcomes: list[Outcome], run_s: float) -> dict[str, Any]:
    """What one side's clients saw over a run of `run_s`."""
    errors = [o for o in outcomes if o.error]
    answered = [o for o in outcomes if not o.error]
    latencies = sorted(o.latency_s for o in outcomes)
    generated = sum(o.completion_tokens for o in answered)
    return {
        "run_s": round(run_s, 3),
        "requests": len(outcomes),
        "by_model": dict(sorted(Counter(o.model for o in outcomes).items())),
        "errors": len(errors),
        "errors_by_kind": dict(sorted(Counter(o.error.split(":", 1)[0] for o in errors).items())),
        "first_errors": [
            {"model": o.model, "sent_s": round(o.sent_s, 3), "status": o.status, "error": o.error}
            for o in sorted(errors, key=lambda o: o.sent_s)[:ERRORS_KEPT]
        ],
        "generated_tokens": generated,
        "generated_tokens_per_s": round(generated / run_s, 3) if run_s > 0 else None,
        "prompt_tokens_mean": (
            round(sum(o.prompt_tokens for o in answered) / len(answered), 1) if answered else None
        ),
        "latency_s": {
            "p50": round(nearest_rank(latencies, 0.5), 3) if latencies else None,
            "p99": round(nearest_rank(latencies, 0.99), 3) if latencies else None,
            "max": round(latencies[-1], 3) if latencies else None,
        },
    }


def wait_figures(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The waits for the GPU token the daemon's handoff and wait events say: how many, the
    longest and the model that waited it."""
    waits = [
        (float(e["wait_s"]), e.get("to") or e.get("model"))
        for e in events
        if e.get("event") in ("handoff", "wait") and e.get("wait_s") is not None
    ]
    worst = max(waits, default=None, key=lambda w: w[0])
    return {
        "how": "wait_s of the daemon's handoff and wait events during the run",
        "count": len(waits),
        "worst_wait_s": None if worst is None else round(worst[0], 3),
        "worst_wait_model": None if worst is None else worst[1],
    }


def tokens_ratio(sides: dict[str, Any], baseline: str) -> float | None:
    ours: float | None = sides.get("arbiterd", {}).get("generated_tokens_per_s")
    theirs: float | None = sides.get(baseline, {}).get("generated_tokens_per_s")
    if ours is None or not theirs:
        return None
    return round(ours / theirs, 4)


def goals(sides: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, each with its figure and pass (None: not measured, which fails)."""
    ours = sides.get("arbiterd", {})

    def goal(measured: float | None, passes: Callable[[float], bool], **bound: float) -> Any:
        return {"measured": measured, **bound, "pass": measured is not None and passes(measured)}

    per_request = ours.get("handoffs", {}).get("per_request")
    checks = {
        "vs_ceiling": goal(
            tokens_ratio(sides, "ceiling"), lambda r: r >= CEILING_RATIO_MIN, at_least=0.8
        ),
        "vs_router": goal(
            tokens_ratio(sides, "router"), lambda r: r >= ROUTER_RATIO_MIN, at_least=1.5
        ),
        "p99_latency_s": goal(
            ours.get("latency_s", {}).get("p99"), lambda s: s <= P99_MAX_S, at_most=P99_MAX_S
        ),
        "handoffs_per_request": goal(
            per_request, lambda h: h <= HANDOFFS_PER_REQUEST_MAX, at_most=HANDOFFS_PER_REQUEST_MAX
        ),
        "errors": goal(ours.get("errors"), lambda e: e == 0, at_most=0),
    }
    return {**checks, "pass": all(c["pass"] for c in checks.values())}


# -- the clients --------------------------------------------------------------------------------


def completion(response: httpx.Response) -> tuple[str, int, int]:
    """(error, prompt tokens, completion tokens) of `response`: error "" for a 200 with a
    completion and its usage."""
    if response.status_code != 200:
        return f"HTTP {response.status_code}: {response.text[:ERROR_TEXT_CHARS]}", 0, 0
    try:
        body = response.json()
        text, usage = body["choices"][0]["text"], body["usage"]
        counts = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"bad completion: {exc!r}: {response.text[:ERROR_TEXT_CHARS]}", 0, 0
    if not isinstance(text, str):
        return f"bad completion: text is {type(text).__name__}", 0, 0
    return "", *counts


def connection() -> httpx.Client:
    """A client's HTTP client: a new connection per request, on every side. llama-server's
    router drops a kept-alive connection now and then across a model switch ("Server
    disconnected without sending a response": 3 of 50 requests in a 4 s run, none of 169 with
    a connection each); on the loopback a connection costs well under a millisecond."""
    return httpx.Client(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_keepalive_connections=0))


def send(http: httpx.Client, url: str, model: str, text: str) -> tuple[str, str, int, int]:
    """(status, error, prompt tokens, completion tokens) of one completion."""
    body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0}
    try:
        response = http.post(f"{url}/completions", json=body)
    except httpx.HTTPError as exc:
        return "exception", f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_CHARS], 0, 0
    return str(response.status_code), *completion(response)


def client(
    index: int, model: str, url: str, words: int, *, started: float, deadline: float
) -> list[Outcome]:
    """One client's requests to `model`, one after another, until `deadline` (monotonic)."""
    outcomes: list[Outcome] = []
    with connection() as http:
        while (sent := time.monotonic()) < deadline:
            status, error, prompt_tokens, tokens = send(
                http, url, model, prompt(index, len(outcomes), words)
            )
            latency = time.monotonic() - sent
            outcomes.append(
                Outcome(model, sent - started, latency, status, error, prompt_tokens, tokens)
            )
    return outcomes


def run_clients(
    url: str, models: list[str], words: int, seconds: float
) -> tuple[list[Outcome], float]:
    """One client per entry of `models` (the model it sends to) for `seconds`: every outcome,
    and the run's length (the first send to the last answer)."""
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(models), thread_name_prefix="contention") as pool:
        futures = [
            pool.submit(
                client, index, model, url, words, started=started, deadline=started + seconds
            )
            for index, model in enumerate(models)
        ]
        outcomes = [outcome for future in futures for outcome in future.result()]
    return outcomes, time.monotonic() - started


def warm_up(url: str, models: tuple[str, ...], words: int) -> None:
    """One request per model in `models`, in order, one at a time; RuntimeError on a failure."""
    with connection() as http:
        for index, model in enumerate(models):
            _, error, _, _ = send(http, url, model, prompt(-1, index, words))
            if error:
                raise RuntimeError(f"warm-up of {model}: {error}")


# -- the sides ----------------------------------------------------------------------------------


def clients_models(per_model: int) -> list[str]:
    """The model of each client: a, b, a, b, ... (per_model of each)."""
    return [MODELS[index % len(MODELS)] for index in range(per_model * len(MODELS))]


@dataclass(frozen=True)
class Load:
    """What every side is given: the model file, the clients per model, how long they send,
    the threads a server decodes on and the words of a prompt."""

    path: Path
    per_model: int
    seconds: float
    threads: int
    words: int


def measure_arbiterd(load: Load, source: Path) -> dict[str, Any]:
    keys = {"path": load.path, "n_ctx": CTX_PER_SEQUENCE, "n_gpu_layers": 0}
    keys["n_threads"] = load.threads
    daemon = Daemon(dict.fromkeys(MODELS, keys), env=source_env(source))
    try:
        daemon.wait_ready()
        warm_up(daemon.url, MODELS * 2, load.words)
        before, seq = scrape(metrics_text(daemon)), last_seq(daemon.socket)
        outcomes, run_s = run_clients(
            daemon.url, clients_models(load.per_model), load.words, load.seconds
        )
        after, events = scrape(metrics_text(daemon)), events_after(daemon.socket, seq)
        with daemon.client() as control:
            engine = control.call("status").get("engine")
    finally:
        daemon.cleanup()
    figures = side_figures(outcomes, run_s)
    handoffs = handoff_figures(before, after, run_s)
    handoffs["per_request"] = (
        round(handoffs["count"] / figures["requests"], 4) if figures["requests"] else None
    )
    return {
        **figures,
        "handoffs": handoffs,
        "waits": wait_figures(events),
        "server": {
            "what": "arbiterd, models a and b on the same file, the daemon's default policy",
            "source": describe_source(source),
            "model_keys": {k: v for k, v in keys.items() if k != "path"},
            "engine": engine,
        },
    }


def measure_ceiling(binary: Path, load: Load) -> dict[str, Any]:
    slots = load.per_model * len(MODELS)
    args = [str(binary), "-m", str(load.path), "--alias", MODELS[0], "-np", str(slots)]
    args += ["-c", str(slots * CTX_PER_SEQUENCE), "-t", str(load.threads)]
    with (
        tempfile.TemporaryDirectory(prefix="ad-contention-") as folder,
        llama_server.serve(args, Path(folder)) as url,
    ):
        warm_up(url, MODELS[:1], load.words)
        outcomes, run_s = run_clients(url, [MODELS[0]] * slots, load.words, load.seconds)
    return {
        **side_figures(outcomes, run_s),
        "server": {
            "what": f"llama-server -np {slots}: every client on one model that never switches, "
            "its requests decoded together in one batch (a batched ceiling)",
            "args": args[1:],
        },
    }


def router_preset(path: Path, per_model: int, threads: int) -> str:
    """The --models-preset file: models a and b on `path`, a slot per client of each."""
    sections = [
        "version = 1",
        "[*]",
        f"c = {per_model * CTX_PER_SEQUENCE}",
        f"np = {per_model}",
        f"t = {threads}",
    ]
    for model in MODELS:
        sections += [f"[{model}]", f"model = {path}"]
    return "\n".join(sections) + "\n"


def measure_router(binary: Path, load: Load) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ad-contention-") as folder:
        preset = Path(folder) / "models.ini"
        preset.write_text(router_preset(load.path, load.per_model, load.threads))
        args = [str(binary), "--models-preset", str(preset), "--models-max", "1"]
        with llama_server.serve(args, Path(folder)) as url:
            warm_up(url, MODELS * 2, load.words)
            outcomes, run_s = run_clients(
                url, clients_models(load.per_model), load.words, load.seconds
            )
    return {
        **side_figures(outcomes, run_s),
        "server": {
            "what": "llama-server's router, models a and b, --models-max 1: a switch stops one "
            "model's server and starts the other's",
            "args": args[1:],
            "preset": router_preset(Path("MODEL"), load.per_model, load.threads).splitlines(),
        },
    }


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.contention",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="The module's docstring says what each figure means.",
    )
    parser.add_argument("--seconds", type=float, default=45.0, help="how long the clients send")
    parser.add_argument(
        "--clients-per-model", type=int, default=3, help="concurrent clients per model (>= 1)"
    )
    add_peer_arguments(parser, SIDES)
    parser.add_argument(
        "--prompt-words",
        dest="words",
        type=int,
        default=PROMPT_WORDS,
        help=f"words after a prompt's numbers (default {PROMPT_WORDS}: ~300 gemma-3 tokens)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the arbiterd checkout the daemon runs from (default: this one)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    sides = args.sides.split(",")
    if args.seconds <= 0 or min(args.clients_per_model, args.threads, args.words) < 1:
        parser.error("need --seconds > 0 and --clients-per-model, --threads, --prompt-words >= 1")
    if not sides or not set(sides) <= set(SIDES):
        parser.error(f"--sides: a comma-separated subset of {','.join(SIDES)}")
    load_before = load_average()
    binary = llama_server.ensure() if set(sides) & {"ceiling", "router"} else None
    measured: dict[str, Any] = {}
    with model_file(args.model) as path:
        for side in SIDES:
            if side not in sides:
                continue
            print(f"contention: measuring {side} for {args.seconds} s", file=sys.stderr)
            load = Load(path, args.clients_per_model, args.seconds, args.threads, args.words)
            meter = CpuMeter()
            if side == "arbiterd":
                measured[side] = measure_arbiterd(load, args.source)
            elif side == "ceiling":
                assert binary is not None
                measured[side] = measure_ceiling(binary, load)
            else:
                assert binary is not None
                measured[side] = measure_router(binary, load)
            measured[side]["other_load"] = meter.report()
        file_bytes = path.stat().st_size
    result: dict[str, Any] = {
        "benchmark": "contention",
        "ratios": {
            "how": "arbiterd's generated tokens per second over the baseline's, same run",
            "arbiterd_over_ceiling": tokens_ratio(measured, "ceiling"),
            "arbiterd_over_router": tokens_ratio(measured, "router"),
        },
        "goals": goals(measured),
        "sides": measured,
        "setup": {
            "model": args.model,
            "model_file_bytes": file_bytes,
            "models": list(MODELS),
            "clients_per_model": args.clients_per_model,
            "seconds": args.seconds,
            "threads": args.threads,
            "ctx_per_sequence": CTX_PER_SEQUENCE,
            "request": f"/v1/completions, not streamed, max_tokens {MAX_TOKENS}, temperature 0, "
            f"a prompt of its request and client number and {args.words} words drawn "
            "from them: no prefix shared between requests beyond their first tokens",
            "warm_up": "a, b, a, b one at a time (the ceiling: one request), before the clock",
            "order": "one side after another, never two servers at once",
            "llama_server": None if binary is None else str(binary),
            "llama_cpp_python": llama_server.engine_version(),
        },
        "machine": machine(load_before),
    }
    report(result, args.out)
    return 0 if result["goals"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
