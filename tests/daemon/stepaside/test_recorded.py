"""The memory rule on machines recorded for real (tests/fixtures/telemetry: amdgpu, i915, xe):
the lookout's scan reads the recorded /proc tree (each process given the `stat` and `cmdline`
a live one has), the DRM fdinfo reader measures what each holds on the device, and the policy
steps aside for the game by its memory, never for the daemon's own worker nor for a program
`ignore` names; and NVIDIA's process lists through the NVML reader on a pynvml stand-in with
the real module's names (tests/daemon/observe/telemetry/support.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from arbiterd.config import YieldRules
from arbiterd.daemon.observe.telemetry import DrmFdinfoReader, NvmlReader
from arbiterd.daemon.stepaside.lookout import Lookout
from arbiterd.daemon.stepaside.policy import Aside, Sighting, next_aside
from arbiterd.daemon.stepaside.programs import Program
from tests.daemon.observe.telemetry.support import copied_tree, two_gpus
from tests.support.waiting import until

MiB = 1 << 20
# The recorded links' targets: no such nodes here, and a scan matches the links' text.
NODES = [Path(f"/dev/dri/{name}") for name in ("card0", "card1", "renderD128", "renderD129")]
# Each recorded pid as a live process would show it: (comm, argv).
PROCESSES = {
    "amdgpu": {
        4242: ("python3", ["python3", "-m", "arbiterd.worker"]),
        5151: ("Game.exe", ["Z:\\games\\Game.exe"]),
        6161: ("kwin_wayland", ["kwin_wayland"]),
        7171: ("bash", ["bash"]),
    },
    "i915": {3001: ("blender", ["/usr/bin/blender"])},
    "xe": {9001: ("ComfyUI", ["python", "main.py"])},
}


def live_like(machine: str, tmp_path: Path) -> tuple[Path, Path]:
    """The recorded machine's trees, each pid given a stat line and a command line."""
    sysfs, procfs = copied_tree(machine, tmp_path)
    for pid, (comm, argv) in PROCESSES[machine].items():
        # Fields after the name: state, ppid (1), ... starttime (field 22) = pid * 100.
        after = ["S", "1", *["0"] * 17, str(pid * 100), *["0"] * 30]
        (procfs / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(after)}\n")
        (procfs / str(pid) / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
    return sysfs, procfs


def look(machine: str, tmp_path: Path) -> tuple[Sighting, ...]:
    """One whole look of the lookout at the recorded machine."""
    sysfs, procfs = live_like(machine, tmp_path)
    reader = DrmFdinfoReader(procfs, sysfs)
    assert reader.open() is None

    def measure() -> dict[int, int]:
        return {p.pid: p.used_bytes or 0 for p in reader.read().processes if p.pid is not None}

    seen: list[tuple[Sighting, ...]] = []

    async def scenario() -> None:
        lookout = Lookout(
            lambda sightings, whole, began: seen.append(sightings),
            measure=measure,
            scan_s=60,
            by_name=False,
            procfs=procfs,
            nodes=NODES,
        )
        lookout.start()
        await until(lambda: seen, 10, "the first look")
        await lookout.close()

    asyncio.run(scenario())
    return seen[0]


def stepped_for(sightings: tuple[Sighting, ...], rules: YieldRules, own: set[int]) -> Aside | None:
    return next_aside(None, sightings, rules, own=own, passed=(), now=1.0)


MEMORY_ONLY = YieldRules(programs=(), min_bytes=512 * MiB)


def test_amdgpu_a_game_over_min_bytes_is_stepped_aside_for_and_the_worker_never(
    tmp_path: Path,
) -> None:
    sightings = look("amdgpu", tmp_path)
    by_pid = {s.program.pid: s for s in sightings}
    assert by_pid[5151].program.nodes == {"/dev/dri/renderD129"}
    assert by_pid[5151].used_bytes == 1024 * MiB  # the 5.19-6.8 format's drm-memory-vram
    assert by_pid[6161].used_bytes is None  # GTT only: nothing on the device
    aside = stepped_for(sightings, MEMORY_ONLY, own={4242})
    assert aside is not None
    assert (aside.pid, aside.name, aside.by_memory) == (5151, "Game.exe", True)
    assert aside.reason == "holds 1.0 GiB of device memory ([yield] min_bytes is 512.0 MiB)"
    # Named in ignore, the game is not stepped aside for by its memory.
    ignoring = YieldRules(programs=(), min_bytes=512 * MiB, ignore=("game.exe",))
    assert stepped_for(sightings, ignoring, own={4242}) is None
    # Over a higher threshold, nothing is.
    assert stepped_for(sightings, YieldRules(programs=(), min_bytes=2048 * MiB), {4242}) is None


@pytest.mark.parametrize(
    ("machine", "pid", "used"),
    [("i915", 3001, 3072 * MiB), ("xe", 9001, 2052 * MiB + 512 * MiB)],
)
def test_intel_local_memory_over_min_bytes_is_stepped_aside_for(
    tmp_path: Path, machine: str, pid: int, used: int
) -> None:
    sightings = look(machine, tmp_path)
    aside = stepped_for(sightings, MEMORY_ONLY, own=set())
    assert aside is not None
    assert (aside.pid, aside.used_bytes) == (pid, used)


def test_nvidia_a_game_in_nvmls_graphics_list_over_min_bytes_is_stepped_aside_for() -> None:
    """NVML's process lists (the reader on pynvml's names, tests/daemon/observe/telemetry): the
    game's 2 GiB in the graphics list, the worker's 6 GiB counted once though listed twice; a
    process NVML lists without a figure never counts as over min_bytes."""
    reader = NvmlReader(two_gpus(), name_of=lambda pid: None)
    assert reader.open() is None
    used = {p.pid: p.used_bytes for p in reader.read().processes if p.pid is not None}
    assert used == {4242: 6 << 30, 4343: None, 5151: 2 << 30}
    programs = {
        4242: Program(4242, 100, "python3", ("python3", "-m", "arbiterd.worker"), 1),
        4343: Program(4343, 200, "cudaapp", ("cudaapp",), 1),
        5151: Program(5151, 300, "Game.exe", ("Game.exe",), 1),
    }
    sightings = tuple(Sighting(programs[pid], used[pid]) for pid in programs)
    aside = stepped_for(sightings, MEMORY_ONLY, own={4242})
    assert aside is not None
    assert (aside.pid, aside.used_bytes) == (5151, 2 << 30)
