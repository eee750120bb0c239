"""Footprints (issue 44): what a warm model takes of each device it is placed on — its weights,
its KV cache and its compute buffers — predicted from its GGUF before it loads, measured by the
engine once it is warm, and the one compared with the other.

Owns the record both are written in (`DeviceFootprint`), the predictor (`predict`: a header and a
`Layout` in, figures out) and the comparison (`error`). Pure: never opens a file, never imports
llama.cpp; the worker measures (arbiterd/worker/engine/) and the daemon compares.

What a device's figures count, predicted and measured alike:
- a GPU or an RPC server: every buffer the model has there (weights, KV, compute);
- the CPU (`cpu`): the host memory the model allocates itself — its KV and compute buffers on the
  host, and the weights the CPU repacks at load into buffers of its own. Weights mapped from the
  model file are the pages of the daemon's host copy, shared by every model on that file and
  counted once with it (`host_copy_bytes`), so they never count here.

How llama.cpp (the version llama-cpp-python 0.3.36 vendors) lays a model out, which `predict`
follows: the input embeddings always stay on the CPU; with `n_gpu_layers` = L of a model's
n_layer blocks, the last L of the n_layer + 1 layers (the blocks, then the output layer) go to
the devices, split between them by `split`; the KV cache is n_ctx cells rounded up to 256 (one
unified cache however many sequences), each layer's on that layer's device; compute buffers are
reserved for the worst batch, one micro-batch (n_ubatch tokens) with an output for every token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from arbiterd.fields import Record
from arbiterd.gguf import GgufHeader, Tensor

CPU = "cpu"
KV_CELL_ROUNDING = 256  # llama.cpp rounds n_ctx up to whole 256s (n_ctx 1000 gets 1024 cells)
F32_BYTES = 4  # activations, logits and attention masks are f32
# Over several devices llama.cpp pipelines micro-batches: its scheduler keeps this many copies
# of the graph's inputs (GGML_SCHED_MAX_COPIES), the masks among them. Measured: the tiny model
# on two RPC servers holds 9.2 MiB of host compute buffers (2.4 MiB on one) and 19.2 MiB on the
# servers (10.6 MiB on one).
PIPELINE_COPIES = 4
# Bytes per element of the KV cache's types (llama_context_params type_k/type_v; ggml's blocks).
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# Architectures without a KV cache: they encode each input at once (gguf.py's encoder-only).
_NO_KV = frozenset({"bert", "eurobert", "jina-bert-v2", "jina-bert-v3", "modern-bert", "neo-bert",
                    "nomic-bert", "nomic-bert-moe", "t5encoder"})  # fmt: skip
# Tensors of the input layer, kept on the CPU whatever the placement (llama.cpp's dev_input).
_INPUT_TENSORS = ("token_embd.", "token_types.", "position_embd.", "per_layer_token_embd.")
TIED_OUTPUT = "token_embd.weight"  # the output matrix of a model without `output.weight`
# The largest buffer a Vulkan shader can bind (VkPhysicalDeviceLimits.maxStorageBufferRange): a
# weight larger than that cannot be used on the device, and llama.cpp keeps it on the CPU. Mesa's
# llvmpipe reports 128 MiB, hardware drivers commonly 4 GiB. Measured on llvmpipe: gemma-3-270m's
# tied output (170 MiB) stays on the CPU, which then computes the logits; SmolLM2's (28.7 MiB) is
# copied to the device, as both are to an RPC server.
LLVMPIPE_STORAGE_RANGE_BYTES = 128 << 20
VULKAN_STORAGE_RANGE_BYTES = 4 << 30
# ggml types the CPU repacks at load into its own buffers (ggml-cpu's repack.cpp on x86 with
# AVX2: Q4_0 and Q4_K as 8x8 blocks, IQ4_NL likewise) when a matrix's rows come in eights:
# Q4_0, Q4_K, IQ4_NL. The token embeddings are read by row (GET_ROWS), never repacked.
_REPACKED_TYPES = frozenset({2, 12, 20})
REPACK_ROWS = 8


@dataclass(frozen=True)
class DeviceFootprint(Record):
    """What a model takes of one device (`device`: an arbiterd device id, "cpu" for host
    memory), by kind. Devices the engine cannot tell apart are named together, joined by "+"."""

    device: str = ""
    weights_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes


@dataclass(frozen=True)
class ModelFootprint(Record):
    """A model's footprint as status carries it: `predicted` before its first load, `measured`
    when it last became warm (() until then, or where the engine cannot tell), and `error`,
    the prediction's (`error`), once both are known."""

    predicted: tuple[DeviceFootprint, ...] = ()
    measured: tuple[DeviceFootprint, ...] = ()
    error: float | None = None

    @classmethod
    def of(
        cls, predicted: Sequence[DeviceFootprint], measured: Sequence[DeviceFootprint]
    ) -> ModelFootprint:
        off = round(error(predicted, measured), 4) if predicted and measured else None
        return cls(tuple(predicted), tuple(measured), off)


