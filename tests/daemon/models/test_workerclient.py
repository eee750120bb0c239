"""The asyncio worker client against real worker processes on the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from arbiterd.daemon.models.workerclient import BACKENDS, WorkerClient
from arbiterd.errors import ContextOverflowError, ProtocolError, WorkerError, WorkerGoneError
from arbiterd.reply import WorkerResult, WorkerStatus
from arbiterd.spec import WORKER_PROTOCOL, ModelSpec, WorkerConfig
from arbiterd.states import ResidencyState
from arbiterd.wire import MAX_MESSAGE_BYTES
from tests.support.blocking_worker import BlockingWorker
from tests.support.requests import request_for
from tests.support.signals import stop

_T = TypeVar("_T")

PROMPT = " ".join(f"the fox {w} is not a dog" for w in ("one", "two", "three", "four") * 8)
SHORT = {"prompt": "the fox", "max_tokens": 4, "temperature": 0}
LONG_TOKENS = 3000
LONG = {
    "prompt": "the fox",
    "max_tokens": LONG_TOKENS,
    "temperature": 0,
}  # ends only when cancelled


@pytest.fixture
def configs(tmp_path: Path, tiny_model: Path) -> Configs:
    return Configs(tmp_path / "arena", tiny_model)


class Configs:
    def __init__(self, arena: Path, model: Path) -> None:
        self.arena = arena
        self.model = model

    def __call__(self, name: str = "m", *, n_ctx: int = 4096) -> WorkerConfig:
        spec = ModelSpec(name=name, path=self.model, n_ctx=n_ctx, n_gpu_layers=0)
        return WorkerConfig(spec=spec, arena=self.arena)


class Events:
    """A worker's events as on_event hands them over, and a wait for one that matches."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self._arrived = asyncio.Condition()

    def __call__(self, event: dict[str, Any]) -> None:
        self.seen.append(event)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._arrived:
            self._arrived.notify_all()

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        async with self._arrived:
            await self._arrived.wait_for(lambda: any(predicate(e) for e in self.seen))
        return next(e for e in self.seen if predicate(e))


@contextlib.asynccontextmanager
async def spawned(
    config: WorkerConfig, events: Events | None = None
) -> AsyncIterator[WorkerClient]:
    worker = await WorkerClient.spawn(config, on_event=events)
    try:
        yield worker
    finally:
        await worker.kill()  # reaps it; a worker that exited already is only reaped


def run(scenario: Coroutine[Any, Any, _T], timeout_s: float = 60) -> _T:
    async def bounded() -> _T:
        async with asyncio.timeout(timeout_s):
            return await scenario

    return asyncio.run(bounded())


class FirstChunk:
    """An on_chunk that keeps the chunks and says when the first one came."""

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.came = asyncio.Event()

    def __call__(self, chunk: dict[str, Any]) -> None:
        self.chunks.append(chunk)
        self.came.set()


def test_spawn_returns_once_the_worker_said_its_hello(configs: Configs) -> None:
    async def scenario() -> tuple[WorkerClient, WorkerStatus]:
        async with spawned(configs("m")) as worker:
            return worker, await worker.status()

    worker, status = run(scenario())
    hello = worker.hello
    assert hello is not None
    assert (hello.protocol, hello.model, hello.pid) == (WORKER_PROTOCOL, "m", worker.pid)
    assert hello.backend in BACKENDS
    assert (status.pid, status.backend) == (worker.pid, hello.backend)
    assert status.engine == hello.engine


def test_a_request_returns_the_workers_result_and_its_events_reach_on_event(
    configs: Configs,
) -> None:
    events = Events()

    async def scenario() -> WorkerResult:
        async with spawned(configs("m"), events) as worker:
            return await worker.generate(request_for("completion", SHORT), request_id="mine")

    result = run(scenario())
    assert result.completion_tokens == 4
    assert result.cancelled is False
    assert result.response["choices"][0]["text"]
    # What the request's one `request` event says (the router publishes it; arbiterd.reply).
    said = result.event(model="m", request_id="mine").to_json()
    assert (said["id"], said["completion_tokens"]) == ("mine", 4)
    residency = [(e["from"], e["to"]) for e in events.seen if e["event"] == "residency"]
    assert residency[0] == ("loading", "warm")  # before its reply: it had to load to answer


