"""Reading a TOML table for a config: the file, read only when it is the user's alone (owned by
the user, writable by nobody else: paths.trusted_file_problem), typed getters whose errors name
the file, the key path and what was expected, and the spelling of keys and values that those
messages quote back. Owns no key of arbiterd's config (config/ does): only how a value is read
and shown.
"""

from __future__ import annotations

import difflib
import enum
import math
import os
import re
import stat
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from arbiterd.errors import ConfigError
from arbiterd.paths import owner_problem, trusted_file_problem

_MAX_GOT_CHARS = 80  # a value quoted back in a message is cut to this length


Keys = tuple[str, ...]


Choice = TypeVar("Choice", bound=enum.Enum)


OPTIONAL_PATH_EXPECTED = 'a path (a string; "" = the default)'


class Missing:
    """The value of a key that is not there."""


MISSING = Missing()


@dataclass(frozen=True)
class Source:
    """Where values come from: what messages name, and what relative paths resolve against."""

    label: str
    base: Path
    home: Path

    def fail(self, keys: Keys, message: str) -> ConfigError:
        return ConfigError(f"{self.label}: {dotted(keys)}: {message}")

    def expected(
        self, keys: Keys, expected: str, got: object, *, secret: bool = False
    ) -> ConfigError:
        return self.fail(keys, f"expected {expected}, got {describe(got, secret=secret)}")

    def path(self, keys: Keys, text: str, expected: str) -> Path:
        """`text` as a path: `~` expanded, relative to the config file's directory."""
        if "\0" in text:  # no file name holds NUL; the OS would refuse it later, less clearly
            raise self.expected(keys, expected, text)
        if text == "~" or text.startswith("~/"):
            path = self.home / text[2:]
        else:
            try:
                path = Path(text).expanduser()  # ~user
            except RuntimeError:
                raise self.expected(keys, f"{expected}, for a user that exists", text) from None
        return path if path.is_absolute() else self.base / path


@dataclass(frozen=True)
class Table:
    """One TOML table being validated: typed getters whose errors name the key path."""

    src: Source
    where: Keys
    values: Mapping[str, object]

    def keys(self, key: str) -> Keys:
        return (*self.where, key)

    def check_keys(self, allowed: tuple[str, ...], hint: Callable[[str, object], str]) -> None:
        for key, value in self.values.items():
            if key in allowed:
                continue
            kind = "table" if isinstance(value, dict) else "key"
            message = f"unknown {kind}; expected one of: {', '.join(allowed)}"
            close = difflib.get_close_matches(key, allowed, n=1)
            extra = hint(key, value) or (f"did you mean {close[0]}?" if close else "")
            raise self.src.fail(self.keys(key), f"{message} ({extra})" if extra else message)

    def integer(self, key: str, default: int, expected: str, *, ok: Callable[[int], bool]) -> int:
        value = self.values.get(key, default)
        # bool is an int in Python, but `n_ctx = true` is a mistake in TOML.
        if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
            raise self.src.expected(self.keys(key), expected, value)
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.values.get(key, default)
        if not isinstance(value, bool):
            raise self.src.expected(self.keys(key), "true or false", value)
        return value

    def seconds(self, key: str, default: float, *, note: str = "") -> float:
        value = self.values.get(key, default)
        # TOML has inf and nan; neither is a duration.
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            expected = f"a non-negative number of seconds{note}"
            raise self.src.expected(self.keys(key), expected, value)
        return float(value)

    def string(
        self,
        key: str,
        default: str,
        expected: str,
        *,
        ok: Callable[[str], bool] | None = None,
        secret: bool = False,
    ) -> str:
        value = self.values.get(key, default)
        if not isinstance(value, str) or (ok is not None and not ok(value)):
            raise self.src.expected(self.keys(key), expected, value, secret=secret)
        return value

    def size(self, key: str, default: int = 0) -> int:
        """A number of bytes: an integer, or a string such as "22GiB" or "512 MB"; `default`
        when absent."""
        value = self.values.get(key, default)
        size = parse_size(value) if isinstance(value, int | str) else None
        if size is None:
            raise self.src.expected(self.keys(key), SIZE_EXPECTED, value)
        return size

    def choice(self, key: str, default: Choice, expected: str) -> Choice:
        """One of an enum's values, by its text; `default` when absent."""
        text = self.string(key, default.value, expected)
        try:
            return type(default)(text)
        except ValueError:
            raise self.src.expected(self.keys(key), expected, text) from None

    def optional_path(self, key: str) -> Path | None:
        """A path, or None when absent or "" (a default applies)."""
        text = self.string(key, "", OPTIONAL_PATH_EXPECTED)
        return self.src.path(self.keys(key), text, OPTIONAL_PATH_EXPECTED) if text else None


