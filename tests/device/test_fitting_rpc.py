"""A fitting set on an RPC device (issue 44): `arbiterd rpc-server --clients 4` serves each
client with a ggml server process of its own, so two tiny models on it are warm together and
alternate with no release; with room for one, each switch makes the other release in place, its
connection closes and its server process is idle again (it freed what the model held), and
every answer is the one the model gave first. A server of ggml's, which serves one client at a
time, is refused a fitting set: its models could never be warm together."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from arbiterd.errors import ConfigError
from tests.device.test_fitting_device import (
    ON_DEVICE,
    PROMPTS,
    alternate_warm_together,
    take_turns,
)
from tests.support.daemon import Daemon, serving, tiny
from tests.support.rpcservers import RpcServer, serving_processes, start_server
from tests.support.waiting import wait_until


def devices_table(device: str, memory: int | str) -> str:
    shown = f'"{memory}"' if isinstance(memory, str) else str(memory)
    return f'\n[devices."{device}"]\nmemory = {shown}\nreserve = 0\n'


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RpcServer]:
    server = start_server(tmp_path_factory.mktemp("rpc"), clients=4)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def daemon(front: RpcServer, tiny_model: Path) -> Iterator[Daemon]:
    models = {
        name: tiny(tiny_model, n_ctx=512, devices=[front.device], **ON_DEVICE) for name in PROMPTS
    }
    keys = {"rpc_servers": [front.endpoint]}
    pasted = devices_table(front.device, "1GiB")
    with serving(models, daemon_keys=keys, pasted=pasted) as running:
        yield running


def test_models_that_fit_are_warm_on_one_rpc_server_together(
    daemon: Daemon, front: RpcServer
) -> None:
    alternate_warm_together(daemon)
    assert len(serving_processes(front)) == 2  # a server process for each, at once


def test_with_room_for_one_each_switch_releases_and_idles_the_others_server_process(
    daemon: Daemon, front: RpcServer
) -> None:
    def one_left() -> None:
        # The other's connection closed with its release: its process is idle, one serves.
        wait_until(lambda: len(serving_processes(front)) == 1, 10, "the other's process to end")

    take_turns(daemon, front.device, partial(devices_table, front.device), one_left)


def test_a_server_of_one_client_at_a_time_is_refused_a_fitting_set(
    tmp_path: Path, tiny_model: Path
) -> None:
    stock = start_server(tmp_path)  # ggml's own server
    try:
        models = {"a": tiny(tiny_model, n_ctx=512, devices=[stock.device], **ON_DEVICE)}
        with serving(models, daemon_keys={"rpc_servers": [stock.endpoint]}) as daemon:
            daemon.config.write_text(
                daemon.config.read_text() + devices_table(stock.device, "1GiB")
            )
            with daemon.client() as client, pytest.raises(ConfigError) as refused:
                client.call("reload")
            said = str(refused.value)
            assert f'devices."{stock.device}": the RPC server at {stock.endpoint}' in said
            assert "serves one client at a time" in said
            assert "arbiterd rpc-server --clients N" in said
    finally:
        stock.kill()
