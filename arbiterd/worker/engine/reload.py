"""Reload residency, the portable mechanism (any llama-cpp-python, no engine patch): a release
frees the context and the model (the KV, as its policy says, saved to host bytes first); a
restore loads the model again from its host copy and sets the KV back. Part of the engine
(arbiterd/worker/engine/): it calls llama_cpp, on the engine thread only.

- cold: `llama_state_get_data` copies the KV cache into host bytes (with the token list of the
  sequence it keeps, the most recently used), then the context and model are freed;
- warm: the model is loaded again from its *host copy* — a memfd holding the GGUF, so a restore
  reads 0 bytes from disk — into a context with identical params, the KV bytes are set back,
  and the decoder's prefix matching evaluates only the tokens that are new.
`Llama.save_state()` is not used: it also copies an n_tokens x n_vocab float32 score array.
"""

from __future__ import annotations

import time

import llama_cpp

from arbiterd.errors import EngineError, RequestError, RestoreError
from arbiterd.spec import KvPolicy
from arbiterd.states import BackendKind
from arbiterd.worker.engine.backend import (
    LlamaBackend,
    disk_read_bytes,
    load_kv,
    return_freed_heap,
    save_kv,
)
from arbiterd.worker.engine.records import Moved


class ReloadBackend(LlamaBackend):
    """Portable residency: free everything on release, reload from the host copy on restore."""

    kind = BackendKind.RELOAD
    keeps_kv_on_device = False
    # Why the projector cannot swap with the weights: freeing them frees the whole context.
    swap_refusal = (
        "the reload backend cannot take the weights off the device and keep the KV there "
        "(it would evaluate the prompt again)"
    )

    def release(self, kv: KvPolicy) -> Moved:
        llm = self._require_llm()
        if kv is KvPolicy.DEVICE:
            raise RequestError("the reload backend cannot keep the KV cache on the device")
        started, read_before = time.monotonic(), disk_read_bytes()
        weights = self._weights_bytes() + self._free_projector()
        decoder = self._generator.decoder
        self._kv = save_kv(llm, decoder) if kv is KvPolicy.HOST and decoder.cells_used else None
        if self._kv is None:
            decoder.forget()
        decoder.unbind()
        llm.close()
        self._llm = None
        return_freed_heap()  # the model's small blocks: 38 MB of a cold gemma-3 worker's 102
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=weights,
            kv_bytes=len(self._kv.data) if self._kv else 0,
            disk_read_bytes=disk_read_bytes() - read_before,
        )

    def restore(self) -> Moved:
        if self._llm is not None:
            raise RestoreError(f"{self.spec.name} is already warm")
        started, read_before = time.monotonic(), disk_read_bytes()
        llm = self._new_llama(RestoreError)
        kv_bytes = 0
        if self._kv is not None:
            try:
                load_kv(llm, self._kv)
            except RestoreError:
                llm.close()  # roll back: stay cold, keep the host KV for the next try
                raise
            kv_bytes = len(self._kv.data)
        self._llm, self._kv = llm, None
        projector_bytes = self._warm_projector()
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=self._weights_bytes() + projector_bytes,
            kv_bytes=kv_bytes,
            disk_read_bytes=disk_read_bytes() - read_before,
        )

    def resident_bytes(self) -> int:
        """Device bytes by our own accounting: weights plus the KV state while warm, else 0."""
        if self._llm is None:
            return 0
        return (
            self._weights_bytes()
            + int(llama_cpp.llama_state_get_size(self._llm.ctx))
            + self._projector_bytes()
        )

    def host_weights_bytes(self) -> int:
        """Host memory of this worker's own holding the weights: none, a release frees the
        Llama (its next load reads the daemon's shared copy)."""
        return 0

    def _weights_off(self) -> int:
        """Take the weights off the device, the KV left there; the bytes moved. Only a backend
        without a `swap_refusal` is asked."""
        raise EngineError(self.swap_refusal)

    def _weights_on(self) -> int:
        raise EngineError(self.swap_refusal)
