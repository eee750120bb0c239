"""Says whether the engine offers a Vulkan device, for scripts/test.sh's device tier.

Prints the first Vulkan device's label (e.g. "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits)") and
exits 0, or prints why there is none and exits 1. ggml-vulkan lists a CPU-type device such as
llvmpipe only when GGML_VK_VISIBLE_DEVICES names it, so the caller sets that first.
"""

from __future__ import annotations

import sys

from tests.support.devices import vulkan_device


def main() -> int:
    found = vulkan_device()
    if isinstance(found, str):
        print(found)
        return 1
    print(found.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
