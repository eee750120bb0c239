"""A model slot: one configured model in the daemon, and its lifecycle as an Enum and a table.

Owns what the daemon knows of one model between its workers: the lifecycle state, the worker
that serves it now, what that worker's hello said, the residency it last reported, whether it
is an embedding model, its restarts and its last error, and the unload or load (issue 14) in
progress. Pure bookkeeping, mutated only on the daemon's event loop; the parts that act on it
(lifecycle.py starts, restarts and unloads workers, routing.py sends requests) move it through
`move`, which refuses a transition the table does not list.

    starting ──► ready ──► restarting ──► starting
        │  └──────────────────▲    └──► unloaded   (an `unload` cancels the restart)
        └──► failed              (permanent: the reason is kept; `reload` starts it again)
    ready ──► unloading ──► unloaded ──► starting  (issue 14: `unload` or unload_after_s;
                                                    a demand model begins unloaded)
    any ──► stopped
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbiterd.config import ModelConfig
from arbiterd.daemon.workerclient import WorkerClient, WorkerHello
from arbiterd.errors import InvalidTransitionError
from arbiterd.hostcopy import Lease


class SlotState(enum.StrEnum):
    STARTING = "starting"  # its worker is being spawned
    READY = "ready"  # a worker said hello and serves; `residency` says how
    RESTARTING = "restarting"  # no worker; one is spawned again after a backoff
    FAILED = "failed"  # cannot start until the config changes: `last_error` says why
    STOPPED = "stopped"  # the daemon stopped it (shutdown, or removed by a reload)
    # Its worker saves the prompt cache to disk and exits; a request waits for it to finish,
    # then starts a new worker (which reads that file).
    UNLOADING = "unloading"
    UNLOADED = "unloaded"  # no worker, no host copy: started by its next request or `warm`


TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.STARTING: frozenset(
        {SlotState.READY, SlotState.RESTARTING, SlotState.FAILED, SlotState.STOPPED}
    ),
    SlotState.READY: frozenset({SlotState.RESTARTING, SlotState.UNLOADING, SlotState.STOPPED}),
    SlotState.RESTARTING: frozenset({SlotState.STARTING, SlotState.UNLOADED, SlotState.STOPPED}),
    SlotState.FAILED: frozenset({SlotState.STOPPED}),
    SlotState.STOPPED: frozenset(),
    SlotState.UNLOADING: frozenset({SlotState.UNLOADED, SlotState.STOPPED}),
    SlotState.UNLOADED: frozenset({SlotState.STARTING, SlotState.STOPPED}),
}


@dataclass
class Slot:
    config: ModelConfig  # the current one: a reload that changes only its aliases swaps it
    state: SlotState = SlotState.STARTING
    worker: WorkerClient | None = None  # set exactly while READY
    residency: str | None = None  # the worker's residency state (states.ResidencyState's values)
    hello: WorkerHello | None = None  # its last worker's: what runs it; kept across restarts
    warning: str = ""  # e.g. GPU layers asked of an engine that cannot offload; "" when none
    # Serves embeddings only (spec.EMBEDDING requests); decided as its worker is spawned
    # (modelfile.serves_embeddings), so right whenever `ready` is set.
    embedding: bool = False
    pinned: bool = False
    restarts: int = 0
    failures_in_row: int = 0
    started_at: float = 0.0  # time.monotonic() of its worker's hello
    last_error: str = ""
    # The model file its last start did not find, while that is the reason it does not serve
    # (lifecycle.py sets and clears it; routing.py answers requests at once meanwhile).
    missing_file: Path | None = None
    last_handoff: dict[str, object] | None = None  # the last time it took the GPU from a model
    copy_lease: Lease | None = None  # on the daemon's memfd of its model file; kept across restarts
    restart_task: asyncio.Task[None] | None = None
    # Set while unloading: what its worker said (lifecycle.Lifecycle.unload); awaited by
    # whoever starts the slot again, since the next worker reads the file the last one writes.
    unload_task: asyncio.Task[dict[str, Any]] | None = None
    load_task: asyncio.Task[None] | None = None  # set while an unloaded slot is started again
    # time.monotonic() when its worker last went cold (unload_after_s counts from it); None
    # while it is not cold.
    cold_since: float | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set exactly while READY

    @property
    def name(self) -> str:
        return self.config.name

    def move(self, new: SlotState, *, worker: WorkerClient | None = None, reason: str = "") -> None:
        """Go to `new` (with its worker when READY, with the reason when FAILED or RESTARTING);
        raises InvalidTransitionError for a move the table does not list."""
        if new not in TRANSITIONS[self.state]:
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

    @property
    def shown_state(self) -> str:
        """What status shows: the worker's residency while ready, else the slot's state."""
        if self.state is SlotState.READY and self.residency is not None:
            return self.residency
        return self.state.value
