"""The router in-process: fake workers in real slots, one retry rule, errors and cancels."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from arbiterd.arena import Arena
from arbiterd.daemon.models import routing
from arbiterd.daemon.models.routing import Router
from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.waiting import Waits
from arbiterd.daemon.models.workerclient import ChunkListener, EndListener
from arbiterd.errors import (
    ContextOverflowError,
    EngineError,
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
from tests.support.fakeworkers import IdleWorker
from tests.support.models import model_config
from tests.support.requests import request_for, wire_of
from tests.support.waiting import until

_T = TypeVar("_T")
BODY = {"prompt": "the fox", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "the fox"}], "max_tokens": 4}
# What a fake worker does with one request: its chunks go to on_chunk; it returns the result.
Behaviour = Callable[["FakeWorker", ChunkListener | None], Awaitable[WorkerResult]]


async def answers(worker: FakeWorker, on_chunk: ChunkListener | None) -> WorkerResult:
    for n in range(3):
        if on_chunk is not None:
            on_chunk({"text": f"chunk {n}"})
    return WorkerResult(response={"text": f"answered by {worker.name}"})


async def gone(worker: FakeWorker, on_chunk: ChunkListener | None) -> WorkerResult:
    """The worker died before the request reached it."""
    worker.exit(-9)
    raise WorkerGoneError(f"worker for {worker.name} is gone")


async def overflows(worker: FakeWorker, on_chunk: ChunkListener | None) -> WorkerResult:
    raise ContextOverflowError("the prompt exceeds the context window (64 tokens)")


async def decodes_until_cancelled(
    worker: FakeWorker, on_chunk: ChunkListener | None
) -> WorkerResult:
    if on_chunk is not None:
        on_chunk({"text": "first"})
    try:
        await asyncio.Event().wait()  # a long decode
    except asyncio.CancelledError:
        worker.interrupted = True
        raise
    raise AssertionError("a decode that nobody ends")


class FakeWorker(IdleWorker):
    """A WorkerPort where the router uses it: generate, cancel, wait. Its pid is ours, what the
    router's wait notices look for in the arena's queue."""

    def __init__(self, name: str, behaviour: Behaviour = answers) -> None:
        super().__init__(name)
        self.name = name
        self.behaviour = behaviour
        self.requests: list[tuple[str, dict[str, Any], str | None]] = []
        self.received = asyncio.Event()
        self.cancels: list[str] = []
        self.cancelled = asyncio.Event()
        self.interrupted = False
        self.code: int | None = None
        self._exited = asyncio.Event()

    async def generate(
        self,
        request: GenerateRequest,
        *,
        on_chunk: ChunkListener | None = None,
        timeout_s: float | None = 600.0,
        request_id: str | None = None,
        on_end: EndListener | None = None,
    ) -> WorkerResult:
        kind, body = wire_of(request)
        self.requests.append((kind, body, request_id))
        self.received.set()
        return await self.behaviour(self, on_chunk)

    def cancel(self, target: str) -> None:
        self.cancels.append(target)
        self.cancelled.set()

    def exit(self, code: int) -> None:
        self.code = code
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.code is not None
        return self.code


# Nobody waits for this arena's GPU: every worker here is ready at once.
ARENAS = tempfile.TemporaryDirectory(prefix="arbiterd-routing-")


def requests(daemon: Daemon) -> list[RequestEvent]:
    """The `request` events the router published, and nothing else was."""
    assert all(isinstance(e, RequestEvent) for e in daemon.published)
    return [e for e in daemon.published if isinstance(e, RequestEvent)]


def ready(slot: Slot, worker: FakeWorker) -> None:
    slot.move(SlotState.READY, worker=worker)


class WatchedSlot(Slot):
    """A slot that says when a request waits for it: `settled` is how the router waits for a
    slot to be ready (or retired), and `waited_on` is set once a call will wait."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.waited_on = asyncio.Event()

    async def settled(self) -> None:
        if self.state not in (SlotState.READY, SlotState.STOPPED):
            self.waited_on.set()
        await super().settled()


