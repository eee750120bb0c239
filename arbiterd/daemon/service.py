"""What the daemon's edges (HTTP API, control socket) may ask of its core, and nothing more.

The supervisor implements `Service`; the edges depend only on this protocol, so each edge is
tested against a small double as well as against the real daemon. All methods are called on
the daemon's asyncio event loop.

The HTTP edge looks a request's model up once (`model`: a name or one of its aliases, with or
without Ollama's ":latest"), checks the request against what it finds, and from then on names
the model by its configured name (`complete`, `stream`); the answer names it as the client asked
(clients compare the `model` they get with the one they sent), which the edge writes. A command
takes a name or an alias; its reply and every event name the model itself.

Errors the methods raise (arbiterd.errors), which each edge maps once:
    UnknownModelError      no model by that name               HTTP 404, listing the models
    ContextOverflowError   prompt (+ max_tokens) > context     HTTP 400
    RequestError           a bad parameter, or a kind of       HTTP 400
                           request the model does not serve
    QueueTimeoutError      waited past the model's max_queue_s HTTP 503, Retry-After
    WorkerError            the model's worker failed/restarts  HTTP 503
    EngineError            the model failed to load/restore    HTTP 503
    ControlError           a command that cannot be done now   control: error reply

Status (`await status()`): a `DaemonStatus` (arbiterd/status.py), which the control socket
writes as JSON and the HTTP API's /v1/models and Ollama routes read; docs/control-protocol.md
describes it field by field.

Events (from `subscribe()`): JSON objects, each an arbiterd/events.py record as its `to_json`
writes it (`parse_event` reads one back); docs/control-protocol.md ("Events") lists them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from arbiterd.procs import WaitNews
from arbiterd.request import GenerateRequest
from arbiterd.states import ControlCommand
from arbiterd.status import DaemonStatus


@dataclass(frozen=True)
class ImagePolicy:
    """What a vision model accepts (its [models.NAME] table), as the core tells the HTTP edge."""

    model: str
    max_bytes: int
    max_pixels: int
    allow_urls: bool


@dataclass(frozen=True)
class ServedModel:
    """A configured model as the HTTP edge admits a request for it, looked up once per request
    (`Service.model`): its name, and what the edge checks the request against."""

    name: str  # the configured name that the name or alias asked for resolves to
    embedding: bool  # it serves embeddings only (read as its config was loaded), nothing else
    strict_api: bool  # refuse, rather than ignore, the fields that change nothing for it
    images: ImagePolicy | None  # what images it takes (issue 12); None: none, it has no mmproj


class Service(Protocol):
    def model_names(self) -> list[str]:
        """The configured models, in config order."""
        ...

    def model(self, asked: str) -> ServedModel | None:
        """The configured model that `asked` (a name or an alias) names; None when it names
        none."""
        ...

    async def complete(self, model: str, request: GenerateRequest) -> dict[str, Any]:
        """Run one request (an EMBEDDING request for an embedding model, a COMPLETION or CHAT
        request for any other) on `model`, a configured name (`model(...).name`), to the end;
        returns the OpenAI response object."""
        ...

    def stream(
        self, model: str, request: GenerateRequest
    ) -> AsyncIterator[dict[str, Any] | WaitNews]:
        """Yield OpenAI chunk objects as they come and, while the model waits for the GPU, what
        it waits for (a WaitNews, from `[daemon] queue_notice_s` on, every few seconds: each
        edge shows it in its own way, or not at all). Errors are raised from the iterator,
        before or during the stream; closing the iterator early or cancelling the task awaiting
        it (the client went away) cancels the request in its worker. `complete` is cancelled
        the same way."""
        ...

    async def status(self) -> DaemonStatus:
        """What the daemon is doing now (arbiterd/status.py): built once, for every edge."""
        ...

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        """A queue that receives every event from now on, until `unsubscribe`."""
        ...

    def unsubscribe(self, events: asyncio.Queue[dict[str, Any]]) -> None: ...

    async def command(
        self,
        name: ControlCommand,
        model: str | None = None,
        on_news: Callable[[WaitNews], None] | None = None,
        *,
        pid: int | None = None,
    ) -> dict[str, Any]:
        """One of control.COMMANDS; `model` is required for MODEL_COMMANDS, `pid` for yield.
        Returns a small result object (e.g. {"model": ..., "state": ...}). While a model command
        waits for the GPU, `on_news` is told what it waits for, soon and then every second."""
        ...

    async def metrics_text(self) -> bytes:
        """The Prometheus text exposition of the daemon's metrics, VRAM read for the scrape."""
        ...
