"""The inference engine: the only module that imports llama_cpp (besides arbiterd/native/ and
vision.py, which owns its multimodal half, libmtmd).

Owns the llama objects of one model and moving them between device and host. Everything else
talks to the `Backend` protocol, so tests and other residency mechanisms can stand behind it.
Must only be called from one thread (the worker's engine thread): llama.cpp contexts are not
thread-safe, and freeing device buffers must never race a decode.

The portable backend is **reload** (DESIGN.md §4):
- cold: `llama_state_get_data` copies the KV cache into host bytes (with the token list it
  belongs to), then the context and model are freed;
- warm: the model is loaded again from its *host copy* — a memfd holding the GGUF, so a restore
  reads 0 bytes from disk — into a context with identical params, the KV bytes are set back,
  and `Llama.generate`'s prefix matching evaluates only the tokens that are new.
`Llama.save_state()` is not used: it also copies an n_tokens x n_vocab float32 score array.

A request is **prepared** (rendered, sized and tokenized) before it **runs**: preparing needs only
the vocabulary, which a vocab-only model (no weights, no context, no device memory) holds for the
worker's whole life, so a worker tokenizes while cold, before it asks for the GPU (issue 10).

A vision model (ModelSpec.mmproj) takes images in chat requests: prepared as text with a marker
where each image goes, then, on the warm model, laid out and encoded by vision.py's Projector
(loaded just in time) and decoded here as embeddings on the model's own context (issue 12).
When the projector does not fit the device budget beside the model (`vram_budget`, else the
device's measured free memory), the in-place backend takes the weights off the device around
it, the KV left in place (`_encoder_session`); the reload backend cannot, and says so.

An embedding model (ModelSpec.embedding) serves only "embedding" requests, every other model
only "chat" and "completion" ones: its context makes pooled embeddings, one unit-length vector
per input text (issue 11).
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import re
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import llama_chat_format
from llama_cpp._internals import LlamaBatch, LlamaModel
from llama_cpp.llama_grammar import LlamaGrammar

from arbiterd.errors import (
    ArbiterError,
    ContextOverflowError,
    EngineError,
    ModelLoadError,
    RequestError,
    ResidencyCallError,
    RestoreError,
)
from arbiterd.hostcopy import copy_into_memfd
from arbiterd.native import ggml, libllama
from arbiterd.native.libllama import ResidencyApi, probe_residency_api
from arbiterd.request import GenerateRequest, RequestKind, ResponseFormat, ToolChoice
from arbiterd.spec import (
    MAX_N_CTX,
    KvPolicy,
    ModelSpec,
    Residency,
    kind_refusal,
)
from arbiterd.worker.choices import Choice, TokenLogprob
from arbiterd.worker.kvfile import KvState
from arbiterd.worker.toolcalls import CallReader, call_schema, template_takes_tools
from arbiterd.worker.vision import (
    MARKER,
    EncoderPath,
    EncoderStep,
    Projector,
    Span,
    decode_image,
    digest_of,
    plan_encoder,
)

log = logging.getLogger(__name__)
_LIBC = ctypes.CDLL(None)  # this process's C library (malloc_trim, where it is glibc)

# One llama_tokenize call takes time quadratic in the special tokens its text holds (llama.cpp's
# special-token partition walks its fragment list from the start at every match: a chat request
# of 100,000 one-word messages took ~590 s on gemma-3, issue 10). A long text is tokenized in
# pieces of about this size instead, cut where the tokens come out the same (`_Vocab._cut`):
# linear time, and a cancel is seen between two pieces (gemma-3: ~80 ms each at worst).
TOKENIZE_PIECE_BYTES = 16 * 1024
# How many places where a special token starts are tried for a cut before the piece grows by
# another TOKENIZE_PIECE_BYTES (each try reads ~2,000 substrings at most).
CUT_CANDIDATES = 64
# llama-cpp-python's name for the chat format that renders the GGUF's own Jinja template.
GGUF_TEMPLATE = "chat_template.default"
# llama.cpp's enum llama_pooling_type, and the types that make one vector of an input's tokens:
# "none" gives one per token, "rank" a reranker's score.
POOLING_TYPES = {
    llama_cpp.LLAMA_POOLING_TYPE_NONE: "none",
    llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
    llama_cpp.LLAMA_POOLING_TYPE_LAST: "last",
    llama_cpp.LLAMA_POOLING_TYPE_RANK: "rank",
}
POOLED = ("mean", "cls", "last")
# ggml's device kinds whose free memory bounds what a projector may take beside the model.
_GPU_KINDS = ("gpu", "igpu")


@dataclass(frozen=True)
class Moved:
    """What one load, release or restore did."""

    duration_s: float
    weights_bytes: int  # weights put on (or taken off) the device
    kv_bytes: int  # KV cache bytes saved to host or restored from it
    disk_read_bytes: int  # bytes this process read from storage meanwhile (/proc/self/io)


@dataclass
class Generation:
    """The outcome of one request: OpenAI-shaped response plus what it cost."""

    response: dict[str, Any]
    prompt_tokens: int
    prompt_tokens_evaluated: int  # run through llama_decode; prefix-cache hits excluded
    completion_tokens: int
    cancelled: bool = False
    encoder_steps: tuple[EncoderStep, ...] = ()  # what the projector did for it (issue 12)


@dataclass(frozen=True)
class Prepared:
    """A request rendered and tokenized: the arguments `Llama.create_completion` runs it with,
    the prompt as tokens; for an embedding request, each input's tokens. Made from the
    vocabulary alone, so without the GPU."""

    kind: RequestKind
    completion: dict[str, Any]  # {} for an embedding request
    include_usage: bool = False  # a streamed request ends with a chunk of its usage
    n: int = 1  # choices, generated one after the other
    top_logprobs: int | None = None  # None: no log-probabilities; else how many alternatives
    tools: tuple[str, ...] = ()  # the names of the tools the answer may call
    forced_call: bool = False  # a grammar makes the whole answer a call
    parallel_calls: bool = True  # the answer may call several tools; else the first counts
    inputs: tuple[list[int], ...] = ()  # an embedding request's texts, tokenized
    # A vision request's images (PNG or JPEG bytes), and where each goes among the prompt's
    # text tokens (an index into completion["prompt"], in order).
    images: tuple[bytes, ...] = ()
    image_at: tuple[int, ...] = ()

    @property
    def prompt_tokens(self) -> list[int]:
        tokens: list[int] = self.completion["prompt"]
        return tokens


ChunkSink = Callable[[dict[str, Any]], None]
"""Receives each streamed chunk."""

Cancelled = Callable[[], bool]
"""Asked between two pieces of a request's work (a tokenizer piece, a decode): True stops it."""


def _never() -> bool:
    return False


class Backend(Protocol):
    """One model's residency mechanism. All methods run on the engine thread.

    `prepare` touches no device state, so the caller may release or restore the model from
    inside its `cancelled` callback."""

    spec: ModelSpec
    kind: str  # "in-place" or "reload", as status, /metrics and the tray name it
    fallback_reason: str  # why not in-place, when that was looked for and not found; else ""
    keeps_kv_on_device: bool  # whether release(KvPolicy.DEVICE) is possible
    prompt_tokens_evaluated_total: int

    def open(self) -> None: ...

    def load(self) -> Moved: ...

    def release(self, kv: KvPolicy) -> Moved: ...

    def restore(self) -> Moved: ...

    def prepare(self, request: GenerateRequest, cancelled: Cancelled) -> Prepared: ...

    def run(
        self, request: Prepared, sink: ChunkSink | None, cancelled: Cancelled
    ) -> Generation: ...

    def resident_bytes(self) -> int: ...

    def host_kv_bytes(self) -> int: ...

    def host_weights_bytes(self) -> int: ...

    def kept_kv(self) -> KvState | None: ...

    def adopt_kv(self, kv: KvState) -> None: ...

    def close(self) -> None: ...


def disk_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (page-cache hits excluded)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


