"""The decoder: sequences generated on llama.cpp's batch API, several in one `llama_decode` per
step (continuous batching, issue 42), each sampled by its own sampler chain in C.

Owns the context's KV sequences: which tokens each holds (`Decoder.slots`, the prompt cache a
new request reuses the longest prefix of), which sequence generates in each, and the batch they
are decoded in. Part of the engine (arbiterd/worker/engine/): it calls llama_cpp, on the engine
thread only.

A step decodes, in one batch of at most n_batch tokens, the last sampled token of every
generating sequence and then as much of the prompts still to evaluate as fits: a long prompt is
evaluated a chunk per step, never stalling the others for longer than one batch. The KV cache is
unified: its n_ctx cells are shared by the sequences, each of which may grow to n_ctx. When a
step needs more cells than are free, the prompt caches of idle sequences go first (least
recently used first), then the sequence that started last is set back to evaluate its tokens
again later (its sampler keeps its state, so its answer does not change); only a sequence alone
that outgrows the context ends, with finish reason "length".
"""

from __future__ import annotations

import ctypes
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp.llama_grammar import LlamaGrammar

from arbiterd.errors import ArbiterError, EngineError, RequestError
from arbiterd.worker.choices import TokenLogprob
from arbiterd.worker.engine.records import Cancelled

# llama-cpp-python's create_completion defaults, which the requests' arguments were made for
# (the chat handlers fill in their own): a request that gives none samples as it did there.
DEFAULTS: dict[str, Any] = {
    "max_tokens": 16,
    "temperature": 0.8,
    "top_p": 0.95,
    "min_p": 0.05,
    "typical_p": 1.0,
    "top_k": 40,
    "repeat_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "mirostat_mode": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
}
# Arguments a completion may carry that change nothing here: the prompt (a Sequence's own),
# streaming (every sequence streams to its choice), the model's name, tail-free sampling (gone
# from llama.cpp; llama-cpp-python ignores it too), log-probabilities (Prepared.top_logprobs).
_IGNORED = {"prompt", "stream", "model", "tfs_z", "logprobs"}
# Arguments only their empty value is taken for: nothing this project makes sets them.
_EMPTY = {"suffix": None, "echo": False, "logits_processor": None, "stopping_criteria": None}
# The repeat penalties look back this far (llama-cpp-python's last_n_tokens_size).
PENALTY_LAST_N = 64


