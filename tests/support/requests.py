"""Generation requests for tests and benchmarks, built as records (no dialect to parse)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from arbiterd.request import GenerateRequest, Sampling
from arbiterd.states import Priority, RequestKind

_SAMPLING = {each.name for each in fields(Sampling)}
_TUPLES = {"messages", "inputs", "images", "tools"}


def request_for(kind: str, body: dict[str, Any]) -> GenerateRequest:
    """The record of `kind` with `body`'s fields: GenerateRequest's own, and Sampling's beside
    them (`max_tokens`, `temperature`, ...) for short; lists are taken as the tuples the record
    holds."""
    sampling: dict[str, Any] = {key: value for key, value in body.items() if key in _SAMPLING}
    if "stop" in sampling:
        sampling["stop"] = tuple(sampling["stop"])
    given: dict[str, Any] = {
        key: tuple(value) if key in _TUPLES else value
        for key, value in body.items()
        if key not in _SAMPLING
    }
    if "priority" in given:
        given["priority"] = Priority(given["priority"])
    return GenerateRequest(RequestKind(kind), sampling=Sampling(**sampling), **given)


def wire_of(request: GenerateRequest) -> tuple[str, dict[str, Any]]:
    """`request` as doubles of the service and the worker keep it: its kind, and the rest of
    its wire form (GenerateRequest.to_json: its own fields)."""
    body = request.to_json()
    return body.pop("kind"), body
