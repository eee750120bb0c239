"""Issue 42's numbers: one model's speed with one client and with 4 and 8 concurrent clients,
arbiterd against llama.cpp's own llama-server, measured one after another in the same run.

    python -m benchmarks.parallel [--seconds 30] [--repeats 5] [--clients 4,8]
        [--model gemma|tiny] [--sides arbiterd,llama-server-np1,llama-server-batched]
        [--threads N] [--parallel N] [--host-copy memfd|page-cache] [--source CHECKOUT]
        [--out FILE]

Three sides, one at a time (on a machine of 2 cores two servers decoding at once would measure
each other), each serving one model "m" on the CPU with --threads threads (default: every CPU;
arbiterd through n_threads, llama-server through -t):
- arbiterd: a daemon (tests.support.daemon, from --source's checkout) with n_ctx N_CTX (room for
  8 sequences of CTX_PER_SEQUENCE and the ~1k-token prompt) and the daemon's defaults otherwise
  (--host-copy sets where its weights are mapped from).
  `parallel` (issue 42: the sequences a model decodes in one batch) is set only by --parallel;
  without it the daemon's default holds, which the JSON names as the checkout's config says
  (ModelConfig; a checkout without the key serves one request at a time).
- llama-server-np1: `llama-server -np 1 -c N_CTX`, the single-client peer and the unbatched
  reference under concurrent clients (their requests queue for its one slot).
- llama-server-batched: for each client count N, `llama-server -np N -c N x CTX_PER_SEQUENCE`,
  a slot per client, their requests decoded together in one batch (continuous batching).
llama-server is the stock one built from the llama.cpp vendored in the engine's pinned
llama-cpp-python (benchmarks/llama_server.py builds and caches it; a side that needs it builds it
first when it is not cached).

Every request is a streamed /v1/completions (temperature 0, stream_options.include_usage) on a
connection of its own (contention.connection), timed by its client: TTFT is the send to the first
chunk with text, latency the send to the end of the stream. A prompt is its two numbers and
--prompt-words words drawn by a generator seeded with them (contention.prompt: ~60 gemma-3
tokens for the default 55 words; the tiny model's default 10, ~50 of its tokens), so no two
requests share more than their first tokens and no prompt cache takes a prefill away, except
where one is measured. ignore_eos is not sent: arbiterd refuses
fields it does not know (400), and a before and an after must ask the same; the drawn words run
MAX_TOKENS tokens on gemma-3-270m without it (short_answers counts the answers that stopped
early, and every rate is of the answers' own usage.completion_tokens).

Before the clock each server answers one request (arbiterd's model loads). Then:
- one client (the servers of one slot): --repeats requests of MAX_TOKENS tokens, one after
  another: decode tokens/s = completion_tokens / (latency - TTFT), and the whole request's time;
  a short request on a cached prompt: a fresh prompt sent twice with max_tokens 1, the second's
  latency; a prefill: a fresh prompt of --prefill-words words (~1k tokens: 1000 words, 300
  for the tiny model) with max_tokens 1,
  prompt_tokens / latency. Medians, and every value.
- N concurrent clients (each of --clients, default 4 and 8): each sends one request of
  MAX_TOKENS after another until --seconds have passed (those in flight then finish and count):
  generated tokens per second of the run (first send to last answer), TTFT and latency p50/p99
  (nearest rank), errors by kind, short answers.
Each side also reports other_load: the CPU time other programs took from its first server's
start to its last one's end (worker_handoff.CpuMeter; the sides run one after another on a
machine that may be shared).

Ratios arbiterd / peer and issue 42's goals, each with its figure and pass: single-client decode
tokens/s >= 0.95 x llama-server -np 1, the cached short request's latency <= 1.5 x its, prefill
tokens/s >= 0.95 x its, and at 4 and at 8 clients aggregate tokens/s >= 0.95 x llama-server
-np 4 / -np 8. The run exits 1 when a goal fails or is not measured (the JSON is printed, and
written, all the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks import llama_server
from benchmarks.common import (
    add_peer_arguments,
    describe_source,
    load_average,
    machine,
    nearest_rank,
    ratio,
    report,
    source_env,
)
from benchmarks.contention import ERROR_TEXT_CHARS, ERRORS_KEPT, connection, prompt
from benchmarks.load_run import model_file
from benchmarks.worker_handoff import CpuMeter
from tests.support.daemon import Daemon

MODEL = "m"
ARBITERD, NP1, BATCHED = "arbiterd", "llama-server-np1", "llama-server-batched"
SIDES = (ARBITERD, NP1, BATCHED)
MAX_TOKENS = 48
# A model's prompt words and long prompt's words: with the two numbers ~60 and ~1k tokens (the
# JSON reports the measured means). The tiny GGUF's tokenizer takes ~4.5 tokens a word: its
# prompts are shorter, to fit a batched peer's slot of CTX_PER_SEQUENCE and N_CTX.
WORDS = {"gemma": (55, 1000), "tiny": (10, 300)}
CTX_PER_SEQUENCE = 256  # a request's ~110 tokens, with room; a batched peer's slot each
N_CTX = 2048  # arbiterd's and -np 1's: 8 x CTX_PER_SEQUENCE, and the ~1k prompt with room
# Client numbers, so that no two phases of a side send the same prompt (a server's cache
# would skip a prefill the figure means to count): the single-client parts are negative.
WARM_UP, DECODE, CACHED, PREFILL = -1, -2, -3, -4
CLIENT_BLOCK = 1000  # N clients are numbered N x CLIENT_BLOCK + 0 .. N - 1
# The goals (issue 42, "Numbers").
GOAL_CLIENTS = (4, 8)
DECODE_RATIO_MIN = 0.95
CACHED_LATENCY_RATIO_MAX = 1.5
PREFILL_RATIO_MIN = 0.95
CLIENTS_RATIO_MIN = 0.95


# -- pure parts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One streamed request as its client saw it: `status` is the HTTP status or "exception",
    `error` "" for a whole answer, else what went wrong; `ttft_s` None when no text came; the
    tokens are the answer's usage (0 on error)."""

    sent_s: float  # since its phase started
    latency_s: float  # the send to the end of the stream
    ttft_s: float | None
    status: str
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """completion_tokens over the time after the first token (issue 42's decode rate)."""
        if self.error or self.ttft_s is None or self.latency_s <= self.ttft_s:
            return None
        return self.completion_tokens / (self.latency_s - self.ttft_s)


