"""The vision steps that run on the model's own context (issue 12): a prompt laid out with its
images' spans, the embeddings the projector made decoded at their positions, and the device
memory a projector may take beside the model. The projector itself is arbiterd/worker/vision.py's.
Part of the engine (arbiterd/worker/engine/): it calls llama_cpp.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import llama_cpp
import numpy as np
import numpy.typing as npt

from arbiterd.errors import EngineError, RequestError
from arbiterd.native import ggml, libllama
from arbiterd.worker.engine.records import Prepared
from arbiterd.worker.vision import Span

log = logging.getLogger(__name__)


def free_device_bytes() -> int | None:
    """Free memory of the first local GPU the engine offers (where a projector goes); None when it
    has none or ggml cannot be read."""
    try:
        found = ggml.devices(libllama.loaded_libllama())
    except (EngineError, OSError, AttributeError) as exc:
        log.warning("cannot read the devices' free memory: %s", exc)
        return None
    # A device whose driver runs on the CPU reports a fixed heap, not what is free: no budget.
    return next((d.free_bytes for d in found if d.local_gpu and not d.on_cpu), None)


@dataclass(frozen=True)
class Prefill:
    """A vision prompt laid out: its tokens (placeholder ids at image positions), the cached
    prefix kept, and the positions evaluated before the decoder ran it (text and image)."""

    tokens: list[int]
    reused: int
    evaluated: int


def lay_out(
    request: Prepared, digests: list[bytes], layouts: dict[bytes, tuple[Span, ...]]
) -> tuple[list[int], list[tuple[int, bytes, Span]]]:
    """The prompt's tokens with each image's spans in place, and where each image span starts."""
    text = request.prompt_tokens
    tokens: list[int] = []
    placed: list[tuple[int, bytes, Span]] = []
    cut = 0
    for at, digest in zip(request.image_at, digests, strict=True):
        tokens += text[cut:at]
        cut = at
        for span in layouts[digest]:
            if span.image:
                placed.append((len(tokens), digest, span))
            tokens += span.ids
    tokens += text[cut:]
    return tokens, placed


def decode_embeddings(
    llm: llama_cpp.Llama,
    embd: npt.NDArray[np.float32],
    position: int,
    seq: int,
    non_causal: bool,
) -> None:
    """Decode one image chunk's embeddings in KV sequence `seq` from `position` on (the
    decoder records its placeholder ids there, so the next prompt's prefix match runs through
    it). A model that attends both ways within an image (Gemma 3) needs the whole image in one
    decode."""
    n, n_embd = embd.shape
    step = n if non_causal else llm.n_batch
    if non_causal and n > llm.n_batch:
        raise RequestError(f"an image of {n} positions exceeds the model's batch of {llm.n_batch}")
    batch = llama_cpp.llama_batch_init(step, n_embd, 1)
    data = np.ascontiguousarray(embd, dtype=np.float32)
    try:
        if non_causal:
            llama_cpp.llama_set_causal_attn(llm.ctx, False)
        for first in range(0, n, step):
            count = min(step, n - first)
            ctypes.memmove(batch.embd, data[first:].ctypes.data, count * n_embd * 4)
            for i in range(count):
                batch.pos[i] = position + first + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 0
            batch.n_tokens = count
            status = llama_cpp.llama_decode(llm.ctx, batch)
            if status != 0:
                raise EngineError(f"llama_decode failed (status {status}) on an image")
    finally:
        if non_causal:
            llama_cpp.llama_set_causal_attn(llm.ctx, True)
        llama_cpp.llama_batch_free(batch)
