"""The vocabulary every process shares: the states, operations and kinds that cross a process
boundary, as Enums, with the transition tables of the two state machines.

Owns the names. The worker (worker/residency.py moves a model through ResidencyState), the
daemon (daemon/models/slots.py moves a slot through SlotState), the CLI and the tray read the same
members; outside the (de)serialisation of a record no module compares one of these names as a
string. Reading is tolerant: a value this version does not know (a newer worker, a newer daemon)
reads as the Enum's UNKNOWN member, which no table lets anything move to or from, instead of
raising.

Residency of one model, in its worker:

    loading ──► warm ──► cooling ──► cold ──► warming ──► warm
       │          ▲                    ▲         │
       │          └──── (restore ok) ──┼─────────┘
       │                               └── (restore failed: rolled back)
       └──► failed          any state ──► stopped

A slot, one configured model in the daemon:

    starting ──► ready ──► restarting ──► starting
        │  └──────────────────▲    └──► unloaded   (an `unload` cancels the restart)
        └──► failed              (permanent: the reason is kept; `reload` starts it again)
    ready ──► unloading ──► unloaded ──► starting  (`unload` or unload_after_s;
                                                    a demand model begins unloaded)
    any ──► stopped
"""

from __future__ import annotations

import enum
from typing import Self


class _Tolerant(enum.StrEnum):
    """A StrEnum whose constructor reads an unknown value as UNKNOWN instead of raising."""

    @classmethod
    def _missing_(cls, value: object) -> Self:
        return cls("unknown")


class ResidencyState(_Tolerant):
    LOADING = "loading"  # holds the token, reading weights onto the device
    WARM = "warm"  # holds the token; weights and KV on the device
    COOLING = "cooling"  # releasing the device (saving KV to host)
    COLD = "cold"  # no token; weights and KV on the host only
    WARMING = "warming"  # holds the token again; restoring weights and KV
    FAILED = "failed"  # could not load; the reason is in the event
    STOPPED = "stopped"  # the worker exited
    UNKNOWN = "unknown"  # a state this version does not know (read from a newer worker)


RESIDENCY_TRANSITIONS: dict[ResidencyState, frozenset[ResidencyState]] = {
    ResidencyState.LOADING: frozenset(
        {ResidencyState.WARM, ResidencyState.FAILED, ResidencyState.STOPPED}
    ),
    ResidencyState.WARM: frozenset({ResidencyState.COOLING, ResidencyState.STOPPED}),
    ResidencyState.COOLING: frozenset({ResidencyState.COLD, ResidencyState.STOPPED}),
    ResidencyState.COLD: frozenset({ResidencyState.WARMING, ResidencyState.STOPPED}),
    # warming → cold: the restore failed and was rolled back (the token is given up too).
    ResidencyState.WARMING: frozenset(
        {ResidencyState.WARM, ResidencyState.COLD, ResidencyState.STOPPED}
    ),
    ResidencyState.FAILED: frozenset({ResidencyState.STOPPED}),
    ResidencyState.STOPPED: frozenset(),
    ResidencyState.UNKNOWN: frozenset(),
}

# The residency states in which a model holds the arena token (its weights may be on the device).
HOLDS_TOKEN = frozenset(
    {ResidencyState.LOADING, ResidencyState.WARM, ResidencyState.COOLING, ResidencyState.WARMING}
)


class SlotState(_Tolerant):
    STARTING = "starting"  # its worker is being spawned
    READY = "ready"  # a worker said hello and serves; the slot's residency says how
    RESTARTING = "restarting"  # no worker; one is spawned again after a backoff
    FAILED = "failed"  # cannot start until the config changes: its last error says why
    STOPPED = "stopped"  # the daemon stopped it (shutdown, or removed by a reload)
    # Its worker saves the prompt cache to disk and exits; a request waits for it to finish,
    # then starts a new worker (which reads that file).
    UNLOADING = "unloading"
    UNLOADED = "unloaded"  # no worker, no host copy: started by its next request or `warm`
    UNKNOWN = "unknown"  # a state this version does not know (read from a newer daemon)


SLOT_TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.STARTING: frozenset(
        {SlotState.READY, SlotState.RESTARTING, SlotState.FAILED, SlotState.STOPPED}
    ),
    SlotState.READY: frozenset({SlotState.RESTARTING, SlotState.UNLOADING, SlotState.STOPPED}),
    SlotState.RESTARTING: frozenset({SlotState.STARTING, SlotState.UNLOADED, SlotState.STOPPED}),
    SlotState.FAILED: frozenset({SlotState.STOPPED}),
    SlotState.STOPPED: frozenset(),
    SlotState.UNLOADING: frozenset({SlotState.UNLOADED, SlotState.STOPPED}),
    SlotState.UNLOADED: frozenset({SlotState.STARTING, SlotState.STOPPED}),
    SlotState.UNKNOWN: frozenset(),
}

# Slot states in which a model is in trouble: the tray turns amber while one lasts.
TROUBLE = frozenset({SlotState.FAILED, SlotState.RESTARTING})
# Slot states of a model without a worker: no VRAM, no host copy; its prompt cache may be on
# disk. Not ResidencyState.COLD, which keeps a worker and its host copy.
WITHOUT_WORKER = frozenset({SlotState.UNLOADING, SlotState.UNLOADED})


class CpuCause(_Tolerant):
    """Why models that ask for GPU layers run on the CPU (arbiterd/offload.py decides it)."""

    NO_GPU = "no-gpu"  # the machine has no GPU device node: the CPU is all there is
    ENGINE = "engine"  # the machine has a GPU that the engine does not offload to
    UNKNOWN = "unknown"


class WorkerOp(_Tolerant):
    """The operations the daemon sends a worker (the worker protocol, worker/loop.py)."""

    GENERATE = "generate"
    STATUS = "status"
    CANCEL = "cancel"
    RELEASE = "release"
    WARM = "warm"
    PIN = "pin"
    UNPIN = "unpin"
    UNLOAD = "unload"
    SHUTDOWN = "shutdown"
    UNKNOWN = "unknown"


class RequestStatus(_Tolerant):
    """How a request ended (the `status` of a request event)."""

    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"


class BackendKind(_Tolerant):
    """The residency mechanism a worker uses, as status, /metrics and the tray name it."""

    IN_PLACE = "in-place"  # the patched engine releases and restores buffers in place
    RELOAD = "reload"  # the model is freed and loaded again from the host copy
    UNKNOWN = "unknown"
