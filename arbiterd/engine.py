"""The inference engine: the only module that imports llama_cpp (besides arbiterd/native/).

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
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import llama_cpp

from arbiterd.errors import (
    ContextOverflowError,
    EngineError,
    ModelLoadError,
    RequestError,
    RestoreError,
)
from arbiterd.hostcopy import copy_into_memfd
from arbiterd.native.libllama import ResidencyApi, probe_residency_api
from arbiterd.spec import COMPLETION_PARAMS, MAX_N_CTX, KvPolicy, ModelSpec

log = logging.getLogger(__name__)


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


ChunkSink = Callable[[dict[str, Any]], bool]
"""Receives each streamed chunk; returns False to cancel the request."""


class Backend(Protocol):
    """One model's residency mechanism. All methods run on the engine thread."""

    spec: ModelSpec
    keeps_kv_on_device: bool  # whether release(KvPolicy.DEVICE) is possible
    prompt_tokens_evaluated_total: int

    def load(self) -> Moved: ...

    def release(self, kv: KvPolicy) -> Moved: ...

    def restore(self) -> Moved: ...

    def generate(self, kind: str, body: dict[str, Any], sink: ChunkSink | None) -> Generation: ...

    def resident_bytes(self) -> int: ...

    def host_kv_bytes(self) -> int: ...

    def close(self) -> None: ...


def disk_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (page-cache hits excluded)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


@dataclass
class _KvSnapshot:
    data: bytes
    tokens: list[int]


@dataclass
class _Counting:
    """What one request sent to llama_decode, from the `Llama.eval` calls it made: the first
    evaluates the prompt's uncached suffix, each later one feeds back one sampled token."""

    reused_prefix: int = 0
    evals: list[int] = field(default_factory=list)

    @property
    def prompt_evaluated(self) -> int:
        return self.evals[0] if self.evals else 0

    @property
    def sampled(self) -> int:
        return len(self.evals)  # the last sampled token is never fed back