def test_a_streamed_request_calls_on_chunk_for_each_piece_before_it_returns(
    configs: Configs,
) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], WorkerResult]:
        chunks = FirstChunk()
        async with spawned(configs("m")) as worker:
            result = await worker.generate(
                request_for("completion", {**SHORT, "max_tokens": 6}), on_chunk=chunks
            )
        return chunks.chunks, result

    chunks, result = run(scenario())
    assert result.completion_tokens == 6
    assert 1 <= len(chunks) <= 7
    assert all(isinstance(chunk, dict) for chunk in chunks)


def test_cancel_stops_a_streaming_request_and_the_worker_goes_on(configs: Configs) -> None:
    async def scenario() -> tuple[WorkerResult, WorkerResult]:
        async with spawned(configs("m")) as worker:
            chunks = FirstChunk()
            decoding = asyncio.create_task(
                worker.generate(request_for("completion", LONG), on_chunk=chunks, request_id="long")
            )
            await chunks.came.wait()
            worker.cancel("long")
            cancelled = await decoding
            return cancelled, await worker.generate(request_for("completion", SHORT))

    cancelled, after = run(scenario())
    assert cancelled.cancelled is True
    assert cancelled.completion_tokens < LONG_TOKENS
    assert after.completion_tokens == 4


def test_a_request_whose_asker_gave_up_tells_on_end_its_cancelled_result(
    configs: Configs,
) -> None:
    """A client that went away: its request still ends, cancelled, and that end is news (the
    router publishes its `request` event from it)."""

    async def scenario() -> WorkerResult:
        ended: asyncio.Queue[WorkerResult] = asyncio.Queue()
        async with spawned(configs("m")) as worker:
            chunks = FirstChunk()
            decoding = asyncio.create_task(
                worker.generate(
                    request_for("completion", LONG),
                    on_chunk=chunks,
                    request_id="long",
                    on_end=ended.put_nowait,
                )
            )
            await chunks.came.wait()
            decoding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await decoding
            worker.cancel("long")
            async with asyncio.timeout(30):
                return await ended.get()

    result = run(scenario())
    assert result.cancelled is True
    assert result.completion_tokens < LONG_TOKENS


def test_status_is_answered_while_a_request_decodes(configs: Configs) -> None:
    async def scenario() -> tuple[WorkerStatus, bool]:
        async with spawned(configs("m")) as worker:
            chunks = FirstChunk()
            decoding = asyncio.create_task(
                worker.generate(request_for("completion", LONG), on_chunk=chunks, request_id="long")
            )
            await chunks.came.wait()
            status = await worker.status()
            still_decoding = not decoding.done()
            worker.cancel("long")
            await decoding
            return status, still_decoding

    status, still_decoding = run(scenario())
    assert still_decoding
    assert status.current is not None


def test_an_error_reply_is_raised_as_its_own_class_and_the_worker_lives(
    configs: Configs,
) -> None:
    async def scenario() -> WorkerResult:
        async with spawned(configs("m", n_ctx=64)) as worker:
            with pytest.raises(ContextOverflowError, match="context window"):
                await worker.generate(
                    request_for("completion", {"prompt": PROMPT, "max_tokens": 4})
                )
            return await worker.generate(request_for("completion", SHORT))

    assert run(scenario()).completion_tokens == 4


def test_a_message_the_worker_cannot_take_fails_its_request_at_once_and_the_worker_serves_on(
    configs: Configs,
) -> None:
    """The worker answers it with "bad_message" and the request's id, so the request fails now
    rather than after its timeout (600 s for a generate)."""

    async def scenario() -> tuple[list[str], float, WorkerResult]:
        async with spawned(configs("m")) as worker:
            started = time.monotonic()
            problems = []
            with pytest.raises(ProtocolError) as too_big:
                await worker.generate(
                    request_for("completion", {"prompt": "x" * MAX_MESSAGE_BYTES})
                )
            problems.append(str(too_big.value))
            with pytest.raises(ProtocolError) as unknown:
                await worker.request("dance")
            problems.append(str(unknown.value))
            took_s = time.monotonic() - started
            return problems, took_s, await worker.generate(request_for("completion", SHORT))

    problems, took_s, after = run(scenario())
    assert f"exceeds {MAX_MESSAGE_BYTES}" in problems[0]  # refused whole or as it grew
    assert problems[1] == "bad op 'dance'"
    assert took_s < 30
    assert after.completion_tokens == 4


