"""ggml's own copy rates of the Vulkan device (arbiterd.native.ggml.transfer_rates), the floor the
device-tier benchmarks set a release and a restore against (issue 25)."""

from __future__ import annotations

from arbiterd.native import ggml
from arbiterd.native.libllama import loaded_libllama


def test_transfer_rates_use_the_devices_pinned_host_memory(vulkan0: ggml.Device) -> None:
    rates = ggml.transfer_rates(loaded_libllama(), vulkan0.name, 4 << 20, tries=2)
    assert rates.device == vulkan0.name
    assert rates.nbytes == 4 << 20
    # ggml-vulkan's host buffer type: the pinned memory the patch's release copies into.
    assert rates.host_buffer.startswith("Vulkan")
    assert rates.upload_bytes_per_s > 0
    assert rates.download_bytes_per_s > 0
