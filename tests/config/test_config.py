"""config.toml: every key, its default, the flags that override it, and each error's message."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from arbiterd.cli.discovery import FoundModel
from arbiterd.cli.starter import starter_config_text
from arbiterd.config import (
    DEFAULT_MAX_IMAGE_BYTES,
    Config,
    Encoder,
    HostCopyMode,
    Load,
    default_config_path,
    load_config,
)
from arbiterd.errors import BadValueError, ConfigError, RuntimeDirError
from arbiterd.spec import MAX_WAIT_S, KvPolicy, Residency, Turns, WorkerConfig
from arbiterd.states import Priority
from arbiterd.tomltable import parse_size

FULL = """\
[daemon]
http = "0.0.0.0:9000"
socket = "run/control.sock"
arena = "/dev/shm/arena"
journal = "~/journal.sqlite3"
api_key = "sk-local-123"
host_ram_budget = "8GiB"
prompt_cache_budget = 1048576
responses_budget = "16MiB"

[models.qwen]
path = "models/qwen.gguf"
aliases = ["gpt-4o-mini", "qwen2.5:7b"]
n_ctx = 8192
n_gpu_layers = 20
n_threads = 6
chat_format = "chatml"
mmproj = ""
embedding = false
kv_on_release = "drop"
residency = "reload"
min_hold_s = 0.5
idle_release_s = 30
strict_api = true
priority = "interactive"
preemptible = false
load = "demand"
unload_after_s = 600
repack = false