class _EvalCancelled(Exception):
    """Raised out of `Llama.eval` to stop a cancelled request between two decodes; it never
    leaves this module (`_drain` turns it into a cancelled Generation)."""


@dataclass
class _Run:
    """One request on the warm model: whether to stop it, and what it sent to llama_decode, from
    the `Llama.eval` calls it made: the first evaluates the prompt's uncached suffix, each later
    one feeds back one sampled token."""

    cancelled: Cancelled = _never
    reused_prefix: int = 0
    evals: list[int] = field(default_factory=list)
    stopped: bool = False  # the last eval was cut short by a cancel
    logprobs: list[TokenLogprob] | None = None  # the sampler records here when asked to
    top_logprobs: int = 0

    @property
    def prompt_evaluated(self) -> int:
        return self.evals[0] if self.evals else 0

    @property
    def sampled(self) -> int:
        # A token is sampled after every eval (the last one is never fed back), but none after
        # an eval that a cancel cut short.
        return len(self.evals) - self.stopped


class ReloadBackend:
    """Portable residency: free everything on release, reload from the host copy on restore."""

    kind = "reload"
    keeps_kv_on_device = False
    # Why the projector cannot swap with the weights: freeing them frees the whole context.
    swap_refusal = (
        "the reload backend cannot take the weights off the device and keep the KV there "
        "(it would evaluate the prompt again)"
    )

    def __init__(self, spec: ModelSpec, fallback_reason: str = "", *, vram_budget: int = 0) -> None:
        self.spec = spec
        self.fallback_reason = fallback_reason  # why not in-place, when that was looked for
        # Device bytes a projector session may bring the model to ([daemon] vram_budget); 0:
        # the model's bytes plus the device's free memory when it can be measured, else none.
        self.vram_budget = vram_budget
        self._use_mmap = True
        self._llm: llama_cpp.Llama | None = None
        self._host_fd: int | None = None
        self._vocab: _Vocab | None = None
        self._chat: _ChatFormat | None = None
        self._kv: KvState | None = None
        self._run = _Run()
        self.prompt_tokens_evaluated_total = 0
        self._projector = (
            None
            if spec.mmproj is None
            else Projector(
                spec.mmproj,
                resident=spec.encoder_resident,
                n_threads=spec.n_threads,
                use_gpu=spec.n_gpu_layers != 0,
            )
        )

    # -- residency --------------------------------------------------------------------------

    def open(self) -> None:
        """Get what needs no GPU: the host copy of the file and its vocabulary. The worker calls
        this before it asks for the token; `load` does when nobody did."""
        if self._vocab is not None:
            return
        if self.spec.host_copy_fd is not None:
            self._host_fd = self.spec.host_copy_fd  # the daemon's copy, shared by its workers
        elif self.spec.host_copy and self._host_fd is None:
            self._host_fd = copy_into_memfd(self.spec.path).fd
        self._vocab = _Vocab(self._model_path(ModelLoadError), self.spec.path)

    def load(self) -> Moved:
        started, read_before = time.monotonic(), disk_read_bytes()
        self.open()
        self._llm = self._new_llama(ModelLoadError)
        if self._projector is not None:
            self._projector.n_threads = self._llm.context_params.n_threads
            try:
                self._projector.check(self._llm.model)
            except ModelLoadError:
                self._llm.close()
                self._llm = None
                raise
            self._log_projector_steps("checked at load")
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=self._weights_bytes(),
            kv_bytes=0,
            disk_read_bytes=disk_read_bytes() - read_before,
        )

    def release(self, kv: KvPolicy) -> Moved:
        llm = self._require_llm()
        if kv is KvPolicy.DEVICE:
            raise RequestError("the reload backend cannot keep the KV cache on the device")
        started, read_before = time.monotonic(), disk_read_bytes()
        weights = self._weights_bytes() + self._free_projector()
        self._kv = _save_kv(llm) if kv is KvPolicy.HOST and llm.n_tokens > 0 else None
        llm.close()
        self._llm = None
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
                _load_kv(llm, self._kv)
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

    def host_kv_bytes(self) -> int:
        """Host memory the KV cache of a cold model takes (the weights' host copy is the
        daemon's, shared by the workers on the same file)."""
        return len(self._kv.data) if self._kv else 0

    def host_weights_bytes(self) -> int:
        """Host memory of this worker's own holding the weights: none, a release frees the
        Llama (its next load reads the daemon's shared copy)."""
        return 0

    def kept_kv(self) -> KvState | None:
        """The prompt cache to keep while the model is unloaded (issue 14): a warm model's, or
        the host copy a cold one saved on release; None when there is none (empty, dropped, or
        left on the device by an in-place release, where it cannot be read without a restore).
        """
        if self._kv is not None:
            return self._kv
        llm = self._llm
        if llm is None or self._is_released() or llm.n_tokens == 0:
            return None
        return _save_kv(llm)

    def adopt_kv(self, kv: KvState) -> None:
        """Set a kept prompt cache into the freshly loaded, warm context: the next request then
        evaluates only what its prompt adds. RestoreError when it does not fit; the context is
        then left empty (a full prefill, never a half-set cache)."""
        llm = self._require_llm()
        if self._is_released() or llm.n_tokens != 0:
            raise RestoreError(f"{self.spec.name} has a prompt cache already")
        if len(kv.tokens) > llm.n_ctx():
            raise RestoreError(f"{len(kv.tokens)} tokens do not fit a context of {llm.n_ctx()}")
        try:
            _load_kv(llm, kv)
        except RestoreError:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            llm.n_tokens = 0
            raise

    def _is_released(self) -> bool:
        """Whether the context is alive but its buffers released (the in-place backend)."""
        return False

    def close(self) -> None:
        self._free_projector()
        if self._llm is not None:
            self._llm.close()
            self._llm = None
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None
        if self._host_fd is not None:
            os.close(self._host_fd)
            self._host_fd = None
        self._kv = None

    # -- requests ---------------------------------------------------------------------------

    def prepare(self, request: GenerateRequest, cancelled: Cancelled) -> Prepared:
        """Render and tokenize one completion, chat or embedding request, with the vocabulary
        alone: no device state is touched, so a cold model prepares as well as a warm one. Only
        what needs the model is checked here (the HTTP edge checked every field): the kind it
        serves (a RequestError), its vocabulary's token ids, the grammar of a schema, a template
        with a place for tools, and the context.

        Sizes are checked before any native call: more messages than the context has tokens,
        or more characters than n_ctx of the longest tokens could cover, cannot fit. The
        tokenizer stops as soon as the context is full, and when `cancelled` says so between
        two of its pieces (RequestError)."""
        vocab = self._require_vocab()
        refusal = kind_refusal(self.spec.name, request.kind, self.spec.embedding)
        if refusal:
            raise RequestError(refusal)
        if request.kind is RequestKind.EMBEDDING:
            return self._prepare_embedding(vocab, request.inputs, cancelled)
        n_ctx = self.spec.n_ctx
        kwargs = request.sampling.kwargs()
        bias = _logit_bias(request.logit_bias, vocab.n_tokens)
        if bias:
            kwargs["logit_bias"] = bias
        images: tuple[bytes, ...] = ()
        image_at: tuple[int, ...] = ()
        if request.kind is RequestKind.CHAT:
            images = self._images(request.images)
            completion, image_at = self._prepare_chat(
                vocab, request, kwargs, cancelled, len(images)
            )
        else:
            _check_characters(len(request.prompt), vocab.max_text_bytes(n_ctx))
            tokens = vocab.completion_prompt(request.prompt, limit=n_ctx, cancelled=cancelled)
            completion = {"prompt": tokens, "stream": True, **kwargs}
        prepared = Prepared(
            request.kind,
            completion,
            include_usage=request.include_usage,
            n=request.n,
            top_logprobs=request.logprobs,
            tools=tuple(tool.name for tool in request.tools),
            forced_call=request.tool_choice is not ToolChoice.AUTO,
            parallel_calls=request.parallel_tool_calls,
            images=images,
            image_at=image_at,
        )
        if len(prepared.prompt_tokens) >= n_ctx:  # the test create_completion makes, made early
            raise ContextOverflowError(
                f"Requested tokens ({len(prepared.prompt_tokens)}) exceed context window of {n_ctx}"
            )
        return prepared

    def _images(self, given: tuple[str, ...]) -> tuple[bytes, ...]:
        """A chat request's images (base64, one per marker in its messages, as the HTTP edge
        made them), checked to be images this model can take."""
        if given and self._projector is None:
            raise RequestError(
                f"{self.spec.name} takes no images: its config names no mmproj (a projector)"
            )
        return tuple(decode_image(index, data) for index, data in enumerate(given))

    def _prepare_chat(
        self,
        vocab: _Vocab,
        request: GenerateRequest,
        kwargs: dict[str, Any],
        cancelled: Cancelled,
        n_images: int = 0,
    ) -> tuple[dict[str, Any], tuple[int, ...]]:
        """A chat request's completion arguments, and where its `n_images` images go among the
        prompt's tokens."""
        n_ctx = self.spec.n_ctx
        messages = list(request.messages)
        # Chat templates put at least a role marker around every message: each takes a
        # token at least, so more messages than the context has tokens cannot fit.
        if len(messages) > n_ctx:
            raise ContextOverflowError(
                f"{len(messages)} messages exceed the context window of {n_ctx} tokens"
            )
        _check_characters(_characters(messages), vocab.max_text_bytes(n_ctx))
        response_format = _response_format(request.response_format, vocab)
        if response_format is not None:  # the chat handler turns it into a grammar
            kwargs = {**kwargs, "response_format": response_format}
        tools = [tool.to_json() for tool in request.tools]
        forced = {
            ToolChoice.AUTO: None,
            ToolChoice.REQUIRED: "required",
            ToolChoice.FUNCTION: request.tool_name,
        }[request.tool_choice]
        call_grammar = _call_grammar(tools, forced, vocab, shaped=response_format is not None)
        if tools:
            self._require_tool_template()
            kwargs["tools"] = tools  # for the template; the choice is ours to enforce
        completion, image_at = self._chat_completion(
            vocab, _template_messages(messages), kwargs, cancelled, n_images
        )
        if call_grammar is not None:
            completion["grammar"] = call_grammar
        return completion, image_at

    def run(self, request: Prepared, sink: ChunkSink | None, cancelled: Cancelled) -> Generation:
        """Generate for a prepared request on the warm model, its `n` choices one after the
        other (each after the first reuses the prompt's KV). With a sink, chunks are streamed to
        it as they come; the returned response is then assembled from them. `cancelled` is
        asked before every decode: the prompt is evaluated n_batch tokens at a time, so a
        cancel waits for one batch at most."""
        llm = self._require_llm()
        if request.kind is RequestKind.EMBEDDING:
            return self._embed(llm, request.inputs, cancelled)
        head: dict[str, Any] = {}  # one id and creation time for every chunk of every choice
        choices: list[Choice] = []
        prompt_tokens = cached = evaluated = completion_tokens = 0
        stopped = False
        completion = request.completion
        prefill: _Prefill | None = None
        if request.images:
            try:
                prefill = self._prefill_images(llm, request)
            except ArbiterError:
                self._log_projector_steps("a failed request")  # none is left for the next one
                raise
            completion = {**completion, "prompt": prefill.tokens}
        for index in range(request.n):
            recorded: list[TokenLogprob] | None = None if request.top_logprobs is None else []
            run = self._run = _Run(
                cancelled, logprobs=recorded, top_logprobs=request.top_logprobs or 0
            )
            calls = (
                CallReader(
                    request.tools, forced=request.forced_call, parallel=request.parallel_calls
                )
                if request.tools
                else None
            )
            choice = Choice(request.kind, index, calls=calls, logprobs=recorded)
            try:
                chunks = llm.create_completion(**_for_choice(completion, index))
                stopped = self._drain(choice, cast(Iterator[dict[str, Any]], chunks), head, sink)
            except ValueError as exc:  # llama-cpp-python reports bad arguments as ValueError
                raise RequestError(str(exc)) from None
            choices.append(choice)
            if index == 0:
                prompt_tokens, cached = run.reused_prefix + run.prompt_evaluated, run.reused_prefix
                if prefill is not None and prefill.evaluated:
                    cached = prefill.reused  # the rest of the prefix was evaluated just before
                    evaluated += prefill.evaluated
            evaluated += run.prompt_evaluated
            completion_tokens += run.sampled
            if stopped:
                break
        self.prompt_tokens_evaluated_total += evaluated
        chat = request.kind is RequestKind.CHAT
        response = {
            "id": head.get("id", ""),
            "object": "chat.completion" if chat else "text_completion",
            "created": head.get("created", int(time.time())),
            "model": self.spec.name,
            "choices": [choice.result() for choice in choices],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                # the prompt-cache hit: the prefix kept from earlier requests, not evaluated again
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        if sink is not None and request.include_usage and not stopped:
            # OpenAI's last chunk of a stream that asked for it: no choices, the usage.
            sink(
                {
                    "id": response["id"],
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": response["created"],
                    "model": response["model"],
                    "choices": [],
                    "usage": response["usage"],
                }
            )
        steps = self._projector.take_steps() if self._projector is not None else ()
        return Generation(
            response, prompt_tokens, evaluated, completion_tokens, stopped, encoder_steps=steps
        )

    def generate(self, request: GenerateRequest, sink: ChunkSink | None) -> Generation:
        """`prepare` and `run` in one call, never cancelled: for callers that drive a backend
        directly and hold the GPU anyway (tests, benchmarks)."""
        return self.run(self.prepare(request, _never), sink, _never)

    def _prepare_embedding(
        self, vocab: _Vocab, texts: tuple[str, ...], cancelled: Cancelled
    ) -> Prepared:
        """Tokenize each text as `Llama.embed` does: with the vocabulary's BOS/EOS (BERT's
        CLS/SEP), special tokens taken as plain text. Each input is embedded in one decode, so
        each must fit the context on its own."""
        n_ctx = self.spec.n_ctx
        inputs = []
        for index, text in enumerate(texts):
            if cancelled():  # between two inputs: a waiter gets the GPU, a cancel is seen
                raise RequestError("cancelled while its input was tokenized")
            try:
                tokens = vocab.tokenize(
                    text.encode(),
                    add_special=True,
                    parse_special=False,
                    limit=n_ctx,
                    cancelled=cancelled,
                )
            except ContextOverflowError as exc:
                raise ContextOverflowError(f"input[{index}]: {exc}") from None
            if len(tokens) > n_ctx:
                raise ContextOverflowError(
                    f"input[{index}] is {len(tokens)} tokens long, more than the context window"
                    f" of {n_ctx}"
                )
            if not tokens:
                raise RequestError(f"input[{index}] makes no tokens: there is nothing to embed")
            inputs.append(tokens)
        return Prepared(RequestKind.EMBEDDING, {}, inputs=tuple(inputs))

    def _embed(
        self, llm: llama_cpp.Llama, inputs: tuple[list[int], ...], cancelled: Cancelled
    ) -> Generation:
        """OpenAI's embedding response for the prepared inputs: each decoded alone, from an
        empty cache, in one decode (`_new_llama` makes a decode hold the whole context), its
        pooled vector scaled to length 1 as OpenAI's and Ollama's are. `cancelled` is asked
        before each; a cancel returns the vectors made so far, marked cancelled."""
        n_embd = llm.n_embd()
        memory = llama_cpp.llama_get_memory(llm.ctx)  # NULL for an encoder: it keeps no cache
        batch = LlamaBatch(n_tokens=max(map(len, inputs)), embd=0, n_seq_max=1, verbose=False)
        data: list[dict[str, Any]] = []
        tokens = 0
        try:
            for index, input_tokens in enumerate(inputs):
                if cancelled():
                    break
                if memory:
                    llama_cpp.llama_memory_clear(memory, True)
                batch.set_batch(input_tokens, n_past=0, logits_all=True)  # pooling reads all
                status = llama_cpp.llama_decode(llm.ctx, batch.batch)
                if status != 0:
                    raise EngineError(f"llama_decode failed (status {status}) on input[{index}]")
                pooled = llama_cpp.llama_get_embeddings_seq(llm.ctx, 0)
                if not pooled:
                    raise EngineError(f"llama.cpp pooled no vector for input[{index}]")
                vector = _unit_length(pooled[:n_embd])
                data.append({"object": "embedding", "index": index, "embedding": vector})
                tokens += len(input_tokens)
        finally:
            batch.close()  # type: ignore[no-untyped-call]
        self.prompt_tokens_evaluated_total += tokens
        response = {
            "object": "list",
            "data": data,
            "model": self.spec.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return Generation(response, tokens, tokens, 0, cancelled=len(data) < len(inputs))

    def _chat_completion(
        self,
        vocab: _Vocab,
        messages: list[Any],
        kwargs: dict[str, Any],
        cancelled: Cancelled,
        n_images: int = 0,
    ) -> tuple[dict[str, Any], tuple[int, ...]]:
        """The completion arguments the chat handler makes of `messages`, and where each of
        `n_images` images goes among its prompt tokens: the rendered prompt is cut at each
        MARKER and its pieces tokenized one by one, as mtmd tokenizes the text around media."""
        if self._chat is None:
            raise RequestError(f"{self.spec.name} has not been loaded yet")
        image_at: list[int] = []

        def tokenize(text: bytes, add_bos: bool, special: bool) -> list[int]:
            pieces = text.split(MARKER.encode()) if n_images else [text]
            if len(pieces) - 1 != n_images:
                raise RequestError(
                    f"the chat template kept {len(pieces) - 1} of the request's {n_images} "
                    "images; its messages must carry each image where the template prints text"
                )
            tokens: list[int] = []
            image_at.clear()
            for index, piece in enumerate(pieces):
                if index:
                    image_at.append(len(tokens))
                tokens += vocab.tokenize(
                    piece,
                    add_special=add_bos and index == 0,
                    parse_special=special,
                    limit=self.spec.n_ctx,
                    cancelled=cancelled,
                )
            return tokens

        call = _CompletionCall(self._chat, tokenize)
        # Llama.create_chat_completion picks the chat handler and its defaults; the handler
        # renders the template, tokenizes through `call` and hands it the completion to run.
        try:
            llama_cpp.Llama.create_chat_completion(
                cast(llama_cpp.Llama, call), messages=messages, stream=True, **kwargs
            )
        except (ValueError, llama_chat_format.LlamaChatCompletionHandlerNotFoundException) as exc:
            # A template's raise_exception(), or a chat_format llama-cpp-python does not know.
            raise RequestError(str(exc)) from None
        return call.arguments, tuple(image_at)

    def _require_tool_template(self) -> None:
        if self._chat is None:
            raise RequestError(f"{self.spec.name} has not been loaded yet")
        if not self._chat.takes_tools:
            how = (
                f'its chat_format "{self._chat.chat_format}"'
                if self._chat.chat_format != GGUF_TEMPLATE
                else "the chat template in its GGUF"
            )
            raise RequestError(
                f"{self.spec.name} cannot be offered tools: {how} has no place for them"
            )

    def _drain(
        self,
        choice: Choice,
        stream: Iterator[dict[str, Any]],
        head: dict[str, Any],
        sink: ChunkSink | None,
    ) -> bool:
        """Feed one choice's text chunks to `choice`, sending what it makes of them to the sink;
        True if a cancel stopped it."""
        try:
            for chunk in stream:
                chunk["model"] = self.spec.name  # llama-cpp-python names the file it loaded
                if not head:  # the first chunk names the whole response
                    prefix = "chat" if choice.kind == "chat" else ""
                    head.update(id=prefix + chunk["id"], created=chunk["created"])
                for converted in choice.convert(chunk):
                    converted.update(head)
                    if sink is not None:
                        sink(converted)
        except _EvalCancelled:  # raised through llama-cpp-python's generators, which are done
            return True
        return False

    # -- images -----------------------------------------------------------------------------

    def _prefill_images(self, llm: llama_cpp.Llama, request: Prepared) -> _Prefill:
        """Lay a vision request's prompt out with its images and evaluate it up to its last
        token, which `Llama.generate` evaluates (its prefix match then finds every position
        but that one cached, and samples from fresh logits).

        The projector is loaded only when something needs it: an image never laid out (the
        worker's first sight of it), or one that is not in the cached prefix (to encode it).
        It encodes every such image, is freed (just in time), and only then are the text and
        the embeddings decoded on the model's context. A follow-up turn whose images are all
        in the cached prefix loads nothing and leaves the whole suffix to `generate`."""
        projector = self._projector
        if projector is None:
            raise RequestError(f"{self.spec.name} takes no images")
        data = {digest_of(image): image for image in request.images}
        digests = [digest_of(image) for image in request.images]
        embeddings: dict[bytes, list[npt.NDArray[np.float32]]] = {}
        non_causal = False
        with ExitStack() as stack:
            if not projector.known(digests):
                unknown = {d: data[d] for d in digests if d not in projector.layouts}
                stack.enter_context(self._encoder_session(llm, projector))
                projector.lay_out(unknown)
            tokens, placed = _lay_out(request, digests, projector.layouts)
            if len(tokens) >= llm.n_ctx():
                raise ContextOverflowError(
                    f"Requested tokens ({len(tokens)}) exceed context window of {llm.n_ctx()}"
                )
            if tokens[-1] < 0:
                raise RequestError("the prompt ends with an image: the template must end in text")
            cached = _common_prefix(llm.input_ids[: llm.n_tokens].tolist(), tokens[:-1])
            pending = [p for p in placed if p[0] + len(p[2].ids) > cached]
            if not pending:
                return _Prefill(tokens, 0, 0)
            start = min(cached, pending[0][0])
            if not projector.loaded:
                stack.enter_context(self._encoder_session(llm, projector))
            for _, digest, _ in pending:
                if digest not in embeddings:
                    embeddings[digest] = projector.encode(data[digest])
            non_causal = projector.non_causal()
        # The projector is freed here (unless resident), and swapped-out weights are back:
        # the model's context decodes alone.
        self._run = _Run()  # counts the text evaluated below (Llama.eval is instrumented)
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), -1, start, -1)
        llm.n_tokens = start
        image_positions = 0
        for at, digest, span in pending:
            if at > llm.n_tokens:
                llm.eval(tokens[llm.n_tokens : at])
            _decode_embeddings(llm, embeddings[digest][span.chunk], span.ids, non_causal)
            image_positions += len(span.ids)
        if len(tokens) - 1 > llm.n_tokens:
            llm.eval(tokens[llm.n_tokens : len(tokens) - 1])
        text = sum(self._run.evals)
        return _Prefill(tokens, start, text + image_positions)

    @contextmanager
    def _encoder_session(self, llm: llama_cpp.Llama, projector: Projector) -> Iterator[None]:
        """The projector loaded for the block, beside the weights or swapped with them as
        `plan_encoder` decides: on the swap path the weights leave first (the KV stays), and
        come back only after the projector is freed, also when the block fails. Each step is
        recorded with the path and the peak of `resident_bytes`."""
        resident = self.resident_bytes()
        plan = plan_encoder(
            resident_bytes=resident,
            encoder_bytes=0 if projector.loaded else projector.weights_bytes(),
            budget_bytes=self._encoder_budget(resident),
            swap_refusal=(
                'the projector is resident (encoder = "resident")'
                if projector.resident
                else self.swap_refusal
            ),
        )
        if plan.reason:
            log.info("%s: projector %s: %s", self.spec.name, plan.path.value, plan.reason)
        projector.begin(plan, self.resident_bytes)
        try:
            with ExitStack() as stack:
                if plan.path is EncoderPath.SWAP:
                    started = time.monotonic()
                    moved = self._weights_off()
                    projector.record("release", time.monotonic() - started, moved)
                    stack.callback(self._swap_back, projector)
                # Entered last, left first: the projector is freed before the weights return.
                stack.enter_context(projector.session(llm.model))
                yield
        finally:
            projector.end()

    def _swap_back(self, projector: Projector) -> None:
        started = time.monotonic()
        moved = self._weights_on()
        projector.record("restore", time.monotonic() - started, moved)

    def _encoder_budget(self, resident_bytes: int) -> int:
        """The device bytes the model may reach with its projector: `vram_budget`, else what
        it holds plus the device's free memory, else 0 (unknown: a model on the CPU, where
        the engine cannot tell)."""
        if self.vram_budget > 0:
            return self.vram_budget
        if self.spec.n_gpu_layers == 0 or not llama_cpp.llama_supports_gpu_offload():
            return 0
        free = _free_device_bytes()
        return 0 if free is None else resident_bytes + free

    def _weights_off(self) -> int:
        """Take the weights off the device, the KV left there; the bytes moved. Only a backend
        without a `swap_refusal` is asked."""
        raise EngineError(self.swap_refusal)

    def _weights_on(self) -> int:
        raise EngineError(self.swap_refusal)

    def _free_projector(self) -> int:
        """Free a loaded projector (going cold, closing); the bytes it held on the device, which
        the release reports with the weights. Its step is logged, not left for a request."""
        if self._projector is None or not self._projector.loaded:
            return 0
        held = self._projector.loaded_bytes()
        self._projector.free()
        self._log_projector_steps("going cold")
        return held

    def _warm_projector(self) -> int:
        """Load a resident projector with the model it belongs to (warming up); the bytes it
        put on the device. One that cannot be loaded now leaves the model warm without it: the
        next image tries again, and fails its request with the reason."""
        projector, llm = self._projector, self._llm
        if projector is None or not projector.resident or llm is None:
            return 0
        try:
            with projector.session(llm.model):
                pass
        except RequestError as exc:
            log.warning("%s: resident projector not loaded on warm-up: %s", self.spec.name, exc)
            return 0
        self._log_projector_steps("loaded on warm-up")
        return projector.loaded_bytes()

    def _log_projector_steps(self, why: str) -> None:
        """Log the projector's steps that no request reports (`why` they are not)."""
        if self._projector is not None:
            for step in self._projector.take_steps():
                log.info("%s: projector, %s: %s", self.spec.name, why, step.to_json())

    def _projector_bytes(self) -> int:
        return 0 if self._projector is None else self._projector.loaded_bytes()

    # -- helpers ----------------------------------------------------------------------------

    def _require_llm(self) -> llama_cpp.Llama:
        if self._llm is None:
            raise RequestError(f"{self.spec.name} is not warm")
        return self._llm

    def _weights_bytes(self) -> int:
        llm = self._llm
        return 0 if llm is None else int(llama_cpp.llama_model_size(llm.model))

    def _require_vocab(self) -> _Vocab:
        if self._vocab is None:
            raise RequestError(f"{self.spec.name} has not been opened yet")
        return self._vocab

    def _model_path(self, error: type[ModelLoadError] | type[RestoreError]) -> str:
        if self._host_fd is not None:
            return f"/proc/self/fd/{self._host_fd}"
        if self.spec.path.is_file():
            return str(self.spec.path)
        raise error(f"model file not found: {self.spec.path}")

    def _new_llama(self, error: type[ModelLoadError] | type[RestoreError]) -> llama_cpp.Llama:
        spec = self.spec
        if not 0 < spec.n_ctx <= MAX_N_CTX:
            raise error(f"n_ctx must be between 1 and {MAX_N_CTX}, got {spec.n_ctx}")
        path = self._model_path(error)
        kwargs: dict[str, Any] = {
            "model_path": path,
            "n_ctx": spec.n_ctx,
            "n_gpu_layers": spec.n_gpu_layers,
            "seed": spec.seed,
            "use_mmap": self._use_mmap,
            "verbose": False,
        }
        if spec.n_threads:
            kwargs["n_threads"] = spec.n_threads
        if spec.chat_format:
            kwargs["chat_format"] = spec.chat_format
        if spec.embedding:
            # An input is embedded in one decode: llama.cpp encodes a model that attends both
            # ways (BERT) in one micro-batch, and Llama.n_batch caps a decode's tokens. Both
            # hold the whole context, so every input that fits the context can be embedded.
            kwargs |= {"embedding": True, "n_batch": spec.n_ctx, "n_ubatch": spec.n_ctx}
        try:
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
        _instrument_eval(llm, lambda: self._run)
        _instrument_sample(llm, lambda: self._run)
        template = llm.metadata.get("tokenizer.chat_template", "")
        self._chat = _ChatFormat(
            llm.chat_handler,
            llm._chat_handlers,
            llm.chat_format,
            takes_tools=llm.chat_format == GGUF_TEMPLATE and template_takes_tools(template),
        )
        return llm


