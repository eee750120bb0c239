"""Generator for tiny, random-weight llama GGUF models used by the tests.

This module owns the on-disk layout of the test fixture model: the llama
architecture metadata, the random (seeded, deterministic) F32 weights, the
SentencePiece-style ("llama") vocabulary and the chat template. The output is
meant to be loaded by llama.cpp (via llama-cpp-python) in milliseconds; it
produces gibberish, but deterministic gibberish.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_SPEC",
    "TOOLS_CHAT_TEMPLATE",
    "TinyModelSpec",
    "write_tiny_llama",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Minimal Jinja chat template stored as ``tokenizer.chat_template``."""

TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nTools:{% for tool in tools %}\n{{ tool.function | tojson }}"
    '{% endfor %}\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}"
    '<tool_call>{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A Hermes-style template that renders the tools a request offers and earlier calls (their
arguments as objects, the Hugging Face convention)."""

_SPACE = "\u2581"  # SentencePiece word-boundary marker (LOWER ONE EIGHTH BLOCK)
_WEIGHT_STD = 0.02
_RMS_EPS = 1e-5
_ROPE_FREQ_BASE = 10000.0

_SPECIAL_TOKENS: tuple[tuple[str, gguf.TokenType], ...] = (
    ("<unk>", gguf.TokenType.UNKNOWN),
    ("<s>", gguf.TokenType.CONTROL),
    ("</s>", gguf.TokenType.CONTROL),
)
_UNK_ID = 0
_BOS_ID = 1
_EOS_ID = 2
_N_BYTE_TOKENS = 256
_FIRST_ORDINARY_ID = len(_SPECIAL_TOKENS) + _N_BYTE_TOKENS

_WORD_LIST = """
the a an and of to in is it that for on with as was be at by this are or from
hello world you he she we they not but what all can will one there quick brown fox dog
"""
_COMMON_WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())


@dataclass(frozen=True)
class TinyModelSpec:
    """Hyper-parameters of the generated model (defaults give a ~0.55 MB file)."""

    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 2048
    n_vocab: int = 512  # includes special tokens
    seed: int = 0
    chat_template: str = CHAT_TEMPLATE
    # Set: an embedding model, whose vectors llama.cpp pools this way (llama.pooling_type).
    pooling: gguf.PoolingType | None = None
    # The layers' matrices stored as Q4_0, which the CPU repacks at load into a buffer of its
    # own (ggml's extra buffer types on AVX2 and NEON): weights that are not the file's bytes.
    quantized: bool = False
    # Set: the GGUF names fill-in-the-middle tokens (tokenizer.ggml.fim_pre/suf/mid_token_id),
    # the vocabulary's last three, as a code model's names its own.
    fim: bool = False
    general_name: str = "arbiterd-tiny-llama"  # as a converter names the model it wrote

    @property
    def head_dim(self) -> int:
        """Per-head embedding size."""
        return self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        """Width of the K and V projections (grouped-query attention)."""
        return self.head_dim * self.n_head_kv

    def validate(self) -> None:
        """Raise ``ValueError`` if llama.cpp could not load this shape."""
        if min(self.n_layer, self.n_embd, self.n_head, self.n_head_kv, self.n_ff) < 1:
            raise ValueError(f"all sizes must be positive: {self}")
        if self.n_embd % self.n_head != 0:
            raise ValueError("n_embd must be divisible by n_head")
        if self.head_dim % 2 != 0:
            raise ValueError("head_dim (n_embd / n_head) must be even for RoPE")
        if self.n_head % self.n_head_kv != 0:
            raise ValueError("n_head must be divisible by n_head_kv")
        if self.n_vocab < _min_vocab():
            raise ValueError(f"n_vocab must be at least {_min_vocab()}")
        if self.quantized and (self.n_embd % 32 or self.n_ff % 32):
            raise ValueError("a quantized model's n_embd and n_ff must be multiples of 32")


def _base_pieces() -> list[str]:
    """Pieces every vocabulary needs so plain ASCII text never hits byte fallback."""
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits
    return [_SPACE, *chars, *(_SPACE + c for c in chars), *".,!?'\"-:;()"]


def _min_vocab() -> int:
    return _FIRST_ORDINARY_ID + len(_base_pieces())


def _ordinary_pieces() -> Iterator[str]:
    """Yield unique normal pieces, most useful first, without end.

    llama.cpp's SPM tokenizer only ever builds a piece by merging two adjacent
    pieces that are themselves in the vocabulary, so every multi-character word
    is preceded by all of its prefixes.
    """
    seen: set[str] = set()

    def fresh(candidates: Iterator[str]) -> Iterator[str]:
        for piece in candidates:
            if piece not in seen:
                seen.add(piece)
                yield piece

    yield from fresh(iter(_base_pieces()))
    yield from fresh(
        (_SPACE + word)[:end] for word in _COMMON_WORDS for end in range(2, len(word) + 2)
    )
    letters = string.ascii_lowercase
    for length in itertools.count(2):
        yield from fresh("".join(p) for p in itertools.product(letters, repeat=length))
        yield from fresh(_SPACE + "".join(p) for p in itertools.product(letters, repeat=length))


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[gguf.TokenType]]:
    tokens = [text for text, _ in _SPECIAL_TOKENS]
    types = [kind for _, kind in _SPECIAL_TOKENS]
    tokens += [f"<0x{b:02X}>" for b in range(_N_BYTE_TOKENS)]
    types += [gguf.TokenType.BYTE] * _N_BYTE_TOKENS
    scores = [0.0] * len(tokens)
    n_ordinary = n_vocab - len(tokens)
    for rank, piece in enumerate(itertools.islice(_ordinary_pieces(), n_ordinary)):
        tokens.append(piece)
        # SentencePiece-like log-prob scores: longer pieces win merges.
        scores.append(float(len(piece)) - rank * 1e-3)
        types.append(gguf.TokenType.NORMAL)
    return tokens, scores, types


def _random(rng: np.random.Generator, *shape: int) -> npt.NDArray[np.float32]:
    """Small-magnitude weights; numpy shape is (rows=out, cols=in)."""
    return (rng.standard_normal(shape, dtype=np.float32) * _WEIGHT_STD).astype(np.float32)


def _ones(n: int) -> npt.NDArray[np.float32]:
    return np.ones(n, dtype=np.float32)


def _tensors(spec: TinyModelSpec) -> Iterator[tuple[str, npt.NDArray[np.float32]]]:
    rng = np.random.default_rng(spec.seed)
    yield "token_embd.weight", _random(rng, spec.n_vocab, spec.n_embd)
    for i in range(spec.n_layer):
        blk = f"blk.{i}"
        yield f"{blk}.attn_norm.weight", _ones(spec.n_embd)
        yield f"{blk}.attn_q.weight", _random(rng, spec.n_embd, spec.n_embd)
        yield f"{blk}.attn_k.weight", _random(rng, spec.n_embd_kv, spec.n_embd)
        yield f"{blk}.attn_v.weight", _random(rng, spec.n_embd_kv, spec.n_embd)
        yield f"{blk}.attn_output.weight", _random(rng, spec.n_embd, spec.n_embd)
        yield f"{blk}.ffn_norm.weight", _ones(spec.n_embd)
        yield f"{blk}.ffn_gate.weight", _random(rng, spec.n_ff, spec.n_embd)
        yield f"{blk}.ffn_up.weight", _random(rng, spec.n_ff, spec.n_embd)
        yield f"{blk}.ffn_down.weight", _random(rng, spec.n_embd, spec.n_ff)
    yield "output_norm.weight", _ones(spec.n_embd)
    output = _random(rng, spec.n_vocab, spec.n_embd)
    # Control and byte tokens get a constant zero logit, so greedy decoding
    # always picks an ordinary (printable ASCII) piece and never emits EOS or a
    # stray, possibly invalid-UTF-8 byte. Sampling can still reach them.
    output[:_FIRST_ORDINARY_ID] = 0.0
    yield "output.weight", output


DEFAULT_SPEC = TinyModelSpec()
"""The spec used when none is given: a ~0.55 MB, 2-layer model."""


def write_tiny_llama(path: Path, spec: TinyModelSpec = DEFAULT_SPEC) -> Path:
    """Write a loadable random-weight llama GGUF to ``path`` and return ``path``.

    The same ``spec`` always produces a byte-identical file.
    """
    spec.validate()
    path = Path(path)
    tokens, scores, types = _vocab(spec.n_vocab)

    writer = gguf.GGUFWriter(path, "llama")
    try:
        writer.add_name(spec.general_name)
        writer.add_file_type(
            gguf.LlamaFileType.MOSTLY_Q4_0 if spec.quantized else gguf.LlamaFileType.ALL_F32
        )
        writer.add_vocab_size(spec.n_vocab)
        writer.add_context_length(spec.n_ctx_train)
        if spec.pooling is not None:
            writer.add_pooling_type(spec.pooling)
        writer.add_embedding_length(spec.n_embd)
        writer.add_block_count(spec.n_layer)
        writer.add_feed_forward_length(spec.n_ff)
        writer.add_head_count(spec.n_head)
        writer.add_head_count_kv(spec.n_head_kv)
        writer.add_rope_dimension_count(spec.head_dim)
        writer.add_rope_freq_base(_ROPE_FREQ_BASE)
        writer.add_layer_norm_rms_eps(_RMS_EPS)

        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(_UNK_ID)
        writer.add_bos_token_id(_BOS_ID)
        writer.add_eos_token_id(_EOS_ID)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        if spec.fim:
            for offset, role in enumerate(("pre", "suf", "mid"), start=3):
                writer.add_uint32(f"tokenizer.ggml.fim_{role}_token_id", spec.n_vocab - offset)
        if spec.chat_template:  # "": no template at all, as a base model's GGUF has none
            writer.add_chat_template(spec.chat_template)

        for name, tensor in _tensors(spec):
            if spec.quantized and name.startswith("blk.") and tensor.ndim == 2:
                q4 = gguf.GGMLQuantizationType.Q4_0
                writer.add_tensor(name, gguf.quants.quantize(tensor, q4), raw_dtype=q4)
            else:
                writer.add_tensor(name, tensor)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