async def waiting_for(slot: Slot, request: asyncio.Task[Any]) -> None:
    """Return once `request` waits for `slot`; fail if it ends first (or after 10 s)."""
    assert isinstance(slot, WatchedSlot)
    waited = asyncio.get_running_loop().create_task(slot.waited_on.wait())
    try:
        done, _ = await asyncio.wait({waited, request}, timeout=10, return_when="FIRST_COMPLETED")
    finally:
        waited.cancel()
    assert waited in done, f"the request did not wait for {slot.name}: {request}"


class Daemon:
    """Slots, a router and what it published; `lifecycle_replaces` plays the lifecycle's part."""

    def __init__(self, *names: str) -> None:
        self.slots: dict[str, Slot] = {name: WatchedSlot(model_config(name)) for name in names}
        self.published: list[Event] = []
        self.loaded: list[str] = []  # the slots `load` started, in order
        self.spawned = asyncio.Event()  # cleared, a spawn waits until the test sets it
        self.spawned.set()
        waits = Waits(Arena(Path(ARENAS.name) / "arena"), notice_after_s=1.0)
        self.router = Router(self.slots, self.published.append, self.load, waits)

    async def load(self, slot: Slot) -> None:
        """What lifecycle.py does for an unloaded slot: a new worker, ready."""
        self.loaded.append(slot.name)
        slot.move(SlotState.STARTING)
        await self.spawned.wait()  # the spawn
        ready(slot, FakeWorker(f"{slot.name}-loaded"))

    def serve(self, model: str, worker: FakeWorker) -> FakeWorker:
        ready(self.slots[model], worker)
        return worker

    async def lifecycle_replaces(self, model: str, gone: FakeWorker, successor: FakeWorker) -> None:
        """What lifecycle.py does when a worker exits: restarting, then a new worker ready."""
        await gone.wait()
        slot = self.slots[model]
        slot.move(SlotState.RESTARTING, reason="worker killed by signal 9")
        # The backoff lasts until the retry waits for the successor: the retry is seen to wait
        # through the restart, not sent to a worker that is not ready.
        assert isinstance(slot, WatchedSlot)
        await slot.waited_on.wait()
        slot.move(SlotState.STARTING)
        ready(slot, successor)


def run(scenario: Coroutine[Any, Any, _T]) -> _T:
    async def bounded() -> _T:
        async with asyncio.timeout(30):
            return await scenario

    return asyncio.run(bounded())


def test_a_request_gets_its_workers_response_under_a_fresh_request_id() -> None:
    async def scenario() -> tuple[list[dict[str, Any]], FakeWorker, Daemon]:
        daemon = Daemon("m")
        worker = daemon.serve("m", FakeWorker("w1"))
        first = await daemon.router.complete("m", request_for("completion", BODY))
        second = await daemon.router.complete("m", request_for("chat", CHAT))
        return [first.response, second.response], worker, daemon

    responses, worker, daemon = run(scenario())
    assert responses == [{"text": "answered by w1"}] * 2
    assert [(kind, body) for kind, body, _ in worker.requests] == [
        ("completion", {"prompt": "the fox", "sampling": {"max_tokens": 4}}),
        ("chat", {"messages": CHAT["messages"], "sampling": {"max_tokens": 4}}),
    ]
    ids = [request_id for _, _, request_id in worker.requests]
    assert ids[0] != ids[1]
    assert all(str(i).startswith(f"req-{os.getpid()}-") for i in ids)
    # A served request's one event, with what its worker measured (the router publishes it).
    ended = [(e.model, e.request_id, e.status) for e in requests(daemon)]
    assert ended == [("m", ids[0], RequestStatus.OK), ("m", ids[1], RequestStatus.OK)]


def test_a_request_waits_for_a_starting_model_and_is_served_once_it_is_ready() -> None:
    async def scenario() -> dict[str, Any]:
        daemon = Daemon("m")
        request = asyncio.create_task(daemon.router.complete("m", request_for("completion", BODY)))
        await waiting_for(daemon.slots["m"], request)
        assert not request.done()
        daemon.serve("m", FakeWorker("w1"))
        return (await request).response

    assert run(scenario()) == {"text": "answered by w1"}


