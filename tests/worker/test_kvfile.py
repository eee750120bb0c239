"""The state file format: a round trip, and every file that must be refused."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from pathlib import Path

import pytest

from arbiterd.worker import kvfile
from arbiterd.worker.kvfile import KvFileError, KvKey, KvState

KEY = KvKey(model_size=1234, model_mtime_ns=5678, n_ctx=512, embedding=False)
STATE = KvState(tokens=[1, 2, 3, 70000, 2**31 - 1], data=bytes(range(256)) * 10)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "m.kv"
    written = kvfile.write(path, KEY, STATE)
    assert written == path.stat().st_size
    return path


def test_a_state_written_reads_back_the_same(saved: Path) -> None:
    assert kvfile.read(saved, KEY) == STATE
    assert [p.name for p in saved.parent.iterdir()] == ["m.kv"]  # no temporary left


def test_the_key_of_a_file_is_its_size_and_mtime(tmp_path: Path) -> None:
    model = tmp_path / "x.gguf"
    model.write_bytes(b"1234")
    key = KvKey.of(model, n_ctx=64, embedding=True)
    assert (key.model_size, key.n_ctx, key.embedding) == (4, 64, True)
    assert key.model_mtime_ns == model.stat().st_mtime_ns


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KvFileError, match="no state file"):
        kvfile.read(tmp_path / "none.kv", KEY)


@pytest.mark.parametrize("keep", [0, 5, 10, 20, -1])
def test_a_truncated_file_is_refused(saved: Path, keep: int) -> None:
    saved.write_bytes(saved.read_bytes()[:keep])
    with pytest.raises(KvFileError):
        kvfile.read(saved, KEY)


def test_a_file_with_bytes_over_is_refused(saved: Path) -> None:
    saved.write_bytes(saved.read_bytes() + b"x")
    with pytest.raises(KvFileError, match="truncated or has bytes over"):
        kvfile.read(saved, KEY)


def test_a_damaged_header_is_refused(saved: Path) -> None:
    blob = bytearray(saved.read_bytes())
    blob[len(kvfile.MAGIC) + 4] = ord("#")  # the JSON's opening brace
    saved.write_bytes(bytes(blob))
    with pytest.raises(KvFileError, match="damaged header"):
        kvfile.read(saved, KEY)


def test_a_header_length_out_of_bounds_is_refused(saved: Path) -> None:
    blob = bytearray(saved.read_bytes())
    struct.pack_into("<I", blob, len(kvfile.MAGIC), 2**32 - 1)
    saved.write_bytes(bytes(blob))
    with pytest.raises(KvFileError, match="header is damaged"):
        kvfile.read(saved, KEY)


def test_damaged_kv_bytes_are_refused(saved: Path) -> None:
    blob = bytearray(saved.read_bytes())
    blob[-1] ^= 0xFF
    saved.write_bytes(bytes(blob))
    with pytest.raises(KvFileError, match="SHA-256"):
        kvfile.read(saved, KEY)


def test_another_file_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.write_bytes(b"GGUF and more")
    with pytest.raises(KvFileError, match="not an arbiterd state file"):
        kvfile.read(other, KEY)


def test_another_version_is_refused(saved: Path) -> None:
    blob = saved.read_bytes()
    start = len(kvfile.MAGIC) + 4
    (length,) = struct.unpack_from("<I", blob, len(kvfile.MAGIC))
    header = json.loads(blob[start : start + length])
    header["version"] = 99
    raw = json.dumps(header).encode()
    saved.write_bytes(kvfile.MAGIC + struct.pack("<I", len(raw)) + raw + blob[start + length :])
    with pytest.raises(KvFileError, match="format 99"):
        kvfile.read(saved, KEY)


@pytest.mark.parametrize(
    "other",
    [
        KvKey(model_size=1235, model_mtime_ns=5678, n_ctx=512, embedding=False),
        KvKey(model_size=1234, model_mtime_ns=5679, n_ctx=512, embedding=False),
        KvKey(model_size=1234, model_mtime_ns=5678, n_ctx=1024, embedding=False),
        KvKey(model_size=1234, model_mtime_ns=5678, n_ctx=512, embedding=True),
    ],
    ids=["model size", "model mtime", "n_ctx", "embedding"],
)
def test_a_state_made_for_another_model_file_or_params_is_refused(
    saved: Path, other: KvKey
) -> None:
    with pytest.raises(KvFileError, match="was made for"):
        kvfile.read(saved, other)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        kvfile.write(saved, KEY, KvState([9], b"new"))
    monkeypatch.undo()
    assert kvfile.read(saved, KEY) == STATE
    assert [p.name for p in saved.parent.iterdir()] == ["m.kv"]


# -- privacy (issue 24: another local user read a prompt back from a .kv file) ------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_state_file_is_0600_under_umask_022_and_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the temporary, written and about to be renamed into place
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    old = os.umask(0o022)
    try:
        kvfile.write(tmp_path / "m.kv", KEY, STATE)
    finally:
        os.umask(old)
    assert seen == [0o600]
    assert mode_of(tmp_path / "m.kv") == 0o600


def test_a_state_file_is_0600_even_where_the_umask_takes_the_owners_write_bit(
    tmp_path: Path,
) -> None:
    old = os.umask(0o277)
    try:
        kvfile.write(tmp_path / "m.kv", KEY, STATE)
    finally:
        os.umask(old)
    assert mode_of(tmp_path / "m.kv") == 0o600


def test_a_temporary_left_by_a_dead_worker_of_the_same_pid_is_replaced(tmp_path: Path) -> None:
    stale = tmp_path / f".m.kv.{os.getpid()}.tmp"
    stale.write_bytes(b"half a file")
    stale.chmod(0o644)
    kvfile.write(tmp_path / "m.kv", KEY, STATE)
    assert kvfile.read(tmp_path / "m.kv", KEY) == STATE
    assert [p.name for p in tmp_path.iterdir()] == ["m.kv"]


def test_a_symlink_at_the_temporary_is_replaced_not_written_through(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (tmp_path / f".m.kv.{os.getpid()}.tmp").symlink_to(target)
    kvfile.write(tmp_path / "m.kv", KEY, STATE)
    assert target.read_bytes() == b""
    assert mode_of(tmp_path / "m.kv") == 0o600


def test_a_loose_state_file_is_made_0600_as_it_is_read(saved: Path) -> None:
    saved.chmod(0o644)  # as an older arbiterd wrote them, under umask 022
    assert kvfile.read(saved, KEY) == STATE
    assert mode_of(saved) == 0o600


def test_a_symlink_at_the_state_file_is_refused_not_followed(tmp_path: Path, saved: Path) -> None:
    link = tmp_path / "link.kv"
    link.symlink_to(saved)
    with pytest.raises(KvFileError, match="cannot read"):
        kvfile.read(link, KEY)