class InPlaceBackend(ReloadBackend):
    """Residency through the arbiterd engine build (arbiterd/native/llama-residency.patch): the
    model and context stay alive and only their buffers' bytes move, so nothing is re-parsed or
    re-read; the KV may even stay on the device. Loading and generation are the reload
    backend's.

    KV policies: `device` keeps the KV buffers where they are; `host` saves the KV with the state
    API (only the cells in use, with their tokens) before the release and sets it back after the
    restore; `drop` clears it. A model that runs on the CPU (n_gpu_layers = 0, or an engine that
    cannot offload) is loaded without mmap and releases its host buffers too, so the same
    mechanism frees its RAM: the weights' copy then lives in a memory file outside the worker's
    mappings."""

    kind = "in-place"
    keeps_kv_on_device = True
    swap_refusal = ""

    def __init__(self, spec: ModelSpec, api: ResidencyApi, *, vram_budget: int = 0) -> None:
        super().__init__(spec, vram_budget=vram_budget)
        self._api = api
        self._released = False
        # The weights are off the device for a projector (the swap path), or stayed off when
        # bringing them back failed: the next request or release tries again.
        self._swapped_out = False
        self._host_buffers = spec.n_gpu_layers == 0 or not llama_cpp.llama_supports_gpu_offload()
        self._use_mmap = not self._host_buffers  # mapped weights live in the file, not in buffers
        self._kept_kv_bytes = 0  # KV left on the device by a `device` release

    def release(self, kv: KvPolicy) -> Moved:
        llm = self._require_llm()
        if self._released:
            raise RequestError(f"{self.spec.name} is already cold")
        self._heal_swap()
        started = time.monotonic()
        projector_bytes = self._free_projector()  # going cold frees a resident encoder
        ctx = _context_pointer(llm)
        flags = self._flags(kv)
        if kv is KvPolicy.DROP:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            llm.n_tokens = 0
        self._kv = _save_kv(llm) if kv is KvPolicy.HOST and llm.n_tokens > 0 else None
        kept = self._api.stats(ctx, self._flags(KvPolicy.HOST)).kv_bytes
        self._kept_kv_bytes = kept if kv is KvPolicy.DEVICE else 0
        try:
            self._api.release_device(ctx, flags)
        except ResidencyCallError as exc:
            self._kv = None
            raise EngineError(str(exc)) from None
        if self._host_buffers:
            _return_freed_heap()
        stats = self._api.stats(ctx, flags)
        self._released = True
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=stats.weights_bytes + projector_bytes,
            kv_bytes=len(self._kv.data) if self._kv else 0,
            disk_read_bytes=0,
        )

    def restore(self) -> Moved:
        llm = self._require_llm()
        if not self._released:
            raise RestoreError(f"{self.spec.name} is already warm")
        started, read_before = time.monotonic(), disk_read_bytes()
        ctx = _context_pointer(llm)
        weights = self._api.stats(ctx, 0).weights_bytes
        try:
            self._api.restore_device(ctx)
        except ResidencyCallError as exc:
            # Still released, the weights' copy intact, the saved KV kept: the next warm-up
            # tries again.
            raise RestoreError(f"restore failed: {exc}") from None
        self._released = False
        kv_bytes = 0
        if self._kv is not None:
            try:
                _load_kv(llm, self._kv)
            except RestoreError:
                self._api.release_device(ctx, self._flags(KvPolicy.HOST))  # stay cold, KV kept
                self._released = True
                raise
            kv_bytes = len(self._kv.data)
            self._kv = None
        elif self._kept_kv_bytes == 0:
            llm.n_tokens = 0  # the cache came back empty
        self._kept_kv_bytes = 0
        llm._requires_eval = True  # decode one token again rather than trust kept logits
        weights += self._warm_projector()
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=weights,
            kv_bytes=kv_bytes,
            disk_read_bytes=disk_read_bytes() - read_before,
        )

    def resident_bytes(self) -> int:
        """Device bytes (host bytes for a CPU model) by the engine's own figures: weights, KV
        and compute buffers while warm; the KV kept by a `device` release while cold."""
        llm = self._llm
        if llm is None:
            return 0
        if self._released or self._swapped_out:
            return self._kept_kv_bytes + self._projector_bytes()
        stats = self._api.stats(_context_pointer(llm), self._flags(KvPolicy.HOST))
        return stats.device_bytes + self._projector_bytes()

    def _is_released(self) -> bool:
        return self._released

    def host_weights_bytes(self) -> int:
        """Host memory holding the released weights, this worker's own (0 while warm): the
        engine keeps the device's tensors as they were laid out there, beside the daemon's copy
        of the file they were loaded from."""
        llm = self._llm
        if llm is None or not self._released:
            return 0
        return self._api.stats(_context_pointer(llm), 0).host_bytes

    def run(self, request: Prepared, sink: ChunkSink | None, cancelled: Cancelled) -> Generation:
        if self._released:
            raise RequestError(f"{self.spec.name} is not warm")
        self._heal_swap()
        return super().run(request, sink, cancelled)

    def _weights_off(self) -> int:
        """Release the weights and compute buffers with KEEP_KV: the KV cells stay where they
        are, so the encode costs no prompt evaluation and no KV copy."""
        ctx = _context_pointer(self._require_llm())
        flags = self._flags(KvPolicy.DEVICE)
        kept = self._api.stats(ctx, self._flags(KvPolicy.HOST)).kv_bytes
        try:
            self._api.release_device(ctx, flags)
        except ResidencyCallError as exc:
            raise EngineError(f"cannot make room for the projector: {exc}") from None
        if self._host_buffers:
            _return_freed_heap()
        self._swapped_out, self._kept_kv_bytes = True, kept
        return self._api.stats(ctx, flags).weights_bytes

    def _weights_on(self) -> int:
        """Bring the weights back after the projector; the KV never left. On failure they stay
        off (the context released, its copies intact) and RestoreError says so."""
        llm = self._require_llm()
        ctx = _context_pointer(llm)
        weights = self._api.stats(ctx, 0).weights_bytes
        try:
            self._api.restore_device(ctx)
        except ResidencyCallError as exc:
            raise RestoreError(
                f"{self.spec.name}'s weights could not come back after the projector: {exc}"
            ) from None
        self._swapped_out, self._kept_kv_bytes = False, 0
        llm._requires_eval = True  # decode one token again rather than trust kept logits
        return weights

    def _heal_swap(self) -> None:
        """Weights a failed swap left off the device come back before anything else runs
        (RestoreError again if they still cannot)."""
        if self._swapped_out:
            self._weights_on()

    def _flags(self, kv: KvPolicy) -> int:
        flags = libllama.KEEP_KV if kv is KvPolicy.DEVICE else 0
        return flags | (libllama.HOST_BUFFERS if self._host_buffers else 0)


