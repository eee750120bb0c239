"""Vision (issue 12): owns llama.cpp's multimodal library (libmtmd, through `llama_cpp.mtmd_cpp`)
for one model: its projector (the mmproj "encoder") loaded just in time, images turned into
embeddings, and the token bookkeeping that lets the prompt cache run across images. Besides
the engine (arbiterd/worker/engine/), the only module that touches llama_cpp; it never decodes
on the model's context itself (the engine's images.py does, with the embeddings this module
hands back) and never keeps an image.

Just in time (docs/vision.md, "Just in time"): `Projector.session()` loads the projector right
before an image is encoded and frees it when the block ends, also on every error path; with
`resident` it stays loaded until `free()` (the model going cold).

**Placeholders.** The decoder's prompt cache is a list of token ids per KV sequence
(`Decoder.slots`, worker/engine/decode.py) compared with the next prompt's ids. An image has no
ids: it becomes `n` embeddings at `n` positions. Each image position gets a *placeholder id*
instead, negative (never a vocabulary id, so an image never matches text) and derived from the
image's SHA-256 and its place in the image, so the same image at the same place gives the same
ids and a follow-up turn, which sends the conversation again with its image, matches the cached
prefix through the image and evaluates only its new text. Two different images share their first
placeholder with odds of 1 in 2^31 (then the next positions differ too, with the same odds
each).

**Layouts.** How many positions an image takes, and which text tokens llama.cpp wraps it in
(e.g. Gemma 3's <start_of_image>), is mtmd's to say and needs the projector. `Projector.layouts`
remembers it per image digest for the worker's life, so a follow-up turn whose images are all in
the cached prefix loads no projector at all.

**Beside or swap** (issue 12). The projector is loaded *beside* the model's weights when both fit
the device budget; when they do not, the model *swaps*: its weights leave the device (its KV
stays), the projector is loaded, encodes and is freed, and only then do the weights come back,
so the device never holds both. `plan_encoder` decides from the figures alone; every step of a
request's projector session says which path ran and the most the model held so far
(`EncoderEvent.peak_bytes`, sampled from the engine's own accounting after each step).

**Steps.** Each thing a session does is kept as the `encoder` event that will report it
(events.EncoderEvent, its fields described there), without its time, model and request id,
which the worker loop fills in: "load", "encode" or "free" (the projector), or, on the swap
path, "release" and "restore" (the model's weights, its KV kept on the device). Outside a
request's session a step's path and reason are "" and its peak 0.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import enum
import hashlib
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import mtmd_cpp

from arbiterd.errors import ModelLoadError, RequestError
from arbiterd.events import EncoderEvent
from arbiterd.render import format_bytes
from arbiterd.spec import IMAGE_MARKER

log = logging.getLogger(__name__)

MARKER = IMAGE_MARKER  # where a rendered prompt holds an image (arbiterd/spec.py says why)
# Image formats the decoder in libmtmd (stb_image) reads, by their first bytes. WebP it reads
# only through an ffmpeg subprocess (a build with MTMD_VIDEO), which a worker never starts: the
# HTTP edge converts a WebP to PNG (arbiterd/daemon/http/images.py).
IMAGE_SIGNATURES = {b"\x89PNG\r\n\x1a\n": "png", b"\xff\xd8\xff": "jpeg"}
# mtmd's log lines kept to explain a failure (it reports one on its log, returning NULL).
_LOG_LINES = 32
# Layouts remembered per worker, the oldest forgotten first: a forgotten image costs one
# projector load to lay it out again when it comes back (its placeholders are the same).
MAX_LAYOUTS = 1024
_PLACEHOLDER_SPAN = (1 << 31) - 2  # placeholder ids are -1 .. -(2^31 - 1)
_IMAGE_CHUNK = mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_IMAGE
# libmtmd's helper hands a buffer stb_image cannot decode to `ffprobe` and `ffmpeg` (as a WebP
# or a video), found on PATH unless a directory is named. A worker never runs them on a
# client's bytes: they are looked for under /dev/null, which is not a directory, so no program
# can be found there and the buffer is simply refused.
_NO_FFMPEG_DIR = b"/dev/null"


class EncoderPath(enum.StrEnum):
    """Where the projector goes while it encodes."""

    BESIDE = "beside"  # loaded next to the model's weights
    SWAP = "swap"  # the weights leave the device first (the KV stays) and come back after


@dataclass(frozen=True)
class EncoderPlan:
    """Which path a projector session takes, and why when it is not the plain one: the figures
    that made it swap, or why a swap that was needed could not be done."""

    path: EncoderPath
    reason: str = ""


def plan_encoder(
    *,
    resident_bytes: int,
    encoder_bytes: int,
    budget_bytes: int,
    swap_refusal: str = "",
) -> EncoderPlan:
    """Beside when the model's device bytes (`resident_bytes`: weights, KV, compute buffers)
    and the projector's (`encoder_bytes`) fit `budget_bytes` together, or when no budget is
    known (0); else swap, unless the backend cannot (`swap_refusal` says why): then beside
    regardless, and the reason says so."""
    if budget_bytes <= 0 or resident_bytes + encoder_bytes <= budget_bytes:
        return EncoderPlan(EncoderPath.BESIDE)
    over = (
        f"the model's {format_bytes(resident_bytes)} and the projector's "
        f"{format_bytes(encoder_bytes)} exceed the budget of {format_bytes(budget_bytes)}"
    )
    if swap_refusal:
        return EncoderPlan(EncoderPath.BESIDE, f"{over}, but {swap_refusal}: loaded beside")
    return EncoderPlan(EncoderPath.SWAP, f"{over}: the weights left the device while it encoded")


@dataclass(frozen=True)
class Span:
    """One run of positions an image becomes: text ids mtmd wraps it in (`embeddings` None), or
    the placeholder ids of one image chunk and, once encoded, its embeddings (n x n_embd)."""

    ids: tuple[int, ...]
    image: bool
    chunk: int = 0  # which image chunk of its image (a sliced image has several)


def decode_image(index: int, data: str) -> bytes:
    """The bytes of body["images"][index] (base64, as the HTTP edge passed it), checked to be a
    format the decoder reads. RequestError otherwise."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"images[{index}] is not base64") from None
    if image_format(raw) is None:
        raise RequestError(f"images[{index}] is not a PNG or JPEG image")
    return raw