@dataclass(frozen=True)
class Sampling:
    """How one sequence is sampled and when it stops, read from the completion arguments a
    request was prepared with (`Prepared.completion`, as llama-cpp-python's create_completion
    takes them)."""

    max_tokens: int | None
    temperature: float
    top_p: float
    min_p: float
    typical_p: float
    top_k: int
    repeat_penalty: float
    frequency_penalty: float
    presence_penalty: float
    mirostat_mode: int
    mirostat_tau: float
    mirostat_eta: float
    seed: int | None = None
    stop: tuple[bytes, ...] = ()
    grammar: LlamaGrammar | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, completion: dict[str, Any]) -> Sampling:
        """The sampling a completion's arguments ask for; EngineError for an argument this
        decoder does not know (a change in what preparing makes, never a user's mistake)."""
        given = dict(completion)
        for key in _IGNORED:
            given.pop(key, None)
        for key, empty in _EMPTY.items():
            if given.pop(key, empty) != empty:
                raise EngineError(f"the decoder does not take {key!r}")
        values = {key: given.pop(key, default) for key, default in DEFAULTS.items()}
        for key, value in list(values.items()):
            if value is None and key != "max_tokens":
                values[key] = DEFAULTS[key]
        stop = given.pop("stop", None) or ()
        if isinstance(stop, str):
            stop = (stop,)
        seed = given.pop("seed", None)
        grammar = given.pop("grammar", None)
        bias = given.pop("logit_bias", None) or {}
        if given:
            raise EngineError(f"the decoder does not take {', '.join(sorted(given))}")
        return cls(
            **values,
            seed=seed,
            stop=tuple(s.encode() for s in stop if s),
            grammar=grammar,
            logit_bias=tuple((int(t), float(b)) for t, b in bias.items()),
        )

    def chain(self, vocab: llama_cpp.llama_vocab_p, n_vocab: int, seed: int) -> Any:
        """A llama.cpp sampler chain that samples as llama-cpp-python's `Llama._init_sampler`
        does (its order: the bias, the penalties, the grammar, then the choice), seeded with
        `seed`. The caller frees it (llama_sampler_free)."""
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())

        def add(sampler: Any) -> None:
            if not sampler:
                llama_cpp.llama_sampler_free(chain)
                raise RequestError("llama.cpp could not make the sampler this request asks for")
            llama_cpp.llama_sampler_chain_add(chain, sampler)

        if self.logit_bias:
            entries = (llama_cpp.llama_logit_bias * len(self.logit_bias))(
                *(llama_cpp.llama_logit_bias(token, bias) for token, bias in self.logit_bias)
            )
            add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(self.logit_bias), entries))
        add(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab,
                PENALTY_LAST_N,
                self.repeat_penalty,
                self.frequency_penalty,
                self.presence_penalty,
            )
        )
        if self.grammar is not None:
            add(
                llama_cpp.llama_sampler_init_grammar(
                    vocab, self.grammar._grammar.encode(), self.grammar._root.encode()
                )
            )
        if self.temperature < 0:
            add(llama_cpp.llama_sampler_init_dist(seed))
        elif self.temperature == 0:
            add(llama_cpp.llama_sampler_init_greedy())
        elif self.mirostat_mode == 1:
            add(
                llama_cpp.llama_sampler_init_mirostat(
                    n_vocab, seed, self.mirostat_tau, self.mirostat_eta, 100
                )
            )
        elif self.mirostat_mode == 2:
            add(
                llama_cpp.llama_sampler_init_mirostat_v2(seed, self.mirostat_tau, self.mirostat_eta)
            )
        else:
            add(llama_cpp.llama_sampler_init_top_k(self.top_k))
            add(llama_cpp.llama_sampler_init_typical(self.typical_p, 1))
            add(llama_cpp.llama_sampler_init_top_p(self.top_p, 1))
            add(llama_cpp.llama_sampler_init_min_p(self.min_p, 1))
            add(llama_cpp.llama_sampler_init_temp(self.temperature))
            add(llama_cpp.llama_sampler_init_dist(seed))
        return chain


class Text:
    """A sequence's generated bytes, handed out as text as soon as it is safe: never the start
    of a UTF-8 character whose rest has not come, never what may be the start of a stop string.
    `add` says where the first stop string is once one has come (the text ends before it)."""

    def __init__(self, stop: tuple[bytes, ...]) -> None:
        self._stop = stop
        self._longest = max(map(len, stop), default=0)
        self._bytes = bytearray()
        self._sent = 0
        self.stopped = False

    def add(self, piece: bytes) -> str:
        """The text that can be sent once `piece` is added; sets `stopped` when a stop string
        has come (and the text is then complete)."""
        self._bytes += piece
        end = len(self._bytes)
        if self._stop:
            look_from = max(0, self._sent - self._longest)
            found = [i for i in (self._bytes.find(s, look_from) for s in self._stop) if i >= 0]
            if found:
                self.stopped = True
                return self._take(min(found))
            end -= self._held_for_stop()
        return self._take(end - _incomplete_tail(self._bytes[:end]))

    def rest(self) -> str:
        """Everything not yet sent: the end of a sequence (an incomplete character dropped)."""
        return self._take(len(self._bytes))

    def _held_for_stop(self) -> int:
        """How many of the last bytes may begin a stop string."""
        tail = bytes(self._bytes[-self._longest :])
        for n in range(min(len(tail), self._longest), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stop):
                return n
        return 0

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        text = bytes(self._bytes[self._sent : end]).decode("utf-8", errors="ignore")
        self._sent = end
        return text


def _incomplete_tail(data: bytes | bytearray) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character not yet whole."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII)
            needed = 4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1
            return back if needed > back else 0
    return 0


Emit = Callable[[str, str | None], None]
"""Receives a sequence's text as it can be sent, and its finish reason with the last piece."""


@dataclass
class Sequence:
    """One choice being generated: its prompt, how it samples, where its text goes. The decoder
    fills in the rest as it runs it."""

    prompt: list[int]
    sampling: Sampling
    emit: Emit
    cancelled: Cancelled
    logprobs: list[TokenLogprob] | None = None  # recorded here when asked for
    top_logprobs: int = 0
    slot: int | None = None  # the seq_id it holds while it runs (a preferred one before)
    reused: int = 0  # prompt tokens its slot held already
    evaluated: int = 0  # tokens decoded for it (its prompt's, and again after a set-back)
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stopped: bool = False  # a cancel ended it
    error: ArbiterError | None = None  # why it failed (a decode under it)
    started_at: float = 0.0
    _pending: list[int] = field(default_factory=list)  # to decode before it samples
    _limit: int = 0  # tokens it may generate
    _chain: Any = None
    _text: Text | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.stopped or self.error is not None

    @property
    def prompt_evaluated(self) -> int:
        return min(self.evaluated, len(self.prompt) - self.reused)


