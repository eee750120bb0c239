"""The compute devices the loaded engine offers (CPU, CUDA0, Vulkan0, ...), from ggml's registry.

Owns the ctypes handle on libggml, the library libllama links against (found beside libllama,
opened RTLD_NOLOAD: never a second copy). Read only: listing devices changes nothing.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from arbiterd.errors import EngineError

# enum ggml_backend_dev_type
_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
# Vulkan drivers that run on the CPU: Mesa's llvmpipe (its Vulkan driver is also called lavapipe)
# and Google's SwiftShader. ggml-vulkan lists such a device only when GGML_VK_VISIBLE_DEVICES names
# it, calls it kind "gpu", and reports the driver's fixed heap as its memory: the figures do not
# move with use (measured on llvmpipe: 2 GiB free whatever is allocated).
_CPU_VULKAN_DRIVERS = ("llvmpipe", "lavapipe", "swiftshader")
_LIBGGML = ("libggml.so", "libggml.so.0")


@dataclass(frozen=True)
class Device:
    name: str  # ggml's: "CPU", "CUDA0", "Vulkan0"
    description: str  # "NVIDIA H200", the CPU's model name
    kind: str  # "cpu", "gpu", "igpu", "accel" or "meta"
    free_bytes: int
    total_bytes: int

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


def devices(libllama: Path) -> list[Device]:
    """The devices of the ggml that `libllama` (a loaded library) links against."""
    lib = _open_ggml(libllama)
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
    found = []
    for index in range(int(count())):
        dev = get(index)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(
            Device(
                name=_text(lib.ggml_backend_dev_name(dev)),
                description=_text(lib.ggml_backend_dev_description(dev)),
                kind=_KINDS.get(int(kind(dev)), "unknown"),
                free_bytes=free.value,
                total_bytes=total.value,
            )
        )
    return found


def _open_ggml(libllama: Path) -> ctypes.CDLL:
    for name in _LIBGGML:
        path = libllama.parent / name
        try:
            return ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:
            continue
    raise EngineError(f"no libggml beside {libllama} is loaded in this process")


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace").strip() if value else ""
