"""The event records: each kind round-trips, and old, garbled or unknown objects still read."""

from __future__ import annotations

import math
from typing import Any

import pytest

from arbiterd.events import (
    KINDS,
    DeviceMemory,
    EncoderEvent,
    Event,
    HandoffEvent,
    HolderSilentEvent,
    HoldEvent,
    LeaseEvent,
    OtherEvent,
    OverflowEvent,
    PassedOverEvent,
    ProcessMemory,
    PromptCacheEvictEvent,
    RamBudgetEvent,
    ReloadEvent,
    RequestEvent,
    ResidencyEvent,
    StepAsideEvent,
    UnloadEvent,
    VramEvent,
    VramNotFreedEvent,
    WaitEvent,
    WorkerEvent,
    parse_event,
)
from arbiterd.states import (
    PassOverReason,
    ReleaseReason,
    RequestStatus,
    ResidencyState,
    UnloadReason,
)

T = 1_718_000_000.25
GiB = 1 << 30

# One of each kind with every field set (none at its default), as the daemon would send it.
SAMPLES: list[Event] = [
    ResidencyEvent(
        at=T,
        model="gemma",
        from_state=ResidencyState.WARMING,
        to_state=ResidencyState.WARM,
        duration_s=0.92,
        weights_bytes=300 << 20,
        kv_bytes=12 << 20,
        disk_read_bytes=4096,
        reason="wanted",
        waited_from=T - 2,
        wait_s=1.0,
        holder_pid=4243,
        holder_name="tiny",
    ),
    RequestEvent(
        at=T,
        model="gemma",
        request_id="cmpl-1",
        duration_s=0.5,
        prompt_tokens=212,
        prompt_tokens_evaluated=12,
        completion_tokens=40,
        cancelled=True,
        status=RequestStatus.CANCELLED,
        error="the client went away",
    ),
    HandoffEvent(
        at=T,
        from_model="gemma",
        to_model="tiny",
        holder_pid=4242,
        waited_from=T - 1.5,
        wait_s=0.5,
        release_s=0.4,
        restore_s=0.9,
        restored_bytes=GiB,
        release_reason=ReleaseReason.WANTED,
        devices=("gpu0",),
        turn_served=7,
    ),
    WaitEvent(
        at=T,
        model="tiny",
        holder_pid=777,
        holder_name="steam",
        waited_from=T - 30,
        wait_s=29.5,
    ),
    WorkerEvent(
        at=T,
        model="gemma",
        pid=4242,
        code=-6,
        reason="killed by signal 6",
        restart_in_s=1.0,
        last_words=("corrupted double-linked list",),
    ),
    ReloadEvent(at=T, added=("a",), removed=("b", "c"), changed=("d",), warnings=("a: no mmproj",)),
    HoldEvent(at=T, held=True),
    StepAsideEvent(
        at=T,
        aside=True,
        program="blender",
        pid=5151,
        reason="named in [yield] programs ('blender')",
        used_bytes=3 << 30,
    ),
    UnloadEvent(
        at=T,
        model="gemma",
        pid=4242,
        reason=UnloadReason.IDLE,
        kv_file="/state/arbiterd/prompt-cache/gemma.kv",
        kv_bytes=3 << 20,
        tokens=812,
    ),
    RamBudgetEvent(
        at=T, used_bytes=9 * GiB, budget_bytes=8 * GiB, unload=("a", "b"), after_bytes=7 * GiB
    ),
    PromptCacheEvictEvent(
        at=T,
        model="gemma",
        evicted=("old",),
        evicted_bytes=3 << 20,
        used_bytes=5 << 20,
        budget_bytes=8 << 20,
    ),
    EncoderEvent(
        at=T,
        model="eye",
        request_id="r8",
        action="encode",
        duration_s=0.004,
        bytes_=1024,
        images=1,
        path="swap",
        peak_bytes=6728960,
        reason="the model's 6.4 MiB and the projector's 155.3 KiB exceed the budget of 6.5 MiB",
    ),
    VramEvent(
        at=T,
        source="nvml",
        devices=(DeviceMemory("gpu0", "NVIDIA H200", 140 * GiB, 3 * GiB),),
        models=(("gemma", GiB), ("tiny", None)),
        others=(ProcessMemory(9, "gpu0", GiB, "Xorg"),),
        errors=("fdinfo: permission denied",),
    ),
    VramNotFreedEvent(
        at=T,
        model="gemma",
        pid=4242,
        device="gpu0",
        bytes_before=2 * GiB,
        bytes_after=GiB,
        expected_bytes=64 << 20,
        waited_s=2.0,
    ),
    HolderSilentEvent(at=T, model="gemma", pid=4242, silent_s=61.5, timeout_s=30.0, killed=True),
    PassedOverEvent(
        at=T,
        model="tiny",
        pid=4343,
        reason=PassOverReason.STOPPED,
        free_s=0.0,
        arena="/run/arena/gpu0",
    ),
    OverflowEvent(at=T),
    LeaseEvent(
        at=T,
        device="rpc:10.0.0.5:50052",
        lender="10.0.0.5:50053",
        state="revoked",
        by="arbiterd run: game (pid 7)",
    ),
]


def test_every_kind_has_a_sample() -> None:
    assert sorted(event.kind for event in SAMPLES) == sorted(KINDS)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.kind)
