"""The load run (issue 24, "Numbers"): --clients clients (default 16), each alternating
requests between two models, for --seconds (default 60), through a real daemon; the goals are
0 errors and a flat RSS.

    python -m benchmarks.load_run [--seconds 60] [--clients 16] [--model tiny|gemma]
        [--n-gpu-layers 0] [--samples] [--out FILE]

The daemon (tests.support.daemon: its own config, socket, arena and journal in a private
folder under /tmp) serves two models, "a" and "b", on the same file: the tests' tiny random
GGUF (tests.support.tiny_gguf, written into a temporary folder) by default, or with --model
gemma the real gemma-3-270m Q4_K_M (the demo extra's package). Both models take the tests'
keys (tests.support.daemon.tiny: n_ctx 2048, min_hold_s 0.05, n_gpu_layers per
--n-gpu-layers, 0 = the CPU), so the GPU token changes hands as often as the requests ask.

Before the clock starts each model answers twice, alternately (a, b, a, b), so that both have
loaded, released and restored once: what they hold after their first handoff is the start of
the run, not a growth. Then every client (a thread of its own, with its own httpx connection)
sends one non-streamed completion after another, "a" then "b" then "a" ... (the even clients
start with "a", the odd ones with "b"), until --seconds have passed since the start; the
requests in flight then finish and count. Each prompt names its client and request, so no two
are alike. An error is any answer but a 200 whose body holds a completion, or an exception (a
timeout, a refused connection).

Figures:
- requests: by status ("200", another HTTP status, or "exception"), by model, and per second;
  errors: how many, by kind, and the first ERRORS_KEPT messages.
- latency: per request as its client saw it (send -> whole answer): median, p95, p99 (nearest
  rank), min and max; and the median of the requests sent in the first and in the last
  window (see RSS) with their ratio.
- handoffs: from the daemon's /metrics, scraped before the first client starts and after the
  last has finished: arbiterd_handoffs_total (and the mean of arbiterd_handoff_seconds) between
  the two scrapes, per second; the daemon's own requests_total by status; worker restarts.
- rss: VmRSS (/proc/PID/status) of the daemon and of each model's worker, read every
  SAMPLE_INTERVAL_S by a thread of its own from the start of the clients to the end of the
  last request: per process, the median of the samples in the first WINDOW_S and in the last
  WINDOW_S (half the run each when the run is shorter than two windows), their ratio last /
  first (the growth ratio), the least-squares slope over all samples (bytes per minute), and
  the largest sample. The worker pids are read from the daemon's status after the warm-up; a
  worker that restarted meanwhile is reported (its samples stop) rather than followed.
- goals: errors == 0, and every process's growth ratio under RSS_GROWTH_RATIO_MAX, each with
  its figure and pass, and pass for the two together. The run exits 1 when a goal fails (the
  JSON is printed, and written, all the same).

The baseline is in the same run: the first window's RSS (and latency) against the last's. On a
machine shared with other work the latencies include theirs: loadavg_before says how busy the
CPUs were before the daemon started.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import nearest_rank, proc_memory, report, summary
from benchmarks.worker_handoff import model_path
from tests.support.daemon import Daemon, serving, tiny
from tests.support.tiny_gguf import write_tiny_llama

MODELS = ("a", "b")
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 120.0  # a request waits behind the other model's queue and its handoff
SAMPLE_INTERVAL_S = 1.0
WINDOW_S = 10.0
RSS_GROWTH_RATIO_MAX = 1.10  # "RSS flat": the last window under 10% above the first
ERRORS_MAX = 0
ERRORS_KEPT = 5  # messages kept in the JSON; the rest are only counted
ERROR_TEXT_CHARS = 300


# -- pure parts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it: `status` is the HTTP status ("200", "503", ...) or
    "exception"; `error` is "" for a completion, else what went wrong."""

    model: str
    sent_s: float  # since the clients started
    latency_s: float
    status: str
    error: str = ""


def window_s(run_s: float) -> float:
    """The length of the first and of the last window of a run of `run_s`: WINDOW_S, or half
    the run when the run is shorter than two windows."""
    return min(WINDOW_S, run_s / 2)


