"""Finding the GGUFs other tools keep, in a fake home made here: Ollama's store (manifests and
blobs), the Hugging Face cache (snapshots of symlinks), LM Studio's folders and ~/models; and
`arbiterd models` run as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arbiterd.cli.discovery import (
    FoundModel,
    config_name,
    find_models,
    ollama_name,
    training_tag,
)
from arbiterd.cli.starter import starter_config_text
from arbiterd.config import (
    EMBEDDED_CHAT_MODEL_NAME,
    EMBEDDED_MODEL_NAME,
    SMOLLM_FILE,
    load_config,
    smollm_model_path,
)
from arbiterd.render import format_bytes
from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.ollama_store import add_model, model_blob
from tests.support.tiny_gguf import DEFAULT_SPEC, TinyModelSpec, write_tiny_llama

# A model of another seed (so another blob) trained for 1024 tokens, without a chat template.
PLAIN_SPEC = TinyModelSpec(seed=1, n_ctx_train=1024, chat_template="")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "plain.gguf", PLAIN_SPEC)


def found_in(home: Path, **env: str) -> list[FoundModel]:
    discovery = find_models({"HOME": str(home), **env})
    assert discovery.warnings == []
    return discovery.models


def copy(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def hf_snapshot(hub: Path, repo: str, file: str, source: Path, revisions: int = 1) -> Path:
    """`source` in the Hugging Face cache as huggingface_hub leaves a download: a blob named
    by its hash, and a symlink to it in each revision's snapshot."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    blob = copy(source, folder / "blobs" / "0123abcd")
    first = None
    for revision in range(revisions):
        link = folder / "snapshots" / f"rev{revision}" / file
        link.parent.mkdir(parents=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        first = first or link
    assert first is not None
    return first


def test_every_place_is_searched_and_each_file_is_listed_once(
    home: Path, tiny_model: Path, tiny_mmproj: Path, plain_model: Path
) -> None:
    store = home / ".ollama/models"
    llama = add_model(store, "llama3.2:3b", tiny_model)
    add_model(store, "llama3.2:latest", tiny_model)  # another name of the same blob
    add_model(store, "me/plain:q4", plain_model)
    snapshot = hf_snapshot(
        home / ".cache/huggingface/hub", "org/Tiny-GGUF", "tiny-Q8_0.gguf", tiny_model, 2
    )
    studio = copy(plain_model, home / ".lmstudio/models/org/Plain-GGUF/plain-Q4_K_M.gguf")
    copy(tiny_mmproj, studio.with_name("mmproj-plain-f16.gguf"))  # a projector, no model
    older = copy(tiny_model, home / ".cache/lm-studio/models/org/old/old.gguf")
    cached = copy(tiny_model, home / ".cache/llama.cpp/org_tiny.gguf")
    mine = copy(plain_model, home / "models/plain.gguf")
    (home / "models/again.gguf").symlink_to(mine)  # the same file by another name
    shared = home / ".local/share/models"
    shared.mkdir(parents=True)
    (shared / "loop").symlink_to(shared)  # a folder that holds itself is walked once

    models = found_in(home)

    assert [(m.name, m.source, m.path) for m in models] == [
        ("llama3.2:3b", "ollama", model_blob(llama)),
        ("me-plain:q4", "ollama", model_blob(store / "manifests/registry.ollama.ai/me/plain/q4")),
        # general.name, as the GGUF says; then its file's name, once that name is taken
        ("arbiterd-tiny-llama", "huggingface", snapshot),
        ("plain-Q4_K_M", "lm-studio", studio),
        ("old", "lm-studio", older),
        ("org_tiny", "llama.cpp", cached),
        ("plain", "models", mine),
    ]
    assert [m.ollama_name for m in models[:2]] == ["llama3.2:3b", "me/plain:q4"]
    assert [m.aliases for m in models[:2]] == [("llama3.2:latest",), ()]
    assert models[0].size_bytes == tiny_model.stat().st_size
    assert models[2].size_bytes == tiny_model.stat().st_size  # the blob's, not the symlink's


def test_each_model_says_what_its_header_says(
    home: Path, tiny_model: Path, plain_model: Path
) -> None:
    copy(tiny_model, home / "models/a.gguf")
    copy(plain_model, home / "models/b.gguf")

    a, b = found_in(home)

    assert (a.architecture, a.context_length, a.chat_template) == (
        "llama",
        DEFAULT_SPEC.n_ctx_train,
        True,
    )
    assert (b.architecture, b.context_length, b.chat_template) == ("llama", 1024, False)


def test_an_ollama_models_projector_is_its_mmproj(
    home: Path, tiny_model: Path, tiny_mmproj: Path
) -> None:
    store = home / ".ollama/models"
    add_model(store, "llava:7b", tiny_model, projector=tiny_mmproj)

    (model,) = found_in(home)

    assert model.mmproj is not None
    assert model.mmproj.read_bytes() == tiny_mmproj.read_bytes()
    assert model.mmproj.parent == store / "blobs"


def test_a_manifest_whose_blob_is_missing_is_skipped_with_a_warning_naming_it(
    home: Path, tiny_model: Path, plain_model: Path
) -> None:
    store = home / ".ollama/models"
    add_model(store, "kept:1b", tiny_model)
    gone = add_model(store, "gone:1b", plain_model)
    model_blob(gone).unlink()
    broken = store / "manifests/registry.ollama.ai/library/broken/latest"
    broken.parent.mkdir(parents=True)
    broken.write_text('{"layers": [')  # cut off mid-write

    discovery = find_models({"HOME": str(home)})

    assert [m.name for m in discovery.models] == ["kept:1b"]
    assert discovery.warnings == [
        f"skipped {broken}: it is not JSON (an Ollama manifest is)",
        f"skipped {gone}: its model blob {model_blob(gone)} is missing",
    ]


def bad_manifests(store: Path) -> tuple[Path, Path]:
    """Two manifests no parser should die of, of 10 KB each (issue 40): lists nested 5,000 deep,
    and a number of 5,000 digits (int() refuses more than 4,300)."""
    deep = store / "manifests/registry.ollama.ai/library/deep/latest"
    deep.parent.mkdir(parents=True)
    deep.write_text('{"layers": ' + "[" * 5000 + "]" * 5000 + "}")
    long = store / "manifests/registry.ollama.ai/library/long/latest"
    long.parent.mkdir(parents=True)
    long.write_text('{"layers": [' + "7" * 5000 + "]}")
    return deep, long


def test_a_manifest_nested_5000_deep_is_skipped_with_one_warning_and_the_rest_listed(
    home: Path, tiny_model: Path
) -> None:
    store = home / ".ollama/models"
    add_model(store, "kept:1b", tiny_model)
    deep, long = bad_manifests(store)

    discovery = find_models({"HOME": str(home)})

    assert [m.name for m in discovery.models] == ["kept:1b"]
    assert discovery.warnings == [
        f"skipped {deep}: it nests too deeply to be an Ollama manifest",
        f"skipped {long}: it holds a number too long to be an Ollama manifest's",
    ]


def test_a_file_that_is_no_gguf_is_skipped_with_a_warning(home: Path) -> None:
    broken = home / "models/notes.gguf"
    broken.parent.mkdir()
    broken.write_text("# my notes on models\n")

    discovery = find_models({"HOME": str(home)})

    assert discovery.models == []
    assert discovery.warnings == [
        f"skipped {broken}: it is not a GGUF model file (it starts with '# my', expected 'GGUF')"
    ]


def test_the_environment_moves_ollamas_store_and_the_hugging_face_cache(
    tmp_path: Path, home: Path, tiny_model: Path, plain_model: Path
) -> None:
    add_model(tmp_path / "ollama", "moved:1b", tiny_model)
    add_model(home / ".ollama/models", "unused:1b", plain_model)  # not where OLLAMA_MODELS is
    hf_snapshot(tmp_path / "hf/hub", "org/plain", "plain.gguf", plain_model)

    models = found_in(home, OLLAMA_MODELS=str(tmp_path / "ollama"), HF_HOME=str(tmp_path / "hf"))

    assert [(m.name, m.source) for m in models] == [
        ("moved:1b", "ollama"),
        ("arbiterd-tiny-llama", "huggingface"),
    ]


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("llama3.2:3b", "llama3.2:3b"),
        ("SmolLM2 135M Instruct", "SmolLM2-135M-Instruct"),
        ("hf.co/bartowski/Llama-3.2-3B-GGUF:Q4_K_M", "hf.co-bartowski-Llama-3.2-3B-GGUF:Q4_K_M"),
        ("..", "model"),
        ("qwén ", "qw-n"),
        ("x" * 80 + ":q4", "x" * 61 + ":q4"),
    ],
)
def test_a_suggested_name_is_a_valid_config_name(text: str, name: str) -> None:
    assert config_name(text) == name


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("Smollm2 135M 8k Lc100K Mix1 Ep2", True),  # SmolLM2-135M-Instruct's GGUF says so
        ("checkpoint-500", True),
        ("merged", True),
        ("Qwen2.5 7B Instruct", False),
        ("Mistral 7B Instruct v0.2", False),
        ("Phi 3 Mini 4k Instruct", False),
        ("Falcon Model 7B", False),
    ],
)
def test_a_gguf_name_of_a_training_run_is_told_from_a_models(name: str, tag: bool) -> None:
    assert training_tag(name) is tag


