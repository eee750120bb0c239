"""The daemon's events as typed records: one frozen dataclass per kind, read tolerantly.

Owns the shape of every event the daemon publishes on the control socket and keeps in its
journal (docs/control-protocol.md, "Events"), and the one way to read one: `parse_event(obj)`.
Reading never raises: a field that is missing or of the wrong type reads as None (or empty),
extra fields are ignored, so a journal an older daemon wrote and a line a newer one sends both
read; a kind this module does not know reads as an `OtherEvent` that keeps its fields.
`to_json()` gives the object as the daemon sends it, and `parse_event(e.to_json()) == e`.

Shared by every process (worker, daemon, CLI, tray): imports nothing of arbiterd's, and never Qt.

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
    overflow        the control socket dropped a subscriber that fell behind
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: object) -> int | None:
    number = _float(value)
    return None if number is None else int(number)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(item for item in value if isinstance(item, str))


def _mappings(value: object) -> list[Mapping[str, Any]]:
    if not isinstance(value, list | tuple):
        return []
    return [item for item in value if isinstance(item, Mapping)]


@dataclass(frozen=True, kw_only=True)
class Event:
    """What every event has: its kind and `at`, seconds since the epoch (None: it did not say)."""

    KIND: ClassVar[str] = ""

    at: float | None = None

    @property
    def kind(self) -> str:
        return self.KIND

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Self:
        """The record of `obj`; never raises (see the module's docstring)."""
        return cls(at=_float(obj.get("at")))

    def to_json(self) -> dict[str, Any]:
        return {"event": self.kind, "at": self.at, **self._fields()}

    def _fields(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True, kw_only=True)
class ResidencyEvent(Event):
    """A model's residency changed: `duration_s` is how long the state it left lasted; the bytes
    are what the change moved (weights and KV) and what it read from disk. A load or warm-up that
    ends warm also says how its worker got the token: it asked at `waited_from`, waited `wait_s`,
    and `holder_pid` / `holder_name` held the token then (None: it was free)."""

    KIND: ClassVar[str] = "residency"

    model: str | None = None
    from_state: str | None = None
    to_state: str | None = None
    duration_s: float | None = None
    weights_bytes: int | None = None
    kv_bytes: int | None = None
    disk_read_bytes: int | None = None
    reason: str = ""
    waited_from: float | None = None
    wait_s: float | None = None
    holder_pid: int | None = None
    holder_name: str | None = None

    @property
    def moved_bytes(self) -> int:
        """Weights and KV together; 0 when the event did not say."""
        return (self.weights_bytes or 0) + (self.kv_bytes or 0)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ResidencyEvent:
        return cls(
            at=_float(obj.get("at")),
            model=_str(obj.get("model")),
            from_state=_str(obj.get("from")),
            to_state=_str(obj.get("to")),
            duration_s=_float(obj.get("duration_s")),
            weights_bytes=_int(obj.get("weights_bytes")),
            kv_bytes=_int(obj.get("kv_bytes")),
            disk_read_bytes=_int(obj.get("disk_read_bytes")),
            reason=_text(obj.get("reason")),
            waited_from=_float(obj.get("waited_from")),
            wait_s=_float(obj.get("wait_s")),
            holder_pid=_int(obj.get("holder_pid")),
            holder_name=_str(obj.get("holder_name")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "from": self.from_state,
            "to": self.to_state,
            "duration_s": self.duration_s,
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "disk_read_bytes": self.disk_read_bytes,
            "reason": self.reason,
            "waited_from": self.waited_from,
            "wait_s": self.wait_s,
            "holder_pid": self.holder_pid,
            "holder_name": self.holder_name,
        }


@dataclass(frozen=True, kw_only=True)
class RequestEvent(Event):
    """A request ended; `status` is "ok", "error" or "cancelled" (None from an older daemon,
    which said only `cancelled`), and `error` says what went wrong."""

    KIND: ClassVar[str] = "request"

    model: str | None = None
    request_id: str | None = None
    duration_s: float | None = None
    prompt_tokens: int | None = None
    prompt_tokens_evaluated: int | None = None
    completion_tokens: int | None = None
    cancelled: bool = False
    status: str | None = None
    error: str = ""

    @property
    def outcome(self) -> str | None:
        return self.status or ("cancelled" if self.cancelled else None)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RequestEvent:
        return cls(
            at=_float(obj.get("at")),
            model=_str(obj.get("model")),
            request_id=_str(obj.get("id")),
            duration_s=_float(obj.get("duration_s")),
            prompt_tokens=_int(obj.get("prompt_tokens")),
            prompt_tokens_evaluated=_int(obj.get("prompt_tokens_evaluated")),
            completion_tokens=_int(obj.get("completion_tokens")),
            cancelled=obj.get("cancelled") is True,
            status=_str(obj.get("status")),
            error=_text(obj.get("error")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "id": self.request_id,
            "duration_s": self.duration_s,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_evaluated": self.prompt_tokens_evaluated,
            "completion_tokens": self.completion_tokens,
            "cancelled": self.cancelled,
            "status": self.status,
            "error": self.error,
        }


@dataclass(frozen=True, kw_only=True)
class HandoffEvent(Event):
    """The GPU went from `from_model` to `to_model`, as the model that got it measured: it began
    waiting at `waited_from`, waited `wait_s` for the token (held by `holder_pid`; the release
    of `from_model`, `release_s` when known, happened within that wait), then restored for
    `restore_s`, moving `restored_bytes` onto the device.

    An older daemon inferred handoffs and said only from, to, release_s, wait_s and restore_s,
    its wait_s counted from the end of the release: those read with the new fields None."""

    KIND: ClassVar[str] = "handoff"

    from_model: str | None = None
    to_model: str | None = None
    holder_pid: int | None = None
    waited_from: float | None = None
    wait_s: float | None = None
    release_s: float | None = None
    restore_s: float | None = None
    restored_bytes: int | None = None
    # Why `from_model` let go, when it did during the wait: "wanted", or "preempted" (paused
    # mid-generation for a waiter of a higher class).
    release_reason: str | None = None

    @property
    def total_s(self) -> float:
        """From the first moment of the handoff to `to_model` being warm."""
        parts = [self.wait_s, self.restore_s]
        if self.waited_from is None:  # an older daemon's: the release came before the wait
            parts.append(self.release_s)
        return sum(part for part in parts if part is not None)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> HandoffEvent:
        return cls(
            at=_float(obj.get("at")),
            from_model=_str(obj.get("from")),
            to_model=_str(obj.get("to")),
            holder_pid=_int(obj.get("holder_pid")),
            waited_from=_float(obj.get("waited_from")),
            wait_s=_float(obj.get("wait_s")),
            release_s=_float(obj.get("release_s")),
            restore_s=_float(obj.get("restore_s")),
            restored_bytes=_int(obj.get("restored_bytes")),
            release_reason=_str(obj.get("release_reason")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "from": self.from_model,
            "to": self.to_model,
            "holder_pid": self.holder_pid,
            "waited_from": self.waited_from,
            "wait_s": self.wait_s,
            "release_s": self.release_s,
            "restore_s": self.restore_s,
            "restored_bytes": self.restored_bytes,
            "release_reason": self.release_reason,
        }


@dataclass(frozen=True, kw_only=True)
class WaitEvent(Event):
    """`model` waited `wait_s` from `waited_from` for the GPU, held by a program that is not one
    of the daemon's models: a game, `arbiterd run CMD`, another daemon's model. Not a handoff."""

    KIND: ClassVar[str] = "wait"

    model: str | None = None
    holder_pid: int | None = None
    holder_name: str = ""
    waited_from: float | None = None
    wait_s: float | None = None

    @property
    def total_s(self) -> float:
        return self.wait_s or 0.0

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> WaitEvent:
        return cls(
            at=_float(obj.get("at")),
            model=_str(obj.get("model")),
            holder_pid=_int(obj.get("holder_pid")),
            holder_name=_text(obj.get("holder_name")),
            waited_from=_float(obj.get("waited_from")),
            wait_s=_float(obj.get("wait_s")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "holder_pid": self.holder_pid,
            "holder_name": self.holder_name,
            "waited_from": self.waited_from,
            "wait_s": self.wait_s,
        }


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

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> WorkerEvent:
        return cls(
            at=_float(obj.get("at")),
            model=_str(obj.get("model")),
            pid=_int(obj.get("pid")),
            code=_int(obj.get("code")),
            reason=_text(obj.get("reason")),
            restart_in_s=_float(obj.get("restart_in_s")),
            last_words=_names(obj.get("last_words")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "pid": self.pid,
            "code": self.code,
            "reason": self.reason,
            "restart_in_s": self.restart_in_s,
            "last_words": list(self.last_words),
        }


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

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ReloadEvent:
        return cls(
            at=_float(obj.get("at")),
            added=_names(obj.get("added")),
            removed=_names(obj.get("removed")),
            changed=_names(obj.get("changed")),
            aliases_changed=_names(obj.get("aliases_changed")),
            warnings=_names(obj.get("warnings")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "added": list(self.added),
            "removed": list(self.removed),
            "changed": list(self.changed),
            "aliases_changed": list(self.aliases_changed),
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True, kw_only=True)
class HoldEvent(Event):
    """The user took the GPU (`held`, game mode: every model goes cold) or gave it back."""

    KIND: ClassVar[str] = "hold"

    held: bool = False

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> HoldEvent:
        return cls(at=_float(obj.get("at")), held=obj.get("held") is True)

    def _fields(self) -> dict[str, Any]:
        return {"held": self.held}


@dataclass(frozen=True)
class UnloadEvent(Event):
    """A model was unloaded (`reason`: "command", "idle" after unload_after_s, or
    "host_ram_budget"): its worker
    saved `tokens` tokens of prompt cache, `kv_bytes` in all, to `kv_file` and exited; `error`
    says why nothing was saved when a save failed (it unloaded regardless)."""

    KIND: ClassVar[str] = "unload"

    model: str | None = None
    pid: int | None = None
    reason: str = ""
    kv_file: str | None = None
    kv_bytes: int | None = None
    tokens: int | None = None
    error: str = ""

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> UnloadEvent:
        return cls(
            at=_float(obj.get("at")),
            model=_str(obj.get("model")),
            pid=_int(obj.get("pid")),
            reason=_text(obj.get("reason")),
            kv_file=_str(obj.get("kv_file")),
            kv_bytes=_int(obj.get("kv_bytes")),
            tokens=_int(obj.get("tokens")),
            error=_text(obj.get("error")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "pid": self.pid,
            "reason": self.reason,
            "kv_file": self.kv_file,
            "kv_bytes": self.kv_bytes,
            "tokens": self.tokens,
            "error": self.error,
        }


@dataclass(frozen=True, kw_only=True)
class EncoderEvent(Event):
    """A vision model's projector (mmproj) did one thing for request `request_id` (issue 12):
    `action` "load", "encode" or "free", taking `duration_s`; `bytes` are the projector's
    weights for load and free, the embeddings made for encode; `images` how many it encoded.
    On the "swap" `path` (the projector did not fit the device budget beside the weights),
    "release" and "restore" are the model's weights leaving before the load and coming back
    after the free, their KV kept on the device; else the path is "beside". `peak_bytes`: the
    most the model held on the device (the projector's bytes included) from the session's
    start up to this step; `reason`: why it swapped, or why it could not."""

    KIND: ClassVar[str] = "encoder"

    model: str | None = None
    request_id: str | None = None
    action: str = ""
    duration_s: float | None = None
    bytes_: int | None = None
    images: int | None = None
    path: str = ""  # "beside" or "swap"; "" from a daemon before it
    peak_bytes: int | None = None
    reason: str = ""

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> EncoderEvent:
        return cls(
            at=_float(obj.get("at")),
            model=_str(obj.get("model")),
            request_id=_str(obj.get("id")),
            action=_text(obj.get("action")),
            duration_s=_float(obj.get("duration_s")),
            bytes_=_int(obj.get("bytes")),
            images=_int(obj.get("images")),
            path=_text(obj.get("path")),
            peak_bytes=_int(obj.get("peak_bytes")),
            reason=_text(obj.get("reason")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "id": self.request_id,
            "action": self.action,
            "duration_s": self.duration_s,
            "bytes": self.bytes_,
            "images": self.images,
            "path": self.path,
            "peak_bytes": self.peak_bytes,
            "reason": self.reason,
        }


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

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RamBudgetEvent:
        return cls(
            at=_float(obj.get("at")),
            used_bytes=_int(obj.get("used_bytes")),
            budget_bytes=_int(obj.get("budget_bytes")),
            unload=_names(obj.get("unload")),
            after_bytes=_int(obj.get("after_bytes")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
            "unload": list(self.unload),
            "after_bytes": self.after_bytes,
        }


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

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PromptCacheEvictEvent:
        return cls(
            at=_float(obj.get("at")),
            model=_str(obj.get("model")),
            evicted=_names(obj.get("evicted")),
            evicted_bytes=_int(obj.get("evicted_bytes")),
            used_bytes=_int(obj.get("used_bytes")),
            budget_bytes=_int(obj.get("budget_bytes")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "evicted": list(self.evicted),
            "evicted_bytes": self.evicted_bytes,
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
        }


@dataclass(frozen=True)
class VramDevice:
    device: str | None
    name: str | None
    total_bytes: int | None
    used_bytes: int | None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> VramDevice:
        return cls(
            device=_str(obj.get("device")),
            name=_str(obj.get("name")),
            total_bytes=_int(obj.get("total_bytes")),
            used_bytes=_int(obj.get("used_bytes")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
        }


@dataclass(frozen=True)
class VramProcess:
    """A GPU program that is not one of the daemon's models (a game, a browser, the desktop)."""

    pid: int | None
    device: str | None
    used_bytes: int | None  # None: the driver lists it but does not say how much
    name: str | None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> VramProcess:
        return cls(
            pid=_int(obj.get("pid")),
            device=_str(obj.get("device")),
            used_bytes=_int(obj.get("used_bytes")),
            name=_str(obj.get("name")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "device": self.device,
            "used_bytes": self.used_bytes,
            "name": self.name,
        }


@dataclass(frozen=True, kw_only=True)
class VramEvent(Event):
    """Live VRAM figures, the status's `telemetry` object: each device, each model's bytes
    (None: cannot be told), every other GPU program, and what could not be read."""

    KIND: ClassVar[str] = "vram"

    source: str | None = None
    devices: tuple[VramDevice, ...] = ()
    models: tuple[tuple[str, int | None], ...] = ()
    others: tuple[VramProcess, ...] = ()
    errors: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> VramEvent:
        models = obj.get("models")
        return cls(
            at=_float(obj.get("at")),
            source=_str(obj.get("source")),
            devices=tuple(VramDevice.from_json(d) for d in _mappings(obj.get("devices"))),
            models=tuple(
                (name, _int(value))
                for name, value in (models.items() if isinstance(models, Mapping) else ())
                if isinstance(name, str)
            ),
            others=tuple(VramProcess.from_json(p) for p in _mappings(obj.get("others"))),
            errors=_names(obj.get("errors")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "devices": [device.to_json() for device in self.devices],
            "models": dict(self.models),
            "others": [process.to_json() for process in self.others],
            "errors": list(self.errors),
        }


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

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> VramNotFreedEvent:
        return cls(
            at=_float(obj.get("at")),
            model=_str(obj.get("model")),
            pid=_int(obj.get("pid")),
            device=_str(obj.get("device")),
            bytes_before=_int(obj.get("bytes_before")),
            bytes_after=_int(obj.get("bytes_after")),
            expected_bytes=_int(obj.get("expected_bytes")),
            waited_s=_float(obj.get("waited_s")),
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "pid": self.pid,
            "device": self.device,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "expected_bytes": self.expected_bytes,
            "waited_s": self.waited_s,
        }


@dataclass(frozen=True, kw_only=True)
class HolderSilentEvent(Event):
    """`model`'s warm worker `pid`, which holds the GPU, showed no sign of life for `silent_s`
    (issue 24: stopped, or stuck in a hung driver); `timeout_s` is [daemon] holder_timeout_s.
    Said once when it passes `timeout_s` (`killed` false), and again when it passes twice that
    and the daemon kills it (`killed` true) so the token moves on."""

    KIND: ClassVar[str] = "holder_silent"

    model: str | None = None
    pid: int | None = None
    silent_s: float | None = None
    timeout_s: float | None = None
    killed: bool = False

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> HolderSilentEvent:
        return cls(
            at=_float(obj.get("at")),
            model=_str(obj.get("model")),
            pid=_int(obj.get("pid")),
            silent_s=_float(obj.get("silent_s")),
            timeout_s=_float(obj.get("timeout_s")),
            killed=obj.get("killed") is True,
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "pid": self.pid,
            "silent_s": self.silent_s,
            "timeout_s": self.timeout_s,
            "killed": self.killed,
        }


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
    def from_json(cls, obj: Mapping[str, Any]) -> OtherEvent:
        return cls(
            at=_float(obj.get("at")),
            name=_text(obj.get("event")),
            fields={k: v for k, v in obj.items() if k not in {"event", "at"}},
        )

    def _fields(self) -> dict[str, Any]:
        return dict(self.fields)


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
        UnloadEvent,
        RamBudgetEvent,
        PromptCacheEvictEvent,
        EncoderEvent,
        VramEvent,
        VramNotFreedEvent,
        HolderSilentEvent,
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
