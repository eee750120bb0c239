"""Stable error codes: unique, each standing for one class, mapped once to their outcomes."""

from __future__ import annotations

import pytest

from arbiterd import errors
from arbiterd.errors import (
    OUTCOMES,
    AcquireCancelledError,
    ArbiterError,
    CommandNotFoundError,
    ConfigError,
    ContextOverflowError,
    EngineError,
    ErrorCode,
    InvalidTransitionError,
    ProtocolError,
    RequestError,
    ResidencyCallError,
    UnknownModelError,
    WorkerError,
    WorkerGoneError,
    error_from_wire,
)


def every_class() -> list[type[ArbiterError]]:
    found: list[type[ArbiterError]] = [ArbiterError]
    for cls in found:
        found.extend(cls.__subclasses__())
    return found


CODED = [cls for cls in every_class() if "code" in cls.__dict__]
UNCODED = [cls for cls in every_class() if "code" not in cls.__dict__]


def test_error_codes_are_unique_strings() -> None:
    values = [code.value for code in ErrorCode.__members__.values()]
    assert len(values) == len(set(values))  # no alias: each string names one code


def test_every_code_stands_for_exactly_one_class() -> None:
    codes = [cls.code for cls in CODED]
    assert sorted(codes) == sorted(ErrorCode)  # each code declared once, none left without one
    for code in ErrorCode:
        assert type(error_from_wire({"code": code.value, "message": "m"})).code is code


def test_every_code_has_its_outcome_at_the_edges() -> None:
    assert set(OUTCOMES) == set(ErrorCode)
    for code, outcome in OUTCOMES.items():
        assert outcome.http_status in {400, 404, 413, 422, 429, 500, 503}, code
        assert outcome.exit_code != 0, code


@pytest.mark.parametrize("cls", CODED, ids=lambda cls: cls.__name__)
def test_a_class_with_its_own_code_crosses_the_wire_as_itself(cls: type[ArbiterError]) -> None:
    sent = cls("models.m.path: expected a file, got a directory")
    wire = sent.to_wire()
    assert wire == {"code": cls.code.value, "message": str(sent)}
    received = error_from_wire(wire)
    assert type(received) is cls
    assert str(received) == str(sent)
    assert (received.http_status, received.exit_code) == (sent.http_status, sent.exit_code)


@pytest.mark.parametrize("cls", UNCODED, ids=lambda cls: cls.__name__)
def test_a_class_without_its_own_code_shares_its_parents(cls: type[ArbiterError]) -> None:
    parent = cls.__mro__[1]
    assert issubclass(parent, ArbiterError)
    assert cls.code is parent.code
    assert cls.exit_code == parent.exit_code


def test_a_subclass_without_a_code_arrives_as_the_class_its_code_stands_for() -> None:
    received = error_from_wire(InvalidTransitionError("m: stopped → ready").to_wire())
    assert type(received) is WorkerError
    assert str(received) == "m: stopped → ready"
    overflowed = error_from_wire(ResidencyCallError("release returned 3", status=3).to_wire())
    assert type(overflowed) is EngineError


@pytest.mark.parametrize(
    "raw",
    [
        {"code": "a_code_from_a_newer_worker", "message": "something new"},
        {"code": None, "message": "something new"},
        {"message": "something new"},
    ],
)
def test_an_unknown_code_is_a_worker_error_with_the_message_that_came(raw: object) -> None:
    received = error_from_wire(raw)
    assert type(received) is WorkerError
    assert str(received) == "something new"


def test_an_unknown_code_without_a_message_says_the_code() -> None:
    received = error_from_wire({"code": "nova"})
    assert type(received) is WorkerError
    assert "nova" in str(received)


@pytest.mark.parametrize("raw", ["ContextOverflowError", None, ["context_overflow", "x"]])
def test_an_error_that_is_not_an_object_is_a_worker_error(raw: object) -> None:
    received = error_from_wire(raw)
    assert type(received) is WorkerError
    assert "malformed" in str(received)


@pytest.mark.parametrize(
    ("error", "http_status", "exit_code"),
    [
        (UnknownModelError("no model named 'x'"), 404, 65),
        (ContextOverflowError("the prompt exceeds the context window"), 400, 65),
        (RequestError("bad request"), 400, 65),
        (EngineError("m failed to load"), 503, 70),
        (WorkerGoneError("worker for m is gone"), 503, 70),
        (ProtocolError("message is not JSON"), 503, 70),
        (ConfigError("models.m.path: expected a file"), 500, 78),
        (AcquireCancelledError("interrupted"), 503, 130),
        (CommandNotFoundError("no such program: nope"), 500, 127),
        (ArbiterError("anything"), 500, 1),
    ],
)
def test_each_error_says_its_http_status_and_exit_code(
    error: ArbiterError, http_status: int, exit_code: int
) -> None:
    assert (error.http_status, error.exit_code) == (http_status, exit_code)


def test_a_second_class_for_a_code_already_taken_is_refused() -> None:
    with pytest.raises(TypeError, match="worker already stands for WorkerError"):

        class AnotherWorkerError(ArbiterError):
            code = ErrorCode.WORKER

    assert type(error_from_wire({"code": "worker", "message": "m"})) is WorkerError


def test_every_class_of_the_module_is_drawn_in_its_docstring() -> None:
    doc = errors.__doc__ or ""
    defined = [cls for cls in every_class() if cls.__module__ == errors.__name__]
    assert [cls.__name__ for cls in defined if f" {cls.__name__} " not in doc] == []
