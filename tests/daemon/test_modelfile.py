"""Model files are checked before anything loads: the user's path, the key, what is wrong."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from arbiterd.config import Config, load_config
from arbiterd.daemon.modelfile import NotGgufError, check_models, read_header
from arbiterd.errors import ConfigError
from tests.support.tiny_gguf import DEFAULT_SPEC


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


@pytest.mark.slow
def test_the_header_of_the_demo_model_is_read_without_its_vocabulary(gemma_model: Path) -> None:
    header = read_header(gemma_model)
    assert (header.architecture, header.context_length) == ("gemma3", 32768)


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