def window_medians(
    points: list[tuple[float, float]], run_s: float
) -> tuple[float | None, float | None]:
    """The medians of the values whose time falls in the first and in the last window of the
    run (`window_s`), None for a window without any."""
    length = window_s(run_s)
    first = [value for t, value in points if t < length]
    last = [value for t, value in points if t >= run_s - length]
    return (
        statistics.median(first) if first else None,
        statistics.median(last) if last else None,
    )


def ratio(last: float | None, first: float | None) -> float | None:
    if last is None or first is None or first <= 0:
        return None
    return round(last / first, 4)


def rss_figures(samples: list[tuple[float, int]], run_s: float) -> dict[str, Any]:
    """One process's VmRSS samples, (seconds since the start, bytes): the window medians, the
    growth ratio (last / first), the slope over all samples and the largest sample."""
    points = [(t, float(rss)) for t, rss in samples]
    first, last = window_medians(points, run_s)
    slope = None
    if len(points) >= 2 and len({t for t, _ in points}) >= 2:
        fit = statistics.linear_regression([t for t, _ in points], [v for _, v in points])
        slope = round(fit.slope * 60)
    return {
        "samples": len(points),
        "first_window_median_bytes": None if first is None else round(first),
        "last_window_median_bytes": None if last is None else round(last),
        "growth_ratio": ratio(last, first),
        "slope_bytes_per_min": slope,
        "max_bytes": max((rss for _, rss in samples), default=None),
    }


def request_figures(outcomes: list[Outcome], run_s: float) -> dict[str, Any]:
    """Requests by status and by model, per second, and the errors: by kind, the first few."""
    errors = [o for o in outcomes if o.error]
    return {
        "total": len(outcomes),
        "by_status": dict(sorted(Counter(o.status for o in outcomes).items())),
        "by_model": dict(sorted(Counter(o.model for o in outcomes).items())),
        "per_s": round(len(outcomes) / run_s, 2) if run_s > 0 else None,
        "errors": len(errors),
        "errors_by_kind": dict(sorted(Counter(o.error.split(":", 1)[0] for o in errors).items())),
        "first_errors": [
            {"model": o.model, "sent_s": round(o.sent_s, 3), "status": o.status, "error": o.error}
            for o in sorted(errors, key=lambda o: o.sent_s)[:ERRORS_KEPT]
        ],
    }


def latency_figures(outcomes: list[Outcome], run_s: float) -> dict[str, Any]:
    """Latency over every request (errors included: a fast refusal shows as one), and the
    median of those sent in the first and the last window, with their ratio."""
    values = [o.latency_s for o in outcomes]
    if not values:
        return {"count": 0}
    first, last = window_medians([(o.sent_s, o.latency_s) for o in outcomes], run_s)
    return {
        **summary(values, "s"),
        "p95_s": round(nearest_rank(sorted(values), 0.95), 6),
        "first_window_median_s": None if first is None else round(first, 6),
        "last_window_median_s": None if last is None else round(last, 6),
        "last_over_first": ratio(last, first),
    }


def scrape(text: str) -> dict[str, float]:
    """A Prometheus text exposition as {sample name with its labels: value}, the labels
    sorted: 'arbiterd_requests_total{model="a",status="ok"}'."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def metric_deltas(
    before: dict[str, float], after: dict[str, float], prefix: str
) -> dict[str, float]:
    """after - before for every sample whose name starts with `prefix` (absent before: 0)."""
    return {
        name: after[name] - before.get(name, 0.0)
        for name in sorted(after)
        if name.startswith(prefix)
    }


def handoff_figures(
    before: dict[str, float], after: dict[str, float], run_s: float
) -> dict[str, Any]:
    """What the daemon's metrics say happened between the two scrapes."""
    count = round(
        after.get("arbiterd_handoffs_total", 0.0) - before.get("arbiterd_handoffs_total", 0.0)
    )
    seconds = after.get("arbiterd_handoff_seconds_sum", 0.0) - before.get(
        "arbiterd_handoff_seconds_sum", 0.0
    )
    requests = metric_deltas(before, after, "arbiterd_requests_total")
    restarts = metric_deltas(before, after, "arbiterd_worker_restarts_total")
    return {
        "how": "arbiterd_handoffs_total and arbiterd_handoff_seconds from /metrics, after - "
        "before the clients",
        "count": count,
        "per_s": round(count / run_s, 2) if run_s > 0 else None,
        "mean_s": round(seconds / count, 6) if count else None,
        "daemon_requests": {name: round(value) for name, value in requests.items() if value},
        "worker_restarts": round(sum(restarts.values())),
    }


