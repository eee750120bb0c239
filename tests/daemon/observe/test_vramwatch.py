"""The VRAM watch in-process: the engines' own figures per worker, readings, teardown checks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

from arbiterd.daemon.observe import vramwatch
from arbiterd.daemon.observe.telemetry import (
    AccountingReader,
    DeviceMemory,
    ProcessMemory,
    ReaderSet,
    Reading,
    TelemetrySnapshot,
)
from arbiterd.daemon.observe.vramwatch import VramWatch
from arbiterd.events import Event, ResidencyEvent, VramNotFreedEvent
from arbiterd.states import ResidencyState

_T = TypeVar("_T")
GiB = 1 << 30
A_PID, B_PID = 4242, 4343


def accounting_only(accounted: Callable[[], Mapping[int, int]], **_: object) -> ReaderSet:
    """What select_readers chooses on a machine without a GPU reader, whatever this one has."""
    reader = AccountingReader(accounted, total_bytes=8 * GiB, name_of=lambda pid: None)
    return ReaderSet((reader,), ("nvml: not in these tests",), context_allowance_bytes=0)


class LeakyGpu:
    """A driver that never gives memory back: A_PID holds 1 GiB on gpu0, warm or cold."""

    source = "leaky-test-gpu"

    def open(self) -> str | None:
        return None

    def close(self) -> None:
        return None

    def read(self) -> Reading:
        return Reading(
            devices=(DeviceMemory("gpu0", "test gpu", 8 * GiB, GiB),),
            processes=(ProcessMemory(A_PID, "gpu0", GiB, "python3"),),
            measured=frozenset({"gpu0"}),
        )


class Watch:
    """A VramWatch and what it told its callbacks."""

    def __init__(
        self, arena: Path, readers: ReaderSet | None = None, *, watched: bool = True
    ) -> None:
        self.snapshots: asyncio.Queue[TelemetrySnapshot] = asyncio.Queue()
        self.leaks: asyncio.Queue[Event] = asyncio.Queue()
        self.vram = VramWatch(
            arena,
            on_snapshot=self.snapshots.put_nowait,
            on_leak=self.leaks.put_nowait,
            watched=lambda: watched,
            readers=readers,
        )

    def held(self, pid: int) -> int | None:
        """What the watch's readers say `pid` holds on its device, read now."""
        return self.vram.readers.read().process_bytes(pid, self.vram.device)


@pytest.fixture(autouse=True)
def no_gpu_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vramwatch, "select_readers", accounting_only)


def residency(
    model: str, from_state: str, to_state: str, *, weights: int = 0, kv: int = 0, held: int = 0
) -> ResidencyEvent:
    """A worker's event: `weights` and `kv` moved, `held` what it holds once moved."""
    return ResidencyEvent(
        at=1.0,
        model=model,
        from_state=ResidencyState(from_state),
        to_state=ResidencyState(to_state),
        weights_bytes=weights,
        kv_bytes=kv,
        resident_bytes=held,
    )


def run(scenario: Coroutine[Any, Any, _T]) -> _T:
    async def bounded() -> _T:
        async with asyncio.timeout(30):
            return await scenario

    return asyncio.run(bounded())


def test_a_worker_is_accounted_at_what_it_says_it_holds_warm_or_cold(tmp_path: Path) -> None:
    async def scenario() -> list[int | None]:
        watch = Watch(tmp_path / "arena")
        watch.vram.worker_started("a", A_PID)
        seen = [watch.held(A_PID)]
        warm = residency("a", "warming", "warm", weights=3 * GiB, kv=GiB, held=5 * GiB)
        watch.vram.residency(A_PID, warm)
        seen.append(watch.held(A_PID))
        watch.vram.residency(A_PID, residency("a", "warm", "cooling", held=5 * GiB))
        seen.append(watch.held(A_PID))
        watch.vram.residency(A_PID, residency("a", "cooling", "cold", weights=3 * GiB, kv=GiB))
        seen.append(watch.held(A_PID))
        await watch.vram.stop()
        return seen

    # 5 GiB warm: weights and KV, and the compute buffers no event moves.
    assert run(scenario()) == [0, 5 * GiB, 5 * GiB, 0]