@dataclass(frozen=True)
class EngineInfo:
    """What the loaded engine can do: offload to a GPU or not, and on which devices."""

    offload: bool  # llama_supports_gpu_offload
    devices: tuple[str, ...]  # "CPU: <model name>", "CUDA0: NVIDIA H200", ...

    def to_json(self) -> dict[str, Any]:
        return {"offload": self.offload, "devices": list(self.devices)}


def engine_info() -> EngineInfo:
    """The loaded llama_cpp's abilities; the device list is empty when libggml cannot be read."""
    try:
        found = tuple(device.label for device in ggml.devices(libllama.loaded_libllama()))
    except (EngineError, OSError, AttributeError) as exc:
        log.warning("cannot list the engine's devices: %s", exc)
        found = ()
    return EngineInfo(offload=bool(llama_cpp.llama_supports_gpu_offload()), devices=found)


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


def _free_device_bytes() -> int | None:
    """Free memory of the first GPU the engine offers (where a projector goes); None when it
    has none or ggml cannot be read."""
    try:
        found = ggml.devices(libllama.loaded_libllama())
    except (EngineError, OSError, AttributeError) as exc:
        log.warning("cannot read the devices' free memory: %s", exc)
        return None
    # A device whose driver runs on the CPU reports a fixed heap, not what is free: no budget.
    return next((d.free_bytes for d in found if d.kind in _GPU_KINDS and not d.on_cpu), None)