@dataclass(frozen=True)
class Streamed:
    """What a completion's event stream said: error "" when it ended with [DONE] after a usage;
    `first_text_s` is the clock's reading at the first chunk with text (None: none came)."""

    error: str
    first_text_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def read_stream(lines: Iterable[str], now: Callable[[], float]) -> Streamed:
    """The figures of a /v1/completions event stream, read line by line; `now` is read at the
    first chunk that carries text. Lines other than `data: ...` (blank lines, arbiterd's
    `: waiting` comments) carry nothing."""
    first: float | None = None
    usage: object = None
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            error, prompt_tokens, completion_tokens = usage_counts(usage)
            return Streamed(error, first, prompt_tokens, completion_tokens)
        chunk = parse_chunk(data)
        if isinstance(chunk, str):
            return Streamed(chunk, first)
        if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
            first = now()
        usage = chunk.get("usage") or usage
    return Streamed("bad stream: it ended without [DONE]", first)


def parse_chunk(data: str) -> dict[str, Any] | str:
    """A stream event's chunk, or what is wrong with it (an error event included)."""
    try:
        chunk = json.loads(data)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        return f"bad stream: {data[:ERROR_TEXT_CHARS]}"
    if "error" in chunk:
        return f"stream error: {json.dumps(chunk['error'])[:ERROR_TEXT_CHARS]}"
    return chunk


