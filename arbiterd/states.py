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

Not every name here is read tolerantly: a `Priority` or a `RequestKind` is an input (a config
key, a header, a request field), where a value this version does not know is refused with the
names it does (`parse_priority`), never read as something else.
"""

from __future__ import annotations

import enum
from typing import Self

from arbiterd.errors import BadValueError


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


class ControlCommand(enum.StrEnum):
    """The commands of the control protocol, as the CLI and the tray send them to the daemon
    (arbiterd/control.py owns each one's arguments). An input, read strictly: the daemon refuses
    a command it does not know, naming those it does (control.CODE_UNKNOWN_COMMAND)."""

    HELLO = "hello"
    STATUS = "status"
    DEVICES = "devices"
    SUBSCRIBE = "subscribe"
    UNSUBSCRIBE = "unsubscribe"
    EVENTS = "events"
    WARM = "warm"
    RELEASE = "release"
    PIN = "pin"
    UNPIN = "unpin"
    UNLOAD = "unload"
    HOLD = "hold"
    UNHOLD = "unhold"
    YIELD = "yield"
    RESUME = "resume"
    RELOAD = "reload"
    SHUTDOWN = "shutdown"


# The control commands a model's worker carries out, and the op the daemon sends it for each
# (arbiterd/daemon/supervisor.py). `unload` is the daemon's own: its lifecycle asks the worker to
# save its prompt cache (WorkerOp.UNLOAD), then stops it (daemon/models/lifecycle.py).
WORKER_OP_OF: dict[ControlCommand, WorkerOp] = {
    ControlCommand.WARM: WorkerOp.WARM,
    ControlCommand.RELEASE: WorkerOp.RELEASE,
    ControlCommand.PIN: WorkerOp.PIN,
    ControlCommand.UNPIN: WorkerOp.UNPIN,
}


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


class ReleaseReason(_Tolerant):
    """Why a warm model gave the GPU up (worker/policy.py decides WANTED and IDLE; the worker
    preempts; the daemon commands): the `reason` of its warm → cooling residency event, and a
    handoff's `release_reason`."""

    WANTED = "wanted"  # another program waits for the token
    IDLE = "idle"  # idle longer than idle_release_s
    PREEMPTED = "preempted"  # paused mid-request for a waiter of a higher class
    COMMAND = "command"  # the `release` control command (or a hold, a step aside)
    UNKNOWN = "unknown"


# The releases made for a waiter: the token is handed over to it rather than given up.
FOR_A_WAITER = frozenset({ReleaseReason.WANTED, ReleaseReason.PREEMPTED})


class UnloadReason(_Tolerant):
    """Why the daemon unloaded a model (its worker saved its prompt cache and exited): the
    `reason` of an unload event."""

    COMMAND = "command"  # the `unload` control command
    IDLE = "idle"  # unused for unload_after_s
    HOST_RAM_BUDGET = "host_ram_budget"  # cold models over [daemon] host_ram_budget, oldest first
    UNKNOWN = "unknown"


class PassOverReason(_Tolerant):
    """Why a waiter ahead in the queue was passed over (issue 40 item 1): the `reason` of a
    passed_over event."""

    STOPPED = "stopped"  # its process is stopped (SIGSTOP, Ctrl-Z's SIGTSTP, a debugger)
    NOT_TAKING = "not_taking"  # it let the free token lie for the bound (token.PASS_OVER_S)
    UNKNOWN = "unknown"


class Priority(enum.StrEnum):
    """A waiter's class in an arena's queue: a higher one is admitted first; within a class,
    arrival order. The tickets' names spell it (docs/arena-protocol.md, "The queue")."""

    INTERACTIVE = "interactive"  # a person waiting on the answer
    NORMAL = "normal"
    BATCH = "batch"  # work nobody watches

    @property
    def rank(self) -> int:
        return list(Priority).index(self)  # 0 first


PRIORITY_CHOICES = ", ".join(p.value for p in Priority)


def parse_priority(text: str, where: str) -> Priority:
    """`text` as a Priority; BadValueError naming `where` and the allowed names."""
    try:
        return Priority(text)
    except ValueError:
        raise BadValueError(f"{where} must be one of {PRIORITY_CHOICES}, got {text!r}") from None


class RequestKind(enum.StrEnum):
    """What a request asks its model to make; an embedding model serves EMBEDDING only."""

    COMPLETION = "completion"  # text after a prompt
    CHAT = "chat"  # the next turn of a conversation, through the model's chat template
    EMBEDDING = "embedding"  # a vector for each input text
