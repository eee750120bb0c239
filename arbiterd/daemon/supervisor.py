"""The supervisor: one slot per configured model, and the daemon's `Service` (service.py).

Composes the daemon's parts, each with one job, and keeps what ties them together:
- `slots.Slot`, one per model, with its lifecycle state machine;
- `lifecycle.Lifecycle` starts, restarts and stops the slots' workers;
- `routing.Router` sends requests to them, with one retry rule;
- `eventbus.EventBus` stamps, counts, journals and fans out every event;
- `handoffs.Handoffs` turns the waits workers measured into handoffs and waits;
- `vramwatch.VramWatch` reads VRAM, accounts the engines' figures, verifies teardowns;
- `keepers.Keepers` runs the groups' and the fitting sets' keepers and their budgets;
- `holderwatch.HolderWatch` asks the workers that hold a token whether they live, and applies
  liveness.judge's verdict (issues 24, 40);
- `unloads.IdleUnloads` and `unloads.RamBudget` unload models that stayed cold and idle for
  their unload_after_s, or that the host RAM budget has no room for (issue 14);
- `modelstatus.model_status` builds each model's status record;
- `reload.Reload` applies a re-read config (`arbiterd reload`);
- `leases.Leases` holds each lent RPC device for its lender while not granted (issue 46).
Here: which model a name or alias asks for (the config's `resolve`: `model` for the HTTP edge,
which then names the model by its name; each command), what a worker's events mean for its
slot, the daemon's status from its parts' records, the commands (hold, reload, unload, ...),
what runs the models (the workers' hellos), and the metrics scrape. Everything runs on the
daemon's asyncio loop; no request waits on a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from arbiterd.arena import Arena
from arbiterd.config import (
    Config,
    hashed_servers,
)
from arbiterd.control import MODEL_COMMANDS
from arbiterd.daemon.models.handoffs import Handoffs
from arbiterd.daemon.models.holderwatch import HolderWatch
from arbiterd.daemon.models.keepers import Keepers
from arbiterd.daemon.models.lifecycle import Lifecycle
from arbiterd.daemon.models.modelfile import vram_budget_for
from arbiterd.daemon.models.modelstatus import model_status
from arbiterd.daemon.models.routing import Router
from arbiterd.daemon.models.slots import Slot, new_slot
from arbiterd.daemon.models.unloads import IdleUnloads, RamBudget
from arbiterd.daemon.models.waiting import NewsListener, Waits
from arbiterd.daemon.models.workerclient import WorkerHello
from arbiterd.daemon.models.workerport import WorkerPort
from arbiterd.daemon.observe.eventbus import EventBus
from arbiterd.daemon.observe.journal import Journal
from arbiterd.daemon.observe.metrics import Metrics
from arbiterd.daemon.observe.telemetry import ReaderSet, TelemetrySnapshot
from arbiterd.daemon.observe.vramwatch import VramWatch
from arbiterd.daemon.reload import Reload
from arbiterd.daemon.service import ImagePolicy, ServedModel
from arbiterd.daemon.stepaside.aside import StepAside
from arbiterd.daemon.stepaside.hold import DaemonHold
from arbiterd.daemon.stepaside.leases import Leases
from arbiterd.errors import (
    AcquireTimeoutError,
    ArbiterError,
    ConfigError,
    ControlError,
)
from arbiterd.events import (
    Event,
    HandoffEvent,
    HoldEvent,
    ResidencyEvent,
    VramEvent,
    parse_event,
)
from arbiterd.offload import CpuNote, cpu_note, gpu_nodes, setup_script
from arbiterd.procs import WaitNews, holder_name, waiter_name
from arbiterd.reply import EngineReport
from arbiterd.request import GenerateRequest
from arbiterd.states import (
    WORKER_OP_OF,
    ControlCommand,
    CpuCause,
    ResidencyState,
    SlotState,
    UnloadReason,
    WorkerOp,
)
from arbiterd.status import (
    HOLD_HOLDER_NAME,
    DaemonStatus,
    Engine,
    Holder,
    HostRam,
    PromptCache,
    Waiter,
)

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 300.0
USER_HOLD = "user"  # the user's reason for the daemon's hold (game mode)
# The residency states in which a worker holds the GPU's token.
_HOLDS_TOKEN = frozenset(
    {ResidencyState.LOADING, ResidencyState.WARMING, ResidencyState.WARM, ResidencyState.COOLING}
)
# Beside the journal: the prompt caches unloaded models keep (lifecycle.py, worker/kvfile.py).
KV_DIR = "prompt-cache"
# What a request in flight when the daemon stops, or sent after, is answered (issue 30).
SHUTTING_DOWN = "arbiterd is shutting down; send the request again once it is running"


class Supervisor:
    """The daemon's `Service`, and what ties its parts together (the module docstring lists
    them).

    It is every method the edges call plus the reactions to the parts' events, and each of
    those is a few lines that apply a decision made elsewhere: a pure function
    (liveness.judge, budgets.ram_plan, reload.plan_reload, Handoffs.observe) or a part's own
    method (a Slot's changes are slots.py's, a worker's lifecycle.py's, a request's path
    routing.py's). It owns the config (a reload replaces it through `_replace_config`) and the
    slots; the parts it gives them to read them as they are now.
    """

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
        for name, model in config.models.items():
            self.metrics.add_model(name, model.devices)
        # gpu0's arena: the user's hold, the groups' keepers (groups are on gpu0 alone) and
        # status's holder; a waiting model is told of its own devices' arenas (waiting.py).
        self._arena = Arena(config.daemon.arena)
        # Every model has its slot from the start: the control socket answers before the
        # workers start, and status then lists each model as starting, not an empty daemon.
        self._slots: dict[str, Slot] = {name: new_slot(m) for name, m in config.models.items()}
        self._bus = EventBus(self.metrics, journal)
        self._handoffs = Handoffs()
        self._vram = VramWatch(
            config.daemon.arena,
            on_snapshot=self._on_snapshot,
            on_leak=self._on_leak,
            watched=lambda: self._bus.watched,
            on_reading=self._on_reading,
            readers=readers,
        )
        self._lifecycle = Lifecycle(
            config.daemon.arena,
            publish=self._bus.publish,
            on_worker_event=self._on_worker_event,
            on_ready=self._on_ready,
            on_gone=self._on_gone,
            kv_dir=config.daemon.journal.parent / KV_DIR,
            prompt_cache_budget_bytes=config.daemon.prompt_cache_budget_bytes,
            # The config as it is when each worker starts (a reload replaces it).
            vram_budget=lambda model: vram_budget_for(self.config, model),
            turns=config.daemon.turns,
            hashed=lambda model: hashed_servers(self.config, model),
        )
        # Asks the workers that hold a token whether they live (liveness.py decides).
        self._holders = HolderWatch(self._slots, lambda: self.config, self._bus.publish)
        self._waits = Waits(self._arena, notice_after_s=config.daemon.queue_notice_s)
        self._router = Router(self._slots, self._bus.publish, self._lifecycle.load, self._waits)
        # gpu0's token held on someone's behalf: the user's hold, a program stepped aside for.
        self._hold = DaemonHold(self._arena, self._release_models)
        self._aside = StepAside(
            config.yield_rules,
            self._hold,
            self._bus.publish,
            self._vram.process_bytes,
            measured_by=self._vram.other_programs_readers(),
            arena=self._arena,
        )
        # The lent RPC devices' leases: each device held for its lender while not granted.
        self._leases = Leases(config.daemon.arena, self._bus.publish)
        # The groups' and the fitting sets' keepers, with the config as it is now.
        self._keepers = Keepers(self._arena, self._vram, lambda: self.config)
        self._engine: EngineReport | None = None  # as the latest worker's hello says
        self._gpu_nodes: tuple[str, ...] | None = None  # this machine's, read at the first hello
        self._cpu_causes_said: set[CpuCause] = set()  # logged this run (offload.py)
        self._tasks: set[asyncio.Task[None]] = set()  # started here, not awaited by anyone
        # What the daemon unloads of its own accord: models idle for their unload_after_s,
        # and cold ones the host RAM budget has no room for.
        self._idle_unloads = IdleUnloads(self._slots, self._lifecycle)
        self._ram_budget = RamBudget(
            self._slots, self._lifecycle, lambda: self.config, self._bus.publish, self._spawn
        )
        self._reload = Reload(
            slots=self._slots,
            config=lambda: self.config,
            replace_config=self._replace_config,
            start=self._start,
            lifecycle=self._lifecycle,
            keepers=self._keepers,
            vram=self._vram,
            handoffs=self._handoffs,
            aside=self._aside,
            metrics=self.metrics,
            publish=self._bus.publish,
        )
        # One reload at a time, and none while start() starts the workers: the control socket
        # listens before they start, and two reloads at once would each replace the slots.
        self._config_lock = asyncio.Lock()
        self.stopped = asyncio.Event()  # set by the shutdown command; the daemon awaits it

    # -- lifetime -----------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._config_lock:
            cache = self._lifecycle.prompt_cache
            if cache is not None:  # refused now, with its fix, rather than at the first unload
                await asyncio.to_thread(cache.make_private)
            await self._keepers.check_devices(self.config)
            await self._leases.apply(self.config)
            self._keepers.start_missing()
            await asyncio.gather(*(self._start(slot) for slot in self._slots.values()))
        log.info("VRAM telemetry: %s", self._vram.readers.describe())
        self._vram.start()
        self._spawn(self._idle_unloads.run())
        self._spawn(self._holders.run())
        self._aside.start()
        log.info("stepping aside for other GPU programs: %s", self._aside.describe())

    async def _start(self, slot: Slot) -> None:
        """Start a new slot's worker, unless it is loaded on demand."""
        if slot.state is SlotState.STARTING:
            await self._lifecycle.start(slot)

    def stop_requests(self) -> None:
        """Refuse every request from now on, and end those in flight with ShuttingDownError
        (their decodes cancelled in the workers): the first step of serve.py's stop."""
        self._router.stop_requests(SHUTTING_DOWN)

    async def stop(self) -> None:
        """Stop every worker and release a user hold (after stop_requests: no request is
        left to finish)."""
        for task in list(self._tasks):
            task.cancel()
        await self._lifecycle.stop(list(self._slots.values()))
        await self._keepers.stop()
        await self._leases.close()
        await self._aside.close()
        self._hold.close()
        await self._vram.stop()

    # -- requests -----------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self.config.models)

    def model(self, asked: str) -> ServedModel | None:
        name = self.config.resolve(asked)
        slot = None if name is None else self._slots.get(name)
        if name is None or slot is None:  # no slot: a reload adds it (the router said the same)
            return None
        config = self.config.models[name]
        images = None
        if config.mmproj is not None:
            images = ImagePolicy(
                model=config.name,
                max_bytes=config.max_image_bytes,
                max_pixels=config.max_image_pixels,
                allow_urls=config.allow_image_urls,
            )
        return ServedModel(name, slot.embedding, config.strict_api, images)

    async def complete(self, model: str, request: GenerateRequest) -> dict[str, Any]:
        result = await self._router.complete(model, request)
        return result.response

    def stream(
        self, model: str, request: GenerateRequest
    ) -> AsyncIterator[dict[str, Any] | WaitNews]:
        return self._router.stream(model, request)

    # -- status and commands ------------------------------------------------------------------

    async def status(self) -> DaemonStatus:
        slots = list(self._slots.values())
        # A fresh reading, not the last periodic one (up to 5 s old when nobody subscribes).
        snapshot = await self._vram.fresh()
        models = await asyncio.gather(
            *(model_status(s, snapshot, self._vram, self._holders.silence) for s in slots)
        )
        arena = self._arena.observe()
        holder = None
        if arena.holder_pid is not None:
            holder = Holder(
                pid=arena.holder_pid,
                name=holder_name(arena),
                since=arena.holder.since if arena.holder else None,
            )
        host_ram = HostRam(
            host_copies_bytes=self._lifecycle.host_copies.total_bytes(),
            host_kv_bytes=sum(m.host_kv_bytes for m in models),
            host_weights_bytes=sum(m.host_weights_bytes for m in models),
            budget_bytes=self.config.daemon.host_ram_budget_bytes,  # 0: none
        )
        cache = self._lifecycle.prompt_cache
        usage = None if cache is None else await asyncio.to_thread(cache.usage)
        engine = self._engine
        return DaemonStatus(
            models=tuple(models),
            arena=str(arena.path),
            holder=holder,
            waiters=tuple(Waiter(pid=p, name=waiter_name(arena, p)) for p in arena.waiter_pids),
            hold=self._hold.wanted_by(USER_HOLD),
            stepped_aside=self._aside.status(),
            leases=self._leases.status(),
            yield_watch=self._aside.describe(),
            groups=self._keepers.status(),
            telemetry=self._vram.status(snapshot),
            # Each copy once, however many models share it.
            host_ram_bytes=(
                host_ram.host_copies_bytes + host_ram.host_kv_bytes + host_ram.host_weights_bytes
            ),
            host_ram=host_ram,
            prompt_cache=None
            if usage is None
            else PromptCache(usage["bytes"], usage["files"], usage["budget_bytes"]),
            engine=None if engine is None else self._engine_status(engine),
        )

    def _cpu_note(self, engine: EngineReport) -> CpuNote | None:
        """Why the models that ask for GPU layers run on `engine`'s CPU, read once: the machine's
        GPU nodes do not change while the daemon runs."""
        if self._gpu_nodes is None:
            self._gpu_nodes = gpu_nodes()
        return cpu_note(self._gpu_nodes, engine.offload, setup_script())

    def _engine_status(self, engine: EngineReport) -> Engine:
        note = self._cpu_note(engine)
        if note is None or all(s.config.n_gpu_layers == 0 for s in self._slots.values()):
            return Engine(engine.offload, engine.devices)
        return Engine(engine.offload, engine.devices, cpu_cause=note.cause, cpu_note=note.text)

    async def command(
        self,
        name: ControlCommand,
        model: str | None = None,
        on_news: NewsListener | None = None,
        *,
        pid: int | None = None,
    ) -> dict[str, Any]:
        if name in MODEL_COMMANDS:
            if not model:
                raise ControlError(f"{name} needs a model name")
            # An unknown name as it is, for the command to refuse with the list of models.
            named = self.config.resolve(model) or model
            return await self._model_command(name, named, on_news)
        if name is ControlCommand.HOLD:
            return await self._take_hold()
        if name is ControlCommand.UNHOLD:
            return self._give_back_hold()
        if name in (ControlCommand.YIELD, ControlCommand.RESUME):
            return await self._aside_command(name, pid)
        if name is ControlCommand.RELOAD:
            return await self._reload_command()
        if name is ControlCommand.SHUTDOWN:
            self.stopped.set()
            return {"stopping": True}
        raise ControlError(f"unknown command {str(name)!r}")

    async def _aside_command(self, name: ControlCommand, pid: int | None) -> dict[str, Any]:
        """`yield` (step aside for program `pid` until it exits) or `resume` (end a step
        aside now)."""
        if name is ControlCommand.RESUME:
            return self._aside.resume()
        if pid is None:
            raise ControlError("yield needs the pid of the program to step aside for")
        return await self._aside.yield_to(pid)

    async def _model_command(
        self, name: ControlCommand, model: str, on_news: NewsListener | None = None
    ) -> dict[str, Any]:
        """`name` for `model` (by its name: the reply names it so, also when asked by alias);
        `on_news` is told what it waits for while the model waits for the GPU."""
        slot = self._router.slot_of(model)
        if name is ControlCommand.UNLOAD:
            unloading = self._lifecycle.unload(slot, UnloadReason.COMMAND)
            saved = await (
                unloading if on_news is None else self._waits.command(slot, unloading, on_news)
            )
            return {"model": model, "state": slot.shown_state, **saved}
        if name is ControlCommand.RELEASE and slot.state in (
            SlotState.UNLOADING,
            SlotState.UNLOADED,
        ):
            return {"model": model, "state": slot.shown_state}  # not started to release it
        worker = await self._router.worker_of(model)
        if name in (ControlCommand.PIN, ControlCommand.UNPIN):
            self._slots[model].pin(name is ControlCommand.PIN)
        asked = worker.request(WORKER_OP_OF[name], timeout_s=COMMAND_TIMEOUT_S)
        result = await (asked if on_news is None else self._waits.command(slot, asked, on_news))
        return {"model": model, **result}

    async def _reload_command(self) -> dict[str, Any]:
        """Re-read the config file: start added models, stop removed ones, restart changed
        ones (a failed one too); the others keep serving undisturbed, also when only their
        aliases changed (those apply at once), and apply [yield]. [daemon] changes need a
        restart."""
        if self._reload_config is None:
            raise ControlError("this daemon was given no way to read its config again")
        async with self._config_lock:
            result = await self._reload.apply(self._reload_config)
            try:
                await self._leases.apply(self.config)
            except ConfigError as exc:
                log.warning("reload: %s", exc)
        self._idle_unloads.wake()  # unload_after_s may have changed, slots come and gone
        return result

    def _replace_config(self, config: Config) -> None:
        self.config = config  # a reload's: [models], [groups], [devices], [yield]

    async def _take_hold(self) -> dict[str, Any]:
        """Game mode: every model goes cold (pinned or not) and the daemon keeps the token."""
        if self._hold.wanted_by(USER_HOLD):
            return {"hold": True}
        try:
            await asyncio.wait_for(
                self._hold.take(USER_HOLD, HOLD_HOLDER_NAME), timeout=COMMAND_TIMEOUT_S
            )
        except TimeoutError:
            self._hold.give_back(USER_HOLD)
            raise AcquireTimeoutError(
                f"the GPU was not free within {COMMAND_TIMEOUT_S:g} s"
            ) from None
        self._bus.publish(HoldEvent(held=True))
        return {"hold": True}

    def _give_back_hold(self) -> dict[str, Any]:
        if self._hold.wanted_by(USER_HOLD):
            self._hold.give_back(USER_HOLD)
            self._bus.publish(HoldEvent(held=False))
        return {"hold": False}

    async def _release_models(self) -> None:
        """Ask every model that holds the GPU to release now (the daemon's hold waits for it);
        one that cannot is logged, and the hold waits for its token all the same. Not one that
        waits for the GPU: its engine answers once it got the GPU, which the hold, ahead of it
        in the queue, keeps."""

        async def release(slot: Slot) -> None:
            if slot.worker is None or slot.residency not in _HOLDS_TOKEN:
                return
            try:
                await slot.worker.request(WorkerOp.RELEASE, timeout_s=COMMAND_TIMEOUT_S)
            except ArbiterError as exc:
                log.warning("%s: could not release for the daemon's hold: %s", slot.name, exc)

        await asyncio.gather(*(release(slot) for slot in list(self._slots.values())))

    async def metrics_text(self) -> bytes:
        """The metrics, with a VRAM reading taken for this scrape: the figures agree with the
        residency gauges of the same scrape, however recent the last handoff."""
        snapshot = await self._vram.fresh()
        if snapshot is not None:
            self.metrics.observe_vram(snapshot)
        return self.metrics.text()

    # -- events -------------------------------------------------------------------------------

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        events = self._bus.subscribe()
        self._vram.wake()  # a watcher wants fresh figures now, then every second
        return events

    def unsubscribe(self, events: asyncio.Queue[dict[str, Any]]) -> None:
        self._bus.unsubscribe(events)

    def _on_ready(self, slot: Slot) -> None:
        """A worker said hello: keep what runs the model, and say once per worker start what
        it will not get."""
        worker = slot.worker
        assert worker is not None  # ready: spawned
        hello: WorkerHello | None = worker.hello
        assert hello is not None  # spawn returns once the hello is read
        if hello.engine != self._engine:  # every worker loads the same llama.cpp: said once
            devices = ", ".join(hello.engine.devices) or "none listed"
            offload = "can" if hello.engine.offload else "cannot"
            log.info("engine: %s offload to a GPU; devices: %s", offload, devices)
        self._engine = hello.engine
        self.metrics.set_backend(slot.name, hello.backend)
        slot.said_hello(hello)
        note = self._cpu_note(hello.engine) if slot.config.n_gpu_layers != 0 else None
        if note is not None and note.cause not in self._cpu_causes_said:
            # Once per cause while the daemon runs: every worker loads the same engine on the
            # same machine, so a line per model (or per restart) would only repeat it.
            self._cpu_causes_said.add(note.cause)
            log.log(logging.WARNING if note.warning else logging.INFO, "engine: %s", note.text)
        self._vram.worker_started(slot.name, worker.pid)
        if slot.pinned:  # a restarted worker of a pinned model is pinned too
            self._spawn(self._pin_again(slot, worker))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)
        return task

    async def _pin_again(self, slot: Slot, worker: WorkerPort) -> None:
        try:
            await worker.request(WorkerOp.PIN)
        except ArbiterError as exc:
            log.warning("%s: could not pin its new worker: %s", slot.name, exc)

    def _on_gone(self, slot: Slot, worker: WorkerPort) -> None:
        self._vram.worker_gone(slot.name, worker.pid)

    def _on_worker_event(self, slot: Slot, raw: dict[str, Any]) -> None:
        """An event from `slot`'s worker: what it means for the slot, then published."""
        event = parse_event(raw)
        if isinstance(event, ResidencyEvent):
            self._on_residency(slot, event)
            return
        self._bus.publish(event)

    def _on_residency(self, slot: Slot, event: ResidencyEvent) -> None:
        worker = slot.worker
        if worker is None or event.model != slot.name:
            return
        slot.report_residency(event.to_state, now=time.monotonic(), reason=event.reason)
        self._idle_unloads.wake()  # cold now, or no longer: its unload is due at another time
        if event.to_state is ResidencyState.COLD or event.from_state is ResidencyState.LOADING:
            self._ram_budget.want_check()
        self._vram.residency(worker.pid, event, slot.config.devices)
        self._bus.publish(event)
        made = self._handoffs.observe(event, self._vram.models_by_pid, slot.config.devices)
        if made is not None:
            published = self._bus.publish(made)
            if isinstance(published, HandoffEvent):
                slot.took_gpu(published)

    def _on_snapshot(self, snapshot: TelemetrySnapshot) -> None:
        self.metrics.observe_vram(snapshot)
        self._bus.live(VramEvent.from_json({"event": "vram", **snapshot.to_json()}))

    def _on_reading(self, snapshot: TelemetrySnapshot) -> None:
        # On the sampler's thread: each fitting set's budget as the reading measures it.
        self._keepers.fit_budgets(snapshot)

    def _on_leak(self, event: Event) -> None:
        log.warning("VRAM not freed after release: %s", event.to_json())
        self._bus.publish(event)