@dataclass(frozen=True)
class Layout:
    """How a model is made, besides its file: `devices`, the ids its layers go to in order (()
    : all on the CPU), `n_gpu_layers` of them offloaded (-1: all), shared out by `split` (the
    devices' proportions; (): evenly); a context of `n_ctx` tokens, `n_ubatch` a micro-batch,
    its KV cache of `cache_type`; `repack`: the CPU repacks the weights it holds
    (use_extra_bufts on an engine whose CPU has them); `largest_weight`: (device, bytes) for
    each device that cannot take a weight larger than that (a Vulkan device's storage range),
    which then stays on the CPU."""

    n_ctx: int
    devices: tuple[str, ...] = ()
    n_gpu_layers: int = -1
    split: tuple[float, ...] = ()
    n_ubatch: int = 512
    cache_type: str = "f16"
    repack: bool = False
    largest_weight: tuple[tuple[str, int], ...] = ()


def predict(header: GgufHeader, layout: Layout) -> tuple[DeviceFootprint, ...]:
    """The footprint, per device, that a model with this header (read with its tensor table)
    takes once warm with this layout: the CPU's first, then the devices in the layout's order,
    those the layout gives nothing left out.

    The compute buffers are an estimate, calibrated against what llama.cpp reserved for the
    tiny test model, SmolLM2-135M and gemma-3-270m (n_ctx 1024, n_ubatch 512, on the CPU and
    Vulkan0): the largest of three phases on each device — attention (a token's scores against
    every cell, per head), the feed-forward block, and the output (a logit per vocabulary entry
    per token) — plus the attention masks, which live through the layers."""
    n_layer = header.shape.get("block_count", 0)
    where = _layer_devices(n_layer, layout)
    largest = dict(layout.largest_weight)
    tensors = {t.name: t for t in header.tensors}
    weights: dict[str, int] = {}
    for tensor in header.tensors:
        device = _device_of(tensor.name, where, n_layer)
        if tensor.nbytes > largest.get(device, tensor.nbytes):
            device = CPU
        if device != CPU:
            weights[device] = weights.get(device, 0) + tensor.nbytes
        elif layout.repack and _repacked(tensor):
            weights[CPU] = weights.get(CPU, 0) + tensor.nbytes
    # A model without an output matrix multiplies by its token embeddings: a copy of them goes
    # to the output layer's device, where it fits (on the CPU the embeddings themselves serve).
    output = tensors.get("output.weight") or tensors.get(TIED_OUTPUT)
    output_device = where[n_layer]
    if output is None or output.nbytes > largest.get(output_device, output.nbytes):
        output_device = CPU
    elif output.name == TIED_OUTPUT and output_device != CPU:
        weights[output_device] = weights.get(output_device, 0) + output.nbytes
    kv = _kv(header, layout, where[:n_layer])
    compute = _compute(header, layout, where, output_device)
    order = [CPU, *layout.devices]
    found = [
        DeviceFootprint(d, weights.get(d, 0), kv.get(d, 0), compute.get(d, 0))
        for d in dict.fromkeys(order)
    ]
    return tuple(f for f in found if f.total_bytes)


def error(predicted: Sequence[DeviceFootprint], measured: Sequence[DeviceFootprint]) -> float:
    """How far the prediction is off the measured footprint, as a signed fraction of the
    measured total (+0.1: 10 % more than measured was predicted). Where the engine measured
    devices together ("gpu0+rpc:…"), their predictions add up; 0.0 when nothing was measured."""
    measured_total = sum(f.total_bytes for f in measured)
    if not measured_total:
        return 0.0
    return (sum(f.total_bytes for f in predicted) - measured_total) / measured_total


def matched(
    predicted: Iterable[DeviceFootprint], measured: Iterable[DeviceFootprint]
) -> list[tuple[str, DeviceFootprint | None, DeviceFootprint | None]]:
    """Each measured device (or group of devices) beside the prediction for it, then any
    device predicted but not measured: (device, predicted, measured)."""
    predictions = {f.device: f for f in predicted}
    rows: list[tuple[str, DeviceFootprint | None, DeviceFootprint | None]] = []
    for found in measured:
        parts = [predictions.pop(d) for d in found.device.split("+") if d in predictions]
        rows.append((found.device, _sum(found.device, parts) if parts else None, found))
    rows += [(device, guess, None) for device, guess in predictions.items()]
    return rows


def total(footprints: Iterable[DeviceFootprint]) -> int:
    return sum(f.total_bytes for f in footprints)


