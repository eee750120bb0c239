"""A foreign Vulkan program for the device tier's step aside test (issue 45): it takes no part in
arbiterd's protocol, and on llvmpipe it opens no device node, so only a `[yield] programs` rule
naming it (its command line holds this file's name) can catch it.

Prints the device it runs on, then copies a buffer to and from it through ggml (the engine's
own Vulkan backend: real device buffers) over and over, printing "copied" after each round,
until its standard input closes.
"""

from __future__ import annotations

import sys
import threading

from arbiterd.native import ggml, libllama
from tests.support.devices import vulkan_device

NBYTES = 16 << 20


def main() -> int:
    device = vulkan_device()
    if isinstance(device, str):
        print(f"no device: {device}", flush=True)
        return 1
    print(f"on {device.label}", flush=True)
    closed = threading.Event()

    def until_closed() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=until_closed, daemon=True).start()
    while not closed.is_set():
        ggml.transfer_rates(libllama.loaded_libllama(), device.name, NBYTES, tries=1)
        print("copied", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
