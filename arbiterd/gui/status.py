"""The daemon's `status` object, read into frozen records the tray can rely on.

Owns the tolerant reading of the status shape (arbiterd/daemon/service.py's docstring): a key
that is missing or of the wrong type gets a neutral default instead of an exception, so a newer
or older daemon never crashes the tray. Knows the optional keys that telemetry adds later
(`devices`, `others`), the host RAM figures (`host_ram_bytes`, per model and in all), what
runs the models (each one's `backend` and `warning`, the top-level `engine`), and issue 14's
`host_ram` and `prompt_cache` budgets and `groups`, and works without them.
Never imports Qt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from arbiterd.events import HandoffEvent

# States in which a model is in trouble: the tray turns amber while one lasts.
TROUBLE_STATES = frozenset({"failed", "restarting"})
# States of a model without a worker (issue 14): no VRAM, no host copy; its prompt cache may be
# on disk. Not "cold", which keeps a worker and its host copy.
UNLOADING, UNLOADED = "unloading", "unloaded"
UNLOADED_STATES = frozenset({UNLOADING, UNLOADED})
# The name the daemon's own hold (game mode) takes the arena token under (supervisor._take_hold).
HOLD_HOLDER_NAME = "arbiterd hold"
# A group's keeper holds the arena token as "group NAME" (arena/groups.py, _Files.holder_name).
GROUP_HOLDER_PREFIX = "group "


def _int(value: object, default: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return int(value)


def _optional_int(value: object) -> int | None:
    """A byte count the daemon may not report (an older daemon): None when absent or odd."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return int(value)


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _str(value: object, default: str = "") -> str:
    return value if isinstance(value, str) else default


def _dicts(value: object) -> list[Mapping[str, Any]]:
    if not isinstance(value, list):
        return []
    return [item for item in value if isinstance(item, Mapping)]


@dataclass(frozen=True)
class ModelStatus:
    name: str
    state: str
    pinned: bool
    queue: int
    resident_bytes: int  # on the device, by the engine's own accounting
    host_ram_bytes: int | None  # its host copy of the weights (its share) and KV kept on the host
    last_error: str
    restarts: int
    last_handoff: HandoffEvent | None
    backend: str = ""  # "in-place" | "reload"; "" when the daemon does not say (yet)
    fallback_reason: str = ""  # why not in-place
    warning: str = ""  # e.g. it asks for GPU layers an engine that cannot offload will not give
    # Issue 24: its worker did not answer, and the figures are what it said this long ago.
    stale_s: float | None = None
    # Warm, and no sign of life from its worker this long (holder_timeout_s or more).
    silent_s: float | None = None

    @classmethod
    def read(cls, raw: Mapping[str, Any]) -> ModelStatus:
        handoff = raw.get("last_handoff")
        return cls(
            name=_str(raw.get("name"), "?"),
            state=_str(raw.get("state"), "unknown"),
            pinned=raw.get("pinned") is True,
            queue=_int(raw.get("queue")),
            # Measured VRAM when the daemon's telemetry can tell, else the engine's account.
            resident_bytes=max(0, _int(raw.get("vram_bytes"), _int(raw.get("resident_bytes")))),
            host_ram_bytes=_optional_int(raw.get("host_ram_bytes")),
            last_error=_str(raw.get("last_error")),
            restarts=_int(raw.get("restarts")),
            last_handoff=HandoffEvent.from_json(handoff) if isinstance(handoff, Mapping) else None,
            backend=_str(raw.get("backend")),
            fallback_reason=_str(raw.get("fallback_reason")),
            warning=_str(raw.get("warning")),
            stale_s=_float(raw.get("stale_s")),
            silent_s=_float(raw.get("silent_s")),
        )

    @property
    def unloaded(self) -> bool:
        """No worker (unloading or unloaded): nothing on the device, nothing in host RAM."""
        return self.state in UNLOADED_STATES


@dataclass(frozen=True)
class Holder:
    pid: int
    name: str
    since: float | None


@dataclass(frozen=True)
class Device:
    device: str
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class OtherProcess:
    """A GPU program that is not one of the daemon's models (a game, a browser)."""

    name: str
    pid: int
    bytes_: int


@dataclass(frozen=True)
class Engine:
    """What the daemon's engine (llama.cpp, as its workers load it) can do."""

    offload: bool  # False: CPU only
    devices: tuple[str, ...]

    @classmethod
    def read(cls, raw: object) -> Engine | None:
        if not isinstance(raw, Mapping):
            return None
        devices = raw.get("devices")
        names = devices if isinstance(devices, list) else []
        return cls(raw.get("offload") is True, tuple(d for d in names if isinstance(d, str)))


@dataclass(frozen=True)
class Group:
    """Models that hold the GPU together behind one keeper (issue 14, `[groups.NAME]`)."""

    name: str
    models: tuple[str, ...]
    holds_token: bool  # its keeper holds the arena's token: its members may be warm together
    failure: str  # "" while its keeper runs; else why it stopped

    @classmethod
    def read(cls, raw: Mapping[str, Any]) -> Group:
        models = raw.get("models")
        return cls(
            name=_str(raw.get("name"), "?"),
            models=tuple(m for m in models if isinstance(m, str))
            if isinstance(models, list)
            else (),
            holds_token=raw.get("holds_token") is True,
            failure=_str(raw.get("failure")),
        )


