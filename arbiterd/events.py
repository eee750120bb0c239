"""The daemon's events as typed records: one frozen dataclass per kind, read tolerantly.

Owns the shape of every event the daemon publishes on the control socket and keeps in its
journal (docs/control-protocol.md, "Events"), and the one way to read one: `parse_event(obj)`.
Reading never raises: a field that is missing or of the wrong type reads as None (or empty), a
state or status this version does not know as its Enum's UNKNOWN, extra fields are ignored, so
a journal an older daemon wrote and a line a newer one sends both read; a kind this module does
not know reads as an `OtherEvent` that keeps its fields.
`to_json()` gives the object as the daemon sends it, and `parse_event(e.to_json()) == e`.

Shared by every process (worker, daemon, CLI, tray): imports nothing of arbiterd's but the
states it carries (arbiterd/states.py) and the field codec (arbiterd/fields.py) that reads and
writes every record but `OtherEvent`, and never Qt.

    residency       a model's residency state changed (the worker's state machine)
    request         a request ended
    handoff         the GPU went from one model to another, measured by the model that got it
    wait            a model waited for the GPU behind a program that is not one of our models
    worker          a worker exited, or could not start
    reload          the config was read again
    hold            the user took or gave back the GPU (game mode)
    unload          a model was unloaded: its worker exited, its prompt cache kept on disk
    host_ram_budget the host copies and cold KV caches went over [daemon] host_ram_budget:
                    which cold models are unloaded for it, with the numbers
    prompt_cache_evict  state files removed to keep the prompt caches within their budget
    encoder         a vision model's projector was loaded, encoded images or was freed
    vram            live VRAM figures (~1 Hz to subscribers; never journaled)
    vram_not_freed  a release did not give the VRAM back
    holder_silent   a warm worker showed no sign of life for [daemon] holder_timeout_s: reported,
                    then killed after as long again
    passed_over     a model took the GPU before a waiter ahead of it in the queue that could not
                    take it: stopped, or leaving the free token untaken (issue 40 item 1)
    overflow        the control socket dropped a subscriber that fell behind
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from arbiterd.fields import Record, finite, text
from arbiterd.states import (
    PassOverReason,
    ReleaseReason,
    RequestStatus,
    ResidencyState,
    UnloadReason,
)

# -- the records -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Event(Record):
    """What every event has: its kind and `at`, seconds since the epoch (None: it did not say)."""

    KIND: ClassVar[str] = ""

    at: float | None = None

    @property
    def kind(self) -> str:
        return self.KIND

    def to_json(self) -> dict[str, Any]:
        return {"event": self.kind, **super().to_json()}


@dataclass(frozen=True, kw_only=True)
class ResidencyEvent(Event):
    """A model's residency changed: `duration_s` is how long the state it left lasted; the bytes
    are what the change moved (weights and KV) and what it read from disk. Of the weights,
    `file_bytes` are those a release freed without a copy and a restore read back from the model
    file's host copy; `copied_bytes` is what a release copied out of the buffers it freed (0 once
    every weight comes back from the file, a kept copy or a mapping). A load or warm-up that
    ends warm also says how its worker got the token: it asked at `waited_from`, waited `wait_s`,
    and `holder_pid` / `holder_name` held the token then (None: it was free). `resident_bytes`
    is what the worker holds on its devices once the change is made (weights, KV and compute
    buffers; the KV a release left on the device), by the engine's own figures. A release
    (cooling → cold) says in `turn_served` how many requests the turn it ends served (issue 43)."""

    KIND: ClassVar[str] = "residency"

    model: str | None = None
    from_state: ResidencyState | None = field(default=None, metadata={"json": "from"})
    to_state: ResidencyState | None = field(default=None, metadata={"json": "to"})
    duration_s: float | None = None
    weights_bytes: int | None = None
    kv_bytes: int | None = None
    disk_read_bytes: int | None = None
    file_bytes: int | None = None
    copied_bytes: int | None = None
    # A release's ReleaseReason (warm → cooling, cooling → cold); else what went wrong, if
    # anything (a load that failed, a restore rolled back): free text.
    reason: str = ""
    waited_from: float | None = None
    wait_s: float | None = None
    holder_pid: int | None = None
    holder_name: str | None = None
    resident_bytes: int | None = None
    turn_served: int | None = None

    @property
    def moved_bytes(self) -> int:
        """Weights and KV together; 0 when the event did not say."""
        return (self.weights_bytes or 0) + (self.kv_bytes or 0)

    @property
    def release_reason(self) -> ReleaseReason | None:
        """Why the model gave the GPU up, when this is a release that says so; else None."""
        releasing = self.from_state in (ResidencyState.WARM, ResidencyState.COOLING)
        return ReleaseReason(self.reason) if releasing and self.reason else None


@dataclass(frozen=True, kw_only=True)
class RequestEvent(Event):
    """A request ended; `status` is ok, error or cancelled (None from an older daemon, which
    said only `cancelled`), and `error` says what went wrong."""

    KIND: ClassVar[str] = "request"

    model: str | None = None
    request_id: str | None = field(default=None, metadata={"json": "id"})
    duration_s: float | None = None
    prompt_tokens: int | None = None
    prompt_tokens_evaluated: int | None = None
    completion_tokens: int | None = None
    cancelled: bool = False
    status: RequestStatus | None = None
    error: str = ""

    @property
    def outcome(self) -> RequestStatus | None:
        return self.status or (RequestStatus.CANCELLED if self.cancelled else None)


@dataclass(frozen=True, kw_only=True)
class HandoffEvent(Event):
    """The GPU went from `from_model` to `to_model`, as the model that got it measured: it began
    waiting at `waited_from`, waited `wait_s` for the token (held by `holder_pid`; the release
    of `from_model`, `release_s` when known, happened within that wait), then restored for
    `restore_s`, moving `restored_bytes` onto `devices` (to_model's device ids; empty from a
    daemon that did not say).

    An older daemon inferred handoffs and said only from, to, release_s, wait_s and restore_s,
    its wait_s counted from the end of the release: those read with the new fields None."""

    KIND: ClassVar[str] = "handoff"

    from_model: str | None = field(default=None, metadata={"json": "from"})
    to_model: str | None = field(default=None, metadata={"json": "to"})
    holder_pid: int | None = None
    waited_from: float | None = None
    wait_s: float | None = None
    release_s: float | None = None
    restore_s: float | None = None
    restored_bytes: int | None = None
    # Why `from_model` let go, when it did during the wait: WANTED, or PREEMPTED (paused
    # mid-generation for a waiter of a higher class).
    release_reason: ReleaseReason | None = None
    devices: tuple[str, ...] = ()
    # How many requests `from_model`'s turn served before that release (issue 43), when known.
    turn_served: int | None = None

    @property
    def total_s(self) -> float:
        """From the first moment of the handoff to `to_model` being warm."""
        parts = [self.wait_s, self.restore_s]
        if self.waited_from is None:  # an older daemon's: the release came before the wait
            parts.append(self.release_s)
        return sum(part for part in parts if part is not None)


@dataclass(frozen=True, kw_only=True)
class WaitEvent(Event):
    """`model` waited `wait_s` from `waited_from` for the GPU, held by a program that is not one
    of the daemon's models: a game, `arbiterd run CMD`, another daemon's model. Not a handoff.
    `devices`: the model's device ids (empty from a daemon that did not say)."""

    KIND: ClassVar[str] = "wait"

    model: str | None = None
    holder_pid: int | None = None
    holder_name: str = ""
    waited_from: float | None = None
    wait_s: float | None = None
    devices: tuple[str, ...] = ()

    @property
    def total_s(self) -> float:
        return self.wait_s or 0.0


