"""What both residency mechanisms share: one model's llama objects (its vocabulary, its Llama, the
projector of a vision model), loading them (each Llama made as loading.py makes it), the prompt
cache kept across a load, the projector's sessions beside or swapped with the weights, and
handing requests to preparation and generation.
The mechanisms themselves, how a release and a restore move the model, are the subclasses':
reload.py (free everything, load again) and inplace.py (move the buffers' bytes, the objects
kept). Part of the engine (arbiterd/worker/engine/): it calls llama_cpp, on the engine thread only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt

from arbiterd.errors import (
    ArbiterError,
    ContextOverflowError,
    EngineError,
    ModelLoadError,
    RequestError,
    RestoreError,
)
from arbiterd.footprint import DeviceFootprint
from arbiterd.hostcopy import copy_into_memfd
from arbiterd.request import GenerateRequest
from arbiterd.spec import Capability, KvPolicy, ModelInfo, ModelSpec, capabilities
from arbiterd.states import BackendKind, RequestKind
from arbiterd.worker.engine.decode import Decoder, common_prefix
from arbiterd.worker.engine.generate import Generator
from arbiterd.worker.engine.images import (
    Prefill,
    decode_embeddings,
    free_device_bytes,
    lay_out,
)
from arbiterd.worker.engine.loading import make_llama, predict_footprint
from arbiterd.worker.engine.placement import (
    Placement,
    runs_on_cpu,
)
from arbiterd.worker.engine.prepare import GGUF_TEMPLATE, ChatFormat, Preparer
from arbiterd.worker.engine.records import Cancelled, ChunkSink, Generation, Moved, Prepared, never
from arbiterd.worker.engine.vocab import Vocab
from arbiterd.worker.kvfile import KvState
from arbiterd.worker.toolcalls import template_takes_tools
from arbiterd.worker.vision import (
    EncoderPath,
    Projector,
    digest_of,
    plan_encoder,
)

log = logging.getLogger(__name__)
_LIBC = ctypes.CDLL(None)  # this process's C library (malloc_trim, where it is glibc)

# llama.cpp's enum llama_pooling_type, and the types that make one vector of an input's tokens:
# "none" gives one per token, "rank" a reranker's score.
# The KV sequence a vision prompt is laid out in (a vision request runs alone: the decoder's
# others are idle meanwhile), and its first choice generates in.
VISION_SLOT = 0


class LlamaBackend(ABC):
    """One model's llama objects and what is done with them whichever way they move; a subclass
    says how a release and a restore move them (its `kind`)."""

    kind: BackendKind  # as status, /metrics and the tray name it
    keeps_kv_on_device: bool  # whether release(KvPolicy.DEVICE) is possible
    # Why the projector cannot swap with the weights ("" where it can: `_weights_off`).
    swap_refusal: str

    def __init__(self, spec: ModelSpec, fallback_reason: str = "", *, vram_budget: int = 0) -> None:
        self.spec = spec
        self.fallback_reason = fallback_reason  # why not in-place, when that was looked for
        # Device bytes a projector session may bring the model to ([daemon] vram_budget); 0:
        # the model's bytes plus the device's free memory when it can be measured, else none.
        self.vram_budget = vram_budget
        self._use_mmap = True
        self._placement: Placement | None = None  # its devices, found when it first loads
        # Its footprint as predicted from its GGUF before it first loaded (issue 44); () until
        # then, or where the file could not be read for it.
        self._predicted: tuple[DeviceFootprint, ...] = ()
        self._llm: llama_cpp.Llama | None = None
        self._host_fd: int | None = None
        self._vocab: Vocab | None = None
        self._chat: ChatFormat | None = None
        self._kv: KvState | None = None
        self._generator = Generator(spec.name, parallel=spec.parallel, seed=spec.seed)
        self._ended: dict[str, Generation] = {}  # requests run alone, for the next `step`
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

    @abstractmethod
    def release(self, kv: KvPolicy) -> Moved:
        """Take the model off the device, its KV kept as `kv` says."""

    @abstractmethod
    def restore(self) -> Moved:
        """Bring a released model back onto the device, warm."""

    @abstractmethod
    def resident_bytes(self) -> int:
        """Device bytes the model holds now, by the backend's own accounting."""

    @abstractmethod
    def host_weights_bytes(self) -> int:
        """Host memory of this worker's own holding the weights."""

    @abstractmethod
    def _weights_off(self) -> int:
        """Take the weights off the device, the KV left there; the bytes moved. Only a backend
        without a `swap_refusal` is asked."""

    @abstractmethod
    def _weights_on(self) -> int:
        """Bring the weights `_weights_off` took back."""

    @property
    def prompt_tokens_evaluated_total(self) -> int:
        return self._generator.prompt_tokens_evaluated_total

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
        self._vocab = Vocab(self._model_path(ModelLoadError), self.spec.path)
        # Before the token too: a fitting set's keeper counts it before the first load.
        self._predicted = predict_footprint(self.spec, lambda: self._model_path(ModelLoadError))

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

    def host_kv_bytes(self) -> int:
        """Host memory the KV cache of a cold model takes (the weights' host copy is the
        daemon's, shared by the workers on the same file)."""
        return len(self._kv.data) if self._kv else 0

    def kept_kv(self) -> KvState | None:
        """The prompt cache to keep while the model is unloaded (issue 14): a warm model's, or
        the host copy a cold one saved on release; None when there is none (empty, dropped, or
        left on the device by an in-place release, where it cannot be read without a restore).
        """
        if self._kv is not None:
            return self._kv
        llm = self._llm
        if llm is None or self._is_released() or not self._generator.decoder.cells_used:
            return None
        return save_kv(llm, self._generator.decoder)

    def adopt_kv(self, kv: KvState) -> None:
        """Set a kept prompt cache into the freshly loaded, warm context: the next request then
        evaluates only what its prompt adds. RestoreError when it does not fit; the context is
        then left empty (a full prefill, never a half-set cache)."""
        llm = self._require_llm()
        decoder = self._generator.decoder
        if self._is_released() or decoder.cells_used:
            raise RestoreError(f"{self.spec.name} has a prompt cache already")
        if len(kv.tokens) > llm.n_ctx():
            raise RestoreError(f"{len(kv.tokens)} tokens do not fit a context of {llm.n_ctx()}")
        if kv.seq >= decoder.n_seq:
            raise RestoreError(
                f"it was kept in sequence {kv.seq}, beyond parallel = {decoder.n_seq}"
            )
        try:
            load_kv(llm, kv)
        except RestoreError:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            raise
        # The state holds every sequence's cells; the one kept is what the slots say.
        decoder.slots[kv.seq][:] = kv.tokens

    def _is_released(self) -> bool:
        """Whether the context is alive but its buffers released (the in-place backend)."""
        return False

    def close(self) -> None:
        self._free_projector()
        self._generator.decoder.unbind()
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

    def capabilities(self) -> tuple[Capability, ...]:
        """What this model can be asked for (spec.capabilities), once its vocabulary is open:
        whether its GGUF has a chat template is read there; () before."""
        if self._vocab is None:
            return ()
        vocab = self._vocab
        return capabilities(
            self.spec, has_chat_template=bool(vocab.chat_template), has_fim=vocab.fim is not None
        )

    def model_info(self) -> ModelInfo | None:
        """What its GGUF says of the model, with the chat template chats are rendered with (the
        config's, else the GGUF's); None before its vocabulary is open."""
        vocab = self._vocab
        if vocab is None:
            return None
        template = self.spec.chat_template
        if template is None:
            template = vocab.chat_template
        return ModelInfo(vocab.architecture, vocab.trained_context, template)

    def prepare(self, request: GenerateRequest, cancelled: Cancelled) -> Prepared:
        """Check, render and tokenize a request with the vocabulary alone (`Preparer.prepare`):
        no device state is touched, so a cold model prepares as well as a warm one."""
        preparer = Preparer(
            self.spec, self._require_vocab(), self._chat, takes_images=self._projector is not None
        )
        return preparer.prepare(request, cancelled)

    def begin(
        self, request_id: str, request: Prepared, sink: ChunkSink | None, cancelled: Cancelled
    ) -> None:
        """Start a prepared request on the warm model beside those running: a chat or
        completion request joins the decoder's batch; one that runs alone (`Prepared.alone`:
        images, or embeddings) is run to its end here, with nothing else running. Its result
        comes from the next `step`; what keeps it from starting is raised."""
        if request.alone:
            if self._generator.busy:
                raise EngineError("a request that runs alone was begun beside others")
            self._ended[request_id] = self.run(request, sink, cancelled)
            return
        self._before_run()
        self._generator.begin(request, sink, cancelled, key=request_id)

    def step(self) -> dict[str, Generation | ArbiterError]:
        """One decode of every running request's sequences; the requests that ended, by the
        ids they were begun with: their generation, or why they failed."""
        ended: dict[str, Generation | ArbiterError] = dict(self._ended)
        self._ended.clear()
        if self._generator.busy:
            for job in self._generator.step():
                outcome = job.error or job.generation
                assert outcome is not None  # a job ends done or failed
                ended[job.key] = outcome
        return ended

    def abandon(self, error: ArbiterError) -> list[str]:
        """End every running request with `error` (a step raised what it never should); their
        ids. The KV is emptied: the step may have left it half made."""
        ended = [job.key for job in self._generator.fail_all(error)]
        ended += self._ended
        self._ended.clear()
        return ended

    @property
    def generating(self) -> int:
        """The sequences generating now."""
        return self._generator.running

    @property
    def tokens_generated_total(self) -> int:
        return self._generator.decoder.tokens_generated_total

    def _before_run(self) -> None:
        """Check the model can decode now: it is loaded (and, in place, not released)."""
        self._require_llm()

    def run(self, request: Prepared, sink: ChunkSink | None, cancelled: Cancelled) -> Generation:
        """Generate for a prepared request on the warm model (`Generator.run`), its images
        first laid out and encoded (`_prefill_images`), or embed its inputs: alone, from
        begin to end."""
        llm = self._require_llm()
        self._before_run()
        if request.kind is RequestKind.EMBEDDING:
            return self._generator.embed(llm, request.inputs, cancelled)
        prefill: Prefill | None = None
        if request.images:
            try:
                prefill = self._prefill_images(llm, request)
            except ArbiterError:
                self._log_projector_steps("a failed request")  # none is left for the next one
                raise
        return self._generator.run(
            request, sink, cancelled, prefill=prefill, projector=self._projector
        )

    def generate(self, request: GenerateRequest, sink: ChunkSink | None) -> Generation:
        """`prepare` and `run` in one call, never cancelled: for callers that drive a backend
        directly and hold the GPU anyway (tests, benchmarks)."""
        return self.run(self.prepare(request, never), sink, never)

    # -- images -----------------------------------------------------------------------------

    def _prefill_images(self, llm: llama_cpp.Llama, request: Prepared) -> Prefill:
        """Lay a vision request's prompt out with its images and evaluate it, in the decoder's
        slot VISION_SLOT, up to its last token, which the decoder evaluates (its prefix match
        then finds every position but that one cached, and samples from fresh logits).

        The projector is loaded only when something needs it: an image never laid out (the
        worker's first sight of it), or one that is not in the cached prefix (to encode it).
        It encodes every such image, is freed (just in time), and only then are the text and
        the embeddings decoded on the model's context. A follow-up turn whose images are all
        in the cached prefix loads nothing and leaves the whole suffix to the decoder."""
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
            tokens, placed = lay_out(request, digests, projector.layouts)
            if len(tokens) >= llm.n_ctx():
                raise ContextOverflowError(
                    f"Requested tokens ({len(tokens)}) exceed context window of {llm.n_ctx()}"
                )
            if tokens[-1] < 0:
                raise RequestError("the prompt ends with an image: the template must end in text")
            decoder = self._generator.decoder
            cached = common_prefix(decoder.slots[VISION_SLOT], tokens[:-1])
            pending = [p for p in placed if p[0] + len(p[2].ids) > cached]
            if not pending:
                return Prefill(tokens, 0, 0)
            start = min(cached, pending[0][0])
            if not projector.loaded:
                stack.enter_context(self._encoder_session(llm, projector))
            for _, digest, _ in pending:
                if digest not in embeddings:
                    embeddings[digest] = projector.encode(data[digest])
            non_causal = projector.non_causal()
        # The projector is freed here (unless resident), and swapped-out weights are back:
        # the model's context decodes alone.
        decoder.trim(VISION_SLOT, start)
        slot = decoder.slots[VISION_SLOT]
        text = image_positions = 0
        for at, digest, span in pending:
            if at > len(slot):
                text += decoder.evaluate(VISION_SLOT, tokens[len(slot) : at], never)
            chunk = embeddings[digest][span.chunk]
            decode_embeddings(llm, chunk, len(slot), VISION_SLOT, non_causal)
            decoder.positions(VISION_SLOT, span.ids)
            image_positions += len(span.ids)
        if len(tokens) - 1 > len(slot):
            text += decoder.evaluate(VISION_SLOT, tokens[len(slot) : len(tokens) - 1], never)
        return Prefill(tokens, start, text + image_positions)

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
        if runs_on_cpu(self.spec):
            return 0
        free = free_device_bytes()
        return 0 if free is None else resident_bytes + free

    @property
    def predicted_footprint(self) -> tuple[DeviceFootprint, ...]:
        return self._predicted

    def footprint(self) -> tuple[DeviceFootprint, ...]:
        """The footprint by the engine's own figures while warm, per device; () where the
        engine cannot tell (a subclass that can says)."""
        return ()

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

    def _require_vocab(self) -> Vocab:
        if self._vocab is None:
            raise RequestError(f"{self.spec.name} has not been opened yet")
        return self._vocab

    def _new_llama(self, error: type[ModelLoadError] | type[RestoreError]) -> llama_cpp.Llama:
        """The model's Llama, made as loading.make_llama makes it, attached to the generator,
        with the chat format its template gives it."""
        path = self._model_path(error)
        made = make_llama(self.spec, path, use_mmap=self._use_mmap, error=error)
        self._placement = made.placement
        llm = made.llm
        self._generator.attach(llm)
        self._chat = ChatFormat(
            llm.chat_handler,
            llm._chat_handlers,
            llm.chat_format,
            takes_tools=llm.chat_format == GGUF_TEMPLATE and template_takes_tools(made.template),
        )
        return llm

    def _model_path(self, error: type[ModelLoadError] | type[RestoreError]) -> str:
        if self._host_fd is not None:
            return f"/proc/self/fd/{self._host_fd}"
        if self.spec.path.is_file():
            return str(self.spec.path)
        raise error(f"model file not found: {self.spec.path}")


def disk_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (page-cache hits excluded)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def save_kv(llm: llama_cpp.Llama, decoder: Decoder) -> KvState:
    """The context's whole KV state, which names the tokens of the slot used last (what a kept
    prompt cache keeps); within a worker the decoder's slots say what every sequence holds."""
    size = llama_cpp.llama_state_get_size(llm.ctx)
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_get_data(llm.ctx, buffer, size)
    seq = decoder.most_recent_slot() or 0
    return KvState(list(decoder.slots[seq]), bytes(buffer)[:written], seq)


def return_freed_heap() -> None:
    """Hand the heap pages freed blocks leave back to the system. glibc keeps freed blocks below
    its mmap threshold (which grows up to 32 MiB as a process frees large blocks) in its arenas,
    so without this neither a load's garbage, nor a model the reload backend freed, nor a CPU
    model's in-place release would lower the worker's RSS."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def load_kv(llm: llama_cpp.Llama, kv: KvState) -> None:
    size = len(kv.data)
    buffer = (ctypes.c_uint8 * size).from_buffer_copy(kv.data)
    if llama_cpp.llama_state_set_data(llm.ctx, buffer, size) != size:
        raise RestoreError("the saved KV state does not fit the new context")