def test_a_request_waiting_for_a_model_a_reload_replaces_is_served_by_its_new_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(routing, "READY_TIMEOUT_S", 5.0)  # waiting on the old slot: fails

    async def scenario() -> dict[str, Any]:
        daemon = Daemon("m")
        old = daemon.slots["m"]
        request = asyncio.create_task(daemon.router.complete("m", request_for("completion", BODY)))
        await waiting_for(old, request)
        # What the supervisor's reload does for a changed model: the new slot serves the
        # name, then the old one retires, then the new one's worker starts.
        daemon.slots["m"] = new = WatchedSlot(model_config("m"))
        old.move(SlotState.STOPPED)
        await waiting_for(new, request)
        assert not request.done()  # waiting for the new slot's worker, not told it is gone
        daemon.serve("m", FakeWorker("new"))
        return (await request).response

    assert run(scenario()) == {"text": "answered by new"}


def test_a_request_waiting_for_a_model_a_reload_removes_is_told_it_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(routing, "READY_TIMEOUT_S", 5.0)  # waiting on the old slot: fails

    async def scenario() -> None:
        daemon = Daemon("m", "other")
        request = asyncio.create_task(daemon.router.complete("m", request_for("completion", BODY)))
        await waiting_for(daemon.slots["m"], request)
        daemon.slots.pop("m").move(SlotState.STOPPED)
        with pytest.raises(UnknownModelError, match="no model named 'm'; available: other"):
            await request

    run(scenario())


def test_a_request_for_an_unloaded_model_starts_its_worker_once() -> None:
    async def scenario() -> tuple[list[dict[str, Any]], Daemon]:
        daemon = Daemon("m")
        slot = daemon.slots["m"]
        ready(slot, FakeWorker("w1"))
        slot.move(SlotState.UNLOADING)
        slot.move(SlotState.UNLOADED)
        daemon.spawned.clear()
        first = asyncio.create_task(daemon.router.complete("m", request_for("completion", BODY)))
        await until(lambda: daemon.loaded == ["m"], 10, "the first request to start m")
        second = asyncio.create_task(daemon.router.complete("m", request_for("completion", BODY)))
        await waiting_for(slot, second)  # for the worker the first one starts
        daemon.spawned.set()
        return [(await first).response, (await second).response], daemon

    responses, daemon = run(scenario())
    assert responses == [{"text": "answered by m-loaded"}] * 2
    assert daemon.loaded == ["m"]  # the second found it starting, and waited


def test_a_request_whose_worker_was_gone_is_sent_once_more_to_its_successor() -> None:
    async def scenario() -> tuple[dict[str, Any], FakeWorker, FakeWorker, Daemon]:
        daemon = Daemon("m")
        first = daemon.serve("m", FakeWorker("w1", gone))
        successor = FakeWorker("w2")
        replacing = asyncio.create_task(daemon.lifecycle_replaces("m", first, successor))
        result = await daemon.router.complete("m", request_for("completion", BODY))
        await replacing
        return result.response, first, successor, daemon

    response, first, successor, daemon = run(scenario())
    assert response == {"text": "answered by w2"}
    assert first.requests == successor.requests  # the same request, under the same id
    assert len(first.requests) == 1
    ended = [(e.request_id, e.status) for e in requests(daemon)]
    assert ended == [(first.requests[0][2], RequestStatus.OK)]  # once, as it was served once


def test_a_request_is_retried_only_once() -> None:
    async def scenario() -> tuple[FakeWorker, FakeWorker, Daemon]:
        daemon = Daemon("m")
        first = daemon.serve("m", FakeWorker("w1", gone))
        successor = FakeWorker("w2", gone)
        replacing = asyncio.create_task(daemon.lifecycle_replaces("m", first, successor))
        with pytest.raises(WorkerGoneError, match="worker for w2 is gone"):
            await daemon.router.complete("m", request_for("completion", BODY))
        await replacing
        return first, successor, daemon

    first, successor, daemon = run(scenario())
    assert (len(first.requests), len(successor.requests)) == (1, 1)
    request_id = first.requests[0][2]
    assert daemon.published == [
        RequestEvent(
            model="m",
            request_id=request_id,
            status=RequestStatus.ERROR,
            error="worker for w2 is gone",
        )
    ]