def test_a_model_whose_gguf_names_its_training_run_is_named_by_its_file(home: Path) -> None:
    smollm = home / "models" / SMOLLM_FILE
    smollm.parent.mkdir(parents=True)
    smollm.symlink_to(smollm_model_path())
    run = TinyModelSpec(general_name="Tiny 1M Lc8K Ep3")
    for quantization in ("Q4_K_M", "Q8_0"):
        write_tiny_llama(home / "models" / f"tiny-1m-{quantization}.gguf", run)

    # The file's name without its quantization; the second quantization keeps its own. (A
    # folder's symlinks are listed after its files.)
    assert [m.name for m in found_in(home)] == [
        "tiny-1m",
        "tiny-1m-Q8_0",
        "SmolLM2-135M-Instruct",
    ]


def test_ollama_names_leave_out_the_default_registry_and_namespace() -> None:
    assert ollama_name("registry.ollama.ai", "library", "llama3.2", "3b") == "llama3.2:3b"
    assert ollama_name("registry.ollama.ai", "me", "tiny", "q4") == "me/tiny:q4"
    assert ollama_name("hf.co", "org", "Tiny-GGUF", "Q8_0") == "hf.co/org/Tiny-GGUF:Q8_0"


def test_names_taken_twice_are_numbered_before_their_tag(home: Path, tiny_model: Path) -> None:
    for folder in ("a", "b", "c"):
        copy(tiny_model, home / "models" / folder / "m.gguf")

    assert [m.name for m in found_in(home)] == [
        "arbiterd-tiny-llama",
        "m",
        "arbiterd-tiny-llama-2",
    ]