class ReloadBackend:
    """Portable residency: free everything on release, reload from the host copy on restore."""

    keeps_kv_on_device = False

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._llm: llama_cpp.Llama | None = None
        self._host_fd: int | None = None
        self._kv: _KvSnapshot | None = None
        self._counting = _Counting()
        self.prompt_tokens_evaluated_total = 0

    # -- residency --------------------------------------------------------------------------

    def load(self) -> Moved:
        started, read_before = time.monotonic(), disk_read_bytes()
        if self.spec.host_copy_fd is not None:
            self._host_fd = self.spec.host_copy_fd  # the daemon's copy, shared by its workers
        elif self.spec.host_copy and self._host_fd is None:
            self._host_fd = copy_into_memfd(self.spec.path).fd
        self._llm = self._new_llama(ModelLoadError)
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
        weights = self._weights_bytes()
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
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=self._weights_bytes(),
            kv_bytes=kv_bytes,
            disk_read_bytes=disk_read_bytes() - read_before,
        )

    def resident_bytes(self) -> int:
        """Device bytes by our own accounting: weights plus the KV state while warm, else 0."""
        if self._llm is None:
            return 0
        return self._weights_bytes() + int(llama_cpp.llama_state_get_size(self._llm.ctx))

    def host_kv_bytes(self) -> int:
        """Host memory the KV cache of a cold model takes (the weights' host copy is the
        daemon's, shared by the workers on the same file)."""
        return len(self._kv.data) if self._kv else 0

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None
        if self._host_fd is not None:
            os.close(self._host_fd)
            self._host_fd = None
        self._kv = None

    # -- requests ---------------------------------------------------------------------------

    def generate(self, kind: str, body: dict[str, Any], sink: ChunkSink | None) -> Generation:
        """Run one completion ("completion": body["prompt"]) or chat ("chat": body["messages"]).

        With a sink, chunks are streamed to it as they come; the returned response is then the
        last chunk's metadata with the full text assembled.
        """
        llm = self._require_llm()
        kwargs = _request_kwargs(body)
        self._counting = _Counting()
        try:
            if kind == "chat":
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise RequestError("'messages' must be a non-empty list")
                stream = cast(
                    Iterator[dict[str, Any]],
                    llm.create_chat_completion(messages=messages, stream=True, **kwargs),
                )
            elif kind == "completion":
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise RequestError("'prompt' must be a string")
                stream = cast(
                    Iterator[dict[str, Any]],
                    llm.create_completion(prompt=prompt, stream=True, **kwargs),
                )
            else:
                raise RequestError(f"unknown request kind {kind!r}")
            return self._drain(kind, stream, sink)
        except ValueError as exc:  # llama-cpp-python reports context overflow as ValueError
            if "context window" in str(exc) or "exceed" in str(exc):
                raise ContextOverflowError(str(exc)) from None
            raise RequestError(str(exc)) from None

    def _drain(
        self, kind: str, stream: Iterator[dict[str, Any]], sink: ChunkSink | None
    ) -> Generation:
        pieces: list[str] = []
        last: dict[str, Any] = {}
        finish_reason = None
        cancelled = False
        for chunk in stream:
            chunk["model"] = self.spec.name  # llama-cpp-python names the file it loaded
            last = chunk
            choice = chunk["choices"][0]
            text = choice["delta"].get("content") if kind == "chat" else choice.get("text")
            if text:
                pieces.append(text)
            finish_reason = choice.get("finish_reason") or finish_reason
            if sink is not None and not sink(chunk):
                cancelled = True
                break
        if hasattr(stream, "close"):
            stream.close()  # stops the generator, and llama-cpp's, at once
        counting = self._counting
        evaluated = counting.prompt_evaluated
        self.prompt_tokens_evaluated_total += evaluated
        prompt_tokens = counting.reused_prefix + evaluated
        completion_tokens = counting.sampled
        text = "".join(pieces)
        final: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if kind == "chat":
            final["message"] = {"role": "assistant", "content": text}
        else:
            final["text"] = text
        response = {
            "id": last.get("id", ""),
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": last.get("created", int(time.time())),
            "model": self.spec.name,
            "choices": [final],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        return Generation(response, prompt_tokens, evaluated, completion_tokens, cancelled)

    # -- helpers ----------------------------------------------------------------------------

    def _require_llm(self) -> llama_cpp.Llama:
        if self._llm is None:
            raise RequestError(f"{self.spec.name} is not warm")
        return self._llm

    def _weights_bytes(self) -> int:
        llm = self._llm
        return 0 if llm is None else int(llama_cpp.llama_model_size(llm.model))

    def _new_llama(self, error: type[ModelLoadError] | type[RestoreError]) -> llama_cpp.Llama:
        spec = self.spec
        if not 0 < spec.n_ctx <= MAX_N_CTX:
            raise error(f"n_ctx must be between 1 and {MAX_N_CTX}, got {spec.n_ctx}")
        if self._host_fd is not None:
            path = f"/proc/self/fd/{self._host_fd}"
        elif spec.path.is_file():
            path = str(spec.path)
        else:
            raise error(f"model file not found: {spec.path}")
        kwargs: dict[str, Any] = {
            "model_path": path,
            "n_ctx": spec.n_ctx,
            "n_gpu_layers": spec.n_gpu_layers,
            "seed": spec.seed,
            "verbose": False,
        }
        if spec.n_threads:
            kwargs["n_threads"] = spec.n_threads
        if spec.chat_format:
            kwargs["chat_format"] = spec.chat_format
        try:
            llm = llama_cpp.Llama(**kwargs)
        except (ValueError, RuntimeError, OSError, MemoryError) as exc:
            # llama-cpp-python names the path it was given: the user knows their own.
            reason = str(exc).replace(path, str(spec.path))
            raise error(f"cannot load {spec.path}: {reason}") from None
        _count_evals(llm, lambda: self._counting)
        return llm


class InPlaceBackend(ReloadBackend):
    """Residency through a patched llama.cpp (arbiterd.native): the model and context stay
    alive and only their device buffers go, so nothing is re-parsed; the KV may even stay on
    the device. Loading and generation are the reload backend's."""

    keeps_kv_on_device = True

    def __init__(self, spec: ModelSpec, api: ResidencyApi) -> None:
        super().__init__(spec)
        self._api = api
        self._released = False

    def release(self, kv: KvPolicy) -> Moved:
        llm = self._require_llm()
        started = time.monotonic()
        if kv is KvPolicy.DROP:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            llm.n_tokens = 0
        kv_bytes = 0 if kv is KvPolicy.DROP else int(llama_cpp.llama_state_get_size(llm.ctx))
        self._api.release_device(_context_pointer(llm), keep_kv=kv is KvPolicy.DEVICE)
        self._released = True
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=self._weights_bytes(),
            kv_bytes=0 if kv is KvPolicy.DEVICE else kv_bytes,
            disk_read_bytes=0,
        )

    def restore(self) -> Moved:
        llm = self._require_llm()
        if not self._released:
            raise RestoreError(f"{self.spec.name} is already warm")
        started = time.monotonic()
        try:
            self._api.restore_device(_context_pointer(llm))
        except EngineError as exc:
            raise RestoreError(str(exc)) from None
        self._released = False
        llm._requires_eval = True  # decode one token again rather than trust kept logits
        return Moved(
            duration_s=time.monotonic() - started,
            weights_bytes=self._weights_bytes(),
            kv_bytes=int(llama_cpp.llama_state_get_size(llm.ctx)) if llm.n_tokens else 0,
            disk_read_bytes=0,
        )

    def resident_bytes(self) -> int:
        return 0 if self._released else super().resident_bytes()

    def generate(self, kind: str, body: dict[str, Any], sink: ChunkSink | None) -> Generation:
        if self._released:
            raise RequestError(f"{self.spec.name} is not warm")
        return super().generate(kind, body, sink)


