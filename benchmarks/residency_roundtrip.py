"""One model's residency round trips through the in-place backend, in this process: what a release
frees, what a restore costs, and whether decoding afterwards gives the very same logits.

For each KV policy (host, device, drop) and --rounds times: generate on a fixed prompt with
greedy sampling, release, read the memory the device (NVML when the model is on an NVIDIA GPU,
else this process's RSS) uses, restore, generate the same request again. Checks, per round:

- freed: device memory used before the release minus after it, against what the engine says it
  released (weights + KV + compute buffers, llama_context_residency_stats); the goal is ≥ 95 %.
  RSS counts only touched pages, so on the CPU the goal is weights + KV (the compute buffer is
  reserved for a 512-token batch's logits and mostly never touched).
- identical: the text and the final logits (all n_vocab floats, compared bit for bit) of the
  generation after the restore equal those of a control generation on the same warm context
  before the release (same cached prefix, so the same decode calls).
- restore_s against bytes ÷ bandwidth: the host→device (or host→host) copy rate measured in the
  same run with the same buffers is the floor; the ratio says how far a restore is from it.

Also times a reload-backend round trip of the same model for comparison: restore alone, and
restore + the same generation (on the CPU the reload backend maps the weights, so its restore
returns before reading them and its first decode pays). Needs the arbiterd
engine build (scripts/setup.sh installs it); --random-model writes a random-weight llama GGUF of
about the given size first (a model to measure with on a machine that has none).

--device vulkan (issue 25) puts every layer on the engine's Vulkan device (llvmpipe on a machine
without a GPU: benchmarks/on_device.py) and checks that the weights are there by the engine's
own stats. The floor is then the device's own copy rate, measured in the same run through ggml's
ggml_backend_tensor_set/get on a tensor the size of the weights (arbiterd.native.ggml
.transfer_rates), and each policy's release and restore are set against it: release_vs_download
= release median ÷ ((weights + the KV bytes saved) ÷ download rate), restore_vs_upload = restore
median ÷ ((weights + the KV bytes set back) ÷ upload rate); the goal is ≤ 1.5 for both. The
*_first_touch ratios set them against the first copy into new memory instead (a release's
shadow and a restore's buffers are new each time; on llvmpipe, whose device memory is the
host's, that first copy pays a page fault per page). On a
device the memory freed is not read (llvmpipe's memory figures are fixed accounting, see
ggml.Device.on_cpu, and no NVML answers for Vulkan): the engine's stats say what was released.
It also runs benchmarks.first_release (--fresh-processes fresh processes): the first release of
a process against its later ones.

    python -m benchmarks.residency_roundtrip [--model GGUF | --random-model MB]
        [--device cpu|vulkan] [--n-gpu-layers -1] [--rounds 3] [--prompt-words 400]
        [--max-tokens 16] [--fresh-processes N] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from arbiterd.native import ggml, libllama
from arbiterd.spec import KvPolicy, ModelSpec, Residency
from arbiterd.worker import engine
from arbiterd.worker.engine import InPlaceBackend, ReloadBackend, select_backend
from arbiterd.worker.engine.inplace import context_pointer
from benchmarks import first_release, on_device
from benchmarks.common import report, summary
from tests.support.requests import request_for

MAX_TOKENS = 16
N_CTX = 2048
FREED_GOAL = 0.95
DEVICE_GOAL_RATIO = 1.5  # issue 25: release and restore within 1.5x of the device's copy rates
FRESH_PROCESSES_ON_DEVICE = 10
FRESH_ROUNDS = 4
FRESH_PROMPT_WORDS = 30


@dataclass
class Memory:
    """Reads the memory the model's device uses: NVML's used bytes of GPU 0, or this process's
    RSS when the model runs on the CPU (or NVML is not there)."""

    what: str
    read: Callable[[], int]
    # Whether reserved memory counts whole: a device allocation does; RSS counts only the pages
    # touched, and the CPU compute buffer (sized for a 512-token batch's logits) is mostly not.
    counts_reserved: bool
    measured: bool = True  # False: nothing reads this device's memory; `read` says 0


NOT_MEASURED = Memory(
    "not measured on a Vulkan device: no NVML, and llvmpipe's figures are fixed accounting "
    "(the engine's residency stats say what was released)",
    lambda: 0,
    counts_reserved=True,
    measured=False,
)


def device_memory(on_gpu: bool) -> Memory:
    if on_gpu:
        try:
            import pynvml  # type: ignore[import-untyped]  # noqa: PLC0415 (GPU runs only)

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(handle)
            return Memory(
                f"nvml used bytes of {name}",
                lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
                counts_reserved=True,
            )
        except Exception as exc:
            print(f"NVML unavailable ({exc}); measuring RSS")
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * page

    return Memory("process RSS", rss, counts_reserved=False)


def final_logits(llm: llama_cpp.Llama) -> str:
    """A digest of the last decoded position's logits, bit for bit."""
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    raw = ctypes.string_at(pointer, n_vocab * ctypes.sizeof(ctypes.c_float))
    return hashlib.sha256(raw).hexdigest()


