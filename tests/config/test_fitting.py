"""The [devices.ID] table (issue 44): a device's memory makes the models placed on it alone, and
in no [groups] table, its fitting set; each bad value is refused with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbiterd.config import DEFAULT_DEVICE_RESERVE, FITTING_GROUP, DeviceConfig, load_config
from arbiterd.errors import ConfigError

MODELS = """\
[models.chat]
path = "/models/chat.gguf"
[models.embed]
path = "/models/embed.gguf"
[models.task]
path = "/models/task.gguf"
[models.rag]
path = "/models/rag.gguf"
[models.other]
path = "/models/other.gguf"
devices = ["gpu1"]
[groups.pair]
models = ["rag", "task"]
"""


def test_a_devices_memory_makes_its_models_outside_groups_a_fitting_set(
    tmp_path: Path, env: dict[str, str]
) -> None:
    config = load_config(_write(tmp_path, MODELS + '[devices.gpu0]\nmemory = "20GiB"\n'), env=env)
    assert config.devices == {
        "gpu0": DeviceConfig("gpu0", 20 << 30, ("chat", "embed"), DEFAULT_DEVICE_RESERVE)
    }
    groups = {name: model.group for name, model in config.models.items()}
    assert groups == {
        "chat": FITTING_GROUP,
        "embed": FITTING_GROUP,
        "task": "pair",
        "rag": "pair",
        "other": "",  # on gpu1, which has no [devices] table
    }
    worker = config.models["chat"].worker_config(tmp_path, embedding=False, n_ctx=2048)
    assert worker.group == FITTING_GROUP


def test_a_devices_table_may_leave_the_memory_to_be_measured_and_set_the_reserve(
    tmp_path: Path, env: dict[str, str]
) -> None:
    config = load_config(_write(tmp_path, MODELS + '[devices.gpu0]\nreserve = "2GiB"\n'), env=env)
    assert config.devices["gpu0"] == DeviceConfig("gpu0", None, ("chat", "embed"), 2 << 30)
    config = load_config(_write(tmp_path, MODELS + "[devices.gpu0]\n"), env=env)
    assert config.devices["gpu0"].reserve == DEFAULT_DEVICE_RESERVE
    assert config.models["chat"].group == FITTING_GROUP


def test_an_rpc_servers_models_may_be_a_fitting_set(tmp_path: Path, env: dict[str, str]) -> None:
    # Whether the server serves several clients at once is the daemon's to ask (supervisor.py).
    text = (
        '[daemon]\nrpc_servers = ["127.0.0.1:50052"]\n'
        '[models.x]\npath = "/models/x.gguf"\ndevices = ["rpc:127.0.0.1:50052"]\n'
        '[devices."rpc:127.0.0.1:50052"]\nmemory = "4GiB"\n'
    )
    config = load_config(_write(tmp_path, text), env=env)
    assert config.devices["rpc:127.0.0.1:50052"].members == ("x",)
    assert config.models["x"].group == FITTING_GROUP


def test_without_a_devices_table_nothing_changes(tmp_path: Path, env: dict[str, str]) -> None:
    config = load_config(_write(tmp_path, MODELS), env=env)
    assert config.devices == {}
    assert config.models["chat"].group == ""


@pytest.mark.parametrize(
    ("table", "key", "expected"),
    [
        ('[devices.gpu9x]\nmemory = "1GiB"\n', "devices.gpu9x", "a device id"),
        ("[devices.gpu0]\nmemory = 0\n", "devices.gpu0.memory", "more than 0"),
        ('[devices.gpu0]\nmemory = "lots"\n', "devices.gpu0.memory", "a number of bytes"),
        ('[devices.gpu0]\nmemory = "1GiB"\nspare = 1\n', "devices.gpu0.spare", "unknown"),
        ('[devices.gpu0]\nreserve = "lots"\n', "devices.gpu0.reserve", "a number of bytes"),
        ('[devices.gpu0]\nmemory = "512MiB"\n', "devices.gpu0.reserve", "512.0 MiB is not less"),
        ('[devices.gpu0]\nmemory = "8GiB"\nreserve = "8GiB"\n', "devices.gpu0.reserve", "not less"),
        ("devices = 3\n", "devices", "tables"),
        ('[groups.fitting]\nmodels = ["chat", "embed"]\n', "groups.fitting", "fitting set"),
    ],
)
def test_a_bad_devices_table_is_refused_naming_the_key(
    tmp_path: Path, env: dict[str, str], table: str, key: str, expected: str
) -> None:
    text = table + MODELS if table.startswith("devices =") else MODELS + table
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, text), env=env)
    assert key in str(caught.value)
    assert expected in str(caught.value)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return path