def _sum(device: str, parts: Sequence[DeviceFootprint]) -> DeviceFootprint:
    return DeviceFootprint(
        device,
        sum(p.weights_bytes for p in parts),
        sum(p.kv_bytes for p in parts),
        sum(p.compute_bytes for p in parts),
    )


def _layer_devices(n_layer: int, layout: Layout) -> list[str]:
    """The device of each of the n_layer + 1 layers (the blocks, then the output layer), as
    llama.cpp's load_tensors assigns them: the last `n_gpu_layers` to the devices, split by
    the cumulative proportions (each layer to the first device whose share it falls under)."""
    count = n_layer + 1
    offloaded = count if layout.n_gpu_layers < 0 else min(layout.n_gpu_layers, count)
    if not layout.devices:
        offloaded = 0
    first = count - offloaded
    shares = layout.split or tuple(1.0 for _ in layout.devices)
    whole = sum(shares) or 1.0
    bounds = [sum(shares[: i + 1]) / whole for i in range(len(shares))]
    devices = []
    for il in range(count):
        if il < first:
            devices.append(CPU)
            continue
        at = (il - first) / offloaded
        index = next((i for i, bound in enumerate(bounds) if at < bound), len(bounds) - 1)
        devices.append(layout.devices[index])
    return devices


def _device_of(name: str, where: Sequence[str], n_layer: int) -> str:
    if name.startswith(_INPUT_TENSORS):
        return CPU
    if name.startswith("blk."):
        index = name.split(".", 2)[1]
        if index.isdigit() and int(index) < n_layer:
            return where[int(index)]
    return where[n_layer]  # the output norm and matrix, and any other model-wide tensor


def _repacked(tensor: Tensor) -> bool:
    return (
        tensor.ggml_type in _REPACKED_TYPES
        and len(tensor.shape) > 1  # a matrix
        and tensor.shape[1] % REPACK_ROWS == 0
        and not tensor.name.startswith(_INPUT_TENSORS)
    )


def kv_cells(n_ctx: int) -> int:
    return math.ceil(n_ctx / KV_CELL_ROUNDING) * KV_CELL_ROUNDING


def _kv(header: GgufHeader, layout: Layout, blocks: Sequence[str]) -> dict[str, int]:
    """Each layer's K and V, for every cell, on its layer's device."""
    shape = header.shape
    heads = shape.get("head_count", 0)
    if header.architecture in _NO_KV or not heads:
        return {}
    kv_heads = shape.get("head_count_kv", heads)
    head_dim = shape.get("embedding_length", 0) // heads
    width = (shape.get("key_length", head_dim) + shape.get("value_length", head_dim)) * kv_heads
    per_layer = math.ceil(width * kv_cells(layout.n_ctx) * CACHE_TYPE_BYTES[layout.cache_type])
    found: dict[str, int] = {}
    for device in blocks:
        found[device] = found.get(device, 0) + per_layer
    return found


def _compute(
    header: GgufHeader, layout: Layout, where: Sequence[str], output_device: str
) -> dict[str, int]:
    """The compute buffers' estimate, per device (see `predict`)."""
    shape, tensors = header.shape, {t.name: t for t in header.tensors}
    tokens = min(layout.n_ubatch, layout.n_ctx)
    cells = kv_cells(layout.n_ctx)
    n_embd = shape.get("embedding_length", 0)
    heads = shape.get("head_count", 0)
    n_ff = _rows(tensors, "blk.0.ffn_up.weight")
    n_vocab = _rows(tensors, "output.weight") or _rows(tensors, TIED_OUTPUT)
    # One mask of a token against every cell; a model that alternates sliding-window and full
    # attention keeps one of each.
    masks = tokens * cells * F32_BYTES * (2 if shape.get("sliding_window") else 1)
    stream = 3 * tokens * n_embd * F32_BYTES  # the residual stream and a normed copy of it
    attention = tokens * cells * heads * F32_BYTES + stream
    feed_forward = 3 * tokens * n_ff * F32_BYTES + stream
    output = tokens * n_vocab * F32_BYTES + 2 * tokens * n_embd * F32_BYTES
    copies = PIPELINE_COPIES if len(set(where) - {CPU}) > 1 else 1
    found: dict[str, int] = {}
    for device in dict.fromkeys(where[:-1]):
        found[device] = copies * masks + max(attention, feed_forward)
    if CPU not in found:  # the CPU embeds the tokens and hands the masks to the devices
        found[CPU] = copies * (masks + stream)
    found[output_device] = max(found.get(output_device, 0), output)
    return found


def _rows(tensors: Mapping[str, Tensor], name: str) -> int:
    tensor = tensors.get(name)
    return tensor.shape[1] if tensor is not None and len(tensor.shape) > 1 else 0
