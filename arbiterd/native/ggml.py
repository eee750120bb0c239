"""The compute devices the loaded engine offers (CPU, CUDA0, Vulkan0, ...), from ggml's registry,
and how fast ggml itself moves bytes to and from one of them.

Owns the ctypes handle on libggml, the library libllama links against (found beside libllama,
opened RTLD_NOLOAD: never a second copy). Listing devices changes nothing; `transfer_rates`
allocates a buffer on a device and frees it before it returns, so it must run where the engine
is used and never while a context decodes (the benchmarks call it between round trips).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiterd.errors import EngineError

# enum ggml_backend_dev_type
_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
# Vulkan drivers that run on the CPU: Mesa's llvmpipe (its Vulkan driver is also called lavapipe)
# and Google's SwiftShader. ggml-vulkan lists such a device only when GGML_VK_VISIBLE_DEVICES names
# it, calls it kind "gpu", and reports the driver's fixed heap as its memory: the figures do not
# move with use (measured on llvmpipe: 2 GiB free whatever is allocated).
_CPU_VULKAN_DRIVERS = ("llvmpipe", "lavapipe", "swiftshader")
_LIBGGML = ("libggml.so", "libggml.so.0")
GGML_TYPE_I8 = 24  # enum ggml_type: one byte per element, so a tensor of n elements is n bytes
TRANSFER_FILL = 0x5A  # the byte the host buffer holds; the download must bring it back


@dataclass(frozen=True)
class Device:
    name: str  # ggml's: "CPU", "CUDA0", "Vulkan0"
    description: str  # "NVIDIA H200", the CPU's model name
    kind: str  # "cpu", "gpu", "igpu", "accel" or "meta"
    free_bytes: int
    total_bytes: int
    handle: int = 0  # ggml_backend_dev_t, valid while the engine is loaded
    registry: str = ""  # the backend that offers it: "CPU", "Vulkan", "RPC", ...

    @property
    def remote(self) -> bool:
        """A device of an RPC server (native/rpc.py)."""
        return self.registry == "RPC"

    @property
    def local_gpu(self) -> bool:
        """A GPU of this machine: what arbiterd's ids gpu0, gpu1, ... count, in ggml's order."""
        return self.kind in ("gpu", "igpu") and not self.remote

    @property
    def on_cpu(self) -> bool:
        """A GPU API device whose driver runs on the CPU (llvmpipe): real Vulkan, no GPU, and
        memory figures that are the driver's accounting, not a budget."""
        text = self.description.lower()
        return self.name.startswith("Vulkan") and any(d in text for d in _CPU_VULKAN_DRIVERS)

    @property
    def label(self) -> str:
        label = f"{self.name}: {self.description}" if self.description else self.name
        return f"{label} [runs on the CPU]" if self.on_cpu else label


def devices(libllama: Path, *, with_remote_memory: bool = False) -> list[Device]:
    """The devices of the ggml that `libllama` (a loaded library) links against. An RPC
    device's memory is asked of its server only `with_remote_memory` (it is 0 otherwise): the
    question connects, and waits while the server serves another client (native/rpc.py)."""
    lib = open_ggml(libllama)
    count = lib.ggml_backend_dev_count
    count.restype = ctypes.c_size_t
    get = lib.ggml_backend_dev_get
    get.argtypes, get.restype = [ctypes.c_size_t], ctypes.c_void_p
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        function = getattr(lib, name)
        function.argtypes, function.restype = [ctypes.c_void_p], ctypes.c_char_p
    kind = lib.ggml_backend_dev_type
    kind.argtypes, kind.restype = [ctypes.c_void_p], ctypes.c_int
    memory = lib.ggml_backend_dev_memory
    size_p = ctypes.POINTER(ctypes.c_size_t)
    memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    memory.restype = None
    reg_of = lib.ggml_backend_dev_backend_reg
    reg_of.argtypes, reg_of.restype = [ctypes.c_void_p], ctypes.c_void_p
    reg_name = lib.ggml_backend_reg_name
    reg_name.argtypes, reg_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    found = []
    for index in range(int(count())):
        dev = get(index)
        registry = _text(reg_name(reg_of(dev)))
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if registry != "RPC" or with_remote_memory:
            memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(
            Device(
                name=_text(lib.ggml_backend_dev_name(dev)),
                description=_text(lib.ggml_backend_dev_description(dev)),
                kind=_KINDS.get(int(kind(dev)), "unknown"),
                free_bytes=free.value,
                total_bytes=total.value,
                handle=int(dev),
                registry=registry,
            )
        )
    return found


