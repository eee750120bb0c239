"""What the daemon's edges (HTTP API, control socket) may ask of its core, and nothing more.

The supervisor implements `Service`; the edges depend only on this protocol, so each edge is
tested against a small double as well as against the real daemon. All methods are called on
the daemon's asyncio event loop.

Wherever a method takes a model, it takes a model's name or one of its aliases (with or without
Ollama's ":latest"; `resolve` says which model that is). A completion names the model as it was
asked for (clients compare the `model` they get with the one they sent); a command's reply and
every event name the model itself.

Errors the methods raise (arbiterd.errors), which each edge maps once:
    UnknownModelError      no model by that name               HTTP 404, listing the models
    ContextOverflowError   prompt (+ max_tokens) > context     HTTP 400
    RequestError           a bad parameter, or a kind of       HTTP 400
                           request the model does not serve
    WorkerError            the model's worker failed/restarts  HTTP 503
    EngineError            the model failed to load/restore    HTTP 503
    ControlError           a command that cannot be done now   control: error reply

Status (`await status()`): a `DaemonStatus` (arbiterd/status.py), which the control socket
writes as JSON and the HTTP API's /v1/models and Ollama routes read; docs/control-protocol.md
describes it field by field.

Events (from `subscribe()`), JSON objects with "event" and "at" (seconds since the epoch):
    residency   a model's state changed: model, from, to, duration_s, weights_bytes, kv_bytes,
                disk_read_bytes, reason; ending a load or warm-up also waited_from, wait_s,
                holder_pid, holder_name
    request     a request ended: model, id, duration_s, prompt_tokens, prompt_tokens_evaluated,
                completion_tokens, cancelled, status ("ok" | "error" | "cancelled")
    handoff     the GPU changed hands between models, as the model that got it measured:
                from, to, holder_pid, waited_from, wait_s, release_s (when "from" released
                during the wait), restore_s, restored_bytes,
                release_reason ("wanted" | "preempted" | None)
    wait        a model waited behind a program that is not one of ours: model, holder_pid,
                holder_name, waited_from, wait_s
    worker      a worker exited or restarted: model, pid, code, reason, restart_in_s
    reload      the config was read again: added, removed, changed (restarted),
                aliases_changed (applied without a restart), warnings
    hold        the user took (held=true) or gave back (held=false) the GPU
    unload      a model was unloaded: model, pid, reason, kv_file, kv_bytes, tokens, error
    host_ram_budget  host RAM went over [daemon] host_ram_budget: used_bytes, budget_bytes,
                unload (the cold models unloaded for it), after_bytes
    prompt_cache_evict  state files removed for [daemon] prompt_cache_budget: model, evicted,
                evicted_bytes, used_bytes, budget_bytes
    encoder     a vision model's projector did one step of a request: model, id, action
                (load, encode, free, release, restore), duration_s, bytes, images, path,
                peak_bytes, reason
    holder_silent  a warm worker showed no sign of life for holder_timeout_s (killed=false),
                or twice that and was killed (killed=true): model, pid, silent_s, timeout_s
    vram_not_freed  a release did not give the VRAM back: model, pid, device, bytes_before,
                bytes_after, expected_bytes, waited_s
    vram        live figures, ~1 Hz while someone subscribes (the "telemetry" object of
                status); sent to subscribers only, never journaled
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from arbiterd.daemon.images import ImagePolicy
from arbiterd.status import DaemonStatus


class Service(Protocol):
    def model_names(self) -> list[str]:
        """The configured models, in config order."""
        ...

    def strict_api(self, model: str) -> bool:
        """Whether the HTTP API refuses, rather than ignores, the fields that change nothing
        for this model (a configured one)."""
        ...

    def image_policy(self, model: str) -> ImagePolicy | None:
        """What images a configured model takes (issue 12); None: none, it has no mmproj."""
        ...

    def resolve(self, model: str) -> str | None:
        """The name of the configured model that `model` names; None when it names none."""
        ...

    async def complete(self, model: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run one request ("completion" with body["prompt"], "chat" with body["messages"], or
        "embedding" with body["input"], a list of texts, for an embedding model) to the end;
        returns the OpenAI response object."""
        ...

    def stream(self, model: str, kind: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Yield OpenAI chunk objects as they come. Errors are raised from the iterator, before
        or during the stream; closing the iterator early or cancelling the task awaiting it
        (the client went away) cancels the request in its worker. `complete` is cancelled the
        same way."""
        ...

    async def status(self) -> DaemonStatus:
        """What the daemon is doing now (arbiterd/status.py): built once, for every edge."""
        ...

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        """A queue that receives every event from now on, until `unsubscribe`."""
        ...

    def unsubscribe(self, events: asyncio.Queue[dict[str, Any]]) -> None: ...

    async def command(self, name: str, model: str | None = None) -> dict[str, Any]:
        """One of COMMANDS; `model` is required for MODEL_COMMANDS. Returns a small result
        object (e.g. {"model": ..., "state": ...})."""
        ...

    async def metrics_text(self) -> bytes:
        """The Prometheus text exposition of the daemon's metrics, VRAM read for the scrape."""
        ...
