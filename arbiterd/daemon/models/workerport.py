"""What the daemon needs of a worker: the `WorkerPort` Protocol.

Owns that contract and nothing else. workerclient.WorkerClient, the one real worker client,
implements it; the slots, the router, the lifecycle and the supervisor hold a `WorkerPort`, so a
test's fake worker implements it too and mypy checks the fake against what the daemon calls,
where a `cast` would check nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from arbiterd.daemon.models.liveness import Heard
from arbiterd.daemon.models.workerclient import ChunkListener, EndListener, WorkerHello
from arbiterd.reply import WorkerResult, WorkerStatus
from arbiterd.request import GenerateRequest


class WorkerPort(Protocol):
    """A running worker, driven from the daemon's asyncio loop (workerclient.WorkerClient
    documents each member)."""

    model: str
    hello: WorkerHello | None  # what its first line said; None until then
    heard: Heard  # what the daemon last heard of its life (liveness.py)
    killed_for: str  # why the daemon killed it; "" when it did not

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def request(
        self, op: str, *, timeout_s: float | None = ..., **fields: Any
    ) -> dict[str, Any]: ...

    async def generate(
        self,
        request: GenerateRequest,
        *,
        on_chunk: ChunkListener | None = ...,
        timeout_s: float | None = ...,
        request_id: str | None = ...,
        on_end: EndListener | None = ...,
    ) -> WorkerResult: ...

    def cancel(self, target: str) -> None: ...

    async def status(self, timeout_s: float | None = ...) -> WorkerStatus: ...

    def ask(self) -> asyncio.Task[WorkerStatus]: ...

    async def shutdown(self, timeout_s: float = ...) -> int: ...

    def kill_for(self, reason: str) -> None: ...

    async def kill(self) -> int: ...

    async def wait(self) -> int: ...

    async def last_words(self) -> tuple[str, ...]: ...