@dataclass(frozen=True)
class TransferRates:
    """How fast ggml's own ggml_backend_tensor_set (upload) and ggml_backend_tensor_get
    (download) move one tensor of `nbytes` between host memory and a device: the copies the
    residency patch's restore (set, from the model file's host copy or a shadow) and a release
    that must keep a shadow (get, into it) make."""

    device: str  # ggml's name: "Vulkan0"
    host_buffer: str  # the host side's buffer type ("Vulkan_Host": pinned), or "pageable"
    nbytes: int
    tries: int
    upload_bytes_per_s: float  # best of `tries`, into the device buffer written once before
    download_bytes_per_s: float  # best of `tries`, into the host buffer written once before
    # The first copy each way, into memory nothing has written yet (the device buffer just
    # allocated; a host buffer just allocated): what a restore's new buffers and a release's new
    # shadow pay on top, e.g. first-touch page faults where the device's memory is the host's.
    first_upload_s: float
    first_download_s: float

    @property
    def first_upload_bytes_per_s(self) -> float:
        return self.nbytes / self.first_upload_s

    @property
    def first_download_bytes_per_s(self) -> float:
        return self.nbytes / self.first_download_s

    def to_json(self) -> dict[str, object]:
        return {
            "how": "ggml_backend_tensor_set/get of one I8 tensor in a buffer of the device's "
            "buffer type, from/to a host buffer of the device's host buffer type (pinned) where "
            "it has one; best of the tries after the first",
            "device": self.device,
            "host_buffer": self.host_buffer,
            "nbytes": self.nbytes,
            "tries": self.tries,
            "upload_bytes_per_s": round(self.upload_bytes_per_s),
            "download_bytes_per_s": round(self.download_bytes_per_s),
            "first_upload_s": round(self.first_upload_s, 6),
            "first_download_s": round(self.first_download_s, 6),
            "first_upload_bytes_per_s": round(self.first_upload_bytes_per_s),
            "first_download_bytes_per_s": round(self.first_download_bytes_per_s),
        }


class _InitParams(ctypes.Structure):
    # struct ggml_init_params, passed by value to ggml_init
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


def transfer_rates(
    libllama: Path, device_name: str, nbytes: int, *, tries: int = 3
) -> TransferRates:
    """Measures `device_name`'s upload and download rates through ggml's own tensor set/get.

    Allocates a buffer of the device's buffer type holding one tensor of `nbytes` (fewer when
    the buffer type's maximum size is smaller: TransferRates.nbytes says), and two host buffers
    of the device's host buffer type - the pinned memory the patch's release copies the weights
    into - or, for a device without one, of ordinary memory; times one first copy each way into
    the untouched memory, then `tries` more each way, and frees everything. Raises EngineError
    when the device is not there, a buffer cannot be allocated, or the bytes do not come back.
    """
    if nbytes <= 0 or tries < 1:
        raise ValueError("transfer_rates needs nbytes > 0 and tries >= 1")
    fn = _transfer_functions(open_ggml(libllama))
    dev = fn["ggml_backend_dev_by_name"](device_name.encode())
    if not dev:
        raise EngineError(f"ggml lists no device named {device_name!r}")
    buft = fn["ggml_backend_dev_buffer_type"](dev)
    nbytes = min(nbytes, int(fn["ggml_backend_buft_get_max_size"](buft)))
    overhead = int(fn["ggml_tensor_overhead"]())
    ctx = fn["ggml_init"](_InitParams(mem_size=2 * overhead, mem_buffer=None, no_alloc=True))
    if not ctx:
        raise EngineError("ggml_init failed")
    owned: list[int] = []  # the ggml buffers to free
    try:
        tensor = fn["ggml_new_tensor_1d"](ctx, GGML_TYPE_I8, nbytes)
        device_buffer = fn["ggml_backend_alloc_ctx_tensors_from_buft"](ctx, buft)
        if not device_buffer:
            raise EngineError(f"cannot allocate {nbytes} bytes on {device_name}")
        owned.append(device_buffer)
        host_name, (source, target), _keep = _host_buffers(fn, dev, nbytes, owned)
        ctypes.memset(source, TRANSFER_FILL, nbytes)  # its pages exist before the clock runs

        def timed(copy: Callable[..., None], host: int) -> float:
            started = time.perf_counter()
            copy(tensor, host, 0, nbytes)
            return time.perf_counter() - started

        upload, download = fn["ggml_backend_tensor_set"], fn["ggml_backend_tensor_get"]
        first_upload_s = timed(upload, source)
        first_download_s = timed(download, target)
        ends = ctypes.string_at(target, 1) + ctypes.string_at(target + nbytes - 1, 1)
        if ends != bytes([TRANSFER_FILL, TRANSFER_FILL]):
            raise EngineError(f"{device_name}: the bytes uploaded did not come back")
        upload_s = min(timed(upload, source) for _ in range(tries))
        download_s = min(timed(download, target) for _ in range(tries))
    finally:
        for buffer in owned:
            fn["ggml_backend_buffer_free"](buffer)
        fn["ggml_free"](ctx)
    return TransferRates(
        device=device_name,
        host_buffer=host_name,
        nbytes=nbytes,
        tries=tries,
        upload_bytes_per_s=nbytes / upload_s,
        download_bytes_per_s=nbytes / download_s,
        first_upload_s=first_upload_s,
        first_download_s=first_download_s,
    )


