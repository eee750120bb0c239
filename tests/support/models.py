"""A model's config as the daemon holds it, made directly (no config file to write and parse)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from arbiterd.config import ModelConfig
from arbiterd.spec import KvPolicy, Residency


def model_config(name: str, path: Path = Path("/nonexistent.gguf"), **changes: Any) -> ModelConfig:
    """[models.NAME] with the config file's defaults, on the CPU, and `changes` applied."""
    config = ModelConfig(
        name=name,
        path=path,
        n_ctx=2048,
        n_gpu_layers=0,
        n_threads=None,
        chat_format=None,
        mmproj=None,
        embedding=None,
        kv_on_release=KvPolicy.HOST,
        residency=Residency.AUTO,
        min_hold_s=0.1,
        idle_release_s=0.0,
    )
    return replace(config, **changes)
