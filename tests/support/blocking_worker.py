"""`BlockingWorker`: a `WorkerClient` driven from ordinary threads, on a private event loop, for
tests and benchmarks that talk to a real worker process without an asyncio loop of their own.
The daemon never uses it (it lives on its own loop, arbiterd/daemon/models/workerclient.py).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from arbiterd.daemon.models.workerclient import (
    SHUTDOWN_TIMEOUT_S,
    ChunkListener,
    EventListener,
    WorkerClient,
    WorkerHello,
)
from arbiterd.errors import WorkerError
from arbiterd.request import GenerateRequest
from arbiterd.spec import WorkerConfig

_T = TypeVar("_T")


class BlockingWorker:
    """A `WorkerClient` on a private loop in its own thread, for tests and benchmarks that
    drive a worker from plain threads. Events go to `events` (with keep_events) and to every
    listener, which run on the private loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self._loop = loop
        self._thread = thread
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._keep_events = True
        self._listeners: list[EventListener] = []
        self._client: WorkerClient | None = None

    @classmethod
    def spawn(
        cls, config: WorkerConfig, *, env: dict[str, str] | None = None, keep_events: bool = True
    ) -> BlockingWorker:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=loop.run_forever, name=f"blocking-worker-{config.spec.name}", daemon=True
        )
        thread.start()
        worker = cls(loop, thread)
        worker._keep_events = keep_events

        try:
            worker._client = worker._call(
                WorkerClient.spawn(config, env=env, on_event=worker._on_event)
            )
        except BaseException:
            worker._stop_loop()
            raise
        return worker

    @property
    def client(self) -> WorkerClient:
        assert self._client is not None  # set by spawn
        return self._client

    @property
    def model(self) -> str:
        return self.client.model

    @property
    def pid(self) -> int:
        return self.client.pid

    @property
    def hello(self) -> WorkerHello | None:
        return self.client.hello

    @property
    def returncode(self) -> int | None:
        return self.client.returncode

    def add_listener(self, listener: EventListener) -> None:
        self._listeners.append(listener)

    def request(self, op: str, *, timeout_s: float | None = 60.0, **fields: Any) -> dict[str, Any]:
        return self._call(self.client.request(op, timeout_s=timeout_s, **fields))

    def generate(
        self,
        request: GenerateRequest,
        *,
        on_chunk: ChunkListener | None = None,
        timeout_s: float | None = 600.0,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """The worker's result as the wire carries it (arbiterd.reply.WorkerResult)."""
        result = self._call(
            self.client.generate(
                request, on_chunk=on_chunk, timeout_s=timeout_s, request_id=request_id
            )
        )
        return result.to_json()

    def cancel(self, target: str) -> None:
        self._loop.call_soon_threadsafe(self.client.cancel, target)

    def status(self) -> dict[str, Any]:
        """The worker's status as the wire carries it (arbiterd.reply.WorkerStatus)."""
        return self._call(self.client.status()).to_json()

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int:
        try:
            return self._call(self.client.shutdown(timeout_s))
        finally:
            self._stop_loop()

    def kill(self) -> int:
        if self._loop.is_closed():
            code = self.client.returncode
            assert code is not None  # the loop closes only once the worker was reaped
            return code
        try:
            return self._call(self.client.kill())
        finally:
            self._stop_loop()

    def wait(self, timeout_s: float | None = None) -> int:
        """The worker's exit status once it exits; WorkerError after `timeout_s`."""

        async def wait() -> int:
            async with asyncio.timeout(timeout_s):
                return await self.client.wait()

        try:
            return self._call(wait())
        except TimeoutError:
            raise WorkerError(f"worker for {self.model} still runs after {timeout_s} s") from None

    def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """The next event (consumed from `events`) that matches `predicate`."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"no matching event from {self.model} within {timeout_s} s")
            try:
                event = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            if predicate(event):
                return event

    def _on_event(self, event: dict[str, Any]) -> None:
        if self._keep_events:
            self.events.put(event)
        for listener in self._listeners:
            listener(event)

    def _call(self, work: Awaitable[_T]) -> _T:
        async def run() -> _T:
            return await work

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def _stop_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
