"""A large body never stops the daemon answering (issue 40 item 4): the audit's 8 MiB bodies,
sent to a real daemon on its TCP port and on api.sock while another client times `/health`.
On 9b7a9a2 the 60-deep lists held `/health` 9.2 s; the figures with this change are
benchmarks/body_parsing.py's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from arbiterd.daemon.http.app import MAX_BODY_BYTES
from arbiterd.daemon.http.jsonbody import MAX_CONTAINERS
from tests.support.daemon import Daemon, serving, tiny
from tests.support.large_bodies import health_while_posting, legal_60_deep, lists_60_deep

# Far above what a health check takes here (milliseconds), far below the seconds a body
# parsed on the event loop held it.
HEALTH_BOUND_S = 0.5
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    with serving({"tiny": tiny(tiny_model)}) as running:
        yield running


def connecting(daemon: Daemon, over: str) -> Callable[[], httpx.Client]:
    if over == "api.sock":
        return partial(
            httpx.Client,
            transport=httpx.HTTPTransport(uds=str(daemon.api_socket)),
            base_url="http://arbiterd",
            timeout=DEADLINE_S,
        )
    return partial(httpx.Client, base_url=daemon.url.removesuffix("/v1"), timeout=DEADLINE_S)


@pytest.mark.parametrize("over", ["tcp", "api.sock"])
def test_health_answers_while_the_audits_60_deep_body_is_refused(daemon: Daemon, over: str) -> None:
    timed = health_while_posting(connecting(daemon, over), lists_60_deep())
    assert max(timed.health_s) < HEALTH_BOUND_S
    assert timed.answer.status_code == 400, timed.answer.text
    error = timed.answer.json()["error"]
    assert error["code"] == "invalid_value"
    assert f"arbiterd takes at most {MAX_CONTAINERS}" in error["message"]


@pytest.mark.parametrize("over", ["tcp", "api.sock"])
def test_health_answers_while_a_legal_8_mib_body_is_parsed_and_served(
    daemon: Daemon, over: str
) -> None:
    body = legal_60_deep()
    assert MAX_BODY_BYTES - 16 < len(body) <= MAX_BODY_BYTES
    timed = health_while_posting(connecting(daemon, over), body)
    assert max(timed.health_s) < HEALTH_BOUND_S
    assert timed.answer.status_code == 200, timed.answer.text
    assert timed.answer.headers["x-arbiterd-ignored"] == "metadata"
    assert json.loads(timed.answer.content)["choices"][0]["finish_reason"] in {"stop", "length"}