def test_a_warm_cpu_model_is_accounted_at_its_resident_bytes_not_at_what_moved(
    tmp_path: Path,
) -> None:
    # Issue 40: a CPU model's warm-up moved 0 bytes by its event, and the accounting reader
    # booked it at 0 while it was warm (arbiterd_vram_bytes{owner=alpha} 0.0).
    async def scenario() -> list[int | None]:
        watch = Watch(tmp_path / "arena")
        watch.vram.worker_started("a", A_PID)
        watch.vram.residency(A_PID, residency("a", "warming", "warm", held=300 << 20), ("cpu",))
        warm = await watch.vram.fresh()
        # A release that left the KV on the device: the worker still holds it, cold.
        watch.vram.residency(A_PID, residency("a", "warm", "cooling", held=300 << 20), ("cpu",))
        watch.vram.residency(A_PID, residency("a", "cooling", "cold", held=64 << 20), ("cpu",))
        cold = await watch.vram.fresh()
        await watch.vram.stop()
        return [watch.vram.model_bytes(warm, "a"), watch.vram.model_bytes(cold, "a")]

    assert run(scenario()) == [300 << 20, 64 << 20]


@pytest.mark.parametrize("to_state", ["failed", "stopped"])
def test_a_worker_that_failed_or_stopped_holds_nothing(tmp_path: Path, to_state: str) -> None:
    watch = Watch(tmp_path / "arena")
    watch.vram.residency(A_PID, residency("a", "loading", "warm", weights=GiB, held=GiB))
    watch.vram.residency(A_PID, residency("a", "warm", to_state, held=GiB))  # exiting: freed
    assert watch.held(A_PID) == 0


def test_each_worker_is_accounted_on_its_own(tmp_path: Path) -> None:
    watch = Watch(tmp_path / "arena")
    watch.vram.residency(A_PID, residency("a", "loading", "warm", weights=GiB, held=GiB))
    watch.vram.residency(B_PID, residency("b", "loading", "warm", weights=2 * GiB, held=3 * GiB))
    assert (watch.held(A_PID), watch.held(B_PID)) == (GiB, 3 * GiB)
    reading = watch.vram.readers.read()
    assert [d.used_bytes for d in reading.devices] == [4 * GiB]


def test_models_by_pid_names_the_live_workers_and_a_gone_one_holds_nothing(
    tmp_path: Path,
) -> None:
    watch = Watch(tmp_path / "arena")
    watch.vram.worker_started("a", A_PID)
    watch.vram.worker_started("b", B_PID)
    assert watch.vram.models_by_pid == {A_PID: "a", B_PID: "b"}
    watch.vram.residency(A_PID, residency("a", "loading", "warm", weights=GiB, held=GiB))
    watch.vram.residency(B_PID, residency("b", "loading", "warm", weights=GiB, held=GiB))
    watch.vram.worker_gone("a", A_PID)
    assert watch.vram.models_by_pid == {B_PID: "b"}
    assert [p.pid for p in watch.vram.readers.read().processes] == [B_PID]  # a's figure went
    watch.vram.worker_started("a", 5151)  # its restarted worker
    assert watch.vram.models_by_pid == {B_PID: "b", 5151: "a"}


def test_a_fresh_reading_agrees_with_the_residency_just_reported(tmp_path: Path) -> None:
    async def scenario() -> list[int | None]:
        watch = Watch(tmp_path / "arena")
        watch.vram.worker_started("a", A_PID)
        watch.vram.worker_started("b", B_PID)
        watch.vram.residency(A_PID, residency("a", "loading", "warm", weights=GiB, held=GiB))
        first = await watch.vram.fresh()
        watch.vram.residency(A_PID, residency("a", "cooling", "cold"))
        watch.vram.residency(B_PID, residency("b", "warming", "warm", held=2 * GiB))
        second = await watch.vram.fresh()  # right after the handoff: no lag
        await watch.vram.stop()
        return [watch.vram.model_bytes(s, m) for s in (first, second) for m in ("a", "b")]

    assert run(scenario()) == [GiB, 0, 0, 2 * GiB]


def test_status_says_the_readers_and_the_device(tmp_path: Path) -> None:
    watch = Watch(tmp_path / "gpu1")
    status = watch.vram.status(None).to_json()
    assert status == {
        "readers": "accounting (not used: nvml: not in these tests)",
        "device": "gpu1",
    }
    assert watch.vram.model_bytes(None, "a") is None