# -- the starter config of what was found ------------------------------------------------------


def test_the_starter_config_serves_ollama_models_by_name_within_their_trained_context(
    home: Path, tiny_model: Path, plain_model: Path, tiny_mmproj: Path
) -> None:
    store = home / ".ollama/models"
    add_model(store, "llava:7b", tiny_model, projector=tiny_mmproj)
    add_model(store, "llava:latest", tiny_model, projector=tiny_mmproj)
    add_model(store, "arbiterd-tiny-llama:latest", plain_model)
    copy(plain_model, home / "models/plain.gguf")
    config_file = home / "config.toml"
    config_file.write_text(starter_config_text(found_in(home)))

    home.chmod(0o700)  # a usable XDG_RUNTIME_DIR
    config = load_config(config_file, env={"HOME": str(home), "XDG_RUNTIME_DIR": str(home)})

    # The plain model's general.name is the Ollama name of another: its file's name it is.
    assert list(config.models) == ["arbiterd-tiny-llama:latest", "llava:7b", "plain"]
    _, llava, plain = config.models.values()
    assert llava.aliases == ("llava:latest",)
    assert config.resolve("llava") == "llava:7b"
    assert llava.path == model_blob(store / "manifests/registry.ollama.ai/library/llava/7b")
    assert llava.mmproj is not None
    assert llava.mmproj.read_bytes() == tiny_mmproj.read_bytes()
    # 4096 is the starter's n_ctx; a model trained for less gets what it was trained for.
    assert (llava.n_ctx, plain.n_ctx) == (DEFAULT_SPEC.n_ctx_train, PLAIN_SPEC.n_ctx_train)
    assert config.resolve("llava:7b") == "llava:7b"
    assert "no chat template in its GGUF" in config_file.read_text()


