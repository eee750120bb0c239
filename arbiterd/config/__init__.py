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
    lease = "HOST:PORT"           # an rpc: device lent by `arbiterd rpc-server --lend` (issue
                                  #   46): its lease channel; the lender may take it back
    lease_key_file = "~/.config/arbiterd/lease.key"   # the key shared with the lender (0600)
    uploads = "bytes"             # an rpc: device: "hashes" offers weights by hash first (a
                                  #   server with --cache, over a slow link); "bytes" sends them
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
expected; nothing is half-applied. This package never opens a model file (daemon/models/modelfile.py
checks them before anything loads) and never creates a file or directory: it only resolves
paths (and the user names in allow_users).

Importing this package must stay cheap: every `arbiterd` command imports it, including
`arbiterd run -- GAME`, which must never load an inference library (arbiterd.spec is plain).

The package, by what each module owns (callers import from `arbiterd.config`, which re-exports
the names below):

    records      the records (`Config` and its tables) and their defaults
    files        where the config comes from: the file or the embedded default, read in order
    daemontable  the [daemon] table: its keys checked, its defaults resolved
    modeltable   the [models.NAME] tables, and the names requests may ask for
    sharing      the [groups.NAME], [devices.ID] and [yield] tables
"""

from __future__ import annotations

from arbiterd.config.daemontable import (
    is_loopback,
)
from arbiterd.config.files import (
    EMBEDDED_CHAT_MODEL_NAME,
    EMBEDDED_MODEL_NAME,
    SMOLLM_FILE,
    configured_models,
    default_config_path,
    embedded_model_path,
    load_config,
    load_daemon_config,
    smollm_model_path,
)
from arbiterd.config.modeltable import (
    MAX_MODEL_NAME_CHARS,
    is_model_name,
)
from arbiterd.config.records import (
    APP_DIR,
    DEFAULT_DEVICE_RESERVE,
    DEFAULT_HTTP,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_TAG,
    FITTING_GROUP,
    HEADER_TIMEOUT_S,
    HOLDER_TIMEOUT_S,
    PROMPT_CACHE_BUDGET_BYTES,
    RESPONSES_BUDGET_BYTES,
    SOCKET_FILE,
    STARTER_N_CTX,
    YIELD_GRACE_S,
    YIELD_MIN_BYTES,
    YIELD_PROGRAMS,
    Config,
    DeviceConfig,
    Encoder,
    GroupConfig,
    HostCopyMode,
    LeaseConfig,
    Load,
    ModelConfig,
    Tools,
    YieldRules,
    default_n_ctx,
    model_key,
)
from arbiterd.config.sharing import (
    GROUP_NAME_EXPECTED,
    GROUP_NAME_RE,
    hashed_servers,
)

__all__ = [
    "APP_DIR",
    "DEFAULT_DEVICE_RESERVE",
    "DEFAULT_HTTP",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_TAG",
    "EMBEDDED_CHAT_MODEL_NAME",
    "EMBEDDED_MODEL_NAME",
    "FITTING_GROUP",
    "GROUP_NAME_EXPECTED",
    "GROUP_NAME_RE",
    "HEADER_TIMEOUT_S",
    "HOLDER_TIMEOUT_S",
    "MAX_MODEL_NAME_CHARS",
    "PROMPT_CACHE_BUDGET_BYTES",
    "RESPONSES_BUDGET_BYTES",
    "SMOLLM_FILE",
    "SOCKET_FILE",
    "STARTER_N_CTX",
    "YIELD_GRACE_S",
    "YIELD_MIN_BYTES",
    "YIELD_PROGRAMS",
    "Config",
    "DeviceConfig",
    "Encoder",
    "GroupConfig",
    "HostCopyMode",
    "LeaseConfig",
    "Load",
    "ModelConfig",
    "Tools",
    "YieldRules",
    "configured_models",
    "default_config_path",
    "default_n_ctx",
    "embedded_model_path",
    "hashed_servers",
    "is_loopback",
    "is_model_name",
    "load_config",
    "load_daemon_config",
    "model_key",
    "smollm_model_path",
]
