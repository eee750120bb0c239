"""Turns (issue 43) on a real daemon with two tiny models: a wanted model serves what is queued
for it in one turn instead of handing the GPU over after each request, the waiter gets the GPU
once the turn ends, and a model that comes back serves everything queued for it since."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from arbiterd.arena import Arena
from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.waiting import wait_until

# Each answer of the short-turns test: long enough that a batch outlasts the turn.
SHORT_TURN_TOKENS = 1500


def queued_models(daemon: Daemon) -> list[str | None]:
    return [waiter.model for waiter in Arena(daemon.arena).observe().queue]


def other_waited_s(daemon: Daemon) -> float:
    state = Arena(daemon.arena).observe()
    return max(w.waited_s(state.observed_ns) for w in state.queue if w.model == "other")


def queued_requests(daemon: Daemon, model: str) -> int:
    with daemon.client() as client:
        status = client.call("status")
    queue: int = next(m["queue"] for m in status["models"] if m["name"] == model)
    return queue


def run_queued_behind_a_hold(
    daemon: Daemon, holder_requests: int, max_tokens: int, other_waits_s: float = 0.0
) -> list[dict[str, Any]]:
    """Queue `holder_requests` requests for "holder" and then one for "other" while the user's
    hold keeps the GPU, let go once "other" has waited `other_waits_s`, and return the events
    until all of them are answered."""
    errors: list[BaseException] = []

    def ask(model: str, client: openai.OpenAI) -> None:
        try:
            # Greedy: every answer runs its max_tokens (a sampled one may end at once).
            client.completions.create(
                model=model, prompt="the fox", max_tokens=max_tokens, temperature=0
            )
        except BaseException as exc:  # the test thread reports it
            errors.append(exc)

    with daemon.client() as listener, openai_client(daemon, timeout_s=120) as api:
        listener.call("subscribe")
        with daemon.client() as client:
            client.call("hold")
        threads = [
            threading.Thread(target=ask, args=("holder", api)) for _ in range(holder_requests)
        ]
        for thread in threads:
            thread.start()
        # The holder's worker queues for the GPU with its first request, the rest wait in its
        # own queue; the other model queues behind it.
        wait_until(lambda: queued_models(daemon) == ["holder"], 30, "holder in the GPU queue")
        wait_until(
            lambda: queued_requests(daemon, "holder") == holder_requests,
            30,
            "every holder request queued",
        )
        other = threading.Thread(target=ask, args=("other", api))
        other.start()
        wait_until(
            lambda: queued_models(daemon) == ["holder", "other"], 30, "other behind the holder"
        )
        wait_until(
            lambda: other_waited_s(daemon) >= other_waits_s, 30, f"other to wait {other_waits_s} s"
        )
        with daemon.client() as client:
            client.call("unhold")
        events: list[dict[str, Any]] = []
        for event in listener.events(timeout_s=120):
            events.append(event)
            if sum(e["event"] == "request" for e in events) == holder_requests + 1:
                break
        for thread in [*threads, other]:
            thread.join(timeout=60)
    assert not errors, errors
    return events


def after_the_unhold(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events from the holder's first warm-up on (its release for the hold comes before)."""
    first = next(i for i, e in enumerate(events) if e in warm_ups(events, "holder"))
    return events[first:]


