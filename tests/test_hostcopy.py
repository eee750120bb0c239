"""One host copy per model file, shared by every model on it, kept while the file is gone."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiterd.errors import ModelLoadError
from arbiterd.hostcopy import HostCopies


@pytest.fixture
def copies() -> Iterator[HostCopies]:
    held = HostCopies()
    yield held
    held.close()


@pytest.fixture
def own_model(tmp_path: Path, tiny_model: Path) -> Path:
    """A model file of the test's own, which it may delete or rewrite."""
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_model.read_bytes())
    return path


def _open_fd(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_two_models_on_one_file_share_one_copy_counted_once(
    copies: HostCopies, tiny_model: Path
) -> None:
    a = copies.acquire(tiny_model, "a")
    b = copies.acquire(tiny_model, "b")
    assert a.copy is b.copy
    assert a.copy.models() == ["a", "b"]
    assert copies.total_bytes() == tiny_model.stat().st_size
    assert os.pread(a.copy.fd, 4, 0) == b"GGUF"


def test_the_last_release_frees_the_copy(copies: HostCopies, tiny_model: Path) -> None:
    a = copies.acquire(tiny_model, "a")
    b = copies.acquire(tiny_model, "b")
    copies.release(a)
    assert _open_fd(b.copy.fd)
    copies.release(b)
    assert not _open_fd(b.copy.fd)
    assert copies.total_bytes() == 0
    assert not copies.holds(tiny_model)


def test_a_changed_model_keeps_the_copy_across_its_old_and_new_slot(
    copies: HostCopies, own_model: Path
) -> None:
    path = own_model
    old = copies.acquire(path, "m")
    path.unlink()  # the file vanished meanwhile
    new = copies.acquire(path, "m")  # the changed model's new slot, before the old one goes
    copies.release(old)
    assert new.copy is old.copy
    assert _open_fd(new.copy.fd)


def test_a_file_gone_from_disk_is_served_from_its_copy(copies: HostCopies, own_model: Path) -> None:
    path = own_model
    first = copies.acquire(path, "m")
    path.unlink()
    assert copies.holds(path)
    again = copies.acquire(path, "restarted")
    assert again.copy is first.copy


def test_a_new_version_of_the_file_gets_a_fresh_copy(
    copies: HostCopies, own_model: Path, tiny_model: Path
) -> None:
    path = own_model
    old = copies.acquire(path, "a")
    path.write_bytes(tiny_model.read_bytes() + b"\0" * 4096)
    new = copies.acquire(path, "b")
    assert new.copy is not old.copy
    assert copies.total_bytes() == old.copy.size + new.copy.size  # until "a" lets go
    copies.release(old)
    assert copies.total_bytes() == new.copy.size


def test_a_missing_file_without_a_copy_names_the_users_path(
    copies: HostCopies, tmp_path: Path
) -> None:
    with pytest.raises(
        ModelLoadError, match=re.escape(f"model file not found: {tmp_path / 'no.gguf'}")
    ):
        copies.acquire(tmp_path / "no.gguf", "m")


def test_a_directory_is_a_clear_error_not_a_crash(copies: HostCopies, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(f"cannot copy model file {tmp_path}")):
        copies.acquire(tmp_path, "m")
