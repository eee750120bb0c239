"""What a worker answers the daemon, typed once for both processes: a generate op's result
(`WorkerResult`), its status (`WorkerStatus`) and what its engine can do (`EngineReport`).

Owns the shape of those replies (the protocol itself is in arbiterd/worker/loop.py's
docstring). The worker writes each record with `to_json`; the daemon reads it with `from_json`,
the field codec (arbiterd/fields.py), so a field that is missing or odd reads as None or
empty and never raises: the daemon reads attributes, never a dict's keys. The hello alone is read
strictly (daemon/models/workerclient.py's WorkerHello): a worker that does not speak our
protocol is refused, where a status that lacks a figure is only shown without it.

`RequestEvent` has one publisher, the daemon's router (daemon/models/routing.py): a result
carries what the worker measured of its request, and `WorkerResult.event` makes the event of it.

Shared by every process: imports nothing of arbiterd's but the records it carries, never a
process's folder (daemon/, worker/, cli/, gui/) and never Qt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from arbiterd.errors import ProtocolError
from arbiterd.events import RequestEvent
from arbiterd.fields import Record
from arbiterd.footprint import ModelFootprint
from arbiterd.states import BackendKind, RequestStatus, ResidencyState
from arbiterd.status import Turn


@dataclass(frozen=True, kw_only=True)
class WorkerResult(Record):
    """A generate op's result: the OpenAI-shaped `response` (a completion, a chat completion or
    the embeddings) and what the request cost, as the worker measured it: `duration_s` from its
    beginning on the engine to its end; `cancelled`: it stopped early, cancelled."""

    response: dict[str, Any] = field(default_factory=dict)
    duration_s: float | None = None
    prompt_tokens: int = 0
    prompt_tokens_evaluated: int = 0  # run through llama_decode; prefix-cache hits excluded
    completion_tokens: int = 0
    cancelled: bool = False

    def event(self, *, model: str, request_id: str) -> RequestEvent:
        """The `request` event of the request this ended (unstamped: the daemon's bus stamps
        what it publishes)."""
        return RequestEvent(
            model=model,
            request_id=request_id,
            duration_s=self.duration_s,
            prompt_tokens=self.prompt_tokens,
            prompt_tokens_evaluated=self.prompt_tokens_evaluated,
            completion_tokens=self.completion_tokens,
            cancelled=self.cancelled,
            status=RequestStatus.CANCELLED if self.cancelled else RequestStatus.OK,
        )


@dataclass(frozen=True)
class EngineReport(Record):
    """What a worker's engine can do (the worker's engine.EngineInfo as the hello and the
    status carry it; the daemon never imports the engine)."""

    offload: bool = False  # False: everything runs on the CPU, whatever n_gpu_layers asks
    devices: tuple[str, ...] = ()  # "CPU: Intel Xeon", "CUDA0: NVIDIA H200", ...; may be empty

    @classmethod
    def read(cls, raw: object) -> EngineReport:
        """The hello's, read strictly: the first problem is a ProtocolError that names it."""
        if not isinstance(raw, Mapping):
            raise ProtocolError(f"hello: engine is not an object: {raw!r}")
        offload, devices = raw.get("offload"), raw.get("devices")
        if not isinstance(offload, bool):
            raise ProtocolError(f"hello: engine.offload is not a boolean: {offload!r}")
        if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
            raise ProtocolError(f"hello: engine.devices is not a list of strings: {devices!r}")
        return cls(offload, tuple(devices))


@dataclass(frozen=True)
class ModelInfoReport(Record):
    """What the model's GGUF says of it (the worker's spec.ModelInfo): its architecture, the
    context it was trained for (0: not said), its chat template ("": none)."""

    architecture: str = ""
    trained_context: int = 0
    chat_template: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkerStatus(Record):
    """A worker's status, published by its engine thread and answered by its io thread (also
    mid-decode). `WorkerStatus()`, every figure None or empty, is what the daemon knows of a
    worker that has not answered yet.

    `state`: its residency; `holds_token`: it holds the arena token; `queue`: the requests that
    wait (in its inbox, and the one waiting for the GPU); `current`: the request being begun,
    else the batch's oldest; `running`: every request the batch decodes; `sequences` and
    `tokens_per_s`: how many it decodes together and the tokens they generate a second (issue
    42); `served`: requests answered; `paused`: generations paused for a higher class; `turn`:
    its turn and the handoff cost it comes from (issue 43); `resident_bytes`: what it holds on
    its devices, by the engine's figures; `footprint`: what it takes of each device, predicted
    and measured (issue 44); `host_kv_bytes` and `host_weights_bytes`: what it keeps on the
    host for itself; `backend`, `fallback_reason` and `engine`: what runs the model, as the
    hello says it; `beat_age_s`: how old its engine thread's last beat was when the io thread
    answered (daemon/models/liveness.py)."""

    model: str = ""
    pid: int | None = None
    state: ResidencyState | None = None
    holds_token: bool = False
    pinned: bool = False
    queue: int | None = None
    current: str | None = None
    running: tuple[str, ...] = ()
    sequences: int = 0
    tokens_per_s: float = 0.0
    served: int = 0
    paused: int = 0
    turn: Turn | None = None
    resident_bytes: int | None = None
    footprint: ModelFootprint | None = None
    capabilities: tuple[str, ...] = ()
    model_info: ModelInfoReport | None = None
    host_kv_bytes: int = 0
    host_weights_bytes: int = 0
    prompt_tokens_evaluated: int = 0
    last_error: str = ""
    backend: BackendKind | None = None
    fallback_reason: str = ""
    engine: EngineReport | None = None
    beat_age_s: float | None = None

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs: an unload or a budget may take it."""
        return not self.queue and self.current is None
