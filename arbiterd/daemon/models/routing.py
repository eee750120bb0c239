"""Routes each request to its model's worker, with one retry rule for plain and streamed requests.

Owns the request ids and the rule: a request whose worker is gone before it started the request
(not sent yet, or still in the worker's queue: nothing of it ran) goes once more to the worker
that replaces it; any other failure is the request's, so a worker that dies fails only the
request it was running (issue 40). A client that goes away (its task cancelled) cancels the
request in the worker. Every failure is published as a `request` event and raised as the error
the edges map. A request for a model that does not exist is refused before any worker sees it,
and no event is published (the HTTP edge refused one of a kind its model does not serve). A
request for an unloaded model (issue 14) starts its worker first. A model whose settings a
reload changed is served by its new slot from the moment the
old one begins to retire: a request waits for the new worker, never told the model is gone
(issue 40). A request for a model whose file a start did not find (issue 24) is answered at
once, naming the file, rather than waiting for a restart that cannot work; once the file is
back, it starts the model. While a request's model waits for the GPU, a stream yields what it
waits for (procs.WaitNews) at the notice times, and a request that waits past its model's
max_queue_s is given up (daemon/models/waiting.py). Once the daemon stops (`stop_requests`), every
request is refused with ShuttingDownError, and each one in flight, waiting for its worker or
mid-decode, ends with it (its decode cancelled in the worker): an error the edges can still
answer, where the server going away would have cut its connection.

The router is the one publisher of `request` events: a request that ends publishes one, with
what its worker measured (the `WorkerResult`), or the error it failed with; one whose client
went away publishes its worker's cancelled result when that comes (WorkerClient's `on_end`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.waiting import NewsListener, Waits
from arbiterd.daemon.models.workerport import WorkerPort
from arbiterd.errors import (
    ArbiterError,
    EngineError,
    ModelLoadError,
    QueueTimeoutError,
    ShuttingDownError,
    UnknownModelError,
    WorkerError,
    WorkerGoneError,
)
from arbiterd.events import Event, RequestEvent
from arbiterd.procs import WaitNews
from arbiterd.reply import WorkerResult
from arbiterd.request import GenerateRequest
from arbiterd.states import RequestStatus, ResidencyState, SlotState

READY_TIMEOUT_S = 120.0  # how long a request waits for its worker to (re)start
_T = TypeVar("_T")
_DONE = object()  # what a stream's queue gets once its request ended


class Router:
    def __init__(
        self,
        slots: Mapping[str, Slot],
        publish: Callable[[Event], object],
        load: Callable[[Slot], Awaitable[None]],
        waits: Waits,
    ) -> None:
        """`load` starts an unloaded slot's worker (lifecycle.Lifecycle.load)."""
        self._slots = slots
        self._publish = publish
        self._load = load
        self._waits = waits
        self._ids = itertools.count(1)
        self._stopping: str = ""  # why requests are refused; empty while serving
        self._in_flight: set[asyncio.Task[Any]] = set()  # what stop_requests cancels

    def stop_requests(self, reason: str) -> None:
        """From now on refuse every request with ShuttingDownError(`reason`), and end each one
        in flight with it."""
        self._stopping = reason
        for task in self._in_flight:
            task.cancel()

    def stopping_reason(self) -> str:
        """Why requests are refused; empty while the router serves."""
        return self._stopping

    async def complete(self, model: str, request: GenerateRequest) -> WorkerResult:
        request_id = self._request_id()
        on_end = self._ender(model, request_id)
        return await self._until_stopped(
            self._send(
                model,
                request_id,
                lambda worker: worker.generate(request, request_id=request_id, on_end=on_end),
            )
        )

    async def stream(
        self, model: str, request: GenerateRequest
    ) -> AsyncGenerator[dict[str, Any] | WaitNews]:
        request_id = self._request_id()
        chunks: asyncio.Queue[object] = asyncio.Queue()
        on_end = self._ender(model, request_id)

        def generate(worker: WorkerPort) -> Awaitable[WorkerResult]:
            return worker.generate(
                request, on_chunk=chunks.put_nowait, request_id=request_id, on_end=on_end
            )

        # An unknown or failed model: before any chunk.
        await self._until_stopped(self.worker_of(model))
        sending = asyncio.get_running_loop().create_task(
            self._until_stopped(self._send(model, request_id, generate, chunks.put_nowait))
        )
        sending.add_done_callback(lambda _: chunks.put_nowait(_DONE))
        try:
            while True:
                chunk = await chunks.get()
                if chunk is _DONE:
                    sending.result()  # raises the request's error, if it failed
                    return
                yield chunk  # type: ignore[misc]  # everything but _DONE is a chunk or news
        finally:
            if not sending.done():  # closed or cancelled: the client went away
                sending.cancel()

    async def _until_stopped(self, work: Coroutine[Any, Any, _T]) -> _T:
        """`work`, in a task of its own that stop_requests may cancel: then ShuttingDownError.
        Cancelled from outside (the client went away), it is cancelled as ever: `_send` cancels
        the decode in the worker either way."""
        if self._stopping:
            work.close()
            raise ShuttingDownError(self._stopping)
        task = asyncio.get_running_loop().create_task(work)
        self._in_flight.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            stopping = self.stopping_reason()  # set meanwhile, by stop_requests
            if not stopping or (caller is not None and caller.cancelling()):
                raise
            raise ShuttingDownError(stopping) from None
        finally:
            self._in_flight.discard(task)

    async def worker_of(self, model: str) -> WorkerPort:
        """The model's worker once it is ready (started first when it is unloaded); at once
        UnknownModelError or EngineError for a model that does not exist or cannot serve."""
        slot = self.slot_of(model)
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                while True:
                    missing = slot.missing_file is not None
                    if missing or slot.state in (SlotState.UNLOADING, SlotState.UNLOADED):
                        await self._load(slot)  # a missing file: started if it is back
                    if slot.state is SlotState.FAILED or slot.residency is ResidencyState.FAILED:
                        raise EngineError(f"{model} failed to load: {slot.last_error}")
                    if slot.missing_file is not None and slot.state is SlotState.RESTARTING:
                        raise ModelLoadError(
                            f"{model} cannot start: its model file {slot.missing_file} is not "
                            "on disk; put it back (the next request starts it then)"
                        )
                    await slot.settled()
                    if slot.state is not SlotState.STOPPED:
                        break
                    # Retired while this waited: a reload replaced it (its new slot serves the
                    # model) or removed it (UnknownModelError).
                    successor = self.slot_of(model)
                    if successor is slot:
                        raise WorkerError(f"{model} is stopped")
                    slot = successor
        except TimeoutError:
            raise WorkerError(f"{model} is not running ({slot.last_error})") from None
        assert slot.worker is not None  # ready is set only while a worker is attached
        return slot.worker

    def slot_of(self, model: str) -> Slot:
        """The model's slot; UnknownModelError, with the models there are, when it has none."""
        slot = self._slots.get(model)
        if slot is None:
            raise UnknownModelError(
                f"no model named {model!r}; available: {', '.join(self._slots) or 'none'}"
            )
        return slot

    async def _send(
        self,
        model: str,
        request_id: str,
        send: Callable[[WorkerPort], Awaitable[WorkerResult]],
        on_news: NewsListener | None = None,
    ) -> WorkerResult:
        worker = await self.worker_of(model)
        slot = self._slots[model]
        try:
            try:
                result = await self._waits.request(slot, send(worker), on_news)
            except WorkerGoneError:  # gone before it started the request: nothing ran
                worker = await self._successor(model, worker)
                slot = self.slot_of(model)  # a new one, when a reload replaced it
                result = await self._waits.request(slot, send(worker), on_news)
        except asyncio.CancelledError:  # the client went away: stop the decode
            worker.cancel(request_id)
            raise
        except ArbiterError as exc:
            if isinstance(exc, QueueTimeoutError):  # given up while it waited in the worker
                worker.cancel(request_id)
            self._publish(
                RequestEvent(
                    model=model, request_id=request_id, status=RequestStatus.ERROR, error=str(exc)
                )
            )
            raise
        self._ender(model, request_id)(result)
        return result

    def _ender(self, model: str, request_id: str) -> Callable[[WorkerResult], None]:
        """What publishes the end of request `request_id` for `model`, given its result."""

        def ended(result: WorkerResult) -> None:
            self._publish(result.event(model=model, request_id=request_id))  # stamped there

        return ended

    async def _successor(self, model: str, gone: WorkerPort) -> WorkerPort:
        """The worker that replaces `gone` once it is restarted."""
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await gone.wait()  # a worker that closed its socket is about to exit
        except TimeoutError:
            raise WorkerError(f"{model}'s worker closed its socket but keeps running") from None
        slot = self._slots.get(model)
        if slot is not None:  # the lifecycle's watch of its exit detaches it
            await slot.worker_changed(gone)
        return await self.worker_of(model)

    def _request_id(self) -> str:
        return f"req-{os.getpid()}-{next(self._ids)}"
