"""In-place residency, through the arbiterd engine build (arbiterd/native/llama-residency.patch):
the model and context stay alive and only their buffers' bytes move between the device and the
host, so nothing is re-parsed or re-read; the KV may even stay on the device. Part of the engine
(arbiterd/worker/engine/): it calls llama_cpp and the residency API, on the engine thread only.
"""

from __future__ import annotations

import ctypes
import time

import llama_cpp

from arbiterd.errors import (
    EngineError,
    OutOfDeviceMemoryError,
    RequestError,
    ResidencyCallError,
    RestoreError,
)
from arbiterd.footprint import CPU, DeviceFootprint
from arbiterd.native import libllama
from arbiterd.native.libllama import ResidencyApi
from arbiterd.spec import KvPolicy, ModelSpec
from arbiterd.states import BackendKind
from arbiterd.worker.engine.backend import (
    LlamaBackend,
    disk_read_bytes,
    load_kv,
    return_freed_heap,
    save_kv,
)
from arbiterd.worker.engine.placement import runs_on_cpu
from arbiterd.worker.engine.records import Moved


class InPlaceBackend(LlamaBackend):
    """Residency through the arbiterd engine build (arbiterd/native/llama-residency.patch): the
    model and context stay alive and only their buffers' bytes move, so nothing is re-parsed or
    re-read; the KV may even stay on the device. Loading and generation are LlamaBackend's
    (backend.py).

    KV policies: `device` keeps the KV buffers where they are; `host` saves the KV with the state
    API (only the cells in use, with their tokens) before the release and sets it back after the
    restore; `drop` clears it.

    Weights come back from the model file the worker loaded (the daemon's host copy, shared by
    every worker on that file): a device buffer that holds the file's bytes as they are is freed
    without a copy and uploaded again from the file; weights the device holds otherwise are
    copied out once, and the copy is kept (weights never change). A model that runs on the CPU
    (n_gpu_layers = 0, or an engine that cannot offload) maps its weights from the host copy, so
    they are never the worker's own, and releases its host buffers too (the weights the CPU
    repacks at load, its KV and compute buffers): those go to a memory file outside the worker's
    mappings, which the next restore maps back."""

    kind = BackendKind.IN_PLACE
    keeps_kv_on_device = True
    swap_refusal = ""

    def __init__(self, spec: ModelSpec, api: ResidencyApi, *, vram_budget: int = 0) -> None:
        super().__init__(spec, vram_budget=vram_budget)
        self._api = api
        self._released = False
        # The weights are off the device for a projector (the swap path), or stayed off when
        # bringing them back failed: the next request or release tries again.
        self._swapped_out = False
        self._host_buffers = runs_on_cpu(spec)
        self._kept_kv_bytes = 0  # KV left on the device by a `device` release
        self._kv_in_engine_bytes = 0  # KV the engine copied whole to host memory (KV_TO_HOST)

    def load(self) -> Moved:
        moved = super().load()
        # The context lives until close(): its model's vocabulary serves the cold model's
        # tokenizing too, and the vocab-only copy goes.
        self._require_vocab().use_vocabulary_of(self._require_llm()._model)
        # Its small blocks, and those the load parsed and let go (the file's metadata, the
        # vocabulary's map from texts to ids), lie between blocks that stay: only a trim gives
        # their pages back, and on a GPU no release of host buffers would trim later.
        return_freed_heap()
        return moved

    def release(self, kv: KvPolicy) -> Moved:
        llm = self._require_llm()
        if self._released:
            raise RequestError(f"{self.spec.name} is already cold")
        self._heal_swap()
        started = time.monotonic()
        projector_bytes = self._free_projector()  # going cold frees a resident encoder
        ctx = context_pointer(llm)
        flags = self._flags(kv)
        if kv is KvPolicy.DROP:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            self._generator.decoder.forget()
        # On an RPC device the state API costs a round trip per cell range and row (2.5 s for
        # gemma-3-270m's 512 cells over loopback): the engine copies the KV buffers whole.
        whole = kv is KvPolicy.HOST and self._placement is not None and self._placement.remote
        if whole:
            flags |= libllama.KV_TO_HOST
        decoder = self._generator.decoder
        saves = kv is KvPolicy.HOST and decoder.cells_used > 0 and not whole
        self._kv = save_kv(llm, decoder) if saves else None
        kept = self._api.stats(ctx, self._flags(KvPolicy.HOST)).kv_bytes
        self._kept_kv_bytes = kept if kv is KvPolicy.DEVICE else 0
        try:
            self._api.release_device(ctx, flags)
        except ResidencyCallError as exc:
            self._kv = None
            raise EngineError(str(exc)) from None
        if self._host_buffers:
            return_freed_heap()
        stats = self._api.stats(ctx, flags)
        self._released = True
        self._kv_in_engine_bytes = stats.kv_bytes if whole else 0
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=stats.weights_bytes + projector_bytes,
            kv_bytes=len(self._kv.data) if self._kv else self._kv_in_engine_bytes,
            disk_read_bytes=0,
            file_bytes=stats.file_bytes,
            copied_bytes=stats.copied_bytes,
        )

    def restore(self) -> Moved:
        llm = self._require_llm()
        if not self._released:
            raise RestoreError(f"{self.spec.name} is already warm")
        started, read_before = time.monotonic(), disk_read_bytes()
        ctx = context_pointer(llm)
        released = self._api.stats(ctx, 0)
        if self._placement is not None:
            self._placement.check_reachable()  # still released, KV kept, when a server is down
        try:
            self._api.restore_device(ctx)
        except ResidencyCallError as exc:
            # Still released, the weights' copy intact, the saved KV kept: the next warm-up
            # tries again (out of device memory, a fitting set's member does so at once and
            # alone: worker/loop.py).
            error = RestoreError
            if exc.status in (libllama.Status.DEVICE_ALLOC, libllama.Status.COMPUTE):
                error = OutOfDeviceMemoryError
            raise error(f"restore failed: {exc}") from None
        self._released = False
        kv_bytes = 0
        if self._kv is not None:
            try:
                load_kv(llm, self._kv)
            except RestoreError:
                self._api.release_device(ctx, self._flags(KvPolicy.HOST))  # stay cold, KV kept
                self._released = True
                raise
            kv_bytes = len(self._kv.data)
            self._kv = None
        elif self._kv_in_engine_bytes:
            kv_bytes = self._kv_in_engine_bytes  # the engine copied it back as it was
        elif self._kept_kv_bytes == 0:
            self._generator.decoder.forget()  # the cache came back empty
        self._kept_kv_bytes = self._kv_in_engine_bytes = 0
        weights = released.weights_bytes + self._warm_projector()
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=weights,
            kv_bytes=kv_bytes,
            disk_read_bytes=disk_read_bytes() - read_before,
            file_bytes=released.file_bytes,
        )

    def resident_bytes(self) -> int:
        """Device bytes (host bytes for a CPU model) by the engine's own figures: weights, KV
        and compute buffers while warm; the KV kept by a `device` release while cold."""
        llm = self._llm
        if llm is None:
            return 0
        if self._released or self._swapped_out:
            return self._kept_kv_bytes + self._projector_bytes()
        stats = self._api.stats(context_pointer(llm), self._flags(KvPolicy.HOST))
        return stats.device_bytes + self._projector_bytes()

    def footprint(self) -> tuple[DeviceFootprint, ...]:
        """The footprint while warm, by the residency stats: what a release would free of the
        device buffers, and of the host buffers the CPU entry (footprint.py says what counts).
        The stats add up the devices' buffers: a model on several devices is measured on them
        together ("gpu0+rpc:…"). The projector, loaded on demand, is not counted."""
        llm = self._llm
        if llm is None or self._released or self._swapped_out:
            return ()
        ctx = context_pointer(llm)
        host = self._api.stats(ctx, libllama.HOST_BUFFERS)
        if self._host_buffers:  # on the CPU: every buffer is a host buffer
            return (DeviceFootprint(CPU, host.weights_bytes, host.kv_bytes, host.compute_bytes),)
        device = self._api.stats(ctx, 0)
        devices = "+".join(d for d in self.spec.devices if d != CPU)
        found = (
            DeviceFootprint(
                CPU,
                host.weights_bytes - device.weights_bytes,
                host.kv_bytes - device.kv_bytes,
                host.compute_bytes - device.compute_bytes,
            ),
            DeviceFootprint(devices, device.weights_bytes, device.kv_bytes, device.compute_bytes),
        )
        return tuple(f for f in found if f.total_bytes)

    def host_kv_bytes(self) -> int:
        return super().host_kv_bytes() + self._kv_in_engine_bytes

    def _is_released(self) -> bool:
        return self._released

    def host_weights_bytes(self) -> int:
        """Host memory holding this worker's own copies of weights: those that cannot come back
        from the daemon's copy of the model file (a CPU model's repacked weights while cold; a
        device's weights it holds otherwise than the file, cold or warm: their copy is kept)."""
        llm = self._llm
        if llm is None:
            return 0
        return self._api.stats(context_pointer(llm), 0).host_bytes

    def _before_run(self) -> None:
        super()._before_run()
        if self._released:
            raise RequestError(f"{self.spec.name} is not warm")
        self._heal_swap()

    def _weights_off(self) -> int:
        """Release the weights and compute buffers with KEEP_KV: the KV cells stay where they
        are, so the encode costs no prompt evaluation and no KV copy."""
        ctx = context_pointer(self._require_llm())
        flags = self._flags(KvPolicy.DEVICE)
        kept = self._api.stats(ctx, self._flags(KvPolicy.HOST)).kv_bytes
        try:
            self._api.release_device(ctx, flags)
        except ResidencyCallError as exc:
            raise EngineError(f"cannot make room for the projector: {exc}") from None
        if self._host_buffers:
            return_freed_heap()
        self._swapped_out, self._kept_kv_bytes = True, kept
        return self._api.stats(ctx, flags).weights_bytes

    def _weights_on(self) -> int:
        """Bring the weights back after the projector; the KV never left. On failure they stay
        off (the context released, its copies intact) and RestoreError says so."""
        llm = self._require_llm()
        ctx = context_pointer(llm)
        weights = self._api.stats(ctx, 0).weights_bytes
        try:
            self._api.restore_device(ctx)
        except ResidencyCallError as exc:
            raise RestoreError(
                f"{self.spec.name}'s weights could not come back after the projector: {exc}"
            ) from None
        self._swapped_out, self._kept_kv_bytes = False, 0
        return weights

    def _heal_swap(self) -> None:
        """Weights a failed swap left off the device come back before anything else runs
        (RestoreError again if they still cannot)."""
        if self._swapped_out:
            self._weights_on()

    def _flags(self, kv: KvPolicy) -> int:
        flags = libllama.KEEP_KV if kv is KvPolicy.DEVICE else 0
        return flags | (libllama.HOST_BUFFERS if self._host_buffers else 0)


def context_pointer(llm: llama_cpp.Llama) -> int:
    pointer = ctypes.cast(llm.ctx, ctypes.c_void_p).value
    if not pointer:
        raise EngineError("the llama context is gone")
    return pointer
