"""The Vulkan device the device tier runs on (tests/device), found in the engine's own registry."""

from __future__ import annotations

import os

from arbiterd.errors import EngineError
from arbiterd.native import ggml, libllama


def vulkan_device() -> ggml.Device | str:
    """The engine's first Vulkan device, or why there is none (one line)."""
    try:
        found = ggml.devices(libllama.loaded_libllama())
    except (EngineError, OSError, AttributeError) as exc:
        return f"the engine's devices cannot be read: {exc}"
    vulkan = [device for device in found if device.name.startswith("Vulkan")]
    if vulkan:
        return vulkan[0]
    listed = ", ".join(device.name for device in found) or "none"
    if "GGML_VK_VISIBLE_DEVICES" not in os.environ:
        return f"no Vulkan device listed ({listed}); GGML_VK_VISIBLE_DEVICES=0 shows a CPU-type one"
    return (
        f"no Vulkan device listed ({listed}): an engine built without Vulkan, or no Vulkan"
        " driver (Debian/Ubuntu: mesa-vulkan-drivers)"
    )
