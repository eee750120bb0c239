"""`arbiterd status` on the engine (issue 30): why the models run on the CPU said once, as a
warning only where a GPU goes unused, and "VRAM" only of a GPU's memory."""

from __future__ import annotations

from typing import Any

from arbiterd.cli.commands import render_status
from arbiterd.offload import cpu_note, setup_script
from arbiterd.status import DaemonStatus

MODELS = [{"name": "story", "state": "warm"}, {"name": "chat", "state": "cold"}]


def rendered(engine: dict[str, Any] | None, **fields: Any) -> list[str]:
    raw: dict[str, Any] = {"models": MODELS, **fields}
    if engine is not None:
        raw["engine"] = engine
    return render_status(DaemonStatus.from_json(raw)).splitlines()


def engine_of(nodes: tuple[str, ...], offload: bool) -> dict[str, Any]:
    engine: dict[str, Any] = {"offload": offload, "devices": ["CPU: test cpu"]}
    note = cpu_note(nodes, offload, setup_script())
    if note is not None:
        engine |= {"cpu_cause": str(note.cause), "cpu_note": note.text}
    return engine


def test_a_machine_without_a_gpu_says_so_on_the_engine_line_and_warns_of_nothing() -> None:
    lines = rendered(engine_of((), offload=False))
    assert lines[0].split()[:4] == ["MODEL", "STATE", "BACKEND", "RAM"]
    engine = [line for line in lines if line.startswith("engine:")]
    assert engine == [
        "engine: CPU only: this machine has no GPU (no /dev/dri render node, /dev/nvidia* or "
        "/dev/kfd), so the models run on the CPU"
    ]
    assert not [line for line in lines if "warning" in line or "setup.sh" in line]


def test_a_gpu_the_engine_does_not_use_is_one_warning_for_all_models() -> None:
    lines = rendered(engine_of(("/dev/dri/renderD128",), offload=False))
    assert lines[0].split()[3] == "RAM"  # the CPU holds them, whatever the machine has
    assert "engine: CPU only (this engine cannot offload to a GPU)" in lines
    warnings = [line for line in lines if line.startswith("warning")]
    assert len(warnings) == 1
    assert f"`ARBITERD_ENGINE=vulkan bash {setup_script()}`" in warnings[0]


def test_vram_is_said_of_an_engine_that_offloads() -> None:
    lines = rendered({"offload": True, "devices": ["CPU: x", "CUDA0: test gpu"]})
    assert lines[0].split()[3] == "VRAM"
    assert "engine: CUDA0: test gpu (GPU offload)" in lines


def test_before_any_worker_said_the_column_is_vram_only_where_a_device_is_read() -> None:
    assert rendered(None)[0].split()[3] == "MEMORY"
    device = {"device": "gpu0", "used_bytes": 1, "total_bytes": 2}
    assert rendered(None, telemetry={"at": 1.0, "devices": [device]})[0].split()[3] == "VRAM"


def test_the_engines_own_figures_on_a_machine_without_a_gpu_are_the_cpus_host_ram() -> None:
    # Issue 40: status said "gpu0: 0 B used of 23.5 GiB" on a machine without a GPU.
    device = {"device": "gpu0", "name": "engine accounting", "used_bytes": 300 << 20,
              "total_bytes": 16 << 30}  # fmt: skip
    telemetry = {"at": 1.0, "source": "accounting", "devices": [device], "device": "gpu0"}
    lines = rendered(engine_of((), offload=False), telemetry=telemetry)
    assert "CPU (host RAM): 300.0 MiB used of 16.0 GiB (accounting)" in lines
    assert not [line for line in lines if line.startswith("gpu0")]
    # A GPU the engine offloads to keeps its id, even where only the engines' figures say.
    offloads = rendered({"offload": True, "devices": ["CUDA0: test gpu"]}, telemetry=telemetry)
    assert "gpu0: 300.0 MiB used of 16.0 GiB (accounting)" in offloads
    # And a GPU a reader measures is that GPU's, whatever runs the models.
    measured = rendered(engine_of((), offload=False), telemetry={**telemetry, "source": "nvml"})
    assert "gpu0: 300.0 MiB used of 16.0 GiB (nvml)" in measured