def test_a_request_without_an_answer_in_time_is_a_worker_error_and_the_worker_serves_on(
    configs: Configs,
) -> None:
    async def scenario() -> WorkerStatus:
        async with spawned(configs("m")) as worker:
            with pytest.raises(WorkerError, match=r"^m did not answer its status within 0 s$"):
                await worker.request("status", timeout_s=0)
            return await worker.status()  # the late reply of the first is dropped

    assert run(scenario()).state is not None


def test_a_worker_that_exits_before_its_hello_fails_its_spawn_at_once(
    tmp_path: Path, configs: Configs
) -> None:
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(tmp_path / "nowhere")}  # no engine to import

    async def scenario() -> None:
        # "exited (1)", not "did not say hello": spawn did not wait out HELLO_TIMEOUT_S.
        with pytest.raises(WorkerError, match=r"worker for m exited \(1\) before its hello"):
            await WorkerClient.spawn(configs("m"), env=env)

    run(scenario())


def dying_env(trigger: Path) -> dict[str, str]:
    """A worker's environment under which it dies with last words once `trigger` exists."""
    support = Path(__file__).parents[2] / "support" / "last_words"
    path = os.pathsep.join(p for p in (str(support), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "ARBITERD_TEST_LAST_WORDS": str(trigger)}


def test_a_worker_that_dies_before_its_hello_names_its_last_words(
    tmp_path: Path, configs: Configs
) -> None:
    trigger = tmp_path / "die"
    trigger.touch()

    async def scenario() -> None:
        with pytest.raises(WorkerError, match=r"exited \(-6\) before its hello: GGML_ASSERT"):
            await WorkerClient.spawn(configs("m"), env=dying_env(trigger))

    run(scenario())


def test_a_worker_that_aborts_keeps_its_last_words_for_whoever_reaps_it(
    tmp_path: Path, configs: Configs, capfd: pytest.CaptureFixture[str]
) -> None:
    trigger = tmp_path / "die"

    async def scenario() -> tuple[int, tuple[str, ...]]:
        worker = await WorkerClient.spawn(configs("m"), env=dying_env(trigger))
        try:
            # Loaded first: the engine prints while it starts, and its lines must not land
            # after the last words.
            async with asyncio.timeout(30):
                while (await worker.status()).state not in (
                    ResidencyState.WARM,
                    ResidencyState.COLD,
                ):
                    await asyncio.sleep(0.05)
            trigger.touch()
            return await worker.wait(), await worker.last_words()
        finally:
            await worker.kill()

    code, words = run(scenario())
    assert code == -signal.SIGABRT
    assert words[-1] == "GGML_ASSERT(buf != NULL) failed: the last words of a test's worker"
    assert len(words) <= 8
    assert "the last words of a test's worker" in capfd.readouterr().err  # the daemon's log too


def test_a_request_to_a_worker_known_to_be_dead_is_worker_gone(configs: Configs) -> None:
    async def scenario() -> tuple[int, int]:
        async with spawned(configs("m")) as worker:
            os.kill(worker.pid, signal.SIGKILL)
            code = await worker.wait()
            with pytest.raises(WorkerGoneError, match="worker for m is gone"):
                await worker.generate(request_for("completion", SHORT))
            worker.cancel("anything")  # a gone worker has stopped everything already
            return code, await worker.shutdown()

    assert run(scenario()) == (-9, -9)


def test_a_request_in_flight_when_its_worker_dies_is_a_worker_error_not_worker_gone(
    configs: Configs,
) -> None:
    """Part of it may have run, so it must not be sent again."""

    async def scenario() -> BaseException | None:
        async with spawned(configs("m")) as worker:
            chunks = FirstChunk()
            decoding = asyncio.create_task(
                worker.generate(request_for("completion", LONG), on_chunk=chunks)
            )
            await chunks.came.wait()
            os.kill(worker.pid, signal.SIGKILL)
            await asyncio.wait([decoding])
            return decoding.exception()

    error = run(scenario())
    assert type(error) is WorkerError
    assert "exited during" in str(error)


def test_a_worker_the_daemon_kills_for_a_reason_tells_its_requests_why(configs: Configs) -> None:
    async def scenario() -> tuple[int, BaseException | None, str]:
        async with spawned(configs("m")) as worker:
            chunks = FirstChunk()
            decoding = asyncio.create_task(
                worker.generate(request_for("completion", LONG), on_chunk=chunks)
            )
            await chunks.came.wait()
            worker.kill_for("killed: it held the GPU and showed no sign of life")
            worker.kill_for("a second reason is not taken")
            code = await worker.wait()
            await asyncio.wait([decoding])
            return code, decoding.exception(), worker.killed_for

    code, error, reason = run(scenario())
    assert code == -9
    assert type(error) is WorkerError
    assert re.fullmatch(
        r"worker for m exited during a request: killed: it held the GPU and showed no sign of life",
        str(error),
    )
    assert reason == "killed: it held the GPU and showed no sign of life"


def test_a_stopped_worker_is_asked_status_once_and_its_answer_comes_when_it_resumes(
    configs: Configs,
) -> None:
    async def scenario() -> None:
        async with spawned(configs("m")) as worker:
            before = await worker.status()
            assert worker.heard.status is before
            stop(worker.pid)
            try:
                asked = worker.ask()
                for _ in range(3):  # each caller waits for the one question in flight
                    with pytest.raises(WorkerError, match=r"no answer from m to status in 0\.2 s"):
                        await worker.status(timeout_s=0.2)
                    assert worker.ask() is asked
                heard = worker.heard
                assert heard.status is before  # what it said last, for a stale status
                assert heard.asked_at is not None
                assert heard.asked_at > heard.answered_at
            finally:
                os.kill(worker.pid, signal.SIGCONT)
            after = await asked
            assert (worker.heard.status, worker.heard.asked_at) == (after, None)
            assert worker.ask() is not asked  # answered: the next caller asks anew

    run(scenario())


def test_kill_and_wait_say_the_signal_and_shutdown_a_clean_exit(configs: Configs) -> None:
    async def scenario() -> tuple[int, int, int, int]:
        async with spawned(configs("a")) as a, spawned(configs("b")) as b:
            killed = await a.kill()
            waited = await a.wait()
            stopped = await b.shutdown()
            return killed, waited, stopped, await b.kill()  # already gone: only its code

    assert run(scenario()) == (-9, -9, 0, 0)


@pytest.fixture
def threaded_child_watcher() -> Iterator[None]:
    """Python 3.11's default child watcher (a waiting thread per child), as a daemon starts
    with; the watcher the test found is put back after it."""
    if sys.version_info >= (3, 12):  # its loops watch children through pidfds themselves
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        found = asyncio.get_event_loop_policy().get_child_watcher()
        asyncio.set_child_watcher(asyncio.ThreadedChildWatcher())
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.set_child_watcher(found)


@pytest.mark.usefixtures("threaded_child_watcher")
def test_workers_on_one_loop_start_no_thread_in_the_daemons_process(configs: Configs) -> None:
    async def scenario() -> tuple[list[str], list[int]]:
        before = set(threading.enumerate())
        async with spawned(configs("a")) as a, spawned(configs("b")) as b:
            await asyncio.gather(a.status(), b.status())
            started = [t.name for t in set(threading.enumerate()) - before]
            codes = [await a.shutdown(), await b.shutdown()]
        return started, codes

    started, codes = run(scenario())
    assert started == []
    assert codes == [0, 0]


def test_a_blocking_worker_serves_plain_threads(configs: Configs) -> None:
    worker = BlockingWorker.spawn(configs("m"))
    try:
        assert worker.hello is not None
        assert worker.hello.pid == worker.pid
        warm = worker.wait_event(lambda e: e.get("to") == "warm")
        assert warm["model"] == "m"
        result = worker.generate(request_for("completion", SHORT))
        assert result["completion_tokens"] == 4
        assert worker.status()["state"] == "warm"
        assert worker.returncode is None
    finally:
        code = worker.shutdown()
    assert code == 0
    assert worker.kill() == 0  # its loop is closed: the code it exited with


def test_a_blocking_worker_wait_times_out_as_a_worker_error(configs: Configs) -> None:
    worker = BlockingWorker.spawn(configs("m"), keep_events=False)
    try:
        with pytest.raises(WorkerError, match=r"still runs after 0\.01 s"):
            worker.wait(0.01)
        assert worker.events.empty()
    finally:
        assert worker.kill() == -9
