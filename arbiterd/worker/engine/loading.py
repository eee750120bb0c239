"""Making one model's Llama: its parameters, its context, what a worker never uses of it, the
chat template the config names, and the footprint it is predicted to take before it is made.

Owns the llama_cpp calls that make a Llama (and the parameters llama-cpp-python's Llama takes no
argument for, swapped in while it is made) and nothing else: when a model is made, and what is
done with it, are backend.py's (LlamaBackend._new_llama, for a load and a reload's restore).
Part of the engine (arbiterd/worker/engine/): on the engine thread only.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import llama_chat_format
from llama_cpp._internals import LlamaBatch

from arbiterd.errors import ModelLoadError, RestoreError
from arbiterd.footprint import DeviceFootprint, Layout, predict
from arbiterd.gguf import NotGgufError, read_header
from arbiterd.native import libllama
from arbiterd.spec import MAX_N_CTX, ModelSpec
from arbiterd.worker.engine.placement import (
    SPLIT_MODES,
    Placement,
    largest_weights,
    place,
    runs_on_cpu,
)
from arbiterd.worker.engine.prepare import GGUF_TEMPLATE

log = logging.getLogger(__name__)

POOLING_TYPES = {
    llama_cpp.LLAMA_POOLING_TYPE_NONE: "none",
    llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
    llama_cpp.LLAMA_POOLING_TYPE_LAST: "last",
    llama_cpp.LLAMA_POOLING_TYPE_RANK: "rank",
}
POOLED = ("mean", "cls", "last")
# llama-cpp-python's Llama: n_batch = min(n_ctx, 512) and n_ubatch = min(n_batch, 512).
DEFAULT_UBATCH = 512
# What llama.cpp's system info says of a CPU that repacks Q4_0/Q4_K/IQ4_NL weights as footprint.py
# expects (ggml-cpu's x86 repacking needs AVX2).
REPACKING_CPU = (b"AVX2 = 1", b"REPACK = 1")


@dataclass(frozen=True)
class Made:
    """A model's Llama as `make_llama` made it: where its layers went, and the chat template it
    renders with ("": none; the config's where it names one, else the GGUF's)."""

    llm: llama_cpp.Llama
    placement: Placement
    template: str


def make_llama(
    spec: ModelSpec,
    path: str,
    *,
    use_mmap: bool,
    error: type[ModelLoadError] | type[RestoreError],
) -> Made:
    """The Llama of the model `spec` describes, loaded from `path` (its file, or the host
    copy's), placed on its devices; every failure `error` (a load's, or a restore's), naming
    the file as the config does."""
    if not 0 < spec.n_ctx <= MAX_N_CTX:
        raise error(f"n_ctx must be between 1 and {MAX_N_CTX}, got {spec.n_ctx}")
    kwargs: dict[str, Any] = {
        "model_path": path,
        "n_ctx": spec.n_ctx,
        "n_gpu_layers": spec.n_gpu_layers,
        "seed": spec.seed,
        "use_mmap": use_mmap,
        "verbose": False,
    }
    # llama-cpp-python's default is half the CPUs for a generation; llama-server's, and
    # ours, all of them (issue 42: a generation step is one decode, which every CPU speeds).
    threads = spec.n_threads or len(os.sched_getaffinity(0))
    kwargs |= {"n_threads": threads, "n_threads_batch": threads}
    if spec.chat_format:
        kwargs["chat_format"] = spec.chat_format
    if spec.embedding:
        # An input is embedded in one decode: llama.cpp encodes a model that attends both
        # ways (BERT) in one micro-batch, and Llama.n_batch caps a decode's tokens. Both
        # hold the whole context, so every input that fits the context can be embedded.
        kwargs |= {"embedding": True, "n_batch": spec.n_ctx, "n_ubatch": spec.n_ctx}
    placement = place(spec, libllama.loaded_libllama())
    kwargs["split_mode"] = SPLIT_MODES[spec.split_mode]
    if spec.tensor_split:
        kwargs["tensor_split"] = list(spec.tensor_split)
    try:
        with (
            model_params(use_extra_bufts=spec.repack, devices=placement.devices_pointer()),
            context_params(n_seq_max=1 if spec.embedding else spec.parallel),
        ):
            llm = llama_cpp.Llama(**kwargs)
    except (ValueError, RuntimeError, OSError, MemoryError) as exc:
        # llama-cpp-python names the path it was given: the user knows their own.
        reason = str(exc).replace(path, str(spec.path))
        raise error(f"cannot load {spec.path}: {reason}") from None
    if spec.embedding:
        pooling = llama_cpp.llama_pooling_type(llm.ctx)
        pooling_name = POOLING_TYPES.get(pooling, str(pooling))
        if pooling_name not in POOLED:
            llm.close()
            raise error(
                f"cannot serve embeddings with {spec.path}: its pooling type is"
                f" {pooling_name}, which makes no single vector per input"
                f" ({', '.join(POOLED)} would; an embedding model's GGUF names one as"
                " <architecture>.pooling_type)"
            )
    _drop_what_workers_never_use(llm)
    template = llm.metadata.get("tokenizer.chat_template", "")
    if spec.chat_template is not None:  # the config's replaces the GGUF's
        template = spec.chat_template
        _use_template(llm, template)
    return Made(llm, placement, template)


def predict_footprint(
    spec: ModelSpec, model_path: Callable[[], str]
) -> tuple[DeviceFootprint, ...]:
    """The footprint footprint.py predicts from the file this worker loads, laid out as
    `make_llama` makes the model (`model_path()`: the path it loads; ModelLoadError: none);
    () when the file cannot be read for it (the load that follows says why)."""
    try:
        header = read_header(Path(model_path()), tensors=True)
    except (OSError, NotGgufError, ModelLoadError) as exc:
        log.warning("%s: no footprint predicted: %s", spec.name, exc)
        return ()
    on_cpu = runs_on_cpu(spec)
    system = llama_cpp.llama_print_system_info()
    layout = Layout(
        n_ctx=spec.n_ctx,
        devices=() if on_cpu else tuple(d for d in spec.devices if d != "cpu"),
        n_gpu_layers=spec.n_gpu_layers,
        split=tuple(spec.tensor_split),
        n_ubatch=spec.n_ctx if spec.embedding else min(spec.n_ctx, DEFAULT_UBATCH),
        repack=spec.repack and all(flag in system for flag in REPACKING_CPU),
        largest_weight=largest_weights(spec, libllama.loaded_libllama()),
    )
    return predict(header, layout)


def _use_template(llm: llama_cpp.Llama, template: str) -> None:
    """Make `llm` render chats with `template`, as `Llama.__init__` makes it render with the
    GGUF's: a Jinja formatter under GGUF_TEMPLATE, with the model's BOS and EOS."""
    model = llm._model
    eos, bos = llm.token_eos(), llm.token_bos()
    llm._chat_handlers[GGUF_TEMPLATE] = llama_chat_format.Jinja2ChatFormatter(
        template=template,
        eos_token=model.token_get_text(eos) if eos != -1 else "",
        bos_token=model.token_get_text(bos) if bos != -1 else "",
        stop_token_ids=[eos],
    ).to_chat_handler()
    llm.chat_format = GGUF_TEMPLATE


@contextmanager
def model_params(
    *, use_extra_bufts: bool, devices: ctypes.c_void_p | None = None
) -> Iterator[None]:
    """While a Llama is made, the llama_model_params it starts from carry `use_extra_bufts`
    (the CPU's repacking buffer types) and `devices` (a NULL-terminated array of ggml devices,
    placement.py; None: llama.cpp's choice), which llama-cpp-python's Llama takes no argument
    for: it builds its params from llama_model_default_params(), which this swaps for the
    while. The engine thread makes every Llama, one at a time."""
    bindings = llama_cpp.llama_cpp
    defaults = bindings.llama_model_default_params

    def params() -> llama_cpp.llama_model_params:
        chosen: llama_cpp.llama_model_params = defaults()
        chosen.use_extra_bufts = use_extra_bufts
        if devices is not None:
            # llama-cpp-python types the field as an array; its _fields_ make it a pointer.
            chosen.devices = devices  # type: ignore[assignment]
        return chosen

    bindings.llama_model_default_params = params
    try:
        yield
    finally:
        bindings.llama_model_default_params = defaults


@contextmanager
def context_params(*, n_seq_max: int) -> Iterator[None]:
    """While a Llama is made, the llama_context_params it starts from allow `n_seq_max` KV
    sequences in one unified cache of n_ctx cells (the decoder's slots, issue 42), which
    llama-cpp-python's Llama takes no argument for (as `model_params`)."""
    bindings = llama_cpp.llama_cpp
    defaults = bindings.llama_context_default_params

    def params() -> llama_cpp.llama_context_params:
        chosen: llama_cpp.llama_context_params = defaults()
        chosen.n_seq_max = n_seq_max
        chosen.kv_unified = True
        return chosen

    bindings.llama_context_default_params = params
    try:
        yield
    finally:
        bindings.llama_context_default_params = defaults


def _drop_what_workers_never_use(llm: llama_cpp.Llama) -> None:
    """Free what llama-cpp-python's Llama allocates for paths a worker never takes: private
    memory kept for the worker's life, 9 MB in a cold gemma-3 worker (issue 28).

    - Its batch has room for n_ctx sequences a token (n_batch blocks of n_ctx ids: 4 MB at n_ctx
      2048). No decode goes through it: the decoder (engine/decode.py) has its own batch,
      embeddings and images theirs. Room for one token does.
    - The candidates of its old sampling API: three arrays of n_vocab entries (5 MB for
      gemma-3's 262,144 tokens), which nothing in the pinned llama-cpp-python reads any more:
      llama.cpp's sampler chain samples."""
    kept = llm._batch
    llm._batch = llm._stack.enter_context(
        closing(LlamaBatch(n_tokens=1, embd=0, n_seq_max=1, verbose=False))
    )
    kept.close()  # type: ignore[no-untyped-call]  # (and at llm.close() again: a no-op then)
    del llm._candidates
