#!/usr/bin/env bash
# The whole test suite on a fresh machine: sets up .venv, then lint, types and every test, in two
# tiers: the CPU tier (no GPU device visible to the engine), then the device tier (tests/device:
# models on a real Vulkan device — Mesa's llvmpipe, a Vulkan driver that runs on the CPU, where
# no GPU is present). The engine is built with Vulkan (it keeps the CPU backend, so one engine
# serves both tiers); ARBITERD_ENGINE chooses another, and the device tier then says why it did
# not run. Under CI=true the device tier must run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${ARBITERD_ENGINE:-} ]]; then
    export ARBITERD_ENGINE=vulkan
    # llvmpipe and what a Vulkan build needs (Debian/Ubuntu names; setup says so where it
    # cannot install them, and builds the CPU engine when the toolchain is missing).
    export ARBITERD_WANT_PACKAGES="mesa-vulkan-drivers glslc libvulkan-dev spirv-headers"
fi
ARBITERD_EXTRAS="engine,dev,demo,gui" source scripts/setup.sh
# The install tests validate the desktop and unit files with the tools the desktop uses; the
# native tests build a fake libllama with gcc.
need_system_packages desktop-file-utils systemd gcc

pytest_status() {
    # pytest's exit status, with "no tests collected" (5) counted as a pass: a -k that selects
    # nothing in one tier is not a failure.
    local status=0
    .venv/bin/python -m pytest "$@" || status=$?
    if [[ $status -eq 5 ]]; then
        echo "test: pytest collected no tests for this selection" >&2
        status=0
    fi
    return "$status"
}

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
status=0
# No Vulkan device is visible to the CPU tier, whatever the machine has.
GGML_VK_VISIBLE_DEVICES="" pytest_status -m "not device" "$@" || status=$?
# ggml-vulkan lists a CPU-type device (llvmpipe) only when GGML_VK_VISIBLE_DEVICES names it.
if device="$(GGML_VK_VISIBLE_DEVICES=0 .venv/bin/python -m tests.support.vulkan_probe)"; then
    echo "test: the device tier, on $device" >&2
    GGML_VK_VISIBLE_DEVICES=0 ARBITERD_DEVICE_TIER=required \
        pytest_status -m device "$@" || status=$?
else
    echo "test: the device tier did not run: $device" >&2
    if [[ -n ${CI:-} ]]; then
        echo "test: CI must run the device tier" >&2
        status=1
    fi
fi
exit "$status"
