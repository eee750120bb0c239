"""The commented config.toml that `arbiterd install` writes: every key explained, and each
GGUF it found (cli/discovery.py) as a [models.NAME] table ready to serve, under the name
discovery suggests (an Ollama model's own) and with its n_ctx no more than its trained context.
The keys and defaults are arbiterd/config/'s.
"""

from __future__ import annotations

from arbiterd.cli.discovery import FoundModel
from arbiterd.config import (
    DEFAULT_HTTP,
    HEADER_TIMEOUT_S,
    HOLDER_TIMEOUT_S,
    STARTER_N_CTX,
    YIELD_GRACE_S,
    YIELD_MIN_BYTES,
    YIELD_PROGRAMS,
    Load,
    default_n_ctx,
)
from arbiterd.spec import MAX_TURN_S, MAX_WAIT_S, MIN_TURN_S, SWITCH_OVERHEAD
from arbiterd.states import Priority
from arbiterd.tomltable import toml_key, toml_string


def starter_config_text(models: list[FoundModel]) -> str:
    """A commented config for `arbiterd install`: every key explained, and each of `models` as
    a [models.NAME] table ready to serve (comment a table out to leave that model out)."""
    lines = [
        "# arbiterd configuration, read when the daemon starts and again whenever it is saved",
        "# (as `arbiterd reload` does: a mistake applies nothing; [daemon] keys need a restart).",
        "# Paths may start with ~; relative paths are relative to this file's directory.",
        "",
        "[daemon]",
        f'# http = "{DEFAULT_HTTP}"   # the OpenAI-compatible API, HOST:PORT',
        '# api_key = ""              # a bearer token the HTTP API requires; "" = none',
        '# allow_users = []          # other users the HTTP API serves, e.g. ["alice", 1001];',
        "#                           # by default it serves only you, and others need the key",
        "# allow_origins = []        # web pages that may use the API, e.g.",
        '#                           # ["http://localhost:3000"]; by default none may',
        "# api_socket = PATH  the HTTP API on a Unix socket; default api.sock beside `socket`",
        f"# header_timeout_s = {HEADER_TIMEOUT_S:g}     # a client's time to send a request head",
        f"# holder_timeout_s = {HOLDER_TIMEOUT_S:g}     # a warm model silent this long is said;",
        "#                           # twice as long: killed, so the GPU moves on",
        "# socket = PATH   the control socket; default $XDG_RUNTIME_DIR/arbiterd/control.sock",
        "# arena = DIR     the GPU arena; default $XDG_RUNTIME_DIR/arbiterd/arena/gpu0",
        "# journal = PATH  the handoff history; default $XDG_STATE_HOME/arbiterd/journal.sqlite3",
        '# host_ram_budget = 0       host RAM for file copies and cold KV caches, e.g. "16GiB";',
        "#                           # above it the least recently used cold models unload",
        '# prompt_cache_budget = "4GiB"  disk for unloaded models\' prompt caches, oldest go first',
        '# responses_budget = "64MiB"  memory for past /v1/responses (previous_response_id);',
        "#                           # the oldest go first; 0 keeps none",
        "# watch_config = true       # false: a saved change applies only at `arbiterd reload`",
        f"# switch_overhead = {SWITCH_OVERHEAD:g}     # handoffs' share of the time: a wanted",
        "#                           # model with requests queued keeps the GPU for a turn",
        f"# min_turn_s = {MIN_TURN_S:g}          # a turn lasts at least this long",
        f"# max_turn_s = {MAX_TURN_S:g}            # and at most this long",
        "# max_wait_s = { "
        + ", ".join(f"{p.value} = {MAX_WAIT_S[p.rank]:g}" for p in Priority)
        + " }",
        "#                           # a waiter of the class that waited this long ends a turn",
        "",
        "# [yield]   stepping aside for GPU programs that do not take part (a game, ComfyUI):",
        "#           the models release and the daemon holds the GPU for the program until it",
        "#           exits (docs/stepping-aside.md). Every key optional:",
        "# enabled = true",
        "# programs = [" + ", ".join(toml_string(p) for p in YIELD_PROGRAMS) + "]",
        "#                           # by name, or anywhere in the command line (globs)",
        f'# min_bytes = "{YIELD_MIN_BYTES >> 20}MiB"    # or by the device memory a program holds',
        "# ignore = [...]            # never by memory: the desktop, browsers, Steam's client",
        f"# grace_s = {YIELD_GRACE_S:g}              # back once under min_bytes this long",
        "",
        "# One [models.NAME] table per model; NAME (1-64 of A-Z a-z 0-9 . _ -, and an optional",
        "# :TAG as Ollama names models) is the `model` requests ask for; quote it when it",
        '# contains a dot or a colon: [models."qwen2.5-7b"], [models."llama3.2:3b"]. Keys:',
        '#   path = "/models/x.gguf"   required',
        '#   aliases = []              more names for it, e.g. ["gpt-4o-mini", "qwen2.5:7b"]',
        f"#   n_ctx = {STARTER_N_CTX}              context in tokens, at most as trained",
        "#   n_gpu_layers = -1         layers on the GPU; -1 = all",
        "#   n_threads = 0             CPU threads; 0 = every CPU",
        "#   parallel = 4              requests decoded together, sharing n_ctx's cells",
        '#   chat_format = ""          e.g. "chatml", for a GGUF without a chat template',
        '#   mmproj = ""               a vision model\'s projector GGUF: images in chat',
        '#   encoder = "jit"           the projector on the device only to encode ("resident")',
        "#   max_image_bytes = 5242880, max_image_pixels = 33554432   limits per image",
        "#   allow_image_urls = false  file:// and http(s):// image URLs besides data: URLs",
        "#   embedding = true          serve embeddings only; absent: as the GGUF says",
        '#   kv_on_release = "host"    the KV cache on release: "host", "device" or "drop"',
        '#   residency = "auto"        "in-place" (the arbiterd engine), "reload" or "auto"',
        "#   min_hold_s = 0.1          once warm, hold the GPU this long or until a request ran",
        "#   idle_release_s = 0        release after idling this long; 0 = only when wanted",
        '#   priority = "normal"       its class in the GPU queue: interactive, normal or batch',
        "#   preemptible = true        a generation pauses for a waiter of a higher class",
        "#   strict_api = false        refuse API fields that change nothing here (400)",
        '#   load = "start"            "demand": start its worker at its first request',
        "#   unload_after_s = 0        unload after cold and idle this long; 0 = never",
        '#   host_copy = "memfd"       "page-cache": no copy of the file in RAM (restores may',
        "#                             read the disk; the file must stay there)",
    ]
    tables = model_tables(models)
    lines += tables or ["", "# [models.my-model]", '# path = "~/models/my-model.gguf"']
    return "\n".join(lines) + "\n"


