"""The lifecycle of model slots: start, restart with backoff, permanent failures, retire, stop.

Real tiny-model workers where a worker must run; a patched `WorkerClient.spawn` where the test
is about a spawn that fails."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from arbiterd.config import HostCopyMode
from arbiterd.daemon.models import lifecycle
from arbiterd.daemon.models.budgets import PromptCache
from arbiterd.daemon.models.lifecycle import Lifecycle
from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.workerclient import WorkerClient
from arbiterd.daemon.models.workerport import WorkerPort
from arbiterd.errors import ConfigError, ControlError, ProtocolError, WorkerError
from arbiterd.events import Event, PromptCacheEvictEvent, UnloadEvent, WorkerEvent
from arbiterd.hostcopy import Lease
from arbiterd.spec import Residency
from arbiterd.states import SlotState, UnloadReason
from tests.support.models import model_config
from tests.support.pagecache import drop_page_cache
from tests.support.requests import request_for
from tests.support.waiting import to_first_wait

_T = TypeVar("_T")

REAL_SPAWN = WorkerClient.spawn


class Harness:
    """A Lifecycle and what it told the daemon: events, ready slots, gone workers."""

    def __init__(self, arena: Path, model: Path) -> None:
        self.model = model
        self.published: asyncio.Queue[Event] = asyncio.Queue()
        self.readied: asyncio.Queue[tuple[Slot, int]] = asyncio.Queue()  # the slot, its pid
        self.gone: list[tuple[str, int]] = []
        self.worker_events: list[dict[str, Any]] = []
        self.order: list[tuple[str, int]] = []  # ("ready" | "gone", pid), as they came
        self.lifecycle = Lifecycle(
            arena,
            publish=self.published.put_nowait,
            on_worker_event=lambda slot, event: self.worker_events.append(event),
            on_ready=self.on_ready,
            on_gone=self.on_gone,
            kv_dir=arena.parent / "prompt-cache",
        )

    def on_ready(self, slot: Slot) -> None:
        assert slot.worker is not None  # on_ready comes once the slot has its worker
        self.readied.put_nowait((slot, slot.worker.pid))
        self.order.append(("ready", slot.worker.pid))

    def on_gone(self, slot: Slot, worker: WorkerPort) -> None:
        self.gone.append((slot.name, worker.pid))
        self.order.append(("gone", worker.pid))

    def slot(self, name: str = "m") -> Slot:
        return Slot(model_config(name, self.model, n_ctx=512))

    def published_now(self) -> list[Event]:
        events = []
        while not self.published.empty():
            events.append(self.published.get_nowait())
        return events


def run(scenario: Coroutine[Any, Any, _T]) -> _T:
    async def bounded() -> _T:
        async with asyncio.timeout(60):
            return await scenario

    return asyncio.run(bounded())


@pytest.fixture
def harness(tmp_path: Path, tiny_model: Path) -> Harness:
    return Harness(tmp_path / "arena", tiny_model)


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> tuple[float, ...]:
    backoff = (0.01, 0.02, 0.04)
    monkeypatch.setattr(lifecycle, "RESTART_BACKOFF_S", backoff)
    return backoff


def failing_spawns(monkeypatch: pytest.MonkeyPatch, *failures: BaseException) -> list[str]:
    """Make the next spawns raise `failures` in turn, then spawn real workers; returns the
    names of the models each spawn was asked for."""
    asked: list[str] = []
    left = iter(failures)

    async def spawn(config: Any, **kwargs: Any) -> WorkerClient:
        asked.append(config.spec.name)
        for exc in left:
            raise exc
        return await REAL_SPAWN(config, **kwargs)

    monkeypatch.setattr(WorkerClient, "spawn", spawn)
    return asked


def test_a_started_slot_is_ready_with_its_worker_and_the_daemon_is_told(
    harness: Harness,
) -> None:
    async def scenario() -> tuple[Slot, int, int, list[Event]]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        readied, pid = harness.readied.get_nowait()  # before start returned
        assert readied is slot
        assert slot.worker is not None
        worker = slot.worker
        await harness.lifecycle.stop([slot])
        assert worker.returncode is not None
        return slot, pid, worker.returncode, harness.published_now()

    slot, pid, code, published = run(scenario())
    assert slot.hello is None  # the supervisor's on_ready keeps it; the lifecycle does not
    assert pid > 0
    assert code == 0  # stopped, not killed
    assert slot.state is SlotState.STOPPED
    assert published == []  # a stop is no crash
    assert slot.copy_lease is None  # its host copy went with it


def test_a_ready_slots_worker_loads_and_says_so(harness: Harness) -> None:
    async def scenario() -> tuple[str | None, list[dict[str, Any]]]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        residency = slot.residency  # what the slot shows until the worker reports
        assert slot.worker is not None
        await slot.worker.request("warm")
        await harness.lifecycle.stop([slot])
        return residency, harness.worker_events

    residency, events = run(scenario())
    assert residency == "loading"
    assert ("loading", "warm") in [(e.get("from"), e.get("to")) for e in events]


def test_the_worker_is_told_whether_its_model_serves_embeddings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_embedding_model: Path
) -> None:
    told: list[bool] = []

    async def spawn(config: Any, **kwargs: Any) -> WorkerClient:
        told.append(config.spec.embedding)
        return await REAL_SPAWN(config, **kwargs)

    monkeypatch.setattr(WorkerClient, "spawn", spawn)
    harness = Harness(tmp_path / "arena", tiny_embedding_model)

    async def scenario() -> tuple[bool, bool]:
        detected = harness.slot("detected")  # its GGUF names a pooling type
        overridden = Slot(
            model_config("overridden", tiny_embedding_model, n_ctx=512, embedding=False)
        )
        for slot in (detected, overridden):
            await harness.lifecycle.start(slot)
        await harness.lifecycle.stop([detected, overridden])
        return detected.embedding, overridden.embedding

    assert run(scenario()) == (True, False)
    assert told == [True, False]


@pytest.mark.parametrize(
    "refusal",
    [
        ConfigError("models.m.mmproj: this engine cannot load an mmproj yet"),
        ProtocolError("worker speaks protocol 1, not 2"),
    ],
)
def test_a_spawn_refused_for_good_fails_the_slot_with_its_reason_and_is_not_retried(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, refusal: Exception
) -> None:
    asked = failing_spawns(monkeypatch, refusal)

    async def scenario() -> tuple[Slot, list[Event]]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        assert slot.restart_task is None  # nothing scheduled: a retry is all restart tasks do
        await harness.lifecycle.stop([slot])
        return slot, harness.published_now()

    slot, published = run(scenario())
    reason = f"could not start: {refusal}"
    assert slot.last_error == reason
    assert published == [WorkerEvent(model="m", reason=reason)]  # no restart_in_s
    assert asked == ["m"]
    assert harness.readied.empty()


def test_a_failed_slot_shows_failed_until_stopped(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_spawns(monkeypatch, ConfigError("models.m.path: expected a file"))

    async def scenario() -> tuple[SlotState, str, SlotState]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        failed = (slot.state, slot.shown_state)
        await harness.lifecycle.stop([slot])
        return failed[0], failed[1], slot.state

    assert run(scenario()) == (SlotState.FAILED, "failed", SlotState.STOPPED)


def test_a_spawn_that_fails_for_now_is_said_and_retried_after_backing_off(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, quick_backoff: tuple[float, ...]
) -> None:
    asked = failing_spawns(
        monkeypatch,
        OSError(errno.EMFILE, "Too many open files"),
        WorkerError("worker for m did not say hello"),
    )

    async def scenario() -> tuple[Slot, list[Event], SlotState]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        state_after_failure = slot.state
        readied, _ = await harness.readied.get()  # the second retry spawns a real worker
        assert readied is slot
        published = harness.published_now()
        await harness.lifecycle.stop([slot])
        return slot, published, state_after_failure

    slot, published, state_after_failure = run(scenario())
    assert state_after_failure is SlotState.RESTARTING
    assert published == [
        WorkerEvent(
            model="m",
            reason="could not start: EMFILE: Too many open files",
            restart_in_s=quick_backoff[0],
        ),
        WorkerEvent(
            model="m",
            reason="could not start: worker for m did not say hello",
            restart_in_s=quick_backoff[1],  # one step further back
        ),
    ]
    assert asked == ["m", "m", "m"]
    assert slot.restarts == 2
    assert slot.last_error == "could not start: worker for m did not say hello"


def test_a_killed_worker_is_said_and_replaced_by_a_new_one(
    harness: Harness, quick_backoff: tuple[float, ...]
) -> None:
    async def scenario() -> tuple[int, int, Event, Slot]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        _, first = harness.readied.get_nowait()
        os.kill(first, signal.SIGKILL)
        said = await harness.published.get()
        _, second = await harness.readied.get()
        await harness.lifecycle.stop([slot])
        return first, second, said, slot

    first, second, said, slot = run(scenario())
    assert second != first
    assert isinstance(said, WorkerEvent)
    assert said == WorkerEvent(
        at=said.at,
        model="m",
        pid=first,
        code=-9,
        reason="killed by signal 9",
        # It lived less than STABLE_UPTIME_S: one more failure in a row, one step back.
        restart_in_s=quick_backoff[1],
        last_words=said.last_words,  # whatever it wrote last: a SIGKILL leaves no message
    )
    assert slot.restarts == 1
    assert harness.gone == [("m", first), ("m", second)]  # the crash, then the stop


def test_a_retired_slot_stops_its_worker_and_never_restarts(harness: Harness) -> None:
    async def scenario() -> tuple[Slot, int | None, list[Event]]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        worker = slot.worker
        assert worker is not None
        await harness.lifecycle.retire(slot)
        assert slot.restart_task is None
        published = harness.published_now()
        await harness.lifecycle.stop([])
        return slot, worker.returncode, published

    slot, code, published = run(scenario())
    assert (slot.state, slot.worker, code) == (SlotState.STOPPED, None, 0)
    assert published == []
    assert slot.copy_lease is None
    assert len(harness.gone) == 1


def test_a_slot_that_replaces_another_spawns_its_worker_once_the_old_one_has_exited(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_exit_codes: list[int | None] = []  # the old worker's, as each later spawn is asked

    async def scenario() -> tuple[Slot, Slot]:
        old = harness.slot()
        await harness.lifecycle.start(old)
        old_worker = old.worker
        assert old_worker is not None

        async def spawn(config: Any, **kwargs: Any) -> WorkerClient:
            old_exit_codes.append(old_worker.returncode)
            return await REAL_SPAWN(config, **kwargs)

        monkeypatch.setattr(WorkerClient, "spawn", spawn)
        new = harness.slot()  # what a reload that changed the model's settings makes
        retiring = asyncio.create_task(harness.lifecycle.retire(old))
        new.replacing(retiring)
        await harness.lifecycle.start(new)
        await harness.lifecycle.stop([new])
        return old, new

    old, new = run(scenario())
    # One worker of a model at a time: the new one is spawned once the old one has exited.
    assert old_exit_codes == [0]
    assert (old.state, new.state) == (SlotState.STOPPED, SlotState.STOPPED)


def test_retiring_a_slot_that_waits_to_restart_cancels_the_restart(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "RESTART_BACKOFF_S", (3600.0,))
    asked = failing_spawns(monkeypatch, OSError(errno.ENOMEM, "Cannot allocate memory"))

    async def scenario() -> tuple[Slot, bool]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        restart = slot.restart_task
        assert restart is not None
        await harness.lifecycle.retire(slot)
        await asyncio.wait([restart])
        return slot, restart.cancelled()

    slot, cancelled = run(scenario())
    assert (slot.state, cancelled, asked) == (SlotState.STOPPED, True, ["m"])


def test_stop_ends_every_worker_and_nothing_restarts_after_it(harness: Harness) -> None:
    async def scenario() -> tuple[list[Slot], list[int | None], list[Event]]:
        slots = [harness.slot("a"), harness.slot("b")]
        await asyncio.gather(*(harness.lifecycle.start(slot) for slot in slots))
        workers = [slot.worker for slot in slots]
        await harness.lifecycle.stop(slots)
        assert [slot.restart_task for slot in slots] == [None, None]
        return slots, [w.returncode if w else None for w in workers], harness.published_now()

    slots, codes, published = run(scenario())
    assert [slot.state for slot in slots] == [SlotState.STOPPED] * 2
    assert codes == [0, 0]
    assert published == []
    assert harness.lifecycle.host_copies.total_bytes() == 0


def test_two_slots_on_one_file_share_its_host_copy(harness: Harness) -> None:
    async def scenario() -> tuple[int, int, int]:
        a, b = harness.slot("a"), harness.slot("b")
        copy_a = await harness.lifecycle.hold_copy(a)
        copy_b = await harness.lifecycle.hold_copy(b)
        assert copy_a is copy_b
        both = harness.lifecycle.host_copies.total_bytes()
        harness.lifecycle.drop_copy(a)
        one = harness.lifecycle.host_copies.total_bytes()
        harness.lifecycle.drop_copy(b)
        await harness.lifecycle.stop([])
        return both, one, harness.lifecycle.host_copies.total_bytes()

    both, one, none = run(scenario())
    assert both == one == harness.model.stat().st_size
    assert none == 0


@pytest.mark.parametrize(
    "failure",
    [ConfigError("models.m: refused"), OSError(errno.EMFILE, "Too many open files")],
    ids=["permanent", "transient"],
)
def test_a_spawn_that_fails_after_its_slot_was_retired_leaves_it_stopped(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """A reload removed the model (or the daemon stops) while its worker was being spawned."""
    spawning, fail = asyncio.Event(), asyncio.Event()

    async def spawn(config: Any, **kwargs: Any) -> WorkerClient:
        spawning.set()
        await fail.wait()
        raise failure

    monkeypatch.setattr(WorkerClient, "spawn", spawn)

    async def scenario() -> tuple[Slot, list[Event]]:
        slot = harness.slot()
        starting = asyncio.create_task(harness.lifecycle.start(slot))
        await spawning.wait()
        await harness.lifecycle.retire(slot)
        fail.set()
        await starting  # returns: a retired slot is no error
        return slot, harness.published_now()

    slot, published = run(scenario())
    assert (slot.state, slot.restart_task) == (SlotState.STOPPED, None)
    assert published == []


def test_a_worker_that_says_hello_after_its_slot_was_retired_is_shut_down(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, hello = asyncio.Event(), asyncio.Event()
    spawned: list[WorkerClient] = []

    async def spawn(config: Any, **kwargs: Any) -> WorkerClient:
        worker = await REAL_SPAWN(config, **kwargs)
        spawned.append(worker)
        started.set()
        await hello.wait()  # as if its hello were late
        return worker

    monkeypatch.setattr(WorkerClient, "spawn", spawn)

    async def scenario() -> tuple[Slot, int | None, int]:
        slot = harness.slot()
        starting = asyncio.create_task(harness.lifecycle.start(slot))
        await started.wait()
        await harness.lifecycle.retire(slot)
        hello.set()
        await starting
        return slot, spawned[0].returncode, harness.lifecycle.host_copies.total_bytes()

    slot, code, copies = run(scenario())
    assert (slot.state, slot.worker, code) == (SlotState.STOPPED, None, 0)
    assert harness.readied.empty()
    assert (slot.copy_lease, copies) == (None, 0)


def test_a_slot_retired_while_its_model_file_is_copied_spawns_nothing_and_keeps_no_copy(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copying a large model file into memory takes seconds: a reload may remove the model
    meanwhile. The copy must not stay in memory for a model that is gone."""
    asked = failing_spawns(monkeypatch)
    copying, copied = threading.Event(), threading.Event()
    acquire = harness.lifecycle.host_copies.acquire

    def slow_acquire(path: Path, model: str) -> Lease:
        copying.set()
        copied.wait(30)
        return acquire(path, model)

    monkeypatch.setattr(harness.lifecycle.host_copies, "acquire", slow_acquire)

    async def scenario() -> tuple[Slot, int]:
        slot = harness.slot()
        starting = asyncio.create_task(harness.lifecycle.start(slot))
        assert await asyncio.to_thread(copying.wait, 30)
        await harness.lifecycle.retire(slot)
        copied.set()
        await starting
        return slot, harness.lifecycle.host_copies.total_bytes()

    slot, copies = run(scenario())
    assert (slot.state, slot.copy_lease, copies) == (SlotState.STOPPED, None, 0)
    assert asked == []


