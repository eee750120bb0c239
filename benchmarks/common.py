"""What every benchmark shares: the summary of a sample, printing/writing its JSON, a process's
memory as /proc reports it, and the host's memory copy rate."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

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