def model_tables(models: list[FoundModel]) -> list[str]:
    """Each of `models` as a [models.NAME] table ready to serve, after a comment saying where
    it was found (the lines of the starter config's models, and of `arbiterd models --toml`);
    no lines when none can be written."""
    lines: list[str] = []
    skipped = 0
    for found in models:
        try:
            path = toml_string(str(found.path.absolute()))
            mmproj = None if found.mmproj is None else toml_string(str(found.mmproj.absolute()))
        except UnicodeEncodeError:  # a non-UTF-8 file name cannot be written in TOML
            skipped += 1
            continue
        lines += ["", f"# {_provenance(found)}", f"[models.{toml_key(found.name)}]"]
        lines.append(f"path = {path}")
        if found.aliases:
            lines.append(f"aliases = [{', '.join(map(toml_string, found.aliases))}]")
        lines.append(f"n_ctx = {starter_n_ctx(found)}")
        if mmproj is not None:
            lines.append(f"mmproj = {mmproj}")
        # Every GGUF found is served, and none takes memory before it is asked for.
        lines.append(f'load = "{Load.DEMAND.value}"')
    if skipped:
        lines += ["", f"# ({skipped} GGUF file(s) left out: their names are not UTF-8)"]
    return lines


def starter_n_ctx(found: FoundModel) -> int:
    """The context the daemon gives the model when its table sets none (config.default_n_ctx),
    written out so that the user sees it and can change it."""
    return default_n_ctx(found.context_length)


def _provenance(found: FoundModel) -> str:
    where = f"Ollama's {found.ollama_name}" if found.ollama_name else found.source
    what = found.architecture or "architecture unknown"
    trained = f", trained for {found.context_length} tokens" if found.context_length else ""
    template = "" if found.chat_template else ", no chat template in its GGUF (set chat_format)"
    return f"from {where}: {what}{trained}{template}"
