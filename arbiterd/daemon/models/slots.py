"""A model slot: one configured model in the daemon, and its lifecycle (states.SlotState and
states.SLOT_TRANSITIONS, drawn in arbiterd/states.py's docstring).

Owns what the daemon knows of one model between its workers: the lifecycle state, the worker
that serves it now, what that worker's hello said, the residency it last reported, whether it
is an embedding model, its restarts and its last error, the unload or load (issue 14) in
progress, and the retire of the slot it replaces (issue 40). Pure bookkeeping, on the daemon's
event loop. The slot is the one writer of its fields: the parts that act on it (lifecycle.py
starts, restarts and unloads workers, supervisor.py applies what workers report, routing.py
sends requests) change it only through the methods below, and read the fields. `move` refuses
a transition the table does not list; every move wakes whoever awaits a change (`ready`,
`settled`, `worker_changed`) instead of polling.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbiterd.config import STARTER_N_CTX, Load, ModelConfig
from arbiterd.daemon.models.modelfile import ModelTraits, serves_embeddings
from arbiterd.daemon.models.workerclient import WorkerHello
from arbiterd.daemon.models.workerport import WorkerPort
from arbiterd.errors import InvalidTransitionError
from arbiterd.events import HandoffEvent
from arbiterd.hostcopy import Lease
from arbiterd.states import SLOT_TRANSITIONS, ResidencyState, SlotState


@dataclass
class Slot:
    config: ModelConfig  # the current one: a reload that changes only its aliases swaps it
    state: SlotState = SlotState.STARTING
    worker: WorkerPort | None = None  # set exactly while READY
    residency: ResidencyState | None = None  # the worker's residency state, as it last said
    hello: WorkerHello | None = None  # its last worker's: what runs it; kept across restarts
    # Serves embeddings only (RequestKind.EMBEDDING requests), and its context. The flag is read
    # as the slot is made from its config (modelfile.serves_embeddings: the HTTP edge checks a
    # request's kind against it), and both are decided again as its worker is spawned, from what
    # the worker loads (modelfile.model_traits). Until then, the context is its config's, else
    # STARTER_N_CTX (the trained context is not read yet).
    embedding: bool = False
    n_ctx: int = 0
    pinned: bool = False
    restarts: int = 0
    failures_in_row: int = 0
    started_at: float = 0.0  # time.monotonic() of its worker's hello
    last_error: str = ""
    # The model file its last start did not find, while that is the reason it does not serve
    # (routing.py answers requests at once meanwhile).
    missing_file: Path | None = None
    last_handoff: HandoffEvent | None = None  # the last time it took the GPU from a model
    copy_lease: Lease | None = None  # on the daemon's memfd of its model file; kept across restarts
    restart_task: asyncio.Task[None] | None = None
    # Set while unloading: what its worker said (lifecycle.Lifecycle.unload); awaited by
    # whoever starts the slot again, since the next worker reads the file the last one writes.
    unload_task: asyncio.Task[dict[str, Any]] | None = None
    load_task: asyncio.Task[None] | None = None  # set while an unloaded slot is started again
    # The retire of the slot this one replaces (a reload changed its model's settings): its
    # worker starts once that one's has stopped, one worker of a model at a time. Requests
    # wait for it meanwhile (routing.py), never told the model is gone (issue 40).
    replaces: asyncio.Task[None] | None = None
    # time.monotonic() when its worker last went cold (unload_after_s counts from it); None
    # while it is not cold.
    cold_since: float | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set exactly while READY
    # Set, and replaced by a fresh one, at every move: `worker_changed` awaits it.
    _moved: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def __post_init__(self) -> None:
        self.n_ctx = self.config.n_ctx or STARTER_N_CTX

    @property
    def name(self) -> str:
        return self.config.name

    # -- the lifecycle ----------------------------------------------------------------------

    def move(self, new: SlotState, *, worker: WorkerPort | None = None, reason: str = "") -> None:
        """Go to `new` (with its worker when READY, with the reason when FAILED or RESTARTING);
        raises InvalidTransitionError for a move the table does not list."""
        if new not in SLOT_TRANSITIONS[self.state]:
            raise InvalidTransitionError(f"{self.name}: {self.state.value} → {new.value}")
        if (new is SlotState.READY) != (worker is not None):
            raise InvalidTransitionError(f"{self.name}: a worker belongs to ready, and only to it")
        self.state, self.worker = new, worker
        if new is not SlotState.READY:
            self.residency = None
            self.cold_since = None
        if reason:
            self.last_error = reason
        if new is SlotState.READY:
            self.ready.set()
        else:
            self.ready.clear()
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    def serve(self, worker: WorkerPort, *, now: float) -> None:
        """`worker` said hello (at `now`, time.monotonic()): ready, and loading (or waiting to)."""
        self.move(SlotState.READY, worker=worker)
        self.started_at = now
        self.residency = ResidencyState.LOADING

    async def settled(self) -> None:
        """Return once the slot is ready, or stopped (a reload retired it, or the daemon
        stops)."""
        while self.state not in (SlotState.READY, SlotState.STOPPED):
            await self._moved.wait()

    async def worker_changed(self, worker: WorkerPort) -> None:
        """Return once `worker` is no longer this slot's (the lifecycle's watch of its exit
        detaches it)."""
        while self.worker is worker:
            await self._moved.wait()

    @property
    def shown_state(self) -> ResidencyState | SlotState:
        """What status shows: the worker's residency while ready, else the slot's state."""
        if self.state is SlotState.READY and self.residency is not None:
            return self.residency
        return self.state

    # -- what its worker says ---------------------------------------------------------------

    def said_hello(self, hello: WorkerHello) -> None:
        """Keep what runs the model (kept across restarts)."""
        self.hello = hello

    def report_residency(
        self, state: ResidencyState | None, *, now: float, reason: str = ""
    ) -> None:
        """Its worker's residency changed to `state` at `now` (time.monotonic()); a failed one
        keeps `reason` as the last error."""
        self.residency = state
        self.cold_since = now if state is ResidencyState.COLD else None
        if state is ResidencyState.FAILED:
            self.last_error = reason

    def took_gpu(self, handoff: HandoffEvent) -> None:
        """It took the GPU from another model: the handoff event, as published."""
        self.last_handoff = handoff

    # -- what the daemon decides ------------------------------------------------------------

    def reconfigure(self, config: ModelConfig) -> None:
        """A reload changed nothing its worker depends on (perhaps its aliases)."""
        self.config = config

    def pin(self, pinned: bool) -> None:
        self.pinned = pinned

    def decided(self, traits: ModelTraits) -> None:
        self.embedding, self.n_ctx = traits.embedding, traits.n_ctx

    def file_missing(self) -> None:
        """A start did not find its model file: that, not a retry, is what is awaited."""
        self.missing_file = self.config.path

    def file_found(self) -> None:
        """A start found its model file (or holds a copy of it): the note is stale now."""
        if self.missing_file is not None:
            self.missing_file = None
            self.last_error = ""

    def hold_copy(self, lease: Lease) -> None:
        self.copy_lease = lease

    def drop_copy(self) -> Lease | None:
        """Forget its lease on the host copy; returns it, for the caller to release."""
        lease, self.copy_lease = self.copy_lease, None
        return lease

    # -- restarts and the tasks that change it ----------------------------------------------

    def worker_exited(self, *, stable: bool) -> None:
        """Its worker exited: after a stable uptime the backoff starts over."""
        self.failures_in_row = 0 if stable else self.failures_in_row + 1

    def start_failed(self) -> None:
        self.failures_in_row += 1

    def restarted(self) -> None:
        self.restarts += 1

    def restarting(self, task: asyncio.Task[None]) -> None:
        self.restart_task = task

    def unloading(self, task: asyncio.Task[dict[str, Any]] | None) -> None:
        """The unload in progress (None: it ended)."""
        self.unload_task = task

    def loading(self, task: asyncio.Task[None] | None) -> None:
        """The load in progress (None: it ended)."""
        self.load_task = task

    def replacing(self, retire: asyncio.Task[None]) -> None:
        """It replaces a slot whose worker `retire` stops."""
        self.replaces = retire


def new_slot(model: ModelConfig) -> Slot:
    """A slot for `model`: starting, or unloaded for a model loaded on demand; whether it serves
    embeddings is read now, as its config is loaded."""
    return Slot(
        model,
        state=SlotState.UNLOADED if model.load is Load.DEMAND else SlotState.STARTING,
        embedding=serves_embeddings(model),
    )