@dataclass(frozen=True, kw_only=True)
class WorkerEvent(Event):
    """A model's worker exited with `code` (negative: killed by that signal), or could not start
    (`code` and maybe `pid` None); it is started again in `restart_in_s`. `last_words`: the last
    lines it wrote to its stderr (a GGML_ASSERT, a C library's abort message, a traceback)."""

    KIND: ClassVar[str] = "worker"

    model: str | None = None
    pid: int | None = None
    code: int | None = None
    reason: str = ""
    restart_in_s: float | None = None
    last_words: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ReloadEvent(Event):
    """The config was read again: the models added, removed and changed (restarted), those
    whose aliases changed (applied without a restart), and its warnings."""

    KIND: ClassVar[str] = "reload"

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    aliases_changed: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class HoldEvent(Event):
    """The user took the GPU (`held`, game mode: every model goes cold) or gave it back."""

    KIND: ClassVar[str] = "hold"

    held: bool = False


@dataclass(frozen=True, kw_only=True)
class StepAsideEvent(Event):
    """The daemon stepped aside for a program that does not take part (`aside`, issue 45: every
    model released and the daemon holds the GPU on its behalf), or came back (`aside` false:
    `why` it ended: the program exited, its memory stayed low, the user resumed)."""

    KIND: ClassVar[str] = "step_aside"

    aside: bool = False
    program: str | None = None
    pid: int | None = None
    reason: str | None = None  # what caught it
    used_bytes: int | None = None  # device memory it held, where a reader measures it
    why: str | None = None


