"""The engine's records: what a residency move did (`Moved`), a request prepared from the
vocabulary (`Prepared`), what generating for it made (`Generation`), and the callbacks a request
is run with. Part of the engine (arbiterd/worker/engine/); holds no llama objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from arbiterd.events import EncoderEvent
from arbiterd.states import RequestKind


@dataclass(frozen=True)
class Moved:
    """What one load, release or restore did."""

    duration_s: float
    weights_bytes: int  # weights put on (or taken off) the device
    kv_bytes: int  # KV cache bytes saved to host or restored from it
    disk_read_bytes: int  # bytes this process read from storage meanwhile (/proc/self/io)
    # Of weights_bytes: those a release freed without a copy and a restore read back from the
    # model file's host copy (the in-place backend's device weights).
    file_bytes: int = 0
    copied_bytes: int = 0  # what a release copied out of the buffers it freed


@dataclass
class Generation:
    """The outcome of one request: OpenAI-shaped response plus what it cost."""

    response: dict[str, Any]
    prompt_tokens: int
    prompt_tokens_evaluated: int  # run through llama_decode; prefix-cache hits excluded
    completion_tokens: int
    cancelled: bool = False
    encoder_steps: tuple[EncoderEvent, ...] = ()  # what the projector did for it (issue 12)


@dataclass(frozen=True)
class Prepared:
    """A request rendered and tokenized: the arguments of `Llama.create_completion`, which
    the decoder reads, the prompt as tokens; for an embedding request, each input's tokens.
    Made from the vocabulary alone, so without the GPU."""

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
    def alone(self) -> bool:
        """Whether it runs with no other request beside it: a vision request (its images are
        decoded into a sequence of their own, the projector perhaps swapping the weights out),
        or an embedding request (an embedding model decodes one input at a time)."""
        return bool(self.images) or self.kind is RequestKind.EMBEDDING

    @property
    def prompt_tokens(self) -> list[int]:
        tokens: list[int] = self.completion["prompt"]
        return tokens


ChunkSink = Callable[[dict[str, Any]], None]
"""Receives each streamed chunk."""

Cancelled = Callable[[], bool]
"""Asked between two pieces of a request's work (a tokenizer piece, a decode): True stops it."""


def never() -> bool:
    """A `Cancelled` that never cancels."""
    return False