@dataclass(frozen=True)
class _Prefill:
    """A vision prompt laid out: its tokens (placeholder ids at image positions), the cached
    prefix kept, and the positions evaluated before `generate` ran (text and image)."""

    tokens: list[int]
    reused: int
    evaluated: int


def _lay_out(
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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _decode_embeddings(
    llm: llama_cpp.Llama, embd: npt.NDArray[np.float32], ids: tuple[int, ...], non_causal: bool
) -> None:
    """Decode one image chunk's embeddings at the model's next positions, recording its
    placeholder ids there (so the next prompt's prefix match runs through it). A model that
    attends both ways within an image (Gemma 3) needs the whole image in one decode."""
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
                batch.pos[i] = llm.n_tokens + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 0
            batch.n_tokens = count
            status = llama_cpp.llama_decode(llm.ctx, batch)
            if status != 0:
                raise EngineError(f"llama_decode failed (status {status}) on an image")
            llm.input_ids[llm.n_tokens : llm.n_tokens + count] = ids[first : first + count]
            llm.n_tokens += count
    finally:
        if non_causal:
            llama_cpp.llama_set_causal_attn(llm.ctx, True)
        llama_cpp.llama_batch_free(batch)


def _return_freed_heap() -> None:
    """Hand the heap pages freed host buffers leave back to the system. glibc keeps freed blocks
    below its mmap threshold (which grows up to 32 MiB as a process frees large blocks) in its
    arenas, so without this a CPU model's release would not lower the worker's RSS."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _context_pointer(llm: llama_cpp.Llama) -> int:
    pointer = ctypes.cast(llm.ctx, ctypes.c_void_p).value
    if not pointer:
        raise EngineError("the llama context is gone")
    return pointer


def _save_kv(llm: llama_cpp.Llama) -> KvState:
    size = llama_cpp.llama_state_get_size(llm.ctx)
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_get_data(llm.ctx, buffer, size)
    return KvState(list(llm.input_ids[: llm.n_tokens]), bytes(buffer)[:written])


def _load_kv(llm: llama_cpp.Llama, kv: KvState) -> None:
    size = len(kv.data)
    buffer = (ctypes.c_uint8 * size).from_buffer_copy(kv.data)
    if llama_cpp.llama_state_set_data(llm.ctx, buffer, size) != size:
        raise RestoreError("the saved KV state does not fit the new context")
    n = len(kv.tokens)
    llm.input_ids[:n] = kv.tokens
    llm.n_tokens = n
    # The state holds the KV only, no logits: make generate() decode at least one token again.
    llm._requires_eval = True


def _instrument_eval(llm: llama_cpp.Llama, current: Callable[[], _Run]) -> None:
    """Make every `eval` (the calls that reach llama_decode) count its tokens into the current
    run and stop it between two batches when it is cancelled. `Llama.eval` decodes n_batch
    tokens at a time anyway; handing it one batch per call changes nothing but that a cancel
    is seen in between (a decode itself cannot be interrupted). A stopped eval leaves n_tokens
    at what was decoded, so the next request's prefix match stays right."""
    original = llm.eval

    def eval_in_batches(tokens: Any) -> None:
        run = current()
        if not run.evals:
            run.reused_prefix = llm.n_tokens
        run.evals.append(0)
        for start in range(0, len(tokens), llm.n_batch):
            if run.cancelled():
                run.stopped = True
                raise _EvalCancelled
            batch = tokens[start : start + llm.n_batch]
            original(batch)
            run.evals[-1] += len(batch)

    llm.eval = eval_in_batches  # type: ignore[method-assign]


def _instrument_sample(llm: llama_cpp.Llama, current: Callable[[], _Run]) -> None:
    """Make every `sample` record the sampled token's log-probability, and the most likely
    tokens at its place, when the current run asks for them: from the logits the model gave
    (before penalties, bias and grammar: the model's own distribution, as OpenAI reports it).
    Without this llama-cpp-python computes log-probabilities only with logits_all, which keeps
    n_ctx x n_vocab floats (4 GiB for gemma-3 at 4,096 tokens) for every request."""
    original = llm.sample
    vocab = llm._model.vocab
    n_vocab = llm.n_vocab()

    def sample_recording(*args: Any, **kwargs: Any) -> int:
        token: int = original(*args, **kwargs)
        run = current()
        if run.logprobs is None or llama_cpp.llama_vocab_is_eog(vocab, token):
            return token
        idx = kwargs.get("idx")
        pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1 if idx is None else idx - llm.n_tokens)
        logits = np.ctypeslib.as_array(pointer, shape=(n_vocab,)).astype(np.float64)
        run.logprobs.append(_token_logprob(llm, logits, token, run.top_logprobs))
        return token

    llm.sample = sample_recording  # type: ignore[method-assign]


