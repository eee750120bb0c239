"""The engine's devices, read from the registry of the libggml llama_cpp loaded (no GPU needed:
every build has its CPU device)."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbiterd.errors import EngineError
from arbiterd.native import ggml
from arbiterd.native.libllama import loaded_libllama
from tests.native.test_libllama import mapped_paths
from tests.support.fake_libllama import compile_fake


def test_the_loaded_engine_lists_its_cpu() -> None:
    found = ggml.devices(loaded_libllama())
    cpus = [device for device in found if device.kind == "cpu"]
    assert cpus, found
    cpu = cpus[0]
    assert cpu.name
    assert cpu.label.startswith(cpu.name)
    assert 0 < cpu.free_bytes <= cpu.total_bytes
    assert all(device.kind != "unknown" for device in found), found


def test_a_libllama_without_libggml_beside_it_is_an_engine_error(tmp_path: Path) -> None:
    lonely = tmp_path / "libllama.so"
    with pytest.raises(EngineError, match=f"no libggml beside {lonely} is loaded"):
        ggml.devices(lonely)


def test_a_libggml_that_is_not_loaded_is_never_opened(tmp_path: Path) -> None:
    # A libggml.so beside the library, but not the one this process loaded: listing devices
    # must not dlopen a second ggml (RTLD_NOLOAD), so this is an error, not its devices.
    stranger = compile_fake(tmp_path, "libggml")
    assert stranger.name == "libggml.so"
    with pytest.raises(EngineError, match="no libggml beside"):
        ggml.devices(tmp_path / "libllama.so")
    assert stranger not in mapped_paths()


def test_a_vulkan_device_whose_driver_runs_on_the_cpu_says_so() -> None:
    llvmpipe = ggml.Device("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "gpu", 2 << 30, 2 << 30)
    assert llvmpipe.on_cpu
    assert llvmpipe.label == "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) [runs on the CPU]"
    radeon = ggml.Device("Vulkan0", "AMD Radeon RX 7900 XTX (RADV NAVI31)", "gpu", 1, 2)
    cuda = ggml.Device("CUDA0", "NVIDIA H200", "gpu", 1, 2)
    assert not radeon.on_cpu
    assert not cuda.on_cpu
    assert radeon.label == "Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31)"


def test_transfer_rates_move_the_bytes_both_ways_on_the_cpu_device() -> None:
    cpu = next(device for device in ggml.devices(loaded_libllama()) if device.kind == "cpu")
    rates = ggml.transfer_rates(loaded_libllama(), cpu.name, 1 << 20, tries=2)
    assert (rates.device, rates.nbytes, rates.tries) == (cpu.name, 1 << 20, 2)
    assert rates.host_buffer  # the CPU has no pinned host buffer type of its own
    assert rates.upload_bytes_per_s > 0
    assert rates.download_bytes_per_s > 0
    assert rates.first_upload_bytes_per_s > 0
    assert rates.to_json()["device"] == cpu.name


def test_transfer_rates_of_a_device_ggml_does_not_list_is_an_engine_error() -> None:
    with pytest.raises(EngineError, match="no device named 'Nowhere0'"):
        ggml.transfer_rates(loaded_libllama(), "Nowhere0", 1 << 20)
