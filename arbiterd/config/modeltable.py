"""The [models.NAME] tables: each model's keys checked into a `ModelConfig` (`model_table`),
and the names requests may ask for (`is_model_name`, each alias a name of one model only).
Owns what is checked of each key: the path (never opened here: daemon/models/modelfile.py
checks the files), the context, the placement on devices (issue 27), the chat template
(chattemplate.template_problem), the image limits.

Every problem is a ConfigError naming the file, the key path and what was expected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from arbiterd.chattemplate import template_problem
from arbiterd.config.daemontable import (
    RPC_IPV6,
    server_of,
)
from arbiterd.config.records import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_TAG,
    STARTER_N_CTX,
    Encoder,
    HostCopyMode,
    Load,
    ModelConfig,
    Tools,
    model_key,
)
from arbiterd.errors import BadValueError
from arbiterd.paths import (
    DEFAULT_DEVICE,
    DEVICE_ID_SHAPES,
    DeviceId,
    DeviceKind,
    device_arena_of,
    parse_device_id,
)
from arbiterd.spec import (
    DEFAULT_PARALLEL,
    MAX_N_CTX,
    MAX_PARALLEL,
    KvPolicy,
    Residency,
    SplitMode,
)
from arbiterd.states import PRIORITY_CHOICES, Priority
from arbiterd.tomltable import (
    MISSING,
    Keys,
    Missing,
    Source,
    Table,
    describe,
    dotted,
    toml_string,
)

# Model names and aliases appear in URLs (`/v1/models/NAME`), as Prometheus label values and
# in the file name of a model's prompt cache (`NAME.kv`): never a "/", never "." or "..".
MAX_MODEL_NAME_CHARS = 64

# A name may end in ":TAG", as Ollama names models ("llama3.2:3b"): an app set up for Ollama asks
# for such a name, and a model found in Ollama's store is served under it (cli/discovery.py).
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9._-]+(?::[A-Za-z0-9._-]+)?")

MODEL_NAME_EXPECTED = (
    f"a name of 1 to {MAX_MODEL_NAME_CHARS} characters from A-Z a-z 0-9 . _ -, "
    'with an optional :TAG as Ollama names models (e.g. "llama3.2:3b")'
)

ALIAS_EXPECTED = (
    f"an alias of 1 to {MAX_MODEL_NAME_CHARS} characters from A-Z a-z 0-9 . _ -, "
    'with an optional :TAG as Ollama names models (e.g. "qwen2.5:7b")'
)

MODEL_KEYS = (
    "path",
    "aliases",
    "n_ctx",
    "n_gpu_layers",
    "n_threads",
    "parallel",
    "chat_format",
    "mmproj",
    "embedding",
    "kv_on_release",
    "residency",
    "min_hold_s",
    "idle_release_s",
    "priority",
    "preemptible",
    "strict_api",
    "load",
    "unload_after_s",
    "max_queue_s",
    "host_copy",
    "repack",
    "encoder",
    "max_image_bytes",
    "max_image_pixels",
    "allow_image_urls",
    "tools",
    "chat_template",
    "chat_template_file",
    "devices",
    "split_mode",
    "tensor_split",
)

_PATH_EXPECTED = "the GGUF file's path, a non-empty string"

_MODELS_EXPECTED = 'at least one [models.NAME] table with a path, e.g. [models.qwen] path = "..."'

_KV_EXPECTED = 'one of "host", "device", "drop"'

_RESIDENCY_EXPECTED = 'one of "auto", "in-place", "reload"'

_LOAD_EXPECTED = 'one of "start", "demand"'

_HOST_COPY_EXPECTED = 'one of "memfd", "page-cache"'

_ENCODER_EXPECTED = 'one of "jit", "resident"'

_TOOLS_EXPECTED = 'one of "offer", "refuse"'

_TEMPLATE_EXPECTED = 'a Jinja chat template ("" = the GGUF\'s own)'

_ALIASES_EXPECTED = 'an array of aliases, e.g. ["gpt-4o-mini", "qwen2.5:7b"]'

_EMBEDDING_EXPECTED = "true or false (leave it out: as the GGUF says)"

_DEVICES_EXPECTED = f'an array of one or more device ids ({DEVICE_ID_SHAPES}), e.g. ["gpu1"]'

_SPLIT_MODE_EXPECTED = 'one of "layer", "row", "tensor"'

_TENSOR_SPLIT_EXPECTED = "an array of positive numbers, one share per device, e.g. [3, 1]"

# A llama.cpp RPC server serves one client at a time (docs/devices.md): KV buffers left on it
# while cold would keep this worker its client, and no other model could use the server.
_KV_ON_RPC = (
    '"device" cannot be kept for a model on an RPC device: its KV cache would keep the '
    "connection to the server, which serves one client at a time, so no other model could use "
    'it while this one is cold; use "host" (the default) or "drop"'
)


def check_device_arenas(src: Source, models: Mapping[str, ModelConfig], gpu0_arena: Path) -> None:
    """Every model's devices have arenas of their own beside gpu0's (paths.device_arena_of):
    refused here, naming the model, rather than by its worker."""
    for model in models.values():
        for device in model.devices:
            try:
                device_arena_of(device, gpu0_arena)
            except BadValueError as exc:
                raise src.fail(("models", model.name, "devices"), str(exc)) from None


def model_tables(src: Source, raw: object, rpc_servers: tuple[str, ...]) -> dict[str, ModelConfig]:
    if isinstance(raw, Missing) or raw == {}:
        raise src.fail(("models",), f"expected {_MODELS_EXPECTED}, got none")
    if not isinstance(raw, dict):
        raise src.expected(("models",), _MODELS_EXPECTED, raw)
    models = {name: model_table(src, name, table, rpc_servers) for name, table in raw.items()}
    _check_aliases(src, models)
    return models


def model_table(
    src: Source, name: str, raw: object, rpc_servers: tuple[str, ...] = ()
) -> ModelConfig:
    where: Keys = ("models", name)
    if not is_model_name(name):
        raise src.expected(where, f"{MODEL_NAME_EXPECTED} (it appears in URLs)", name)
    if not isinstance(raw, dict):
        raise src.expected(where, 'a table ([models.NAME] with path = "...")', raw)
    table = Table(src, where, raw)
    table.check_keys(MODEL_KEYS, _dotted_name_hint(name))

    path_text = raw.get("path", MISSING)
    if isinstance(path_text, Missing):
        message = f"expected {_PATH_EXPECTED}, got nothing (it is required)"
        raise src.fail(table.keys("path"), message)
    if not isinstance(path_text, str) or not path_text:
        raise src.expected(table.keys("path"), _PATH_EXPECTED, path_text)

    kv_on_release = table.choice("kv_on_release", KvPolicy.HOST, _KV_EXPECTED)
    residency = table.choice("residency", Residency.AUTO, _RESIDENCY_EXPECTED)
    n_ctx = (
        table.integer(
            "n_ctx",
            STARTER_N_CTX,
            f"a positive integer (tokens, at most {MAX_N_CTX})",
            ok=lambda v: 0 < v <= MAX_N_CTX,
        )
        if "n_ctx" in table.values
        else None
    )
    n_gpu_layers = table.integer(
        "n_gpu_layers", -1, "an integer >= -1 (-1 = every layer)", ok=lambda v: v >= -1
    )
    n_threads = table.integer(
        "n_threads", 0, "a non-negative integer (0 = every CPU)", ok=lambda v: v >= 0
    )
    parallel = table.integer(
        "parallel",
        DEFAULT_PARALLEL,
        f"an integer from 1 to {MAX_PARALLEL} (requests decoded together)",
        ok=lambda v: 1 <= v <= MAX_PARALLEL,
    )
    chat_format = table.string(
        "chat_format", "", 'a chat format name such as "chatml" ("" = the GGUF\'s own template)'
    )
    mmproj = table.optional_path("mmproj")
    encoder = table.choice("encoder", Encoder.JIT, _ENCODER_EXPECTED)
    load = table.choice("load", Load.START, _LOAD_EXPECTED)
    host_copy = table.choice("host_copy", HostCopyMode.MEMFD, _HOST_COPY_EXPECTED)
    embedding = raw.get("embedding")
    if embedding is not None and not isinstance(embedding, bool):
        raise src.expected(table.keys("embedding"), _EMBEDDING_EXPECTED, embedding)
    chat_template = _chat_template(table, chat_format)
    devices = _devices(table, rpc_servers)
    if kv_on_release is KvPolicy.DEVICE and any(d.kind is DeviceKind.RPC for d in devices):
        raise src.fail(table.keys("kv_on_release"), _KV_ON_RPC)
    return ModelConfig(
        name=name,
        aliases=_aliases(table),
        path=src.path(table.keys("path"), path_text, _PATH_EXPECTED),
        n_ctx=n_ctx,
        n_gpu_layers=n_gpu_layers,
        n_threads=n_threads or None,
        parallel=parallel,
        chat_format=chat_format or None,
        mmproj=mmproj,
        embedding=embedding,
        kv_on_release=kv_on_release,
        residency=residency,
        min_hold_s=table.seconds("min_hold_s", 0.1),
        idle_release_s=table.seconds("idle_release_s", 0.0, note=" (0 = only when wanted)"),
        strict_api=table.boolean("strict_api", False),
        priority=priority_of(table),
        preemptible=table.boolean("preemptible", True),
        load=load,
        unload_after_s=table.seconds("unload_after_s", 0.0, note=" (0 = never)"),
        max_queue_s=table.seconds("max_queue_s", 0.0, note=" (0 = no limit)"),
        host_copy=host_copy,
        repack=table.boolean("repack", True),
        encoder=encoder,
        max_image_bytes=table.integer(
            "max_image_bytes",
            DEFAULT_MAX_IMAGE_BYTES,
            "a positive integer (bytes of one image as sent)",
            ok=lambda v: v > 0,
        ),
        max_image_pixels=table.integer(
            "max_image_pixels",
            DEFAULT_MAX_IMAGE_PIXELS,
            "a positive integer (width x height of one image)",
            ok=lambda v: v > 0,
        ),
        allow_image_urls=table.boolean("allow_image_urls", False),
        tools=table.choice("tools", Tools.OFFER, _TOOLS_EXPECTED),
        chat_template=chat_template,
        devices=tuple(str(device) for device in devices),
        split_mode=table.choice("split_mode", SplitMode.LAYER, _SPLIT_MODE_EXPECTED),
        tensor_split=_tensor_split(table, devices),
    )


def _devices(table: Table, rpc_servers: tuple[str, ...]) -> tuple[DeviceId, ...]:
    """A model's `devices`, parsed, in the file's order: each once, `cpu` only alone, and each
    rpc: device on a server of `[daemon] rpc_servers`. Whether the engine offers them is the
    worker's to say when it loads (worker/engine/placement.py names those that exist): the
    daemon never loads llama.cpp, and a GPU or a server may come and go while it runs."""
    src, keys = table.src, table.keys("devices")
    value = table.values.get("devices", [DEFAULT_DEVICE])
    if not isinstance(value, list):
        raise src.expected(keys, _DEVICES_EXPECTED, value)
    if not value:
        raise src.fail(keys, f"expected {_DEVICES_EXPECTED}, got an empty array")
    devices: dict[str, tuple[DeviceId, str]] = {}  # canonical id -> (parsed, as the file spells it)
    for text in value:
        if not isinstance(text, str):
            raise src.expected(keys, _DEVICES_EXPECTED, text)
        device = _device(table, text)
        first = devices.get(str(device))
        if first is not None:
            same = "" if first[1] == text else f" (as {describe(first[1])})"
            raise src.fail(keys, f"{describe(text)} is listed twice{same}; name each device once")
        devices[str(device)] = (device, text)
        if device.kind is DeviceKind.RPC and server_of(device) not in rpc_servers:
            listed = ", ".join(rpc_servers) if rpc_servers else "none"
            raise src.fail(
                keys,
                f"{describe(text)} is a device of the RPC server {server_of(device)}, which "
                f"{dotted(('daemon', 'rpc_servers'))} does not list (it lists {listed}); "
                "add the server there",
            )
    if len(devices) > 1 and str(DeviceId(DeviceKind.CPU)) in devices:
        raise src.fail(
            keys,
            '"cpu" goes alone: it means no device, every layer on the CPU; list "cpu" only, '
            "or only the devices the layers go to",
        )
    return tuple(device for device, _ in devices.values())


def _device(table: Table, text: str) -> DeviceId:
    """One device id of `devices`; a ConfigError naming the shapes of ids when it is none."""
    keys = table.keys("devices")
    try:
        device = parse_device_id(text)
    except BadValueError as exc:
        # parse_device_id's message is "device id 'TEXT': WHY"; WHY quotes DEVICE_ID_SHAPES.
        why = str(exc).removeprefix(f"device id {text!r}: ")
        raise table.src.fail(keys, f"{describe(text)} is no device id: {why}") from None
    if device.kind is DeviceKind.RPC and ":" in device.host:
        raise table.src.fail(keys, f"{describe(text)}: {RPC_IPV6}")
    return device


def _tensor_split(table: Table, devices: tuple[DeviceId, ...]) -> tuple[float, ...]:
    """Each device's share of the model, one positive number per device ([] = llama.cpp's
    default: by each device's free memory)."""
    src, keys = table.src, table.keys("tensor_split")
    value = table.values.get("tensor_split", [])
    if not isinstance(value, list):
        raise src.expected(keys, _TENSOR_SPLIT_EXPECTED, value)
    for share in value:
        if (
            isinstance(share, bool)
            or not isinstance(share, int | float)
            or not math.isfinite(share)
            or share <= 0
        ):
            raise src.expected(keys, _TENSOR_SPLIT_EXPECTED, share)
    if value and len(value) != len(devices):
        named = ", ".join(toml_string(str(device)) for device in devices)
        raise src.fail(
            keys,
            f"{len(value)} shares for {len(devices)} device(s) (devices = [{named}]); give one "
            "share per device, in the order of devices",
        )
    return tuple(float(share) for share in value)


