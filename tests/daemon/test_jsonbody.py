"""What a JSON request body may hold (issue 24): valid Unicode in every string and key, integers
of a bounded size, bounded nesting; each refusal names its field."""

from __future__ import annotations

import json

import pytest

from arbiterd.daemon import jsonbody
from arbiterd.daemon.jsonbody import MAX_DEPTH, MAX_INTEGER_DIGITS, BodyRefused

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


def test_a_body_nested_past_the_parsers_limit_is_not_json() -> None:
    refused = refusal(b"[" * 100_000)
    assert str(refused) == "the request body is not valid JSON: nested too deeply"


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
