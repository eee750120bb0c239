"""How many threads a daemon runs while it serves many requests at once.

Starts `python -m arbiterd daemon` (from --source, default this checkout: point it at another
checkout to measure that version the same way) with two models on SmolLM2-135M-Instruct, the
demo's chat model, waits until both are loaded, then sends --requests concurrent completions,
alternating the two models, and reads the daemon's thread count (/proc/PID/status) every 5 ms
until the last answer. Reports the count at idle, the peak while serving, and the threads by
name at the peak (/proc/PID/task/*/comm).

    python -m benchmarks.daemon_threads [--requests 32] [--source DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from arbiterd.cli.controlclient import ControlClient
from arbiterd.config import smollm_model_path
from arbiterd.errors import ArbiterError
from benchmarks.common import report

MODELS = ("left", "right")
START_TIMEOUT_S = 120.0
SAMPLE_S = 0.005


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def write_config(directory: Path, port: int, model: Path) -> Path:
    lines = [
        "[daemon]",
        f'http = "127.0.0.1:{port}"',
        f'socket = "{directory / "control.sock"}"',
        f'arena = "{directory / "arena"}"',
        f'journal = "{directory / "journal.sqlite3"}"',
    ]
    for name in MODELS:
        lines += [f"[models.{name}]", f'path = "{model}"', "n_ctx = 1024", "n_gpu_layers = 0"]
    config = directory / "config.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def threads(pid: int) -> tuple[int, list[str]]:
    """The process's thread count and its threads' names."""
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            continue  # the thread ended meanwhile
    return len(names), names


def wait_loaded(control: Path, daemon: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited with status {daemon.returncode}")
        try:
            with ControlClient.connect(control) as client:
                states = [m["state"] for m in client.call("status")["models"]]
        except (ArbiterError, OSError):
            states = []
        if states and all(state in ("warm", "cold") for state in states):
            return
        time.sleep(0.2)
    raise SystemExit("the models did not load in time")


def complete(url: str, model: str, index: int) -> float:
    started = time.monotonic()
    body = {"model": model, "prompt": f"Request {index}: count to ten.", "max_tokens": 16}
    httpx.post(f"{url}/completions", json=body, timeout=600).raise_for_status()
    return time.monotonic() - started


def measure(requests: int, source: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ad-threads-", dir="/tmp") as tmp:
        directory = Path(tmp)
        port = free_port()
        config = write_config(directory, port, smollm_model_path())
        env = {**os.environ, "PYTHONPATH": str(source)}
        with (directory / "daemon.log").open("w") as log:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "arbiterd", "daemon", "--config", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
                cwd=source,
            )
        try:
            wait_loaded(directory / "control.sock", daemon)
            idle, idle_names = threads(daemon.pid)
            counts: list[int] = []
            peak_names: list[str] = []
            done = threading.Event()

            def sample() -> None:
                nonlocal peak_names
                while not done.is_set():
                    count, names = threads(daemon.pid)
                    if not counts or count > max(counts):
                        peak_names = names
                    counts.append(count)
                    time.sleep(SAMPLE_S)

            sampler = threading.Thread(target=sample)
            sampler.start()
            url = f"http://127.0.0.1:{port}/v1"
            with ThreadPoolExecutor(requests) as pool:
                latencies = list(
                    pool.map(lambda i: complete(url, MODELS[i % len(MODELS)], i), range(requests))
                )
            done.set()
            sampler.join()
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
    return {
        "idle_threads": idle,
        "idle_by_name": dict(collections.Counter(idle_names)),
        "peak_threads": max(counts),
        "peak_by_name": dict(collections.Counter(peak_names)),
        "samples": len(counts),
        "requests": requests,
        "slowest_request_s": round(max(latencies), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument(
        "--source",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the arbiterd checkout the daemon runs from (default: this one)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {
        "benchmark": "daemon_threads",
        "source": str(args.source),
        "models": list(MODELS),
        **measure(args.requests, args.source.resolve()),
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
