"""A JSON request body, parsed and checked once, before any route reads a field of it.

Owns the parsing of HTTP request bodies and the three things every body must be, whatever its
route (OpenAI's or Ollama's), each refused with a `BodyRefused` naming the field as the API
names fields (`messages[0].content`, `logit_bias`):
- **valid Unicode** in every string and every key, at any depth: JSON's `\\ud800` escape makes a
  lone surrogate, which UTF-8 cannot carry, so every encoder after the edge (the worker's
  tokenizer, the response) would fail on it (issue 24: such a prompt ended its worker);
- **integers of at most MAX_INTEGER_DIGITS digits**, refused before int() sees their literal:
  int() raises past 4,300 digits and takes quadratic time below that;
- **at most MAX_DEPTH levels of nesting**: what the daemon passes on, its worker parses again.

Must never recurse over a body (it may nest as deep as the parser allows), and never put a
refused string itself in a message: that may be what cannot be encoded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

# Far more than a request needs (OpenAI bounds a structured output's schema at 10 levels), far
# less than the parser's own limit, Python's recursion limit.
MAX_DEPTH = 64
# Every integer a request takes fits in 20 characters (a seed is an int64); a JSON schema's
# bounds may be larger, but never meaningfully 100 digits.
MAX_INTEGER_DIGITS = 100
_INTEGER_LIMIT = 10**MAX_INTEGER_DIGITS  # the least integer of more digits
_INTEGER_FLOOR = -_INTEGER_LIMIT
MAX_SHOWN_CHARS = 40  # of a key in a field's name
# A lone surrogate: in a str made by json.loads, a well-formed pair of escapes is one code point
# above U+FFFF, so every code point left in this range stands alone.
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyRefused(Exception):
    """A body that is not JSON, or holds what no route may take: `param` names the field (None
    for the body as a whole), `code` is the OpenAI envelope's (None where OpenAI has none)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class _HugeInteger:
    """What the parser makes of an integer literal too long to convert: its digits, counted."""

    digits: int


def parse(raw: bytes) -> object:
    """The JSON value of `raw`, checked to the last string (the module's three rules)."""
    if not raw.strip():
        raise BodyRefused("the request body is empty; expected a JSON object")
    try:
        document = _loads(raw, int)
    except ValueError:
        # Not JSON, or an integer past int()'s 4,300 digits, whose ValueError names no place:
        # parsed again with each literal counted before it is converted (3 times slower, and
        # only for a body refused either way), so that `check` names the field.
        document = _loads(raw, _integer)
    check(document)
    return document


def _loads(raw: bytes, integer: Callable[[str], object]) -> object:
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_int=integer)
    except RecursionError:
        raise BodyRefused("the request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        if integer is int:
            raise
        raise BodyRefused(f"the request body is not valid JSON: {exc}") from None


def check(document: object) -> None:
    """Refuse the first lone surrogate, overlong integer or level too deep in `document` (a
    parsed body). Written for speed: an 8 MiB body of 2 million integers takes about as long
    to check as to parse."""
    pending: list[tuple[str, object, int]] = [("", document, 1)]
    while pending:
        field, value, depth = pending.pop()
        if not isinstance(value, dict | list):  # the body itself is a scalar
            _check_scalar(field, value)
        elif depth > MAX_DEPTH:
            raise BodyRefused(
                f"{_name(field)} nests deeper than {MAX_DEPTH} levels",
                param=field or None,
                code="invalid_value",
            )
        elif isinstance(value, dict):
            _check_members(field, value, depth, pending)
        else:
            _check_items(field, value, depth, pending)


# The two loops below test each scalar inline, not in a function: a call per item costs as much
# as the whole test. Text that is all ASCII and an integer within bounds need no closer look.


def _check_members(
    field: str, value: dict[str, object], depth: int, pending: list[tuple[str, object, int]]
) -> None:
    for key, item in value.items():
        if not key.isascii():
            _check_text(field, key, key=True)
        kind = type(item)
        if kind is dict or kind is list:
            pending.append((_member(field, key), item, depth + 1))
        elif (
            (kind is str and not item.isascii())  # type: ignore[attr-defined]
            or (kind is int and not _INTEGER_FLOOR < item < _INTEGER_LIMIT)
            or kind is _HugeInteger
        ):
            _check_scalar(_member(field, key), item)


def _check_items(
    field: str, value: list[object], depth: int, pending: list[tuple[str, object, int]]
) -> None:
    for index, item in enumerate(value):
        kind = type(item)
        if kind is dict or kind is list:
            pending.append((f"{field}[{index}]", item, depth + 1))
        elif (
            (kind is str and not item.isascii())  # type: ignore[attr-defined]
            or (kind is int and not _INTEGER_FLOOR < item < _INTEGER_LIMIT)
            or kind is _HugeInteger
        ):
            _check_scalar(f"{field}[{index}]", item)


def _check_scalar(field: str, value: object) -> None:
    """Refuse `value` if it is text with a lone surrogate or an integer of too many digits."""
    if isinstance(value, str):
        _check_text(field, value)
        return
    if isinstance(value, _HugeInteger):
        digits = value.digits
    elif type(value) is int and not _INTEGER_FLOOR < value < _INTEGER_LIMIT:
        digits = len(str(abs(value)))
    else:
        return
    raise BodyRefused(
        f"{_name(field)} is an integer of {digits} digits; arbiterd takes integers of at "
        f"most {MAX_INTEGER_DIGITS}",
        param=field or None,
        code="invalid_value",
    )


def _check_text(field: str, text: str, *, key: bool = False) -> None:
    found = _SURROGATE.search(text)
    if found is None:
        return
    where = f"a key of {_name(field)}" if key else _name(field)
    raise BodyRefused(
        f"{where} holds a lone surrogate (U+{ord(found.group()):04X}) at character "
        f"{found.start()}: text must be valid Unicode, which UTF-8 can carry",
        param=field or None,
        code="invalid_value",
    )


def _member(field: str, key: str) -> str:
    shown = key if len(key) <= MAX_SHOWN_CHARS else key[: MAX_SHOWN_CHARS - 3] + "..."
    return f"{field}.{shown}" if field else shown


def _name(field: str) -> str:
    """A field as a message names it."""
    return f"'{field}'" if field else "the request body"


def _integer(literal: str) -> int | _HugeInteger:
    digits = len(literal) - literal.startswith("-")
    return _HugeInteger(digits) if digits > MAX_INTEGER_DIGITS else int(literal)


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")