def read_toml(path: Path) -> dict[str, object]:
    """The TOML document of the config file at `path`, once the file is known to be the user's
    alone (`_check_trusted`): whoever else could write it would choose what the daemon runs
    (issue 40: a config replaced by a link to another user's 0666 file was applied). ConfigError
    names the file and what is wrong, with the fix."""
    label = str(path)
    try:
        # O_NONBLOCK: a FIFO at the path opens at once (and is refused), without waiting for a
        # writer; it changes nothing for a regular file.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{label}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{label}: cannot be read: {exc.strerror}") from None
    try:
        _check_trusted(path, os.fstat(fd))  # the file opened: what is checked is what is read
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{label}: cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{label}: expected UTF-8 text (TOML), got an invalid byte at offset {exc.start}"
        ) from None
    try:
        # A BOM is not TOML, but some editors write one; it carries no meaning.
        return tomllib.loads(text.removeprefix("\ufeff"))
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
        raise ConfigError(f"{label}: expected valid TOML: {exc}") from None


def _check_trusted(path: Path, opened: os.stat_result) -> None:
    """Refuse the config file at `path` (`opened`: the fstat of the file opened, a link's target)
    unless paths.trusted_file_problem finds nothing; a link to it must be the user's too."""
    if stat.S_ISDIR(opened.st_mode):
        raise ConfigError(f"{path}: expected a TOML file, got a directory")
    try:
        link = path.lstat()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror}") from None
    label = str(path)
    if stat.S_ISLNK(link.st_mode):
        if (foreign := owner_problem(f"the link {path}", link)) is not None:
            raise ConfigError(
                f"{foreign}: arbiterd applies only a config that nobody else can change"
                f" (make it yours: {_copy_over(path)})"
            )
        label = f"{path} (a link to {os.path.realpath(path)})"
    problem = trusted_file_problem(label, opened)
    if problem is None:
        return
    if opened.st_uid != os.getuid():
        fix = f"make it yours: {_copy_over(path)}"
    elif stat.S_ISREG(opened.st_mode):
        fix = f"chmod go-w {os.path.realpath(path)}"
    else:
        fix = f"write the config as a file at {path}"
    raise ConfigError(
        f"{problem}: arbiterd applies only a config that nobody else can change ({fix})"
    )


def _copy_over(path: Path) -> str:
    """The commands that put a copy of the user's own in place of the file (or link) `path`."""
    return f"cp {path} {path}.new && chmod go-w {path}.new && mv {path}.new {path}"


SIZE_EXPECTED = 'a number of bytes, or a size such as "22GiB" or "512MB"'


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(value: int | str) -> int | None:
    """Bytes from an integer or a string such as "22GiB", "1.5 GB", "4096"; None when it is
    not one (negative, fractional bytes, an unknown unit)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    match = _SIZE_RE.fullmatch(value)
    if match is None or match[2].upper() not in _SIZE_UNITS:
        return None
    size = float(match[1]) * _SIZE_UNITS[match[2].upper()]
    return int(size) if size == int(size) or match[2] else None


_BARE_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")


_TOML_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def key_path(*keys: str) -> str:
    """A key path as TOML spells it, for messages about a config: models."qwen2.5".n_ctx."""
    return dotted(keys)


def dotted(keys: Iterable[str]) -> str:
    """A key path as TOML spells it: models."qwen2.5".n_ctx."""
    return ".".join(k if _BARE_KEY_RE.fullmatch(k) else toml_string(k) for k in keys)


def describe(value: object, *, secret: bool = False) -> str:
    """A value as a message quotes it back: TOML spelling, cut short; a secret only by type."""
    if isinstance(value, str) and secret:
        return "a string with other characters (not shown: it is a secret)"
    if isinstance(value, str):
        shown = value if len(value) <= _MAX_GOT_CHARS else value[:_MAX_GOT_CHARS] + "..."
        return toml_string(shown)
    if isinstance(value, bool) and not secret:
        return "true" if value else "false"
    if isinstance(value, int | float) and not secret:
        return repr(value)
    kinds = {str: "a string", bool: "a boolean", int: "an integer", float: "a float"}
    kinds |= {dict: "a table", list: "an array", Missing: "nothing"}
    return kinds.get(type(value), f"a {type(value).__name__}")  # TOML dates and times


def toml_string(text: str) -> str:
    """A TOML basic string: quote, backslash and control characters escaped, the rest as is."""
    out = ['"']
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ch < " " or ch == "\x7f":  # TOML forbids raw control characters but tab
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_key(name: str) -> str:
    return name if _BARE_KEY_RE.fullmatch(name) else toml_string(name)
