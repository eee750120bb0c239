"""Finding the GGUF models a user already has, where other tools keep them: owns those places,
the layout of Ollama's store, and the name each model found is suggested to be served under.

    ollama       $OLLAMA_MODELS, else ~/.ollama/models: manifests/HOST/NAMESPACE/MODEL/TAG, each
                 a JSON manifest whose model layer names a blob (blobs/sha256-HEX) by digest
    huggingface  $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub: snapshots of
                 symlinks to blobs
    lm-studio    ~/.lmstudio/models and ~/.cache/lm-studio/models
    llama.cpp    $LLAMA_CACHE, else ~/.cache/llama.cpp (llama.cpp's -hf downloads)
    models       ~/models and ~/.local/share/models

Reads directories, Ollama's manifests and GGUF headers (arbiterd/gguf.py reads those), never
a whole model file (only the metadata before its tensors), and never writes anything. A file
reached twice (a symlink, a hard link, two manifests of one blob) is listed once, where it was
first found, in the order above; another Ollama name of it becomes an alias. What it could not
use is a warning, never an error: the rest is still found.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from arbiterd.config import MAX_MODEL_NAME_CHARS, is_model_name, model_key
from arbiterd.gguf import PROJECTOR_ARCHITECTURE, NotGgufError, read_header

GGUF_SUFFIX = ".gguf"
# Ollama's store, as `ollama pull` lays it out: the registry and namespace a short name stands
# for, and the media types of the layers that hold the model and a vision projector.
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_PROJECTOR_LAYER = "application/vnd.ollama.image.projector"
OLLAMA_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
# A manifest is a few hundred bytes, three levels deep; a file far larger is not one, nor one
# deeper than the parser goes (Python's recursion limit, about 1,000 levels: issue 40's 5,000
# deep ended the whole listing with a RecursionError).
MAX_MANIFEST_BYTES = 1 << 20
# Characters a model name may not hold, each run made one "-".
_NOT_IN_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")
# A GGUF's general.name that names a training run, not a model: its converter took the run's
# folder name. A word of it is a run's (an epoch, a step, a data mix: "Smollm2 135M 8k Lc100K
# Mix1 Ep2", SmolLM2-135M-Instruct's), or the whole name is a folder a trainer writes to.
_TRAINING_WORD_RE = re.compile(r"(?:ep|epoch|steps?|ckpt|checkpoint|iter|mix|lc)\d+k?", re.I)
_TRAINING_FOLDER_RE = re.compile(r"(?:checkpoint|merged|output|model|final)(?:[\s_-]*\d+)?", re.I)
# The quantization a GGUF file's name ends in (".Q4_1", "-q4_k_m", "-UD-IQ3_XXS", "-bf16").
_QUANT_SUFFIX_RE = re.compile(
    r"[.-](?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|[BM]?F16|FP16|F32|FP32|MXFP4)$", re.I
)


@dataclass(frozen=True)
class Place:
    """A folder models are looked for in, and which tool keeps it (`source`)."""

    source: str
    folder: Path


@dataclass(frozen=True)
class FoundModel:
    """One GGUF model found, and what its header says of it."""

    name: str  # the name suggested to serve it under: a valid config name, unique in the list
    path: Path  # as found: a snapshot's symlink, an Ollama blob, a file in a folder
    size_bytes: int
    source: str  # Place.source
    architecture: str | None
    context_length: int | None  # the trained context, as the GGUF says
    chat_template: bool  # whether its GGUF holds a chat template
    ollama_name: str | None = None  # as `ollama list` names it ("llama3.2:3b"), from its store
    mmproj: Path | None = None  # its vision projector, when its Ollama manifest names one
    # Its other names in Ollama's store, of manifests naming the same blob ("llama3.2:latest"
    # beside "llama3.2:3b"): the starter config's aliases, so that each still names it.
    aliases: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """One entry of `arbiterd models --json`; its keys are a public interface."""
        return {
            "name": self.name,
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "source": self.source,
            "architecture": self.architecture,
            "context_length": self.context_length,
            "chat_template": self.chat_template,
            "ollama_name": self.ollama_name,
            "mmproj": None if self.mmproj is None else str(self.mmproj),
            "aliases": list(self.aliases),
        }


@dataclass(frozen=True)
class Discovery:
    """What `find_models` found, where it looked, and what it skipped (one line each)."""

    models: list[FoundModel]
    places: list[Place]
    warnings: list[str] = field(default_factory=list)


def places(env: Mapping[str, str] | None = None) -> list[Place]:
    """Where models are looked for, in the order they are listed (see the module docstring)."""
    env = os.environ if env is None else env
    home = _home(env)
    hub = _env_path(env, "HF_HUB_CACHE")
    if hub is None:
        hf_home = _env_path(env, "HF_HOME")
        hub = (hf_home or home / ".cache/huggingface") / "hub"
    return [
        Place("ollama", _env_path(env, "OLLAMA_MODELS") or home / ".ollama/models"),
        Place("huggingface", hub),
        Place("lm-studio", home / ".lmstudio/models"),
        Place("lm-studio", home / ".cache/lm-studio/models"),
        Place("llama.cpp", _env_path(env, "LLAMA_CACHE") or home / ".cache/llama.cpp"),
        Place("models", home / "models"),
        Place("models", home / ".local/share/models"),
    ]


def find_models(env: Mapping[str, str] | None = None) -> Discovery:
    """Every GGUF model in `places(env)`, each once, named uniquely (Discovery)."""
    looked = places(env)
    finder = _Finder()
    for place in looked:
        if place.source == "ollama":
            finder.ollama_store(place)
        else:
            finder.folder(place)
    return Discovery(finder.models, looked, finder.warnings)


class _Finder:
    """The models found so far, the files already seen (by device and inode: the index of the
    model found there) and the names taken (by config.model_key: "x" and "x:latest" are one)."""

    def __init__(self) -> None:
        self.models: list[FoundModel] = []
        self.warnings: list[str] = []
        self._seen: dict[tuple[int, int], int] = {}
        self._names: set[str] = set()

    def ollama_store(self, place: Place) -> None:
        manifests = place.folder / "manifests"
        for manifest in _ollama_manifests(manifests):
            host, namespace, model, tag = manifest.relative_to(manifests).parts
            try:
                layers = _manifest_layers(manifest)
            except ValueError as exc:
                self.warnings.append(f"skipped {manifest}: {exc}")
                continue
            blob = layers.get(OLLAMA_MODEL_LAYER)
            if blob is None:
                self.warnings.append(f"skipped {manifest}: it names no model layer")
                continue
            path = place.folder / "blobs" / blob.replace(":", "-")
            if not path.is_file():
                self.warnings.append(f"skipped {manifest}: its model blob {path} is missing")
                continue
            mmproj = None
            projector = layers.get(OLLAMA_PROJECTOR_LAYER)
            if projector is not None:
                mmproj = place.folder / "blobs" / projector.replace(":", "-")
                if not mmproj.is_file():
                    self.warnings.append(
                        f"{manifest}: its projector blob {mmproj} is missing; the model is "
                        "listed without it (no images)"
                    )
                    mmproj = None
            name = ollama_name(host, namespace, model, tag)
            self._add(place, path, name, ollama=name, mmproj=mmproj)

    def folder(self, place: Place) -> None:
        for path in _gguf_files(place.folder):
            self._add(place, path, None)

    def _add(
        self,
        place: Place,
        path: Path,
        suggested: str | None,
        *,
        ollama: str | None = None,
        mmproj: Path | None = None,
    ) -> None:
        try:
            st = path.stat()
        except OSError:
            return  # a dangling symlink: an unfinished or removed download
        seen = self._seen.get((st.st_dev, st.st_ino))
        if seen is not None:
            if ollama is not None:
                self._alias(seen, config_name(ollama))
            return
        self._seen[st.st_dev, st.st_ino] = len(self.models)
        try:
            header = read_header(path, all_metadata=True)
        except OSError as exc:
            self.warnings.append(f"skipped {path}: it cannot be read: {exc.strerror}")
            return
        except NotGgufError as exc:
            self.warnings.append(f"skipped {path}: it is {exc}")
            return
        if header.architecture == PROJECTOR_ARCHITECTURE:
            return  # a vision model's projector, not a model of its own
        # Ollama's name; else the model's own (general.name), or its file's name when another
        # model found has that one (two quantizations of one model, say). A general.name that
        # names a training run gives way to the file's name, without its quantization first.
        own = [header.name, _stem(path)]
        if header.name and training_tag(header.name):
            own = [_QUANT_SUFFIX_RE.sub("", _stem(path)), _stem(path)]
        names = [config_name(text) for text in (suggested, *own) if text]
        free = [name for name in names if model_key(name) not in self._names]
        name = free[0] if free else _unique(names[0], self._names)
        self._names.add(model_key(name))
        self.models.append(
            FoundModel(
                name=name,
                path=path,
                size_bytes=st.st_size,
                source=place.source,
                architecture=header.architecture,
                context_length=header.context_length,
                chat_template=bool(header.chat_template),
                ollama_name=ollama,
                mmproj=mmproj,
            )
        )

    def _alias(self, index: int, alias: str) -> None:
        """Another Ollama name of the model at `index`, unless the name is taken."""
        if model_key(alias) in self._names:
            return
        self._names.add(model_key(alias))
        model = self.models[index]
        self.models[index] = replace(model, aliases=(*model.aliases, alias))


def ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The name `ollama list` shows for the manifest at manifests/HOST/NAMESPACE/MODEL/TAG: the
    registry and the "library" namespace are left out, as in `ollama pull llama3.2:3b`."""
    if host != OLLAMA_REGISTRY:
        return f"{host}/{namespace}/{model}:{tag}"
    if namespace != OLLAMA_NAMESPACE:
        return f"{namespace}/{model}:{tag}"
    return f"{model}:{tag}"