def image_format(data: bytes) -> str | None:
    """ "png" or "jpeg" by the first bytes; None for anything else."""
    for signature, name in IMAGE_SIGNATURES.items():
        if data.startswith(signature):
            return name
    return None


def placeholder_ids(digest: bytes, chunk: int, n: int) -> tuple[int, ...]:
    """The ids that stand for positions 0..n-1 of chunk `chunk` of the image with `digest`."""
    base = int.from_bytes(digest[:8], "little") + chunk * 0x9E3779B1
    return tuple(-1 - ((base + i) % _PLACEHOLDER_SPAN) for i in range(n))


class _MtmdLog:
    """The last lines mtmd and its helper logged, to say why a call returned NULL. Installed
    once per process (the callback is global in libmtmd); also passes them to `log`."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque(maxlen=_LOG_LINES)
        self._callback = llama_cpp.llama_log_callback(self._on_line)
        mtmd_cpp.mtmd_log_set(self._callback, ctypes.c_void_p(0))
        mtmd_cpp.mtmd_helper_log_set(self._callback, ctypes.c_void_p(0))

    def _on_line(self, level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        line = " ".join(text.decode("utf-8", "replace").split())  # one line, hints included
        if line:
            self.lines.append(line)
            log.debug("mtmd: %s", line)

    def mark(self) -> int:
        self.lines.clear()
        return 0

    def errors(self) -> str:
        """The lines that say what went wrong since `mark`, joined; "" when none did."""
        wrong = [ln for ln in self.lines if "error" in ln.lower() or "mismatch" in ln.lower()]
        return "; ".join(wrong)


_mtmd_log: _MtmdLog | None = None


def _log() -> _MtmdLog:
    global _mtmd_log  # noqa: PLW0603 (one per process: libmtmd's callback is global)
    if _mtmd_log is None:
        _mtmd_log = _MtmdLog()
    return _mtmd_log


class Projector:
    """One vision model's projector: loaded on demand, freed right after (or kept, `resident`).
    Used from the engine thread only, as the model it belongs to."""

    def __init__(self, path: Path, *, resident: bool, n_threads: int | None, use_gpu: bool):
        self.path = path
        self.resident = resident
        # The engine sets the model's own thread count. Measured on a busy 2-core CPU machine:
        # after a projector load with llama.cpp's default of 4 threads, the model's next
        # decodes took up to 1.9 s instead of 0.3 ms; with OMP_WAIT_POLICY=passive they did not
        # (OpenMP's idle team threads spin). The same count made it rarer, not gone.
        self.n_threads = n_threads
        self._use_gpu = use_gpu
        self._ctx: Any = None  # mtmd_context_p while loaded
        self._model: Any = None  # the llama_model it was loaded for
        self._weights_bytes = 0
        # Image digest -> its spans (placeholder ids, wrapper text ids), as mtmd laid it out;
        # in the order they were last used, at most MAX_LAYOUTS.
        self.layouts: OrderedDict[bytes, tuple[Span, ...]] = OrderedDict()
        self.steps: list[EncoderEvent] = []  # what it did since the last `take_steps`
        # The request session under way (`begin` .. `end`): its plan, how to read the model's
        # device bytes, and the most read so far.
        self._plan: EncoderPlan | None = None
        self._meter: Callable[[], int] = _unmetered
        self._peak = 0

    @property
    def loaded(self) -> bool:
        return self._ctx is not None

    def loaded_bytes(self) -> int:
        """The projector's weights while loaded (clip.cpp puts every tensor on the device, as
        stored: the file's tensor data), else 0. Its compute buffers are not counted."""
        return self._weights_bytes if self._ctx is not None else 0

    def weights_bytes(self) -> int:
        """What the projector puts on the device when loaded: what its last load measured, or
        before any, its file's size (what a load will measure)."""
        return self._weights_bytes or _tensor_bytes(self.path)

    def take_steps(self) -> tuple[EncoderEvent, ...]:
        steps, self.steps = tuple(self.steps), []
        return steps

    # -- a request's session ----------------------------------------------------------------

    def begin(self, plan: EncoderPlan, meter: Callable[[], int]) -> None:
        """Start a request's session on `plan`: each step from here on carries it, and the peak
        of `meter` (the model's device bytes, the projector's included), read now and after
        each step."""
        self._plan, self._meter = plan, meter
        self._peak = meter()

    def end(self) -> None:
        self._plan, self._meter, self._peak = None, _unmetered, 0

    def record(self, action: str, duration_s: float, bytes_: int, images: int = 0) -> None:
        """A step done: by the projector itself, or the model's weights leaving or coming back
        around it (the engine's, on the swap path)."""
        plan = self._plan
        if plan is not None:
            self._peak = max(self._peak, self._meter())
        self.steps.append(
            EncoderEvent(
                action=action,
                duration_s=round(duration_s, 6),
                bytes_=bytes_,
                images=images,
                path="" if plan is None else plan.path.value,
                peak_bytes=self._peak,
                reason="" if plan is None else plan.reason,
            )
        )

    # -- lifecycle --------------------------------------------------------------------------

    def check(self, model: Any) -> None:
        """Load the projector for `model` and free it again (unless resident): what the loader
        refuses — a projector whose output width is not the model's n_embd, an unknown
        projector type — fails the model at load, with llama.cpp's reason (ModelLoadError)."""
        try:
            self._load(model, ModelLoadError)
            if not mtmd_cpp.mtmd_support_vision(self._ctx):
                raise ModelLoadError(f"the projector {self.path} encodes no images")
            if mtmd_cpp.mtmd_decode_use_mrope(self._ctx):
                # Its positions are 2-D (Qwen2-VL's M-RoPE): Llama.n_tokens cannot count them.
                raise ModelLoadError(
                    f"the projector {self.path} places images with M-RoPE positions, which "
                    "arbiterd does not serve yet (issue 12)"
                )
        except ModelLoadError:
            self.free()
            raise
        if not self.resident:
            self.free()

    @contextmanager
    def session(self, model: Any) -> Iterator[None]:
        """The projector loaded for the block (RequestError if it cannot be); freed when the
        block ends, however it ends, unless it is resident."""
        try:
            self._load(model, RequestError)
            yield
        finally:
            if not self.resident:
                self.free()

    def free(self) -> None:
        """Free the projector if it is loaded (the model goes cold, or a JIT encode is done)."""
        if self._ctx is None:
            return
        started = time.monotonic()
        mtmd_cpp.mtmd_free(self._ctx)
        self._ctx = self._model = None
        self.record("free", time.monotonic() - started, self._weights_bytes)

    def _load(self, model: Any, error: type[ModelLoadError] | type[RequestError]) -> None:
        if self._ctx is not None:
            if self._model is model:
                return
            self.free()  # loaded for a model since closed (a reload backend's restore)
        started = time.monotonic()
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = self._use_gpu
        params.print_timings = False
        params.warmup = False  # a warm-up encode per JIT load would double its cost
        if self.n_threads:
            params.n_threads = self.n_threads
        journal = _log()
        journal.mark()
        ctx = mtmd_cpp.mtmd_init_from_file(os.fsencode(self.path), model, params)
        if not ctx:
            why = journal.errors() or "llama.cpp gave no reason"
            raise error(f"cannot load the projector {self.path}: {why}")
        self._ctx, self._model = ctx, model
        self._weights_bytes = _tensor_bytes(self.path)
        self.record("load", time.monotonic() - started, self._weights_bytes)

    # -- images -----------------------------------------------------------------------------

    def lay_out(self, images: dict[bytes, bytes]) -> None:
        """Learn the layout of each image (digest -> bytes) not laid out yet. Needs `session`."""
        for digest, data in images.items():
            if digest not in self.layouts:
                chunks = self._tokenize(data)
                try:
                    self.layouts[digest] = self._spans(digest, chunks)
                finally:
                    mtmd_cpp.mtmd_input_chunks_free(chunks)
            self.layouts.move_to_end(digest)
            while len(self.layouts) > MAX_LAYOUTS:
                self.layouts.popitem(last=False)

    def known(self, digests: list[bytes]) -> bool:
        """Whether every image is laid out already (and marks them used)."""
        if not all(digest in self.layouts for digest in digests):
            return False
        for digest in digests:
            self.layouts.move_to_end(digest)
        return True

    def encode(self, data: bytes) -> list[npt.NDArray[np.float32]]:
        """The embeddings of each image chunk of one image, in order (each n x n_embd), with a
        step recorded. Needs `session`."""
        started = time.monotonic()
        chunks = self._tokenize(data)
        out: list[npt.NDArray[np.float32]] = []
        try:
            n_embd = llama_cpp.llama_model_n_embd_inp(self._model)
            for i in range(mtmd_cpp.mtmd_input_chunks_size(chunks)):
                chunk = mtmd_cpp.mtmd_input_chunks_get(chunks, i)
                if mtmd_cpp.mtmd_input_chunk_get_type(chunk) != _IMAGE_CHUNK:
                    continue
                n = int(mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk))
                if mtmd_cpp.mtmd_encode_chunk(self._ctx, chunk) != 0:
                    why = _log().errors() or "llama.cpp gave no reason"
                    raise RequestError(f"the projector could not encode an image: {why}")
                pointer = mtmd_cpp.mtmd_get_output_embd(self._ctx)
                out.append(np.ctypeslib.as_array(pointer, shape=(n, n_embd)).copy())
        finally:
            mtmd_cpp.mtmd_input_chunks_free(chunks)
        made = sum(int(e.nbytes) for e in out)
        self.record("encode", time.monotonic() - started, made, images=1)
        return out

    def non_causal(self) -> bool:
        """Whether the model attends both ways within an image (Gemma 3). Needs `session`."""
        return bool(mtmd_cpp.mtmd_decode_use_non_causal(self._ctx, None))

    def _tokenize(self, data: bytes) -> Any:
        """mtmd's chunks for one image alone (a bitmap part, no text): its image chunks and the
        text mtmd wraps them in. RequestError when the bytes do not decode."""
        if self._ctx is None:
            raise RequestError("the projector is not loaded")
        journal = _log()
        journal.mark()
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        options = mtmd_cpp.mtmd_helper_init_opt_default()
        options.video_params.ffmpeg_bin_dir = _NO_FFMPEG_DIR
        bitmap = mtmd_cpp.mtmd_helper_bitmap_init_from_buf(
            self._ctx, buffer, len(data), False, options
        )
        if not bitmap:
            raise RequestError("an image is corrupt or truncated: it does not decode")
        chunks = mtmd_cpp.mtmd_input_chunks_init()
        try:
            part = mtmd_cpp.mtmd_input_part()
            part.bitmap = bitmap
            parts = (ctypes.POINTER(mtmd_cpp.mtmd_input_part) * 1)(ctypes.pointer(part))
            status = mtmd_cpp.mtmd_tokenize_from_parts(self._ctx, chunks, parts, 1, False)
        finally:
            mtmd_cpp.mtmd_bitmap_free(bitmap)
        if status != 0:
            mtmd_cpp.mtmd_input_chunks_free(chunks)
            why = journal.errors() or f"status {status}"
            raise RequestError(f"the projector cannot take this image: {why}")
        return chunks

    def _spans(self, digest: bytes, chunks: Any) -> tuple[Span, ...]:
        spans: list[Span] = []
        image_chunks = 0
        for i in range(mtmd_cpp.mtmd_input_chunks_size(chunks)):
            chunk = mtmd_cpp.mtmd_input_chunks_get(chunks, i)
            kind = mtmd_cpp.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                tokens = mtmd_cpp.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                if n.value:
                    spans.append(Span(tuple(tokens[: n.value]), image=False))
            elif kind == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                n_tokens = int(mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk))
                if int(mtmd_cpp.mtmd_input_chunk_get_n_pos(chunk)) != n_tokens:
                    raise RequestError("this projector's images take other positions than tokens")
                ids = placeholder_ids(digest, image_chunks, n_tokens)
                spans.append(Span(ids, image=True, chunk=image_chunks))
                image_chunks += 1
            else:
                raise RequestError("the projector made a chunk that is not text or an image")
        return tuple(spans)


def _unmetered() -> int:
    return 0


def digest_of(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _tensor_bytes(path: Path) -> int:
    """The projector's weight bytes: its file's size (the metadata is a few KB of it)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