def test_an_unloaded_slot_keeps_nothing_and_its_next_worker_starts_after_the_last_exited(
    harness: Harness,
) -> None:
    async def scenario() -> tuple[Slot, int, int, dict[str, Any], list[Event]]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        _, first = harness.readied.get_nowait()
        # The unload begins at once, before its first wait (lifecycle.py).
        unloading = await to_first_wait(harness.lifecycle.unload(slot, UnloadReason.COMMAND))
        assert (slot.state, slot.worker) == (SlotState.UNLOADING, None)
        loading = asyncio.create_task(harness.lifecycle.load(slot))  # a request came
        saved = await unloading
        await loading
        _, second = harness.readied.get_nowait()
        published = harness.published_now()
        await harness.lifecycle.stop([slot])
        return slot, first, second, saved, published

    slot, first, second, saved, published = run(scenario())
    assert second != first
    # The next worker reads what the last one writes: it starts once that one is gone.
    assert harness.order[:3] == [("ready", first), ("gone", first), ("ready", second)]
    assert saved == {"kv_file": None, "kv_bytes": 0, "tokens": 0, "error": ""}  # nothing ran
    assert published == [
        UnloadEvent(
            at=None, model="m", pid=first, reason=UnloadReason.COMMAND, kv_bytes=0, tokens=0
        )
    ]
    assert slot.state is SlotState.STOPPED