def usage_counts(usage: object) -> tuple[str, int, int]:
    """(error, prompt tokens, completion tokens) of a stream's last usage (None: none came)."""
    if not isinstance(usage, dict):
        return f"bad stream: usage {usage!r} before [DONE]", 0, 0
    try:
        return "", int(usage["prompt_tokens"]), int(usage["completion_tokens"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"bad stream: usage {usage!r}: {exc!r}"[:ERROR_TEXT_CHARS], 0, 0


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def spread(values: list[float]) -> dict[str, Any]:
    """The median of `values` and every value, in the order measured."""
    return {"median": median(values), "values": [round(v, 4) for v in values]}


def errors_figures(answers: list[Answer]) -> dict[str, Any]:
    errors = sorted((a for a in answers if a.error), key=lambda a: a.sent_s)
    return {
        "errors": len(errors),
        "errors_by_kind": dict(sorted(Counter(a.error.split(":", 1)[0] for a in errors).items())),
        "first_errors": [
            {"sent_s": round(a.sent_s, 3), "status": a.status, "error": a.error}
            for a in errors[:ERRORS_KEPT]
        ],
    }


def mean_prompt_tokens(answers: list[Answer]) -> float | None:
    answered = [a for a in answers if not a.error]
    return round(sum(a.prompt_tokens for a in answered) / len(answered), 1) if answered else None


def single_figures(
    decode: list[Answer], cached: list[Answer], prefill: list[Answer]
) -> dict[str, Any]:
    """One client's figures: decode rate and whole time of MAX_TOKENS answers, the cached short
    request's latency, the long prompt's prefill rate (errors count in none of them)."""
    decoded = [a for a in decode if not a.error]
    prefilled = [a for a in prefill if not a.error]
    return {
        "decode": {
            "requests": len(decode),
            **errors_figures(decode),
            "prompt_tokens_mean": mean_prompt_tokens(decode),
            "completion_tokens": [a.completion_tokens for a in decoded],
            "tokens_per_s": spread(
                [r for a in decoded if (r := a.decode_tokens_per_s) is not None]
            ),
            "whole_s": spread([a.latency_s for a in decoded]),
            "ttft_s": spread([a.ttft_s for a in decoded if a.ttft_s is not None]),
        },
        "cached_short": {
            "requests": len(cached),
            **errors_figures(cached),
            "prompt_tokens_mean": mean_prompt_tokens(cached),
            "latency_s": spread([a.latency_s for a in cached if not a.error]),
        },
        "prefill": {
            "requests": len(prefill),
            **errors_figures(prefill),
            "prompt_tokens_mean": mean_prompt_tokens(prefill),
            "latency_s": spread([a.latency_s for a in prefilled]),
            "tokens_per_s": spread([a.prompt_tokens / a.latency_s for a in prefilled]),
        },
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {
        "p50": round(nearest_rank(ordered, 0.5), 3) if ordered else None,
        "p99": round(nearest_rank(ordered, 0.99), 3) if ordered else None,
        "max": round(ordered[-1], 3) if ordered else None,
    }


def clients_figures(answers: list[Answer], run_s: float) -> dict[str, Any]:
    """What concurrent clients saw over a run of `run_s`: tokens count only answered requests,
    latency counts every one, TTFT every one that got text."""
    answered = [a for a in answers if not a.error]
    generated = sum(a.completion_tokens for a in answered)
    return {
        "run_s": round(run_s, 3),
        "requests": len(answers),
        **errors_figures(answers),
        "short_answers": sum(a.completion_tokens < MAX_TOKENS for a in answered),
        "generated_tokens": generated,
        "generated_tokens_per_s": round(generated / run_s, 3) if run_s > 0 else None,
        "prompt_tokens_mean": mean_prompt_tokens(answers),
        "ttft_s": percentiles([a.ttft_s for a in answers if a.ttft_s is not None]),
        "latency_s": percentiles([a.latency_s for a in answers]),
    }


def dig(tree: dict[str, Any], *keys: str) -> Any:
    """tree[k1][k2]..., None where a key is missing (a side or a part not measured)."""
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def side_ratio(sides: dict[str, Any], baseline: str, *keys: str) -> float | None:
    """arbiterd's figure at `keys` over `baseline`'s; None when either is not measured."""
    ours, theirs = dig(sides, ARBITERD, *keys), dig(sides, baseline, *keys)
    if ours is None or theirs is None:
        return None
    return ratio(ours, theirs)


def ratios(sides: dict[str, Any], clients: Iterable[int]) -> dict[str, Any]:
    """arbiterd's figures over the peer's: the single client's against -np 1, each client
    count's against -np N (and, for reading, against -np 1, and the peer's own batching gain)."""
    found: dict[str, Any] = {
        "single_decode_tokens_per_s": side_ratio(
            sides, NP1, "single", "decode", "tokens_per_s", "median"
        ),
        "cached_short_latency_s": side_ratio(
            sides, NP1, "single", "cached_short", "latency_s", "median"
        ),
        "prefill_tokens_per_s": side_ratio(
            sides, NP1, "single", "prefill", "tokens_per_s", "median"
        ),
    }
    for count in clients:
        keys = ("clients", str(count), "generated_tokens_per_s")
        found[f"clients_{count}_tokens_per_s"] = side_ratio(sides, BATCHED, *keys)
        found[f"clients_{count}_tokens_per_s_vs_np1"] = side_ratio(sides, NP1, *keys)
        batched, np1 = dig(sides, BATCHED, *keys), dig(sides, NP1, *keys)
        found[f"peer_batching_gain_{count}"] = (
            None if batched is None or np1 is None else ratio(batched, np1)
        )
    return found


def goals(found: dict[str, Any]) -> dict[str, Any]:
    """Issue 42's goals on `ratios`, each with its figure and pass (None: not measured, which
    fails)."""

    def goal(measured: float | None, passes: Callable[[float], bool], **bound: float) -> Any:
        return {"measured": measured, **bound, "pass": measured is not None and passes(measured)}

    checks = {
        "single_decode": goal(
            found.get("single_decode_tokens_per_s"),
            lambda r: r >= DECODE_RATIO_MIN,
            at_least=DECODE_RATIO_MIN,
        ),
        "cached_short_latency": goal(
            found.get("cached_short_latency_s"),
            lambda r: r <= CACHED_LATENCY_RATIO_MAX,
            at_most=CACHED_LATENCY_RATIO_MAX,
        ),
        "prefill": goal(
            found.get("prefill_tokens_per_s"),
            lambda r: r >= PREFILL_RATIO_MIN,
            at_least=PREFILL_RATIO_MIN,
        ),
    }
    for count in GOAL_CLIENTS:
        checks[f"clients_{count}"] = goal(
            found.get(f"clients_{count}_tokens_per_s"),
            lambda r: r >= CLIENTS_RATIO_MIN,
            at_least=CLIENTS_RATIO_MIN,
        )
    return {**checks, "pass": all(c["pass"] for c in checks.values())}


# -- the clients --------------------------------------------------------------------------------


def ask(http: httpx.Client, url: str, text: str, max_tokens: int, *, started: float) -> Answer:
    """One streamed completion of `text`, timed from its send; `started` (monotonic) is its
    phase's start."""
    body = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()

    def answer(status: str, streamed: Streamed) -> Answer:
        ttft = None if streamed.first_text_s is None else streamed.first_text_s - sent
        return Answer(
            sent - started,
            time.monotonic() - sent,
            ttft,
            status,
            streamed.error,
            streamed.prompt_tokens,
            streamed.completion_tokens,
        )

    try:
        with http.stream("POST", f"{url}/completions", json=body) as response:
            status = str(response.status_code)
            if response.status_code != 200:
                response.read()
                return answer(
                    status, Streamed(f"HTTP {status}: {response.text[:ERROR_TEXT_CHARS]}")
                )
            return answer(status, read_stream(response.iter_lines(), time.monotonic))
    except httpx.HTTPError as exc:
        return answer("exception", Streamed(f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_CHARS]))


def one_client(url: str, words: int, prefill_words: int, repeats: int) -> dict[str, Any]:
    """The single-client parts, one request at a time, `repeats` of each."""
    started = time.monotonic()
    with connection() as http:
        decode = [
            ask(http, url, prompt(DECODE, index, words), MAX_TOKENS, started=started)
            for index in range(repeats)
        ]
        cached = []
        for index in range(repeats):
            text = prompt(CACHED, index, words)
            first = ask(http, url, text, 1, started=started)
            # A failed first leaves nothing cached: it stands for the pair.
            cached.append(first if first.error else ask(http, url, text, 1, started=started))
        prefill = [
            ask(http, url, prompt(PREFILL, index, prefill_words), 1, started=started)
            for index in range(repeats)
        ]
    return single_figures(decode, cached, prefill)


def client(index: int, url: str, words: int, *, started: float, deadline: float) -> list[Answer]:
    """One concurrent client's requests, one after another, until `deadline` (monotonic)."""
    answers: list[Answer] = []
    with connection() as http:
        while time.monotonic() < deadline:
            text = prompt(index, len(answers), words)
            answers.append(ask(http, url, text, MAX_TOKENS, started=started))
    return answers


def concurrent_clients(url: str, count: int, words: int, seconds: float) -> dict[str, Any]:
    """`count` clients for `seconds`, and the figures of what they saw."""
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="parallel-client") as pool:
        futures = [
            pool.submit(
                client,
                count * CLIENT_BLOCK + index,
                url,
                words,
                started=started,
                deadline=started + seconds,
            )
            for index in range(count)
        ]
        answers = [answer for future in futures for answer in future.result()]
    return clients_figures(answers, time.monotonic() - started)


def warm_up(url: str, words: int) -> None:
    """One request before the clock (arbiterd's model loads); RuntimeError on a failure."""
    with connection() as http:
        answer = ask(http, url, prompt(WARM_UP, 0, words), MAX_TOKENS, started=time.monotonic())
    if answer.error:
        raise RuntimeError(f"warm-up: {answer.error}")


# -- the sides ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What every side is given: the model file, the threads a server decodes on, the words of
    a prompt and of the long one, the single-client repeats, the client counts and how long
    each count's clients send."""

    path: Path
    threads: int
    words: int
    prefill_words: int
    repeats: int
    clients: tuple[int, ...]
    seconds: float


def say(message: str) -> None:
    print(f"parallel: {message}", file=sys.stderr, flush=True)


def served_figures(url: str, load: Load, side: str) -> dict[str, Any]:
    """The single-client parts, then each client count, on the server at `url`."""
    warm_up(url, load.words)
    say(f"{side}: one client, {load.repeats} of each request")
    single = one_client(url, load.words, load.prefill_words, load.repeats)
    clients = {}
    for count in load.clients:
        say(f"{side}: {count} clients for {load.seconds} s")
        clients[str(count)] = concurrent_clients(url, count, load.words, load.seconds)
    return {"single": single, "clients": clients}


# The config's default is the one a model table without the key gets (ModelSpec's own default
# of 1 is not: the config always passes the key on).
PARALLEL_PROBE = """\
import dataclasses, json
from arbiterd.config import ModelConfig
field = {f.name: f for f in dataclasses.fields(ModelConfig)}.get("parallel")
default = None if field is None or field.default is dataclasses.MISSING else field.default
print(json.dumps({"has_key": field is not None, "default": default}))
"""


def parallel_in(source: Path) -> dict[str, Any]:
    """Whether the checkout's model table has issue 42's `parallel`, and its default, asked of
    a Python that imports arbiterd from `source` (the daemon's code, not this checkout's)."""
    done = subprocess.run(
        [sys.executable, "-c", PARALLEL_PROBE],
        env=source_env(source),
        capture_output=True,
        text=True,
        check=True,
    )
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def parallel_setting(source_has: dict[str, Any], given: int | None) -> dict[str, Any]:
    """What the JSON says of `parallel`: the config key written (None: not written) and the
    sequences a model decodes together as that and the checkout's default make it."""
    if given is not None:
        in_effect, why = given, "--parallel, written in the model's table"
    elif source_has["has_key"]:
        in_effect, why = source_has["default"], "the daemon's default (ModelConfig.parallel)"
    else:
        in_effect, why = 1, "the checkout has no parallel key: one request at a time"
    return {
        "config_key": given,
        "source_has_key": source_has["has_key"],
        "in_effect": in_effect,
        "why": why,
    }


def measure_arbiterd(
    load: Load, source: Path, parallel: dict[str, Any], host_copy: str | None
) -> dict[str, Any]:
    keys: dict[str, Any] = {"path": load.path, "n_ctx": N_CTX, "n_gpu_layers": 0}
    keys["n_threads"] = load.threads
    if parallel["config_key"] is not None:
        keys["parallel"] = parallel["config_key"]
    if host_copy is not None:
        keys["host_copy"] = host_copy
    daemon = Daemon({MODEL: keys}, env=source_env(source))
    try:
        daemon.wait_ready()
        figures = served_figures(daemon.url, load, ARBITERD)
        with daemon.client() as control:
            engine = control.call("status").get("engine")
    finally:
        daemon.cleanup()
    return {
        **figures,
        "server": {
            "what": "arbiterd, one model, the daemon's defaults but for the keys below",
            "source": describe_source(source),
            "model_keys": {k: v for k, v in keys.items() if k != "path"},
            "parallel": parallel,
            "engine": engine,
        },
    }


def peer_args(binary: Path, load: Load, slots: int, n_ctx: int) -> list[str]:
    args = [str(binary), "-m", str(load.path), "--alias", MODEL, "-np", str(slots)]
    return [*args, "-c", str(n_ctx), "-t", str(load.threads)]


def measure_np1(binary: Path, load: Load) -> dict[str, Any]:
    args = peer_args(binary, load, 1, N_CTX)
    with (
        tempfile.TemporaryDirectory(prefix="ad-parallel-") as folder,
        llama_server.serve(args, Path(folder)) as url,
    ):
        figures = served_figures(url, load, NP1)
    return {
        **figures,
        "server": {
            "what": "llama-server -np 1: one slot, concurrent requests queue for it",
            "args": args[1:],
        },
    }


def measure_batched(binary: Path, load: Load) -> dict[str, Any]:
    clients: dict[str, Any] = {}
    for count in load.clients:
        args = peer_args(binary, load, count, count * CTX_PER_SEQUENCE)
        with (
            tempfile.TemporaryDirectory(prefix="ad-parallel-") as folder,
            llama_server.serve(args, Path(folder)) as url,
        ):
            warm_up(url, load.words)
            say(f"{BATCHED}: {count} clients for {load.seconds} s")
            clients[str(count)] = {
                **concurrent_clients(url, count, load.words, load.seconds),
                "args": args[1:],
            }
    return {
        "clients": clients,
        "server": {
            "what": "llama-server -np N for N clients: a slot each, decoded together in one batch",
        },
    }


# -- main ---------------------------------------------------------------------------------------


def client_counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(part) for part in text.split(","))
    if not counts or min(counts) < 1:
        raise ValueError(text)
    return counts


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.parallel",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="The module's docstring says what each figure means.",
    )
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="how long each client count's clients send"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="each single-client request's repeats (default 5)"
    )
    parser.add_argument(
        "--clients",
        type=client_counts,
        default=GOAL_CLIENTS,
        help="concurrent client counts, comma-separated (default: 4,8, the goals' counts)",
    )
    add_peer_arguments(parser, SIDES)
    parser.add_argument(
        "--parallel",
        type=int,
        help="write parallel = N in arbiterd's model table (the checkout must have the key); "
        "default: not written, the daemon's default holds",
    )
    parser.add_argument(
        "--host-copy",
        choices=("memfd", "page-cache"),
        help="write host_copy = X in arbiterd's model table; default: not written (memfd, the "
        "daemon's default: the weights a CPU model computes with are read from its 4 KiB "
        "shmem pages, which costs decode speed against the file's page cache)",
    )
    parser.add_argument(
        "--prompt-words",
        dest="words",
        type=int,
        help="words after a prompt's numbers (default: the model's, ~60 tokens)",
    )
    parser.add_argument(
        "--prefill-words",
        type=int,
        help="words of the long prompt (default: the model's, ~1k tokens)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the arbiterd checkout the daemon runs from (default: this one)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    words, prefill_words = WORDS[args.model]
    if args.words is None:
        args.words = words
    if args.prefill_words is None:
        args.prefill_words = prefill_words
    sides = args.sides.split(",")
    if args.seconds <= 0 or min(args.repeats, args.threads, args.words, args.prefill_words) < 1:
        parser.error("need --seconds > 0 and --repeats, --threads, --*-words >= 1")
    if not sides or not set(sides) <= set(SIDES):
        parser.error(f"--sides: a comma-separated subset of {','.join(SIDES)}")
    if args.parallel is not None and args.parallel < 1:
        parser.error("--parallel: at least 1")
    parallel = None
    if ARBITERD in sides:
        source_has = parallel_in(args.source)
        if args.parallel is not None and not source_has["has_key"]:
            parser.error(f"--parallel: {args.source}'s config has no parallel key")
        parallel = parallel_setting(source_has, args.parallel)
    load_before = load_average()
    binary = llama_server.ensure() if set(sides) & {NP1, BATCHED} else None
    load_kwargs = {k: getattr(args, k) for k in ("threads", "words", "prefill_words", "repeats")}
    measured: dict[str, Any] = {}
    with model_file(args.model) as path:
        load = Load(path, clients=args.clients, seconds=args.seconds, **load_kwargs)
        for side in SIDES:
            if side not in sides:
                continue
            meter = CpuMeter()
            if side == ARBITERD:
                assert parallel is not None
                measured[side] = measure_arbiterd(load, args.source, parallel, args.host_copy)
            elif side == NP1:
                assert binary is not None
                measured[side] = measure_np1(binary, load)
            else:
                assert binary is not None
                measured[side] = measure_batched(binary, load)
            measured[side]["other_load"] = meter.report()
        file_bytes = path.stat().st_size
    found = ratios(measured, args.clients)
    result: dict[str, Any] = {
        "benchmark": "parallel",
        "ratios": {
            "how": "arbiterd's figure over the peer's, same run: single-client parts against "
            "llama-server -np 1, N clients against -np N (_vs_np1: against -np 1; "
            "peer_batching_gain: -np N over -np 1)",
            **found,
        },
        "goals": goals(found),
        "sides": measured,
        "setup": {
            "model": args.model,
            "model_file_bytes": file_bytes,
            "threads": args.threads,
            "repeats": args.repeats,
            "clients": list(args.clients),
            "seconds": args.seconds,
            "max_tokens": MAX_TOKENS,
            "prompt_words": args.words,
            "prefill_words": args.prefill_words,
            "n_ctx": N_CTX,
            "ctx_per_sequence": CTX_PER_SEQUENCE,
            "request": f"/v1/completions streamed with usage, temperature 0, max_tokens "
            f"{MAX_TOKENS} (the cached and prefill requests: 1), a connection each; a prompt of "
            "two numbers and words drawn from them, no prefix shared beyond the first tokens",
            "ignore_eos": "not sent: arbiterd refuses unknown fields; short_answers and "
            "completion_tokens say whether an answer stopped early",
            "warm_up": "one request per server before the clock",
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
