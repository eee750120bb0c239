"""An Ollama model store made from GGUF files, laid out as `ollama pull` leaves it: a JSON
manifest per NAME:TAG under manifests/HOST/NAMESPACE/MODEL/TAG, and each layer a blob named by
the sha256 of its bytes (blobs/sha256-HEX), hard-linked to the GGUF when it can be (a copy
when the store is on another file system)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

MODEL_LAYER = "application/vnd.ollama.image.model"
PROJECTOR_LAYER = "application/vnd.ollama.image.projector"
TEMPLATE_LAYER = "application/vnd.ollama.image.template"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
REGISTRY = "registry.ollama.ai"


def add_model(
    store: Path, name: str, gguf: Path, *, projector: Path | None = None, host: str = REGISTRY
) -> Path:
    """Put `gguf` into the store at `store` as `name` ("llama3.2:3b", "me/tiny:q4", with an
    optional projector GGUF) and return its manifest's path."""
    base, _, tag = name.partition(":")
    namespace, _, model = base.rpartition("/")
    manifest = store / "manifests" / host / (namespace or "library") / model / (tag or "latest")
    layers = [_file_layer(store, MODEL_LAYER, gguf)]
    if projector is not None:
        layers.append(_file_layer(store, PROJECTOR_LAYER, projector))
    layers.append(_text_layer(store, TEMPLATE_LAYER, b"{{ .Prompt }}"))
    config = _text_layer(store, CONFIG_TYPE, json.dumps({"model_format": "gguf"}).encode())
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(
        json.dumps(
            {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": config, "layers": layers}
        )
    )
    return manifest


def blob_path(store: Path, digest: str) -> Path:
    """Where the store keeps the blob of `digest` ("sha256:HEX")."""
    return store / "blobs" / digest.replace(":", "-")


def model_blob(manifest: Path) -> Path:
    """The model blob `manifest` names, in the store it belongs to."""
    store = manifest.parents[4]
    layers = json.loads(manifest.read_text())["layers"]
    digest = next(layer["digest"] for layer in layers if layer["mediaType"] == MODEL_LAYER)
    return blob_path(store, digest)


def _file_layer(store: Path, media_type: str, source: Path) -> dict[str, object]:
    with source.open("rb") as f:
        digest = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    blob = blob_path(store, digest)
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        try:
            os.link(source, blob)
        except OSError:  # another file system, or links not allowed there
            shutil.copyfile(source, blob)
    return {"mediaType": media_type, "digest": digest, "size": blob.stat().st_size}


def _text_layer(store: Path, media_type: str, data: bytes) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob = blob_path(store, digest)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    return {"mediaType": media_type, "digest": digest, "size": len(data)}
