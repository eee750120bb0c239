"""A frozen holder on a real daemon (issue 24): a warm worker stopped with SIGSTOP holds the GPU
token; status answers at once from what it said last, it is reported at holder_timeout_s and
killed at twice that, the GPU moves on to another model, and the stopped model restarts.

A frozen handoff too (issue 40): a worker stopped while warming, and one cooling on an RPC
server that stopped answering (SIGSTOP on `arbiterd rpc-server`: its connections stay open and
nothing comes back), are reported and killed the same way, and the device moves on."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from arbiterd.arena import Arena
from arbiterd.cli.controlclient import ControlClient
from arbiterd.daemon.models.liveness import STATUS_ANSWER_S
from arbiterd.paths import device_arena_of
from tests.support.daemon import Daemon, arbiterd_cli, openai_client, serving, tiny
from tests.support.rpcservers import RpcServer, rpc_servers
from tests.support.signals import stop
from tests.support.waiting import wait_until

HOLDER_TIMEOUT_S = 2.0
# What an answer from the daemon's memory may take on a busy CI machine; a frozen worker's
# figures come from there, without asking it.
PROMPT_S = 0.75
EVENT_TIMEOUT_S = 20.0


def complete(api: openai.OpenAI, model: str) -> str:
    answer = api.completions.create(model=model, prompt="the fox", max_tokens=2, temperature=0)
    return answer.choices[0].text


def model_status(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in status["models"] if m["name"] == name)


def timed_status(control: ControlClient) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    status = control.call("status")
    return status, time.monotonic() - started


def next_event(watcher: ControlClient, matches: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The next event the subscribed `watcher` gets that `matches`; fails after a while."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0:
        for event in watcher.events(timeout_s=left):
            if matches(event):
                return event
    raise AssertionError(f"no matching event within {EVENT_TIMEOUT_S} s")


def silent(killed: bool) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "holder_silent" and e["killed"] is killed


def test_a_stopped_holder_is_reported_then_killed_and_the_gpu_moves_on(tiny_model: Path) -> None:
    models = {"alpha": tiny(tiny_model), "beta": tiny(tiny_model)}
    keys = {"holder_timeout_s": HOLDER_TIMEOUT_S}
    with (
        serving(models, daemon_keys=keys) as daemon,
        openai_client(daemon) as api,
        daemon.client() as control,
        daemon.client() as watcher,
        ThreadPoolExecutor(2) as pool,
    ):
        watcher.call("subscribe")
        complete(api, "alpha")
        status = control.call("status")
        frozen = model_status(status, "alpha")
        assert frozen["state"] == "warm"
        assert status["holder"]["pid"] == frozen["pid"]  # it holds the token, and keeps it
        stop(frozen["pid"])
        beta_answer = pool.submit(complete, api, "beta")  # waits for the token alpha holds
        alpha_answer = pool.submit(complete, api, "alpha")  # sent to the stopped worker

        # Status asks the stopped worker, waits STATUS_ANSWER_S at most, and shows what it said.
        status, took_s = timed_status(control)
        assert took_s < STATUS_ANSWER_S + PROMPT_S
        stale = model_status(status, "alpha")
        assert (stale["state"], stale["pid"]) == ("warm", frozen["pid"])
        assert stale["stale_s"] is not None
        assert model_status(status, "beta")["stale_s"] is None

        reported = next_event(watcher, silent(killed=False))
        assert (reported["model"], reported["pid"]) == ("alpha", frozen["pid"])
        assert HOLDER_TIMEOUT_S <= reported["silent_s"] < 2 * HOLDER_TIMEOUT_S
        assert reported["timeout_s"] == HOLDER_TIMEOUT_S
        # Now its question has gone unanswered for long: nobody waits for it any more.
        status, took_s = timed_status(control)
        assert took_s < PROMPT_S
        reporting = model_status(status, "alpha")  # killed only a holder_timeout_s later
        assert (reporting["pid"], reporting["state"]) == (frozen["pid"], "warm")
        assert reporting["silent_s"] >= HOLDER_TIMEOUT_S
        assert reporting["stale_s"] >= HOLDER_TIMEOUT_S  # its last answer came before it stopped
        started = time.monotonic()
        assert httpx.get(f"{daemon.url}/models", timeout=10).status_code == 200
        assert time.monotonic() - started < PROMPT_S

        killed = next_event(watcher, silent(killed=True))
        assert (killed["model"], killed["pid"]) == ("alpha", frozen["pid"])
        assert killed["silent_s"] >= 2 * HOLDER_TIMEOUT_S
        crashed = next_event(watcher, lambda e: e["event"] == "worker" and e["model"] == "alpha")
        assert (crashed["pid"], crashed["code"]) == (frozen["pid"], -9)
        assert "no sign of life" in crashed["reason"]

        assert beta_answer.result(timeout=60)  # the kernel freed the token: beta served
        # Sent to the stopped worker, it never began there: its successor serves it (issue 40).
        assert alpha_answer.result(timeout=60)

        assert complete(api, "alpha")  # restarted as after any crash, and serving
        restarted = model_status(control.call("status"), "alpha")
        assert restarted["pid"] != frozen["pid"]
        assert (restarted["stale_s"], restarted["silent_s"]) == (None, None)
        assert_the_journal_says_it(daemon)


def assert_the_journal_says_it(daemon: Daemon) -> None:
    shown = arbiterd_cli("events", "--journal", str(daemon.journal))
    lines = [line for line in shown.splitlines() if "holder_silent" in line]
    assert [line.rpartition(": ")[2] for line in lines] == ["reported", "killed"], shown


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RpcServer]:
    with rpc_servers(tmp_path, 1) as (running,):
        yield running


def on_server(server: RpcServer, model: Path) -> dict[str, Any]:
    """A tiny model placed on `server`: its weights, KV and compute live there, and every
    handoff moves them over the wire."""
    return tiny(model, devices=[server.device], n_gpu_layers=-1, residency="in-place")


def serving_on(server: RpcServer, model: Path) -> Any:
    """alpha and beta, both on `server`: one device, one token between them."""
    models = {"alpha": on_server(server, model), "beta": on_server(server, model)}
    keys = {"holder_timeout_s": HOLDER_TIMEOUT_S, "rpc_servers": [server.endpoint]}
    return serving(models, daemon_keys=keys)


def resume(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def residency(model: str, to: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "residency" and e["model"] == model and e["to"] == to


def test_a_worker_stopped_while_warming_is_reported_then_killed_and_the_device_moves_on(
    tiny_model: Path, server: RpcServer
) -> None:
    with (
        serving_on(server, tiny_model) as daemon,
        openai_client(daemon) as api,
        daemon.client() as control,
        daemon.client() as watcher,
        ThreadPoolExecutor(2) as pool,
    ):
        assert complete(api, "alpha")
        control.call("release", model="alpha")  # both cold: alpha warms up on the next request
        pid = model_status(control.call("status"), "alpha")["pid"]
        watcher.call("subscribe")  # from here: the events of the warm-up to come
        # The server stopped: alpha's warm-up waits on it (its check that the server answers
        # waits rpc.PROBE_TIMEOUT_S), and is stopped meanwhile, holding the device's token.
        stop(server.process.pid)
        try:
            alpha_answer = pool.submit(complete, api, "alpha")
            next_event(watcher, residency("alpha", "warming"))
            stop(pid)
        finally:
            resume(server.process.pid)
        beta_answer = pool.submit(complete, api, "beta")  # waits for the token alpha holds

        reported = next_event(watcher, silent(killed=False))
        assert (reported["model"], reported["pid"], reported["state"]) == ("alpha", pid, "warming")
        assert HOLDER_TIMEOUT_S <= reported["silent_s"] < 2 * HOLDER_TIMEOUT_S
        killed = next_event(watcher, silent(killed=True))
        assert (killed["model"], killed["state"]) == ("alpha", "warming")
        assert killed["silent_s"] >= 2 * HOLDER_TIMEOUT_S

        assert beta_answer.result(timeout=60)  # the kernel freed the token: beta served
        with pytest.raises(openai.APIStatusError) as refused:
            alpha_answer.result(timeout=60)
        assert refused.value.status_code == 503
        assert "no sign of life" in str(refused.value)
        assert "while warming" in str(refused.value)
        assert complete(api, "alpha")  # restarted as after any crash, and serving


def test_a_model_cooling_on_a_stopped_rpc_server_is_killed_and_the_device_moves_on(
    tiny_model: Path, server: RpcServer
) -> None:
    with (
        serving_on(server, tiny_model) as daemon,
        openai_client(daemon) as api,
        daemon.client() as control,
        daemon.client() as watcher,
        ThreadPoolExecutor(1) as pool,
    ):
        assert complete(api, "beta")
        assert complete(api, "alpha")  # alpha warm on the server, beta cold (disconnected)
        pid = model_status(control.call("status"), "alpha")["pid"]
        watcher.call("subscribe")  # from here: the events of the handoff to come
        stop(server.process.pid)
        try:
            # beta wants the device: alpha cools, and its release waits on the stopped server.
            beta_answer = pool.submit(complete, api, "beta")
            next_event(watcher, residency("alpha", "cooling"))
            reported = next_event(watcher, silent(killed=False))
            assert (reported["model"], reported["pid"]) == ("alpha", pid)
            assert reported["state"] == "cooling"
            cooling = model_status(control.call("status"), "alpha")
            assert (cooling["state"], cooling["silent_s"] >= HOLDER_TIMEOUT_S) == ("cooling", True)
            killed = next_event(watcher, silent(killed=True))
            assert (killed["model"], killed["state"]) == ("alpha", "cooling")
        finally:
            resume(server.process.pid)  # beta, given the token, waits on the server's answer
        crashed = next_event(watcher, lambda e: e["event"] == "worker" and e["model"] == "alpha")
        assert (crashed["pid"], crashed["code"]) == (pid, -9)
        assert "while cooling" in crashed["reason"]
        # Its connection closed with it: the server serves beta, then alpha's new worker.
        assert beta_answer.result(timeout=60)
        assert complete(api, "alpha")


def test_a_worker_stopped_while_loading_with_the_token_is_killed_and_the_device_moves_on(
    tiny_model: Path, server: RpcServer
) -> None:
    with (
        serving_on(server, tiny_model) as daemon,
        openai_client(daemon) as api,
        daemon.client() as control,
        daemon.client() as watcher,
        ThreadPoolExecutor(2) as pool,
    ):
        old_pid = model_status(control.call("status"), "alpha")["pid"]
        control.call("unload", model="alpha")  # its next request starts a worker that loads
        control.call("release", model="beta")  # nobody warm: no release waits on the server
        arena = Arena(device_arena_of(server.device, daemon.arena))
        watcher.call("subscribe")
        # The server stopped: the load, once it has the token, waits on the server (its check
        # that the server answers waits rpc.PROBE_TIMEOUT_S), and is stopped meanwhile. No
        # event says when a loading worker took the token: the kernel's lock table does.
        stop(server.process.pid)
        try:
            alpha_answer = pool.submit(complete, api, "alpha")
            pid = wait_for_new_holder(arena, old_pid)
            stop(pid)
        finally:
            resume(server.process.pid)
        assert model_status(control.call("status"), "alpha")["state"] == "loading"
        beta_answer = pool.submit(complete, api, "beta")  # waits for the token alpha holds

        reported = next_event(watcher, silent(killed=False))
        assert (reported["model"], reported["pid"], reported["state"]) == ("alpha", pid, "loading")
        killed = next_event(watcher, silent(killed=True))
        assert (killed["model"], killed["state"]) == ("alpha", "loading")
        assert beta_answer.result(timeout=60)
        # alpha's request never began in the killed worker (a loading worker takes none): the
        # restarted worker serves it (issue 40 item 12), and the next one too.
        assert alpha_answer.result(timeout=60)
        assert complete(api, "alpha")


def wait_for_new_holder(arena: Arena, old_pid: int) -> int:
    """The pid of the process that takes `arena`'s token next, other than `old_pid`."""
    holders: list[int] = []

    def taken() -> bool:
        holder = arena.observe().holder_pid
        if holder is not None and holder != old_pid:
            holders.append(holder)
        return bool(holders)

    wait_until(taken, EVENT_TIMEOUT_S, "a new worker to take the server's token")
    return holders[0]