@dataclass(frozen=True)
class HostRam:
    """The daemon's host RAM (status `host_ram`): each model file's host copy once, the KV caches
    cold models keep on the host, the weights cold in-place workers keep on the host as laid out
    for the device, and `[daemon] host_ram_budget` (0: none)."""

    copies_bytes: int
    kv_bytes: int
    budget_bytes: int
    weights_bytes: int = 0  # 0 from a daemon before cold workers reported them

    @classmethod
    def read(cls, raw: object) -> HostRam | None:
        if not isinstance(raw, Mapping):
            return None
        return cls(
            copies_bytes=max(0, _int(raw.get("host_copies_bytes"))),
            kv_bytes=max(0, _int(raw.get("host_kv_bytes"))),
            budget_bytes=max(0, _int(raw.get("budget_bytes"))),
            weights_bytes=max(0, _int(raw.get("host_weights_bytes"))),
        )


@dataclass(frozen=True)
class PromptCache:
    """The prompt caches unloaded models keep on disk (status `prompt_cache`), and
    `[daemon] prompt_cache_budget`."""

    bytes_: int
    files: int
    budget_bytes: int

    @classmethod
    def read(cls, raw: object) -> PromptCache | None:
        if not isinstance(raw, Mapping):
            return None
        return cls(
            bytes_=max(0, _int(raw.get("bytes"))),
            files=max(0, _int(raw.get("files"))),
            budget_bytes=max(0, _int(raw.get("budget_bytes"))),
        )


@dataclass(frozen=True)
class Status:
    models: tuple[ModelStatus, ...]
    holder: Holder | None
    waiters: tuple[Holder, ...]
    hold: bool
    devices: tuple[Device, ...] = ()
    others: tuple[OtherProcess, ...] = ()
    host_ram_bytes: int | None = None  # the daemon's in all, each shared host copy once
    engine: Engine | None = None  # None until a worker said it (or an older daemon)
    host_ram: HostRam | None = None  # None from a daemon before issue 14's budgets
    prompt_cache: PromptCache | None = None
    groups: tuple[Group, ...] = ()

    @classmethod
    def read(cls, raw: Mapping[str, Any]) -> Status:
        telemetry = raw.get("telemetry")
        if not isinstance(telemetry, Mapping):
            telemetry = {}
        holder_raw = raw.get("holder")
        holder = None
        if isinstance(holder_raw, Mapping):
            holder = Holder(
                pid=_int(holder_raw.get("pid")),
                name=_str(holder_raw.get("name")),
                since=_float(holder_raw.get("since")),
            )
        return cls(
            models=tuple(ModelStatus.read(m) for m in _dicts(raw.get("models"))),
            holder=holder,
            waiters=tuple(
                Holder(pid=_int(w.get("pid")), name=_str(w.get("name")), since=None)
                for w in _dicts(raw.get("waiters"))
            ),
            hold=raw.get("hold") is True,
            devices=tuple(
                Device(
                    device=_str(d.get("device"), "gpu"),
                    used_bytes=max(0, _int(d.get("used_bytes"))),
                    total_bytes=max(0, _int(d.get("total_bytes"))),
                )
                for d in _dicts(telemetry.get("devices"))
            ),
            others=tuple(
                OtherProcess(
                    name=_str(o.get("name"), "?"),
                    pid=_int(o.get("pid")),
                    bytes_=max(0, _int(o.get("used_bytes"))),
                )
                for o in _dicts(telemetry.get("others"))
            ),
            host_ram_bytes=_optional_int(raw.get("host_ram_bytes")),
            engine=Engine.read(raw.get("engine")),
            host_ram=HostRam.read(raw.get("host_ram")),
            prompt_cache=PromptCache.read(raw.get("prompt_cache")),
            groups=tuple(Group.read(g) for g in _dicts(raw.get("groups"))),
        )

    def model(self, name: str) -> ModelStatus | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def holder_model(self) -> str | None:
        """The model that holds the GPU, or None when it is free or held by anything else."""
        if self.holder is None:
            return None
        return self.holder.name if self.model(self.holder.name) is not None else None

    @property
    def holder_group(self) -> Group | None:
        """The group whose keeper holds the GPU (its members may be warm together), or None."""
        if self.holder is None:
            return None
        return next(
            (g for g in self.groups if self.holder.name == GROUP_HOLDER_PREFIX + g.name), None
        )

    def group_of(self, model: str) -> Group | None:
        """The group `model` is a member of, or None."""
        return next((g for g in self.groups if model in g.models), None)

    @property
    def models_bytes(self) -> int:
        return sum(m.resident_bytes for m in self.models)

    @property
    def others_bytes(self) -> int:
        """VRAM used by anything but the models: the listed processes, and on a device that
        reports its use, whatever else it counts (the desktop, the driver)."""
        listed = sum(o.bytes_ for o in self.others)
        if not self.devices:
            return listed
        return max(listed, self.used_bytes - self.models_bytes)

    @property
    def used_bytes(self) -> int:
        if self.devices:
            return sum(d.used_bytes for d in self.devices)
        return self.models_bytes + self.others_bytes

    @property
    def total_bytes(self) -> int | None:
        """The devices' memory, or None until telemetry reports it."""
        total = sum(d.total_bytes for d in self.devices)
        return total or None

    @property
    def troubled(self) -> tuple[ModelStatus, ...]:
        return tuple(m for m in self.models if m.state in TROUBLE_STATES)