def test_unloading_a_slot_that_waits_to_restart_cancels_the_restart(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "RESTART_BACKOFF_S", (3600.0,))
    asked = failing_spawns(monkeypatch, OSError(errno.ENOMEM, "Cannot allocate memory"))

    async def scenario() -> tuple[Slot, bool, list[Event]]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        restart = slot.restart_task
        assert restart is not None
        harness.published_now()  # the failed spawn's
        await harness.lifecycle.unload(slot, UnloadReason.IDLE)
        await asyncio.wait([restart])
        published = harness.published_now()
        await harness.lifecycle.stop([slot])
        return slot, restart.cancelled(), published

    slot, cancelled, published = run(scenario())
    assert (cancelled, asked) == (True, ["m"])
    assert [(e.kind, getattr(e, "reason", "")) for e in published] == [("unload", "idle")]
    assert slot.copy_lease is None


def test_a_starting_slot_cannot_be_unloaded(harness: Harness) -> None:
    async def scenario() -> None:
        with pytest.raises(ControlError, match="starting"):
            await harness.lifecycle.unload(harness.slot(), UnloadReason.COMMAND)

    run(scenario())


# -- issue 14: host_copy = "page-cache", the prompt-cache budget ---------------------------------

PROMPT = {"prompt": "the fox is not a dog " * 20, "max_tokens": 2, "temperature": 0}


