"""The device tier of the benchmarks (issue 25): how --device picks n_gpu_layers and makes the
Vulkan device visible, how each benchmark reads --device, the ratios against the device's copy
rates, and the first-release figures - all without a device."""

from __future__ import annotations

import os

import pytest

from benchmarks import first_release, on_device, residency_roundtrip, worker_handoff


def test_a_device_gets_every_layer_and_the_cpu_none_unless_told() -> None:
    assert on_device.gpu_layers("cpu", None) == 0
    assert on_device.gpu_layers("vulkan", None) == -1
    assert on_device.gpu_layers("vulkan", 12) == 12
    assert on_device.gpu_layers("cpu", -1) == -1  # what --n-gpu-layers always did
    with pytest.raises(ValueError, match="not --n-gpu-layers 0"):
        on_device.gpu_layers("vulkan", 0)


def test_vulkan_makes_the_first_device_visible_unless_the_environment_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(on_device.VISIBLE_DEVICES, raising=False)
    on_device.select("cpu")
    assert on_device.VISIBLE_DEVICES not in os.environ
    on_device.select("vulkan")
    assert os.environ[on_device.VISIBLE_DEVICES] == "0"
    monkeypatch.setenv(on_device.VISIBLE_DEVICES, "1")
    on_device.select("vulkan")
    assert os.environ[on_device.VISIBLE_DEVICES] == "1"


def test_a_time_is_set_against_the_copy_and_the_first_touch_copy_of_its_bytes() -> None:
    figures = on_device.versus_floor(3.0, 1000, bytes_per_s=1000.0, first_touch_bytes_per_s=500.0)
    assert figures == {
        "median_s": 3.0,
        "bytes": 1000,
        "floor_s": 1.0,
        "ratio": 3.0,
        "first_touch_floor_s": 2.0,
        "ratio_first_touch": 1.5,
    }
    assert on_device.versus_floor(1.0, 0, 1.0, 1.0)["ratio"] is None


def test_worker_handoff_reads_the_device_and_refuses_no_layers_on_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, args = worker_handoff.parse_args(["--device", "vulkan"])
    assert args.n_gpu_layers == -1
    _, args = worker_handoff.parse_args([])
    assert (args.device, args.n_gpu_layers) == ("cpu", 0)
    with pytest.raises(SystemExit) as exited:
        worker_handoff.parse_args(["--device", "vulkan", "--n-gpu-layers", "0"])
    assert exited.value.code == 2
    assert "not --n-gpu-layers 0" in capsys.readouterr().err


def test_residency_roundtrip_measures_fresh_processes_on_a_device_only_by_default() -> None:
    on_vulkan = residency_roundtrip.parse_args(["--device", "vulkan"])
    assert (on_vulkan.n_gpu_layers, on_vulkan.fresh_processes) == (
        -1,
        residency_roundtrip.FRESH_PROCESSES_ON_DEVICE,
    )
    on_cpu = residency_roundtrip.parse_args([])
    assert (on_cpu.n_gpu_layers, on_cpu.fresh_processes) == (0, 0)
    assert residency_roundtrip.parse_args(["--fresh-processes", "3"]).fresh_processes == 3
    with pytest.raises(SystemExit):
        residency_roundtrip.parse_args(["--fresh-processes", "-1"])


def test_first_release_needs_a_later_round_to_compare_with() -> None:
    _, args = first_release.parse_args(["--device", "vulkan"])
    assert (args.n_gpu_layers, args.processes, args.rounds) == (-1, 10, 4)
    with pytest.raises(SystemExit):
        first_release.parse_args(["--rounds", "1"])


def rounds(*release_s: float) -> dict[str, object]:
    parts = dict.fromkeys(first_release.PARTS, 1.0)
    return {"rounds": [{**parts, "release_s": s} for s in release_s], "first_request_s": 1.0}


def test_the_first_round_of_each_process_is_set_against_all_later_ones() -> None:
    children = [rounds(3.0, 1.0, 1.0), rounds(5.0, 2.0, 1.0), rounds(4.0, 1.0, 9.0)]
    figures = first_release.first_and_later(children)
    release = figures["parts"]["release"]
    assert release["first"]["median_s"] == 4.0
    assert release["later"]["median_s"] == 1.0
    assert figures["first_release_vs_later"] == 4.0
    assert figures["goal_met"] is False
    assert figures["first_restore_vs_later"] == 1.0