def generate(
    backend: InPlaceBackend | ReloadBackend, prompt: str, max_tokens: int
) -> tuple[str, str, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    result = backend.generate(request_for("completion", body), None)
    text = result.response["choices"][0]["text"]
    llm = backend._require_llm()
    return text, final_logits(llm), result.prompt_tokens_evaluated


def copy_bandwidth(on_gpu: bool, nbytes: int) -> tuple[str, float | None]:
    """Bytes per second of the copy a restore makes, best of 5: host→device from pinned memory
    (through torch, when it is installed) for a GPU model, host→host memcpy otherwise."""
    if on_gpu:
        try:
            import torch  # type: ignore[import-not-found]  # noqa: PLC0415 (optional)
        except ImportError:
            return "host→device (torch not installed: not measured)", None
        source = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            started = time.perf_counter()
            target.copy_(source)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        return "host→device from pinned memory (torch)", nbytes / best
    buffer = (ctypes.c_char * nbytes)()
    target_host = (ctypes.c_char * nbytes)()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        ctypes.memmove(target_host, buffer, nbytes)
        best = min(best, time.perf_counter() - started)
    return "host→host memcpy", nbytes / best


def round_trips(
    spec: ModelSpec, prompt: str, rounds: int, memory: Memory, max_tokens: int
) -> dict[str, Any]:
    backend = select_backend(spec)
    if not isinstance(backend, InPlaceBackend):
        raise SystemExit(f"no in-place backend: {backend.fallback_reason}")
    loaded_before = memory.read()
    moved = backend.load()
    loaded = memory.read()
    llm = backend._require_llm()
    ctx = context_pointer(llm)
    result: dict[str, Any] = {
        "load_s": round(moved.duration_s, 4),
        "load_bytes": loaded - loaded_before,
        "policies": {},
    }
    first_text, _, first_evaluated = generate(backend, prompt, max_tokens)
    result["prompt_tokens"] = first_evaluated
    for kv in (KvPolicy.HOST, KvPolicy.DEVICE, KvPolicy.DROP):
        rows = []
        for _ in range(rounds):
            control_text, control_logits, _ = generate(backend, prompt, max_tokens)
            flags = backend._flags(kv)
            expected = backend._api.stats(ctx, flags)
            before = memory.read()
            released = backend.release(kv)
            after = memory.read()
            restored = backend.restore()
            back = memory.read()
            started = time.perf_counter()
            text, logits, evaluated = generate(backend, prompt, max_tokens)
            generated_s = time.perf_counter() - started
            freed = before - after
            goal = (
                expected.device_bytes
                if memory.counts_reserved
                else (expected.weights_bytes + expected.kv_bytes)
            )
            rows.append(
                {
                    "release_s": released.duration_s,
                    "restore_s": restored.duration_s,
                    # What crossed to the host and back: the weights, and the KV bytes the
                    # state API saved and set back (host), none for device and drop.
                    "released_bytes": released.weights_bytes + released.kv_bytes,
                    "restored_bytes": restored.weights_bytes + restored.kv_bytes,
                    "restore_and_generate_s": restored.duration_s + generated_s,
                    "expected_freed_bytes": expected.device_bytes,
                    "weights_bytes": expected.weights_bytes,
                    "kv_bytes": expected.kv_bytes,
                    "compute_bytes": expected.compute_bytes,
                    "freed_bytes": freed,
                    "freed_fraction": (freed / goal if goal else 0) if memory.measured else None,
                    "returned_bytes": back - after,
                    "disk_read_bytes": restored.disk_read_bytes,
                    "prompt_tokens_evaluated_after": evaluated,
                    "identical_text": text == control_text,
                    "identical_logits": logits == control_logits
                    if kv is not KvPolicy.DROP
                    else None,
                    "same_as_first": text == first_text,
                }
            )
        result["policies"][kv.value] = summarise(rows)
    backend.close()
    return result


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    weights_kv = rows[0]["weights_bytes"] + rows[0]["kv_bytes"]
    restore = statistics.median(row["restore_s"] for row in rows)
    fractions = [row["freed_fraction"] for row in rows if row["freed_fraction"] is not None]
    return {
        "rounds": rows,
        "release": summary([row["release_s"] for row in rows], "s"),
        "restore": summary([row["restore_s"] for row in rows], "s"),
        "restore_and_generate": summary([row["restore_and_generate_s"] for row in rows], "s"),
        "restore_rate_bytes_per_s": round(weights_kv / restore) if restore else None,
        "min_freed_fraction": round(min(fractions), 4) if fractions else None,
        "freed_goal_met": all(f >= FREED_GOAL for f in fractions) if fractions else None,
        "all_identical": all(
            row["identical_text"] and row["identical_logits"] is not False for row in rows
        ),
    }


def versus_device(policy: dict[str, Any], rates: ggml.TransferRates) -> dict[str, Any]:
    """One policy's release and restore medians against the device's measured copy rates."""
    rows = policy["rounds"]
    released = int(statistics.median(row["released_bytes"] for row in rows))
    restored = int(statistics.median(row["restored_bytes"] for row in rows))
    release = on_device.versus_floor(
        policy["release"]["median_s"],
        released,
        rates.download_bytes_per_s,
        rates.first_download_bytes_per_s,
    )
    restore = on_device.versus_floor(
        policy["restore"]["median_s"],
        restored,
        rates.upload_bytes_per_s,
        rates.first_upload_bytes_per_s,
    )
    ratios = [figure["ratio"] for figure in (release, restore) if figure["ratio"] is not None]
    return {
        "release_vs_download": release,
        "restore_vs_upload": restore,
        "goal_met": all(ratio <= DEVICE_GOAL_RATIO for ratio in ratios),
    }


def reload_round_trip(spec: ModelSpec, prompt: str, rounds: int, max_tokens: int) -> dict[str, Any]:
    backend = ReloadBackend(spec)
    backend.load()
    generate(backend, prompt, max_tokens)
    restores, totals = [], []
    for _ in range(rounds):
        backend.release(KvPolicy.HOST)
        restored = backend.restore().duration_s
        started = time.perf_counter()
        generate(backend, prompt, max_tokens)
        restores.append(restored)
        totals.append(restored + time.perf_counter() - started)
    backend.close()
    # A CPU model's weights are mapped from the host copy: its restore returns before their
    # pages are read, and the first decode pays for them; compare restore_and_generate.
    return {"restore": summary(restores, "s"), "restore_and_generate": summary(totals, "s")}


def random_model(megabytes: int, directory: Path) -> Path:
    """A random-weight F32 llama GGUF of about `megabytes` (tests.support.tiny_gguf)."""
    from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama  # noqa: PLC0415

    n_embd, n_vocab = 1024, 8192
    per_layer = 4 * (4 * n_embd * n_embd + 3 * n_embd * 4 * n_embd)  # bytes, F32
    n_layer = max(1, (megabytes * 2**20 - 2 * 4 * n_vocab * n_embd) // per_layer)
    spec = TinyModelSpec(
        n_layer=int(n_layer),
        n_embd=n_embd,
        n_head=16,
        n_head_kv=4,
        n_ff=4 * n_embd,
        n_vocab=n_vocab,
        n_ctx_train=N_CTX,
    )
    return write_tiny_llama(directory / f"random-{megabytes}mb.gguf", spec)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked; --n-gpu-layers and --fresh-processes get the device's
    defaults when not given."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.residency_roundtrip", description=__doc__.split("\n\n")[0]
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="a GGUF (default: the demo's gemma-3-270m)")
    source.add_argument("--random-model", type=int, metavar="MB", help="generate one this big")
    parser.add_argument(
        "--device",
        choices=on_device.DEVICES,
        default="cpu",
        help="vulkan: every layer on the engine's Vulkan device (llvmpipe without a GPU)",
    )
    parser.add_argument("--n-gpu-layers", type=int, help="default: -1 with --device vulkan, else 0")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument(
        "--fresh-processes",
        type=int,
        help="fresh processes for the first-release figures (benchmarks.first_release; "
        f"default: {FRESH_PROCESSES_ON_DEVICE} with --device vulkan, else 0: not run)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        args.n_gpu_layers = on_device.gpu_layers(args.device, args.n_gpu_layers)
    except ValueError as exc:
        parser.error(str(exc))
    if args.fresh_processes is None:
        args.fresh_processes = FRESH_PROCESSES_ON_DEVICE if args.device != "cpu" else 0
    if args.rounds < 1 or args.max_tokens < 1 or args.fresh_processes < 0:
        parser.error("need --rounds >= 1, --max-tokens >= 1 and --fresh-processes >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    on_device.select(args.device)  # before anything asks the engine about its devices
    with tempfile.TemporaryDirectory() as scratch:
        if args.random_model:
            path = random_model(args.random_model, Path(scratch))
        elif args.model:
            path = args.model
        else:
            from benchmarks.worker_handoff import model_path  # noqa: PLC0415

            path = model_path(None)
        spec = ModelSpec(
            name="roundtrip",
            path=path,
            n_ctx=N_CTX,
            n_gpu_layers=args.n_gpu_layers,
            residency=Residency.IN_PLACE,
            host_copy=True,
        )
        info = engine.engine_info()
        on_gpu = args.n_gpu_layers != 0 and info.offload
        # On a device: the weights are there, and its copy rates, before the round trips.
        checked = on_device.check(spec) if args.device != "cpu" else None
        memory = NOT_MEASURED if checked else device_memory(on_gpu)
        prompt = " ".join(
            ["the quick brown fox jumps over the lazy dog"] * (args.prompt_words // 9)
        )
        model_bytes = path.stat().st_size
        inplace = round_trips(spec, prompt, args.rounds, memory, args.max_tokens)
        if checked is None:
            copy_kind, bandwidth = copy_bandwidth(on_gpu, 256 * 2**20)
        else:
            copy_kind, bandwidth = "the device's, see device.transfer", None
        reload = reload_round_trip(spec, prompt, args.rounds, args.max_tokens)
        fresh = (
            first_release.measure(
                path,
                n_gpu_layers=args.n_gpu_layers,
                processes=args.fresh_processes,
                rounds=FRESH_ROUNDS,
                kv=KvPolicy.HOST,
                prompt_words=FRESH_PROMPT_WORDS,
                max_tokens=1,
            )
            if args.fresh_processes
            else None
        )
    for policy in inplace["policies"].values():
        rate = policy["restore_rate_bytes_per_s"]
        policy["restore_vs_bandwidth"] = round(bandwidth / rate, 3) if bandwidth and rate else None
        if checked is not None:
            policy["versus_device"] = versus_device(policy, checked.rates)
    result: dict[str, Any] = {
        "benchmark": "residency_roundtrip",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "engine": info.to_json(),
        "libllama": str(libllama.loaded_libllama()),
        "model": {"path": str(path), "bytes": model_bytes},
        "device": checked.to_json() if checked else "cpu",
        "n_gpu_layers": args.n_gpu_layers,
        "max_tokens": args.max_tokens,
        "memory_measured": memory.what,
        "copy_bandwidth": {
            "kind": copy_kind,
            "bytes_per_s": round(bandwidth) if bandwidth else None,
        },
        "in_place": inplace,
        "reload": reload,
    }
    if checked is not None:
        result["headline"] = {
            kv: {
                "release_median_s": policy["release"]["median_s"],
                "restore_median_s": policy["restore"]["median_s"],
                "release_vs_download": policy["versus_device"]["release_vs_download"]["ratio"],
                "restore_vs_upload": policy["versus_device"]["restore_vs_upload"]["ratio"],
                "release_vs_first_touch_download": policy["versus_device"]["release_vs_download"][
                    "ratio_first_touch"
                ],
                "restore_vs_first_touch_upload": policy["versus_device"]["restore_vs_upload"][
                    "ratio_first_touch"
                ],
            }
            for kv, policy in inplace["policies"].items()
        }
        result["goals"] = {
            "release_vs_download_and_restore_vs_upload_at_most": DEVICE_GOAL_RATIO,
            "first_release_vs_later_at_most": first_release.FIRST_GOAL_RATIO,
        }
    if fresh is not None:
        result["first_release"] = fresh
    report(result, args.out)


if __name__ == "__main__":
    main()
