"""Model files are checked before anything loads: the user's path, the key, what is wrong."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from arbiterd.config import STARTER_N_CTX, Config, default_n_ctx, load_config
from arbiterd.daemon.models.modelfile import (
    ModelTraits,
    check_models,
    model_traits,
    serves_embeddings,
    vram_budget_for,
)
from arbiterd.errors import ConfigError
from arbiterd.gguf import GgufHeader, NotGgufError, read_header
from tests.support.models import model_config
from tests.support.tiny_gguf import DEFAULT_SPEC, TinyModelSpec, write_tiny_llama
from tests.support.tiny_mmproj import write_tiny_mmproj


def config_for(tmp_path: Path, model: Path, n_ctx: int = 256) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[daemon]\narena = "{tmp_path / "arena"}"\nsocket = "{tmp_path / "s"}"\n'
        f'[models.m]\npath = "{model}"\nn_ctx = {n_ctx}\n'
    )
    return load_config(path, env={"HOME": str(tmp_path)})


def test_the_header_of_a_real_gguf_names_its_architecture_and_trained_context(
    tiny_model: Path,
) -> None:
    header = read_header(tiny_model)
    assert header.version == 3
    assert header.architecture == "llama"
    assert header.context_length == DEFAULT_SPEC.n_ctx_train
    assert header.tensor_count > 0
    assert header.pooling_type is None
    assert not header.embedding


def test_all_the_metadata_says_the_models_name_and_whether_it_has_a_chat_template(
    tiny_model: Path, tmp_path: Path
) -> None:
    header = read_header(tiny_model, all_metadata=True)
    assert (header.name, header.chat_template) == ("arbiterd-tiny-llama", True)
    assert header.context_length == DEFAULT_SPEC.n_ctx_train
    plain = write_tiny_llama(tmp_path / "plain.gguf", TinyModelSpec(chat_template=""))
    assert read_header(plain, all_metadata=True).chat_template is False


@pytest.mark.slow
def test_the_header_of_the_demo_model_says_it_generates(gemma_model: Path) -> None:
    header = read_header(gemma_model)  # through its 262,144-token vocabulary: no pooling
    assert (header.architecture, header.context_length) == ("gemma3", 32768)
    assert not header.embedding


def test_a_gguf_that_names_a_pooling_type_is_an_embedding_model(
    tiny_embedding_model: Path,
) -> None:
    header = read_header(tiny_embedding_model)
    assert (header.architecture, header.context_length) == ("llama", DEFAULT_SPEC.n_ctx_train)
    assert header.pooling_type == 1  # mean
    assert header.embedding


@pytest.mark.parametrize(
    ("architecture", "pooling_type", "embedding"),
    [
        ("bert", None, True),  # encoder-only: it cannot generate
        ("nomic-bert", 1, True),
        ("qwen3", 3, True),  # a decoder made to embed, pooling its last token
        ("llama", 0, False),  # "none", as llama.cpp reads an absent pooling type
        ("llama", None, False),
        (None, None, False),
    ],
)
def test_an_embedding_model_pools_or_is_an_encoder(
    architecture: str | None, pooling_type: int | None, embedding: bool
) -> None:
    assert GgufHeader(3, 1, architecture, None, pooling_type).embedding is embedding


def test_the_config_says_what_a_model_serves_else_its_gguf(
    tiny_model: Path, tiny_embedding_model: Path
) -> None:
    fds = {path: os.open(path, os.O_RDONLY) for path in (tiny_model, tiny_embedding_model)}
    try:

        def serves(path: Path, embedding: bool | None) -> bool:
            return model_traits(model_config("m", path, embedding=embedding), fds[path]).embedding

        assert not serves(tiny_model, None)
        assert serves(tiny_embedding_model, None)
        assert serves(tiny_model, True)
        assert not serves(tiny_embedding_model, False)
    finally:
        for fd in fds.values():
            os.close(fd)


def test_what_a_model_serves_is_read_as_its_config_loads(
    tmp_path: Path, tiny_model: Path, tiny_embedding_model: Path
) -> None:
    assert not serves_embeddings(model_config("m", tiny_model, embedding=None))
    assert serves_embeddings(model_config("m", tiny_embedding_model, embedding=None))
    assert serves_embeddings(model_config("m", tiny_model, embedding=True))
    assert not serves_embeddings(model_config("m", tiny_embedding_model, embedding=False))
    # A file that cannot be read yet: its start says why, and decides from what it loads.
    assert not serves_embeddings(model_config("m", tmp_path / "gone.gguf", embedding=None))


def test_a_model_without_n_ctx_gets_4096_or_the_context_it_was_trained_for(
    tiny_model: Path,
) -> None:
    assert DEFAULT_SPEC.n_ctx_train < STARTER_N_CTX
    unset = model_config("m", tiny_model, n_ctx=None, embedding=False)
    assert model_traits(unset, None) == ModelTraits(False, DEFAULT_SPEC.n_ctx_train)
    assert model_traits(replace(unset, n_ctx=8192), None).n_ctx == 8192  # as the user wrote
    assert (default_n_ctx(None), default_n_ctx(32768), default_n_ctx(1024)) == (4096, 4096, 1024)


def test_a_context_left_to_the_gguf_is_no_warning(tmp_path: Path, tiny_model: Path) -> None:
    config = config_for(tmp_path, tiny_model)
    unset = replace(config.models["m"], n_ctx=None)
    assert check_models(replace(config, models={"m": unset})) == []


def test_a_copy_that_is_not_a_gguf_fails_its_model(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    fd = os.open(text, os.O_RDONLY)
    try:
        with pytest.raises(ConfigError, match=r"models\.m\.path: the copy of .* is not a GGUF"):
            model_traits(model_config("m", text, n_ctx=None), fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "it is empty"),
        (b"PK\x03\x04rest", "not a GGUF model file (it starts with 'PK"),
        (b"GGUF\x01\x00\x00\x00" + bytes(16), "version 1"),
        (b"GGUF\x03\x00\x00\x00\x01", "truncated"),
        (b"GGUF\x03\x00\x00\x00" + (1 << 40).to_bytes(8, "little") + bytes(8), "damaged"),
    ],
    ids=["empty", "zip", "old_version", "truncated", "absurd_counts"],
)
def test_what_is_not_a_gguf_says_what_it_is(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(NotGgufError, match=re.escape(message)):
        read_header(path)


def test_a_good_config_passes_without_warnings(tmp_path: Path, tiny_model: Path) -> None:
    assert check_models(config_for(tmp_path, tiny_model)) == []


def test_a_missing_file_names_the_config_the_key_and_the_users_path(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "gone.gguf"
    config = config_for(tmp_path, missing)
    with pytest.raises(ConfigError) as caught:
        check_models(config)
    assert str(caught.value) == f"{config.source}: models.m.path: {missing} does not exist"


def test_a_dangling_symlink_is_named_as_such(tmp_path: Path) -> None:
    link = tmp_path / "link.gguf"
    link.symlink_to(tmp_path / "nowhere.gguf")
    with pytest.raises(ConfigError, match="is a symlink to a missing file"):
        check_models(config_for(tmp_path, link))


def test_a_directory_is_refused_before_any_worker_copies_it(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    with pytest.raises(
        ConfigError, match=re.escape(f"models.m.path: {folder} is a directory; expected")
    ):
        check_models(config_for(tmp_path, folder))


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ConfigError, match=re.escape(f"{text} is not a GGUF model file")):
        check_models(config_for(tmp_path, text))


@pytest.mark.skipif(os.getuid() == 0, reason="root reads every file")
def test_an_unreadable_file_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    locked = tmp_path / "locked.gguf"
    locked.write_bytes(tiny_model.read_bytes())
    locked.chmod(0)
    with pytest.raises(ConfigError, match="cannot be read: Permission denied"):
        check_models(config_for(tmp_path, locked))


def test_a_context_beyond_the_trained_one_is_a_warning(tmp_path: Path, tiny_model: Path) -> None:
    config = config_for(tmp_path, tiny_model, n_ctx=DEFAULT_SPEC.n_ctx_train * 2)
    (warning,) = check_models(config)
    assert "models.m.n_ctx" in warning
    assert f"the {DEFAULT_SPEC.n_ctx_train} tokens" in warning


def test_a_vanished_file_whose_copy_is_held_is_a_warning(tmp_path: Path) -> None:
    gone = tmp_path / "gone.gguf"
    config = config_for(tmp_path, gone)
    (warning,) = check_models(config, copy_held=lambda path: path == gone)
    assert "keeps serving from its copy in memory" in warning


def test_the_header_gives_the_shape_a_kv_cache_follows_from(tiny_model: Path) -> None:
    header = read_header(tiny_model)
    spec = DEFAULT_SPEC
    assert header.shape["block_count"] == spec.n_layer
    assert header.shape["head_count_kv"] == spec.n_head_kv
    head_dim = spec.n_embd // spec.n_head
    # f16 K and V, per layer, per KV head, per token.
    expected = 2 * 256 * spec.n_layer * 2 * spec.n_head_kv * head_dim
    assert header.kv_bytes(256) == expected


def group_config(tmp_path: Path, model: Path, budget: str, n_gpu_layers: int = -1) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[daemon]\narena = "{tmp_path / "arena"}"\nsocket = "{tmp_path / "s"}"\n'
        f'vram_budget = "{budget}"\n'
        f'[models.a]\npath = "{model}"\nn_ctx = 256\nn_gpu_layers = {n_gpu_layers}\n'
        f'[models.b]\npath = "{model}"\nn_ctx = 256\nn_gpu_layers = {n_gpu_layers}\n'
        '[groups.pair]\nmodels = ["a", "b"]\n'
    )
    return load_config(path, env={"HOME": str(tmp_path)})


def test_a_group_that_fits_the_budget_passes(tmp_path: Path, tiny_model: Path) -> None:
    need = tiny_model.stat().st_size + (read_header(tiny_model).kv_bytes(256) or 0)
    assert check_models(group_config(tmp_path, tiny_model, f"{2 * need}B")) == []


def test_a_group_over_the_budget_is_refused_with_the_numbers(
    tmp_path: Path, tiny_model: Path
) -> None:
    with pytest.raises(ConfigError) as caught:
        check_models(group_config(tmp_path, tiny_model, "1MiB"))
    message = str(caught.value)
    weights = tiny_model.stat().st_size / (1 << 20)
    kv = (read_header(tiny_model).kv_bytes(256) or 0) / (1 << 20)
    assert f"groups.pair.models: they need about {2 * (weights + kv):.2f} MiB together" in message
    assert f"(a {weights:.2f} MiB weights + {kv:.2f} MiB KV, b " in message
    assert "more than [daemon] vram_budget (1.00 MiB)" in message


def test_members_on_the_cpu_need_no_device_memory(tmp_path: Path, tiny_model: Path) -> None:
    assert check_models(group_config(tmp_path, tiny_model, "1B", n_gpu_layers=0)) == []


def test_a_projector_must_be_a_clip_gguf(tmp_path: Path, tiny_model: Path) -> None:
    config = config_for(tmp_path, tiny_model)
    model = config.models["m"]
    good = write_tiny_mmproj(tmp_path / "mmproj.gguf")
    vision = dataclasses.replace(config, models={"m": dataclasses.replace(model, mmproj=good)})
    assert check_models(vision) == []
    for path, message in [
        (tmp_path / "gone.gguf", "does not exist"),
        (tiny_model, "is not a multimodal projector: its architecture is 'llama'"),
    ]:
        bad = dataclasses.replace(config, models={"m": dataclasses.replace(model, mmproj=path)})
        with pytest.raises(ConfigError, match=r"models\.m\.mmproj: .*" + re.escape(message)):
            check_models(bad)


def test_a_group_members_budget_leaves_room_for_the_others(
    tmp_path: Path, tiny_model: Path
) -> None:
    need = tiny_model.stat().st_size + (read_header(tiny_model).kv_bytes(256) or 0)
    config = group_config(tmp_path, tiny_model, f"{3 * need}B")
    assert vram_budget_for(config, config.models["a"]) == 2 * need  # b is warm beside it
    spent = group_config(tmp_path, tiny_model, f"{need}B")
    assert vram_budget_for(spent, spent.models["a"]) == 1  # nothing left for a projector
    alone = config_for(tmp_path, tiny_model)
    assert vram_budget_for(alone, alone.models["m"]) == 0  # no budget configured