class Decoder:
    """The context's KV sequences and the sequences generating in them (see the module's doc).
    `bind` it to a context before `start`; `slots` outlives a context (a release that keeps the
    KV keeps what they say), `forget` empties it when the KV goes."""

    def __init__(self, n_seq: int, seed: int) -> None:
        self.n_seq = n_seq
        self.slots: list[list[int]] = [[] for _ in range(n_seq)]
        self._used_at = [0.0] * n_seq  # when each slot's cache was last used (least first out)
        self._running: list[Sequence] = []  # in the order they started
        # The seed of a request that gives none: drawn, as llama-cpp-python drew it from the
        # model's seed (not for secrets).
        self._seeds = random.Random(seed)  # noqa: S311
        self._llm: llama_cpp.Llama | None = None
        self._batch: Any = None
        self._piece = ctypes.create_string_buffer(256)
        self.prompt_tokens_evaluated_total = 0
        self.tokens_generated_total = 0

    # -- the context ------------------------------------------------------------------------

    def bind(self, llm: llama_cpp.Llama) -> None:
        """Decode on `llm`'s context from now on (a new one after a reload; slots are kept)."""
        self.unbind()
        self._llm = llm
        self._batch = llama_cpp.llama_batch_init(llm.n_batch, 0, 1)

    def unbind(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self._llm = None

    def forget(self) -> None:
        """The KV is gone (dropped, or came back empty): no slot holds anything."""
        for slot in self.slots:
            slot.clear()

    def clear(self) -> None:
        """Empty every slot: the cells and the record of them."""
        if self._llm is not None:
            # The cells' metadata only: a released context has no buffers to wipe.
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._llm.ctx), False)
        self.forget()

    @property
    def cells_used(self) -> int:
        return sum(map(len, self.slots))

    def most_recent_slot(self) -> int | None:
        """The slot whose cache was used last, among those holding any; None if none does."""
        held = [s for s in range(self.n_seq) if self.slots[s]]
        return max(held, key=lambda s: self._used_at[s]) if held else None

    # -- sequences --------------------------------------------------------------------------

    def start(self, sequence: Sequence) -> bool:
        """Start generating `sequence` in a free slot (its own `slot` if it names one, else
        the one whose cache shares the longest prefix with its prompt, else the least recently
        used); False when every slot is generating. RequestError when its prompt cannot fit."""
        llm = self._require()
        n_ctx = llm.n_ctx()
        prompt = sequence.prompt
        if len(prompt) >= n_ctx:
            raise RequestError(f"Requested tokens ({len(prompt)}) exceed context window of {n_ctx}")
        busy = {s.slot for s in self._running}
        free = [s for s in range(self.n_seq) if s not in busy]
        if sequence.slot is not None:
            free = [s for s in free if s == sequence.slot]
        if not free:
            return False
        shared = {s: common_prefix(self.slots[s], prompt[:-1]) for s in free}
        slot = max(free, key=lambda s: (shared[s], -self._used_at[s]))
        self._trim(slot, shared[slot])
        limit = sequence.sampling.max_tokens
        room = n_ctx - len(prompt)
        sequence.slot = slot
        sequence.reused = len(self.slots[slot])
        sequence._limit = room if limit is None or limit <= 0 else min(limit, room)
        sequence._pending = prompt[sequence.reused :]
        seed = sequence.sampling.seed
        if seed is None:
            seed = self._seeds.randint(0, 2**32 - 1)
        sequence._chain = sequence.sampling.chain(
            llama_cpp.llama_model_get_vocab(llm.model), llm.n_vocab(), seed & 0xFFFFFFFF
        )
        sequence._text = Text(sequence.sampling.stop)
        sequence.started_at = time.monotonic()
        self._used_at[slot] = sequence.started_at
        self._running.append(sequence)
        return True

    def evaluate(self, slot: int, tokens: list[int], cancelled: Cancelled) -> int:
        """Decode `tokens` at the end of an idle slot's cache, a batch at a time, sampling
        nothing (a vision prompt's text between its images); the tokens decoded, fewer when
        `cancelled` said so between two batches."""
        llm = self._require()
        done = 0
        while done < len(tokens):
            if cancelled():
                break
            chunk = tokens[done : done + llm.n_batch]
            self._make_room(len(chunk), keep=slot)
            self._fill([(slot, chunk, False)])
            self._decode("the prompt")
            self.slots[slot] += chunk
            done += len(chunk)
        self.prompt_tokens_evaluated_total += done
        return done

    def positions(self, slot: int, ids: tuple[int, ...]) -> int:
        """Record `ids` as decoded at the end of a slot's cache (an image's positions, decoded
        from its embeddings): the position they start at."""
        at = len(self.slots[slot])
        self.slots[slot] += ids
        return at

    def trim(self, slot: int, keep: int) -> None:
        """Cut an idle slot's cache to its first `keep` tokens."""
        self._trim(slot, keep)

    def step(self) -> list[Sequence]:
        """One decode of every running sequence's next tokens, then each that has logits
        samples; the sequences that ended (finished, cancelled or failed), no longer running."""
        llm = self._require()
        ended = [s for s in self._running if s.cancelled()]
        for sequence in ended:
            sequence.stopped = True
        self._running = [s for s in self._running if not s.done]
        if not self._running:
            self._end(ended)
            return ended
        plan = self._plan(llm.n_batch)
        planned = sum(len(tokens) for _, tokens, _ in plan)
        if planned > llm.n_ctx() - self.cells_used:
            self._make_room(planned, keep=None)
            plan = self._plan(llm.n_batch)
        self._fill(plan)
        try:
            self._decode("a step")
        except EngineError as exc:
            for sequence in self._running:
                sequence.error = exc
            ended += self._running
            self._running = []
            self._end(ended)
            return ended
        index = 0
        by_slot = {s.slot: s for s in self._running}
        for slot, tokens, logits in plan:
            sequence = by_slot[slot]
            self.slots[slot] += tokens
            del sequence._pending[: len(tokens)]
            sequence.evaluated += len(tokens)
            index += len(tokens)
            if logits:
                self._sample(llm, sequence, index - 1)
        ended += [s for s in self._running if s.done]
        self._running = [s for s in self._running if not s.done]
        self._end(ended)
        return ended

    def cancel_all(self, error: ArbiterError) -> list[Sequence]:
        """End every running sequence with `error` (the engine cannot go on)."""
        ended = self._running
        for sequence in ended:
            sequence.error = error
        self._running = []
        self._end(ended)
        return ended

    # -- inside -----------------------------------------------------------------------------

    def _plan(self, budget: int) -> list[tuple[int, list[int], bool]]:
        """What the next decode holds: every generating sequence's last token first, then the
        prompts still to evaluate, oldest first, as much of each as the batch has room for;
        (slot, tokens, whether the last one's logits are sampled)."""
        plan: list[tuple[int, list[int], bool]] = []
        for sequence in self._running:
            if len(sequence._pending) == 1 and budget:
                plan.append((_slot(sequence), sequence._pending[:1], True))
                budget -= 1
        for sequence in self._running:
            if len(sequence._pending) > 1 and budget:
                chunk = sequence._pending[:budget]
                plan.append((_slot(sequence), chunk, len(chunk) == len(sequence._pending)))
                budget -= len(chunk)
        return plan

    def _make_room(self, needed: int, keep: int | None) -> None:
        """Free cells until `needed` more fit: idle slots' caches first (least recently used
        first), then the running sequences that started last are set back to evaluate their
        tokens again; the oldest running sequence keeps its cells."""
        llm = self._require()
        n_ctx = llm.n_ctx()
        running = {s.slot for s in self._running}
        idle = sorted(
            (s for s in range(self.n_seq) if s not in running and s != keep and self.slots[s]),
            key=lambda s: self._used_at[s],
        )
        for slot in idle:
            if n_ctx - self.cells_used >= needed:
                return
            self._trim(slot, 0)
        for sequence in reversed(self._running[1:]):
            if n_ctx - self.cells_used >= needed:
                return
            slot = _slot(sequence)
            sequence._pending = self.slots[slot] + sequence._pending
            self._trim(slot, 0)

    def _trim(self, slot: int, keep: int) -> None:
        memory = llama_cpp.llama_get_memory(self._require().ctx)
        if keep < len(self.slots[slot]) and not llama_cpp.llama_memory_seq_rm(
            memory, slot, keep, -1
        ):
            # A cache that cannot lose a tail (recurrent, or a sliding window past it) loses it all.
            llama_cpp.llama_memory_seq_rm(memory, slot, 0, -1)
            keep = 0
        del self.slots[slot][keep:]

    def _fill(self, plan: list[tuple[int, list[int], bool]]) -> None:
        batch = self._batch
        i = 0
        for slot, tokens, logits in plan:
            at = len(self.slots[slot])
            for j, token in enumerate(tokens):
                batch.token[i] = token
                batch.pos[i] = at + j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = slot
                batch.logits[i] = logits and j == len(tokens) - 1
                i += 1
        batch.n_tokens = i

    def _decode(self, what: str) -> None:
        status = llama_cpp.llama_decode(self._require().ctx, self._batch)
        if status != 0:
            raise EngineError(f"llama_decode failed (status {status}) on {what}")

    def _sample(self, llm: llama_cpp.Llama, sequence: Sequence, index: int) -> None:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        recorded = sequence.logprobs
        logits = None
        if recorded is not None:
            pointer = llama_cpp.llama_get_logits_ith(llm.ctx, index)
            logits = np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).astype(np.float64)
        token = llama_cpp.llama_sampler_sample(sequence._chain, llm.ctx, index)
        text = sequence._text
        assert text is not None
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            self._finish(sequence, "stop")
            return
        sequence.generated.append(token)
        self.tokens_generated_total += 1
        piece = self._token_piece(vocab, token)
        if recorded is not None and logits is not None:
            recorded.append(_token_logprob(self, vocab, logits, token, sequence.top_logprobs))
        shown = text.add(piece)
        if text.stopped:
            self._finish(sequence, "stop", shown)
        elif len(sequence.generated) >= sequence._limit:
            self._finish(sequence, "length", shown)
        else:
            if shown:
                sequence.emit(shown, None)
            sequence._pending = [token]

    def _finish(self, sequence: Sequence, reason: str, shown: str = "") -> None:
        """End a sequence: its last text (what a stop string left, or all that was held back)
        sent with its finish reason."""
        text = sequence._text
        assert text is not None
        sequence.finish_reason = reason
        sequence._pending = []
        sequence.emit(shown + ("" if text.stopped else text.rest()), reason)

    def _end(self, ended: list[Sequence]) -> None:
        """Free what the ended sequences held but their caches (kept for the next prompts)."""
        for sequence in ended:
            if sequence._chain is not None:
                llama_cpp.llama_sampler_free(sequence._chain)
                sequence._chain = None
            if sequence.slot is not None:
                self._used_at[sequence.slot] = time.monotonic()
            self.prompt_tokens_evaluated_total += sequence.prompt_evaluated

    def _token_piece(self, vocab: Any, token: int) -> bytes:
        n = llama_cpp.llama_token_to_piece(vocab, token, self._piece, len(self._piece), 0, False)
        if n < 0:
            self._piece = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(vocab, token, self._piece, -n, 0, False)
        return self._piece.raw[:n]

    def _require(self) -> llama_cpp.Llama:
        if self._llm is None:
            raise EngineError("the decoder has no context")
        return self._llm


def _slot(sequence: Sequence) -> int:
    assert sequence.slot is not None
    return sequence.slot


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _token_logprob(
    decoder: Decoder, vocab: Any, logits: npt.NDArray[np.float64], token: int, top: int
) -> TokenLogprob:
    """The sampled token's log-probability and the `top` most likely at its place, from the
    model's logits (before penalties, bias and grammar: the model's own distribution, as
    OpenAI reports it)."""
    peak = logits.max()
    logprobs = logits - (peak + np.log(np.exp(logits - peak).sum()))
    best = np.argpartition(-logprobs, top)[:top] if top else np.array([], dtype=np.intp)
    ranked = sorted(best.tolist(), key=lambda t: -logprobs[t])
    return TokenLogprob(
        token=decoder._token_piece(vocab, token),
        logprob=float(logprobs[token]),
        top=tuple((decoder._token_piece(vocab, t), float(logprobs[t])) for t in ranked),
    )


def new_id() -> str:
    """A completion's id, as llama-cpp-python made them."""
    return f"cmpl-{uuid.uuid4()}"