[models."llama-3.2_1b"]
path = "/models/llama.gguf"
host_copy = "page-cache"
"""

MINIMAL = '[models.qwen]\npath = "/models/qwen.gguf"\n'


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / "etc" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def assert_daemon_key_refused(
    tmp_path: Path, env: dict[str, str], text: str, key_path: str, expected: str
) -> None:
    """A config whose [daemon] table holds `text` is refused, naming the file, `key_path` and
    what was `expected`."""
    path = write(tmp_path, f"[daemon]\n{text}\n" + MINIMAL)
    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)
    message = str(caught.value)
    assert message.startswith(f"{path}: {key_path}: "), message
    assert expected in message, message


def load_text(tmp_path: Path, env: dict[str, str], text: str) -> Config:
    return load_config(write(tmp_path, text), env=env)


# -- valid files -----------------------------------------------------------------------------


def test_full_file_sets_every_key(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, FULL)
    config = load_config(path, env=env)

    home, etc = Path(env["HOME"]), path.parent
    assert config.source == path
    daemon = config.daemon
    assert (daemon.http_host, daemon.http_port) == ("0.0.0.0", 9000)
    assert daemon.socket == etc / "run/control.sock"  # relative: against the file's directory
    assert daemon.arena == Path("/dev/shm/arena")
    assert daemon.journal == home / "journal.sqlite3"  # ~ expanded
    assert daemon.api_key == "sk-local-123"
    assert daemon.host_ram_budget_bytes == 8 << 30
    assert daemon.prompt_cache_budget_bytes == 1 << 20
    assert daemon.responses_budget_bytes == 16 << 20

    assert list(config.models) == ["qwen", "llama-3.2_1b"]  # the file's order
    qwen = config.models["qwen"]
    assert qwen.name == "qwen"
    assert qwen.path == etc / "models/qwen.gguf"
    assert qwen.aliases == ("gpt-4o-mini", "qwen2.5:7b")
    assert (qwen.n_ctx, qwen.n_gpu_layers, qwen.n_threads) == (8192, 20, 6)
    assert qwen.chat_format == "chatml"
    assert qwen.mmproj is None
    assert qwen.embedding is False
    assert qwen.kv_on_release is KvPolicy.DROP
    assert qwen.min_hold_s == 0.5
    assert qwen.idle_release_s == 30.0
    assert isinstance(qwen.idle_release_s, float)
    assert qwen.strict_api is True
    assert qwen.priority is Priority.INTERACTIVE
    assert qwen.preemptible is False
    assert qwen.load is Load.DEMAND
    assert qwen.unload_after_s == 600.0
    assert qwen.host_copy is HostCopyMode.MEMFD
    assert qwen.repack is False
    assert config.models["llama-3.2_1b"].host_copy is HostCopyMode.PAGE_CACHE


def test_absent_keys_take_their_defaults(tmp_path: Path, env: dict[str, str]) -> None:
    config = load_text(tmp_path, env, MINIMAL)

    run, home = Path(env["XDG_RUNTIME_DIR"]), Path(env["HOME"])
    daemon = config.daemon
    assert (daemon.http_host, daemon.http_port) == ("127.0.0.1", 8642)
    assert daemon.socket == run / "arbiterd/control.sock"
    assert daemon.arena == run / "arbiterd/arena/gpu0"
    assert daemon.journal == home / ".local/state/arbiterd/journal.sqlite3"
    assert daemon.api_key == ""
    assert daemon.host_ram_budget_bytes == 0  # no budget
    assert daemon.prompt_cache_budget_bytes == 4 << 30
    assert daemon.responses_budget_bytes == 64 << 20
    model = config.models["qwen"]
    assert model.path == Path("/models/qwen.gguf")
    assert model.aliases == ()
    # n_ctx: none set, so as its GGUF says (modelfile.model_traits)
    assert (model.n_ctx, model.n_gpu_layers, model.n_threads) == (None, -1, None)
    assert model.chat_format is None
    assert model.mmproj is None
    assert model.embedding is None  # as the GGUF says
    assert model.kv_on_release is KvPolicy.HOST
    assert model.residency is Residency.AUTO
    assert (model.min_hold_s, model.idle_release_s) == (0.1, 0.0)
    assert model.strict_api is False
    assert model.priority is Priority.NORMAL
    assert model.preemptible is True
    assert model.load is Load.START
    assert model.unload_after_s == 0.0
    assert model.host_copy is HostCopyMode.MEMFD
    assert model.repack is True


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ("1048576", 1 << 20),
        ("8GiB", 8 << 30),
        ("8 gib", 8 << 30),
        ("512MiB", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("4GB", 4 * 10**9),
        ("10 KB", 10_000),
        ("7B", 7),
        (4096, 4096),
    ],
)
def test_sizes_take_binary_and_decimal_units(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text", ["", "GiB", "-1GiB", "8 GiBs", "8 PiB", "1e9", "eight", "1.5", -1, True]
)
def test_what_is_not_a_size_is_refused(text: str | int) -> None:
    assert parse_size(text) is None


def test_empty_strings_and_zero_threads_mean_the_default(
    tmp_path: Path, env: dict[str, str]
) -> None:
    text = '[daemon]\nsocket = ""\narena = ""\njournal = ""\n' + MINIMAL
    text += 'n_threads = 0\nchat_format = ""\nmmproj = ""\n'
    config = load_text(tmp_path, env, text)

    assert config.daemon.socket == Path(env["XDG_RUNTIME_DIR"]) / "arbiterd/control.sock"
    model = config.models["qwen"]
    assert (model.n_threads, model.chat_format, model.mmproj) == (None, None, None)


def test_xdg_state_home_and_arbiterd_arena_set_their_defaults(
    tmp_path: Path, env: dict[str, str]
) -> None:
    env |= {"XDG_STATE_HOME": str(tmp_path / "state"), "ARBITERD_ARENA": str(tmp_path / "a")}
    config = load_text(tmp_path, env, MINIMAL)

    assert config.daemon.journal == tmp_path / "state/arbiterd/journal.sqlite3"
    assert config.daemon.arena == tmp_path / "a"


def test_relative_xdg_state_home_is_ignored(tmp_path: Path, env: dict[str, str]) -> None:
    env["XDG_STATE_HOME"] = "state"  # the XDG spec: relative paths here are invalid
    config = load_text(tmp_path, env, MINIMAL)

    assert config.daemon.journal == Path(env["HOME"]) / ".local/state/arbiterd/journal.sqlite3"


def test_bracketed_ipv6_listen_address(tmp_path: Path, env: dict[str, str]) -> None:
    config = load_text(tmp_path, env, '[daemon]\nhttp = "[::1]:8080"\n' + MINIMAL)

    assert (config.daemon.http_host, config.daemon.http_port) == ("::1", 8080)


def test_relative_paths_follow_the_file_not_the_working_directory(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, '[models.qwen]\npath = "qwen.gguf"\n')
    monkeypatch.chdir(tmp_path)

    config = load_config(Path("etc/config.toml"), env=env)

    assert config.source == path
    assert config.models["qwen"].path == path.parent / "qwen.gguf"


def test_missing_model_file_is_not_a_config_error(tmp_path: Path, env: dict[str, str]) -> None:
    config = load_text(tmp_path, env, '[models.qwen]\npath = "/nonexistent/qwen.gguf"\n')

    assert not config.models["qwen"].path.exists()


def test_utf8_bom_is_tolerated(tmp_path: Path, env: dict[str, str]) -> None:
    config = load_text(tmp_path, env, "\ufeff" + MINIMAL)

    assert list(config.models) == ["qwen"]


# -- flags -----------------------------------------------------------------------------------


def test_flags_win_over_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    config = load_config(
        write(tmp_path, FULL),
        http="127.0.0.2:7000",
        socket=tmp_path / "flag.sock",
        arena=tmp_path / "flag-arena",
        env=env,
    )

    daemon = config.daemon
    assert (daemon.http_host, daemon.http_port) == ("127.0.0.2", 7000)
    assert daemon.socket == tmp_path / "flag.sock"
    assert daemon.arena == tmp_path / "flag-arena"
    assert daemon.journal == Path(env["HOME"]) / "journal.sqlite3"  # not overridden


def test_flags_make_the_runtime_dir_unnecessary(tmp_path: Path, env: dict[str, str]) -> None:
    del env["XDG_RUNTIME_DIR"]
    path = write(tmp_path, MINIMAL)

    with pytest.raises(RuntimeDirError, match="XDG_RUNTIME_DIR is not set"):
        load_config(path, env=env)
    config = load_config(path, socket=tmp_path / "s.sock", arena=tmp_path / "arena", env=env)
    assert config.daemon.arena == tmp_path / "arena"


def test_a_bad_file_is_reported_before_a_missing_runtime_dir(
    tmp_path: Path, env: dict[str, str]
) -> None:
    del env["XDG_RUNTIME_DIR"]

    with pytest.raises(ConfigError, match=r"models\.qwen\.n_ctx"):
        load_text(tmp_path, env, MINIMAL + "n_ctx = 0\n")


def test_flags_do_not_excuse_a_bad_key_in_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, '[daemon]\nhttp = "nonsense"\nsocket = 5\n' + MINIMAL)

    with pytest.raises(ConfigError, match=r"daemon\.http"):
        load_config(path, http="127.0.0.1:1", socket=tmp_path / "s", env=env)


@pytest.mark.parametrize("flag", ["localhost", "127.0.0.1:0", "127.0.0.1:http", ":80"])
def test_a_malformed_http_flag_is_a_bad_value(
    tmp_path: Path, env: dict[str, str], flag: str
) -> None:
    with pytest.raises(BadValueError) as caught:
        load_config(write(tmp_path, MINIMAL), http=flag, env=env)

    message = str(caught.value)
    assert message.startswith("--http: expected HOST:PORT with a port from 1 to 65535")
    assert f'"{flag}"' in message


# -- where the file is -----------------------------------------------------------------------


def test_default_path_follows_xdg_config_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert default_config_path({"HOME": str(home)}) == home / ".config/arbiterd/config.toml"
    assert (
        default_config_path({"HOME": str(home), "XDG_CONFIG_HOME": str(tmp_path / "cfg")})
        == tmp_path / "cfg/arbiterd/config.toml"
    )
    # The XDG spec: a relative path in XDG_CONFIG_HOME is invalid and ignored.
    assert (
        default_config_path({"HOME": str(home), "XDG_CONFIG_HOME": "cfg"})
        == home / ".config/arbiterd/config.toml"
    )


def test_the_file_at_the_default_path_is_loaded(tmp_path: Path, env: dict[str, str]) -> None:
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    path = tmp_path / "cfg/arbiterd/config.toml"
    path.parent.mkdir(parents=True)
    path.write_text(MINIMAL)

    config = load_config(env=env)

    assert config.source == path
    assert list(config.models) == ["qwen"]


def test_a_dangling_symlink_at_the_default_path_is_an_error(
    tmp_path: Path, env: dict[str, str]
) -> None:
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    path = tmp_path / "cfg/arbiterd/config.toml"
    path.parent.mkdir(parents=True)
    path.symlink_to(tmp_path / "gone.toml")

    with pytest.raises(ConfigError, match=f"^{path}: no such file$"):
        load_config(env=env)


def test_an_explicit_path_must_exist(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "nope.toml"

    with pytest.raises(ConfigError, match=f"^{path}: no such file$"):
        load_config(path, env=env)


def test_a_directory_is_not_a_config_file(tmp_path: Path, env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=f"^{tmp_path}: expected a TOML file, got a directory"):
        load_config(tmp_path, env=env)


# -- whose file it is (issue 40) ----------------------------------------------------------------

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file away")
REFUSED = "arbiterd applies only a config that nobody else can change"


def make_it_yours(path: Path) -> str:
    return re.escape(f"(make it yours: cp {path} {path}.new && chmod go-w {path}.new && mv ")


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602], ids=oct)
def test_a_config_that_group_or_others_can_write_is_refused_with_chmod_go_w(
    tmp_path: Path, env: dict[str, str], mode: int
) -> None:
    path = write(tmp_path, MINIMAL)
    path.chmod(mode)
    expected = f"{path} has mode {mode:04o}, which lets group or others write it: {REFUSED}"
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)} \\(chmod go-w {path}\\)$"):
        load_config(path, env=env)


@needs_root
def test_a_config_of_another_user_is_refused_with_the_fix(
    tmp_path: Path, env: dict[str, str]
) -> None:
    path = write(tmp_path, MINIMAL)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as refused:
        load_config(path, env=env)
    assert re.match(
        f"^{path} is owned by uid {NOBODY}, not by you \\(uid 0\\): {REFUSED} "
        + make_it_yours(path),
        str(refused.value),
    )


@needs_root
def test_a_config_linked_to_another_users_0666_file_is_refused_naming_the_target(
    tmp_path: Path, env: dict[str, str]
) -> None:
    theirs = write(tmp_path, MINIMAL, name="theirs.toml")
    theirs.chmod(0o666)
    os.chown(theirs, NOBODY, NOBODY)
    path = tmp_path / "cfg" / "config.toml"
    path.parent.mkdir()
    path.symlink_to(theirs)
    with pytest.raises(ConfigError) as refused:
        load_config(path, env=env)
    assert str(refused.value).startswith(
        f"{path} (a link to {theirs}) is owned by uid {NOBODY}, not by you (uid 0): {REFUSED}"
    )


@needs_root
def test_a_link_another_user_made_to_a_config_of_ones_own_is_refused(
    tmp_path: Path, env: dict[str, str]
) -> None:
    mine = write(tmp_path, MINIMAL)
    path = tmp_path / "cfg" / "config.toml"
    path.parent.mkdir()
    path.symlink_to(mine)
    os.lchown(path, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as refused:
        load_config(path, env=env)
    assert re.match(
        f"^the link {path} is owned by uid {NOBODY}, not by you \\(uid 0\\): {REFUSED} "
        + make_it_yours(path),
        str(refused.value),
    )


def test_a_link_to_a_config_of_ones_own_is_read(tmp_path: Path, env: dict[str, str]) -> None:
    mine = write(tmp_path, MINIMAL)
    path = tmp_path / "cfg" / "config.toml"
    path.parent.mkdir()
    path.symlink_to(mine)
    assert list(load_config(path, env=env).models) == ["qwen"]


def test_a_fifo_at_the_config_path_is_refused_without_waiting_for_a_writer(
    tmp_path: Path, env: dict[str, str]
) -> None:
    path = tmp_path / "config.toml"
    os.mkfifo(path, 0o600)
    with pytest.raises(ConfigError, match=f"^{path} is not a regular file: {REFUSED}"):
        load_config(path, env=env)


def test_the_embedded_default_serves_an_instruct_model_first_and_gemma(
    tmp_path: Path, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "empty-config"))

    config = load_config(http="127.0.0.1:9999")

    assert config.source is None
    assert list(config.models) == ["smollm2-135m-instruct", "gemma-3-270m"]
    chat = config.models["smollm2-135m-instruct"]
    assert chat.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert chat.chat_format is None  # its GGUF's own chat template
    gemma = config.models["gemma-3-270m"]
    assert gemma.path.is_file()
    assert gemma.path.suffix == ".gguf"
    assert gemma.chat_format == "gemma"  # its GGUF has no chat template
    assert (gemma.n_ctx, gemma.n_gpu_layers) == (None, -1)
    assert config.daemon.http_port == 9999  # flags apply to the embedded default too
    assert config.daemon.socket == runtime_dir / "arbiterd/control.sock"
    assert config.daemon.arena == runtime_dir / "arbiterd/arena/gpu0"


# -- names and aliases -----------------------------------------------------------------------


def test_a_model_is_found_by_its_name_or_an_alias_with_or_without_the_latest_tag(
    tmp_path: Path, env: dict[str, str]
) -> None:
    config = load_text(tmp_path, env, FULL)

    for asked in ("qwen", "qwen:latest", "gpt-4o-mini", "gpt-4o-mini:latest", "qwen2.5:7b"):
        assert config.resolve(asked) == "qwen", asked
    assert config.resolve("llama-3.2_1b:latest") == "llama-3.2_1b"
    for unknown in ("qwen2.5", "qwen:7b", "gpt-4o", "QWEN", ""):
        assert config.resolve(unknown) is None, unknown


def test_a_model_may_be_named_as_ollama_names_it(tmp_path: Path, env: dict[str, str]) -> None:
    text = '[models."llama3.2:3b"]\npath = "/m.gguf"\n[models."qwen:latest"]\npath = "/q.gguf"\n'
    config = load_text(tmp_path, env, text)

    assert list(config.models) == ["llama3.2:3b", "qwen:latest"]
    assert config.resolve("llama3.2:3b") == "llama3.2:3b"
    assert config.resolve("llama3.2") is None  # another tag: another model, as in Ollama
    assert config.resolve("qwen") == "qwen:latest"


def test_a_tagged_name_and_its_untagged_alias_are_one_name(
    tmp_path: Path, env: dict[str, str]
) -> None:
    text = '[models."qwen:latest"]\npath = "/q.gguf"\naliases = ["qwen"]\n'
    with pytest.raises(ConfigError, match='"qwen" is already the name of'):
        load_text(tmp_path, env, text)


def test_only_the_aliases_changing_keeps_the_same_worker(
    tmp_path: Path, env: dict[str, str]
) -> None:
    old = load_text(tmp_path, env, MINIMAL).models["qwen"]
    realiased = load_text(tmp_path, env, MINIMAL + 'aliases = ["llama3"]\n').models["qwen"]
    resized = load_text(tmp_path, env, MINIMAL + "n_ctx = 8192\n").models["qwen"]

    assert realiased != old
    assert realiased.same_worker(old)
    assert old.same_worker(realiased)
    assert not resized.same_worker(old)


ALIAS_CLASHES = [
    # the models' tables, the alias's key path, what the message says
    pytest.param(
        '[models.a]\npath = "/m"\n[models.b]\npath = "/m"\naliases = ["a"]',
        "models.b.aliases",
        '"a" is already the name of models.a; an alias must differ from every model\'s name '
        "and from every other alias",
        id="another_models_name",
    ),
    pytest.param(
        '[models.a]\npath = "/m"\naliases = ["b"]\n[models.b]\npath = "/m"',
        "models.a.aliases",
        '"b" is already the name of models.b',
        id="a_later_models_name",
    ),
    pytest.param(
        '[models.a]\npath = "/m"\naliases = ["a"]',
        "models.a.aliases",
        '"a" is already the name of models.a',
        id="its_own_name",
    ),
    pytest.param(
        '[models.a]\npath = "/m"\naliases = ["llama3"]\n'
        '[models.b]\npath = "/m"\naliases = ["x", "llama3"]',
        "models.b.aliases",
        '"llama3" is already an alias of models.a',
        id="another_models_alias",
    ),
    pytest.param(
        '[models.a]\npath = "/m"\naliases = ["x", "x"]',
        "models.a.aliases",
        '"x" is already an alias of models.a',
        id="listed_twice",
    ),
    pytest.param(
        '[models.a]\npath = "/m"\naliases = ["llama3"]\n'
        '[models.b]\npath = "/m"\naliases = ["llama3:latest"]',
        "models.b.aliases",
        '"llama3:latest" is already an alias of models.a (as "llama3": a name without a tag '
        "is the same name with :latest, as in Ollama)",
        id="the_latest_tag",
    ),
    pytest.param(
        '[models.a]\npath = "/m"\n[models.b]\npath = "/m"\naliases = ["a:latest"]',
        "models.b.aliases",
        '"a:latest" is already the name of models.a (as "a": ',
        id="a_name_with_the_latest_tag",
    ),
    pytest.param(
        '[models."qwen2.5"]\npath = "/m"\n[models.b]\npath = "/m"\naliases = ["qwen2.5"]',
        "models.b.aliases",
        '"qwen2.5" is already the name of models."qwen2.5"',
        id="a_quoted_name",
    ),
]


@pytest.mark.parametrize(("text", "key_path", "expected"), ALIAS_CLASHES)
def test_an_alias_names_one_model_and_a_clash_names_both(
    tmp_path: Path, env: dict[str, str], text: str, key_path: str, expected: str
) -> None:
    path = write(tmp_path, text + "\n")

    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)

    message = str(caught.value)
    assert message.startswith(f"{path}: {key_path}: "), message
    assert expected in message, message


# -- what the worker gets --------------------------------------------------------------------


def test_worker_config_carries_the_model(tmp_path: Path, env: dict[str, str]) -> None:
    model = load_text(tmp_path, env, FULL).models["qwen"]

    worker = model.worker_config(
        tmp_path / "arena",
        host_copy_fd=7,
        embedding=True,
        n_ctx=6000,
        kv_file=tmp_path / "qwen.kv",
        model_version=(1234, 5678),
        vram_budget=22 << 30,
        turns=Turns(0.2, 1.0, 3.0, (4.0, 9.0, 90.0)),
    )

    spec = worker.spec
    assert (spec.name, spec.path, spec.n_ctx) == ("qwen", model.path, 6000)
    assert (spec.n_gpu_layers, spec.n_threads, spec.chat_format) == (20, 6, "chatml")
    assert spec.host_copy
    assert spec.host_copy_fd == 7
    assert spec.embedding  # as the daemon decided, whatever the config said (n_ctx too)
    assert worker.arena == tmp_path / "arena"
    assert worker.kv_on_release is KvPolicy.DROP
    assert spec.residency is Residency.RELOAD
    assert (worker.min_hold_s, worker.idle_release_s) == (0.5, 30.0)
    assert worker.kv_file == tmp_path / "qwen.kv"
    assert worker.model_version == (1234, 5678)
    assert worker.vram_budget == 22 << 30  # [daemon] vram_budget, for a projector's path
    assert worker.turns == Turns(0.2, 1.0, 3.0, (4.0, 9.0, 90.0))  # [daemon]'s, to each worker
    assert WorkerConfig.from_json(worker.to_json()) == worker


def test_a_page_cache_model_loads_its_file_itself(tmp_path: Path, env: dict[str, str]) -> None:
    model = load_text(tmp_path, env, MINIMAL + 'host_copy = "page-cache"\n').models["qwen"]
    spec = model.worker_config(tmp_path / "arena", None, embedding=False, n_ctx=2048).spec
    assert (spec.host_copy, spec.host_copy_fd) == (False, None)  # no memfd, not even its own


def test_a_vision_model_names_its_projector_and_encoder(
    tmp_path: Path, env: dict[str, str]
) -> None:
    text = MINIMAL + 'mmproj = "~/mmproj.gguf"\nencoder = "resident"\nallow_image_urls = true\n'
    model = load_text(tmp_path, env, text).models["qwen"]
    assert model.mmproj == Path(env["HOME"]) / "mmproj.gguf"
    assert model.encoder is Encoder.RESIDENT
    assert model.allow_image_urls is True
    assert model.max_image_bytes == DEFAULT_MAX_IMAGE_BYTES
    spec = model.worker_config(tmp_path / "arena", embedding=False, n_ctx=2048).spec
    assert (spec.mmproj, spec.encoder_resident) == (model.mmproj, True)


def test_the_encoder_is_just_in_time_unless_the_config_says(
    tmp_path: Path, env: dict[str, str]
) -> None:
    model = load_text(tmp_path, env, MINIMAL).models["qwen"]
    assert (model.mmproj, model.encoder, model.allow_image_urls) == (None, Encoder.JIT, False)


# -- errors ----------------------------------------------------------------------------------

M = '[models.qwen]\npath = "/m/q.gguf"\n'  # a valid model table to add a bad key to

ERRORS = [
    # file text, key path, what the message says was expected or found
    pytest.param(
        M + 'n_ctx = "4k"',
        "models.qwen.n_ctx",
        'expected a positive integer (tokens, at most 2147483647), got "4k"',
        id="n_ctx_text",
    ),
    pytest.param(
        M + "n_ctx = 0", "models.qwen.n_ctx", "expected a positive integer", id="n_ctx_zero"
    ),
    pytest.param(M + "n_ctx = -1", "models.qwen.n_ctx", "got -1", id="n_ctx_negative"),
    pytest.param(
        M + "n_ctx = 4294967296", "models.qwen.n_ctx", "at most 2147483647", id="n_ctx_huge"
    ),
    pytest.param(
        M + "n_ctx = true",
        "models.qwen.n_ctx",
        "expected a positive integer (tokens, at most 2147483647), got true",
        id="n_ctx_bool",
    ),
    pytest.param(M + "n_ctx = 4096.0", "models.qwen.n_ctx", "got 4096.0", id="n_ctx_float"),
    pytest.param(
        M + "n_gpu_layers = -2",
        "models.qwen.n_gpu_layers",
        "expected an integer >= -1 (-1 = every layer), got -2",
        id="n_gpu_layers_below",
    ),
    pytest.param(
        M + "n_gpu_layers = false", "models.qwen.n_gpu_layers", "got false", id="n_gpu_layers_bool"
    ),
    pytest.param(
        M + "n_threads = -4",
        "models.qwen.n_threads",
        "expected a non-negative integer (0 = every CPU), got -4",
        id="n_threads_negative",
    ),
    pytest.param(
        M + "parallel = 0",
        "models.qwen.parallel",
        "expected an integer from 1 to 256 (requests decoded together), got 0",
        id="parallel_zero",
    ),
    pytest.param(M + 'parallel = "4"', "models.qwen.parallel", 'got "4"', id="parallel_string"),
    pytest.param(
        M + 'n_threads = "auto"', "models.qwen.n_threads", 'got "auto"', id="n_threads_text"
    ),
    pytest.param(
        M + 'kv_on_release = "gpu"',
        "models.qwen.kv_on_release",
        'expected one of "host", "device", "drop", got "gpu"',
        id="kv_policy",
    ),
    pytest.param(
        M + 'kv_on_release = "HOST"', "models.qwen.kv_on_release", 'got "HOST"', id="kv_policy_case"
    ),
    pytest.param(
        M + 'load = "lazy"',
        "models.qwen.load",
        'expected one of "start", "demand", got "lazy"',
        id="load",
    ),
    pytest.param(
        M + 'host_copy = "mmap"',
        "models.qwen.host_copy",
        'expected one of "memfd", "page-cache", got "mmap"',
        id="host_copy",
    ),
    pytest.param(
        '[daemon]\nhost_ram_budget = "8 gigs"\n' + M,
        "daemon.host_ram_budget",
        'expected a number of bytes, or a size such as "22GiB" or "512MB", got "8 gigs"',
        id="host_ram_budget_text",
    ),
    pytest.param(
        "[daemon]\nprompt_cache_budget = -1\n" + M,
        "daemon.prompt_cache_budget",
        "got -1",
        id="prompt_cache_budget_negative",
    ),
    pytest.param(
        '[daemon]\nresponses_budget = "lots"\n' + M,
        "daemon.responses_budget",
        'expected a number of bytes, or a size such as "22GiB" or "512MB", got "lots"',
        id="responses_budget_text",
    ),
    pytest.param(
        M + "unload_after_s = -1",
        "models.qwen.unload_after_s",
        "expected a non-negative number of seconds (0 = never), got -1",
        id="unload_after_negative",
    ),
    pytest.param(
        M + 'residency = "inplace"',
        "models.qwen.residency",
        'expected one of "auto", "in-place", "reload", got "inplace"',
        id="residency",
    ),
    pytest.param(
        M + "min_hold_s = -0.1",
        "models.qwen.min_hold_s",
        "expected a non-negative number of seconds, got -0.1",
        id="min_hold_negative",
    ),
    pytest.param(M + 'min_hold_s = "1s"', "models.qwen.min_hold_s", 'got "1s"', id="min_hold_text"),
    pytest.param(M + "min_hold_s = true", "models.qwen.min_hold_s", "got true", id="min_hold_bool"),
    pytest.param(M + "min_hold_s = nan", "models.qwen.min_hold_s", "got nan", id="min_hold_nan"),
    pytest.param(
        M + "idle_release_s = -1",
        "models.qwen.idle_release_s",
        "expected a non-negative number of seconds (0 = only when wanted), got -1",
        id="idle_negative",
    ),
    pytest.param(
        M + "idle_release_s = inf", "models.qwen.idle_release_s", "got inf", id="idle_inf"
    ),
    pytest.param(
        M + "chat_format = 1",
        "models.qwen.chat_format",
        'expected a chat format name such as "chatml"',
        id="chat_format_type",
    ),
    pytest.param(
        M + "mmproj = false",
        "models.qwen.mmproj",
        'expected a path (a string; "" = the default), got false',
        id="mmproj_type",
    ),
    pytest.param(
        M + 'embedding = "yes"',
        "models.qwen.embedding",
        'expected true or false (leave it out: as the GGUF says), got "yes"',
        id="embedding_type",
    ),
    pytest.param(
        "[models.qwen]\nn_ctx = 8",
        "models.qwen.path",
        "expected the GGUF file's path, a non-empty string, got nothing (it is required)",
        id="path_missing",
    ),
    pytest.param(
        '[models.qwen]\npath = ""',
        "models.qwen.path",
        'expected the GGUF file\'s path, a non-empty string, got ""',
        id="path_empty",
    ),
    pytest.param("[models.qwen]\npath = 42", "models.qwen.path", "got 42", id="path_number"),
    pytest.param(
        M + 'priority = "urgent"',
        "models.qwen.priority",
        'expected one of interactive, normal, batch, got "urgent"',
        id="priority_unknown",
    ),
    pytest.param(
        M + 'strict_api = "yes"',
        "models.qwen.strict_api",
        'expected true or false, got "yes"',
        id="strict_api_not_a_boolean",
    ),
    pytest.param(
        M + "repack = 1",
        "models.qwen.repack",
        "expected true or false, got 1",
        id="repack_not_a_boolean",
    ),
    pytest.param(
        '[models.qwen]\npath = ["a"]', "models.qwen.path", "got an array", id="path_array"
    ),
    pytest.param(
        '[models.qwen]\npath = "a\\u0000b"', "models.qwen.path", 'got "a\\u0000b"', id="path_nul"
    ),
    pytest.param(
        M + "n_ctxx = 8",
        "models.qwen.n_ctxx",
        "unknown key; expected one of: path, aliases, n_ctx, n_gpu_layers, n_threads, "
        "parallel, chat_format, mmproj, embedding, kv_on_release, residency, min_hold_s, "
        "idle_release_s, priority, preemptible, strict_api, load, unload_after_s, max_queue_s, "
        "host_copy, repack, encoder, max_image_bytes, max_image_pixels, allow_image_urls, "
        "tools, chat_template, chat_template_file, devices, split_mode, tensor_split "
        "(did you mean n_ctx?)",
        id="unknown_model_key",
    ),
    pytest.param(
        M + "[models.qwen.extra]",
        "models.qwen.extra",
        "unknown table; expected one of: path, aliases, n_ctx",
        id="unknown_model_table",
    ),
    pytest.param(
        '[models.qwen2.5]\npath = "/m/q.gguf"',
        "models.qwen2.5",
        'a model name with a dot must be quoted: [models."qwen2.5"]',
        id="dotted_model_name",
    ),
    pytest.param(
        "[daemon]\nport = 80\n" + M,
        "daemon.port",
        "unknown key; expected one of: http, socket, arena, journal, api_key",
        id="unknown_daemon_key",
    ),
    pytest.param(
        '[server]\nhttp = "a:1"\n' + M,
        "server",
        "unknown table; expected one of: daemon, models, groups",
        id="unknown_table",
    ),
    pytest.param(
        'http = "127.0.0.1:1"\n' + M,
        "http",
        "unknown key; expected one of: daemon, models, groups, yield, devices "
        "(it belongs in the [daemon] table)",
        id="daemon_key_at_top",
    ),
    pytest.param(
        'path = "/m/q.gguf"\n' + M,
        "path",
        "(it belongs in a [models.NAME] table)",
        id="model_key_at_top",
    ),
    pytest.param(
        "daemon = 3\n" + M, "daemon", "expected a table ([daemon]), got 3", id="daemon_not_table"
    ),
    pytest.param(
        '[daemon]\nhttp = "localhost"\n' + M,
        "daemon.http",
        'expected HOST:PORT with a port from 1 to 65535, e.g. "127.0.0.1:8642", got "localhost"',
        id="http_no_port",
    ),
    pytest.param(
        '[daemon]\nhttp = "127.0.0.1:0"\n' + M,
        "daemon.http",
        'got "127.0.0.1:0"',
        id="http_port_zero",
    ),
    pytest.param(
        '[daemon]\nhttp = "127.0.0.1:65536"\n' + M,
        "daemon.http",
        "a port from 1 to 65535",
        id="http_port_high",
    ),
    pytest.param('[daemon]\nhttp = ":8642"\n' + M, "daemon.http", 'got ":8642"', id="http_no_host"),
    pytest.param(
        '[daemon]\nhttp = "::1:8642"\n' + M, "daemon.http", 'got "::1:8642"', id="http_bare_ipv6"
    ),
    pytest.param("[daemon]\nhttp = 8642\n" + M, "daemon.http", "got 8642", id="http_number"),
    pytest.param(
        "[daemon]\nsocket = 5\n" + M, "daemon.socket", "expected a path", id="socket_type"
    ),
    pytest.param("[daemon]\narena = true\n" + M, "daemon.arena", "got true", id="arena_type"),
    pytest.param(
        "[daemon]\njournal = []\n" + M, "daemon.journal", "got an array", id="journal_type"
    ),
    pytest.param(
        "[daemon]\napi_key = 1234\n" + M,
        "daemon.api_key",
        'expected printable ASCII without spaces (a bearer token; "" = none), got an integer',
        id="api_key_type",
    ),
    pytest.param(
        "[daemon]\n",
        "models",
        "expected at least one [models.NAME] table with a path",
        id="no_models",
    ),
    pytest.param("[models]\n", "models", "got none", id="empty_models"),
    pytest.param("models = 3\n", "models", "got 3", id="models_not_table"),
    pytest.param(
        "[models]\nqwen = 3\n",
        "models.qwen",
        'expected a table ([models.NAME] with path = "..."), got 3',
        id="model_not_table",
    ),
    pytest.param(
        '[models."a b"]\npath = "/m"',
        'models."a b"',
        "expected a name of 1 to 64 characters from A-Z a-z 0-9 . _ -, with an optional :TAG "
        'as Ollama names models (e.g. "llama3.2:3b") (it appears in URLs), got "a b"',
        id="name_space",
    ),
    pytest.param(
        '[models."library/llama3.2:3b"]\npath = "/m"',
        'models."library/llama3.2:3b"',
        'got "library/llama3.2:3b"',
        id="name_slash",
    ),
    pytest.param(
        '[models."a:b:c"]\npath = "/m"', 'models."a:b:c"', 'got "a:b:c"', id="name_two_tags"
    ),
    pytest.param(
        '[models."..:7b"]\npath = "/m"', 'models."..:7b"', 'got "..:7b"', id="name_dotdot_tag"
    ),
    pytest.param('[models.""]\npath = "/m"', 'models.""', 'got ""', id="name_empty"),
    pytest.param(
        f'[models.{"x" * 65}]\npath = "/m"',
        f"models.{'x' * 65}",
        "1 to 64 characters",
        id="name_long",
    ),
    pytest.param('[models.".."]\npath = "/m"', 'models.".."', 'got ".."', id="name_dotdot"),
    pytest.param('[models."qwén"]\npath = "/m"', 'models."qwén"', 'got "qwén"', id="name_unicode"),
    pytest.param(
        M + 'aliases = "llama3"',
        "models.qwen.aliases",
        'expected an array of aliases, e.g. ["gpt-4o-mini", "qwen2.5:7b"], got "llama3"',
        id="aliases_not_array",
    ),
    pytest.param(
        M + 'aliases = ["gpt 4"]',
        "models.qwen.aliases",
        "expected an alias of 1 to 64 characters from A-Z a-z 0-9 . _ -, with an optional :TAG "
        'as Ollama names models (e.g. "qwen2.5:7b"), got "gpt 4"',
        id="alias_space",
    ),
    pytest.param(M + "aliases = [3]", "models.qwen.aliases", "got 3", id="alias_number"),
    pytest.param(M + 'aliases = [""]', "models.qwen.aliases", 'got ""', id="alias_empty"),
    pytest.param(
        M + 'aliases = ["a:b:c"]', "models.qwen.aliases", 'got "a:b:c"', id="alias_two_tags"
    ),
    pytest.param(M + 'aliases = [":7b"]', "models.qwen.aliases", 'got ":7b"', id="alias_no_name"),
    pytest.param(
        M + 'aliases = ["qwen:"]', "models.qwen.aliases", 'got "qwen:"', id="alias_no_tag"
    ),
    pytest.param(M + 'aliases = [".."]', "models.qwen.aliases", 'got ".."', id="alias_dotdot"),
    pytest.param(M + f'aliases = ["{"x" * 62}:7b"]', "models.qwen.aliases", "got", id="alias_long"),
    pytest.param(
        M + '[groups.g]\nmodels = ["qwen"]\n', "groups.g.models", "two or more", id="group_of_one"
    ),
    pytest.param(
        M + '[groups.g]\nmodels = ["qwen", "nope"]\n',
        "groups.g.models",
        '"nope" is no model (models: qwen)',
        id="group_unknown_model",
    ),
    pytest.param(M + "[groups.g]\n", "groups.g.models", "two or more", id="group_without_models"),
    pytest.param(
        M + '[groups.g]\nmodels = ["qwen", "qwen"]\n',
        "groups.g.models",
        "already in this group",
        id="group_twice",
    ),
    pytest.param(
        M
        + '[models.r]\npath = "/m/r.gguf"\n'
        + '[groups.g]\nmodels = ["qwen", "r"]\n[groups.h]\nmodels = ["r", "qwen"]\n',
        "groups.h.models",
        "already in groups.g",
        id="two_groups",
    ),
    pytest.param(
        M + '[groups."../x"]\nmodels = []\n', 'groups."../x"', "a name of 1 to 64", id="group_name"
    ),
    pytest.param(
        M + '[groups.g]\nmodels = ["qwen", "qwen"]\nsize = 2\n',
        "groups.g.size",
        "unknown key",
        id="group_key",
    ),
    pytest.param(
        M + '[groups.g]\nmodels = ["qwen"]\npriority = "now"\n',
        "groups.g.models",
        "two or more",
        id="group_checked_in_order",
    ),
    pytest.param(
        '[daemon]\nvram_budget = "lots"\n' + M,
        "daemon.vram_budget",
        'a size such as "22GiB"',
        id="budget_word",
    ),
    pytest.param(
        "[daemon]\nvram_budget = -1\n" + M, "daemon.vram_budget", "got -1", id="budget_negative"
    ),
    pytest.param(
        '[daemon]\nvram_budget = "1.5"\n' + M,
        "daemon.vram_budget",
        "got",
        id="budget_fraction_of_a_byte",
    ),
]


@pytest.mark.parametrize(("text", "key_path", "expected"), ERRORS)
def test_each_error_names_file_key_path_and_expectation(
    tmp_path: Path, env: dict[str, str], text: str, key_path: str, expected: str
) -> None:
    path = write(tmp_path, text + "\n")

    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)

    message = str(caught.value)
    assert message.startswith(f"{path}: {key_path}: "), message
    assert expected in message, message
    assert "\n" not in message


def test_groups_tell_their_members_and_queue_in_their_highest_class(
    tmp_path: Path, env: dict[str, str]
) -> None:
    text = (
        '[daemon]\nvram_budget = "22GiB"\n'
        '[models.a]\npath = "/m/a.gguf"\npriority = "batch"\n'
        '[models.b]\npath = "/m/b.gguf"\npriority = "interactive"\n'
        '[models.c]\npath = "/m/c.gguf"\n'
        '[groups.pair]\nmodels = ["a", "b"]\n'
    )
    config = load_text(tmp_path, env, text)
    (group,) = config.groups.values()
    assert (group.name, group.models, group.priority) == ("pair", ("a", "b"), Priority.INTERACTIVE)
    assert [config.models[n].group for n in "abc"] == ["pair", "pair", ""]
    assert config.models["a"].worker_config(tmp_path, embedding=False, n_ctx=2048).group == "pair"
    assert config.daemon.vram_budget == 22 << 30
    named = load_text(tmp_path, env, text + 'priority = "batch"\n')
    assert named.groups["pair"].priority is Priority.BATCH


def test_joining_a_group_restarts_the_worker(tmp_path: Path, env: dict[str, str]) -> None:
    alone = load_text(
        tmp_path, env, '[models.a]\npath = "/m/a.gguf"\n[models.b]\npath = "/m/b.gguf"\n'
    )
    grouped = load_text(
        tmp_path,
        env,
        '[models.a]\npath = "/m/a.gguf"\n[models.b]\npath = "/m/b.gguf"\n'
        '[groups.g]\nmodels = ["a", "b"]\n',
    )
    assert not grouped.models["a"].same_worker(alone.models["a"])


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("22GiB", 22 << 30),
        ("1.5 GB", 1_500_000_000),
        ("512mib", 512 << 20),
    ],
)
def test_sizes_read_as_bytes(text: int | str, size: int) -> None:
    assert parse_size(text) == size


def test_api_key_errors_do_not_echo_the_key(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, '[daemon]\napi_key = "hunter2 secret"\n' + M)

    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)

    message = str(caught.value)
    assert message.startswith(f"{path}: daemon.api_key: expected printable ASCII without spaces")
    assert "hunter2" not in message


def test_a_toml_syntax_error_gives_line_and_column(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, '[models.qwen]\npath = "/m/q.gguf"\nn_ctx = = 4\n')

    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)

    message = str(caught.value)
    assert message.startswith(f"{path}: expected valid TOML: ")
    assert "(at line 3, column 9)" in message


def test_a_duplicate_table_is_a_syntax_error(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, M + M)

    with pytest.raises(ConfigError, match=r"expected valid TOML: .*line 3"):
        load_config(path, env=env)


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b'[models.qwen]\npath = "/m/\xff.gguf"\n')

    with pytest.raises(ConfigError, match=f"^{path}: expected UTF-8 text .* offset 25$"):
        load_config(path, env=env)


def test_a_directory_in_place_of_the_file_is_named(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "config.toml"
    path.mkdir()
    with pytest.raises(ConfigError, match=f"^{path}: expected a TOML file, got a directory$"):
        load_config(path, env=env)


# -- the starter config ----------------------------------------------------------------------


def found(path: Path, name: str, context_length: int | None = 8192) -> FoundModel:
    """A model as discovery reports it (tests/cli/test_discovery.py finds real ones)."""
    return FoundModel(
        name=name,
        path=path,
        size_bytes=1,
        source="models",
        architecture="llama",
        context_length=context_length,
        chat_template=True,
    )


def test_starter_config_serves_the_models_it_found(tmp_path: Path, env: dict[str, str]) -> None:
    models = [
        found(tmp_path / "Qwen2.5-7B-Instruct-Q4_K_M.gguf", "Qwen2.5-7B-Instruct"),
        found(tmp_path / "blobs/sha256-0a1b", "llama3.2:3b"),
    ]

    text = starter_config_text(models)

    assert '[models."Qwen2.5-7B-Instruct"]' in text
    assert '[models."llama3.2:3b"]' in text
    assert f'path = "{models[0].path}"' in text
    config = load_text(tmp_path, env, text)
    assert list(config.models) == ["Qwen2.5-7B-Instruct", "llama3.2:3b"]
    assert config.models["llama3.2:3b"].path == models[1].path
    assert config.models["llama3.2:3b"].n_ctx == 4096


def test_starter_config_never_sets_n_ctx_above_the_trained_context(
    tmp_path: Path, env: dict[str, str]
) -> None:
    models = [
        found(tmp_path / "a.gguf", "short", context_length=2048),
        found(tmp_path / "b.gguf", "long", context_length=131072),
        found(tmp_path / "c.gguf", "unknown", context_length=None),
    ]
    config = load_text(tmp_path, env, starter_config_text(models))
    assert [m.n_ctx for m in config.models.values()] == [2048, 4096, 4096]


def test_starter_config_quotes_odd_file_names(tmp_path: Path, env: dict[str, str]) -> None:
    models = [
        found(tmp_path / "models/qwen.gguf", "qwen"),
        found(tmp_path / 'odd "n" \\ .gguf', "odd"),
    ]
    config = load_text(tmp_path, env, starter_config_text(models))
    assert [(m.name, m.path) for m in config.models.values()] == [
        ("qwen", models[0].path),
        ("odd", models[1].path),
    ]


def test_models_install_finds_load_on_demand(tmp_path: Path, env: dict[str, str]) -> None:
    config = load_text(tmp_path, env, starter_config_text([found(tmp_path / "a.gguf", "a")]))
    assert config.models["a"].load is Load.DEMAND


def test_starter_config_without_models_shows_an_example() -> None:
    text = starter_config_text([])

    assert "# [models.my-model]" in text
    assert tomllib.loads(text) == {"daemon": {}}


def test_importing_config_loads_no_inference_library() -> None:
    # Every `arbiterd` command imports config, `arbiterd run -- GAME` included.
    code = "import sys, arbiterd.config; print(sorted(m for m in sys.modules if 'llama' in m))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


# -- who the HTTP API serves, and on what -------------------------------------------------------


def test_allow_users_takes_user_names_and_uids(tmp_path: Path, env: dict[str, str]) -> None:
    config = load_text(tmp_path, env, '[daemon]\nallow_users = ["root", 1001]\n' + MINIMAL)
    assert config.daemon.allow_uids == frozenset({0, 1001})
    assert load_text(tmp_path, env, MINIMAL).daemon.allow_uids == frozenset()


def test_allow_origins_are_read_as_browsers_send_origins(
    tmp_path: Path, env: dict[str, str]
) -> None:
    origins = '["http://LocalHost:3000", "tauri://localhost", "https://[::1]:8443"]'
    config = load_text(tmp_path, env, f"[daemon]\nallow_origins = {origins}\n" + MINIMAL)
    assert config.daemon.allow_origins == frozenset(
        {"http://localhost:3000", "tauri://localhost", "https://[::1]:8443"}
    )
    assert load_text(tmp_path, env, MINIMAL).daemon.allow_origins == frozenset()


def test_the_api_socket_is_beside_the_control_socket_unless_set(
    tmp_path: Path, env: dict[str, str]
) -> None:
    run = Path(env["XDG_RUNTIME_DIR"])
    assert load_text(tmp_path, env, MINIMAL).daemon.api_socket == run / "arbiterd/api.sock"
    moved = load_text(tmp_path, env, '[daemon]\nsocket = "/srv/ad/control.sock"\n' + MINIMAL)
    assert moved.daemon.api_socket == Path("/srv/ad/api.sock")
    path = write(tmp_path, '[daemon]\napi_socket = "x/api.sock"\n' + MINIMAL)
    assert load_config(path, env=env).daemon.api_socket == path.parent / "x/api.sock"


def test_the_header_timeout_defaults_to_ten_seconds(tmp_path: Path, env: dict[str, str]) -> None:
    assert load_text(tmp_path, env, MINIMAL).daemon.header_timeout_s == 10.0
    text = "[daemon]\nheader_timeout_s = 2.5\n" + MINIMAL
    assert load_text(tmp_path, env, text).daemon.header_timeout_s == 2.5


def test_the_holder_timeout_defaults_to_thirty_seconds_and_must_be_above_zero(
    tmp_path: Path, env: dict[str, str]
) -> None:
    assert load_text(tmp_path, env, MINIMAL).daemon.holder_timeout_s == 30.0
    text = "[daemon]\nholder_timeout_s = 1.5\n" + MINIMAL
    assert load_text(tmp_path, env, text).daemon.holder_timeout_s == 1.5
    for value, expected in (("0", "above 0, got 0"), ("-1", "non-negative"), ('"30"', "seconds")):
        path = write(tmp_path, f"[daemon]\nholder_timeout_s = {value}\n" + MINIMAL)
        with pytest.raises(ConfigError, match=f"daemon.holder_timeout_s: expected .*{expected}"):
            load_config(path, env=env)


def test_the_daemon_follows_its_config_file_unless_told_not_to(
    tmp_path: Path, env: dict[str, str]
) -> None:
    assert load_text(tmp_path, env, MINIMAL).daemon.watch_config is True
    text = "[daemon]\nwatch_config = false\n" + MINIMAL
    assert load_text(tmp_path, env, text).daemon.watch_config is False
    path = write(tmp_path, '[daemon]\nwatch_config = "no"\n' + MINIMAL)
    with pytest.raises(ConfigError, match=r"daemon\.watch_config: expected true or false"):
        load_config(path, env=env)


@pytest.mark.parametrize(
    "http", ["127.0.0.1:1", "127.0.0.2:1", "localhost:1", "[::1]:1", "[::ffff:127.0.0.1]:1"]
)
def test_a_loopback_address_needs_no_api_key(
    tmp_path: Path, env: dict[str, str], http: str
) -> None:
    assert load_text(tmp_path, env, f'[daemon]\nhttp = "{http}"\n' + MINIMAL).daemon.api_key == ""


@pytest.mark.parametrize("http", ["0.0.0.0:1", "[::]:1", "192.0.2.7:1", "myhost:1"])
def test_any_other_address_needs_an_api_key(tmp_path: Path, env: dict[str, str], http: str) -> None:
    path = write(tmp_path, f'[daemon]\nhttp = "{http}"\n' + MINIMAL)
    host = http.rpartition(":")[0].strip("[]")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)
    message = str(caught.value)
    assert message.startswith(f"{path}: daemon.api_key: expected a key: "), message
    assert f"listen on {host}, which is not a loopback address" in message
    keyed = load_text(tmp_path, env, f'[daemon]\nhttp = "{http}"\napi_key = "k"\n' + MINIMAL)
    assert keyed.daemon.api_key == "k"


def test_the_http_flag_needs_an_api_key_off_loopback_too(
    tmp_path: Path, env: dict[str, str]
) -> None:
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"daemon\.api_key: expected a key: .* on 0\.0\.0\.0"):
        load_config(path, http="0.0.0.0:8642", env=env)


@pytest.mark.parametrize(
    ("text", "key_path", "expected"),
    [
        pytest.param(
            'allow_users = "alice"', "daemon.allow_users", "an array of user names", id="str"
        ),
        pytest.param(
            'allow_users = ["no-such-user-x"]',
            "daemon.allow_users",
            'got "no-such-user-x": no such user',
            id="unknown",
        ),
        pytest.param("allow_users = [-1]", "daemon.allow_users", "got -1", id="negative"),
        pytest.param("allow_users = [true]", "daemon.allow_users", "got true", id="bool"),
        pytest.param("allow_users = [1.5]", "daemon.allow_users", "got 1.5", id="float"),
        pytest.param(
            "header_timeout_s = 0",
            "daemon.header_timeout_s",
            "a number of seconds above 0, got 0",
            id="timeout_zero",
        ),
        pytest.param(
            'header_timeout_s = "10"',
            "daemon.header_timeout_s",
            "a non-negative number of seconds",
            id="timeout_string",
        ),
        pytest.param("api_socket = 5", "daemon.api_socket", "a path", id="api_socket_type"),
        pytest.param(
            'allow_origins = "http://localhost:3000"',
            "daemon.allow_origins",
            "expected an array of web origins, each SCHEME://HOST[:PORT]",
            id="origins_str",
        ),
        pytest.param(
            'allow_origins = ["http://localhost:3000/"]',
            "daemon.allow_origins",
            'without a path or a trailing /, e.g. ["http://localhost:3000"], got '
            '"http://localhost:3000/"',
            id="origin_slash",
        ),
        pytest.param(
            'allow_origins = ["localhost:3000"]',
            "daemon.allow_origins",
            'got "localhost:3000"',
            id="origin_no_scheme",
        ),
        pytest.param("allow_origins = [3000]", "daemon.allow_origins", "got 3000", id="origin_int"),
        pytest.param(
            'allow_origins = ["*"]',
            "daemon.allow_origins",
            'got "*": list each origin; every web page would be one',
            id="origin_any",
        ),
        pytest.param(
            'allow_origins = ["null"]',
            "daemon.allow_origins",
            'got "null": it is the origin of sandboxed and file:// pages',
            id="origin_null",
        ),
    ],
)
def test_http_access_errors_name_the_key(
    tmp_path: Path, env: dict[str, str], text: str, key_path: str, expected: str
) -> None:
    assert_daemon_key_refused(tmp_path, env, text, key_path, expected)


def test_turns_have_defaults_and_take_the_files_values(tmp_path: Path, env: dict[str, str]) -> None:
    assert load_text(tmp_path, env, MINIMAL).daemon.turns == Turns()
    text = (
        "[daemon]\nswitch_overhead = 0.2\nmin_turn_s = 1\nmax_turn_s = 3\n"
        "max_wait_s = { interactive = 4, batch = 90 }\n" + MINIMAL
    )
    turns = load_text(tmp_path, env, text).daemon.turns
    assert turns == Turns(0.2, 1.0, 3.0, (4.0, MAX_WAIT_S[Priority.NORMAL.rank], 90.0))
    assert turns.bound_s(Priority.BATCH) == 90.0


@pytest.mark.parametrize(
    ("text", "key_path", "expected"),
    [
        pytest.param(
            "switch_overhead = 0", "daemon.switch_overhead", "above 0 and below 1", id="share_0"
        ),
        pytest.param(
            "switch_overhead = 1", "daemon.switch_overhead", "above 0 and below 1", id="share_1"
        ),
        pytest.param(
            "switch_overhead = -0.1", "daemon.switch_overhead", "got -0.1", id="share_neg"
        ),
        pytest.param('switch_overhead = "0.1"', "daemon.switch_overhead", "got", id="share_str"),
        pytest.param("switch_overhead = nan", "daemon.switch_overhead", "got nan", id="share_nan"),
        pytest.param("min_turn_s = 0", "daemon.min_turn_s", "above 0, got 0", id="min_zero"),
        pytest.param("min_turn_s = -1", "daemon.min_turn_s", "non-negative", id="min_negative"),
        pytest.param('max_turn_s = "5"', "daemon.max_turn_s", "non-negative", id="max_string"),
        pytest.param(
            "min_turn_s = 2\nmax_turn_s = 1",
            "daemon.max_turn_s",
            "at least min_turn_s (2 s), got 1",
            id="max_below_min",
        ),
        pytest.param(
            "max_wait_s = 5", "daemon.max_wait_s", "a table of seconds by class", id="waits_int"
        ),
        pytest.param(
            "max_wait_s = { urgent = 1 }",
            "daemon.max_wait_s.urgent",
            "expected one of: interactive, normal, batch",
            id="waits_class",
        ),
        pytest.param(
            "max_wait_s = { batch = -3 }",
            "daemon.max_wait_s.batch",
            "non-negative",
            id="wait_negative",
        ),
        pytest.param(
            "max_turn_s = 10\nmax_wait_s = { interactive = 5 }",
            "daemon.max_wait_s.interactive",
            "at least max_turn_s (10 s): a turn may last that long, got 5",
            id="quantum_over_wait",
        ),
    ],
)
def test_turn_errors_name_the_key(
    tmp_path: Path, env: dict[str, str], text: str, key_path: str, expected: str
) -> None:
    assert_daemon_key_refused(tmp_path, env, text, key_path, expected)