def test_a_release_is_verified_and_its_cold_footprint_kept(tmp_path: Path) -> None:
    async def scenario() -> tuple[int | None, int | None, bool]:
        watch = Watch(tmp_path / "arena")
        watch.vram.worker_started("a", A_PID)
        watch.vram.residency(A_PID, residency("a", "loading", "warm", weights=GiB, held=GiB))
        before = watch.vram.footprint("a")
        watch.vram.residency(A_PID, residency("a", "cooling", "cold"))
        await watch.vram.stop()  # waits for the teardown check
        return before, watch.vram.footprint("a"), watch.leaks.empty()

    assert run(scenario()) == (None, 0, True)


def test_a_release_that_does_not_free_vram_is_reported_once_checked(tmp_path: Path) -> None:
    async def scenario() -> tuple[Event, int | None]:
        watch = Watch(tmp_path / "arena", readers=ReaderSet((LeakyGpu(),), ()))
        watch.vram.worker_started("a", A_PID)
        watch.vram.residency(A_PID, residency("a", "cooling", "cold"))
        leak = await watch.leaks.get()  # after the check's deadline (2 s)
        await watch.vram.stop()
        return leak, watch.vram.footprint("a")

    leak, footprint = run(scenario())
    assert isinstance(leak, VramNotFreedEvent)
    assert (leak.model, leak.pid, leak.device, leak.bytes_after) == ("a", A_PID, "gpu0", GiB)
    assert footprint == GiB  # what status shows: it still holds 1 GiB


def test_the_sampler_hands_its_readings_to_the_loop(tmp_path: Path) -> None:
    async def scenario() -> int | None:
        watch = Watch(tmp_path / "arena")
        watch.vram.worker_started("a", A_PID)
        watch.vram.residency(A_PID, residency("a", "loading", "warm", weights=GiB, held=2 * GiB))
        watch.vram.start()
        try:
            watch.vram.wake()
            snapshot = await watch.snapshots.get()
        finally:
            await watch.vram.stop()
        return snapshot.model_bytes("a")

    assert run(scenario()) == 2 * GiB


def test_with_nobody_watching_the_readings_stay_off_the_loop(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, int | None]:
        watch = Watch(tmp_path / "arena", watched=False)
        watch.vram.worker_started("a", A_PID)
        watch.vram.residency(A_PID, residency("a", "loading", "warm", weights=GiB, held=2 * GiB))
        watch.vram.start()
        try:
            # A reading taken as status and a scrape take one: the sampler's hop to the loop,
            # had it made one, was scheduled before this await's result, so it would be queued.
            fresh = await watch.vram.fresh()
            queued = watch.snapshots.qsize()
        finally:
            await watch.vram.stop()
        return queued, None if fresh is None else fresh.model_bytes("a")

    assert run(scenario()) == (0, 2 * GiB)


REMOTE = ("rpc:127.0.0.1:50052", "rpc:127.0.0.1:50053")


def test_a_model_on_rpc_servers_holds_nothing_on_this_device(tmp_path: Path) -> None:
    watch = Watch(tmp_path / "arena")
    watch.vram.residency(A_PID, residency("a", "loading", "warm", weights=GiB, held=GiB), REMOTE)
    assert watch.held(A_PID) == 0


def test_a_release_of_a_model_on_rpc_servers_is_not_checked_on_this_device(
    tmp_path: Path,
) -> None:
    async def scenario() -> bool:
        watch = Watch(tmp_path / "arena", readers=ReaderSet((LeakyGpu(),), ()))
        watch.vram.worker_started("a", A_PID)
        # The leaky driver shows A_PID holding 1 GiB of gpu0 after the release, which is
        # reported for a model on gpu0 (test_a_release_that_does_not_free_vram_...).
        watch.vram.residency(A_PID, residency("a", "cooling", "cold"), REMOTE)
        await watch.vram.stop()  # waits for a teardown check, had one begun
        return watch.leaks.empty()

    assert run(scenario())


def test_a_model_split_over_this_device_and_a_server_is_accounted_here(tmp_path: Path) -> None:
    watch = Watch(tmp_path / "arena")
    split = ("gpu0", "rpc:127.0.0.1:50052")
    watch.vram.residency(A_PID, residency("a", "loading", "warm", held=GiB), split)
    watch.vram.residency(B_PID, residency("b", "loading", "warm", held=GiB), ("cpu",))
    assert (watch.held(A_PID), watch.held(B_PID)) == (GiB, GiB)
