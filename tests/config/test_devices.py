"""The devices keys (issue 27): `devices`, `split_mode`, `tensor_split` per model and `[daemon]
rpc_servers`, each refused with the key named and what would be accepted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from arbiterd.config import Config, load_config
from arbiterd.errors import ConfigError
from arbiterd.spec import SplitMode

SERVERS = '[daemon]\nrpc_servers = ["127.0.0.1:50052", "Box.lan:50053"]\n'


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(run)}


def load(tmp_path: Path, env: dict[str, str], model: str, daemon: str = SERVERS) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(f'{daemon}[models.m]\npath = "/models/m.gguf"\n{model}', encoding="utf-8")
    return load_config(path, env=env)


def refused(tmp_path: Path, env: dict[str, str], model: str, daemon: str = SERVERS) -> str:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, env, model, daemon)
    return str(caught.value)


def test_a_model_is_on_gpu0_by_default_split_by_layer_with_no_shares(
    tmp_path: Path, env: dict[str, str]
) -> None:
    model = load(tmp_path, env, "").models["m"]
    assert (model.devices, model.split_mode, model.tensor_split) == (("gpu0",), "layer", ())
    spec = model.worker_config(tmp_path / "arena", embedding=False, n_ctx=2048).spec
    assert (spec.devices, spec.split_mode, spec.tensor_split) == (("gpu0",), "layer", ())


def test_devices_keep_the_files_order_in_their_canonical_spelling(
    tmp_path: Path, env: dict[str, str]
) -> None:
    text = 'devices = ["rpc:BOX.lan:50053", "rpc:127.0.0.1:50052/1"]\n'
    text += 'split_mode = "row"\ntensor_split = [3, 1.5]\n'
    config = load(tmp_path, env, text)
    model = config.models["m"]
    assert model.devices == ("rpc:box.lan:50053", "rpc:127.0.0.1:50052/1")
    assert model.split_mode is SplitMode.ROW
    assert model.tensor_split == (3.0, 1.5)
    assert config.daemon.rpc_servers == ("127.0.0.1:50052", "box.lan:50053")


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ('devices = ["gpu"]\n', r'models\.m\.devices: .*"gpu" is no device id'),
        ("devices = []\n", r"models\.m\.devices: expected an array .* got an empty array"),
        ('devices = "gpu1"\n', r"models\.m\.devices: expected an array"),
        (
            'devices = ["rpc:box.lan:50053", "rpc:Box.lan:50053"]\n',
            r'"rpc:Box.lan:50053" is listed twice \(as "rpc:box.lan:50053"\)',
        ),
        ('devices = ["GPU1"]\n', r'"GPU1" is no device id: expected gpuN'),
        ('devices = ["cpu", "gpu0"]\n', r'"cpu" goes alone'),
        (
            'devices = ["rpc:10.0.0.9:50052"]\n',
            r"RPC server 10\.0\.0\.9:50052, which daemon\.rpc_servers does not list "
            r"\(it lists 127\.0\.0\.1:50052, box\.lan:50053\)",
        ),
        ('split_mode = "none"\n', r'models\.m\.split_mode: expected one of "layer", "row"'),
        ("tensor_split = [1, 0]\n", r"models\.m\.tensor_split: expected an array of positive"),
        ("tensor_split = [1, true]\n", r"models\.m\.tensor_split: expected"),
        (
            'devices = ["gpu0", "gpu1"]\ntensor_split = [1, 2, 3]\n',
            r'3 shares for 2 device\(s\) \(devices = \["gpu0", "gpu1"\]\)',
        ),
        (
            'devices = ["rpc:127.0.0.1:50052"]\nkv_on_release = "device"\n',
            r'models\.m\.kv_on_release: "device" cannot be kept for a model on an RPC device',
        ),
    ],
)
def test_bad_placement_is_refused_naming_the_key(
    tmp_path: Path, env: dict[str, str], model: str, says: str
) -> None:
    assert re.search(says, refused(tmp_path, env, model)), refused(tmp_path, env, model)


@pytest.mark.parametrize(
    ("servers", "says"),
    [
        ('"127.0.0.1:50052"', r"daemon\.rpc_servers: expected an array of RPC servers"),
        ('["127.0.0.1"]', r"expected an array of RPC servers, each HOST:PORT"),
        ('["127.0.0.1:0"]', r"expected an array of RPC servers"),
        ('["h:1/0"]', r"expected an array of RPC servers"),
        ('["::1:50052"]', r"an IPv6 address cannot name an RPC server"),
        ('["[::1]:50052"]', r"an IPv6 address cannot name an RPC server"),
        ('["Box:1", "box:1"]', r'"box:1" is listed twice \(as "Box:1"\)'),
    ],
)
def test_bad_rpc_servers_are_refused(
    tmp_path: Path, env: dict[str, str], servers: str, says: str
) -> None:
    message = refused(tmp_path, env, "", f"[daemon]\nrpc_servers = {servers}\n")
    assert re.search(says, message), message


def test_a_group_member_off_gpu0_is_refused_groups_across_devices_are_not_built(
    tmp_path: Path, env: dict[str, str]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        '[models.a]\npath = "/m/a.gguf"\ndevices = ["gpu1"]\n'
        '[models.b]\npath = "/m/b.gguf"\n'
        '[groups.pair]\nmodels = ["a", "b"]\n',
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r'groups\.pair\.models: "a" is placed on devices'):
        load_config(path, env=env)
