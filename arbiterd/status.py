"""The daemon's status as typed records: what `status` answers on the control socket.

Owns the shape of the status object (docs/control-protocol.md, "Status", describes these
records field by field). The supervisor builds a `DaemonStatus`; the control socket writes it
once, with `to_json`; every reader (the CLI, the tray, the HTTP API's /v1/models and the Ollama
routes) reads the same record, in-process or with `DaemonStatus.from_json`. Reading never
raises, as for events (arbiterd/fields.py's codec, which these records use): a missing or
odd field reads as None or empty, a state this version does not know as UNKNOWN, so a newer or
older daemon never crashes a client.

Shared by every process: imports nothing of arbiterd's but the events and states it carries,
and never Qt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from arbiterd.events import DeviceMemory, HandoffEvent, ProcessMemory
from arbiterd.fields import Record
from arbiterd.footprint import ModelFootprint
from arbiterd.states import (
    TROUBLE,
    WITHOUT_WORKER,
    BackendKind,
    CpuCause,
    Priority,
    ResidencyState,
    SlotState,
)

# The name the daemon's own hold (game mode) takes the arena token under (supervisor.py).
HOLD_HOLDER_NAME = "arbiterd hold"
# The daemon holds the arena token for a program it stepped aside for (issue 45) under the name
# "PROGRAM (pid PID; arbiterd stepped aside)": what a waiter is told holds the GPU, as is.
STEP_ASIDE_SUFFIX = "; arbiterd stepped aside)"
# A group's keeper holds the arena token as "group NAME" (arena/groups.py, _Files.holder_name).
GROUP_HOLDER_PREFIX = "group "
# The telemetry source of the engines' own figures, where no GPU reader works
# (daemon/observe/telemetry/readers.py's AccountingReader).
ACCOUNTING_SOURCE = "accounting"
CPU_DEVICE_LABEL = "CPU (host RAM)"  # what those figures are of where the models run on the CPU


@dataclass(frozen=True)
class Turn(Record):
    """A model's turn (issue 43), as its worker sizes it: how long it keeps the GPU for its
    queued requests while another waits (`quantum_s`), the handoff cost that comes from
    (`handoff_s`, a moving average of its releases and restores; the prior until
    `handoff_measured`), and how many requests its current turn (or, cold, its last) served."""

    quantum_s: float | None = None
    handoff_s: float | None = None
    handoff_measured: bool = False
    served: int = 0


@dataclass(frozen=True)
class ModelStatus(Record):
    """One configured model. `state` is its worker's residency while it runs, else the slot's
    state. The byte counts: `resident_bytes` on the device by the engine's own accounting,
    `vram_bytes` as measured (None: cannot be told), `cold_footprint_bytes` what its worker
    holds while cold, `host_ram_bytes` its share of its file's host copy plus the KV cache
    (`host_kv_bytes`) and the weights' own copies (`host_weights_bytes`) its worker keeps on the
    host; `host_copy_bytes` the size of that copy and `host_copy_shared_with` the other models
    on it (both only while it has one). `stale_s`: its worker did not answer (issue 24), and
    its figures are what it said this long ago; `silent_s`: its warm worker has shown no sign of
    life this long, holder_timeout_s or more. `capabilities`: what it can be asked for
    (arbiterd.spec.Capability: chat, completion, tools, vision, embedding), as its worker
    tells from its GGUF and config; empty until a worker has opened the model. `devices`: the
    device ids it is placed on, in its config's order (issue 27; empty from a daemon from
    before devices had names, which placed every model on gpu0). `architecture`,
    `trained_context` and `chat_template`: what its GGUF says (the template the config's
    chat_template replaces it with), as its worker read them; "" and 0 until then.
    `sequences` and `tokens_per_s`: the requests its worker decodes together now (up to
    `parallel`) and the tokens they generate a second (issue 42). `footprint`: what it takes
    of each device, predicted from its GGUF and measured by the engine once warm (issue 44,
    arbiterd/footprint.py); None while it has no worker, or from a worker from before."""

    name: str = ""
    aliases: tuple[str, ...] = ()
    path: str = ""  # its GGUF, as the config names it (issue 47)
    capabilities: tuple[str, ...] = ()
    architecture: str = ""
    trained_context: int = 0
    chat_template: str = ""
    n_ctx: int = 0
    parallel: int = 1  # the sequences it decodes in one batch, at most (issue 42)
    devices: tuple[str, ...] = ()
    host_copy: str = ""  # "memfd" | "page-cache"
    state: ResidencyState | SlotState = SlotState.UNKNOWN
    pid: int | None = None
    pinned: bool = False
    queue: int = 0
    sequences: int = 0  # generating now, in one batch
    tokens_per_s: float = 0.0  # generated over the last second of its batch; 0 while idle
    resident_bytes: int = 0
    prompt_tokens_evaluated: int = 0
    served: int = 0
    restarts: int = 0
    last_error: str = ""
    last_handoff: HandoffEvent | None = None
    vram_bytes: int | None = None
    cold_footprint_bytes: int | None = None
    host_ram_bytes: int | None = None
    host_kv_bytes: int = 0
    host_weights_bytes: int = 0
    host_copy_bytes: int | None = None
    host_copy_shared_with: tuple[str, ...] = ()
    backend: BackendKind | None = None  # None: no worker said hello yet
    fallback_reason: str = ""  # why not in-place ("" for in-place)
    stale_s: float | None = None
    silent_s: float | None = None
    turn: Turn | None = None  # None: no worker, or one from before turns
    footprint: ModelFootprint | None = None

    def to_json(self) -> dict[str, Any]:
        obj = super().to_json()
        if self.host_copy_bytes is None:  # no host copy: nothing to say of one
            del obj["host_copy_bytes"], obj["host_copy_shared_with"]
        return obj

    @property
    def device_bytes(self) -> int:
        """What it holds on the device: measured when telemetry can tell, else the engine's
        own account."""
        return max(0, self.resident_bytes if self.vram_bytes is None else self.vram_bytes)

    @property
    def unloaded(self) -> bool:
        """No worker (unloading or unloaded): nothing on the device, nothing in host RAM."""
        return self.state in WITHOUT_WORKER

    @property
    def troubled(self) -> bool:
        """Failed, or restarting after a crash: the tray turns amber while it lasts."""
        return self.state in TROUBLE or self.state is ResidencyState.FAILED


@dataclass(frozen=True)
class Holder(Record):
    """Who holds the arena token: a model's worker, a group's keeper ("group NAME"), the
    daemon's hold (HOLD_HOLDER_NAME) or any other program; `since` when it took it."""

    pid: int | None = None
    name: str | None = None
    since: float | None = None


