"""A model's vocabulary alone, loaded vocab-only (no weights, no context, no device memory): what
the worker tokenizes requests with while the model is cold (issue 10), and what checks that
llama.cpp parses a grammar. Part of the engine (arbiterd/worker/engine/): it calls llama_cpp.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import llama_cpp
from llama_cpp._internals import LlamaModel
from llama_cpp.llama_grammar import LlamaGrammar

from arbiterd.errors import ContextOverflowError, ModelLoadError, RequestError
from arbiterd.request import Infill
from arbiterd.worker.engine.records import Cancelled

# One llama_tokenize call takes time quadratic in the special tokens its text holds (llama.cpp's
# special-token partition walks its fragment list from the start at every match: a chat request
# of 100,000 one-word messages took ~590 s on gemma-3, issue 10). A long text is tokenized in
# pieces of about this size instead, cut where the tokens come out the same (`Vocab._cut`):
# linear time, and a cancel is seen between two pieces (gemma-3: ~80 ms each at worst).
TOKENIZE_PIECE_BYTES = 16 * 1024
# How many places where a special token starts are tried for a cut before the piece grows by
# another TOKENIZE_PIECE_BYTES (each try reads ~2,000 substrings at most).
CUT_CANDIDATES = 64


class Vocab:
    """A model file's vocabulary alone (llama_model_params.vocab_only: no weights, no context,
    no device memory), kept for the worker's life to tokenize requests while the model is cold.
    gemma-3-270m (262,144 tokens): ~0.6 s to load and index, 22 MB of RAM (44 MB before the
    engine's text index: arbiterd/native/README.md).

    Tokenizes as one llama_tokenize call does (parse_special: as llama-cpp-python tokenizes
    prompts), but a long text in pieces (TOKENIZE_PIECE_BYTES), for SPM and BPE vocabularies
    (llama-, gemma- and GPT-style models): llama.cpp splits a text at its special tokens and
    tokenizes each stretch in between on its own, so a cut where a special token is sure to
    be split off changes nothing (`_cut`). Other vocabularies are tokenized in one call.

    A model that stays loaded for the worker's life (the in-place backend) lends its own
    vocabulary instead (`use_vocabulary_of`): the same file's, so the same tokens, and the
    vocab-only copy is freed (issue 28: a second vocabulary in every worker)."""

    def __init__(self, path: str, shown: Path) -> None:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        # No device: left NULL, llama.cpp looks at every registered device, and asking a
        # registered RPC server whose process is gone aborts the worker in ggml's client.
        no_devices = (ctypes.c_void_p * 1)(None)
        params.devices = ctypes.cast(no_devices, ctypes.c_void_p)
        try:
            model = LlamaModel(path_model=path, params=params, verbose=False)
        except ValueError:
            raise ModelLoadError(f"cannot load the vocabulary of {shown}") from None
        self._model: LlamaModel | None = model
        vocab = self._vocab = model.vocab
        metadata = model.metadata()
        # The GGUF's own chat template ("" when it has none), its architecture and the context
        # it was trained for (0: not said), as /api/show and status tell them (issue 30).
        self.chat_template = metadata.get("tokenizer.chat_template", "")
        self.architecture = metadata.get("general.architecture", "")
        trained = metadata.get(f"{self.architecture}.context_length", "")
        self.trained_context = int(trained) if trained.isdigit() else 0
        self.bos = llama_cpp.llama_vocab_bos(vocab)
        self.eos = llama_cpp.llama_vocab_eos(vocab)
        self.sep = llama_cpp.llama_vocab_sep(vocab)
        fim = (
            llama_cpp.llama_vocab_fim_pre(vocab),
            llama_cpp.llama_vocab_fim_suf(vocab),
            llama_cpp.llama_vocab_fim_mid(vocab),
        )
        # Fill-in-the-middle's prefix, suffix and middle tokens, as the GGUF names them (a code
        # model's tokenizer.ggml.fim_*_token_id); None: the model has no such tokens.
        self.fim: tuple[int, int, int] | None = None if -1 in fim else fim
        # The repository-level tokens a code model may have besides (Qwen 2.5 Coder's
        # <|repo_name|> and <|file_sep|>): -1 where it has none.
        self.fim_rep = llama_cpp.llama_vocab_fim_rep(vocab)
        self.fim_sep = llama_cpp.llama_vocab_fim_sep(vocab)
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

    def use_vocabulary_of(self, model: LlamaModel) -> None:
        """Tokenize with `model`'s vocabulary from now on, and free the vocab-only model. `model`
        must be loaded from the same file and stay loaded while this Vocab is used."""
        self._vocab = model.vocab
        self.close()

    def close(self) -> None:
        if self._model is not None:
            self._model.close()  # type: ignore[no-untyped-call]
            self._model = None

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

    def infill_prompt(
        self, prefix: str, fill: Infill, *, limit: int, cancelled: Cancelled
    ) -> list[int]:
        """The tokens of a fill-in-the-middle prompt, in the prefix-suffix-middle order code
        models are trained on (as llama-server's infill): BOS if the vocabulary adds one; the
        extra files, each FIM_SEP, its name and its text after a FIM_REP line where the model
        has those tokens (the repository-level pattern), else their texts as they are; then
        FIM_PRE, the prefix, FIM_SUF, the suffix, FIM_MID and the middle typed so far, after
        which the model writes the rest. The texts are code: a special token's text in them
        is text, not the token."""
        if self.fim is None:
            raise RequestError(
                "this model has no fill-in-the-middle tokens (its GGUF names no "
                "tokenizer.ggml.fim_pre/suf/mid_token_id): a completion with a suffix needs a "
                "code model that has them"
            )
        pre, suf, mid = self.fim

        def text(part: str) -> list[int]:
            return self.tokenize(
                part.encode(),
                add_special=False,
                parse_special=False,
                limit=limit,
                cancelled=cancelled,
            )

        bos = [self.bos] if self.add_bos and self.bos != -1 else []
        extra: list[int] = []
        if fill.extra and -1 not in (self.fim_rep, self.fim_sep):
            extra = [self.fim_rep, *text("myproject\n")]
            for name, body in fill.extra:
                extra += [self.fim_sep, *text(f"{name}\n{body}")]
        else:
            for _, body in fill.extra:
                extra += text(body)
        middle = text(fill.middle) if fill.middle else []
        return [*bos, *extra, pre, *text(prefix), suf, *text(fill.suffix), mid, *middle]

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
