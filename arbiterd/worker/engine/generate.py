"""Generation: a prepared request run on the warm model, its choices drained into OpenAI's chunks
and response, or its inputs embedded; and the instrumentation of the llama's `eval` (count the
tokens decoded, stop between two batches on a cancel) and `sample` (record log-probabilities).
Part of the engine (arbiterd/worker/engine/): it calls llama_cpp, on the engine thread only.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp._internals import LlamaBatch

from arbiterd.errors import EngineError, RequestError
from arbiterd.request import RequestKind
from arbiterd.worker.choices import Choice, TokenLogprob
from arbiterd.worker.engine.images import Prefill
from arbiterd.worker.engine.records import Cancelled, ChunkSink, Generation, Prepared, never
from arbiterd.worker.toolcalls import CallReader
from arbiterd.worker.vision import Projector


class _EvalCancelled(Exception):
    """Raised out of `Llama.eval` to stop a cancelled request between two decodes; it never
    leaves this module (`_drain` turns it into a cancelled Generation)."""


@dataclass
class Run:
    """One request on the warm model: whether to stop it, and what it sent to llama_decode, from
    the `Llama.eval` calls it made: the first evaluates the prompt's uncached suffix, each later
    one feeds back one sampled token."""

    cancelled: Cancelled = never
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


class Generator:
    """Runs prepared requests on a warm llama, one at a time (the engine thread's). Owns the
    current run, which the llama's instrumented `eval` and `sample` count into, and the count of
    prompt tokens evaluated so far."""

    def __init__(self, name: str) -> None:
        self.name = name  # the model's, as responses name it
        self._run = Run()
        self.prompt_tokens_evaluated_total = 0

    def instrument(self, llm: llama_cpp.Llama) -> None:
        """Make `llm`'s evals and samples count into the current run (a freshly made llama)."""
        _instrument_eval(llm, lambda: self._run)
        _instrument_sample(llm, lambda: self._run)

    def count_evals(self) -> Run:
        """A fresh run, never cancelled, that counts what the llama evaluates outside a
        request's choices (a vision prompt's prefill)."""
        self._run = Run()
        return self._run

    def run(
        self,
        llm: llama_cpp.Llama,
        request: Prepared,
        sink: ChunkSink | None,
        cancelled: Cancelled,
        *,
        prefill: Prefill | None,
        projector: Projector | None,
    ) -> Generation:
        """Generate for a prepared chat or completion request on the warm `llm`, its `n` choices
        one after the other (each after the first reuses the prompt's KV), from the vision
        `prefill` when it has images. With a sink, chunks are streamed to it as they come; the
        returned response is then assembled from them. `cancelled` is asked before every
        decode: the prompt is evaluated n_batch tokens at a time, so a cancel waits for one
        batch at most. The `projector`'s steps are the response's."""
        head: dict[str, Any] = {}  # one id and creation time for every chunk of every choice
        choices: list[Choice] = []
        prompt_tokens = cached = evaluated = completion_tokens = 0
        stopped = False
        completion = request.completion
        if prefill is not None:
            completion = {**completion, "prompt": prefill.tokens}
        for index in range(request.n):
            recorded: list[TokenLogprob] | None = None if request.top_logprobs is None else []
            run = self._run = Run(
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
            "model": self.name,
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
        steps = projector.take_steps() if projector is not None else ()
        return Generation(
            response, prompt_tokens, evaluated, completion_tokens, stopped, encoder_steps=steps
        )

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
        self.prompt_tokens_evaluated_total += tokens
        response = {
            "object": "list",
            "data": data,
            "model": self.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return Generation(response, tokens, tokens, 0, cancelled=len(data) < len(inputs))

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
                chunk["model"] = self.name  # llama-cpp-python names the file it loaded
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


def _instrument_eval(llm: llama_cpp.Llama, current: Callable[[], Run]) -> None:
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


def _instrument_sample(llm: llama_cpp.Llama, current: Callable[[], Run]) -> None:
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


def _for_choice(completion: dict[str, Any], index: int) -> dict[str, Any]:
    """The arguments of choice `index`: with a seed, each choice gets its own (seed + index), so
    the choices differ and the whole response is the same again for the same seed."""
    if index == 0 or completion.get("seed") is None:
        return completion
    return {**completion, "seed": completion["seed"] + index}