def goals(requests: dict[str, Any], rss: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """0 errors and a flat RSS, each with what was measured; pass when both pass. A process
    without a growth ratio (no sample in a window) fails: flatness was not shown."""
    ratios = {name: figures["growth_ratio"] for name, figures in rss.items()}
    flat = bool(ratios) and all(r is not None and r < RSS_GROWTH_RATIO_MAX for r in ratios.values())
    errors_pass = requests["errors"] <= ERRORS_MAX
    return {
        "errors": {"measured": requests["errors"], "at_most": ERRORS_MAX, "pass": errors_pass},
        "rss_flat": {
            "growth_ratio_under": RSS_GROWTH_RATIO_MAX,
            "measured": ratios,
            "pass": flat,
        },
        "pass": errors_pass and flat,
    }


# -- the run ------------------------------------------------------------------------------------


class RssSampler:
    """VmRSS of each named process every SAMPLE_INTERVAL_S, on a thread of its own
    ("rss-sampler"): the clients' threads spend the run waiting on the daemon, and a sample
    must not wait behind them. The beat is kept against the start (a late sample does not
    push the next ones later). A process that is gone is sampled no more, and its name is
    kept in `gone`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: dict[str, list[tuple[float, int]]] = {name: [] for name in pids}
        self.gone: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._started = 0.0

    def start(self, started: float) -> None:
        self._started = started
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        beat = 0
        while True:
            now = time.monotonic() - self._started
            for name, pid in self.pids.items():
                if name in self.gone:
                    continue
                try:
                    self.samples[name].append((now, proc_memory(pid)["rss_bytes"]))
                # KeyError: an exited process not yet reaped (a zombie) reports no VmRSS.
                except (FileNotFoundError, ProcessLookupError, KeyError):
                    self.gone.append(name)
            beat += 1
            wait_s = self._started + beat * SAMPLE_INTERVAL_S - time.monotonic()
            if self._stop.wait(max(0.0, wait_s)):
                return


def completion_error(response: httpx.Response) -> str:
    """What is wrong with `response`: nothing ("") for a 200 that holds a completion."""
    if response.status_code != 200:
        return f"HTTP {response.status_code}: {response.text[:ERROR_TEXT_CHARS]}"
    try:
        text = response.json()["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"bad completion: {exc!r}: {response.text[:ERROR_TEXT_CHARS]}"
    return "" if isinstance(text, str) else f"bad completion: text is {type(text).__name__}"


def client(index: int, url: str, started: float, deadline: float) -> list[Outcome]:
    """One client's requests, alternating between the models, until `deadline` (monotonic)."""
    outcomes: list[Outcome] = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        while (sent := time.monotonic()) < deadline:
            model = MODELS[(index + len(outcomes)) % len(MODELS)]
            body = {
                "model": model,
                "prompt": f"Client {index}, request {len(outcomes)}: the harbor at dawn",
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            try:
                response = http.post(f"{url}/completions", json=body)
                status, error = str(response.status_code), completion_error(response)
            except httpx.HTTPError as exc:
                status, error = "exception", f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_CHARS]
            outcomes.append(Outcome(model, sent - started, time.monotonic() - sent, status, error))
    return outcomes


def metrics_text(daemon: Daemon) -> str:
    response = httpx.get(daemon.url.removesuffix("/v1") + "/metrics", timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    return response.text


def warm_up(daemon: Daemon) -> None:
    """a, b, a, b, one at a time: each model loads, releases and restores once."""
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        for index in range(2 * len(MODELS)):
            body = {"model": MODELS[index % len(MODELS)], "prompt": "Warm up", "max_tokens": 1}
            error = completion_error(http.post(f"{daemon.url}/completions", json=body))
            if error:
                raise RuntimeError(f"warm-up: {error}\n{daemon.log.read_text()}")


def worker_pids(daemon: Daemon) -> dict[str, int]:
    with daemon.client() as control:
        models = control.call("status")["models"]
    return {m["name"]: int(m["pid"]) for m in models if isinstance(m.get("pid"), int)}


@contextmanager
def model_file(which: str) -> Iterator[Path]:
    if which == "gemma":
        yield model_path(None)  # the demo extra's gemma-3-270m Q4_K_M, assembled once
        return
    with tempfile.TemporaryDirectory(prefix="ad-load-") as folder:
        yield write_tiny_llama(Path(folder) / "tiny.gguf")


def measure(daemon: Daemon, clients: int, seconds: float) -> dict[str, Any]:
    warm_up(daemon)
    pids = {
        "daemon": daemon.process.pid,
        **{f"worker {m}": p for m, p in worker_pids(daemon).items()},
    }
    before = scrape(metrics_text(daemon))
    sampler = RssSampler(pids)
    started = time.monotonic()
    sampler.start(started)
    try:
        with ThreadPoolExecutor(max_workers=clients, thread_name_prefix="load-client") as pool:
            futures = [
                pool.submit(client, index, daemon.url, started, started + seconds)
                for index in range(clients)
            ]
            outcomes = [outcome for future in futures for outcome in future.result()]
        run_s = time.monotonic() - started
    finally:
        sampler.stop()
    after = scrape(metrics_text(daemon))
    pids_after = {f"worker {m}": p for m, p in worker_pids(daemon).items()}
    changed = sorted(name for name, pid in pids_after.items() if pids.get(name) != pid)
    requests = request_figures(outcomes, run_s)
    rss = {name: rss_figures(sampler.samples[name], run_s) for name in pids}
    return {
        "run_s": round(run_s, 3),
        "requests": requests,
        "latency": latency_figures(outcomes, run_s),
        "handoffs": handoff_figures(before, after, run_s),
        "rss": {
            "how": f"VmRSS every {SAMPLE_INTERVAL_S} s; windows of "
            f"{window_s(run_s):.1f} s at the start and the end of the run; growth = last / "
            "first window median",
            "pids": pids,
            "gone_during_run": sampler.gone,
            "workers_replaced": changed,
            **rss,
        },
        "goals": goals(requests, rss),
        "series": sampler.samples,
    }


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.load_run",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="The module's docstring says what each figure means.",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the clients send")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (>= 2)")
    parser.add_argument(
        "--model",
        choices=("tiny", "gemma"),
        default="tiny",
        help="the tests' tiny random GGUF (default) or gemma-3-270m Q4_K_M",
    )
    parser.add_argument(
        "--n-gpu-layers", type=int, default=0, help="layers on the GPU (0: CPU; -1: all)"
    )
    parser.add_argument("--samples", action="store_true", help="include every RSS sample")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.clients < 2:
        parser.error("need --seconds > 0 and --clients >= 2")
    load_before = [round(x, 2) for x in os.getloadavg()]
    with model_file(args.model) as path:
        keys = tiny(path, n_gpu_layers=args.n_gpu_layers)
        with serving(dict.fromkeys(MODELS, keys)) as daemon:
            measured = measure(daemon, args.clients, args.seconds)
            with daemon.client() as control:
                engine = control.call("status").get("engine")
        file_bytes = path.stat().st_size
    series = measured.pop("series")
    result: dict[str, Any] = {
        "benchmark": "load_run",
        "goals": measured.pop("goals"),
        **measured,
        "setup": {
            "model": args.model,
            "model_file_bytes": file_bytes,
            "models": list(MODELS),
            "model_keys": {k: v for k, v in keys.items() if k != "path"},
            "clients": args.clients,
            "seconds": args.seconds,
            "request": f"/v1/completions, not streamed, max_tokens {MAX_TOKENS}, temperature 0, "
            "a prompt naming its client and request",
            "warm_up": "a, b, a, b, one at a time, before the clock",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "engine": engine,
            "loadavg_before": load_before,
        },
    }
    if args.samples:
        result["rss_samples"] = {
            name: [[round(t, 2), rss] for t, rss in points] for name, points in series.items()
        }
    report(result, args.out)
    return 0 if result["goals"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
