"""The 8 MiB bodies of issue 40's audit, as chat requests to a model named "tiny" whose ignored
`metadata` holds the weight, and a clock on `/health` while one is sent and answered: what
tests/daemon/test_serve_bodies.py checks and benchmarks/body_parsing.py measures."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from arbiterd.daemon.http.app import MAX_BODY_BYTES
from arbiterd.daemon.http.jsonbody import MAX_CONTAINERS

DEPTH = 60  # the audit's, within jsonbody.MAX_DEPTH
JSON = {"content-type": "application/json"}
_HEAD = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '


def chat(metadata: bytes) -> bytes:
    """A chat request whose ignored `metadata` is {"x": `metadata`}."""
    return _HEAD + b'"metadata": {"x": ' + metadata + b"}}"


def _filled(unit: bytes, room: int) -> bytes:
    """A list of as many `unit` as `room` bytes hold."""
    return b"[" + b",".join([unit] * ((room - 2) // (len(unit) + 1))) + b"]"


def _nested(opening: bytes, closing: bytes) -> bytes:
    """DEPTH - 1 levels, which make DEPTH in the list that holds them."""
    return opening * (DEPTH - 1) + b"0" + closing * (DEPTH - 1)


def full(unit: bytes, *, before: bytes = b"") -> bytes:
    """A chat request of MAX_BODY_BYTES at most: `before`, then as many `unit` as fit."""
    frame = len(chat(b"[" + before + b"]"))
    return chat(b"[" + before + _filled(unit, MAX_BODY_BYTES - frame)[1:])


LISTS = _nested(b"[", b"]")
OBJECTS = _nested(b'{"a":', b"}")


def lists_60_deep() -> bytes:
    """The audit's worst: 60-deep lists filling 8 MiB, about 4 million of them (held
    `/health` 9.2 s on 9b7a9a2)."""
    return full(LISTS)


def objects_60_deep() -> bytes:
    return full(OBJECTS)


def flat_numbers() -> bytes:
    """4 million integers in one list."""
    return full(b"1")


def legal_60_deep() -> bytes:
    """As many 60-deep lists as a body may hold (jsonbody.MAX_CONTAINERS), then 2 million
    numbers with a fraction to 8 MiB."""
    chains = b",".join([LISTS] * ((MAX_CONTAINERS - 8) // (DEPTH - 1)))
    return full(b"1.5", before=chains + b",")


@dataclass(frozen=True)
class Timed:
    """The answer to a large body, how long it took, and each `/health` asked meanwhile."""

    answer: httpx.Response
    answer_s: float
    health_s: tuple[float, ...]


def health_while_posting(connect: Callable[[], httpx.Client], body: bytes) -> Timed:
    """Post `body` to /v1/chat/completions on one connection of `connect`, and ask `/health`
    on another, one after another, until the answer came (once at least)."""
    answers: list[httpx.Response] = []
    with connect() as poster, connect() as prober:
        assert prober.get("/health").status_code == 200  # connected before the body goes
        started = time.monotonic()

        def post() -> None:
            answers.append(poster.post("/v1/chat/completions", content=body, headers=JSON))

        sending = threading.Thread(target=post, name="large-body")
        sending.start()
        health_s: list[float] = []
        while sending.is_alive() or not health_s:
            asked = time.monotonic()
            assert prober.get("/health").status_code == 200
            health_s.append(time.monotonic() - asked)
        sending.join()
        answer_s = time.monotonic() - started
    assert answers, "the post raised: see the thread's traceback"
    return Timed(answers[0], answer_s, tuple(health_s))
