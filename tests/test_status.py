"""The status record (arbiterd/status.py): it reads back what it writes, reads any object
without raising, writes the JSON the control socket always sent, and docs/control-protocol.md
names exactly its fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from arbiterd.events import DeviceMemory, HandoffEvent, ProcessMemory
from arbiterd.fields import Record
from arbiterd.footprint import DeviceFootprint, ModelFootprint
from arbiterd.states import BackendKind, Priority, ResidencyState, SlotState
from arbiterd.status import (
    DaemonStatus,
    Engine,
    GroupStatus,
    Holder,
    HostRam,
    Lease,
    ModelStatus,
    PromptCache,
    SteppedAside,
    Telemetry,
    Turn,
    Waiter,
)

DOC = Path(__file__).parents[1] / "docs" / "control-protocol.md"
RECORDS: tuple[type[Record], ...] = (
    DaemonStatus,
    ModelStatus,
    Holder,
    SteppedAside,
    Lease,
    Waiter,
    GroupStatus,
    HostRam,
    PromptCache,
    Engine,
    Telemetry,
    Turn,
    ModelFootprint,
    DeviceFootprint,
    DeviceMemory,
    ProcessMemory,
)
FULL = DaemonStatus(
    models=(
        ModelStatus(
            name="story",
            aliases=("gpt-4o-mini",),
            capabilities=("completion", "chat", "tools"),
            n_ctx=2048,
            host_copy="memfd",
            state=ResidencyState.WARM,
            pid=4242,
            queue=1,
            resident_bytes=265 << 20,
            served=3,
            last_handoff=HandoffEvent(at=1.0, from_model="chat", to_model="story", wait_s=0.5),
            vram_bytes=270 << 20,
            host_ram_bytes=253 << 20,
            host_copy_bytes=253 << 20,
            host_copy_shared_with=("chat",),
            backend=BackendKind.RELOAD,
            turn=Turn(quantum_s=1.8, handoff_s=0.2, handoff_measured=True, served=4),
            fallback_reason="a stock build",
        ),
        ModelStatus(name="chat", host_copy="page-cache", state=SlotState.UNLOADED),
    ),
    arena="/run/user/1000/arbiterd/arena/gpu0",
    holder=Holder(pid=4242, name="story", since=1.0),
    waiters=(Waiter(pid=77, name=None),),
    stepped_aside=SteppedAside(
        program="blender", pid=5151, reason="asked for (arbiterd yield)", since=3.0
    ),
    yield_watch="watching /dev/dri/renderD128 (inotify)",
    leases=(
        Lease(
            device="rpc:10.0.0.5:50052",
            lender="10.0.0.5:50053",
            state="revoked",
            since=4.0,
            by="game (pid 7)",
            lender_name="gaming-pc",
            received_bytes=270 << 20,
            sent_bytes=1 << 20,
        ),
    ),
    groups=(
        GroupStatus("rag", ("story",), Priority.NORMAL, holds_token=True, handoffs=2, failure=""),
    ),
    telemetry=Telemetry(
        at=2.0,
        source="nvml",
        devices=(DeviceMemory("gpu0", "NVIDIA H200", 141 << 30, 1 << 30),),
        models=(("story", 270 << 20), ("chat", None)),
        others=(ProcessMemory(pid=9, device="gpu0", used_bytes=1 << 20, name="Xorg"),),
        readers="nvml",
        device="gpu0",
    ),
    host_ram_bytes=253 << 20,
    host_ram=HostRam(host_copies_bytes=253 << 20, budget_bytes=16 << 30),
    prompt_cache=PromptCache(bytes_=50 << 20, files=2, budget_bytes=4 << 30),
    engine=Engine(offload=False, devices=("CPU: test cpu",)),
)


def test_a_status_reads_back_as_it_was_written() -> None:
    assert DaemonStatus.from_json(FULL.to_json()) == FULL


def test_a_models_state_reads_as_a_residency_or_a_slot_state_else_unknown() -> None:
    read = DaemonStatus.from_json(
        {"models": [{"state": "warm"}, {"state": "unloading"}, {"state": "hibernating"}, {}]}
    )
    assert [m.state for m in read.models] == ["warm", "unloading", "unknown", "unknown"]
    assert [type(m.state) for m in read.models[:2]] == [ResidencyState, SlotState]


@pytest.mark.parametrize(
    "odd",
    [
        {},
        {"models": 3, "holder": "x", "telemetry": [], "engine": "gpu", "host_ram": 5},
        {"models": [7, {"name": 3, "queue": "lots", "last_handoff": [], "backend": 1}]},
        {"groups": [{"models": "a", "holds_token": "yes"}], "waiters": [None]},
    ],
)
def test_any_object_reads_without_raising(odd: dict[str, Any]) -> None:
    read = DaemonStatus.from_json(odd)
    assert all(isinstance(m, ModelStatus) for m in read.models)
    assert read.engine is None or isinstance(read.engine, Engine)


def test_the_json_has_the_keys_the_control_socket_always_sent() -> None:
    written = FULL.to_json()
    story, chat = written["models"]
    assert story["state"] == "warm"
    assert story["last_handoff"] == FULL.models[0].last_handoff.to_json()  # type: ignore[union-attr]
    assert (story["host_copy_bytes"], story["host_copy_shared_with"]) == (253 << 20, ["chat"])
    # A model without a host copy says nothing of one.
    assert "host_copy_bytes" not in chat
    assert "host_copy_shared_with" not in chat
    assert written["telemetry"]["models"] == {"story": 270 << 20, "chat": None}
    # Before its first reading, the telemetry names only its readers and device.
    assert Telemetry(readers="nvml", device="gpu0").to_json() == {
        "readers": "nvml",
        "device": "gpu0",
    }


def _fields(record: type[Record]) -> set[str]:
    return {f.metadata.get("json", f.name) for f in dataclasses.fields(record)}  # type: ignore[arg-type]


def _documented() -> dict[str, set[str]]:
    """Each record section of the doc's status (a `#### \\`Name\\`` heading) and the fields its
    table names."""
    sections: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in DOC.read_text().splitlines():
        heading = re.fullmatch(r"#### `(\w+)`", line)
        if heading:
            current = sections.setdefault(heading[1], set())
        elif line.startswith("#"):
            current = None
        elif current is not None and (row := re.match(r"\| `(\w+)` \|", line)):
            current.add(row[1])
    return sections


def test_the_protocol_doc_names_every_field_of_every_status_record_and_no_other() -> None:
    documented = _documented()
    assert set(documented) == {record.__name__ for record in RECORDS}
    for record in RECORDS:
        assert documented[record.__name__] == _fields(record), record.__name__
