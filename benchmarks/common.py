"""What every benchmark shares: the summary of a sample, percentiles and ratios,
printing/writing its JSON, a process's memory as /proc reports it, the host's memory copy rate,
the environment that runs a daemon from another checkout (a before/after in one run), and
reading a daemon's events."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from arbiterd.cli.controlclient import ControlClient

# /proc/PID/status fields (kB) → our names (bytes). RssAnon + RssFile + RssShmem = VmRSS
# (proc(5)); a model mapped from a memfd (the host copy) counts as RssShmem while mapped.
PROC_MEMORY_FIELDS = {
    "VmRSS": "rss_bytes",
    "RssAnon": "rss_anon_bytes",
    "RssFile": "rss_file_bytes",
    "RssShmem": "rss_shmem_bytes",
}
COPY_ARRAY_BYTES = 256 * 1024 * 1024
COPY_TRIES = 5
EVENTS_PAGE = 500  # the control socket's most events per call (EVENTS_PAGE_MAX)


def summary(values: list[float], unit: str) -> dict[str, float]:
    """count, median, p99 (nearest rank), min and max of `values`, keys suffixed by `unit`."""
    ordered = sorted(values)
    return {
        "count": len(ordered),
        f"median_{unit}": round(statistics.median(ordered), 6),
        f"p99_{unit}": round(ordered[math.ceil(0.99 * len(ordered)) - 1], 6),
        f"min_{unit}": round(ordered[0], 6),
        f"max_{unit}": round(ordered[-1], 6),
    }


def nearest_rank(ordered: list[float], fraction: float) -> float:
    """The nearest-rank percentile of `ordered` (ascending, not empty), as summary's p99."""
    return ordered[max(1, math.ceil(fraction * len(ordered))) - 1]


def ratio(ours: float, baseline: float) -> float | None:
    """ours / baseline, None when the baseline is 0 (no ratio to speak of)."""
    return round(ours / baseline, 4) if baseline > 0 else None


def report(result: dict[str, Any], out: Path | None) -> None:
    """Print the result as JSON, and write it to `out` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


def parse_proc_memory(status: str) -> dict[str, int]:
    """The PROC_MEMORY_FIELDS of a /proc/PID/status text, in bytes; a field the kernel does not
    report (RssAnon and the others came in Linux 4.5) is missing from the result."""
    found: dict[str, int] = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        name = PROC_MEMORY_FIELDS.get(key)
        if name is not None:
            number, unit = value.split()
            if unit != "kB":
                raise ValueError(f"/proc status: {key} in {unit!r}, not kB")
            found[name] = int(number) * 1024
    return found


def proc_memory(pid: int) -> dict[str, int]:
    """Resident memory of process `pid` (PROC_MEMORY_FIELDS), read from /proc/PID/status."""
    return parse_proc_memory(Path(f"/proc/{pid}/status").read_text())


def host_copy_bandwidth(nbytes: int = COPY_ARRAY_BYTES, tries: int = COPY_TRIES) -> dict[str, Any]:
    """Bytes per second one thread copies host memory to host memory (numpy.copyto, a memcpy),
    best of `tries` copies of an `nbytes` array; each byte is read once and written once."""
    source = np.ones(nbytes, dtype=np.uint8)  # written: its pages exist before the clock runs
    target = np.zeros(nbytes, dtype=np.uint8)
    target.fill(1)
    best_s = math.inf
    for _ in range(tries):
        started = time.perf_counter()
        np.copyto(target, source)
        best_s = min(best_s, time.perf_counter() - started)
    return {
        "how": "numpy.copyto of a host array into another, one thread, best of the tries",
        "array_bytes": nbytes,
        "tries": tries,
        "best_s": round(best_s, 6),
        "bytes_per_s": round(nbytes / best_s),
    }


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """--source and --baseline-source: the checkouts a benchmark runs the daemon from (see
    source_env), the baseline measured the same way first in the same run."""
    parser.add_argument(
        "--source",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the arbiterd checkout the daemon runs from (default: this one)",
    )
    parser.add_argument(
        "--baseline-source", type=Path, help="a checkout to measure the same way first"
    )


def load_average() -> list[float]:
    """The machine's load averages (1, 5, 15 min), rounded: what a run shared the CPUs with."""
    return [round(x, 2) for x in os.getloadavg()]


def machine(load_before: list[float]) -> dict[str, Any]:
    """The machine a run measured on: its CPUs, Python, and its load before and after."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
    }


def add_peer_arguments(parser: argparse.ArgumentParser, sides: tuple[str, ...]) -> None:
    """--model, --sides and --threads of a benchmark that sets arbiterd against llama-server on
    the CPU (contention, parallel): which model, which of `sides` to measure, threads each."""
    parser.add_argument(
        "--model",
        choices=("gemma", "tiny"),
        default="gemma",
        help="gemma-3-270m Q4_K_M (default) or the tests' tiny random GGUF (a quick check)",
    )
    parser.add_argument(
        "--sides",
        default=",".join(sides),
        help=f"which to measure, comma-separated (default: {','.join(sides)})",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="threads per server"
    )


def source_env(source: Path) -> dict[str, str]:
    """The environment in which `python -m arbiterd ...`, and every worker it starts (they
    inherit it), imports arbiterd from the checkout `source`: PYTHONPATH names it first, and
    PYTHONSAFEPATH (Python 3.11) keeps `-m` from putting the current directory (this checkout,
    for `python -m benchmarks.X`) before it. Checked by asking such a Python where arbiterd is;
    SystemExit when it would come from anywhere else."""
    paths = [str(source), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONSAFEPATH": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import arbiterd; print(arbiterd.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(source.resolve()):
        raise SystemExit(f"arbiterd would be imported from {where}, not from {source}")
    return env


def describe_source(source: Path) -> dict[str, Any]:
    """Which code a figure is of: the checkout's path, its git commit and whether its tracked
    files differ from it (None each when git cannot tell)."""

    def git(*args: str) -> str | None:
        done = subprocess.run(
            ["git", "-C", str(source), *args], capture_output=True, text=True, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "path": str(source),
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else status != "",
    }


def last_seq(control: Path) -> int:
    """The newest event's sequence number in the journal of the daemon at `control` (0: none)."""
    newest = 0
    with ControlClient.connect(control) as client:
        while page := client.call("events", after_seq=newest, limit=EVENTS_PAGE)["events"]:
            newest = max(int(e["seq"]) for e in page)
    return newest


def events_after(control: Path, seq: int) -> list[dict[str, Any]]:
    """Every event the daemon at `control` stored after `seq`, oldest first."""
    found: list[dict[str, Any]] = []
    with ControlClient.connect(control) as client:
        while page := client.call("events", after_seq=seq, limit=EVENTS_PAGE)["events"]:
            found += page
            seq = max(int(e["seq"]) for e in page)
    return found