@dataclass(frozen=True)
class SteppedAside(Record):
    """The program the daemon stepped aside for (issue 45): it holds the GPU on its behalf."""

    program: str | None = None
    pid: int | None = None
    reason: str | None = None
    since: float | None = None
    used_bytes: int | None = None  # as last measured; None where no reader measures it


@dataclass(frozen=True)
class Lease(Record):
    """A lent RPC device's lease (issue 46, arbiterd/lease/borrower.py): its state ("granted",
    "revoked", ... LeaseState), who holds or wants the GPU on the lender (`by`), why the lease
    is not had (`reason`), and the bytes the lender's front passed each way so far."""

    device: str = ""
    lender: str = ""  # HOST:PORT of the lease channel
    state: str = ""
    since: float | None = None
    by: str | None = None
    reason: str | None = None
    lender_name: str | None = None
    received_bytes: int | None = None
    sent_bytes: int | None = None


@dataclass(frozen=True)
class Waiter(Record):
    """A process waiting for the arena token."""

    pid: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class GroupStatus(Record):
    """Models that hold the GPU together behind one keeper: a `[groups.NAME]` table (issue 14)
    or a device's fitting set (issue 44: `fitting`, name "fitting"). `holds_token` while its
    keeper holds the arena's token, `handoffs` how often it let the token go to an outside
    waiter, `failure` why its keeper stopped ("" while it runs). A fitting set's `warm`: the
    members warm now, and `used_bytes`, their footprints as they say them; `withdrawals`, how
    often a member was made to leave to make room for another or for a budget that shrank;
    `budget_bytes`, what its members may hold at once now (0: each is warm alone), made of the
    device's `size_bytes` (None: not known) as `size_source` tells it, less `reserve_bytes`,
    less what other programs hold now, `others_bytes` (daemon/models/budgets.py device_budget)."""

    name: str = ""
    models: tuple[str, ...] = ()
    priority: Priority | None = None  # None: not said, or a class this version does not know
    holds_token: bool = False
    handoffs: int = 0
    failure: str = ""
    device: str = ""  # "" from a daemon before issue 44
    fitting: bool = False
    budget_bytes: int = 0
    warm: tuple[str, ...] = ()
    used_bytes: int = 0
    withdrawals: int = 0
    size_bytes: int | None = None
    size_source: str = ""
    reserve_bytes: int = 0
    others_bytes: int = 0


@dataclass(frozen=True)
class HostRam(Record):
    """The daemon's host RAM: each model file's host copy once, the KV caches and the weights
    cold workers keep on the host, and `[daemon] host_ram_budget` (0: none)."""

    host_copies_bytes: int = 0
    host_kv_bytes: int = 0
    host_weights_bytes: int = 0
    budget_bytes: int = 0


@dataclass(frozen=True)
class PromptCache(Record):
    """The prompt caches unloaded models keep on disk, and `[daemon] prompt_cache_budget`."""

    bytes_: int = field(default=0, metadata={"json": "bytes"})
    files: int = 0
    budget_bytes: int = 0


@dataclass(frozen=True)
class Engine(Record):
    """What the workers' engine (llama.cpp) can do, as the latest worker's hello said, and
    while a model that asks for GPU layers runs on the CPU, why (`cpu_cause`, None while none
    does) and what would help on this machine, in one line (`cpu_note`, arbiterd/offload.py)."""

    offload: bool = False  # False: everything runs on the CPU
    devices: tuple[str, ...] = ()
    cpu_cause: CpuCause | None = None
    cpu_note: str = ""

    @property
    def cpu_warning(self) -> str:
        """The note when something would help (a GPU the engine does not use), else ""."""
        return self.cpu_note if self.cpu_cause is CpuCause.ENGINE else ""


