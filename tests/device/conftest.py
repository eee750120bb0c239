"""The device tier: every test here puts models on a real Vulkan device (Mesa's llvmpipe on a
machine without a GPU) through the real engine, so the GPU path — a device buffer freed,
allocated again, re-pointed, its weights uploaded from the host copy of the file (or a shadow) —
runs for real, not through a double.

scripts/test.sh runs this tier in its own pytest run with GGML_VK_VISIBLE_DEVICES=0 (ggml-vulkan
hides CPU-type devices unless it is set, and it must be set before the engine loads) and
ARBITERD_DEVICE_TIER=required, under which a missing device fails the run instead of skipping it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from arbiterd.native import ggml
from tests.support.devices import vulkan_device

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.device)


@pytest.fixture(scope="session")
def vulkan0() -> ggml.Device:
    """The Vulkan device the tier runs on; skips (or, where the tier is required, fails) without."""
    found = vulkan_device()
    if isinstance(found, str):
        if os.environ.get("ARBITERD_DEVICE_TIER") == "required":
            pytest.fail(f"the device tier must run: {found}")
        pytest.skip(f"the device tier needs a Vulkan device: {found}")
    return found