def _host_buffers(
    fn: dict[str, Callable[..., Any]], dev: int, nbytes: int, owned: list[int]
) -> tuple[str, tuple[int, int], list[ctypes.Array[ctypes.c_char]]]:
    """Two host buffers of `nbytes` for transfer_rates: of the device's host (pinned) buffer
    type, appended to `owned` for the caller to free, or ordinary memory, kept alive by the
    arrays returned. Returns the host side's name and the two addresses."""
    host_buft = fn["ggml_backend_dev_host_buffer_type"](dev)
    if not host_buft:
        arrays = [ctypes.create_string_buffer(nbytes) for _ in range(2)]
        return "pageable", (ctypes.addressof(arrays[0]), ctypes.addressof(arrays[1])), arrays
    name = _text(fn["ggml_backend_buft_name"](host_buft))
    bases = []
    for _ in range(2):
        buffer = fn["ggml_backend_buft_alloc_buffer"](host_buft, nbytes)
        if not buffer:
            raise EngineError(f"cannot allocate {nbytes} bytes of {name}")
        owned.append(buffer)
        bases.append(int(fn["ggml_backend_buffer_get_base"](buffer)))
    return name, (bases[0], bases[1]), []


def _transfer_functions(lib: ctypes.CDLL) -> dict[str, Callable[..., Any]]:
    """The ggml functions transfer_rates calls, their signatures set (ggml.h, ggml-alloc.h and
    ggml-backend.h; those of libggml-base resolve through libggml, which links it)."""
    p, size, text = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    signatures: dict[str, tuple[list[type], type | None]] = {
        "ggml_backend_dev_by_name": ([text], p),
        "ggml_backend_dev_buffer_type": ([p], p),
        "ggml_backend_dev_host_buffer_type": ([p], p),
        "ggml_backend_buft_name": ([p], text),
        "ggml_backend_buft_get_max_size": ([p], size),
        "ggml_backend_buft_alloc_buffer": ([p, size], p),
        "ggml_backend_buffer_get_base": ([p], p),
        "ggml_backend_buffer_free": ([p], None),
        "ggml_backend_alloc_ctx_tensors_from_buft": ([p, p], p),
        "ggml_backend_tensor_set": ([p, p, size, size], None),
        "ggml_backend_tensor_get": ([p, p, size, size], None),
        "ggml_tensor_overhead": ([], size),
        "ggml_init": ([_InitParams], p),
        "ggml_new_tensor_1d": ([p, ctypes.c_int, ctypes.c_int64], p),
        "ggml_free": ([p], None),
    }
    found: dict[str, Callable[..., Any]] = {}
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
        found[name] = function
    return found


def open_ggml(libllama: Path) -> ctypes.CDLL:
    for name in _LIBGGML:
        path = libllama.parent / name
        try:
            return ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:
            continue
    raise EngineError(f"no libggml beside {libllama} is loaded in this process")


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace").strip() if value else ""
