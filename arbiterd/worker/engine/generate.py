"""Generation: prepared requests run on the warm model as jobs on the decoder (engine/decode.py),
several at once, their choices drained into OpenAI's chunks and response; or inputs embedded.
Part of the engine (arbiterd/worker/engine/): it calls llama_cpp, on the engine thread only.
"""

from __future__ import annotations

import math
import time
from array import array
from typing import Any

import llama_cpp
from llama_cpp._internals import LlamaBatch

from arbiterd.errors import ArbiterError, EngineError
from arbiterd.states import RequestKind
from arbiterd.worker.choices import Choice, TokenLogprob
from arbiterd.worker.engine.decode import Decoder, Sampling, Sequence, new_id
from arbiterd.worker.engine.images import Prefill
from arbiterd.worker.engine.records import Cancelled, ChunkSink, Generation, Prepared
from arbiterd.worker.toolcalls import CallReader
from arbiterd.worker.vision import Projector


class Job:
    """One chat or completion request on the decoder: its `n` choices one after the other (each
    after the first reuses the prompt's KV), streamed to the sink as they come, and the response
    assembled from them (`generation`, once `done`)."""

    def __init__(
        self,
        name: str,
        request: Prepared,
        sink: ChunkSink | None,
        cancelled: Cancelled,
        *,
        key: str,
        prefill: Prefill | None,
        projector: Projector | None,
    ) -> None:
        self.name = name
        self.key = key  # the caller's name for it
        self.request = request
        self._sink = sink
        self._cancelled = cancelled
        self._prefill = prefill
        self._projector = projector
        self._prompt = prefill.tokens if prefill is not None else request.prompt_tokens
        self._sampling = Sampling.of(request.completion)
        self._id = ("chat" if request.kind is RequestKind.CHAT else "") + new_id()
        self._created = int(time.time())
        self.choices: list[Choice] = []
        self.sequences: list[Sequence] = []
        self.generation: Generation | None = None
        self.error: ArbiterError | None = None  # why it failed

    @property
    def done(self) -> bool:
        return self.generation is not None or self.error is not None

    def next_sequence(self) -> Sequence:
        """The next choice's sequence (a vision prompt's first in slot 0, where its prefix was
        evaluated)."""
        index = len(self.sequences)
        request = self.request
        recorded: list[TokenLogprob] | None = None if request.top_logprobs is None else []
        calls = (
            CallReader(request.tools, forced=request.forced_call, parallel=request.parallel_calls)
            if request.tools
            else None
        )
        choice = Choice(request.kind, index, calls=calls, logprobs=recorded)
        sampling = self._sampling
        if index and sampling.seed is not None:
            # Each choice its own seed (seed + index): the choices differ, and the whole
            # response is the same again for the same seed.
            sampling = Sampling(**{**sampling.__dict__, "seed": sampling.seed + index})
        sequence = Sequence(
            self._prompt,
            sampling,
            lambda text, finish: self._emit(choice, text, finish),
            self._cancelled,
            logprobs=recorded,
            top_logprobs=request.top_logprobs or 0,
            slot=0 if self._prefill is not None and index == 0 else None,
        )
        self.choices.append(choice)
        self.sequences.append(sequence)
        return sequence

    def ended(self, sequence: Sequence) -> bool:
        """A sequence of this job ended: True if the job is done (else its next choice is
        due)."""
        if sequence.error is not None:
            self.error = sequence.error
            return True
        if sequence.stopped or len(self.sequences) == self.request.n:
            self.generation = self._generation()
            return True
        return False

    def _emit(self, choice: Choice, text: str, finish: str | None) -> None:
        chunk = {
            "id": self._id.removeprefix("chat"),
            "created": self._created,
            "model": self.name,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
        }
        for converted in choice.convert(chunk):
            converted.update(id=self._id, created=self._created)
            if self._sink is not None:
                self._sink(converted)

    def _generation(self) -> Generation:
        request, sequences = self.request, self.sequences
        first = sequences[0]
        prompt_tokens, cached = len(self._prompt), first.reused
        evaluated = sum(s.prompt_evaluated for s in sequences)
        prefill = self._prefill
        if prefill is not None and prefill.evaluated:
            cached = prefill.reused  # the rest of the prefix was evaluated just before
            evaluated += prefill.evaluated
        stopped = any(s.stopped for s in sequences)
        completion_tokens = sum(len(s.generated) for s in sequences)
        chat = request.kind is RequestKind.CHAT
        response = {
            "id": self._id,
            "object": "chat.completion" if chat else "text_completion",
            "created": self._created,
            "model": self.name,
            "choices": [choice.result() for choice in self.choices],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                # the prompt-cache hit: the prefix kept from earlier requests, not evaluated again
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        if self._sink is not None and request.include_usage and not stopped:
            # OpenAI's last chunk of a stream that asked for it: no choices, the usage.
            self._sink(
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


class Generator:
    """Runs prepared requests on a warm llama (the engine thread's): the decoder and the jobs
    on it, those whose next choice waits for a free sequence first."""

    def __init__(self, name: str, *, parallel: int = 1, seed: int = 0) -> None:
        self.name = name  # the model's, as responses name it
        self.decoder = Decoder(parallel, seed)
        self._waiting: list[Job] = []  # jobs whose next choice has no sequence yet, oldest first
        self._jobs: dict[int, Job] = {}  # by the id of their running sequence
        self._embedded_total = 0

    @property
    def prompt_tokens_evaluated_total(self) -> int:
        return self.decoder.prompt_tokens_evaluated_total + self._embedded_total

    @property
    def busy(self) -> bool:
        """Whether a job runs or waits."""
        return bool(self._waiting or self._jobs)

    @property
    def running(self) -> int:
        """The sequences generating now."""
        return len(self._jobs)

    def attach(self, llm: llama_cpp.Llama) -> None:
        """Decode on a freshly made llama."""
        self.decoder.bind(llm)

    def begin(
        self,
        request: Prepared,
        sink: ChunkSink | None,
        cancelled: Cancelled,
        *,
        key: str = "",
        prefill: Prefill | None = None,
        projector: Projector | None = None,
    ) -> Job:
        """A chat or completion request's job, named `key`, started at once when a sequence
        is free (else at a later `step`). With a sink, chunks are streamed to it as they come;
        the response is then assembled from them. `cancelled` is asked before every decode
        step. The `projector`'s steps (a vision request's) are the response's. Raises what
        keeps it from starting (a prompt the context cannot hold)."""
        job = Job(
            self.name, request, sink, cancelled, key=key, prefill=prefill, projector=projector
        )
        self._waiting.append(job)
        self._admit()
        if job.error is not None:
            raise job.error
        return job

    def step(self) -> list[Job]:
        """One decode of every running sequence; the jobs that ended (done, or failed with
        their `error`)."""
        finished: list[Job] = []
        for sequence in self.decoder.step():
            job = self._jobs.pop(id(sequence))
            if job.ended(sequence):
                finished.append(job)
            else:
                self._waiting.insert(0, job)  # its next choice, before newer jobs
        return finished + self._admit()

    def run(
        self,
        request: Prepared,
        sink: ChunkSink | None,
        cancelled: Cancelled,
        *,
        prefill: Prefill | None = None,
        projector: Projector | None = None,
    ) -> Generation:
        """One request alone, from begin to end (the decoder must be idle)."""
        job = self.begin(request, sink, cancelled, prefill=prefill, projector=projector)
        while not job.done:
            self.step()
        if job.error is not None:
            raise job.error
        assert job.generation is not None
        return job.generation

    def fail_all(self, error: ArbiterError) -> list[Job]:
        """End every job, running or waiting, with `error` (the engine cannot go on), and
        empty the KV: a step that failed midway may have left it unlike the slots' record."""
        failed = []
        for sequence in self.decoder.cancel_all(error):
            job = self._jobs.pop(id(sequence))
            job.error = error
            failed.append(job)
        waiting, self._waiting = self._waiting, []
        for job in waiting:
            job.error = error
        self.decoder.clear()
        return failed + waiting

    def embed(
        self, llm: llama_cpp.Llama, inputs: tuple[list[int], ...], cancelled: Cancelled
    ) -> Generation:
        """OpenAI's embedding response for the prepared inputs: each decoded alone, from an
        empty cache, in one decode (`LlamaBackend._new_llama` makes a decode hold the whole
        context), its pooled vector scaled to length 1 as OpenAI's and Ollama's are.
        `cancelled` is asked before each; a cancel returns the vectors made so far, marked
        cancelled."""
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
        self._embedded_total += tokens
        response = {
            "object": "list",
            "data": data,
            "model": self.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return Generation(response, tokens, tokens, 0, cancelled=len(data) < len(inputs))

    def _admit(self) -> list[Job]:
        """Start the waiting jobs' next choices while sequences are free, oldest first; the
        jobs that failed to start (a prompt that cannot fit)."""
        failed = []
        while self._waiting:
            job = self._waiting[0]
            sequence = job.next_sequence()
            try:
                started = self.decoder.start(sequence)
            except ArbiterError as exc:
                job.error = exc
                failed.append(self._waiting.pop(0))
                continue
            if not started:
                job.sequences.pop()
                job.choices.pop()
                break
            self._waiting.pop(0)
            self._jobs[id(sequence)] = job
        return failed


def _unit_length(vector: list[float]) -> list[float]:
    """`vector` scaled to length 1 (as it is when all zeros), in float32 values: exactly what an
    answer packs as base64 of float32."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return array("f", [x / norm for x in vector] if norm else vector).tolist()