def _chat_template(table: Table, chat_format: str) -> str | None:
    """The model's chat_template, or the text of its chat_template_file, checked to parse and
    to render a generation prompt (chattemplate.template_problem); None when it names neither."""
    src = table.src
    text = table.string("chat_template", "", _TEMPLATE_EXPECTED)
    path = table.optional_path("chat_template_file")
    key = "chat_template" if text else "chat_template_file"
    if text and path is not None:
        raise src.fail(
            table.keys("chat_template_file"), "give chat_template or chat_template_file, not both"
        )
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
            raise src.fail(table.keys(key), f"cannot read {path}: {reason}") from None
    if not text:
        return None
    if chat_format:
        raise src.fail(table.keys(key), "give chat_format or a chat template, not both")
    problem = template_problem(text)
    if problem:
        shown = f" ({path})" if path is not None else ""
        raise src.fail(table.keys(key), f"{problem}{shown}")
    return text


def _aliases(table: Table) -> tuple[str, ...]:
    keys = table.keys("aliases")
    value = table.values.get("aliases", [])
    if not isinstance(value, list):
        raise table.src.expected(keys, _ALIASES_EXPECTED, value)
    for alias in value:
        if not isinstance(alias, str) or not is_model_name(alias):
            raise table.src.expected(keys, ALIAS_EXPECTED, alias)
    return tuple(value)