def test_a_failed_request_is_published_as_an_error_and_raised_as_itself() -> None:
    async def scenario() -> tuple[FakeWorker, Daemon]:
        daemon = Daemon("m")
        worker = daemon.serve("m", FakeWorker("w1", overflows))
        with pytest.raises(ContextOverflowError, match="context window"):
            await daemon.router.complete("m", request_for("completion", BODY))
        return worker, daemon

    worker, daemon = run(scenario())
    assert len(worker.requests) == 1  # an error of the request itself is not retried
    assert daemon.published == [
        RequestEvent(
            model="m",
            request_id=worker.requests[0][2],
            status=RequestStatus.ERROR,
            error="the prompt exceeds the context window (64 tokens)",
        )
    ]


def test_an_unknown_model_is_refused_at_once_naming_the_models_there_are() -> None:
    async def scenario() -> None:
        with pytest.raises(UnknownModelError, match=r"no model named 'x'; available: a, b"):
            await Daemon("a", "b").router.complete("x", request_for("completion", BODY))
        with pytest.raises(UnknownModelError, match=r"available: none"):
            await Daemon().router.worker_of("x")

    run(scenario())


def test_a_failed_model_is_refused_at_once_with_its_reason() -> None:
    async def scenario() -> None:
        daemon = Daemon("m")
        daemon.slots["m"].move(SlotState.FAILED, reason="could not start: mmproj is not supported")
        with pytest.raises(EngineError, match="m failed to load: could not start: mmproj"):
            await daemon.router.complete("m", request_for("completion", BODY))

    run(scenario())


def test_a_model_whose_worker_failed_to_load_is_refused_at_once() -> None:
    async def scenario() -> FakeWorker:
        daemon = Daemon("m")
        worker = daemon.serve("m", FakeWorker("w1"))
        slot = daemon.slots["m"]
        slot.report_residency(ResidencyState.FAILED, now=0.0, reason="missing.gguf: no such file")
        with pytest.raises(EngineError, match=r"m failed to load: missing\.gguf: no such file"):
            await daemon.router.complete("m", request_for("completion", BODY))
        return worker

    assert run(scenario()).requests == []


def test_a_model_that_does_not_become_ready_in_time_is_a_worker_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(routing, "READY_TIMEOUT_S", 0.01)

    async def scenario() -> None:
        daemon = Daemon("m")
        daemon.slots["m"].move(SlotState.RESTARTING, reason="worker exited with code 1")
        with pytest.raises(WorkerError, match=r"m is not running \(worker exited with code 1\)"):
            await daemon.router.complete("m", request_for("completion", BODY))

    run(scenario())


def test_a_client_that_goes_away_cancels_its_request_in_the_worker() -> None:
    async def scenario() -> tuple[FakeWorker, Daemon]:
        daemon = Daemon("m")
        worker = daemon.serve("m", FakeWorker("w1", decodes_until_cancelled))
        request = asyncio.create_task(daemon.router.complete("m", request_for("completion", BODY)))
        await worker.received.wait()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        return worker, daemon

    worker, daemon = run(scenario())
    assert worker.cancels == [worker.requests[0][2]]
    assert worker.interrupted
    # Not an error: its end comes with the worker's cancelled result (WorkerClient's on_end),
    # which this fake never sends.
    assert daemon.published == []


def test_a_stream_yields_the_workers_chunks_in_order() -> None:
    async def scenario() -> list[dict[str, Any] | WaitNews]:
        daemon = Daemon("m")
        daemon.serve("m", FakeWorker("w1"))
        return [chunk async for chunk in daemon.router.stream("m", request_for("completion", BODY))]

    assert run(scenario()) == [{"text": "chunk 0"}, {"text": "chunk 1"}, {"text": "chunk 2"}]


def test_a_stream_of_an_unknown_model_fails_before_any_chunk() -> None:
    async def scenario() -> None:
        stream = Daemon("m").router.stream("x", request_for("completion", BODY))
        with pytest.raises(UnknownModelError):
            await anext(stream)

    run(scenario())


