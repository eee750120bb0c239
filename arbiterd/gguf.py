"""Reading a GGUF model file's header: owns the GGUF format as arbiterd reads it — the
metadata the daemon and the workers need (the architecture, its trained context length, its
pooling type, the shape numbers a KV cache's size follows from) and, when asked, the tensor
table (each tensor's name, shape and type, so its size in bytes).

Stops as soon as it has what it was asked for; never loads tensors' data, never imports
llama.cpp, and says nothing of configs: the daemon's check of a config's model files is
daemon/models/modelfile.py's. Shared by every process.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # version 1 (2023) used 32-bit counts; llama.cpp no longer reads it
# Sanity bounds: a real model has hundreds to a few thousand of each; garbage has billions.
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 20
MAX_STRING_BYTES = 1 << 24
READ_BUFFER_BYTES = 1 << 16

# GGUF value types (gguf.h `enum gguf_type`), by fixed size in bytes.
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# The integers read, by the last part of their `<architecture>.` or `<architecture>.attention.`
# key: the trained context, the pooling type, and the shape of the KV cache (GgufHeader.kv_bytes).
_NUMBERS = frozenset(
    {
        "context_length",
        "pooling_type",
        "block_count",
        "embedding_length",
        "head_count",
        "head_count_kv",
        "key_length",
        "value_length",
    }
)
# Read too when met before the reading stops, but never waited for: the attention window of a
# model whose layers alternate sliding-window and full attention (gemma-2/3), which the compute
# buffers' masks follow (arbiterd/footprint.py).
_WHEN_MET = frozenset({"sliding_window"})
_INTEGER_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
MAX_DIMS = 4  # GGML_MAX_DIMS
# ggml's tensor types (ggml.h `enum ggml_type`) by (elements per block, bytes per block), as
# ggml.c's type_traits size them: a tensor's bytes are its rows' blocks times the block size.
GGML_BLOCKS = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 36),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
}
# llama.cpp's encoder-only architectures (its llm_arch names): they embed, they cannot generate.
ENCODER_ARCHITECTURES = frozenset(
    {
        "bert",
        "eurobert",
        "jina-bert-v2",
        "jina-bert-v3",
        "modern-bert",
        "neo-bert",
        "nomic-bert",
        "nomic-bert-moe",
        "t5encoder",
    }
)


# Where a GGUF keeps its Jinja chat template (llama.cpp's LLM_KV_TOKENIZER_CHAT_TEMPLATE).
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# The architecture llama.cpp's converters write into every mmproj GGUF (clip.cpp reads it).
PROJECTOR_ARCHITECTURE = "clip"


class NotGgufError(Exception):
    """The file is not a GGUF model llama.cpp can read; the message says what it is instead."""


@dataclass(frozen=True)
class Tensor:
    """One entry of a GGUF's tensor table: its name ("blk.3.attn_q.weight"), its shape (ggml's
    order: ne0, the row length, first) and its ggml type (GGML_BLOCKS' keys)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int

    @property
    def nbytes(self) -> int:
        """Its data's size, as ggml_nbytes counts it (a row is whole blocks)."""
        per_block, block_bytes = GGML_BLOCKS[self.ggml_type]
        rows = 1
        for n in self.shape[1:]:
            rows *= n
        return self.shape[0] // per_block * block_bytes * rows


@dataclass(frozen=True)
class GgufHeader:
    version: int
    tensor_count: int
    architecture: str | None
    context_length: int | None  # `<architecture>.context_length`: the trained context
    # `<architecture>.pooling_type` (llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls,
    # 3 last, 4 rank); None when the file does not say, which llama.cpp takes as none.
    pooling_type: int | None
    # The integers that size the KV cache, those the file has: `<architecture>.block_count`,
    # `.embedding_length`, and `<architecture>.attention.head_count`, `.head_count_kv`,
    # `.key_length`, `.value_length` (by their last part); `.sliding_window` where the reading
    # met it.
    shape: Mapping[str, int] = field(default_factory=dict)
    name: str | None = None  # `general.name`, as its converter wrote it ("SmolLM2 135M Instruct")
    # Whether the metadata holds a non-empty `tokenizer.chat_template`; None: not known, the
    # reading stopped before it (read_header without `all_metadata`).
    chat_template: bool | None = None
    # The tensor table, in the file's order; () unless read with `tensors`.
    tensors: tuple[Tensor, ...] = ()

    def kv_bytes(self, n_ctx: int) -> int | None:
        """The f16 KV cache of `n_ctx` tokens, as llama.cpp allocates it for the usual
        attention (K and V per layer, per KV head); None when the file lacks the numbers."""
        shape = self.shape
        layers, heads = shape.get("block_count"), shape.get("head_count")
        if not layers or not heads:
            return None
        kv_heads = shape.get("head_count_kv", heads)
        head_dim = shape.get("embedding_length", 0) // heads
        k_dim = shape.get("key_length", head_dim) * kv_heads
        v_dim = shape.get("value_length", head_dim) * kv_heads
        return 2 * n_ctx * layers * (k_dim + v_dim) if k_dim and v_dim else None

    @property
    def embedding(self) -> bool:
        """Whether this is an embedding model: the file names a pooling type (llama.cpp then
        pools the vectors of an input's tokens into one), or its architecture is encoder-only.
        A generative model whose GGUF names no pooling can still serve embeddings, with
        `embedding = true` in its config."""
        return bool(self.pooling_type) or self.architecture in ENCODER_ARCHITECTURES


def read_header(path: Path, *, all_metadata: bool = False, tensors: bool = False) -> GgufHeader:
    """The header of the GGUF at `path`; with `all_metadata`, read to the end of its metadata,
    so that `chat_template` is known (the template follows the vocabulary: ~0.1 s more for a
    large one); with `tensors`, the tensor table after it too. Raises NotGgufError, or OSError
    if it cannot be read."""
    with open(path, "rb", buffering=READ_BUFFER_BYTES) as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            shown = magic.decode("ascii", "replace") if magic.isascii() else magic.hex(" ")
            got = f"it starts with {shown!r}" if magic else "it is empty"
            raise NotGgufError(f"not a GGUF model file ({got}, expected 'GGUF')")
        try:
            return _read_after_magic(f, all_metadata=all_metadata or tensors, tensors=tensors)
        except struct.error:
            raise NotGgufError("a truncated GGUF file (it ends inside its header)") from None


def _read_after_magic(f: BinaryIO, *, all_metadata: bool, tensors: bool) -> GgufHeader:
    (version,) = _unpack(f, "<I")
    if version not in SUPPORTED_VERSIONS:
        raise NotGgufError(
            f"a GGUF of version {version}, which llama.cpp cannot read (expected 2 or 3)"
        )
    tensor_count, key_count = _unpack(f, "<QQ")
    if tensor_count > MAX_TENSORS or key_count > MAX_KEYS:
        raise NotGgufError(
            f"a GGUF file with a damaged header ({tensor_count} tensors, {key_count} keys)"
        )
    architecture: str | None = None
    general_name: str | None = None
    chat_template: bool | None = False if all_metadata else None
    numbers: dict[str, int] = {}  # those of _NUMBERS the file has
    for _ in range(key_count):
        key = _string(f)
        (kind,) = _unpack(f, "<I")
        prefix, _, name = key.rpartition(".")
        if key == "general.architecture" and kind == _STRING:
            architecture = _string(f)
        elif key == "general.name" and kind == _STRING:
            general_name = _string(f)
        elif key == CHAT_TEMPLATE_KEY and kind == _STRING:
            (length,) = _unpack(f, "<Q")
            f.seek(length, os.SEEK_CUR)  # only whether there is one: its text is the worker's
            chat_template = length > 0
        elif (
            architecture
            and prefix in (architecture, f"{architecture}.attention")
            and (name in _NUMBERS or name in _WHEN_MET)
            and kind in _INTEGER_FORMATS
        ):
            (numbers[name],) = _unpack(f, _INTEGER_FORMATS[kind])
        else:
            _skip_value(f, kind)
        if not all_metadata and architecture is not None and numbers.keys() >= _NUMBERS:
            break  # all we need; the tokenizer's arrays after it can be megabytes
    # A file without some of them is read to the end of its metadata: ~0.1 s for the 262,144
    # tokens of gemma-3's vocabulary.
    return GgufHeader(
        version,
        tensor_count,
        architecture,
        numbers.pop("context_length", None),
        numbers.pop("pooling_type", None),
        numbers,
        general_name,
        chat_template,
        tuple(_tensor(f) for _ in range(tensor_count)) if tensors else (),
    )


def _tensor(f: BinaryIO) -> Tensor:
    """One tensor-table entry: name, dimension count, dimensions, type, data offset."""
    name = _string(f)
    (n_dims,) = _unpack(f, "<I")
    if not 0 < n_dims <= MAX_DIMS:
        raise NotGgufError(f"a GGUF file with a damaged tensor table ({name}: {n_dims} dims)")
    shape = _unpack(f, f"<{n_dims}Q")
    ggml_type, _offset = _unpack(f, "<IQ")
    if ggml_type not in GGML_BLOCKS:
        raise NotGgufError(f"a GGUF file with a tensor of a type arbiterd does not know ({name})")
    return Tensor(name, shape, ggml_type)


def _unpack(f: BinaryIO, fmt: str) -> tuple[int, ...]:
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, f.read(size))  # struct.error on a short read


def _string(f: BinaryIO) -> str:
    (length,) = _unpack(f, "<Q")
    if length > MAX_STRING_BYTES:
        raise NotGgufError(f"a GGUF file with a damaged header (a {length}-byte string)")
    data = f.read(length)
    if len(data) != length:
        raise struct.error("short read")
    return data.decode("utf-8", "replace")


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind in _FIXED_SIZES:
        f.seek(_FIXED_SIZES[kind], os.SEEK_CUR)
    elif kind == _STRING:
        (length,) = _unpack(f, "<Q")
        f.seek(length, os.SEEK_CUR)
    elif kind == _ARRAY:
        element, count = _unpack(f, "<IQ")
        if element in _FIXED_SIZES:
            f.seek(_FIXED_SIZES[element] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, element)
    else:
        raise NotGgufError(f"a GGUF file with a damaged header (value type {kind})")
