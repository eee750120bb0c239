"""An RPC server killed under the daemon (issue 27's faults): while its model is warm, that
model's request fails within seconds with ggml's reason, its restarted worker fails the load
naming the server (before it asks for any token), the model on the other server keeps serving,
and the model comes back by itself once the server does: its worker tries again with backoff."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.rpcservers import RpcServer, rpc_servers, start_server
from tests.support.waiting import wait_until

FAIL_WITHIN_S = 2.0  # the bound on a warm model's request once its server is gone
BACK_WITHIN_S = 60.0


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[RpcServer]]:
    with rpc_servers(tmp_path, 2) as running:
        yield running


@pytest.fixture
def daemon(servers: list[RpcServer], tiny_model: Path) -> Iterator[Daemon]:
    on: dict[str, Any] = {"n_gpu_layers": -1, "residency": "in-place"}
    models = {
        "doomed": tiny(tiny_model, n_ctx=256, devices=[servers[0].device], **on),
        "other": tiny(tiny_model, n_ctx=256, devices=[servers[1].device], **on),
    }
    keys = {"rpc_servers": [s.endpoint for s in servers]}
    with serving(models, daemon_keys=keys) as running:
        yield running


def ask(api: openai.OpenAI, model: str) -> str:
    done = api.completions.create(model=model, prompt="the fox", max_tokens=4, temperature=0)
    return done.choices[0].text


def state_of(daemon: Daemon, model: str) -> dict[str, Any]:
    with daemon.client() as client:
        models: dict[str, dict[str, Any]] = {m["name"]: m for m in client.call("status")["models"]}
    return models[model]


def wait_for(daemon: Daemon, model: str, state: str, within_s: float) -> dict[str, Any]:
    wait_until(lambda: state_of(daemon, model)["state"] == state, within_s, f"{model} {state}")
    return state_of(daemon, model)


def test_a_server_killed_while_its_model_is_warm_fails_it_naming_the_server_until_it_is_back(
    daemon: Daemon, servers: list[RpcServer], tmp_path: Path
) -> None:
    doomed = servers[0]
    with openai_client(daemon, timeout_s=120) as api:
        before = ask(api, "doomed")
        assert state_of(daemon, "doomed")["state"] == "warm"
        doomed.kill()
        started = time.monotonic()
        with pytest.raises(openai.APIError) as failed:
            ask(api, "doomed")
        assert time.monotonic() - started < FAIL_WITHIN_S
        # ggml's own message, not a debugger's backtrace, is what the worker's last words say.
        assert "Remote RPC server crashed" in str(failed.value), failed.value
        assert ask(api, "other")  # the other server's model serves meanwhile
        # Its worker restarted, and failed its load naming the server, before taking a token.
        shown = wait_for(daemon, "doomed", "failed", BACK_WITHIN_S)
        assert f"RPC server {doomed.endpoint} is not reachable" in shown["last_error"]
        with pytest.raises(openai.APIError, match=f"RPC server {doomed.endpoint}"):
            ask(api, "doomed")  # answered at once, with the reason
        port = int(doomed.endpoint.rpartition(":")[2])
        back = start_server(tmp_path, port=port)
        try:
            wait_for(daemon, "doomed", "warm", BACK_WITHIN_S)  # its retry found the server
            assert ask(api, "doomed") == before
            assert ask(api, "other")
        finally:
            back.kill()
