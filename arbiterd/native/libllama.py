"""Finding the libllama that llama_cpp loaded, and probing it for the in-place residency API.

Owns every ctypes handle arbiterd opens on libllama itself. Stock llama.cpp frees device memory
only by freeing the model and context, so the portable backend reloads
(arbiterd/worker/engine/reload.py). The arbiterd engine build - llama-cpp-python with
`llama-residency.patch` (README.md beside this file) - can instead move a live context's buffers
to host memory and back in place; this module binds that API when the library exports it. The
C ABI, version `ABI` (include/llama-residency.h of the patched llama.cpp):

    int32_t llama_residency_abi(void);
    int32_t llama_context_release_device(struct llama_context * ctx, uint32_t flags);
        Frees the weights' buffers: weights a device's own buffer holds as the model file has
        them come back from that file (kept open), any other is copied to host memory once and
        the copy kept across round trips. Frees the compute buffers, and the KV cache's buffers
        unless KEEP_KV (their contents are then gone: the caller saves them first, or passes
        KV_TO_HOST, which copies them whole). HOST_BUFFERS releases host (CPU) buffers too.
        The context's backends of RPC devices are freed with their buffers, which closes the
        connection to the server (native/rpc.py), unless KEEP_KV.
    int32_t llama_context_restore_device(struct llama_context * ctx);
        Allocates the buffers again, uploads the weights from the model file and the copies,
        clears a released KV cache (copies it back after KV_TO_HOST), reserves the compute
        buffers; on failure the context stays
        released, copies intact. A model file that changed since the load is refused (SOURCE).
    int32_t llama_context_residency_stats(const struct llama_context * ctx, uint32_t flags,
                                          struct llama_residency_stats * out);
        The bytes released (or that a release with these flags would free), by kind.

Each returns 0 or a `Status` code. All must be called from the engine thread only (never while
the context decodes), like every other call on a llama.cpp context. Only `loaded_libllama`
imports llama_cpp, and only when called, so the probe works on any library path, including
test doubles.
"""

from __future__ import annotations

import ctypes
import enum
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from arbiterd.errors import EngineError, ResidencyCallError

ABI = 3
ABI_SYMBOL = "llama_residency_abi"
RELEASE_SYMBOL = "llama_context_release_device"
RESTORE_SYMBOL = "llama_context_restore_device"
STATS_SYMBOL = "llama_context_residency_stats"
RESIDENCY_SYMBOLS = (ABI_SYMBOL, RELEASE_SYMBOL, RESTORE_SYMBOL, STATS_SYMBOL)
# Flags of llama_context_release_device.
KEEP_KV = 1 << 0  # the KV cache stays where it is
HOST_BUFFERS = 1 << 1  # host (CPU) buffers are released too: a CPU-only engine's whole model
KV_TO_HOST = 1 << 2  # the KV buffers are copied to host memory whole, and back as they were
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


class Status(enum.IntEnum):
    """What the residency calls return (enum llama_residency_status)."""

    OK = 0
    STATE = 1  # release while released, restore while resident
    HOST_ALLOC = 2  # release: no host memory for the copies; nothing was freed
    DEVICE_ALLOC = 3  # restore: a buffer could not be allocated; still released
    UNSUPPORTED = 4  # release: this model's memory cannot free its KV buffers; nothing freed
    COMPUTE = 5  # restore: the compute buffers could not be reserved; still released
    SOURCE = 6  # restore: a model file the weights come back from changed; still released


STATUS_TEXT = {
    Status.STATE: "the context is not in the state this call needs",
    Status.HOST_ALLOC: "not enough host memory for the weights' copies (nothing was released)",
    Status.DEVICE_ALLOC: "out of device memory",
    Status.UNSUPPORTED: "this model's KV cache cannot leave the device (keep it there instead)",
    Status.COMPUTE: "out of device memory for the compute buffers",
    Status.SOURCE: "the model file's copy the weights come back from has changed since the load",
}


class _Stats(ctypes.Structure):
    _fields_ = [
        ("released", ctypes.c_int32),
        ("weights_bytes", ctypes.c_uint64),
        ("kv_bytes", ctypes.c_uint64),
        ("compute_bytes", ctypes.c_uint64),
        ("host_bytes", ctypes.c_uint64),
        ("file_bytes", ctypes.c_uint64),
        ("copied_bytes", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class ResidencyStats:
    """Bytes by kind that a context has released, or that a release would free."""

    released: bool
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    host_bytes: int  # host memory holding this context's own copies of weights
    file_bytes: int  # of weights_bytes, those that come back from the model file (no copy)
    copied_bytes: int  # what the last release copied out of the buffers it freed

    @property
    def device_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes


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
        release.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        release.restype = ctypes.c_int32
        restore = getattr(self._lib, RESTORE_SYMBOL)
        restore.argtypes = [ctypes.c_void_p]
        restore.restype = ctypes.c_int32
        stats = getattr(self._lib, STATS_SYMBOL)
        stats.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(_Stats)]
        stats.restype = ctypes.c_int32

    def release_device(self, ctx: int, flags: int) -> None:
        """Free ctx's buffers as `flags` (KEEP_KV, HOST_BUFFERS) say; raises ResidencyCallError."""
        _check_ctx(RELEASE_SYMBOL, ctx)
        self._check(RELEASE_SYMBOL, int(getattr(self._lib, RELEASE_SYMBOL)(ctx, flags)))

    def restore_device(self, ctx: int) -> None:
        """Bring back the buffers release_device freed; raises ResidencyCallError."""
        _check_ctx(RESTORE_SYMBOL, ctx)
        self._check(RESTORE_SYMBOL, int(getattr(self._lib, RESTORE_SYMBOL)(ctx)))

    def stats(self, ctx: int, flags: int) -> ResidencyStats:
        """What ctx has released, or what a release with `flags` would free."""
        _check_ctx(STATS_SYMBOL, ctx)
        out = _Stats()
        self._check(
            STATS_SYMBOL, int(getattr(self._lib, STATS_SYMBOL)(ctx, flags, ctypes.byref(out)))
        )
        return ResidencyStats(
            released=bool(out.released),
            weights_bytes=int(out.weights_bytes),
            kv_bytes=int(out.kv_bytes),
            compute_bytes=int(out.compute_bytes),
            host_bytes=int(out.host_bytes),
            file_bytes=int(out.file_bytes),
            copied_bytes=int(out.copied_bytes),
        )

    def _check(self, symbol: str, code: int) -> None:
        if code != 0:
            status: Status | int = Status(code) if code in Status._value2member_map_ else code
            text = (
                STATUS_TEXT.get(status, f"status {int(status)}")
                if isinstance(status, Status)
                else f"status {status}"
            )
            raise ResidencyCallError(
                f"{symbol} failed: {text} (libllama at {self.library})", status
            )


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
    abi = getattr(lib, ABI_SYMBOL)
    abi.argtypes = []
    abi.restype = ctypes.c_int32
    version = int(abi())
    if version != ABI:
        return ProbeMiss(
            path,
            f"libllama at {path} has residency ABI {version}, arbiterd speaks {ABI}: {FALLBACK}",
        )
    return ResidencyApi(path, lib)