def test_a_model_cooling_on_a_server_that_stays_stopped_ends_failed_and_the_device_free(
    tiny_model: Path, server: RpcServer
) -> None:
    with (
        serving_on(server, tiny_model) as daemon,
        openai_client(daemon) as api,
        daemon.client() as control,
        daemon.client() as watcher,
        ThreadPoolExecutor(1) as pool,
    ):
        assert complete(api, "beta")
        assert complete(api, "alpha")  # alpha warm on the server, beta cold (disconnected)
        watcher.call("subscribe")
        stop(server.process.pid)
        try:
            beta_answer = pool.submit(complete, api, "beta")
            killed = next_event(watcher, silent(killed=True))
            assert (killed["model"], killed["state"]) == ("alpha", "cooling")
            # beta, given the token, finds the server silent within its probe and stays cold;
            # alpha's new worker fails its load the same way: each ends, none holds the device.
            with pytest.raises(openai.APIStatusError) as refused:
                beta_answer.result(timeout=60)
            assert refused.value.status_code == 503
            failed = next_event(watcher, residency("alpha", "failed"))
            assert server.endpoint in failed["reason"]
            arena = Arena(device_arena_of(server.device, daemon.arena))
            wait_until(lambda: arena.observe().holder_pid is None, 10, "the device to be free")
        finally:
            resume(server.process.pid)
        assert complete(api, "beta")  # the server answers again: both serve
        wait_until(
            lambda: model_status(control.call("status"), "alpha")["state"] != "failed",
            60,
            "alpha to load again",
        )
        assert complete(api, "alpha")
