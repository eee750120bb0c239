"""Checking model files before anything loads: owns reading a GGUF's header, the config
check that runs before the daemon starts its workers and before a reload applies anything, and
the rule that says from a header whether a model is an embedding model.

Reads only the header and the metadata it needs (the architecture, its trained context length,
its pooling type and the shape numbers a KV cache's size follows from), stopping as soon as it
has them unless asked to read all the metadata (whether it has a chat template, for
`arbiterd models`); never loads tensors, never imports llama.cpp.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from arbiterd.config import Config, ModelConfig, default_n_ctx
from arbiterd.errors import ConfigError
from arbiterd.tomltable import key_path

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
_INTEGER_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
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
    # `.key_length`, `.value_length` (by their last part).
    shape: Mapping[str, int] = field(default_factory=dict)
    name: str | None = None  # `general.name`, as its converter wrote it ("SmolLM2 135M Instruct")
    # Whether the metadata holds a non-empty `tokenizer.chat_template`; None: not known, the
    # reading stopped before it (read_header without `all_metadata`).
    chat_template: bool | None = None

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


def read_header(path: Path, *, all_metadata: bool = False) -> GgufHeader:
    """The header of the GGUF at `path`; with `all_metadata`, read to the end of its metadata,
    so that `chat_template` is known (the template follows the vocabulary: ~0.1 s more for a
    large one). Raises NotGgufError, or OSError if it cannot be read."""
    with open(path, "rb", buffering=READ_BUFFER_BYTES) as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            shown = magic.decode("ascii", "replace") if magic.isascii() else magic.hex(" ")
            got = f"it starts with {shown!r}" if magic else "it is empty"
            raise NotGgufError(f"not a GGUF model file ({got}, expected 'GGUF')")
        try:
            return _read_after_magic(f, all_metadata=all_metadata)
        except struct.error:
            raise NotGgufError("a truncated GGUF file (it ends inside its header)") from None


def _read_after_magic(f: BinaryIO, *, all_metadata: bool) -> GgufHeader:
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
            and name in _NUMBERS
            and kind in _INTEGER_FORMATS
        ):
            (numbers[name],) = _unpack(f, _INTEGER_FORMATS[kind])
        else:
            _skip_value(f, kind)
        if not all_metadata and architecture is not None and len(numbers) == len(_NUMBERS):
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
    )


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


# -- what a model serves ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelTraits:
    """What the daemon decides from a model's file as its worker is spawned: whether it serves
    embeddings, and its context."""

    embedding: bool  # its config's `embedding`, else what its GGUF says (GgufHeader.embedding)
    n_ctx: int  # its config's `n_ctx`, else config.default_n_ctx of its trained context


def model_traits(model: ModelConfig, fd: int | None) -> ModelTraits:
    """`model`'s traits (ModelTraits): its config's where it says them, else from the header
    of its GGUF, read from `fd`, the daemon's copy of the file (what the worker loads, even if
    the file on disk has changed or gone since); None: the model has no copy (host_copy =
    "page-cache") and its worker loads the file itself.

    Raises ConfigError when the copy (or file) is not a GGUF, OSError when it cannot be read."""
    if model.embedding is not None and model.n_ctx is not None:
        return ModelTraits(model.embedding, model.n_ctx)
    source = model.path if fd is None else Path(f"/proc/self/fd/{fd}")
    try:
        header = read_header(source)
    except NotGgufError as exc:
        where = key_path("models", model.name, "path")
        what = model.path if fd is None else f"the copy of {model.path}"
        raise ConfigError(f"{where}: {what} is {exc}") from None
    return ModelTraits(
        header.embedding if model.embedding is None else model.embedding,
        context_of(model, header),
    )


def context_of(model: ModelConfig, header: GgufHeader) -> int:
    """The context `model` runs with: its config's `n_ctx`, else the default for the context
    its GGUF was trained for (config.default_n_ctx)."""
    return default_n_ctx(header.context_length) if model.n_ctx is None else model.n_ctx


# -- the config check ---------------------------------------------------------------------------


def check_models(
    config: Config, *, copy_held: Callable[[Path], bool] = lambda _: False
) -> list[str]:
    """Check every model file of `config` before anything loads; return the warnings.

    Raises one ConfigError naming the config file, the key and the user's path for the first
    file that is missing, not a regular readable file, or not a GGUF. A missing file is only a
    warning when `copy_held(path)`: the daemon still holds its host copy and serves from it."""
    label = str(config.source) if config.source else "embedded default config"
    warnings: list[str] = []
    needs: dict[str, VramNeed] = {}  # by model, for the groups' check
    for model in config.models.values():
        where = f"{label}: {key_path('models', model.name, 'path')}"
        try:
            st = os.stat(model.path)
        except FileNotFoundError:
            if copy_held(model.path):
                warnings.append(
                    f"{where}: {model.path} is gone from disk; {model.name} keeps serving from "
                    "its copy in memory (a daemon restart will need the file)"
                )
                continue
            dangling = os.path.islink(model.path)
            what = "is a symlink to a missing file" if dangling else "does not exist"
            raise ConfigError(f"{where}: {model.path} {what}") from None
        except OSError as exc:
            raise ConfigError(f"{where}: {model.path} cannot be read: {exc.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{where}: {model.path} is a directory; expected a GGUF file")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where}: {model.path} is not a regular file; expected a GGUF")
        try:
            header = read_header(model.path)
        except OSError as exc:
            raise ConfigError(f"{where}: {model.path} cannot be read: {exc.strerror}") from None
        except NotGgufError as exc:
            raise ConfigError(f"{where}: {model.path} is {exc}") from None
        if model.mmproj is not None:
            _check_projector(label, model)
        trained = header.context_length
        if trained is not None and model.n_ctx is not None and model.n_ctx > trained:
            warnings.append(
                f"{label}: {key_path('models', model.name, 'n_ctx')}: {model.n_ctx} is more "
                f"than the {trained} tokens {model.path.name} was trained for; answers past "
                "that length may degrade"
            )
        needs[model.name] = VramNeed.of(model, header, st.st_size)
    _check_groups_fit(config, needs, label)
    return warnings


@dataclass(frozen=True)
class VramNeed:
    """What a warm model takes of the device, estimated from its file: the weights (the whole
    file when any layer is offloaded: an upper bound) and its KV cache at its n_ctx (0 when the
    file does not say enough to tell)."""

    weights: int
    kv: int

    @classmethod
    def of(cls, model: ModelConfig, header: GgufHeader, file_size: int) -> VramNeed:
        if model.n_gpu_layers == 0:
            return cls(0, 0)  # runs on the CPU: holds no device memory
        return cls(file_size, header.kv_bytes(context_of(model, header)) or 0)

    @property
    def total(self) -> int:
        return self.weights + self.kv


def vram_budget_for(config: Config, model: ModelConfig) -> int:
    """The device bytes `model`'s worker may reach (with a vision projector beside it): [daemon]
    vram_budget, less what the other members of its group, warm at the same time, are
    estimated to need (VramNeed); 0: no budget. Reads the other members' headers (~0.1 s for a
    large vocabulary): call it from a thread."""
    budget = config.daemon.vram_budget
    group = config.groups.get(model.group)
    if not budget or group is None:
        return budget
    others = 0
    for name in group.models:
        if name == model.name:
            continue
        member = config.models[name]
        try:
            others += VramNeed.of(
                member, read_header(member.path), os.stat(member.path).st_size
            ).total
        except (OSError, NotGgufError):
            continue  # gone from disk (served from its copy) or refused by the check: unknown
    return max(budget - others, 1)  # 1: nothing is left, a projector never fits beside


def _check_groups_fit(config: Config, needs: Mapping[str, VramNeed], label: str) -> None:
    """Members of a group are warm at once: with a [daemon] vram_budget, refuse a group whose
    members' estimates add up to more, with the numbers."""
    budget = config.daemon.vram_budget
    if not budget:
        return
    for group in config.groups.values():
        members = [(name, needs[name]) for name in group.models if name in needs]
        total = sum(need.total for _, need in members)
        if total <= budget:
            continue
        parts = ", ".join(
            f"{name} {_gib(need.weights)} weights + {_gib(need.kv)} KV" for name, need in members
        )
        raise ConfigError(
            f"{label}: {key_path('groups', group.name, 'models')}: they need about "
            f"{_gib(total)} together ({parts}), more than [daemon] vram_budget "
            f"({_gib(budget)}); leave one out, lower an n_ctx, or raise the budget"
        )


