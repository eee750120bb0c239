"""Finding the libllama that llama_cpp loaded, and probing it for the in-place residency API.

Owns every ctypes handle arbiterd opens on libllama itself. Stock llama.cpp frees device memory
only by freeing the model and context, so the portable backend reloads (engine.py). A patched
llama.cpp can instead drop a live context's device buffers and bring them back in place; this
module binds that API when the library exports it. The assumed C ABI:

    int32_t llama_context_release_device(struct llama_context * ctx, bool keep_kv);
        Frees the context's device buffers: the weights and, unless keep_kv, the KV cache.
        Host copies are kept, so nothing is re-read from disk. Returns 0 on success.
    int32_t llama_context_restore_device(struct llama_context * ctx);
        Allocates the device buffers again and copies the host copies back. Returns 0 on
        success.

Both must be called from the engine thread only (never while the context decodes), like every
other call on a llama.cpp context. Only `loaded_libllama` imports llama_cpp, and only when
called, so the probe works on any library path, including test doubles.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from arbiterd.errors import EngineError

RELEASE_SYMBOL = "llama_context_release_device"
RESTORE_SYMBOL = "llama_context_restore_device"
RESIDENCY_SYMBOLS = (RELEASE_SYMBOL, RESTORE_SYMBOL)
FALLBACK = "using the reload backend"
PROC_MAPS = Path("/proc/self/maps")
# The basename of libllama itself (libllama.so, libllama.so.0, ...), not libllama-common.so.
_LIBLLAMA_NAME = re.compile(r"libllama\.so(\.\d+)*")
_DELETED = " (deleted)"


def loaded_libllama() -> Path:
    """The libllama shared library llama_cpp loaded into this process (importing llama_cpp).

    Raises EngineError when llama_cpp cannot be imported and no libllama is mapped either.
    """
    why = "llama_cpp holds no CDLL handle"
    try:
        from llama_cpp import llama_cpp as bindings  # noqa: PLC0415 (only this function needs it)
    except (ImportError, OSError, RuntimeError) as exc:  # its import loads the library
        why = f"llama_cpp cannot be imported ({exc})"
    else:
        # llama_cpp/llama_cpp.py keeps the handle of load_shared_library() as `_lib`; its
        # `_name` is the path it passed to dlopen.
        lib = getattr(bindings, "_lib", None)
        name = getattr(lib, "_name", None) if isinstance(lib, ctypes.CDLL) else None
        if isinstance(name, str) and os.path.isabs(name) and os.path.exists(name):
            return Path(name)
    mapped = _mapped_libllama()
    if mapped is not None:
        return mapped
    raise EngineError(
        f"cannot find the libllama this process loaded: {why}, and {PROC_MAPS} maps none"
    )


def _mapped_libllama() -> Path | None:
    """The first libllama file mapped into this process, from /proc/self/maps."""
    try:
        maps = PROC_MAPS.read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        # address perms offset dev inode pathname; the pathname may itself contain spaces.
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        pathname = fields[5].removesuffix(_DELETED)
        path = Path(pathname)
        if _LIBLLAMA_NAME.fullmatch(path.name) and path.exists():
            return path
    return None


@dataclass(frozen=True)
class ProbeMiss:
    """Why the in-place residency API is unavailable; the caller falls back to reloading."""

    library: Path
    reason: str


@dataclass(frozen=True)
class ResidencyApi:
    """The in-place residency functions of one libllama, with their ctypes signatures set."""

    library: Path
    _lib: ctypes.CDLL = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        # Without argtypes ctypes would pass a Python int as a C int, truncating the pointer.
        release = getattr(self._lib, RELEASE_SYMBOL)
        release.argtypes = [ctypes.c_void_p, ctypes.c_bool]
        release.restype = ctypes.c_int32
        restore = getattr(self._lib, RESTORE_SYMBOL)
        restore.argtypes = [ctypes.c_void_p]
        restore.restype = ctypes.c_int32

    def release_device(self, ctx: int, keep_kv: bool) -> None:
        """Free ctx's device buffers (weights, and the KV cache unless keep_kv)."""
        _check_ctx(RELEASE_SYMBOL, ctx)
        code = int(getattr(self._lib, RELEASE_SYMBOL)(ctx, keep_kv))
        self._check(RELEASE_SYMBOL, code)

    def restore_device(self, ctx: int) -> None:
        """Bring back the device buffers release_device freed."""
        _check_ctx(RESTORE_SYMBOL, ctx)
        code = int(getattr(self._lib, RESTORE_SYMBOL)(ctx))
        self._check(RESTORE_SYMBOL, code)

    def _check(self, symbol: str, code: int) -> None:
        if code != 0:
            raise EngineError(f"{symbol} failed with code {code} (libllama at {self.library})")


def _check_ctx(symbol: str, ctx: int) -> None:
    # A NULL context would crash inside libllama; refuse it here instead.
    if not ctx:
        raise EngineError(f"{symbol} needs a llama_context pointer, got NULL")


def probe_residency_api(library: Path | None = None) -> ResidencyApi | ProbeMiss:
    """Bind the in-place residency API of `library`, or say why it cannot be used.

    None probes the libllama llama_cpp loaded (see loaded_libllama, whose EngineError this
    passes on); it is opened with RTLD_NOLOAD, so a library that is not loaded already is a
    miss rather than a second copy. An explicit path is opened as given (made absolute, so the
    loader never searches its path for it).
    """
    if library is None:
        path = loaded_libllama()
        mode = os.RTLD_NOLOAD | os.RTLD_NOW
    else:
        path = library.absolute()
        mode = ctypes.DEFAULT_MODE
    try:
        lib = ctypes.CDLL(str(path), mode=mode)
    except OSError as exc:
        if mode & os.RTLD_NOLOAD:
            # dlopen reports a RTLD_NOLOAD miss with no message: ctypes says "dlopen() error".
            reason = f"libllama at {path} is not loaded in this process"
        else:
            reason = f"cannot open {path} ({exc})"
        return ProbeMiss(path, f"{reason}: {FALLBACK}")
    missing = [symbol for symbol in RESIDENCY_SYMBOLS if not hasattr(lib, symbol)]
    if missing:
        symbols = " or ".join(missing)
        stock = " (a stock build)" if len(missing) == len(RESIDENCY_SYMBOLS) else ""
        return ProbeMiss(path, f"libllama at {path} does not export {symbols}{stock}: {FALLBACK}")
    return ResidencyApi(path, lib)
