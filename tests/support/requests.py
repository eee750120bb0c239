"""Generation requests for tests and benchmarks, written as the worker protocol carries them."""

from __future__ import annotations

from typing import Any

from arbiterd.request import GenerateRequest


def request_for(kind: str, body: dict[str, Any]) -> GenerateRequest:
    """The record whose wire form (GenerateRequest.to_json) is `body` with `kind`."""
    return GenerateRequest.from_json({"kind": kind, **body})


def wire_of(request: GenerateRequest) -> tuple[str, dict[str, Any]]:
    """`request` as doubles of the service and the worker keep it: its kind, and the rest of
    its wire form."""
    body = request.to_json()
    return body.pop("kind"), body