def _gib(size: int) -> str:
    if size >= 1 << 30:
        return f"{size / (1 << 30):.2f} GiB"
    return f"{size / (1 << 20):.2f} MiB"


def _check_projector(label: str, model: ModelConfig) -> None:
    """A vision model's mmproj must be a readable GGUF of llama.cpp's "clip" architecture (what
    mtmd_init_from_file loads). Whether its output width matches the model's n_embd takes the
    loader itself: the worker tries it when the model loads (arbiterd/worker/engine/, issue 12)."""
    assert model.mmproj is not None
    where = f"{label}: {key_path('models', model.name, 'mmproj')}"
    path = model.mmproj
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(f"{where}: {path} is not a regular file; expected a projector GGUF")
        header = read_header(path)
    except FileNotFoundError:
        raise ConfigError(f"{where}: {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{where}: {path} cannot be read: {exc.strerror}") from None
    except NotGgufError as exc:
        raise ConfigError(f"{where}: {path} is {exc}") from None
    if header.architecture != PROJECTOR_ARCHITECTURE:
        got = repr(header.architecture) if header.architecture else "none"
        raise ConfigError(
            f"{where}: {path} is not a multimodal projector: its architecture is {got}, "
            f"expected {PROJECTOR_ARCHITECTURE!r} (an mmproj GGUF)"
        )