def releases(events: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    return [
        e for e in events if e["event"] == "residency" and e["model"] == model and e["to"] == "cold"
    ]


def warm_ups(events: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    return [
        e for e in events if e["event"] == "residency" and e["model"] == model and e["to"] == "warm"
    ]


@pytest.fixture
def models(tiny_model: Path) -> dict[str, dict[str, Any]]:
    # Room for a batch of 4 sequences of SHORT_TURN_TOKENS each.
    return {"holder": tiny(tiny_model, n_ctx=8192), "other": tiny(tiny_model, n_ctx=8192)}


@pytest.fixture
def long_turns(models: dict[str, dict[str, Any]]) -> Iterator[Daemon]:
    """Turns of 5 s: longer than the holder's queue takes to serve."""
    with serving(models, daemon_keys={"min_turn_s": 5, "max_turn_s": 5}) as daemon:
        yield daemon


def test_a_wanted_model_serves_its_whole_queue_in_one_turn(long_turns: Daemon) -> None:
    events = after_the_unhold(run_queued_behind_a_hold(long_turns, 6, max_tokens=4))
    # One release, for the waiter, once the queue was served: before issue 43 the holder
    # released after its first request, a handoff per request.
    (release,) = releases(events, "holder")
    assert (release["reason"], release["turn_served"]) == ("wanted", 6)
    served = [e["model"] for e in events if e["event"] == "request"]
    assert served == ["holder"] * 6 + ["other"]
    with long_turns.client() as client:
        status = client.call("status")
    turn = next(m for m in status["models"] if m["name"] == "holder")["turn"]
    assert turn["quantum_s"] == 5  # the clamp: min_turn_s = max_turn_s
    assert turn["handoff_measured"]  # a release and a restore measured: not the prior
    assert turn["handoff_s"] > 0


@pytest.fixture
def short_turns(models: dict[str, dict[str, Any]]) -> Iterator[Daemon]:
    """Turns of 0.3 s: far shorter than the holder's queue takes to serve (12 requests of
    SHORT_TURN_TOKENS, decoded 4 at a time: the tiny model generates a few thousand tokens a
    second here, so each batch of 4 takes about a second)."""
    with serving(models, daemon_keys={"min_turn_s": 0.3, "max_turn_s": 0.3}) as daemon:
        yield daemon


def test_a_turn_ends_for_the_waiter_and_the_holder_comes_back_for_the_rest(
    short_turns: Daemon,
) -> None:
    events = after_the_unhold(
        run_queued_behind_a_hold(short_turns, 12, max_tokens=SHORT_TURN_TOKENS)
    )
    served = [e["model"] for e in events if e["event"] == "request"]
    first_turn = served.index("other")
    # The waiter did not wait for the whole queue, only for the turn ...
    assert 1 <= first_turn < 12, [
        (e["event"], e.get("model"), e.get("to"), e.get("reason"), e.get("at")) for e in events
    ]
    # ... and the holder, back, served everything left in its queue in the turns after.
    assert served[first_turn + 1 :] == ["holder"] * (12 - first_turn)
    first, *_ = releases(events, "holder")
    assert (first["reason"], first["turn_served"]) == ("wanted", first_turn)
    # The holder came back behind the other model: a handoff, its turn of one request said.
    back = [e for e in events if e["event"] == "handoff" and e["to"] == "holder"]
    assert [(h["from"], h["turn_served"]) for h in back] == [("other", 1)]
    # Every later release of the holder ended a turn that served a queue, not one request.
    assert len(releases(events, "holder")) + len(releases(events, "other")) < len(served) / 3


@pytest.fixture
def tight_bounds(models: dict[str, dict[str, Any]]) -> Iterator[Daemon]:
    """Turns of 3 s, and every class's bound 3 s too."""
    keys = {
        "min_turn_s": 3,
        "max_turn_s": 3,
        "max_wait_s": {"interactive": 3, "normal": 3, "batch": 3},
    }
    with serving(models, daemon_keys=keys) as daemon:
        yield daemon


def test_a_waiter_past_its_bound_ends_the_turn_at_once(tight_bounds: Daemon) -> None:
    """ "other" waited its 3 s behind the user's hold: the holder, warm at last, serves the
    request it woke for and lets go, though its quantum would have served its whole queue (as
    test_a_wanted_model_serves_its_whole_queue_in_one_turn does)."""
    events = run_queued_behind_a_hold(tight_bounds, 6, max_tokens=4, other_waits_s=3.2)
    events = after_the_unhold(events)
    served = [e["model"] for e in events if e["event"] == "request"]
    assert served == ["holder", "other", *["holder"] * 5]
    first, *_ = releases(events, "holder")
    assert (first["reason"], first["turn_served"]) == ("wanted", 1)
