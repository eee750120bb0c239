"""The device a benchmark's model runs on (--device cpu|vulkan), and the check that it really runs
there, with the device's own transfer rates beside it (issue 25's device tier of the benchmarks).

--device vulkan puts every layer on the engine's Vulkan device: Mesa's llvmpipe where there is no
GPU, a real Vulkan driver that runs on the CPU. ggml-vulkan lists a CPU-type device only when
GGML_VK_VISIBLE_DEVICES names it, and reads the variable once, when ggml's backend registry is
first used (ggml_vk_instance_init: the first device query or model load; importing llama_cpp
only loads the libraries). `select` sets it, unless the environment already does, at the start of
a benchmark's main, before anything asks the engine about devices; `check` fails the run when the
model did not land on the device after all, so a registry used too early cannot go unnoticed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from arbiterd.native import ggml, libllama
from arbiterd.spec import KvPolicy, ModelSpec, Residency
from arbiterd.worker.engine import InPlaceBackend, select_backend
from arbiterd.worker.engine.inplace import context_pointer
from tests.support.devices import vulkan_device

DEVICES = ("cpu", "vulkan")
VISIBLE_DEVICES = "GGML_VK_VISIBLE_DEVICES"
VISIBLE_DEFAULT = "0"  # the first Vulkan device: llvmpipe on a machine without a GPU
TRANSFER_TRIES = 5


def select(device: str) -> None:
    """Make `device` visible to the engine; call it before anything touches the engine."""
    if device == "vulkan":
        os.environ.setdefault(VISIBLE_DEVICES, VISIBLE_DEFAULT)


def gpu_layers(device: str, given: int | None) -> int:
    """n_gpu_layers on `device`: `given` when the command line says, else every layer (-1) on a
    device and none (0) on the CPU. ValueError for --device vulkan with --n-gpu-layers 0."""
    if given is None:
        return 0 if device == "cpu" else -1
    if device != "cpu" and given == 0:
        raise ValueError(f"--device {device} puts the model on the device: not --n-gpu-layers 0")
    return given


@dataclass(frozen=True)
class DeviceCheck:
    """Where the model runs, by the engine's own figures, and how fast the device copies."""

    device: ggml.Device
    weights_bytes: int  # weights in the device's buffers: what a release copies to host
    kv_bytes: int
    compute_bytes: int
    rates: ggml.TransferRates

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device.label,
            "on_cpu": self.device.on_cpu,
            "checked": "the model loaded with every layer on the device; the engine's residency "
            "stats (llama_context_residency_stats, host buffers not counted) say these bytes "
            "are in its buffers",
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "compute_bytes": self.compute_bytes,
            "transfer": self.rates.to_json(),
        }


def check(spec: ModelSpec) -> DeviceCheck:
    """Loads `spec` (n_gpu_layers != 0) with the in-place backend in this process and fails the
    run (SystemExit, one line) unless the engine lists a Vulkan device and its residency stats
    say the weights are in the device's buffers (not host ones); then measures the device's
    transfer rates on a tensor the size of those weights, and closes the model. Call it while
    no other model of this process is loaded."""
    found = vulkan_device()
    if isinstance(found, str):
        raise SystemExit(f"--device vulkan: {found}")
    # No host copy: the check reads the file once, as a plain load does.
    probe = select_backend(
        dataclasses.replace(
            spec, name=f"{spec.name}-device-check", residency=Residency.IN_PLACE, host_copy=False
        )
    )
    if not isinstance(probe, InPlaceBackend):
        raise SystemExit(f"--device vulkan: no in-place backend ({probe.fallback_reason})")
    probe.load()
    try:
        ctx = context_pointer(probe._require_llm())
        # The flags a release of this model uses: no HOST_BUFFERS when the engine offloads, so
        # only buffers that are not host memory count.
        flags = probe._flags(KvPolicy.HOST)
        if flags & libllama.HOST_BUFFERS:
            raise SystemExit("--device vulkan: the engine cannot offload (a CPU-only build)")
        stats = probe._api.stats(ctx, flags)
    finally:
        probe.close()
    if stats.weights_bytes <= 0:
        raise SystemExit(
            f"--device vulkan: no weights on {found.label} (was {VISIBLE_DEVICES} set before "
            "the engine listed its devices?)"
        )
    rates = ggml.transfer_rates(
        libllama.loaded_libllama(), found.name, stats.weights_bytes, tries=TRANSFER_TRIES
    )
    return DeviceCheck(
        device=found,
        weights_bytes=stats.weights_bytes,
        kv_bytes=stats.kv_bytes,
        compute_bytes=stats.compute_bytes,
        rates=rates,
    )


def versus_floor(
    seconds: float, nbytes: int, bytes_per_s: float, first_touch_bytes_per_s: float
) -> dict[str, Any]:
    """`seconds` against the time `nbytes` take at `bytes_per_s` (the floor: the copy into memory
    written before) and at `first_touch_bytes_per_s` (the first copy into new memory, which is
    what a release's new shadow and a restore's new buffers get): the two ratios."""
    floor_s = nbytes / bytes_per_s
    first_touch_s = nbytes / first_touch_bytes_per_s
    return {
        "median_s": round(seconds, 6),
        "bytes": nbytes,
        "floor_s": round(floor_s, 6),
        "ratio": round(seconds / floor_s, 2) if nbytes else None,
        "first_touch_floor_s": round(first_touch_s, 6),
        "ratio_first_touch": round(seconds / first_touch_s, 2) if nbytes else None,
    }
