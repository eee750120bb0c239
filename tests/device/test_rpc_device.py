"""The in-place backend with the model on llama.cpp RPC devices (issue 27): two `arbiterd
rpc-server` processes on 127.0.0.1, each ggml's own server serving this machine's CPU, are two
devices of the engine. The GPU path of the patch runs over a socket: each RPC buffer freed on
the server, allocated again, re-pointed, its weights uploaded from the host copy of the file.

A ggml RPC server serves one client at a time and frees what a client held when it
disconnects, so a release also closes the connection: the server's memory drops, and another
client (a probe here; another model in the daemon) can connect while the model is cold.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiterd.errors import DeviceUnreachableError, ModelLoadError
from arbiterd.native import ggml, rpc
from arbiterd.spec import KvPolicy, ModelSpec, Residency
from arbiterd.worker.engine import InPlaceBackend, select_backend
from tests.support.requests import request_for
from tests.support.rpcservers import RpcServer, rpc_servers, start_server

PROMPT = " ".join(["the quick brown fox is not a dog"] * 10)
# What a release must give back of what a model took on a server (the figure).
FREED_SHARE = 0.9


def greedy() -> dict[str, object]:
    return {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 5}


def choice(response: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = response["choices"][0]
    return {"text": first["text"], "logprobs": first["logprobs"]}


def on_servers(model: Path, servers: list[RpcServer], n_ctx: int = 512) -> InPlaceBackend:
    spec = ModelSpec(
        name="m",
        path=model,
        n_ctx=n_ctx,
        residency=Residency.IN_PLACE,
        devices=tuple(server.device for server in servers),
    )
    chosen = select_backend(spec)
    assert isinstance(chosen, InPlaceBackend), "the engine is not the arbiterd build"
    return chosen


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RpcServer]]:
    with rpc_servers(tmp_path_factory.mktemp("rpc"), 2) as running:
        yield running


@pytest.mark.parametrize("kv", [KvPolicy.HOST, KvPolicy.DROP])
def test_a_model_split_over_two_rpc_servers_round_trips_in_place_and_frees_the_servers(
    servers: list[RpcServer], gemma_model: Path, kv: KvPolicy
) -> None:
    cold = [server.anon_bytes() for server in servers]
    backend = on_servers(gemma_model, servers)
    backend.load()
    try:
        first = backend.generate(request_for("completion", greedy()), None)
        control = (
            first
            if kv is KvPolicy.DROP
            else backend.generate(request_for("completion", greedy()), None)
        )
        warm = [server.anon_bytes() for server in servers]
        assert all(w > c for w, c in zip(warm, cold, strict=True))  # each holds a share
        released = backend.release(kv)
        # Every weight on the servers comes back from the host copy of the file: none copied.
        assert released.weights_bytes > 0
        assert released.file_bytes == released.weights_bytes
        assert released.copied_bytes == (released.kv_bytes if kv is KvPolicy.HOST else 0)
        # The connections closed: each server freed the model's share and serves the next.
        for server, c, w in zip(servers, cold, warm, strict=True):
            assert rpc.probe(server.endpoint).devices
            assert w - server.anon_bytes() >= FREED_SHARE * (w - c), server.endpoint
        restored = backend.restore()
        assert restored.file_bytes == released.file_bytes
        assert restored.kv_bytes == released.kv_bytes
        again = backend.generate(request_for("completion", greedy()), None)
        assert choice(again.response) == choice(control.response)
        expected = first.prompt_tokens if kv is KvPolicy.DROP else 1
        assert again.prompt_tokens_evaluated == expected
    finally:
        backend.close()


def test_a_server_down_while_cold_fails_the_warm_up_cleanly_and_it_comes_back_with_the_server(
    tmp_path: Path, tiny_model: Path
) -> None:
    server = start_server(tmp_path)
    backend = on_servers(tiny_model, [server])
    backend.load()
    try:
        backend.generate(request_for("completion", greedy()), None)
        # As the restored model answers: the prompt from the cache, its last token evaluated
        # (a whole prefill's batches may round the last bit of a logprob otherwise).
        control = backend.generate(request_for("completion", greedy()), None)
        backend.release(KvPolicy.HOST)
        port = int(server.endpoint.rsplit(":", 1)[1])
        server.kill()
        with pytest.raises(DeviceUnreachableError, match=server.endpoint):
            backend.restore()
        assert backend.resident_bytes() == 0  # still cold, nothing half restored
        assert backend.host_kv_bytes() > 0  # the prompt cache is kept
        server = start_server(tmp_path, port)  # a new server: nothing of the model on it
        backend.restore()
        again = backend.generate(request_for("completion", greedy()), None)
        assert choice(again.response) == choice(control.response)
        assert again.prompt_tokens_evaluated == 1
    finally:
        backend.close()
        server.kill()


def test_a_device_the_engine_does_not_offer_is_refused_naming_those_it_does(
    vulkan0: ggml.Device, tiny_model: Path
) -> None:
    spec = ModelSpec(name="m", path=tiny_model, n_ctx=256, devices=("gpu7",))
    backend = select_backend(spec)
    with pytest.raises(ModelLoadError, match=r"gpu7, which this engine does not offer") as err:
        backend.load()
    assert f"gpu0 ({vulkan0.label})" in str(err.value)


def test_a_server_that_is_not_there_fails_the_load_naming_it(
    tmp_path: Path, tiny_model: Path
) -> None:
    down = start_server(tmp_path)
    down.kill()
    backend = on_servers(tiny_model, [down])
    with pytest.raises(DeviceUnreachableError, match=rf"RPC server {down.endpoint} is not"):
        backend.load()