# -- `arbiterd models` -------------------------------------------------------------------------


def arbiterd_models(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return arbiterd_at_home(home, "models", *args)


def arbiterd_at_home(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`arbiterd ARGS` run by a user whose home is `home`, with no model places moved."""
    env = {k: v for k, v in os.environ.items() if k not in {"OLLAMA_MODELS", "HF_HOME"}}
    env |= {"HOME": str(home)}
    # Nor a daemon of the user running the tests, nor a config of theirs.
    for name in ("HF_HUB_CACHE", "LLAMA_CACHE", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "arbiterd", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_models_json_lists_what_was_found_and_warns_on_stderr(
    home: Path, tiny_model: Path, plain_model: Path
) -> None:
    store = home / ".ollama/models"
    manifest = add_model(store, "llama3.2:3b", tiny_model)
    gone = add_model(store, "gone:1b", plain_model)
    model_blob(gone).unlink()

    done = arbiterd_models(home, "--json")

    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert listed["served"]["pid"] is None  # not running: what the embedded default serves
    assert listed["served"]["config"] is None
    assert [m["name"] for m in listed["served"]["models"]] == [
        EMBEDDED_CHAT_MODEL_NAME,
        EMBEDDED_MODEL_NAME,
    ]
    assert listed["models"] == [
        {
            "name": "llama3.2:3b",
            "path": str(model_blob(manifest)),
            "size_bytes": tiny_model.stat().st_size,
            "source": "ollama",
            "architecture": "llama",
            "context_length": DEFAULT_SPEC.n_ctx_train,
            "chat_template": True,
            "ollama_name": "llama3.2:3b",
            "mmproj": None,
            "aliases": [],
            "served_as": None,
        }
    ]
    assert done.stderr == (
        f"arbiterd models: warning: skipped {gone}: its model blob {model_blob(gone)} is missing\n"
    )


def test_models_and_install_dry_run_list_the_rest_past_a_manifest_nested_5000_deep(
    home: Path, tiny_model: Path
) -> None:
    store = home / ".ollama/models"
    add_model(store, "kept:1b", tiny_model)
    deep, _ = bad_manifests(store)

    listed = arbiterd_models(home, "--json")
    would = arbiterd_at_home(home, "install", "--dry-run")

    assert listed.returncode == 0, listed.stderr
    assert [m["name"] for m in json.loads(listed.stdout)["models"]] == ["kept:1b"]
    assert f"skipped {deep}: it nests too deeply" in listed.stderr
    assert would.returncode == 0, would.stderr
    assert f"note     skipped {deep}: it nests too deeply" in would.stdout
    assert f"would write    {home / '.config/arbiterd/config.toml'}\n" in would.stdout  # kept:1b


def test_models_prints_a_table(home: Path, tiny_model: Path, plain_model: Path) -> None:
    manifest = add_model(home / ".ollama/models", "llama3.2:3b", tiny_model)
    plain = copy(plain_model, home / "models/plain.gguf")

    done = arbiterd_models(home)

    assert done.returncode == 0, done.stderr
    served, found = done.stdout.split("\n\n")
    assert served.startswith("served by the embedded default once arbiterd runs")
    assert f"  {EMBEDDED_CHAT_MODEL_NAME}  {smollm_model_path()}" in served
    heading, header, *rows = [line.split("  ") for line in found.splitlines()]
    assert heading == ["found (`arbiterd models --toml` prints a [models.NAME] table for each):"]
    cells = [[cell.strip() for cell in row if cell.strip()] for row in (header, *rows)]
    assert cells == [
        ["NAME", "SIZE", "ARCH", "CONTEXT", "CHAT TEMPLATE", "SOURCE", "SERVED", "PATH"],
        [
            "llama3.2:3b",
            format_bytes(tiny_model.stat().st_size),
            "llama",
            str(DEFAULT_SPEC.n_ctx_train),
            "yes",
            "ollama",
            "-",
            str(model_blob(manifest)),
        ],
        [
            "arbiterd-tiny-llama",
            format_bytes(plain.stat().st_size),
            "llama",
            "1024",
            "no",
            "models",
            "-",
            str(plain),
        ],
    ]


def test_models_lists_what_the_running_daemon_serves_and_toml_leaves_it_out(
    home: Path, tiny_model: Path, plain_model: Path
) -> None:
    mine = copy(tiny_model, home / "models/tiny.gguf")
    plain = copy(plain_model, home / "models/plain.gguf")
    with serving({"chat": tiny(mine)}) as daemon:
        listed = arbiterd_models(home, "--config", str(daemon.config))
        pasted = arbiterd_models(home, "--config", str(daemon.config), "--toml")

    assert listed.returncode == 0, listed.stderr
    served, found = listed.stdout.split("\n\n")
    assert served.splitlines() == [
        f"served by the running daemon (pid {daemon.process.pid}):",
        "  NAME  FILE",
        f"  chat  {mine}",
    ]
    rows = {row.split()[-1]: row.split() for row in found.splitlines()[2:]}
    assert rows[str(mine)][-2] == "chat"  # the file the daemon serves as chat
    assert rows[str(plain)][-2] == "-"
    # Appended to the config, a second table for the file it serves would be one too many.
    assert pasted.returncode == 0, pasted.stderr
    assert pasted.stdout.count("[models.") == 1
    assert f'path = "{plain}"' in pasted.stdout
    assert pasted.stderr == (
        f"arbiterd models: left out, as {daemon.config} serves them already: {rows[str(mine)][0]}\n"
    )


def test_models_with_nothing_found_says_where_it_looked(home: Path) -> None:
    done = arbiterd_models(home)

    assert done.returncode == 0
    assert "\n\nno GGUF models found; looked in:\n" in done.stdout
    assert f"  {home / '.ollama/models'} (ollama)\n" in done.stdout
    assert f"  {home / '.cache/huggingface/hub'} (huggingface)\n" in done.stdout
    assert f"  {home / '.lmstudio/models'} (lm-studio)\n" in done.stdout
    assert f"  {home / 'models'} (models)\n" in done.stdout


def test_models_toml_pasted_into_a_config_serves_each_model(
    home: Path, tiny_model: Path, plain_model: Path
) -> None:
    """From "I have these GGUFs" to a config: `arbiterd models --toml`'s tables, pasted under
    a [daemon] table, are a config the daemon serves every model of, each by its name."""
    add_model(home / ".ollama/models", "llama3.2:3b", tiny_model)
    copy(plain_model, home / "models/plain.gguf")
    done = arbiterd_models(home, "--toml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("[models.") == 2
    daemon = Daemon({}, pasted=done.stdout)
    try:
        status = daemon.wait_ready(states=("unloaded",))  # load = "demand": none started yet
        assert [m["name"] for m in status["models"]] == ["llama3.2:3b", "arbiterd-tiny-llama"]
        api = openai_client(daemon, timeout_s=120)
        for name in ("llama3.2:3b", "arbiterd-tiny-llama"):
            answer = api.completions.create(model=name, prompt="the fox", max_tokens=2)
            assert answer.model == name
    finally:
        daemon.cleanup()


def test_models_toml_with_nothing_found_prints_nothing(home: Path) -> None:
    done = arbiterd_models(home, "--toml")
    assert (done.returncode, done.stdout) == (0, "")
