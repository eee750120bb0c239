"""Why models that ask for GPU layers run on the CPU, and what would help on this machine.

Owns the one cause the daemon states for it (issue 30): llama.cpp runs every layer on the CPU
when its engine cannot offload, which looks like a very slow GPU, so the daemon says why once
per cause — not once per model — and its advice fits the machine it runs on:

    the machine's GPU nodes     the engine          said
    none                        cannot offload      info: no GPU here, the CPU is all there is
    /dev/nvidia*, /dev/kfd,     cannot offload      warning: a command that rebuilds the engine
    /dev/dri/renderD*                               for that GPU (CUDA, ROCm, else Vulkan)
    any                         offloads            nothing

`cpu_note` decides it from the device nodes and the engine's report, pure; `gpu_nodes` and
`setup_script` read the two facts it needs from this machine. Shared by the daemon and its
clients: imports only arbiterd.states, never Qt.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from arbiterd.states import CpuCause

# A GPU's device nodes, as the kernel's drivers name them: a DRM render node (any GPU with a
# DRM driver: AMD, Intel, NVIDIA's nouveau or nvidia-drm), NVIDIA's own driver's device files,
# and AMD's compute interface, which ROCm needs.
GPU_NODE_GLOBS = ("dri/renderD*", "nvidia[0-9]*", "kfd")
# llama-cpp-python's CMake switch for each backend setup.sh can build (a wheel install has no
# setup.sh: pip builds the stock engine with it).
CMAKE_SWITCH = {"cuda": "-DGGML_CUDA=on", "rocm": "-DGGML_HIP=on", "vulkan": "-DGGML_VULKAN=on"}


@dataclass(frozen=True)
class CpuNote:
    """What to say of models that run on the CPU: a warning when something would help."""

    cause: CpuCause
    text: str

    @property
    def warning(self) -> bool:
        return self.cause is CpuCause.ENGINE


def gpu_nodes(dev: Path = Path("/dev")) -> tuple[str, ...]:
    """The GPU device nodes under `dev`, sorted (empty on a machine without a GPU)."""
    return tuple(sorted(str(path) for glob in GPU_NODE_GLOBS for path in dev.glob(glob)))


def setup_script() -> Path | None:
    """scripts/setup.sh of the clone arbiterd runs from, or None for an installed wheel."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
    return script if script.is_file() else None


def backend_for(nodes: Sequence[str]) -> str:
    """The engine backend for the GPU these nodes are of: CUDA for NVIDIA's driver, ROCm for
    AMD's compute interface, else Vulkan, which any GPU with a render node can run."""
    names = [Path(node).name for node in nodes]
    if any(name.startswith("nvidia") for name in names):
        return "cuda"
    return "rocm" if "kfd" in names else "vulkan"


def rebuild_command(backend: str, script: Path | None) -> str:
    """A command that, pasted into a shell, builds an engine for `backend`: setup.sh of the
    clone (it is meant to be sourced by scripts/test.sh and demo.sh, and runs as well under
    bash), else pip with llama-cpp-python's CMake switch."""
    if script is not None:
        return f"ARBITERD_ENGINE={backend} bash {shlex.quote(str(script))}"
    return (
        f"CMAKE_ARGS={CMAKE_SWITCH[backend]} {shlex.quote(sys.executable)} -m pip install "
        "--force-reinstall --no-cache-dir llama-cpp-python"
    )


def cpu_note(nodes: Sequence[str], offload: bool, script: Path | None) -> CpuNote | None:
    """Why models that ask for GPU layers run on the CPU, given the machine's GPU device
    `nodes` and whether the engine can `offload`; None when it can (nothing to say)."""
    if offload:
        return None
    if not nodes:
        return CpuNote(
            CpuCause.NO_GPU,
            "CPU only: this machine has no GPU (no /dev/dri render node, /dev/nvidia* or "
            "/dev/kfd), so the models run on the CPU",
        )
    command = rebuild_command(backend_for(nodes), script)
    return CpuNote(
        CpuCause.ENGINE,
        f"the models run on the CPU: this engine cannot offload to the GPU this machine has "
        f"({', '.join(nodes)}; a CPU-only build, or no driver it can use); `{command}` builds "
        "one for it, then restart arbiterd",
    )
