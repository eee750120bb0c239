"""The configuration's records and their defaults: `Config` and the tables it holds
(`DaemonConfig`, `ModelConfig`, `GroupConfig`, `DeviceConfig`, `YieldRules`), the choices a
table may make (`Load`, `HostCopyMode`, `Encoder`, `Tools`), and how a model name is looked up
(`model_key`, `Config.resolve`).

Frozen records, built only by this package's readers (daemontable.py, modeltable.py,
sharing.py, files.py); every process reads them. Reads no file and checks nothing: a record
holds what its reader checked.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path

from arbiterd.paths import (
    DEFAULT_DEVICE,
    DeviceKind,
    parse_device_id,
)
from arbiterd.spec import (
    DEFAULT_PARALLEL,
    DEFAULT_TURNS,
    KvPolicy,
    ModelSpec,
    Residency,
    SplitMode,
    Turns,
    WorkerConfig,
)
from arbiterd.states import Priority

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

# Ollama's tag for a name given without one: "llama3" and "llama3:latest" are one name.
DEFAULT_TAG = "latest"

# What a device's fitting set leaves free by default: room for a desktop's compositor and
# browser to grow into (what they hold now is measured and counted apart).
DEFAULT_DEVICE_RESERVE = 512 << 20

# The group of a device's fitting set (issue 44), in that device's arena: no [groups] table may
# take the name.
FITTING_GROUP = "fitting"

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
    lease: LeaseConfig | None = None  # an rpc: device lent on a lease (issue 46)
    # `uploads = "hashes"`: weights are offered to this RPC server by hash first, down to
    # 64 KiB, so a server with a cache (--cache) is sent what it lacks only (issue 46)
    hash_uploads: bool = False

    @property
    def endpoint(self) -> str | None:
        """HOST:PORT of an RPC server's device, as its workers are given it; None for another."""
        parsed = parse_device_id(self.device)
        return None if parsed.kind is not DeviceKind.RPC else f"{parsed.host}:{parsed.port}"


@dataclass(frozen=True)
class LeaseConfig:
    """`[devices."rpc:HOST:PORT"] lease`: the device is lent by `arbiterd rpc-server --lend`,
    whose lease channel is at `lender`; the borrower proves the key in `key_file`
    (arbiterd/lease/borrower.py). The key is read when the daemon starts the lease."""

    lender: str  # HOST:PORT
    key_file: Path


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
