"""What a JSON request body may hold (issue 24): valid Unicode in every string and key, integers
of a bounded size, bounded nesting; each refusal names its field."""

from __future__ import annotations

import json

import pytest

from arbiterd.daemon.http import jsonbody
from arbiterd.daemon.http.jsonbody import (
    C_PARSER_MAX_STRINGS,
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_INTEGER_DIGITS,
    BodyRefused,
)

LONE = "ab\ud800cd"


def refusal(raw: bytes) -> BodyRefused:
    with pytest.raises(BodyRefused) as refused:
        jsonbody.parse(raw)
    return refused.value


@pytest.mark.parametrize(
    ("document", "param"),
    [
        ({"prompt": LONE}, "prompt"),
        ({"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
        (
            {"messages": [{"content": [{"type": "text", "text": "\udfff"}]}]},
            "messages[0].content[0].text",
        ),
        ({"metadata": {LONE: "x"}}, "metadata"),  # a key: named by the object that holds it
        ({LONE: 1}, None),  # a key of the body itself
        ({"stop": ["ok", "\udc80"]}, "stop[1]"),
        ({"a": {"b": [[{"c": LONE}]]}}, "a.b[0][0].c"),
        # A pair written the wrong way round is two lone surrogates.
        ({"prompt": "\ude00\ud83d"}, "prompt"),
        (LONE, None),
    ],
)
def test_a_lone_surrogate_is_refused_naming_its_field_at_any_depth(
    document: object, param: str | None
) -> None:
    refused = refusal(json.dumps(document).encode())  # ensure_ascii: written as the \ud800 escape
    assert refused.param == param
    assert refused.code == "invalid_value"
    assert "lone surrogate" in str(refused)
    assert str(refused).encode()  # the message itself is text UTF-8 can carry
    if param is not None:
        assert f"'{param}'" in str(refused)


# Every other class of code point is text: NUL, controls, private use, non-characters, the last
# code point, combining marks, right-to-left text, emoji (a surrogate pair in the JSON).
TEXTS = [
    "\x00",
    "\x1b[31m",
    "\ue000\U000f0000",
    "\ufffe\uffff",
    "\U0010ffff",
    "e\u0301",
    "\u202eabc\u05d0",
    "\U0001f600",
]


@pytest.mark.parametrize("text", TEXTS)
def test_every_other_code_point_is_text(text: str) -> None:
    document = {"prompt": text, text: [text]}
    for raw in (json.dumps(document).encode(), json.dumps(document, ensure_ascii=False).encode()):
        assert jsonbody.parse(raw) == document


def with_integer(digits: int, *, sign: str = "") -> bytes:
    """A body whose seed is an integer literal of `digits` digits (json.dumps cannot write one
    of more than 4,300)."""
    return b'{"model": "m", "options": {"seed": %s}}' % (sign + "9" * digits).encode()


@pytest.mark.parametrize("digits", [MAX_INTEGER_DIGITS + 1, 4300, 4301, 100_000])
@pytest.mark.parametrize("sign", ["", "-"])
def test_an_integer_of_too_many_digits_is_refused_naming_its_field(digits: int, sign: str) -> None:
    refused = refusal(with_integer(digits, sign=sign))
    assert refused.param == "options.seed"
    assert str(refused) == (
        f"'options.seed' is an integer of {digits} digits; arbiterd takes integers of at most "
        f"{MAX_INTEGER_DIGITS}"
    )


def test_an_integer_of_the_most_digits_is_taken() -> None:
    assert jsonbody.parse(with_integer(MAX_INTEGER_DIGITS)) == {
        "model": "m",
        "options": {"seed": int("9" * MAX_INTEGER_DIGITS)},
    }


def test_a_body_that_is_not_json_is_said_so_even_with_a_long_integer() -> None:
    refused = refusal(b'{"seed": ' + b"9" * 5000 + b", }")
    assert refused.param is None
    assert str(refused).startswith("the request body is not valid JSON: ")


def nested(levels: int) -> bytes:
    return b'{"a": ' * (levels - 1) + b"[1]" + b"}" * (levels - 1)


def test_nesting_is_bounded_and_the_refusal_names_the_field() -> None:
    assert jsonbody.parse(nested(MAX_DEPTH))
    refused = refusal(nested(MAX_DEPTH + 1))
    assert refused.param == ".".join(["a"] * MAX_DEPTH)
    assert f"nests deeper than {MAX_DEPTH} levels" in str(refused)


@pytest.mark.parametrize("strings", [0, C_PARSER_MAX_STRINGS + 1])
def test_a_body_nested_past_the_parsers_limit_is_not_json(strings: int) -> None:
    # Past Python's recursion limit, within MAX_CONTAINERS, read by either parser.
    refused = refusal(b"[" + b'"a",' * strings + b"[" * 50_000)
    assert str(refused) == "the request body is not valid JSON: nested too deeply"


def containers(count: int) -> bytes:
    """A body of `count` objects and arrays: [{}, [], {}, ...]."""
    return b"[" + b",".join([b"{}", b"[]"] * (count // 2))[: 3 * (count - 1) - 1] + b"]"


def test_a_body_of_too_many_objects_and_arrays_is_refused_before_it_is_parsed() -> None:
    taken = jsonbody.parse(containers(MAX_CONTAINERS))
    assert isinstance(taken, list)
    assert len(taken) == MAX_CONTAINERS - 1
    # Issue 40: 4 million lists 60 deep, 8 MiB, held the GIL 1.4 s as they were built. The
    # brackets of a string never count.
    for raw, count in [
        (containers(MAX_CONTAINERS + 1), MAX_CONTAINERS + 1),
        (b"[" * 59 + b"]" * 59 + b'"[{"' + b"[]" * 4_000_000, 4_000_059),
    ]:
        refused = refusal(raw)
        assert (refused.param, refused.code) == (None, "invalid_value")
        assert str(refused) == (
            f"the request body holds {count} objects and arrays; arbiterd takes at most "
            f"{MAX_CONTAINERS}"
        )


@pytest.mark.parametrize(
    "text",
    [
        "[{" * MAX_CONTAINERS,  # code in a prompt
        '\\"[{' * MAX_CONTAINERS,  # escaped quotes and backslashes around them
        "[" * (MAX_CONTAINERS + 1) + "\\",  # a string that ends in an escaped backslash
    ],
)
def test_brackets_in_strings_are_not_objects_or_arrays(text: str) -> None:
    document = {"prompt": text, "stop": [text, {"[": "]"}]}
    assert jsonbody.parse(json.dumps(document).encode()) == document


def test_a_body_of_many_strings_is_parsed_alike_and_checked_alike() -> None:
    # More than the C parser reads in one go: json's Python parser reads it.
    words = [f"w{index}" for index in range(C_PARSER_MAX_STRINGS)]
    document = {"input": words, "options": {"seed": 7, "temperature": 0.5, "stop": None}}
    raw = json.dumps(document).encode()
    assert raw.count(b'"') > 2 * C_PARSER_MAX_STRINGS
    assert jsonbody.parse(raw) == document
    assert refusal(json.dumps({**document, "prompt": LONE}).encode()).param == "prompt"
    huge = raw.replace(b'"seed": 7', b'"seed": ' + b"9" * 5000)
    assert refusal(huge).param == "options.seed"
    assert str(refusal(raw[:-1])).startswith("the request body is not valid JSON: ")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "the request body is empty; expected a JSON object"),
        (b'{"t": NaN}', "the request body is not valid JSON: NaN is not valid JSON"),
        (b'{"m": "\xff"}', "the request body is not valid JSON: 'utf-8' codec can't decode"),
    ],
)
def test_what_is_not_json_is_refused_for_the_body_as_a_whole(raw: bytes, message: str) -> None:
    refused = refusal(raw)
    assert (refused.param, refused.code) == (None, None)
    assert str(refused).startswith(message)