def is_model_name(text: str) -> bool:
    """Whether `text` may name a model or be an alias: MODEL_NAME_RE, at most
    MAX_MODEL_NAME_CHARS, and not "." or ".." before its tag (path segments a URL normalizer
    would eat, in `/v1/models/NAME`)."""
    return (
        len(text) <= MAX_MODEL_NAME_CHARS
        and MODEL_NAME_RE.fullmatch(text) is not None
        and text.partition(":")[0] not in {".", ".."}
    )


def _check_aliases(src: Source, models: Mapping[str, ModelConfig]) -> None:
    """Every name a request may ask for names one model: an alias is no model's name and no
    other alias, counting NAME and NAME:latest as one (`model_key`)."""
    taken = {model_key(name): (name, f"the name of {dotted(('models', name))}") for name in models}
    for model in models.values():
        for alias in model.aliases:
            key = model_key(alias)
            if key in taken:
                spelled, what = taken[key]
                same = "" if spelled == alias else f" (as {describe(spelled)}: {_SAME_NAME})"
                raise src.fail(
                    ("models", model.name, "aliases"),
                    f"{describe(alias)} is already {what}{same}; an alias must differ from "
                    "every model's name and from every other alias",
                )
            taken[key] = (alias, f"an alias of {dotted(('models', model.name))}")


_SAME_NAME = f"a name without a tag is the same name with :{DEFAULT_TAG}, as in Ollama"


def priority_of(table: Table) -> Priority:
    return table.choice("priority", Priority.NORMAL, f"one of {PRIORITY_CHOICES}")


def _dotted_name_hint(name: str) -> Callable[[str, object], str]:
    def hint(key: str, value: object) -> str:
        # `[models.qwen2.5]` is the table "5" inside the model "qwen2".
        if isinstance(value, dict):
            return f'a model name with a dot must be quoted: [models."{name}.{key}"]'
        return ""

    return hint