def config_name(text: str) -> str:
    """`text` made into a valid config model name (config.is_model_name): each run of other
    characters one "-" (the "/" of a namespaced Ollama name too), a ":TAG" kept, cut to
    MAX_MODEL_NAME_CHARS."""
    if is_model_name(text):
        return text
    base, colon, tag = text.partition(":")
    tag = _NOT_IN_NAME_RE.sub("-", tag).strip("-.")
    suffix = f":{tag}" if colon and tag else ""
    base = _NOT_IN_NAME_RE.sub("-", base).strip("-.")[: MAX_MODEL_NAME_CHARS - len(suffix)]
    base = base.rstrip("-.") or "model"
    return f"{base}{suffix}"[:MAX_MODEL_NAME_CHARS]


def training_tag(name: str) -> bool:
    """Whether a GGUF's general.name names a training run rather than a model: a word of it
    is a run's (an epoch, a step, a data mix), or it is the folder a trainer writes to."""
    words = re.split(r"[\s_-]+", name)
    return bool(_TRAINING_FOLDER_RE.fullmatch(name.strip())) or any(
        _TRAINING_WORD_RE.fullmatch(word) for word in words
    )


def _unique(name: str, used: set[str]) -> str:
    """`name`, or `name-2`, `name-3`... (before its tag) when its model_key is in `used`."""
    base, colon, tag = name.partition(":")
    candidate, n = name, 1
    while model_key(candidate) in used:
        n += 1
        suffix = f"-{n}{colon}{tag}"
        candidate = base[: MAX_MODEL_NAME_CHARS - len(suffix)] + suffix
    used.add(candidate)
    return candidate