def test_a_stream_that_fails_raises_its_error_to_the_consumer_and_publishes_it() -> None:
    async def scenario() -> Daemon:
        daemon = Daemon("m")
        daemon.serve("m", FakeWorker("w1", overflows))
        stream = daemon.router.stream("m", request_for("completion", BODY))
        with pytest.raises(ContextOverflowError):
            await anext(stream)  # the error, where the first chunk would have been
        return daemon

    published = run(scenario()).published
    assert [(e.status, e.model) for e in published if isinstance(e, RequestEvent)] == [
        ("error", "m")
    ]


def test_a_stream_whose_worker_was_gone_is_sent_once_more_to_its_successor() -> None:
    async def scenario() -> tuple[list[dict[str, Any] | WaitNews], FakeWorker]:
        daemon = Daemon("m")
        first = daemon.serve("m", FakeWorker("w1", gone))
        successor = FakeWorker("w2")
        replacing = asyncio.create_task(daemon.lifecycle_replaces("m", first, successor))
        chunks = [
            chunk async for chunk in daemon.router.stream("m", request_for("completion", BODY))
        ]
        await replacing
        return chunks, successor

    chunks, successor = run(scenario())
    assert len(chunks) == 3
    assert len(successor.requests) == 1


def test_closing_a_stream_early_cancels_the_request_in_the_worker() -> None:
    async def scenario() -> tuple[dict[str, Any] | WaitNews, FakeWorker]:
        daemon = Daemon("m")
        worker = daemon.serve("m", FakeWorker("w1", decodes_until_cancelled))
        stream = daemon.router.stream("m", request_for("completion", BODY))
        first = await anext(stream)
        await stream.aclose()  # the HTTP client hung up
        await asyncio.wait_for(worker.cancelled.wait(), timeout=10)
        return first, worker

    first, worker = run(scenario())
    assert first == {"text": "first"}
    assert worker.cancels == [worker.requests[0][2]]
    assert worker.interrupted  # the decode's await was cancelled too


def test_a_streaming_client_whose_task_is_cancelled_cancels_the_request_in_the_worker() -> None:
    async def scenario() -> FakeWorker:
        daemon = Daemon("m")
        worker = daemon.serve("m", FakeWorker("w1", decodes_until_cancelled))
        first_chunk = asyncio.Event()

        async def client() -> None:
            async for _ in daemon.router.stream("m", request_for("completion", BODY)):
                first_chunk.set()

        consuming = asyncio.create_task(client())
        await first_chunk.wait()
        consuming.cancel()  # the server cancels the handler of a connection that closed
        with pytest.raises(asyncio.CancelledError):
            await consuming
        await asyncio.wait_for(worker.cancelled.wait(), timeout=10)
        return worker

    worker = run(scenario())
    assert worker.cancels == [worker.requests[0][2]]


def test_stopping_ends_a_request_mid_decode_with_shutting_down_and_refuses_the_next() -> None:
    async def scenario() -> tuple[FakeWorker, str]:
        daemon = Daemon("m")
        worker = daemon.serve("m", FakeWorker("w1", decodes_until_cancelled))
        asking = asyncio.create_task(daemon.router.complete("m", request_for("completion", BODY)))
        await asyncio.wait_for(worker.received.wait(), timeout=10)
        daemon.router.stop_requests("stopping for the test")
        with pytest.raises(ShuttingDownError, match="stopping for the test"):
            await asking
        await asyncio.wait_for(worker.cancelled.wait(), timeout=10)
        with pytest.raises(ShuttingDownError) as refused:
            await daemon.router.complete("m", request_for("completion", BODY))
        return worker, str(refused.value)

    worker, refused = run(scenario())
    assert len(worker.requests) == 1  # the one sent after the stop never reached the worker
    assert worker.cancels == [worker.requests[0][2]]
    assert refused == "stopping for the test"


def test_a_client_that_leaves_while_stopping_is_cancelled_as_ever() -> None:
    async def scenario() -> None:
        daemon = Daemon("m")
        worker = daemon.serve("m", FakeWorker("w1", decodes_until_cancelled))
        asking = asyncio.create_task(daemon.router.complete("m", request_for("completion", BODY)))
        await asyncio.wait_for(worker.received.wait(), timeout=10)
        asking.cancel()  # the client went away
        daemon.router.stop_requests("stopping for the test")
        with pytest.raises(asyncio.CancelledError):
            await asking

    run(scenario())
