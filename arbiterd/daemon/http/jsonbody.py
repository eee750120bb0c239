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

And a body holds at most MAX_CONTAINERS objects and arrays, counted before the parser makes any
(issue 40): json's C parser holds the GIL from start to end, so a body of millions of lists
kept every other thread waiting for seconds, the event loop included, wherever it was parsed.
What else it may hold the GIL for is bounded too: numbers are converted by functions of this
module (Python code, where another thread may take the GIL, at each one), and a body of more
than C_PARSER_MAX_STRINGS strings is read by json's Python parser, whose C parts each read one
string. app.py parses large bodies off the event loop; with these bounds the loop waits
tens of milliseconds at most for its turn.

Must never recurse over a body (it may nest as deep as the parser allows), and never put a
refused string itself in a message: that may be what cannot be encoded.
"""

from __future__ import annotations

import json
import json.scanner
import re
from dataclasses import dataclass

# Far more than a request needs (OpenAI bounds a structured output's schema at 10 levels), far
# less than the parser's own limit, Python's recursion limit.
MAX_DEPTH = 64
# Every integer a request takes fits in 20 characters (a seed is an int64); a JSON schema's
# bounds may be larger, but never meaningfully 100 digits.
MAX_INTEGER_DIGITS = 100
# Objects and arrays in one body. A request of 10,000 messages, each with a content part, has
# 30,000; the parser builds 65,536 in about 20 ms on a loaded machine, where 4 million 60-deep
# lists in 8 MiB took 1.4 s (issue 40).
MAX_CONTAINERS = 65_536
# Strings (keys included) json's C parser may read in one go: 2 million took 90 ms on a loaded
# machine, so 131,072 take about 6. A body with more (counted as quotes, escaped ones too) is
# read by json's Python parser, 8 times slower.
C_PARSER_MAX_STRINGS = 131_072
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
    """The JSON value of `raw`, checked to the last string (the module's rules)."""
    if not raw.strip():
        raise BodyRefused("the request body is empty; expected a JSON object")
    try:
        # As json.loads decodes bytes: UTF-8, 16 or 32 by the first bytes, lone surrogates kept
        # for `check` to name.
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except UnicodeDecodeError as exc:
        raise BodyRefused(f"the request body is not valid JSON: {exc}") from None
    containers = _containers(text)
    if containers > MAX_CONTAINERS:
        raise BodyRefused(
            f"the request body holds {containers} objects and arrays; arbiterd takes at most "
            f"{MAX_CONTAINERS}",
            code="invalid_value",
        )
    decoder = json.JSONDecoder(
        parse_constant=_reject_constant, parse_int=_integer, parse_float=_float
    )
    if text.count('"') > 2 * C_PARSER_MAX_STRINGS:
        # json.decoder's own choice when its C part is missing; one per body, for its memo.
        decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    try:
        document = decoder.decode(text)
    except RecursionError:
        raise BodyRefused("the request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError
        raise BodyRefused(f"the request body is not valid JSON: {exc}") from None
    check(document)
    return document


def _containers(text: str) -> int:
    """How many objects and arrays the JSON `text` holds, counted only as far as it takes to
    tell whether that is more than MAX_CONTAINERS: every bracket counts, unless it is in a
    string (a prompt of code may hold many). Exact for valid JSON; never less than the parser
    would build of invalid JSON before it stopped. Searches the text at C speed, with a turn
    of Python per string only for a body with more brackets than the bound."""
    brackets = text.count("[") + text.count("{")
    if brackets <= MAX_CONTAINERS:
        return brackets
    quote = text.find('"')
    while quote != -1 and brackets > MAX_CONTAINERS:
        end = _string_end(text, quote)
        if end == -1:  # unterminated: the parser stops there
            break
        brackets -= text.count("[", quote, end) + text.count("{", quote, end)
        quote = text.find('"', end + 1)
    return brackets


def _string_end(text: str, start: int) -> int:
    """Where the string that opens at `start` closes (its quote's index), or -1."""
    end = text.find('"', start + 1)
    while end != -1:
        escapes = end - 1
        while text[escapes] == "\\":
            escapes -= 1
        if (end - 1 - escapes) % 2 == 0:  # not an escaped quote
            return end
        end = text.find('"', end + 1)
    return -1


def check(document: object) -> None:
    """Refuse the first lone surrogate, overlong integer or level too deep in `document` (a
    parsed body). Written for speed: an 8 MiB body of 2 million integers takes a quarter as
    long to check as to parse."""
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
# as the whole test. Text that is all ASCII needs no closer look, and an integer none unless the
# parser marked it too long.


def _check_members(
    field: str, value: dict[str, object], depth: int, pending: list[tuple[str, object, int]]
) -> None:
    for key, item in value.items():
        if not key.isascii():
            _check_text(field, key, key=True)
        kind = type(item)
        if kind is dict or kind is list:
            pending.append((_member(field, key), item, depth + 1))
        elif (kind is str and not item.isascii()) or kind is _HugeInteger:  # type: ignore[attr-defined]
            _check_scalar(_member(field, key), item)


def _check_items(
    field: str, value: list[object], depth: int, pending: list[tuple[str, object, int]]
) -> None:
    for index, item in enumerate(value):
        kind = type(item)
        if kind is dict or kind is list:
            pending.append((f"{field}[{index}]", item, depth + 1))
        elif (kind is str and not item.isascii()) or kind is _HugeInteger:  # type: ignore[attr-defined]
            _check_scalar(f"{field}[{index}]", item)


def _check_scalar(field: str, value: object) -> None:
    """Refuse `value` if it is text with a lone surrogate or an integer of too many digits."""
    if isinstance(value, str):
        _check_text(field, value)
        return
    if not isinstance(value, _HugeInteger):
        return
    raise BodyRefused(
        f"{_name(field)} is an integer of {value.digits} digits; arbiterd takes integers of at "
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
    """An integer literal, converted unless it is too long to (int() raises past 4,300 digits,
    naming no place, and takes quadratic time below that): `check` names its field."""
    digits = len(literal) - literal.startswith("-")
    return _HugeInteger(digits) if digits > MAX_INTEGER_DIGITS else int(literal)


def _float(literal: str) -> float:
    # Python, not the parser's own conversion, only for the turn it gives other threads.
    return float(literal)


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")