def select_backend(spec: ModelSpec) -> Backend:
    """The in-place backend when the loaded libllama has the residency API, else reload (and
    the reason is logged, once per worker)."""
    probed = probe_residency_api()
    if isinstance(probed, ResidencyApi):
        log.info("%s: in-place residency through %s", spec.name, probed.library)
        return InPlaceBackend(spec, probed)
    log.info("%s: %s", spec.name, probed.reason)
    return ReloadBackend(spec)


def _context_pointer(llm: llama_cpp.Llama) -> int:
    pointer = ctypes.cast(llm.ctx, ctypes.c_void_p).value
    if not pointer:
        raise EngineError("the llama context is gone")
    return pointer


def _save_kv(llm: llama_cpp.Llama) -> _KvSnapshot:
    size = llama_cpp.llama_state_get_size(llm.ctx)
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_get_data(llm.ctx, buffer, size)
    return _KvSnapshot(bytes(buffer)[:written], list(llm.input_ids[: llm.n_tokens]))


def _load_kv(llm: llama_cpp.Llama, kv: _KvSnapshot) -> None:
    size = len(kv.data)
    buffer = (ctypes.c_uint8 * size).from_buffer_copy(kv.data)
    if llama_cpp.llama_state_set_data(llm.ctx, buffer, size) != size:
        raise RestoreError("the saved KV state does not fit the new context")
    n = len(kv.tokens)
    llm.input_ids[:n] = kv.tokens
    llm.n_tokens = n
    # The state holds the KV only, no logits: make generate() decode at least one token again.
    llm._requires_eval = True


def _count_evals(llm: llama_cpp.Llama, current: Callable[[], _Counting]) -> None:
    """Record the token count of every `eval` (the calls that reach llama_decode)."""
    original = llm.eval

    def counting_eval(tokens: Any) -> None:
        counting = current()
        if not counting.evals:
            counting.reused_prefix = llm.n_tokens
        counting.evals.append(len(tokens))
        original(tokens)

    llm.eval = counting_eval  # type: ignore[method-assign]


def _request_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for key, types in COMPLETION_PARAMS.items():
        if key not in body or body[key] is None:
            continue
        value = body[key]
        if isinstance(value, bool) or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types)
            raise RequestError(f"'{key}' must be {expected}, got {type(value).__name__}")
        kwargs[key] = value
    if "max_tokens" in kwargs and kwargs["max_tokens"] < 1:
        raise RequestError("'max_tokens' must be at least 1")
    return kwargs
