"""Records as JSON, field by field: the one codec every record that travels between arbiterd's
processes is read and written by, driven by its fields' types, so no record writes its own.

Two variants. The tolerant one (`Record`: `from_json`, `to_json`) never raises: a field that is
missing or of the wrong type reads as None (or empty), a value an Enum does not know as its
UNKNOWN, extra fields are ignored; the events (arbiterd/events.py), the status records
(arbiterd/status.py) and the worker's replies (arbiterd/reply.py) read so, because an older or a
newer process may have written them. The strict one (`strict_decode`, `strict_encode`) reads a
record that one process writes and another runs, the generation request (arbiterd/request.py):
there a field that does not read fails the message.

Shared by every process: imports nothing of arbiterd's, and never Qt.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Self, TypeVar

# -- the field codec -------------------------------------------------------------------------
#
# One reader and one writer per field, chosen once per record class from the field's type:
#
#     float | None, int | None   a finite number (not a bool), else None
#     int                        a finite number (not a bool), else 0
#     float                      a finite number (not a bool), else 0.0
#     str | None / str           a string, else None / ""
#     bool                       true only for JSON true
#     a states.py Enum | None    its member (an unknown value: UNKNOWN), a non-string None;
#                                an Enum without UNKNOWN (Priority): an unknown value None too
#     Enum | Enum (states.py's)  the member of the first that knows the value, else the first's
#                                UNKNOWN (a non-string too): one name that may be either
#     Record | None              an object read as that record, else None
#     tuple[str, ...]            the strings of a list; written as a list
#     tuple[Record, ...]         the objects of a list, each read as that record; written as a list
#     tuple[tuple[str, T], ...]  an object of str keys, each value read as T; written as an object
#     dict[str, Any]             an object kept as it came (a payload this codec does not look
#                                into: a reply's OpenAI response), else {}
#
# A field's JSON name is its own unless its metadata names another (`metadata={"json": "from"}`:
# a Python keyword, or a name that reads better in Python).

_Reader = Callable[[object], Any]
_D = TypeVar("_D")
_Writer = Callable[[Any], Any]


def finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: object) -> int | None:
    number = finite(value)
    return None if number is None else int(number)


def _count(value: object) -> int:
    number = _int(value)
    return 0 if number is None else number


def _rate(value: object) -> float:
    number = finite(value)
    return 0.0 if number is None else number


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _true(value: object) -> bool:
    return value is True


def _names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(item for item in value if isinstance(item, str))


def _mappings(value: object) -> list[Mapping[str, Any]]:
    if not isinstance(value, list | tuple):
        return []
    return [item for item in value if isinstance(item, Mapping)]


def _same(value: Any) -> Any:
    return value


def _object(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        return {}
    return {name: item for name, item in value.items() if isinstance(name, str)}


_SCALARS: dict[object, _Reader] = {
    float | None: finite,
    int | None: _int,
    int: _count,
    float: _rate,
    str | None: _str,
    str: text,
    bool: _true,
}


def _member(kind: type[enum.StrEnum]) -> _Reader:
    def read(value: object) -> Any:
        if not isinstance(value, str):
            return None
        try:
            return kind(value)  # a tolerant Enum reads an unknown value as UNKNOWN
        except ValueError:  # one without UNKNOWN: no member, no value
            return None

    return read


def _value(member: enum.StrEnum | None) -> str | None:
    return None if member is None else str(member)  # a StrEnum's str() is its value


def _names_a_value(kind: object) -> bool:
    """Whether `kind` is a StrEnum (states.py's): an optional one reads as its member or None."""
    return isinstance(kind, type) and issubclass(kind, enum.StrEnum)


def _tolerant(kind: object) -> bool:
    """Whether `kind` is an Enum that reads an unknown value as UNKNOWN (states.py's): only
    such an Enum can stand in a union of Enums, whose reading falls back on its UNKNOWN."""
    return (
        isinstance(kind, type) and issubclass(kind, enum.StrEnum) and "UNKNOWN" in kind.__members__
    )


def _either(kinds: tuple[type[enum.StrEnum], ...]) -> _Reader:
    def read(value: object) -> Any:
        for kind in kinds:
            if isinstance(value, str) and (member := kind(value)) is not kind("unknown"):
                return member
        return kinds[0]("unknown")

    return read


def _record(kind: type[Record]) -> _Reader:
    def read(value: object) -> Record | None:
        return kind.from_json(value) if isinstance(value, Mapping) else None

    return read


def _written_record(record: Record | None) -> dict[str, Any] | None:
    return None if record is None else record.to_json()


def _records(kind: type[Record]) -> _Reader:
    def read(value: object) -> tuple[Record, ...]:
        return tuple(kind.from_json(item) for item in _mappings(value))

    return read


def _written_records(records: tuple[Record, ...]) -> list[dict[str, Any]]:
    return [record.to_json() for record in records]


def _pairs(read_value: _Reader) -> _Reader:
    def read(value: object) -> tuple[tuple[str, Any], ...]:
        items = value.items() if isinstance(value, Mapping) else ()
        return tuple((name, read_value(item)) for name, item in items if isinstance(name, str))

    return read


def _union_codec(args: tuple[Any, ...]) -> tuple[_Reader, _Writer] | None:
    """The codec of an optional Enum or record, or of a union of Enums; None for another."""
    if len(args) == 2 and args[1] is type(None):
        kind = args[0]
        if _names_a_value(kind):
            return _member(kind), _value
        if isinstance(kind, type) and issubclass(kind, Record):
            return _record(kind), _written_record
    if all(_tolerant(kind) for kind in args):
        return _either(args), str
    return None


def _codec_of(hint: Any) -> tuple[_Reader, _Writer]:
    """The reader and writer of a field of type `hint` (the table above)."""
    if hint in _SCALARS:
        return _SCALARS[hint], _same
    if hint == dict[str, Any]:
        return _object, dict
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and (codec := _union_codec(args)) is not None:
        return codec
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if item is str:
            return _names, list
        if isinstance(item, type) and issubclass(item, Record):
            return _records(item), _written_records
        if typing.get_origin(item) is tuple and typing.get_args(item)[0] is str:
            return _pairs(_codec_of(typing.get_args(item)[1])[0]), dict
    raise TypeError(f"fields.py has no codec for a field of type {hint!r}")


@dataclass(frozen=True)
class _Field:
    name: str  # the attribute
    key: str  # the JSON name
    read: _Reader
    write: _Writer


# Each record class's fields, made on its first use. Two threads that make one at once make the
# same tuple: the one stored last wins, harmlessly.
_CODECS: dict[type[Record], tuple[_Field, ...]] = {}


def _fields(kind: type[Record]) -> tuple[_Field, ...]:
    codec = _CODECS.get(kind)
    if codec is None:
        hints = typing.get_type_hints(kind)
        codec = _CODECS[kind] = tuple(
            _Field(f.name, f.metadata.get("json", f.name), *_codec_of(hints[f.name]))
            for f in dataclasses.fields(kind)  # type: ignore[arg-type]
        )
    return codec


class Record:
    """A frozen dataclass read and written by the field codec: `from_json` never raises (see
    the module's docstring), `to_json` gives the object as it travels, fields in their order."""

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Self:
        return cls(**{f.name: f.read(obj.get(f.key)) for f in _fields(cls)})

    def to_json(self) -> dict[str, Any]:
        return {f.key: f.write(getattr(self, f.name)) for f in _fields(type(self))}


# -- the strict codec ------------------------------------------------------------------------
#
# The same idea for a record that one process writes and another runs, where a field that does
# not read is the message's fault and must fail it (arbiterd/request.py's GenerateRequest, issue
# 41): `strict_decode` raises FieldError naming the first field that is unknown, missing (one
# without a default) or of the wrong type; `strict_encode` writes only the fields that differ
# from their default. One reader per field type, by the field's annotation:
#
#     int, float (None too when optional)   a number (not a bool; an int for int), finite
#     str, bool (None too when optional)    a string, a JSON boolean
#     a StrEnum (None too when optional)    one of its values
#     a dataclass (None too when optional)  an object, read strictly as that record
#     dict[str, Any]                        an object, kept as it is (a JSON schema, say)
#     dict[int, float]                      an object of decimal int keys to numbers
#     tuple[T, ...], tuple[A, B]            a list of T, a list of exactly an A and a B
#
# The checks of what a value means (a range, one field against another) are the writer's: the
# strict codec checks only that the message is the record's.


class FieldError(ValueError):
    """A message that is not the record it should be; `str()` names the field."""


_StrictReader = Callable[[object, str], Any]

# Each record class's fields for the strict codec: (attribute, JSON name, reader, default or
# _REQUIRED), made on first use like _CODECS.
_REQUIRED = object()
_STRICT: dict[type, tuple[tuple[str, str, _StrictReader, Any], ...]] = {}


def _must(key: str, expected: str, value: object) -> FieldError:
    got = "null" if value is None else type(value).__name__
    return FieldError(f"'{key}' must be {expected}, got {got}")


def _strict_number(kind: type) -> _StrictReader:
    expected = "an integer" if kind is int else "a number"
    accepted = int if kind is int else int | float

    def read(value: object, key: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise _must(key, expected, value)
        if not math.isfinite(value):
            raise FieldError(f"'{key}' must be finite")
        return value

    return read


def _strict_plain(kind: type, expected: str) -> _StrictReader:
    def read(value: object, key: str) -> Any:
        if not isinstance(value, kind):
            raise _must(key, expected, value)
        return value

    return read


def _strict_member(kind: type[enum.StrEnum]) -> _StrictReader:
    def read(value: object, key: str) -> Any:
        if isinstance(value, str) and value in kind._value2member_map_:
            return kind(value)
        choices = ", ".join(member.value for member in kind)
        raise FieldError(f"'{key}' must be one of {choices}, got {str(value)[:40]!r}")

    return read


def _strict_optional(read_value: _StrictReader) -> _StrictReader:
    def read(value: object, key: str) -> Any:
        return None if value is None else read_value(value, key)

    return read


def _strict_items(read_item: _StrictReader) -> _StrictReader:
    def read(value: object, key: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise _must(key, "a list", value)
        return tuple(read_item(item, f"{key}[{index}]") for index, item in enumerate(value))

    return read


def _strict_fixed(readers: tuple[_StrictReader, ...]) -> _StrictReader:
    def read(value: object, key: str) -> tuple[Any, ...]:
        if not isinstance(value, list) or len(value) != len(readers):
            raise _must(key, f"a list of {len(readers)}", value)
        return tuple(
            each(item, f"{key}[{i}]")
            for i, (each, item) in enumerate(zip(readers, value, strict=True))
        )

    return read


def _strict_object(value: object, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _must(key, "an object", value)
    return value


_STRICT_SCALARS: dict[object, _StrictReader] = {
    int: _strict_number(int),
    float: _strict_number(float),
    str: _strict_plain(str, "a string"),
    bool: _strict_plain(bool, "a boolean"),
}
_MAX_INT_KEY_DIGITS = 19  # int64's; int() refuses more than 4,300 digits (issue 24)


def _strict_int_keys(read_value: _StrictReader) -> _StrictReader:
    def read(value: object, key: str) -> dict[int, Any]:
        read_ = {}
        for name, item in _strict_object(value, key).items():
            # ASCII digits before int(): str.isdigit() also takes digits int() refuses ("²").
            if not (name.isascii() and name.isdigit() and len(name) <= _MAX_INT_KEY_DIGITS):
                raise FieldError(f"'{key}' has the key {name[:40]!r}, which is not an integer")
            read_[int(name)] = read_value(item, f"{key}.{name}")
        return read_

    return read


def _strict_reader(hint: Any) -> _StrictReader:
    """The strict reader of a field of type `hint` (the table above)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and len(args) == 2 and args[1] is type(None):
        return _strict_optional(_strict_reader(args[0]))
    if hint in _STRICT_SCALARS:
        return _STRICT_SCALARS[hint]
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return _strict_member(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _strict_record(hint)
    return _strict_container(hint, args)


def _strict_container(hint: Any, args: tuple[Any, ...]) -> _StrictReader:
    origin = typing.get_origin(hint)
    if origin is dict and args == (str, Any):
        return _strict_object
    if origin is dict and args[0] is int:
        return _strict_int_keys(_strict_reader(args[1]))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _strict_items(_strict_reader(args[0]))
    if origin is tuple:
        return _strict_fixed(tuple(_strict_reader(arg) for arg in args))
    raise TypeError(f"the strict codec has no reader for a field of type {hint!r}")


def _strict_record(kind: type) -> _StrictReader:
    def read(value: object, key: str) -> Any:
        return _strict_decode(kind, value, f"{key}.")

    return read


def _strict_fields(kind: type) -> tuple[tuple[str, str, _StrictReader, Any], ...]:
    codec = _STRICT.get(kind)
    if codec is None:
        hints = typing.get_type_hints(kind)
        codec = _STRICT[kind] = tuple(
            (
                f.name,
                f.metadata.get("json", f.name),
                _strict_reader(hints[f.name]),
                f.default
                if f.default is not dataclasses.MISSING
                else f.default_factory()
                if f.default_factory is not dataclasses.MISSING
                else _REQUIRED,
            )
            for f in dataclasses.fields(kind)
        )
    return codec


def _strict_decode(kind: type[_D], obj: object, where: str) -> _D:
    if not isinstance(obj, dict):
        raise FieldError(f"'{where.rstrip('.') or 'the message'}' must be an object")
    codec = _strict_fields(kind)
    unknown = sorted(set(obj) - {key for _, key, _, _ in codec})
    if unknown:
        raise FieldError(f"unknown field '{where}{str(unknown[0])[:40]}'")
    given: dict[str, Any] = {}
    for name, key, read, default in codec:
        if key in obj:
            given[name] = read(obj[key], where + key)
        elif default is _REQUIRED:
            raise FieldError(f"'{where}{key}' is missing")
    return kind(**given)


def strict_decode(kind: type[_D], obj: object) -> _D:
    """The record of dataclass `kind` that `strict_encode` wrote as `obj`; FieldError naming the
    first field that is not (see the table above)."""
    return _strict_decode(kind, obj, "")


def _strict_written(value: Any) -> Any:
    if isinstance(value, enum.StrEnum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return strict_encode(value)
    if isinstance(value, tuple):
        return [_strict_written(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _strict_written(item) for key, item in value.items()}
    return value


def strict_encode(record: Any) -> dict[str, Any]:
    """`record`, a dataclass, as `strict_decode` reads it: each field that differs from its
    default under its JSON name, in their order."""
    return {
        key: _strict_written(getattr(record, name))
        for name, key, _, default in _strict_fields(type(record))
        if default is _REQUIRED or getattr(record, name) != default
    }