def _stem(path: Path) -> str:
    return path.name.removesuffix(GGUF_SUFFIX) if path.suffix == GGUF_SUFFIX else path.name


def _ollama_manifests(manifests: Path) -> Iterator[Path]:
    """The manifest files, HOST/NAMESPACE/MODEL/TAG deep, in name order."""
    for host in _subfolders(manifests):
        for namespace in _subfolders(host):
            for model in _subfolders(namespace):
                try:
                    tags = sorted(model.iterdir())
                except OSError:
                    continue
                yield from (tag for tag in tags if tag.is_file())


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(entry for entry in folder.iterdir() if entry.is_dir())
    except OSError:
        return []


def _manifest_layers(manifest: Path) -> dict[str, str]:
    """The digest of each layer of an Ollama manifest, by media type (the first of each).
    Raises ValueError saying what is wrong with it."""
    try:
        with manifest.open("rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"it cannot be read: {exc.strerror}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError("it is too large to be an Ollama manifest")
    try:
        parsed = json.loads(data)
    except RecursionError:  # the parser recurses once per level
        raise ValueError("it nests too deeply to be an Ollama manifest") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("it is not JSON (an Ollama manifest is)") from None
    except ValueError:  # int() refuses a literal of more than 4,300 digits
        raise ValueError("it holds a number too long to be an Ollama manifest's") from None
    layers = parsed.get("layers") if isinstance(parsed, dict) else None
    if not isinstance(layers, list):
        raise ValueError("it has no list of layers (not an Ollama manifest)")
    found: dict[str, str] = {}
    for layer in layers:
        if not isinstance(layer, dict):
            continue
        kind, digest = layer.get("mediaType"), layer.get("digest")
        if not isinstance(kind, str) or kind in found:
            continue
        if not isinstance(digest, str) or not OLLAMA_DIGEST_RE.fullmatch(digest):
            raise ValueError(f"its {kind} layer has no sha256 digest")
        found[kind] = digest
    return found


def _gguf_files(root: Path) -> Iterator[Path]:
    """The *.gguf files under `root`, symlinked folders followed once each, in name order, a
    folder's symlinks after its files (a file with a link beside it is listed by its own name)."""
    visited: set[tuple[int, int]] = set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        try:
            st = os.stat(folder)
        except OSError:
            subfolders.clear()
            continue
        if (st.st_dev, st.st_ino) in visited:
            subfolders.clear()  # a symlink loop, or a folder linked twice
            continue
        visited.add((st.st_dev, st.st_ino))
        subfolders.sort()
        found = [Path(folder) / name for name in files if name.endswith(GGUF_SUFFIX)]
        yield from sorted(found, key=lambda path: (path.is_symlink(), path.name))


def _env_path(env: Mapping[str, str], var: str) -> Path | None:
    raw = env.get(var, "")
    return Path(raw).expanduser() if raw else None


def _home(env: Mapping[str, str]) -> Path:
    raw = env.get("HOME", "")
    return Path(raw) if raw and Path(raw).is_absolute() else Path.home()
