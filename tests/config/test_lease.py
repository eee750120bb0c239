"""`[devices."rpc:HOST:PORT"] lease` and `lease_key_file` (issue 46): a lent RPC device's lease
channel and the key the borrower proves; each bad value refused with the key named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from arbiterd.config import Config, LeaseConfig, hashed_servers, load_config
from arbiterd.errors import ConfigError

LENT = "rpc:127.0.0.1:50052"
MODELS = f"""\
[daemon]
rpc_servers = ["127.0.0.1:50052"]
[models.lent]
path = "/models/lent.gguf"
devices = ["{LENT}"]
"""


def load(tmp_path: Path, env: dict[str, str], table: str) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(MODELS + table, encoding="utf-8")
    return load_config(path, env=env)


def test_a_lent_device_names_its_lender_and_its_key_file(
    tmp_path: Path, env: dict[str, str]
) -> None:
    table = f'[devices."{LENT}"]\nlease = "lender.lan:50053"\nlease_key_file = "~/lease.key"\n'
    config = load(tmp_path, env, table)
    device = config.devices[LENT]
    assert device.lease == LeaseConfig("lender.lan:50053", tmp_path / "home" / "lease.key")
    assert device.members == ("lent",)
    assert device.memory is None  # nothing else changes: measured, as before


@pytest.mark.parametrize(
    ("table", "said"),
    [
        (
            f'[devices."{LENT}"]\nlease = "lender.lan"\nlease_key_file = "k"\n',
            f'devices."{LENT}".lease: expected HOST:PORT',
        ),
        (
            f'[devices."{LENT}"]\nlease = "lender.lan:50053"\n',
            "lease_key_file: is required with lease",
        ),
        (
            f'[devices."{LENT}"]\nlease_key_file = "k"\n',
            "lease_key_file: is given without lease",
        ),
        (
            '[devices.gpu0]\nlease = "lender.lan:50053"\nlease_key_file = "k"\n',
            "gpu0 is this machine's own device: only an RPC server's (rpc:HOST:PORT) is lent",
        ),
    ],
)
def test_a_lease_that_cannot_be_used_is_refused_naming_the_key(
    tmp_path: Path, env: dict[str, str], table: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(said)):
        load(tmp_path, env, table)


def test_uploads_by_hash_name_the_models_servers_for_its_workers(
    tmp_path: Path, env: dict[str, str]
) -> None:
    config = load(tmp_path, env, f'[devices."{LENT}"]\nuploads = "hashes"\n')
    assert config.devices[LENT].hash_uploads
    assert hashed_servers(config, config.models["lent"]) == ("127.0.0.1:50052",)
    bytes_ = load(tmp_path, env, f'[devices."{LENT}"]\nuploads = "bytes"\n')
    assert hashed_servers(bytes_, bytes_.models["lent"]) == ()
    assert hashed_servers(bytes_, load(tmp_path, env, "").models["lent"]) == ()


@pytest.mark.parametrize(
    ("table", "said"),
    [
        (f'[devices."{LENT}"]\nuploads = "hash"\n', 'expected "bytes" or "hashes"'),
        (
            '[devices.gpu0]\nuploads = "hashes"\n',
            "gpu0 is this machine's own device: only an RPC server is sent weights by hash",
        ),
    ],
)
def test_uploads_that_cannot_be_used_are_refused(
    tmp_path: Path, env: dict[str, str], table: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(said)):
        load(tmp_path, env, table)
