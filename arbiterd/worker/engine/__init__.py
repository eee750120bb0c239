"""The inference engine: the only package that imports llama_cpp (besides arbiterd/native/ and
arbiterd/worker/vision.py, which owns its multimodal half, libmtmd).

Owns the llama objects of one model and moving them between device and host. Everything else
talks to the `Backend` protocol, so tests and other residency mechanisms can stand behind it.
Must only be called from one thread (the worker's engine thread): llama.cpp contexts are not
thread-safe, and freeing device buffers must never race a decode.

    __init__    this facade: the `Backend` protocol, `select_backend`, `engine_info`
    records     what crosses the facade: Moved, Prepared, Generation, the callbacks
    backend     LlamaBackend, what both residency mechanisms share: the llama objects, loading,
                the prompt cache kept across a load, the projector's sessions
    loading     making a model's Llama: its parameters and context, the config's template, and
                the footprint it is predicted to take
    reload      ReloadBackend: release frees everything, restore loads from the host copy
    inplace     InPlaceBackend: release and restore move the buffers' bytes (the engine patch)
    vocab       Vocab, the vocabulary alone: tokenizing while cold
    prepare     request preparation: checked, rendered and tokenized, pure over the vocabulary
    decode      the batched decoder: KV sequences, one llama_decode per step for every running
                sequence, C sampler chains, stop strings
    generate    generation: requests as jobs over the decoder's sequences, chunks, embeddings
    images      the vision steps on the model's context: layout, embeddings decoded, budget
    placement   the model's `devices` as the engine's ggml devices, RPC servers registered

A request is **prepared** (rendered, sized and tokenized) before it **runs**: preparing needs only
the vocabulary, which a vocab-only model (no weights, no context, no device memory) holds for the
worker's whole life, so a worker tokenizes while cold, before it asks for the GPU (issue 10).

A vision model (ModelSpec.mmproj) takes images in chat requests: prepared as text with a marker
where each image goes, then, on the warm model, laid out and encoded by vision.py's Projector
(loaded just in time) and decoded here as embeddings on the model's own context (issue 12).
When the projector does not fit the device budget beside the model (`vram_budget`, else the
device's measured free memory), the in-place backend takes the weights off the device around
it, the KV left in place (`LlamaBackend._encoder_session`); the reload backend cannot, and says
so.

An embedding model (ModelSpec.embedding) serves only "embedding" requests, every other model
only "chat" and "completion" ones: its context makes pooled embeddings, one unit-length vector
per input text (issue 11).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import llama_cpp

from arbiterd.errors import ArbiterError, EngineError, ModelLoadError
from arbiterd.footprint import DeviceFootprint
from arbiterd.native import ggml, libllama
from arbiterd.native.libllama import ResidencyApi, probe_residency_api
from arbiterd.request import GenerateRequest
from arbiterd.spec import Capability, KvPolicy, ModelInfo, ModelSpec, Residency
from arbiterd.states import BackendKind
from arbiterd.worker.engine.inplace import InPlaceBackend
from arbiterd.worker.engine.records import Cancelled, ChunkSink, Generation, Moved, Prepared
from arbiterd.worker.engine.reload import ReloadBackend
from arbiterd.worker.kvfile import KvState

__all__ = [
    "Backend",
    "Cancelled",
    "ChunkSink",
    "EngineInfo",
    "Generation",
    "InPlaceBackend",
    "Moved",
    "Prepared",
    "ReloadBackend",
    "engine_info",
    "select_backend",
]

log = logging.getLogger(__name__)


class Backend(Protocol):
    """One model's residency mechanism. All methods run on the engine thread.

    `prepare` touches no device state, so the caller may release or restore the model from
    inside its `cancelled` callback. Prepared requests are `begin`-ed beside each other and
    run by `step`s, each one decode of all of them; a release between two steps keeps them
    (the in-place backend: they resume after the restore)."""

    spec: ModelSpec
    kind: BackendKind  # as status, /metrics and the tray name it
    fallback_reason: str  # why not in-place, when that was looked for and not found; else ""
    keeps_kv_on_device: bool  # whether release(KvPolicy.DEVICE) is possible

    @property
    def prompt_tokens_evaluated_total(self) -> int: ...

    def open(self) -> None: ...

    def load(self) -> Moved: ...

    def release(self, kv: KvPolicy) -> Moved: ...

    def restore(self) -> Moved: ...

    def prepare(self, request: GenerateRequest, cancelled: Cancelled) -> Prepared: ...

    def begin(
        self, request_id: str, request: Prepared, sink: ChunkSink | None, cancelled: Cancelled
    ) -> None: ...

    def step(self) -> dict[str, Generation | ArbiterError]: ...

    def abandon(self, error: ArbiterError) -> list[str]: ...

    @property
    def generating(self) -> int: ...

    @property
    def tokens_generated_total(self) -> int: ...

    def resident_bytes(self) -> int: ...

    @property
    def predicted_footprint(self) -> tuple[DeviceFootprint, ...]: ...

    def footprint(self) -> tuple[DeviceFootprint, ...]: ...

    def capabilities(self) -> tuple[Capability, ...]: ...

    def model_info(self) -> ModelInfo | None: ...

    def host_kv_bytes(self) -> int: ...

    def host_weights_bytes(self) -> int: ...

    def kept_kv(self) -> KvState | None: ...

    def adopt_kv(self, kv: KvState) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineInfo:
    """What the loaded engine can do: offload to a GPU or not, and on which devices."""

    offload: bool  # a local GPU takes layers (RPC servers are named by the models' devices)
    devices: tuple[str, ...]  # "CPU: <model name>", "CUDA0: NVIDIA H200", ...

    def to_json(self) -> dict[str, Any]:
        return {"offload": self.offload, "devices": list(self.devices)}


def engine_info() -> EngineInfo:
    """The loaded llama_cpp's abilities; the device list is empty when libggml cannot be read."""
    try:
        listed = ggml.devices(libllama.loaded_libllama())
    except (EngineError, OSError, AttributeError) as exc:
        log.warning("cannot list the engine's devices: %s", exc)
        return EngineInfo(offload=bool(llama_cpp.llama_supports_gpu_offload()), devices=())
    # llama_supports_gpu_offload is true for every engine with the RPC backend, GPU or not.
    local = any(device.local_gpu for device in listed)
    return EngineInfo(offload=local, devices=tuple(device.label for device in listed))


def select_backend(spec: ModelSpec, *, vram_budget: int = 0) -> Backend:
    """The in-place backend when the loaded libllama has the residency API, else reload (and
    the reason is logged, once per worker, and kept as the backend's fallback_reason), as
    spec.residency allows: "reload" never probes, "in-place" fails without the API.
    `vram_budget`: the device bytes a projector session may bring the model to (0: unknown)."""
    if spec.residency is Residency.RELOAD:
        return ReloadBackend(spec, vram_budget=vram_budget)
    probed = probe_residency_api()
    if isinstance(probed, ResidencyApi):
        log.info("%s: in-place residency through %s", spec.name, probed.library)
        return InPlaceBackend(spec, probed, vram_budget=vram_budget)
    if spec.residency is Residency.IN_PLACE:
        raise ModelLoadError(f'{spec.name} asks for residency = "in-place": {probed.reason}')
    log.info("%s: %s", spec.name, probed.reason)
    return ReloadBackend(spec, fallback_reason=probed.reason, vram_budget=vram_budget)
