"""Checking model files before anything loads: owns the config check that runs before the daemon
starts its workers and before a reload applies anything, and what a model serves as its header
says (arbiterd/gguf.py reads the header); never loads tensors, never imports llama.cpp.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from arbiterd.config import Config, ModelConfig, default_n_ctx
from arbiterd.errors import ConfigError
from arbiterd.gguf import PROJECTOR_ARCHITECTURE, GgufHeader, NotGgufError, read_header
from arbiterd.tomltable import key_path

# -- what a model serves ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelTraits:
    """What the daemon decides from a model's file as its worker is spawned: whether it serves
    embeddings, and its context."""

    embedding: bool  # its config's `embedding`, else what its GGUF says (GgufHeader.embedding)
    n_ctx: int  # its config's `n_ctx`, else config.default_n_ctx of its trained context


def serves_embeddings(model: ModelConfig) -> bool:
    """Whether `model` serves embeddings only, read as its config is loaded (its slot is made):
    its config's `embedding`, else what its GGUF's header says; False when the file cannot be
    read (its start then says why, and decides again from what the worker loads)."""
    if model.embedding is not None:
        return model.embedding
    try:
        return read_header(model.path).embedding
    except (OSError, NotGgufError):
        return False


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
