"""The lease channel's key and its proof (arbiterd/lease/channel.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from arbiterd.errors import BadValueError
from arbiterd.lease.channel import proof, proves, read_key, split_address


def key_file(folder: Path, text: str, mode: int = 0o600) -> Path:
    path = folder / "lease.key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_proof_proves_its_key_for_its_nonce_only() -> None:
    answer = proof(b"secret", "n1")
    assert proves(b"secret", "n1", answer)
    assert not proves(b"secret", "n2", answer)  # a proof replayed for another challenge
    assert not proves(b"other", "n1", answer)
    assert not proves(b"secret", "n1", None)
    assert b"secret".hex() not in answer
    assert "secret" not in answer


def test_the_key_is_the_file_stripped(tmp_path: Path) -> None:
    assert read_key(key_file(tmp_path, "  s3cret\n")) == b"s3cret"


@pytest.mark.parametrize(
    ("text", "mode", "said"),
    [
        ("", 0o600, "is empty"),
        ("\n \n", 0o600, "is empty"),
        ("k", 0o644, "lets group or others read it; chmod 600"),
        ("k", 0o620, "lets group or others write it"),
        ("k" * 5000, 0o600, "is over 4096 bytes"),
    ],
)
def test_a_key_file_that_cannot_be_used_is_refused_saying_why(
    tmp_path: Path, text: str, mode: int, said: str
) -> None:
    with pytest.raises(BadValueError, match=said):
        read_key(key_file(tmp_path, text, mode))


def test_a_missing_or_linked_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadValueError, match="No such file"):
        read_key(tmp_path / "absent.key")
    real = key_file(tmp_path, "k")
    link = tmp_path / "link.key"
    os.symlink(real, link)
    with pytest.raises(BadValueError, match="lease key file"):
        read_key(link)


def test_an_address_is_host_and_port() -> None:
    assert split_address("lender.lan:50053", "lease") == ("lender.lan", 50053)
    for bad in ("lender", ":1", "h:0", "h:70000", "h:x"):
        with pytest.raises(BadValueError, match="expected HOST:PORT"):
            split_address(bad, "lease")