def test_each_kind_round_trips(event: Event) -> None:
    obj = event.to_json()
    assert (obj["event"], obj["at"]) == (event.kind, T)
    assert parse_event(obj) == event
    assert type(parse_event(obj)) is type(event)


def test_the_json_names_are_the_daemons() -> None:
    handoff = SAMPLES[2].to_json()
    assert handoff == {
        "event": "handoff",
        "at": T,
        "from": "gemma",
        "to": "tiny",
        "holder_pid": 4242,
        "waited_from": T - 1.5,
        "wait_s": 0.5,
        "release_s": 0.4,
        "restore_s": 0.9,
        "restored_bytes": GiB,
        "release_reason": "wanted",
        "devices": ["gpu0"],
        "turn_served": 7,
    }
    assert SAMPLES[1].to_json()["id"] == "cmpl-1"
    assert SAMPLES[0].to_json()["to"] == "warm"


def test_a_handoff_from_an_older_daemon_reads_with_the_new_fields_unknown() -> None:
    old = {
        "event": "handoff",
        "at": T,
        "from": "gemma",
        "to": "tiny",
        "release_s": 0.4,
        "wait_s": 0.1,
        "restore_s": 0.9,
    }
    event = parse_event(old)
    assert event == HandoffEvent(
        at=T, from_model="gemma", to_model="tiny", release_s=0.4, wait_s=0.1, restore_s=0.9
    )
    assert isinstance(event, HandoffEvent)
    assert (event.holder_pid, event.waited_from, event.restored_bytes) == (None, None, None)
    # Its wait began after the release: the handoff took all three.
    assert event.total_s == pytest.approx(1.4)


def test_a_measured_handoff_counts_the_release_within_the_wait() -> None:
    event = SAMPLES[2]
    assert isinstance(event, HandoffEvent)
    assert event.total_s == pytest.approx(0.5 + 0.9)


# Every key any kind reads, each with a value of a type that field cannot take.
GARBLED: dict[str, Any] = {
    "at": "yesterday",
    "model": 7,
    "from": 7,
    "to": ["warm"],
    "reason": 7,
    "id": 7,
    "status": 7,
    "error": {"why": "?"},
    "cancelled": "yes",
    "held": 1,
    "holder_name": 7,
    "source": 7,
    "device": 7,
    "added": "a",
    "removed": {"b": 1},
    "changed": 7,
    "warnings": "careful",
    "devices": 7,
    "models": ["gemma"],
    "others": "Xorg",
    "errors": 7,
    "killed": "yes",
    **{
        key: value
        for value, keys in (
            ("lots", ("duration_s", "wait_s", "release_s", "restore_s", "restart_in_s")),
            (True, ("weights_bytes", "kv_bytes", "disk_read_bytes", "file_bytes", "copied_bytes")),
            (True, ("prompt_tokens", "code")),
            ([1], ("prompt_tokens_evaluated", "completion_tokens", "pid", "holder_pid")),
            (None, ("waited_from", "restored_bytes", "bytes_before", "expected_bytes")),
            ({}, ("bytes_after", "waited_s", "silent_s", "timeout_s")),
        )
        for key in keys
    },
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_garbled_or_empty_object_reads_as_the_empty_record(kind: str) -> None:
    empty = KINDS[kind]()
    assert parse_event({"event": kind, **GARBLED}) == empty
    assert parse_event({"event": kind}) == empty
    assert empty.kind == kind


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True])
def test_a_number_that_is_not_a_figure_is_unknown(value: float) -> None:
    assert parse_event({"event": "worker", "pid": value, "restart_in_s": value}) == WorkerEvent()


def test_extra_fields_are_ignored() -> None:
    event = parse_event({"event": "hold", "at": T, "held": True, "by": "the user", "seq": 3})
    assert event == HoldEvent(at=T, held=True)


def test_parts_of_a_list_that_are_not_objects_are_left_out() -> None:
    event = parse_event(
        {"event": "vram", "devices": [5, {"device": "gpu0", "used_bytes": "x"}], "others": [[]]}
    )
    assert event == VramEvent(devices=(DeviceMemory("gpu0", None, None, None),))


def test_an_unknown_kind_keeps_its_fields_and_round_trips() -> None:
    obj = {"event": "thermal", "at": T, "device": "gpu0", "celsius": 91}
    event = parse_event(obj)
    assert event == OtherEvent(at=T, name="thermal", fields={"device": "gpu0", "celsius": 91})
    assert event.kind == "thermal"
    assert event.to_json() == obj
    assert parse_event(event.to_json()) == event


@pytest.mark.parametrize("obj", [None, 7, "handoff", ["handoff"], {}, {"event": ["handoff"]}])
def test_anything_that_is_not_an_event_object_reads_as_a_kindless_other(obj: object) -> None:
    event = parse_event(obj)
    assert isinstance(event, OtherEvent)
    assert event.kind == ""


def test_records_are_frozen() -> None:
    event = SAMPLES[6]
    with pytest.raises(AttributeError):
        event.at = 0.0  # type: ignore[misc]


def test_a_state_or_status_this_version_does_not_know_reads_as_unknown() -> None:
    residency = parse_event({"event": "residency", "from": "warm", "to": "frozen"})
    request = parse_event({"event": "request", "status": "deferred"})
    assert residency == ResidencyEvent(
        from_state=ResidencyState.WARM, to_state=ResidencyState.UNKNOWN
    )
    assert request == RequestEvent(status=RequestStatus.UNKNOWN)
    assert residency.to_json()["to"] == "unknown"