def moves(events: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The worker's residency events by (from, to): the last of each."""
    return {(e["from"], e["to"]): e for e in events if e.get("event") == "residency"}


def test_a_page_cache_slot_holds_no_copy_and_its_reads_from_disk_are_reported(
    harness: Harness, tmp_path: Path
) -> None:
    model = tmp_path / "own.gguf"  # a file of its own: its page cache is this test's to drop
    model.write_bytes(harness.model.read_bytes())

    async def scenario() -> tuple[Slot, int]:
        slot = Slot(
            model_config(
                "m", model, n_ctx=512, host_copy=HostCopyMode.PAGE_CACHE, residency=Residency.RELOAD
            )
        )
        drop_page_cache(model)
        await harness.lifecycle.start(slot)
        assert slot.worker is not None
        await slot.worker.request("warm")
        await slot.worker.request("release")
        drop_page_cache(model)  # what the kernel may do to a cold model's file under pressure
        await slot.worker.request("warm")
        copies = harness.lifecycle.host_copies.total_bytes()
        await harness.lifecycle.stop([slot])
        return slot, copies

    slot, copies = run(scenario())
    assert (slot.copy_lease, copies) == (None, 0)
    moved = moves(harness.worker_events)
    # The worker read the file itself: at load, and again at the restore after the eviction.
    assert moved[("loading", "warm")]["disk_read_bytes"] > 0
    assert moved[("warming", "warm")]["disk_read_bytes"] > 0


def test_a_memfd_slot_restores_without_reading_the_disk(harness: Harness) -> None:
    async def scenario() -> None:
        slot = Slot(model_config("m", harness.model, n_ctx=512, residency=Residency.RELOAD))
        await harness.lifecycle.start(slot)
        assert slot.worker is not None
        await slot.worker.request("warm")
        await slot.worker.request("release")
        drop_page_cache(harness.model)
        await slot.worker.request("warm")
        await harness.lifecycle.stop([slot])

    run(scenario())
    assert moves(harness.worker_events)[("warming", "warm")]["disk_read_bytes"] == 0


def test_a_page_cache_model_whose_file_is_gone_cannot_start_and_says_why(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "RESTART_BACKOFF_S", (3600.0,))
    gone = tmp_path / "gone.gguf"

    async def scenario() -> tuple[Slot, list[Event]]:
        slot = Slot(model_config("m", gone, n_ctx=512, host_copy=HostCopyMode.PAGE_CACHE))
        await harness.lifecycle.start(slot)
        published = harness.published_now()
        await harness.lifecycle.stop([slot])
        return slot, published

    slot, published = run(scenario())
    assert slot.state is SlotState.STOPPED
    reason = f'model file not found: {gone}; with host_copy = "page-cache" no copy of it is kept'
    assert reason in slot.last_error
    assert "m cannot start until the file is back" in slot.last_error
    assert [type(e) for e in published] == [WorkerEvent]
    assert reason in (getattr(published[0], "reason", "") or "")


def write_state(folder: Path, model: str, size: int, mtime_s: int) -> Path:
    folder.mkdir(mode=0o700, exist_ok=True)  # as the daemon makes it: a loose one is refused
    path = folder / f"{model}.kv"
    path.write_bytes(b"\0" * size)
    os.utime(path, (mtime_s, mtime_s))
    return path


def unload_with_cache(
    harness: Harness, budget_bytes: int, *, release: bool = True
) -> tuple[dict[str, Any], list[Event]]:
    """Start "m", run a prompt, release it (its KV goes to the host, so its size is known
    before the save) unless not `release`, unload it under a prompt-cache budget of
    `budget_bytes`; returns the unload's reply and the events."""
    harness.lifecycle.prompt_cache = PromptCache(
        harness.lifecycle.prompt_cache.folder if harness.lifecycle.prompt_cache else Path(),
        budget_bytes,
    )

    async def scenario() -> tuple[dict[str, Any], list[Event]]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        assert slot.worker is not None
        await slot.worker.generate(request_for("completion", PROMPT))
        if release:
            await slot.worker.request("release")
        harness.published_now()
        saved = await harness.lifecycle.unload(slot, UnloadReason.COMMAND)
        published = harness.published_now()
        await harness.lifecycle.stop([slot])
        return saved, published

    return run(scenario())


def test_saving_a_prompt_cache_evicts_the_oldest_files_and_says_which(harness: Harness) -> None:
    cache = harness.lifecycle.prompt_cache
    assert cache is not None
    write_state(cache.folder, "oldest", 1 << 20, 1_000)
    write_state(cache.folder, "newer", 1 << 20, 2_000)

    saved, published = unload_with_cache(harness, budget_bytes=(1 << 20) + (512 << 10))

    kv_bytes = saved["kv_bytes"]
    assert 0 < kv_bytes < 512 << 10  # the tiny model's few hundred tokens
    assert saved["error"] == ""
    assert sorted(p.name for p in cache.folder.glob("*.kv")) == ["m.kv", "newer.kv"]
    evictions = [e for e in published if isinstance(e, PromptCacheEvictEvent)]
    # Before the save: a cold model's KV size is known, so the room is made first.
    assert evictions == [
        PromptCacheEvictEvent(
            model="m",
            evicted=("oldest",),
            evicted_bytes=1 << 20,
            used_bytes=1 << 20,
            budget_bytes=(1 << 20) + (512 << 10),
        )
    ]
    unloads = [e for e in published if isinstance(e, UnloadEvent)]
    assert [(u.kv_bytes, u.error) for u in unloads] == [(kv_bytes, "")]


@pytest.mark.parametrize("release", [True, False], ids=["cold", "warm"])
def test_a_prompt_cache_larger_than_the_whole_budget_is_not_kept_and_the_unload_says_why(
    harness: Harness, release: bool
) -> None:
    # Cold: its size is known and nothing is written; warm: it is written, then removed.
    cache = harness.lifecycle.prompt_cache
    assert cache is not None
    write_state(cache.folder, "other", 100, 1_000)

    saved, published = unload_with_cache(harness, budget_bytes=1000, release=release)

    assert saved["kv_file"] is None
    assert "is larger than the whole prompt_cache_budget (1000 bytes): not kept" in saved["error"]
    assert sorted(p.name for p in cache.folder.glob("*.kv")) == ["other.kv"]  # left alone
    unloads = [e for e in published if isinstance(e, UnloadEvent)]
    assert len(unloads) == 1
    assert "prompt_cache_budget" in unloads[0].error
    assert not [e for e in published if isinstance(e, PromptCacheEvictEvent)]


def test_forgetting_a_model_removes_its_prompt_cache(harness: Harness) -> None:
    cache = harness.lifecycle.prompt_cache
    assert cache is not None
    kept = write_state(cache.folder, "kept", 10, 1_000)
    removed = write_state(cache.folder, "removed", 10, 1_000)

    run(harness.lifecycle.forget_prompt_cache("removed"))

    assert kept.exists()
    assert not removed.exists()


# -- a model file gone from disk (issue 24) ------------------------------------------------------


def test_a_page_cache_model_whose_file_is_gone_is_not_unloaded(
    harness: Harness, tmp_path: Path
) -> None:
    path = tmp_path / "copy.gguf"
    shutil.copyfile(harness.model, path)

    async def scenario() -> tuple[SlotState, str]:
        slot = Slot(model_config("m", path, n_ctx=512, host_copy=HostCopyMode.PAGE_CACHE))
        await harness.lifecycle.start(slot)
        path.unlink()
        try:
            with pytest.raises(ControlError) as refused:
                await harness.lifecycle.unload(slot, UnloadReason.COMMAND)
            return slot.state, str(refused.value)
        finally:
            await harness.lifecycle.stop([slot])

    state, refusal = run(scenario())
    assert state is SlotState.READY  # left serving
    assert f"m's model file {path} is gone from disk" in refusal
    assert "the only copy of it (what its worker mapped)" in refusal
    assert "remove the model from the config and reload to let it go" in refusal


def test_a_model_whose_copy_another_model_keeps_is_unloaded_though_its_file_is_gone(
    harness: Harness, tmp_path: Path
) -> None:
    path = tmp_path / "copy.gguf"
    shutil.copyfile(harness.model, path)

    async def scenario() -> tuple[SlotState, SlotState]:
        first, second = (Slot(model_config(n, path, n_ctx=512)) for n in ("a", "b"))
        await harness.lifecycle.start(first)
        await harness.lifecycle.start(second)
        path.unlink()
        try:
            await harness.lifecycle.unload(first, UnloadReason.COMMAND)
            refused = harness.lifecycle.unload_refusal(second)  # now the last to hold it
            assert f"b's model file {path} is gone from disk" in refused
            await harness.lifecycle.load(first)  # from the copy b keeps
            return first.state, second.state
        finally:
            await harness.lifecycle.stop([first, second])

    assert run(scenario()) == (SlotState.READY, SlotState.READY)


def test_a_start_that_misses_the_file_marks_it_and_the_start_that_finds_it_clears_the_note(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "RESTART_BACKOFF_S", (3600.0,))
    path = tmp_path / "copy.gguf"

    async def scenario() -> tuple[Path | None, str, SlotState, Path | None, str]:
        slot = Slot(model_config("m", path, n_ctx=512), state=SlotState.UNLOADED)
        await harness.lifecycle.load(slot)
        missing, note = slot.missing_file, slot.last_error
        await harness.lifecycle.load(slot)  # still gone: nothing is tried
        shutil.copyfile(harness.model, path)
        await harness.lifecycle.load(slot)  # back: started now, not after the hour's backoff
        try:
            return missing, note, slot.state, slot.missing_file, slot.last_error
        finally:
            await harness.lifecycle.stop([slot])

    missing, note, state, after, after_note = run(scenario())
    assert missing == path
    assert note == f"could not start: model file not found: {path}"
    assert (state, after, after_note) == (SlotState.READY, None, "")
    # One failed start said (the second load tried nothing), then none.
    starts = [e for e in harness.published_now() if isinstance(e, WorkerEvent)]
    assert len(starts) == 1


def test_a_prompt_cache_folder_made_loose_after_start_gets_no_cache(harness: Harness) -> None:
    cache = harness.lifecycle.prompt_cache
    assert cache is not None

    async def scenario() -> dict[str, Any]:
        slot = harness.slot()
        await harness.lifecycle.start(slot)
        assert slot.worker is not None
        await slot.worker.generate(request_for("completion", PROMPT))
        cache.make_private()
        cache.folder.chmod(0o755)
        try:
            return await harness.lifecycle.unload(slot, UnloadReason.COMMAND)
        finally:
            await harness.lifecycle.stop([slot])

    saved = run(scenario())
    assert saved["kv_file"] is None
    assert f"{cache.folder} has mode 0755; it must be 0700" in saved["error"]
    assert list(cache.folder.iterdir()) == []  # the worker was not asked to write one


# -- the worker's environment --------------------------------------------------------------------

NO_NODES: tuple[str, ...] = ()


def test_a_worker_on_a_machine_without_a_gpu_is_told_to_load_no_vulkan_driver() -> None:
    env = lifecycle.worker_env({"HOME": "/h", "NOTIFY_SOCKET": "/run/n"}, NO_NODES)
    assert env == {"HOME": "/h", "VK_LOADER_DRIVERS_DISABLE": "*", "GGML_NO_BACKTRACE": "1"}


@pytest.mark.parametrize(
    ("base", "nodes"),
    [
        ({}, ("/dev/dri/renderD128",)),  # a GPU: its driver is what the engine uses
        ({"GGML_VK_VISIBLE_DEVICES": "0"}, NO_NODES),  # llvmpipe named: the device tier
        ({"VK_ICD_FILENAMES": "/x.json"}, NO_NODES),  # the user's own choice of driver
        ({"VK_LOADER_DRIVERS_SELECT": "*lvp*"}, NO_NODES),
    ],
)
def test_the_vulkan_drivers_are_left_alone_where_they_can_matter(
    base: dict[str, str], nodes: tuple[str, ...]
) -> None:
    assert lifecycle.worker_env(base, nodes) == {**base, "GGML_NO_BACKTRACE": "1"}


def test_a_worker_is_told_which_servers_it_offers_weights_by_hash_and_only_those() -> None:
    gpu = ("/dev/dri/renderD128",)
    env = lifecycle.worker_env({}, gpu, ("10.0.0.5:50052", "box.lan:50053"))
    assert env["ARBITERD_RPC_HASH_UPLOADS"] == "10.0.0.5:50052,box.lan:50053"
    # The daemon's own environment never decides it: only the config does.
    inherited = {"ARBITERD_RPC_HASH_UPLOADS": "10.0.0.9:1"}
    assert "ARBITERD_RPC_HASH_UPLOADS" not in lifecycle.worker_env(inherited, gpu)


def test_ggml_prints_no_backtrace_in_a_worker_and_a_users_value_is_kept() -> None:
    assert lifecycle.worker_env({}, ("/dev/dri/renderD128",))["GGML_NO_BACKTRACE"] == "1"
    asked = {"GGML_NO_BACKTRACE": "yes"}
    assert lifecycle.worker_env(asked, ("/dev/dri/renderD128",)) == asked


ENGINE_PROBE = """
import json
from pathlib import Path
from arbiterd.worker.engine import engine_info
devices = list(engine_info().devices)
maps = Path("/proc/self/maps").read_text()
print(json.dumps({"devices": devices, "llvm": "libLLVM" in maps or "libvulkan_lvp" in maps}))
"""


def test_without_its_drivers_the_engine_lists_the_same_devices_and_maps_no_llvm() -> None:
    # The CPU tier's view (GGML_VK_VISIBLE_DEVICES=""): no Vulkan device can be listed.
    base = {**os.environ, "GGML_VK_VISIBLE_DEVICES": ""}
    for key in lifecycle.VULKAN_DRIVER_KEYS:
        base.pop(key, None)
    probes = []
    for env in (base, lifecycle.worker_env(base, NO_NODES)):
        child = subprocess.run(
            [sys.executable, "-c", ENGINE_PROBE],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        probes.append(json.loads(child.stdout.splitlines()[-1]))
    assert probes[1]["devices"] == probes[0]["devices"]
    assert probes[1]["llvm"] is False
