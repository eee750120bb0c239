"""The state file an unloaded model's prompt cache waits in (issue 14): its format, read and write.

Owns the bytes on disk and nothing else: no llama.cpp, no daemon. A worker that is unloaded
writes its KV state here; the next worker of that model reads it back after loading, and its
prefix matching then evaluates only what a new prompt adds.

    MAGIC (8 bytes) | header length (u32 LE) | header (UTF-8 JSON) | tokens (i32 LE) | KV bytes

The header says the format version, what the state was made for (`KvKey`: the model file's
size and mtime, the context params that must match), how many tokens and KV bytes follow, and
the SHA-256 of both. The model file is named by the size and mtime_ns of the version the
worker loaded (the daemon's host copy records them as it copies the file, so a file replaced on
disk while a copy of the old one serves is told apart) rather than a hash of its first MiB:
stat costs nothing, any rewrite of the file (a new download, a requantization)
changes its mtime, and a GGUF's first MiB is mostly its header and vocabulary, the same for
two fine-tunes of one base. The digest catches a file damaged on disk: llama.cpp checks only
the sizes of what it sets back, so damaged KV bytes would otherwise give a wrong answer.

Any file that is missing, short, damaged, of another version or made for another model file
or params is refused with `KvFileError` (its reason for the log); the caller discards it and
prefills in full. Writing goes to a temporary file that is renamed over the old one, so a
reader never sees half a file.

A state file holds the KV of the user's prompts, which another local user could read back as
text (issue 24), so it is private: the temporary file is created O_EXCL|O_NOFOLLOW with mode
0600 (and fchmod'ed to it, whatever the umask) before a byte is written, and a file opened to
be read is put back to 0600 if it is wider (an older arbiterd wrote them with the umask's mode).
The folder they live in is the daemon's to check (budgets.PromptCache, 0700).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

MAGIC = b"ARBKV\x00\x01\n"
FORMAT_VERSION = 1
_HEADER_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024  # a header is ~300 bytes; more is a damaged length field
PRIVATE_FILE_MODE = 0o600
_TOKEN_BYTES = 4


class KvFileError(Exception):
    """A state file that cannot be used; its message says why. It never leaves the worker: the
    worker logs it, discards the file and prefills in full."""


@dataclass(frozen=True)
class KvKey:
    """What a KV state was made for; a state restores only into a worker with an equal key."""

    model_size: int
    model_mtime_ns: int
    n_ctx: int
    embedding: bool

    @classmethod
    def of(cls, model: Path, *, n_ctx: int, embedding: bool) -> KvKey:
        """The key of `model` as it is on disk now (OSError when it cannot be read)."""
        st = os.stat(model)
        return cls(st.st_size, st.st_mtime_ns, n_ctx, embedding)


@dataclass(frozen=True)
class KvState:
    tokens: list[int]  # the tokens whose KV `data` holds in sequence `seq`, in order
    data: bytes  # llama_state_get_data's bytes (the other sequences' KV in it is not kept)
    seq: int = 0  # the KV sequence (the decoder's slot) that held them


def write(path: Path, key: KvKey, state: KvState) -> int:
    """Write `state` for `key` to `path` (tmp + rename); returns the bytes written. OSError
    (ENOSPC, EACCES, ...) leaves no file behind but the old one, if any."""
    tokens = array("i", state.tokens)
    if tokens.itemsize != _TOKEN_BYTES:
        raise KvFileError(f"this platform's C int is {tokens.itemsize} bytes")
    token_bytes = _little_endian(tokens)
    header = json.dumps(
        {
            "version": FORMAT_VERSION,
            "key": asdict(key),
            "n_tokens": len(state.tokens),
            "seq": state.seq,
            "data_bytes": len(state.data),
            "sha256": _digest(token_bytes, state.data),
        }
    ).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with _create_private(tmp) as out:
            out.write(MAGIC)
            out.write(_HEADER_LEN.pack(len(header)))
            out.write(header)
            out.write(token_bytes)
            out.write(state.data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(MAGIC) + _HEADER_LEN.size + len(header) + len(token_bytes) + len(state.data)


def read(path: Path, key: KvKey) -> KvState:
    """The state in `path`, if it was made for `key`; KvFileError says why not (a missing file
    too). The guard ladder: magic → header length → header JSON → version → key → sizes →
    digest."""
    try:
        blob = _read_private(path)
    except FileNotFoundError:
        raise KvFileError(f"no state file at {path}") from None
    except OSError as exc:
        raise KvFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not blob.startswith(MAGIC):
        raise KvFileError(f"{path} is not an arbiterd state file")
    at = len(MAGIC)
    if len(blob) < at + _HEADER_LEN.size:
        raise KvFileError(f"{path} is truncated")
    (header_len,) = _HEADER_LEN.unpack_from(blob, at)
    at += _HEADER_LEN.size
    if header_len > MAX_HEADER_BYTES or len(blob) < at + header_len:
        raise KvFileError(f"{path} is truncated or its header is damaged")
    try:
        header = json.loads(blob[at : at + header_len])
        version = header["version"]
        saved_key = KvKey(**header["key"])
        n_tokens, data_bytes, digest = header["n_tokens"], header["data_bytes"], header["sha256"]
        seq = header.get("seq", 0)
    except (ValueError, TypeError, KeyError) as exc:
        raise KvFileError(f"{path} has a damaged header ({exc})") from None
    if version != FORMAT_VERSION:
        raise KvFileError(f"{path} is format {version!r}; this arbiterd reads {FORMAT_VERSION}")
    if saved_key != key:
        raise KvFileError(f"{path} was made for {saved_key}, not {key}")
    if not all(isinstance(n, int) for n in (n_tokens, data_bytes, seq)) or seq < 0:
        raise KvFileError(f"{path} has a damaged header (sizes)")
    at += header_len
    token_end = at + n_tokens * _TOKEN_BYTES
    if n_tokens < 0 or data_bytes < 0 or len(blob) != token_end + data_bytes:
        raise KvFileError(f"{path} is truncated or has bytes over (its header says otherwise)")
    token_bytes, data = blob[at:token_end], blob[token_end:]
    if _digest(token_bytes, data) != digest:
        raise KvFileError(f"{path} is damaged (its SHA-256 does not match)")
    tokens = array("i")
    tokens.frombytes(token_bytes)
    if not _LITTLE:
        tokens.byteswap()
    return KvState(tokens.tolist(), data, seq)


def _create_private(tmp: Path) -> BinaryIO:
    """A new file at `tmp`, mode 0600, open for writing. One left at the name by a worker that
    died with this pid is removed first: the name is this process's alone."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, PRIVATE_FILE_MODE)
    except FileExistsError:
        tmp.unlink()
        fd = os.open(tmp, flags, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # a umask may have narrowed it (0400 under 0277)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def _read_private(path: Path) -> bytes:
    """The bytes of the regular file at `path` (never a symlink's target), its mode put back
    to 0600 first if it is wider."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KvFileError(f"{path} is not a regular file")
        if st.st_mode & 0o077:
            os.fchmod(fd, PRIVATE_FILE_MODE)
        return f.read()


_LITTLE = struct.pack("=i", 1) == struct.pack("<i", 1)


def _little_endian(tokens: array[int]) -> bytes:
    if _LITTLE:
        return tokens.tobytes()
    swapped = array("i", tokens)
    swapped.byteswap()
    return swapped.tobytes()


def _digest(token_bytes: bytes, data: bytes) -> str:
    hasher = hashlib.sha256(token_bytes)
    hasher.update(data)
    return hasher.hexdigest()
