"""The supervisor: one worker per configured model, and the daemon's `Service` (service.py).

Owns the worker processes (spawn, restart with backoff, graceful stop), the routing of requests
to them, the user's hold on the GPU ("game mode"), the VRAM telemetry (a sampler thread, and a
verified teardown after every release), and the event stream: every event from a worker or
from here is stamped, turned into handoffs, counted in the metrics, written to the journal and
fanned out to subscribers. It also keeps what each worker's hello says runs its model (the
residency backend, and what the engine can do), and says once per worker start when a model
asks for GPU layers an engine that cannot offload will not give (issue 15). Runs on the
daemon's asyncio loop; blocking calls to workers run in its own thread pool, and worker threads
reach the loop only through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from arbiterd.arena import Arena, Token
from arbiterd.config import Config, ModelConfig
from arbiterd.errors import (
    ArbiterError,
    ContextOverflowError,
    ControlError,
    EngineError,
    RequestError,
    UnknownModelError,
    WorkerError,
)
from arbiterd.hostcopy import HostCopies, HostCopy, Lease
from arbiterd.journal import Journal
from arbiterd.metrics import Metrics
from arbiterd.modelfile import check_models
from arbiterd.procs import holder_name, process_name
from arbiterd.service import MODEL_COMMANDS
from arbiterd.telemetry import (
    ColdFootprints,
    ReaderSet,
    Sampler,
    TeardownCheck,
    TeardownResult,
    TelemetrySnapshot,
    device_for_arena,
    select_readers,
)
from arbiterd.workerclient import (
    EngineReport,
    RemoteError,
    WorkerGoneError,
    WorkerHello,
    WorkerProcess,
)

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_UPTIME_S = 60.0  # a worker up this long has its backoff reset
READY_TIMEOUT_S = 120.0  # how long a request waits for its worker to (re)start
REQUEST_THREADS = 64  # each in-flight request waits on one
SUBSCRIBER_QUEUE = 1000
HANDOFF_WINDOW_S = 30.0  # a release this recent is the "from" of the next warm-up
COMMAND_TIMEOUT_S = 300.0
# Remote error kinds that mean "your request is wrong", not "the model is broken".
_REQUEST_ERRORS: dict[str, type[RequestError]] = {
    "ContextOverflowError": ContextOverflowError,
    "RequestError": RequestError,
}
_ENGINE_ERRORS = frozenset({"EngineError", "ModelLoadError", "RestoreError"})
# How to get an engine that offloads (scripts/setup.sh builds llama-cpp-python for it).
ENGINE_REBUILD_HINT = "rebuild it with ARBITERD_ENGINE=cuda|rocm|vulkan ./scripts/setup.sh"


def offload_warning(n_gpu_layers: int, engine: EngineReport) -> str:
    """What to tell the user about a model that asks for `n_gpu_layers` on `engine`: "" when
    the engine gives what is asked; else one line (llama.cpp then quietly runs every layer on
    the CPU, which looks like a very slow GPU)."""
    if n_gpu_layers == 0 or engine.offload:
        return ""
    return (
        f"asks for n_gpu_layers={n_gpu_layers} but this engine cannot offload to a GPU "
        f"(a CPU-only build, or no GPU it can use): it runs on the CPU; {ENGINE_REBUILD_HINT}"
    )


@dataclass
class _Slot:
    """One configured model. Mutated only on the event loop."""

    config: ModelConfig
    worker: WorkerProcess | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    state: str = "starting"
    pinned: bool = False
    restarts: int = 0
    failures_in_row: int = 0
    started_at: float = 0.0
    last_error: str = ""
    last_handoff: dict[str, Any] | None = None  # the last time it took the GPU from a model
    restart_task: asyncio.Task[None] | None = None
    copy_lease: Lease | None = None  # on the daemon's memfd of its model file; kept across restarts
    hello: WorkerHello | None = None  # its last worker's: what runs it; kept across restarts
    warning: str = ""  # offload_warning for that worker; "" when none


@dataclass
class _Release:
    model: str
    at: float
    release_s: float


class Supervisor:
    def __init__(
        self,
        config: Config,
        journal: Journal | None = None,
        reload_config: Callable[[], Config] | None = None,
        readers: ReaderSet | None = None,
    ) -> None:
        self.config = config
        self._reload_config = reload_config  # None: nothing to reload (embedded default)
        self.metrics = Metrics()
        self._journal = journal
        self._arena = Arena(config.daemon.arena)
        self._slots: dict[str, _Slot] = {}
        self._host_copies = HostCopies()
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._pool = ThreadPoolExecutor(REQUEST_THREADS, thread_name_prefix="supervisor")
        self._ids = itertools.count(1)
        self._last_release: _Release | None = None
        self._hold: Token | None = None
        self._stopping = False
        # Read by the sampler's thread: replaced whole on every change, never mutated.
        self._accounted: dict[int, int] = {}  # worker pid -> device bytes by its own account
        self._model_pids: dict[str, int] = {}
        self._engine: EngineReport | None = None  # as the latest worker's hello says
        self._device = device_for_arena(config.daemon.arena)
        self._readers = readers or select_readers(lambda: self._accounted)
        self._sampler = Sampler(
            self._readers,
            lambda snapshot: self._call_soon(self._on_snapshot, snapshot),
            model_pids=lambda: self._model_pids,
            interested=lambda: bool(self._subscribers),
        )
        self._teardown = TeardownCheck(self._readers)
        self._footprints = ColdFootprints(self._readers.context_allowance_bytes)
        self.stopped = asyncio.Event()  # set by the shutdown command; the daemon awaits it
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifetime -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for name, model in self.config.models.items():
            self._slots[name] = _Slot(model)
            self.metrics.add_model(name)
        await asyncio.gather(*(self._spawn(slot) for slot in self._slots.values()))
        log.info("VRAM telemetry: %s", self._readers.describe())
        self._sampler.start()

    async def stop(self) -> None:
        """Stop every worker (in-flight requests finish first) and release a user hold."""
        self._stopping = True
        self._teardown.cancel()
        self._sampler.stop()
        for slot in self._slots.values():
            if slot.restart_task is not None:
                slot.restart_task.cancel()
        workers = [s.worker for s in self._slots.values() if s.worker is not None]
        await asyncio.gather(*(self._run(w.shutdown) for w in workers))
        if self._hold is not None:
            self._hold.release()
            self._hold = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._readers.close()
        self._host_copies.close()

    async def _hold_copy(self, slot: _Slot) -> HostCopy:
        """The slot's host copy of its model file (shared with every slot on that file)."""
        if slot.copy_lease is None:
            slot.copy_lease = await self._run(
                self._host_copies.acquire, slot.config.path, slot.config.name
            )
        return slot.copy_lease.copy

    def _drop_copy(self, slot: _Slot) -> None:
        if slot.copy_lease is not None:
            self._host_copies.release(slot.copy_lease)
            slot.copy_lease = None

    async def _spawn(self, slot: _Slot) -> None:
        name = slot.config.name
        slot.state = "starting"
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        try:
            copy = await self._hold_copy(slot)
            worker = await self._run(
                WorkerProcess.spawn,
                slot.config.worker_config(self.config.daemon.arena, copy.fd),
                env=env,
                keep_events=False,
            )
        except (ArbiterError, OSError) as exc:
            # OSError: no fd for the socketpair (EMFILE), no memory to fork, ... — transient,
            # like a copy or a hello that failed; each is said and retried with backoff.
            reason = str(exc) if isinstance(exc, ArbiterError) else _os_reason(exc)
            slot.last_error = f"could not start: {reason}"
            delay = self._schedule_restart(slot)
            log.warning("%s could not start (%s); retrying in %.0f s", name, reason, delay)
            self._publish(
                {
                    "event": "worker",
                    "model": name,
                    "pid": None,
                    "code": None,
                    "reason": slot.last_error,
                    "restart_in_s": delay,
                }
            )
            return
        worker.add_listener(self._from_thread(self._on_worker_event))
        slot.worker, slot.started_at = worker, time.monotonic()
        assert worker.hello is not None  # spawn returns once the hello is read
        self._on_hello(slot, worker.hello)
        self._model_pids = {**self._model_pids, name: worker.pid}
        if slot.pinned:
            await self._run(worker.request, "pin")
        slot.ready.set()
        threading.Thread(
            target=self._watch, args=(slot, worker), name=f"watch-{name}", daemon=True
        ).start()

    def _on_hello(self, slot: _Slot, hello: WorkerHello) -> None:
        """Keep what runs the model, and say once per worker start what it will not get."""
        slot.hello = hello
        if hello.engine != self._engine:  # every worker loads the same llama.cpp: said once
            devices = ", ".join(hello.engine.devices) or "none listed"
            offload = "can" if hello.engine.offload else "cannot"
            log.info("engine: %s offload to a GPU; devices: %s", offload, devices)
        self._engine = hello.engine
        self.metrics.set_backend(slot.config.name, hello.backend)
        slot.warning = offload_warning(slot.config.n_gpu_layers, hello.engine)
        if slot.warning:
            log.warning("%s %s", slot.config.name, slot.warning)

    def _watch(self, slot: _Slot, worker: WorkerProcess) -> None:
        """Waits for the worker to exit (runs in its own thread)."""
        code = worker.process.wait()
        self._call_soon(self._on_worker_exit, slot, worker, code)

    def _on_worker_exit(self, slot: _Slot, worker: WorkerProcess, code: int) -> None:
        if slot.worker is not worker:
            return
        self._forget_worker(slot.config.name, worker.pid)
        slot.worker = None
        slot.ready.clear()
        slot.state = "stopped" if self._stopping else "restarting"
        if self._stopping:
            return
        uptime = time.monotonic() - slot.started_at
        slot.failures_in_row = 0 if uptime >= STABLE_UPTIME_S else slot.failures_in_row + 1
        delay = RESTART_BACKOFF_S[min(slot.failures_in_row, len(RESTART_BACKOFF_S) - 1)]
        reason = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        slot.last_error = f"worker {reason}"
        self._publish(
            {
                "event": "worker",
                "model": slot.config.name,
                "pid": worker.pid,
                "code": code,
                "reason": reason,
                "restart_in_s": delay,
            }
        )
        self._pool.submit(worker.kill)  # closes its socket; the process is already reaped
        self._schedule_restart(slot, delay)

    def _schedule_restart(self, slot: _Slot, delay_s: float | None = None) -> float:
        """Spawn the slot's worker again after `delay_s` (default: the next backoff step);
        returns the delay."""
        if delay_s is None:
            delay_s = RESTART_BACKOFF_S[min(slot.failures_in_row, len(RESTART_BACKOFF_S) - 1)]
            slot.failures_in_row += 1
        if self._stopping:
            return delay_s
        slot.state = "restarting"

        async def restart() -> None:
            await asyncio.sleep(delay_s)
            slot.restarts += 1
            await self._spawn(slot)

        slot.restart_task = asyncio.get_running_loop().create_task(restart())
        return delay_s

    # -- requests -----------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self.config.models)

    async def complete(self, model: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        request_id = self._request_id()
        worker = await self._worker_of(model)
        try:
            try:
                result = await self._run(worker.generate, kind, body, request_id=request_id)
            except WorkerGoneError:  # died before our request reached it: nothing ran, retry
                worker = await self._replacement(model, worker)
                result = await self._run(worker.generate, kind, body, request_id=request_id)
        except asyncio.CancelledError:  # the client went away: stop the decode
            _quietly(worker.cancel)(request_id)
            raise
        except RemoteError as exc:
            raise self._request_failed(model, request_id, exc) from None
        except WorkerError as exc:
            raise self._request_failed(model, request_id, exc) from None
        response: dict[str, Any] = result["response"]
        return response

    async def stream(
        self, model: str, kind: str, body: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        request_id = self._request_id()
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def on_chunk(chunk: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(items.put_nowait, ("chunk", chunk))

        def send(worker: WorkerProcess) -> asyncio.Future[Any]:
            future = loop.run_in_executor(
                self._pool,
                lambda: worker.generate(kind, body, on_chunk=on_chunk, request_id=request_id),
            )
            future.add_done_callback(lambda done: items.put_nowait(("done", done)))
            return future

        worker = await self._worker_of(model)
        future = send(worker)
        retried = False
        try:
            while True:
                what, item = await items.get()
                if what == "chunk":
                    yield item
                    continue
                try:
                    item.result()
                except WorkerGoneError:
                    if retried:
                        raise
                    retried = True  # died before our request reached it: nothing ran
                    worker = await self._replacement(model, worker)
                    future = send(worker)
                    continue
                except (RemoteError, WorkerError) as exc:
                    raise self._request_failed(model, request_id, exc) from None
                return
        finally:
            if not future.done():  # closed or cancelled: the client went away
                _quietly(worker.cancel)(request_id)  # one short write, safe to do here

    async def _replacement(self, model: str, gone: WorkerProcess) -> WorkerProcess:
        """The worker that replaces `gone` once it is restarted (the exit watcher restarts)."""
        slot = self._slots[model]
        if slot.worker is gone:
            slot.ready.clear()
        return await self._worker_of(model)

    async def _worker_of(self, model: str) -> WorkerProcess:
        slot = self._slots.get(model)
        if slot is None:
            raise UnknownModelError(
                f"no model named {model!r}; available: {', '.join(self._slots) or 'none'}"
            )
        if slot.state == "failed":
            raise EngineError(f"{model} failed to load: {slot.last_error}")
        try:
            await asyncio.wait_for(slot.ready.wait(), READY_TIMEOUT_S)
        except TimeoutError:
            raise WorkerError(f"{model} is not running ({slot.last_error})") from None
        assert slot.worker is not None  # ready is set only while a worker is attached
        return slot.worker

    def _request_failed(self, model: str, request_id: str, exc: ArbiterError) -> ArbiterError:
        """Map a worker's answer to the error the edges expect, and record the failure."""
        if isinstance(exc, RemoteError):
            if exc.kind in _REQUEST_ERRORS:
                error: ArbiterError = _REQUEST_ERRORS[exc.kind](str(exc))
            elif exc.kind in _ENGINE_ERRORS:
                error = EngineError(str(exc))
            else:
                error = WorkerError(str(exc))
        else:
            error = exc
        self._publish(
            {
                "event": "request",
                "model": model,
                "id": request_id,
                "status": "error",
                "error": str(error),
            }
        )
        return error

    def _request_id(self) -> str:
        return f"req-{os.getpid()}-{next(self._ids)}"

    # -- status and commands ------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        slots = list(self._slots.values())
        # A fresh reading, not the last periodic one (up to 5 s old when nobody subscribes).
        snapshot = await self._run(self._sampler.sample) or self._sampler.latest
        reports = await asyncio.gather(*(self._slot_status(s, snapshot) for s in slots))
        arena = await self._run(self._arena.observe)
        holder = None
        if arena.holder_pid is not None:
            holder = {
                "pid": arena.holder_pid,
                "name": holder_name(arena),
                "since": arena.holder.since if arena.holder else None,
            }
        return {
            "models": reports,
            "arena": str(arena.path),
            "holder": holder,
            "waiters": [{"pid": p, "name": process_name(p)} for p in arena.waiter_pids],
            "hold": self._hold is not None,
            "telemetry": self._telemetry_status(snapshot),
            # Each copy once, however many models share it.
            "host_ram_bytes": self._host_copies.total_bytes()
            + sum(int(r.get("host_kv_bytes") or 0) for r in reports),
            "engine": None if self._engine is None else self._engine.to_json(),
        }

    async def _slot_status(self, slot: _Slot, snapshot: TelemetrySnapshot | None) -> dict[str, Any]:
        report: dict[str, Any] = {
            "name": slot.config.name,
            "state": slot.state,
            "pid": None,
            "pinned": slot.pinned,
            "queue": 0,
            "resident_bytes": 0,
            "prompt_tokens_evaluated": 0,
            "served": 0,
            "restarts": slot.restarts,
            "last_error": slot.last_error,
            "last_handoff": slot.last_handoff,
            "vram_bytes": None,  # measured by the telemetry readers; None = cannot be told
            "cold_footprint_bytes": self._footprints.footprint(slot.config.name),
            **self._host_ram(slot, host_kv_bytes=0),
            # None until its first worker said hello.
            "backend": slot.hello.backend if slot.hello is not None else None,
            "fallback_reason": slot.hello.fallback_reason if slot.hello is not None else "",
            "warning": slot.warning,
        }
        if snapshot is not None:
            report["vram_bytes"] = snapshot.model_bytes(slot.config.name, self._device)
        worker = slot.worker
        if worker is not None:
            try:
                live = await self._run(worker.status)
            except WorkerError:
                return report
            for key in (
                "state",
                "pid",
                "queue",
                "resident_bytes",
                "prompt_tokens_evaluated",
                "served",
            ):
                report[key] = live.get(key, report[key])
            report["last_error"] = live.get("last_error") or slot.last_error
            report.update(self._host_ram(slot, host_kv_bytes=int(live.get("host_kv_bytes", 0))))
        return report

    def _host_ram(self, slot: _Slot, *, host_kv_bytes: int) -> dict[str, Any]:
        """The model's host RAM: its share of the file's copy (split between the models that
        use it, so the shares add up to the total) plus the KV cache it keeps on the host."""
        lease = slot.copy_lease
        if lease is None:
            return {"host_ram_bytes": host_kv_bytes or None, "host_kv_bytes": host_kv_bytes}
        models = lease.copy.models()
        return {
            "host_ram_bytes": lease.copy.size // len(models) + host_kv_bytes,
            "host_kv_bytes": host_kv_bytes,
            "host_copy_bytes": lease.copy.size,
            "host_copy_shared_with": [m for m in models if m != slot.config.name],
        }

    async def command(self, name: str, model: str | None = None) -> dict[str, Any]:
        if name in MODEL_COMMANDS:
            if not model:
                raise ControlError(f"{name} needs a model name")
            worker = await self._worker_of(model)
            if name in ("pin", "unpin"):
                self._slots[model].pinned = name == "pin"
            result = await self._run(worker.request, name, timeout_s=COMMAND_TIMEOUT_S)
            return {"model": model, **result}
        if name == "hold":
            return await self._take_hold()
        if name == "unhold":
            return self._give_back_hold()
        if name == "reload":
            return await self._reload()
        if name == "shutdown":
            self.stopped.set()
            return {"stopping": True}
        raise ControlError(f"unknown command {name!r}")

    async def _reload(self) -> dict[str, Any]:
        """Re-read the config file: start added models, stop removed ones, restart changed
        ones; the others keep serving undisturbed. [daemon] changes need a restart."""
        if self._reload_config is None:
            raise ControlError("running on the embedded default: there is no config to reload")
        new = await self._run(self._reload_config)
        # The whole new config is checked before anything changes: a bad file applies nothing.
        warnings = await self._run(check_models, new, copy_held=self._host_copies.holds)
        for warning in warnings:
            log.warning("%s", warning)
        old = self.config.models
        added = [n for n in new.models if n not in old]
        removed = [n for n in old if n not in new.models]
        changed = [n for n in new.models if n in old and new.models[n] != old[n]]
        fresh = {name: _Slot(new.models[name]) for name in added + changed}
        try:
            # Before the old slots let theirs go: a changed model whose file is gone from disk
            # restarts from the copy its old worker still holds.
            await asyncio.gather(*(self._hold_copy(slot) for slot in fresh.values()))
        except ArbiterError as exc:
            for slot in fresh.values():
                self._drop_copy(slot)
            raise ControlError(f"reload applied nothing: {exc}") from None
        for name in removed + changed:
            await self._retire(self._slots.pop(name))
        self.config = Config(daemon=self.config.daemon, models=new.models, source=new.source)
        for name, slot in fresh.items():
            self._slots[name] = slot
            self.metrics.add_model(name)
        await asyncio.gather(*(self._spawn(slot) for slot in fresh.values()))
        summary = {"added": added, "removed": removed, "changed": changed}
        self._publish({"event": "reload", **summary, "warnings": warnings})
        return {**summary, "warnings": warnings}

    async def _retire(self, slot: _Slot) -> None:
        if slot.restart_task is not None:
            slot.restart_task.cancel()
        worker, slot.worker = slot.worker, None  # detached: its exit is not a crash
        slot.ready.clear()
        self._footprints.forget(slot.config.name)
        if worker is not None:
            self._forget_worker(slot.config.name, worker.pid)
            await self._run(worker.shutdown)
        self._drop_copy(slot)  # after the worker, which held its own descriptor of the copy

    async def _take_hold(self) -> dict[str, Any]:
        """Game mode: every model goes cold (pinned or not) and the daemon keeps the token."""
        if self._hold is not None:
            return {"hold": True}
        for slot in self._slots.values():
            if slot.worker is not None:
                await self._run(slot.worker.request, "release", timeout_s=COMMAND_TIMEOUT_S)
        self._hold = await self._run(
            self._arena.acquire, "arbiterd hold", timeout_s=COMMAND_TIMEOUT_S
        )
        self._publish({"event": "hold", "held": True})
        return {"hold": True}

    def _give_back_hold(self) -> dict[str, Any]:
        if self._hold is not None:
            self._hold.release()
            self._hold = None
            self._publish({"event": "hold", "held": False})
        return {"hold": False}

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    # -- events -------------------------------------------------------------------------------

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(events)
        self._sampler.wake()  # a watcher wants fresh figures now, then every second
        return events

    def unsubscribe(self, events: asyncio.Queue[dict[str, Any]]) -> None:
        self._subscribers.discard(events)

    def _on_worker_event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "request":
            event.setdefault("status", "cancelled" if event.get("cancelled") else "ok")
        if event.get("event") == "residency":
            self._on_residency(event)
        self._publish(event)

    def _on_residency(self, event: dict[str, Any]) -> None:
        slot = self._slots.get(str(event.get("model")))
        if slot is None:
            return
        slot.state = str(event["to"])
        if slot.state == "failed":
            slot.last_error = str(event.get("reason", ""))
        self._account(slot, event)
        if event["from"] == "cooling" and event["to"] == "cold" and slot.worker is not None:
            self._verify_teardown(slot.config.name, slot.worker.pid)
        if event["from"] == "cooling" and event["to"] == "cold" and event["reason"] == "wanted":
            self._last_release = _Release(slot.config.name, event["at"], event["duration_s"])
        became_warm = event["to"] == "warm" and event["from"] in ("warming", "loading")
        release = self._last_release
        if became_warm and release is not None and release.model != slot.config.name:
            restore_s = float(event["duration_s"])
            took_token_at = float(event["at"]) - restore_s
            if took_token_at - release.at <= HANDOFF_WINDOW_S:
                self._last_release = None
                handoff = {
                    "event": "handoff",
                    "from": release.model,
                    "to": slot.config.name,
                    "release_s": round(release.release_s, 6),
                    "wait_s": round(max(0.0, took_token_at - release.at), 6),
                    "restore_s": round(restore_s, 6),
                }
                slot.last_handoff = handoff
                self._publish(handoff)

    # -- VRAM ---------------------------------------------------------------------------------

    def _account(self, slot: _Slot, event: dict[str, Any]) -> None:
        """The engine's own figure, which the accounting reader reports on machines without a
        GPU reader: weights + KV while warm, nothing once cold."""
        worker = slot.worker
        if worker is None:
            return
        if event["to"] == "warm":
            held = int(event.get("weights_bytes") or 0) + int(event.get("kv_bytes") or 0)
        elif event["to"] in ("cold", "failed", "stopped"):
            held = 0
        else:
            return
        self._accounted = {**self._accounted, worker.pid: held}

    def _forget_worker(self, model: str, pid: int) -> None:
        self._accounted = {p: b for p, b in self._accounted.items() if p != pid}
        self._model_pids = {m: p for m, p in self._model_pids.items() if m != model}

    def _verify_teardown(self, model: str, pid: int) -> None:
        """After a release, check (off the loop) that the worker's VRAM really came back."""
        latest = self._sampler.latest
        future = self._pool.submit(
            self._teardown.run,
            model,
            pid,
            expected_bytes=self._footprints.expected(model),
            bytes_before=latest.model_bytes(model, self._device) if latest else None,
            device=self._device,
        )
        future.add_done_callback(
            lambda done: (
                self._call_soon(self._on_teardown, done.result())
                if not done.cancelled() and done.exception() is None
                else None
            )
        )

    def _on_teardown(self, result: TeardownResult) -> None:
        self._footprints.record(result)
        event = result.event()
        if event is not None:
            log.warning("%s: VRAM not freed after release: %s", result.model, event)
            self._publish(event)

    def _on_snapshot(self, snapshot: TelemetrySnapshot) -> None:
        self.metrics.observe_vram(snapshot)
        vram = {"event": "vram", **snapshot.to_json()}
        for events in list(self._subscribers):  # live figures: not journaled
            if not events.full():
                events.put_nowait(vram)

    def _telemetry_status(self, snapshot: TelemetrySnapshot | None) -> dict[str, Any]:
        figures: dict[str, Any] = snapshot.to_json() if snapshot is not None else {}
        return {**figures, "readers": self._readers.describe(), "device": self._device}

    # -- event stream -------------------------------------------------------------------------

    def _publish(self, event: dict[str, Any]) -> None:
        event.setdefault("at", time.time())
        self.metrics.observe(event)
        if self._journal is not None:
            try:
                self._journal.append(event)
            except Exception:  # a full disk must not take the daemon down
                log.exception("could not journal an event")
        for events in list(self._subscribers):
            if events.full():
                continue  # the control server notices and drops that subscriber
            events.put_nowait(event)

    # -- plumbing -----------------------------------------------------------------------------

    async def _run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: function(*args, **kwargs))

    def _call_soon(self, function: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(function, *args)

    def _from_thread(
        self, handler: Callable[[dict[str, Any]], None]
    ) -> Callable[[dict[str, Any]], None]:
        return lambda event: self._call_soon(handler, event)


def _os_reason(exc: OSError) -> str:
    """An OSError as one line: errno name and text ("EMFILE: Too many open files")."""
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{name}: {text}" if name else text


def _quietly(function: Callable[[str], None]) -> Callable[[str], None]:
    """Best effort: the worker may be gone already."""

    def call(argument: str) -> None:
        try:
            function(argument)
        except ArbiterError:
            log.debug("could not deliver to a gone worker", exc_info=True)

    return call
