"""A model that cannot be served: the worker's stand-in backend, and its answers until it loads.

Owns `Unavailable`, a Backend (worker/engine's interface) whose every move fails with the reason
the backend could not be made, so the worker still says hello, fails its load like a model
whose file cannot load, and answers each request with that reason; and `answer_until_loaded`,
what the engine thread does once a load failed: answer every request with the reason, and try
the load again where it may yet work (an RPC server that was down). Holds no llama objects.
"""

from __future__ import annotations

import queue
import time

from arbiterd.errors import ArbiterError, DeviceUnreachableError, EngineError
from arbiterd.footprint import DeviceFootprint
from arbiterd.request import GenerateRequest
from arbiterd.spec import Capability, KvPolicy, ModelInfo, ModelSpec, Residency
from arbiterd.states import BackendKind, WorkerOp
from arbiterd.wire import LineWriter
from arbiterd.worker import keptkv
from arbiterd.worker.engine import Cancelled, ChunkSink, Generation, Moved, Prepared
from arbiterd.worker.engine.placement import check_servers_up
from arbiterd.worker.inbox import Inbox
from arbiterd.worker.kvfile import KvState
from arbiterd.worker.residency import Residency as ResidencyMachine
from arbiterd.worker.tenancy import Tenancy

# A load that failed for a device out of reach (an RPC server down) is tried again after this,
# then after twice as long each time, up to the maximum.
LOAD_RETRY_S = 1.0
LOAD_RETRY_MAX_S = 30.0


class Unavailable:
    """Stands in for a backend that cannot be made (residency = "in-place" on an engine without
    the residency API): the worker still says hello, then fails its load with `error`, like a
    model whose file cannot load, and answers every request with that reason. Without it the
    worker would die before its hello, and the daemon would retry it for ever, knowing nothing.
    """

    keeps_kv_on_device = False
    prompt_tokens_evaluated_total = 0
    tokens_generated_total = 0
    generating = 0
    fallback_reason = ""

    def __init__(self, spec: ModelSpec, error: EngineError) -> None:
        self.spec = spec
        # What the config asked for, as the status shows it (only "in-place" can fail so).
        self.kind = (
            BackendKind.IN_PLACE if spec.residency is Residency.IN_PLACE else BackendKind.RELOAD
        )
        self._error = error

    def open(self) -> None:
        raise self._error

    def load(self) -> Moved:
        raise self._error

    def release(self, kv: KvPolicy) -> Moved:
        raise self._error

    def restore(self) -> Moved:
        raise self._error

    def prepare(self, request: GenerateRequest, cancelled: Cancelled) -> Prepared:
        raise self._error

    def begin(
        self, request_id: str, request: Prepared, sink: ChunkSink | None, cancelled: Cancelled
    ) -> None:
        raise self._error

    def step(self) -> dict[str, Generation | ArbiterError]:
        return {}

    def abandon(self, error: ArbiterError) -> list[str]:
        return []

    def resident_bytes(self) -> int:
        return 0

    @property
    def predicted_footprint(self) -> tuple[DeviceFootprint, ...]:
        return ()

    def footprint(self) -> tuple[DeviceFootprint, ...]:
        return ()

    def capabilities(self) -> tuple[Capability, ...]:
        return ()

    def model_info(self) -> ModelInfo | None:
        return None

    def host_kv_bytes(self) -> int:
        return 0

    def host_weights_bytes(self) -> int:
        return 0

    def kept_kv(self) -> KvState | None:
        return None

    def adopt_kv(self, kv: KvState) -> None:
        raise self._error

    def close(self) -> None:
        return None


def answer_until_loaded(inbox: Inbox, tenancy: Tenancy, out: LineWriter) -> bool:
    """A model that cannot load keeps answering, with its reason, until shut down; True
    once it has loaded after all. A load that failed for a device that could not be reached
    (an RPC server down) is tried again with backoff, from LOAD_RETRY_S up to
    LOAD_RETRY_MAX_S, each try a check that its servers are up before any token is asked."""
    retry_in_s = LOAD_RETRY_S
    next_try = time.monotonic() + retry_in_s
    while True:
        # A deadline, not a timeout per get: requests answered meanwhile do not put it off.
        timeout_s = max(0.0, next_try - time.monotonic()) if tenancy.retry_load else None
        try:
            command = inbox.get(timeout_s)
        except queue.Empty:
            retry_in_s = min(2 * retry_in_s, LOAD_RETRY_MAX_S)
            next_try = time.monotonic() + retry_in_s
            try:
                check_servers_up(tenancy.config.spec)
            except DeviceUnreachableError as exc:
                tenancy.last_error = str(exc)  # still failed: nothing new to say
                continue
            tenancy.residency = ResidencyMachine(tenancy.name)  # loading again
            if tenancy.load():
                return True
            continue
        if command.op is WorkerOp.SHUTDOWN:
            return False
        if command.op is WorkerOp.UNLOAD:  # nothing was loaded: nothing to keep
            out.send({"id": command.id, "result": keptkv.kept()})
            return False
        failed = EngineError(f"{tenancy.name} failed to load: {tenancy.last_error}")
        out.send({"id": command.id, "error": failed.to_wire()})