def _token_logprob(
    llm: llama_cpp.Llama, logits: npt.NDArray[np.float64], token: int, top: int
) -> TokenLogprob:
    peak = logits.max()
    logprobs = logits - (peak + np.log(np.exp(logits - peak).sum()))
    best = np.argpartition(-logprobs, top)[:top] if top else np.array([], dtype=np.intp)
    ranked = sorted(best.tolist(), key=lambda t: -logprobs[t])
    return TokenLogprob(
        token=llm.detokenize([token]),
        logprob=float(logprobs[token]),
        top=tuple((llm.detokenize([t]), float(logprobs[t])) for t in ranked),
    )


def _unit_length(vector: list[float]) -> list[float]:
    """`vector` scaled to length 1 (as it is when all zeros), in float32 values: exactly what an
    answer packs as base64 of float32."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return array("f", [x / norm for x in vector] if norm else vector).tolist()


def _response_format(wanted: ResponseFormat | None, vocab: _Vocab) -> dict[str, Any] | None:
    """The chat request's structured output, as llama-cpp-python's chat handlers take it:
    {"type": "json_object"}, with the JSON schema the output must follow when there is one
    ("schema"), checked to compile to a grammar; None for free text."""
    if wanted is None:
        return None
    if wanted.schema is None:
        return {"type": "json_object"}
    _grammar(wanted.schema, "the JSON schema", vocab)
    return {"type": "json_object", "schema": wanted.schema}


def _grammar(schema: dict[str, Any], what: str, vocab: _Vocab) -> LlamaGrammar:
    """The grammar whose sentences are the instances of a JSON schema; RequestError naming
    `what` when llama-cpp-python's converter cannot follow the schema, or llama.cpp cannot
    parse what the converter wrote."""
    try:  # the converter reports what it cannot follow in assorted exceptions
        grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    except Exception as exc:
        raise RequestError(f"{what} cannot be followed: {exc}") from None
    if not vocab.parses(grammar):
        raise RequestError(
            f"{what} cannot be followed: llama.cpp cannot parse the grammar made of it (a"
            " property name with a form feed, a backspace or a quote, for one)"
        )
    return grammar


def _logit_bias(given: dict[int, float], n_vocab: int) -> dict[int, float]:
    """The request's logit bias, checked to name tokens of this model's vocabulary."""
    for token in given:
        if not 0 <= token < n_vocab:
            raise RequestError(
                f"'logit_bias' names token {token}; this model's ids are 0 to {n_vocab - 1}"
            )
    return dict(given)


def _call_grammar(
    tools: list[dict[str, Any]], forced: str | None, vocab: _Vocab, *, shaped: bool
) -> LlamaGrammar | None:
    """The grammar that makes the answer the call `forced` asks for (None: the model's choice),
    after checking every tool's parameters, called or not: a bad one is the client's bug."""
    for tool in tools:
        function = tool["function"]
        _grammar(function.get("parameters") or {}, f"tool {function['name']!r}'s parameters", vocab)
    if forced is None:
        return None
    if shaped:
        raise RequestError(
            "'response_format' cannot shape an answer that 'tool_choice' makes a call"
        )
    return _grammar(call_schema(tools, None if forced == "required" else forced), "the call", vocab)


def _template_messages(messages: list[Any]) -> list[Any]:
    """Messages as chat templates read them (the Hugging Face convention): a call's arguments
    as an object rather than OpenAI's JSON text, and "" for the content of an assistant turn
    that only called tools (templates trim or concatenate it)."""
    shaped = []
    for message in messages:
        if not isinstance(message, dict) or not message.get("tool_calls"):
            shaped.append(message)
            continue
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
                calls.append(call)
                continue
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError:
                arguments = function["arguments"]
            calls.append({**call, "function": {**function, "arguments": arguments}})
        shaped.append({**message, "content": message.get("content") or "", "tool_calls": calls})
    return shaped


def _for_choice(completion: dict[str, Any], index: int) -> dict[str, Any]:
    """The arguments of choice `index`: with a seed, each choice gets its own (seed + index), so
    the choices differ and the whole response is the same again for the same seed."""
    if index == 0 or completion.get("seed") is None:
        return completion
    return {**completion, "seed": completion["seed"] + index}


def _characters(messages: list[Any]) -> int:
    """Characters in all the strings of a chat request's messages (what a template renders)."""
    count, pending = 0, list(messages)
    while pending:  # a loop, not recursion: the nesting depth is the client's choice
        value = pending.pop()
        if isinstance(value, str):
            count += len(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return count


def _check_characters(count: int, limit: int | None) -> None:
    if limit is not None and count > limit:
        raise ContextOverflowError(
            f"{count} characters exceed what the context window can hold ({limit})"
        )


@dataclass(frozen=True)
class _ChatFormat:
    """What `Llama.create_chat_completion` picks its chat handler from, as `Llama.__init__` set
    it up from the model's metadata and the spec's chat_format."""

    chat_handler: Any
    _chat_handlers: dict[str, Any]
    chat_format: str | None
    takes_tools: bool = False  # the chat template renders the tools a request offers


class _CompletionCall:
    """Stands in for the `Llama` that `Llama.create_chat_completion` runs on, without weights:
    the chat handler renders the template, tokenizes the prompt through `tokenize` and asks
    `create_completion` to run it, which records the arguments instead (to run them on the
    warm model later) and hands back an empty stream that nobody reads."""

    verbose = False

    def __init__(self, chat: _ChatFormat, tokenize: Callable[[bytes, bool, bool], list[int]]):
        self.chat_handler = chat.chat_handler
        self._chat_handlers = chat._chat_handlers
        self.chat_format = chat.chat_format
        self._tokenize = tokenize
        self.arguments: dict[str, Any] = {}

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._tokenize(text, add_bos, special)

    def create_completion(self, **arguments: Any) -> Iterator[dict[str, Any]]:
        self.arguments = arguments
        return iter(())


class _Vocab:
    """A model file's vocabulary alone (llama_model_params.vocab_only: no weights, no context,
    no device memory), kept for the worker's life to tokenize requests while the model is cold.
    gemma-3-270m (262,144 tokens): ~0.65 s to load, ~0.3 s to index, 44 MB of RAM.

    Tokenizes as one llama_tokenize call does (parse_special: as llama-cpp-python tokenizes
    prompts), but a long text in pieces (TOKENIZE_PIECE_BYTES), for SPM and BPE vocabularies
    (llama-, gemma- and GPT-style models): llama.cpp splits a text at its special tokens and
    tokenizes each stretch in between on its own, so a cut where a special token is sure to
    be split off changes nothing (`_cut`). Other vocabularies are tokenized in one call."""

    def __init__(self, path: str, shown: Path) -> None:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        try:
            self._model = LlamaModel(path_model=path, params=params, verbose=False)
        except ValueError:
            raise ModelLoadError(f"cannot load the vocabulary of {shown}") from None
        vocab = self._vocab = self._model.vocab
        self.bos = llama_cpp.llama_vocab_bos(vocab)
        self.eos = llama_cpp.llama_vocab_eos(vocab)
        self.sep = llama_cpp.llama_vocab_sep(vocab)
        self.add_bos = llama_cpp.llama_vocab_get_add_bos(vocab)
        self.add_eos = llama_cpp.llama_vocab_get_add_eos(vocab)
        self.n_tokens = llama_cpp.llama_vocab_n_tokens(vocab)
        self._in_pieces = llama_cpp.llama_vocab_type(vocab) in (
            llama_cpp.LLAMA_VOCAB_TYPE_SPM,
            llama_cpp.LLAMA_VOCAB_TYPE_BPE,
        )
        # What llama.cpp splits texts at (its cache_special_tokens) and how.
        special = (
            llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
            | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
            | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        )
        specials, lstrip, rstrip, longest = set(), set(), set(), 0
        if self._in_pieces:
            for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
                text = llama_cpp.llama_vocab_get_text(vocab, token)
                longest = max(longest, len(text))
                attr = llama_cpp.llama_vocab_get_attr(vocab, token)
                if attr & special and text:
                    specials.add(text)
                    if attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP:
                        lstrip.add(text)
                    if attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP:
                        rstrip.add(text)
        self._specials = frozenset(specials)
        self._lstrip = frozenset(lstrip)
        self._rstrip = frozenset(rstrip)
        self._lengths = sorted({len(text) for text in specials}, reverse=True)
        self._longest_special = self._lengths[0] if self._lengths else 0
        # Where a special token may start: its first two bytes (`_clean_cut` checks the rest).
        # One alternative per two-byte start, not per token: gemma-3 has 6,414 special tokens,
        # which `re` would try one by one at every '<'.
        starts = sorted({text[:2] for text in specials}, key=len, reverse=True)
        self._special_starts = re.compile(b"|".join(map(re.escape, starts)) or b"(?!)")
        # SPM writes a space as the 3-byte "▁" and byte-level BPE each byte as a 1- or 2-byte
        # character: no token covers more bytes of text than its own text has.
        self._longest_token = longest

    def close(self) -> None:
        self._model.close()  # type: ignore[no-untyped-call]

    def parses(self, grammar: LlamaGrammar) -> bool:
        """Whether llama.cpp's grammar parser takes `grammar`, tried as the sampler will be:
        for one it refuses, llama_sampler_init_grammar returns NULL, which llama-cpp-python
        adds to its sampler chain all the same, and the first sample dereferences (issue 24:
        a schema whose property name holds a form feed, a backspace or a quote killed the
        worker with SIGSEGV). The converter writes those as escapes GBNF lacks."""
        sampler = llama_cpp.llama_sampler_init_grammar(
            self._vocab, grammar._grammar.encode(), grammar._root.encode()
        )
        if not sampler:
            return False
        llama_cpp.llama_sampler_free(sampler)
        return True

    def max_text_bytes(self, n_ctx: int) -> int | None:
        """The longest text (bytes, or characters: never more) that n_ctx tokens can hold;
        None where the vocabulary may drop text (WPM and UGM skip whitespace)."""
        return n_ctx * self._longest_token if self._in_pieces else None

    def completion_prompt(self, prompt: str, *, limit: int, cancelled: Cancelled) -> list[int]:
        """The tokens `Llama.create_completion` makes of a text prompt: BOS if the vocabulary
        adds one, the text with its special tokens parsed, then SEP or EOS if it adds one."""
        text = self.tokenize(
            prompt.encode(), add_special=False, parse_special=True, limit=limit, cancelled=cancelled
        )
        bos = [self.bos] if self.add_bos and self.bos != -1 else []
        eos = [self.sep if self.sep != -1 else self.eos] if self.add_eos or self.sep != -1 else []
        return bos + text + eos

    def tokenize(
        self,
        text: bytes,
        *,
        add_special: bool,
        parse_special: bool,
        limit: int,
        cancelled: Cancelled,
    ) -> list[int]:
        """`text`'s tokens, as llama_tokenize gives them. ContextOverflowError once they are
        `limit` or more (or the text is too long for that many); RequestError when `cancelled`
        says so between two pieces."""
        max_bytes = self.max_text_bytes(limit)
        if max_bytes is not None and len(text) > max_bytes:
            raise ContextOverflowError(
                f"a prompt of {len(text)} bytes exceeds the {max_bytes} that the context window"
                f" of {limit} tokens can hold"
            )
        # Without parse_special, llama.cpp splits only at some special tokens: `_cut` assumes all.
        if not (self._in_pieces and parse_special) or len(text) <= TOKENIZE_PIECE_BYTES:
            return self._call(text, add_special=add_special, parse_special=parse_special)
        # SPM and BPE add BOS/EOS around the whole text, as the vocabulary says.
        tokens = [self.bos] if add_special and self.add_bos else []
        start = 0
        while start < len(text):
            if cancelled():
                raise RequestError("cancelled while its prompt was tokenized")
            end = self._cut(text, start + TOKENIZE_PIECE_BYTES)
            tokens += self._call(text[start:end], add_special=False, parse_special=True)
            if len(tokens) >= limit:
                raise ContextOverflowError(
                    f"Requested tokens ({len(tokens)} or more) exceed context window of {limit}"
                )
            start = end
        if add_special and self.add_eos:
            tokens.append(self.eos)
        return tokens

    def _call(self, text: bytes, *, add_special: bool, parse_special: bool) -> list[int]:
        capacity = len(text) + 2
        while True:
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(
                self._vocab, text, len(text), buffer, capacity, add_special, parse_special
            )
            if count >= 0:
                return list(buffer[:count])
            capacity = -count  # llama_tokenize says how many it needs

    def _cut(self, text: bytes, at: int) -> int:
        """The first place from `at` on where the text can be cut without changing its tokens
        (end of text if none), trying CUT_CANDIDATES possible special-token starts per piece
        length."""
        while at < len(text):
            for tried, match in enumerate(self._special_starts.finditer(text, at), start=1):
                if self._clean_cut(text, match.start()):
                    return match.start()
                if tried == CUT_CANDIDATES:
                    break
            else:
                return len(text)  # no special token after `at`: the rest is one stretch
            at += TOKENIZE_PIECE_BYTES
        return len(text)

    def _clean_cut(self, text: bytes, p: int) -> bool:
        """Whether llama.cpp surely splits a special token off at `p`. It looks for special
        tokens longest first, each in the stretches still unsplit, leftmost match first; the
        longest one starting at p (length m) is split off there unless a special at least as
        long overlaps it or covers p, which would be matched first (or in an unknown order).
        Then the stretches before and after p see the same matches as in the whole text. Also:
        an LSTRIP token would strip the whitespace before p, and an RSTRIP token that ends at p
        the whitespace p starts with."""
        m = next((n for n in self._lengths if text[p : p + n] in self._specials), 0)
        if m == 0:
            return False  # only its first two bytes are a special token's
        token = text[p : p + m]
        if token in self._lstrip:
            return False
        if token[:1].isspace() and any(
            text[max(0, p - n) : p] in self._rstrip for n in self._lengths
        ):
            return False
        for q in range(max(0, p - self._longest_special + 1), p + m):
            for n in self._lengths:
                if n < m:
                    break  # shorter ones are matched after it
                overlaps = q > p or q + n > p
                if q != p and overlaps and text[q : q + n] in self._specials:
                    return False
        return True
