"""Plain descriptions of models and workers, shared by the daemon and the worker processes.

Owns the records that cross process boundaries (ModelSpec, WorkerConfig, the worker protocol
version) and the request parameters a model accepts. Imports nothing heavy: the daemon and the
CLI use these without loading llama.cpp, which only the worker processes do.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiterd.states import Priority, RequestKind

# 2: error replies carry a stable code (errors.ErrorCode), not an exception class name.
# 3: a generate op carries one "request" (arbiterd.request.GenerateRequest), not "kind" and "body".
# 4: a generate op is answered {"id", "started": true} before its chunks and result (a daemon of
#    protocol 3 would read it as a reply without a result).
WORKER_PROTOCOL = 4

# Request parameters passed through to llama-cpp-python, with the type each must have.
COMPLETION_PARAMS: dict[str, tuple[type, ...]] = {
    "max_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "repeat_penalty": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "seed": (int,),
    "stop": (str, list),
}
# llama.cpp keeps n_ctx in a uint32 and sizes host arrays by it; larger values wrap or exhaust RAM.
MAX_N_CTX = (1 << 31) - 1
# Requests a model decodes together (`parallel`, issue 42): llama-server's and LM Studio's
# default; at most llama.cpp's LLAMA_MAX_SEQ.
DEFAULT_PARALLEL = 4
MAX_PARALLEL = 256


# Where an image goes in a vision request's text, from the HTTP edge to the engine: libmtmd's own
# default marker. The edge refuses it in a request's text, so each one is an image (issue 12).
IMAGE_MARKER = "<__media__>"
# The most images one request may carry: each is decoded, encoded and held as embeddings while
# the request is evaluated; tiny ones would otherwise fit the request body by the thousand.
MAX_IMAGES = 32


class KvPolicy(enum.StrEnum):
    """What happens to the KV cache when a model releases the GPU."""

    HOST = "host"  # saved to host memory and restored: no re-prefill
    DEVICE = "device"  # left on the device (in-place backend only)
    DROP = "drop"  # discarded: the next request re-processes its prompt


class Residency(enum.StrEnum):
    """Which residency backend a worker uses (engine.select_backend)."""

    AUTO = "auto"  # in-place when the engine has it, else reload
    IN_PLACE = "in-place"  # in-place or the worker does not start
    RELOAD = "reload"  # always reload (e.g. to compare, or to free the host copy on release)


class SplitMode(enum.StrEnum):
    """How llama.cpp splits a model over several devices (its LLAMA_SPLIT_MODE_*)."""

    LAYER = "layer"  # whole layers (and their KV) to each device, in turn
    ROW = "row"  # each matrix's rows over the devices
    TENSOR = "tensor"  # tensor parallelism: every layer on every device


@dataclass(frozen=True)
class ModelSpec:
    """How to load one model. Cold and warm contexts are built from the same spec, so their
    params are identical (a KV state does not restore into a context with other params)."""

    name: str
    path: Path
    n_ctx: int = 4096
    n_gpu_layers: int = -1
    n_threads: int | None = None  # None: every CPU this process may run on
    parallel: int = 1  # sequences decoded together (the config's default is DEFAULT_PARALLEL)
    chat_format: str | None = None
    seed: int = 0
    residency: Residency = Residency.AUTO
    # Serves embeddings and nothing else: the config's `embedding`, else what the GGUF says
    # (arbiterd.daemon.models.modelfile), decided by the daemon before the worker starts.
    embedding: bool = False
    host_copy: bool = True  # keep the GGUF in a memfd: restores read nothing from disk
    # A memfd the daemon filled and passed down (one per file, shared by its workers); None:
    # the worker makes its own copy when host_copy is set.
    host_copy_fd: int | None = None
    # A vision model's projector GGUF (issue 12); None: the model takes no images.
    mmproj: Path | None = None
    # Keep the projector loaded while warm; False: load it for each encode, free it right after.
    encoder_resident: bool = False
    # Chat requests may offer tools (issue 30); False: the config's tools = "refuse".
    tools: bool = True
    # The config's chat_template (or chat_template_file's text), checked at config load; it
    # replaces the GGUF's own. None: the GGUF's (or chat_format's).
    chat_template: str | None = None
    # Weights the CPU holds may be repacked at load into its faster layouts (ggml's extra buffer
    # types: Q4_0, IQ4_NL, ... on AVX2 or NEON); those are then the worker's own memory, not
    # the host copy's pages (issue 28). False: every CPU weight is mapped from the copy.
    repack: bool = True
    # Where its layers go (issue 27): device ids (arbiterd.paths.parse_device_id) in the order
    # llama.cpp fills them; "gpu0" on an engine without a GPU means the CPU, as before devices.
    devices: tuple[str, ...] = ("gpu0",)
    split_mode: SplitMode = SplitMode.LAYER  # how llama.cpp splits over several devices
    tensor_split: tuple[float, ...] = ()  # each device's share; () = by free memory


def kind_refusal(model: str, kind: RequestKind, embedding: bool) -> str:
    """Why `model` cannot serve a request of `kind`, as one line for the client; "" when it
    can. `embedding`: the model is an embedding model, which serves EMBEDDING requests only
    (every other model serves CHAT and COMPLETION ones)."""
    if embedding and kind is not RequestKind.EMBEDDING:
        wanted = "chat completions" if kind is RequestKind.CHAT else "completions"
        return f"{model!r} is an embedding model: it makes embeddings, not {wanted}"
    if not embedding and kind is RequestKind.EMBEDDING:
        return (
            f"{model!r} is not an embedding model: it makes chat completions and completions, "
            "not embeddings"
        )
    return ""


class Capability(enum.StrEnum):
    """What a model can be asked for, as /v1/models, /api/tags, /api/show and status name it."""

    CHAT = "chat"  # it has a chat template (its GGUF's, a chat_format or the config's)
    COMPLETION = "completion"  # every generative model completes a prompt
    TOOLS = "tools"  # chat requests may offer tools (unless tools = "refuse")
    VISION = "vision"  # its config names a projector (mmproj)
    EMBEDDING = "embedding"  # an embedding model, which serves nothing else
    FIM = "fim"  # its GGUF names fill-in-the-middle tokens: a completion may have a suffix


@dataclass(frozen=True)
class ModelInfo:
    """What a model's GGUF says of it, as its worker read it: the architecture, the context it
    was trained for (0: not said) and the chat template chats are rendered with ("": none)."""

    architecture: str
    trained_context: int
    chat_template: str


def capabilities(
    spec: ModelSpec, *, has_chat_template: bool, has_fim: bool = False
) -> tuple[Capability, ...]:
    """What the model `spec` describes can do, `has_chat_template` saying whether its GGUF has
    a chat template: an embedding model only embeds; any other completes, chats when it has a
    template (the GGUF's, a chat_format or the config's), takes tools with chat unless its
    config refuses them (a template without a place for them gets them in the system turn,
    arbiterd/chattemplate.py), and images when a projector is named; it fills in the middle when
    its GGUF names the tokens for it (`has_fim`)."""
    if spec.embedding:
        return (Capability.EMBEDDING,)
    chat = has_chat_template or spec.chat_format is not None or spec.chat_template is not None
    found = [Capability.COMPLETION]
    if chat:
        found.append(Capability.CHAT)
        if spec.tools:
            found.append(Capability.TOOLS)
        if spec.mmproj is not None:
            found.append(Capability.VISION)
    if has_fim:
        found.append(Capability.FIM)
    return tuple(found)


# [daemon]'s turn defaults (issue 43, docs/scheduling.md says how they were chosen).
SWITCH_OVERHEAD = 0.1
MIN_TURN_S = 0.5
MAX_TURN_S = 5.0
# Per class, in Priority's order: interactive, normal, batch.
MAX_WAIT_S = (5.0, 30.0, 60.0)


@dataclass(frozen=True)
class Turns:
    """How long a wanted model keeps the GPU for the requests queued for it (issue 43): a
    quantum sized so that handoffs take at most `switch_overhead` of the time, within
    [min_turn_s, max_turn_s], ended early once a waiter has waited `max_wait_s` of its class
    (indexed by Priority.rank). config/daemontable.py checks the values; the worker applies them
    (worker/policy.py)."""

    switch_overhead: float = SWITCH_OVERHEAD
    min_turn_s: float = MIN_TURN_S
    max_turn_s: float = MAX_TURN_S
    max_wait_s: tuple[float, ...] = MAX_WAIT_S

    def bound_s(self, priority: Priority) -> float:
        """How long a waiter of `priority` may wait before the holder's turn ends for it."""
        return self.max_wait_s[priority.rank]

    def to_json(self) -> dict[str, object]:
        return {
            "switch_overhead": self.switch_overhead,
            "min_turn_s": self.min_turn_s,
            "max_turn_s": self.max_turn_s,
            "max_wait_s": {p.value: self.bound_s(p) for p in Priority},
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Turns:
        return cls(
            switch_overhead=float(raw["switch_overhead"]),
            min_turn_s=float(raw["min_turn_s"]),
            max_turn_s=float(raw["max_turn_s"]),
            max_wait_s=tuple(float(raw["max_wait_s"][p.value]) for p in Priority),
        )


DEFAULT_TURNS = Turns()


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, passed as JSON on its command line."""

    spec: ModelSpec
    arena: Path
    kv_on_release: KvPolicy = KvPolicy.HOST
    min_hold_s: float = 0.1
    idle_release_s: float = 0.0  # 0: release only when wanted
    priority: Priority = Priority.NORMAL  # its class in the GPU queue, unless a request says
    preemptible: bool = True  # a generation pauses at a token boundary for a higher class
    # Where an `unload` saves the prompt cache and a new worker restores it from (issue 14,
    # worker/kvfile.py); None: unloading saves nothing.
    kv_file: Path | None = None
    # (size, mtime_ns) of the version of the model file that host_copy_fd holds, which keys
    # the state file; None: the worker reads the file itself, and stats it.
    model_version: tuple[int, int] | None = None
    # The [groups] table it belongs to: it goes warm through that group's gate
    # (arbiterd/arena/groups.py) instead of taking the arena's token itself; "" = none.
    group: str = ""
    # [daemon] vram_budget: the device bytes the model may reach with its vision projector
    # loaded beside it; more, and its weights leave while the projector encodes (issue 12).
    # 0: the device's measured free memory decides, where the engine can tell.
    vram_budget: int = 0
    # [daemon]'s turns: how long this model keeps the GPU for its queue when wanted.
    turns: Turns = DEFAULT_TURNS

    def to_json(self) -> str:
        spec = dataclasses.asdict(self.spec)
        spec["path"] = str(self.spec.path)
        spec["mmproj"] = None if self.spec.mmproj is None else str(self.spec.mmproj)
        return json.dumps(
            {
                "spec": spec,
                "arena": str(self.arena),
                "kv_on_release": self.kv_on_release.value,
                "min_hold_s": self.min_hold_s,
                "idle_release_s": self.idle_release_s,
                "priority": self.priority.value,
                "preemptible": self.preemptible,
                "kv_file": None if self.kv_file is None else str(self.kv_file),
                "model_version": None if self.model_version is None else list(self.model_version),
                "group": self.group,
                "vram_budget": self.vram_budget,
                "turns": self.turns.to_json(),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        raw = json.loads(text)
        version = raw.get("model_version")
        spec = dict(raw["spec"])
        spec["path"] = Path(spec["path"])
        spec["mmproj"] = None if spec.get("mmproj") is None else Path(spec["mmproj"])
        spec["residency"] = Residency(spec.get("residency", Residency.AUTO))
        spec["devices"] = tuple(spec.get("devices", ("gpu0",)))
        spec["split_mode"] = SplitMode(spec.get("split_mode", SplitMode.LAYER))
        spec["tensor_split"] = tuple(float(share) for share in spec.get("tensor_split", ()))
        return cls(
            spec=ModelSpec(**spec),
            arena=Path(raw["arena"]),
            kv_on_release=KvPolicy(raw["kv_on_release"]),
            min_hold_s=float(raw["min_hold_s"]),
            idle_release_s=float(raw["idle_release_s"]),
            priority=Priority(raw.get("priority", Priority.NORMAL)),
            preemptible=bool(raw.get("preemptible", True)),
            kv_file=None if raw.get("kv_file") is None else Path(raw["kv_file"]),
            model_version=None if version is None else (int(version[0]), int(version[1])),
            group=str(raw.get("group", "")),
            vram_budget=int(raw.get("vram_budget", 0)),
            turns=Turns.from_json(raw["turns"]) if "turns" in raw else Turns(),
        )