@dataclass(frozen=True)
class LeaseEvent(Event):
    """A lent RPC device's lease changed (issue 46): granted, revoked (`by`: who wants the
    GPU on the lender), returned, unreachable or refused (`reason`), ..."""

    KIND: ClassVar[str] = "lease"

    device: str | None = None
    lender: str | None = None
    state: str | None = None
    by: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class UnloadEvent(Event):
    """A model was unloaded (`reason`: why, an UnloadReason): its worker saved `tokens` tokens
    of prompt cache, `kv_bytes` in all, to `kv_file` and exited; `error` says why nothing was
    saved when a save failed (it unloaded regardless)."""

    KIND: ClassVar[str] = "unload"

    model: str | None = None
    pid: int | None = None
    reason: UnloadReason | None = None
    kv_file: str | None = None
    kv_bytes: int | None = None
    tokens: int | None = None
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class EncoderEvent(Event):
    """A vision model's projector (mmproj) did one thing for request `request_id` (issue 12):
    `action` "load", "encode" or "free", taking `duration_s`; `bytes` are the projector's
    weights for load and free, the embeddings made for encode; `images` how many it encoded.
    On the "swap" `path` (the projector did not fit the device budget beside the weights),
    "release" and "restore" are the model's weights leaving before the load and coming back
    after the free, their KV kept on the device (their `bytes` are those weights); else the
    path is "beside". `peak_bytes`: the most the model held on the device (the projector's
    bytes included) from the session's start up to this step, so the last step has the
    session's peak; `reason`: why it swapped, or why it could not. The worker's projector keeps
    each step as this record before the worker loop adds the time, model and request id."""

    KIND: ClassVar[str] = "encoder"

    model: str | None = None
    request_id: str | None = field(default=None, metadata={"json": "id"})
    action: str = ""
    duration_s: float | None = None
    bytes_: int | None = field(default=None, metadata={"json": "bytes"})
    images: int | None = None
    path: str = ""  # "beside" or "swap"; "" from a daemon before it
    peak_bytes: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class RamBudgetEvent(Event):
    """Host RAM (`used_bytes`: the model files' host copies, each once, and the KV caches cold
    models keep on the host) went over `budget_bytes` ([daemon] host_ram_budget): the cold
    models in `unload`, least recently used first, are unloaded for it (each then has an
    `unload` event with the reason "host_ram_budget"), which leaves `after_bytes`."""

    KIND: ClassVar[str] = "host_ram_budget"

    used_bytes: int | None = None
    budget_bytes: int | None = None
    unload: tuple[str, ...] = ()
    after_bytes: int | None = None


@dataclass(frozen=True)
class PromptCacheEvictEvent(Event):
    """To keep `model`'s prompt cache on disk within `budget_bytes` ([daemon]
    prompt_cache_budget), the state files of the models in `evicted` (oldest first),
    `evicted_bytes` in all, were removed; `used_bytes` is what the folder holds after."""

    KIND: ClassVar[str] = "prompt_cache_evict"

    model: str | None = None
    evicted: tuple[str, ...] = ()
    evicted_bytes: int | None = None
    used_bytes: int | None = None
    budget_bytes: int | None = None


@dataclass(frozen=True)
class DeviceMemory(Record):
    """One device's memory: what a VRAM reader returns (arbiterd/daemon/telemetry) and a `vram`
    event carries. A reader fills every field; None is what could not be read off the wire."""

    device: str | None  # "gpu0": the arena name (telemetry/records.py, arena_device_name)
    name: str | None  # for humans: "NVIDIA GeForce RTX 4090", "amdgpu 0000:03:00.0"
    total_bytes: int | None
    used_bytes: int | None

    @property
    def free_bytes(self) -> int | None:
        if self.total_bytes is None or self.used_bytes is None:
            return None
        return max(0, self.total_bytes - self.used_bytes)


