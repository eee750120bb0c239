"""Why models that ask for GPU layers run on the CPU, and the advice for this machine (issue 30):
device-node fixtures in a folder standing for /dev, the engine's report, the note said."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from arbiterd.offload import backend_for, cpu_note, gpu_nodes, rebuild_command, setup_script
from arbiterd.states import CpuCause

SCRIPT = Path("/home/me/src/arbiterd/scripts/setup.sh")


def make_dev(tmp_path: Path, *nodes: str) -> Path:
    dev = tmp_path / "dev"
    for node in ("null", "tty0", "dri/card0", *nodes):  # not GPU nodes: a card is not a render node
        (dev / node).parent.mkdir(parents=True, exist_ok=True)
        (dev / node).touch()
    return dev


def test_a_machine_without_gpu_nodes_has_none(tmp_path: Path) -> None:
    assert gpu_nodes(make_dev(tmp_path)) == ()


def test_render_nodes_nvidia_devices_and_kfd_are_gpu_nodes(tmp_path: Path) -> None:
    dev = make_dev(tmp_path, "dri/renderD128", "nvidia0", "nvidiactl", "nvidia-uvm", "kfd")
    assert gpu_nodes(dev) == tuple(
        str(dev / n) for n in ("dri/renderD128", "kfd", "nvidia0")
    )  # nvidiactl and nvidia-uvm are the driver's, not a GPU


def test_an_engine_that_offloads_has_nothing_said_of_it() -> None:
    assert cpu_note((), True, SCRIPT) is None
    assert cpu_note(("/dev/nvidia0",), True, SCRIPT) is None


def test_a_machine_without_a_gpu_is_told_so_and_not_to_rebuild() -> None:
    note = cpu_note((), False, SCRIPT)
    assert note is not None
    assert (note.cause, note.warning) == (CpuCause.NO_GPU, False)
    assert "this machine has no GPU" in note.text
    assert "ARBITERD_ENGINE" not in note.text
    assert "rebuild" not in note.text


@pytest.mark.parametrize(
    ("nodes", "backend"),
    [
        (("/dev/dri/renderD128", "/dev/nvidia0"), "cuda"),
        (("/dev/dri/renderD128", "/dev/kfd"), "rocm"),
        (("/dev/dri/renderD128",), "vulkan"),
    ],
)
def test_a_machine_with_a_gpu_is_warned_with_a_command_for_that_gpu(
    nodes: tuple[str, ...], backend: str
) -> None:
    assert backend_for(nodes) == backend
    note = cpu_note(nodes, False, SCRIPT)
    assert note is not None
    assert (note.cause, note.warning) == (CpuCause.ENGINE, True)
    assert f"`ARBITERD_ENGINE={backend} bash {SCRIPT}`" in note.text
    assert ", ".join(nodes) in note.text
    assert "|" not in note.text  # no cuda|rocm|vulkan for a shell to read as pipes


def test_without_a_clone_the_advice_is_pip_with_the_backends_switch() -> None:
    command = rebuild_command("vulkan", None)
    words = shlex.split(command)
    assert words[0] == "CMAKE_ARGS=-DGGML_VULKAN=on"
    assert words[2:] == [
        "-m", "pip", "install", "--force-reinstall", "--no-cache-dir", "llama-cpp-python"
    ]  # fmt: skip


def test_the_advised_command_runs_setup_as_a_script_when_pasted(tmp_path: Path) -> None:
    """Pasted into a shell: an environment word, then bash running this clone's setup.sh (it is
    sourced by test.sh and demo.sh, and not executable). Run here with a bash that only
    records what it was given, so nothing is built."""
    script = setup_script()
    assert script is not None
    assert script.name == "setup.sh"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "bash").write_text('#!/bin/sh\necho "$ARBITERD_ENGINE $*"\n')
    (fake / "bash").chmod(0o755)
    done = subprocess.run(
        ["/bin/sh", "-c", rebuild_command("cuda", script)],
        env={"PATH": f"{fake}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["cuda", str(script)]
