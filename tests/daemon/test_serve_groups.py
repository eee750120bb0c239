"""Groups end to end: a real daemon with two tiny models in one group and one outside it. The
members are warm at once and alternate with no handoff; a program outside the group (a model
outside it, a game) makes every member release once, and the group takes the GPU back after."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from arbiterd.arena import Arena
from tests.support.daemon import Daemon, serving
from tests.support.daemon import tiny as tiny_table
from tests.support.waiting import wait_until

# The tiny model as every test here runs it.
tiny = partial(tiny_table, n_ctx=512, min_hold_s=0.02)


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    with serving(
        {"a": tiny(tiny_model), "b": tiny(tiny_model), "solo": tiny(tiny_model)},
        groups={"pair": ["a", "b"]},
    ) as running:
        yield running


def ask(daemon: Daemon, model: str) -> None:
    body = {"model": model, "prompt": "the fox", "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{daemon.url}/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def last_seq(daemon: Daemon) -> int:
    with daemon.client() as client:
        found = client.call("events", limit=500)["events"]
    return max((int(e["seq"]) for e in found), default=0)


def events_after(daemon: Daemon, seq: int) -> list[dict[str, Any]]:
    with daemon.client() as client:
        found: list[dict[str, Any]] = client.call("events", after_seq=seq, limit=500)["events"]
    return found


def releases(found: list[dict[str, Any]], model: str) -> int:
    return sum(
        1
        for e in found
        if e["event"] == "residency"
        and e["model"] == model
        and (e["from"], e["to"]) == ("cooling", "cold")
    )


def states(daemon: Daemon) -> dict[str, str]:
    with daemon.client() as client:
        return {m["name"]: m["state"] for m in client.call("status")["models"]}


def test_members_are_warm_together_and_alternate_without_handoffs(daemon: Daemon) -> None:
    ask(daemon, "a")
    ask(daemon, "b")
    before = last_seq(daemon)
    for model in ["a", "b"] * 4:
        ask(daemon, model)
    assert {k: v for k, v in states(daemon).items() if k != "solo"} == {"a": "warm", "b": "warm"}
    new = events_after(daemon, before)
    assert [e for e in new if e["event"] == "handoff"] == []
    assert releases(new, "a") == releases(new, "b") == 0
    with daemon.client() as client:
        status = client.call("status")
    (group,) = status["groups"]
    assert (group["name"], group["models"], group["holds_token"]) == ("pair", ["a", "b"], True)
    assert status["holder"]["name"] == "group pair"


def test_a_model_outside_the_group_makes_every_member_release_once(daemon: Daemon) -> None:
    ask(daemon, "a")
    ask(daemon, "b")
    before = last_seq(daemon)
    ask(daemon, "solo")
    assert states(daemon) == {"a": "cold", "b": "cold", "solo": "warm"}
    ask(daemon, "a")  # the group takes the GPU back for a; b stays cold until asked
    new = events_after(daemon, before)
    assert (releases(new, "a"), releases(new, "b"), releases(new, "solo")) == (1, 1, 1)
    handoffs = [(e["from"], e["to"]) for e in new if e["event"] == "handoff"]
    assert handoffs == [("solo", "a")]
    ask(daemon, "b")  # through the open gate: no handoff, solo stays cold
    assert states(daemon) == {"a": "warm", "b": "warm", "solo": "cold"}


def test_a_game_makes_the_whole_group_release_and_the_group_comes_back(daemon: Daemon) -> None:
    ask(daemon, "a")
    ask(daemon, "b")
    before = last_seq(daemon)
    token = Arena(daemon.arena).acquire("game", timeout_s=60)
    try:
        assert states(daemon) == {"a": "cold", "b": "cold", "solo": "cold"}
        with daemon.client() as client:
            assert client.call("status")["groups"][0]["holds_token"] is False
        asking = threading.Thread(target=ask, args=(daemon, "a"))
        asking.start()  # a waits behind the game: the group's keeper queues for it ...
        wait_until(token.wanted, 60, "the keeper to queue for a")
    finally:
        token.release()
    asking.join(timeout=120)  # ... and gets the GPU back for the group
    ask(daemon, "b")
    new = events_after(daemon, before)
    assert (releases(new, "a"), releases(new, "b")) == (1, 1)
    waits = [e for e in new if e["event"] == "wait"]
    assert [(e["model"], e["holder_name"]) for e in waits] == [("a", "game")]
    assert states(daemon) == {"a": "warm", "b": "warm", "solo": "cold"}
