"""A fake worker that implements daemon/models/workerport.WorkerPort, for tests that put one in
a slot: mypy checks it (and every fake made from it) against what the daemon calls."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from arbiterd.daemon.models.liveness import Heard
from arbiterd.daemon.models.workerclient import ChunkListener, EndListener, WorkerHello
from arbiterd.reply import WorkerResult, WorkerStatus
from arbiterd.request import GenerateRequest


class IdleWorker:
    """A worker that a slot keeps and nobody drives: each call a test does not override fails
    it, naming the call."""

    def __init__(self, model: str = "m") -> None:
        self.model = model
        self.hello: WorkerHello | None = None
        self.heard = Heard.started(0.0)
        self.killed_for = ""

    @property
    def pid(self) -> int:
        return os.getpid()  # ours: a test that queues in an arena queues as this worker

    @property
    def returncode(self) -> int | None:
        return None

    def _unused(self, call: str) -> AssertionError:
        return AssertionError(f"{type(self).__name__} was asked {call}, which this test fakes not")

    async def request(
        self, op: str, *, timeout_s: float | None = 60.0, **fields: Any
    ) -> dict[str, Any]:
        raise self._unused(f"request({op!r})")

    async def generate(
        self,
        request: GenerateRequest,
        *,
        on_chunk: ChunkListener | None = None,
        timeout_s: float | None = 600.0,
        request_id: str | None = None,
        on_end: EndListener | None = None,
    ) -> WorkerResult:
        raise self._unused("generate")

    def cancel(self, target: str) -> None:
        raise self._unused("cancel")

    async def status(self, timeout_s: float | None = 10.0) -> WorkerStatus:
        raise self._unused("status")

    def ask(self) -> asyncio.Task[WorkerStatus]:
        raise self._unused("ask")

    async def shutdown(self, timeout_s: float = 30.0) -> int:
        raise self._unused("shutdown")

    def kill_for(self, reason: str) -> None:
        raise self._unused("kill_for")

    async def kill(self) -> int:
        raise self._unused("kill")

    async def wait(self) -> int:
        raise self._unused("wait")

    async def last_words(self) -> tuple[str, ...]:
        return ()