@dataclass(frozen=True)
class ProcessMemory(Record):
    """What one process holds on one device: a reader's row (a model's worker or any other GPU
    program), and in a `vram` event one of the programs that are not the daemon's models (a
    game, a browser, the desktop). A reader always knows `pid` and `device`."""

    pid: int | None
    device: str | None
    used_bytes: int | None  # None: the driver lists the process but does not say how much
    name: str | None  # None: gone, or not ours to read


@dataclass(frozen=True, kw_only=True)
class VramEvent(Event):
    """Live VRAM figures, the status's `telemetry` object: each device, each model's bytes
    (None: cannot be told), every other GPU program, and what could not be read."""

    KIND: ClassVar[str] = "vram"

    source: str | None = None
    devices: tuple[DeviceMemory, ...] = ()
    models: tuple[tuple[str, int | None], ...] = ()
    others: tuple[ProcessMemory, ...] = ()
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class VramNotFreedEvent(Event):
    """`model`'s worker released the GPU but still held `bytes_after` on `device` after
    `waited_s`, where its cold footprint is `expected_bytes`."""

    KIND: ClassVar[str] = "vram_not_freed"

    model: str | None = None
    pid: int | None = None
    device: str | None = None
    bytes_before: int | None = None
    bytes_after: int | None = None
    expected_bytes: int | None = None
    waited_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class HolderSilentEvent(Event):
    """`model`'s worker `pid`, which holds the GPU, showed no sign of life for `silent_s`
    (issue 24: stopped, or stuck in a hung driver; issue 40: also in a handoff, stuck on an RPC
    server that stopped answering); `timeout_s` is [daemon] holder_timeout_s, `state` its
    residency then ("warm", "loading", "warming", "cooling"). Said once when it passes
    `timeout_s` (`killed` false), and again when it passes twice that and the daemon kills it
    (`killed` true) so the token moves on."""

    KIND: ClassVar[str] = "holder_silent"

    model: str | None = None
    pid: int | None = None
    silent_s: float | None = None
    timeout_s: float | None = None
    killed: bool = False
    state: str | None = None


@dataclass(frozen=True, kw_only=True)
class PassedOverEvent(Event):
    """`model` took the GPU before `pid`, a waiter ahead of it in the queue of `arena` that could
    not take the free token: its process was stopped (`reason` STOPPED: Ctrl-Z, SIGSTOP) or
    it left the token free for `free_s` (NOT_TAKING: it hangs, or keeps its ticket while it
    does something else). That waiter keeps its place: it is first again once it can take
    (docs/arena-protocol.md, "The queue")."""

    KIND: ClassVar[str] = "passed_over"

    model: str | None = None
    pid: int | None = None
    reason: PassOverReason | None = None
    free_s: float | None = None
    arena: str = ""


@dataclass(frozen=True, kw_only=True)
class OverflowEvent(Event):
    """Sent by the control socket, not the daemon's core: this subscriber fell behind, missed
    events and is being dropped."""

    KIND: ClassVar[str] = "overflow"


@dataclass(frozen=True, kw_only=True)
class OtherEvent(Event):
    """An event of a kind this module does not know (a newer daemon's), kept as it came:
    `name` is its kind ("" when it had none), `fields` everything but "event" and "at"."""

    name: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.name

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Self:
        return cls(
            at=finite(obj.get("at")),
            name=text(obj.get("event")),
            fields={k: v for k, v in obj.items() if k not in {"event", "at"}},
        )

    def to_json(self) -> dict[str, Any]:
        return {"event": self.kind, "at": self.at, **self.fields}


KINDS: dict[str, type[Event]] = {
    kind.KIND: kind
    for kind in (
        ResidencyEvent,
        RequestEvent,
        HandoffEvent,
        WaitEvent,
        WorkerEvent,
        ReloadEvent,
        HoldEvent,
        StepAsideEvent,
        LeaseEvent,
        UnloadEvent,
        RamBudgetEvent,
        PromptCacheEvictEvent,
        EncoderEvent,
        VramEvent,
        VramNotFreedEvent,
        HolderSilentEvent,
        PassedOverEvent,
        OverflowEvent,
    )
}


def parse_event(obj: object) -> Event:
    """The record for one event object; never raises (anything that is not an object, or has
    no kind this module knows, is an `OtherEvent`)."""
    if not isinstance(obj, Mapping):
        return OtherEvent()
    name = obj.get("event")
    kind = KINDS.get(name, OtherEvent) if isinstance(name, str) else OtherEvent
    return kind.from_json(obj)