@dataclass(frozen=True)
class Telemetry(Record):
    """The daemon's VRAM reading: `readers` (which, and which were not used) and the arena's
    `device` always; once a reading exists, when it was taken (`at`), by which `source`, each
    device, each model's bytes (None: cannot be told), every other GPU program, and what could
    not be read."""

    at: float | None = None
    source: str | None = None
    devices: tuple[DeviceMemory, ...] = ()
    models: tuple[tuple[str, int | None], ...] = ()
    others: tuple[ProcessMemory, ...] = ()
    errors: tuple[str, ...] = ()
    readers: str = ""
    device: str | None = None

    def to_json(self) -> dict[str, Any]:
        obj = super().to_json()
        if self.at is None:  # no reading yet: only what reads
            return {"readers": obj["readers"], "device": obj["device"]}
        return obj


@dataclass(frozen=True)
class DaemonStatus(Record):
    """The whole status: every model, the arena and who holds or waits for its token, the
    user's hold, the groups, the VRAM reading, host RAM (each host copy once, plus every
    model's host KV and weights' own copies, in `host_ram_bytes`; by part in `host_ram`), the
    prompt caches on disk (None: none are kept) and the engine (None until a worker said)."""

    models: tuple[ModelStatus, ...] = ()
    arena: str = ""
    holder: Holder | None = None
    waiters: tuple[Waiter, ...] = ()
    hold: bool = False
    stepped_aside: SteppedAside | None = None
    leases: tuple[Lease, ...] = ()  # the lent RPC devices' (issue 46)
    # What the lookout for programs that do not take part sees with (issue 45): "off", or the
    # nodes it watches and the memory readers it has.
    yield_watch: str | None = None
    groups: tuple[GroupStatus, ...] = ()
    telemetry: Telemetry | None = None
    host_ram_bytes: int | None = None
    host_ram: HostRam | None = None
    prompt_cache: PromptCache | None = None
    engine: Engine | None = None

    def model(self, name: str) -> ModelStatus | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def holder_model(self) -> str | None:
        """The model that holds the GPU, or None when it is free or held by anything else."""
        if self.holder is None or self.holder.name is None:
            return None
        return self.holder.name if self.model(self.holder.name) is not None else None

    @property
    def holder_group(self) -> GroupStatus | None:
        """The group whose keeper holds the GPU (its members may be warm together), or None."""
        if self.holder is None:
            return None
        holder = self.holder.name
        return next((g for g in self.groups if holder == GROUP_HOLDER_PREFIX + g.name), None)

    def group_of(self, model: str) -> GroupStatus | None:
        """The group `model` is a member of, or None."""
        return next((g for g in self.groups if model in g.models), None)

    @property
    def troubled(self) -> tuple[ModelStatus, ...]:
        return tuple(m for m in self.models if m.troubled)

    @property
    def memory_name(self) -> str:
        """What the models' resident bytes are to be called: "VRAM" only of a GPU's memory (an
        engine that offloads, or before any worker said, a device telemetry reads), "RAM" where
        the engine runs them on the CPU, "memory" while neither is known."""
        if self.engine is not None:
            return "VRAM" if self.engine.offload else "RAM"
        return "VRAM" if self.devices else "memory"

    @property
    def devices(self) -> tuple[DeviceMemory, ...]:
        return () if self.telemetry is None else self.telemetry.devices

    def device_label(self, device: DeviceMemory) -> str:
        """What a person calls `device`: its id ("gpu0"), or "CPU (host RAM)" where no GPU
        reader measures and the engine runs the models on the CPU, so the engines' own figures
        are of the host's RAM (issue 40: a machine without a GPU was shown as gpu0). The id
        stays the arena's: it keys the models' figures and the metrics' labels."""
        accounted = self.telemetry is not None and self.telemetry.source == ACCOUNTING_SOURCE
        on_cpu = self.engine is not None and not self.engine.offload
        return CPU_DEVICE_LABEL if accounted and on_cpu else device.device or "?"

    @property
    def others(self) -> tuple[ProcessMemory, ...]:
        return () if self.telemetry is None else self.telemetry.others

    @property
    def models_bytes(self) -> int:
        return sum(m.device_bytes for m in self.models)

    @property
    def others_bytes(self) -> int:
        """VRAM used by anything but the models: the listed processes, and on a device that
        reports its use, whatever else it counts (the desktop, the driver)."""
        listed = sum(max(0, o.used_bytes or 0) for o in self.others)
        if not self.devices:
            return listed
        return max(listed, self.used_bytes - self.models_bytes)

    @property
    def used_bytes(self) -> int:
        if self.devices:
            return sum(max(0, d.used_bytes or 0) for d in self.devices)
        return self.models_bytes + self.others_bytes

    @property
    def total_bytes(self) -> int | None:
        """The devices' memory, or None until telemetry reports it."""
        total = sum(max(0, d.total_bytes or 0) for d in self.devices)
        return total or None
