"""The supervisor: one slot per configured model, and the daemon's `Service` (service.py).

Composes the daemon's parts, each with one job, and keeps what ties them together:
- `slots.Slot`, one per model, with its lifecycle state machine;
- `lifecycle.Lifecycle` starts, restarts and stops the slots' workers;
- `routing.Router` sends requests to them, with one retry rule;
- `eventbus.EventBus` stamps, counts, journals and fans out every event;
- `handoffs.Handoffs` turns the waits workers measured into handoffs and waits;
- `vramwatch.VramWatch` reads VRAM, accounts the engines' figures, verifies teardowns;
- `liveness.judge` decides whether a worker that holds a token (warm, or in a handoff: loading,
  warming, cooling) and shows no sign of life is reported or killed (issues 24, 40); the watch
  here asks those workers for their status and applies it.
Here: which model a name or alias asks for (the config's `resolve`, at each entry point, so
every edge takes aliases), what a worker's events mean for its slot, status, the commands (hold,
reload, unload, ...), unloading models that stayed cold and idle for their unload_after_s
(issue 14) or that the host RAM budget has no room for (budgets.ram_plan, looked at whenever a
model goes cold or loads), and the metrics scrape. Everything runs on the daemon's asyncio
loop; no request waits on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any

from arbiterd.arena import Arena
from arbiterd.arena.devices import canonical_order
from arbiterd.arena.groups import Keeper
from arbiterd.config import (
    FITTING_GROUP,
    Config,
    DeviceConfig,
    GroupConfig,
    Load,
    ModelConfig,
    default_config_path,
)
from arbiterd.control import MODEL_COMMANDS
from arbiterd.daemon.models.budgets import (
    ColdModel,
    CopyUse,
    DeviceBudget,
    Measured,
    device_budget,
    measured_device,
    measured_host,
    ram_plan,
)
from arbiterd.daemon.models.handoffs import Handoffs
from arbiterd.daemon.models.lifecycle import Lifecycle
from arbiterd.daemon.models.liveness import (
    STATUS_ANSWER_S,
    Verdict,
    holds_token,
    judge,
    kill_reason,
    ping_interval_s,
    silent_s,
    stale,
)
from arbiterd.daemon.models.modelfile import check_models, vram_budget_for
from arbiterd.daemon.models.routing import Router
from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.waiting import NewsListener, Waits
from arbiterd.daemon.models.workerclient import EngineReport, WorkerClient, WorkerHello
from arbiterd.daemon.observe.eventbus import EventBus
from arbiterd.daemon.observe.journal import Journal
from arbiterd.daemon.observe.metrics import Metrics
from arbiterd.daemon.observe.telemetry import ReaderSet, TelemetrySnapshot
from arbiterd.daemon.observe.vramwatch import VramWatch
from arbiterd.daemon.service import ImagePolicy
from arbiterd.daemon.stepaside.aside import StepAside
from arbiterd.daemon.stepaside.hold import DaemonHold
from arbiterd.errors import (
    AcquireTimeoutError,
    ArbiterError,
    ConfigError,
    ControlError,
    DeviceUnreachableError,
)
from arbiterd.events import (
    Event,
    HandoffEvent,
    HolderSilentEvent,
    HoldEvent,
    RamBudgetEvent,
    ReloadEvent,
    ResidencyEvent,
    VramEvent,
    parse_event,
)
from arbiterd.footprint import ModelFootprint
from arbiterd.native import rpc
from arbiterd.offload import CpuNote, cpu_note, gpu_nodes, setup_script
from arbiterd.paths import DEFAULT_DEVICE, DeviceId, DeviceKind, device_arena_of, parse_device_id
from arbiterd.procs import WaitNews, holder_name, waiter_name
from arbiterd.render import format_bytes
from arbiterd.request import GenerateRequest
from arbiterd.states import BackendKind, CpuCause, ResidencyState, SlotState
from arbiterd.status import (
    HOLD_HOLDER_NAME,
    DaemonStatus,
    Engine,
    GroupStatus,
    Holder,
    HostRam,
    ModelStatus,
    PromptCache,
    Turn,
    Waiter,
    model_info_fields,
)
from arbiterd.tomltable import key_path

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 300.0
USER_HOLD = "user"  # the user's reason for the daemon's hold (game mode)
# The residency states in which a worker holds the GPU's token.
_HOLDS_TOKEN = frozenset(
    {ResidencyState.LOADING, ResidencyState.WARMING, ResidencyState.WARM, ResidencyState.COOLING}
)
STATUS_TIMEOUT_S = 10.0
# A model due for unloading but not idle (a request waits for the GPU in it) is looked at again
# this soon; one that is not unloaded for another reason (its file gone, its worker not
# answering), one unload_after_s later.
UNLOAD_RETRY_S = 1.0
# Beside the journal: the prompt caches unloaded models keep (lifecycle.py, worker/kvfile.py).
KV_DIR = "prompt-cache"
# What a request in flight when the daemon stops, or sent after, is answered (issue 30).
SHUTTING_DOWN = "arbiterd is shutting down; send the request again once it is running"


def unload_at(slot: Slot) -> float | None:
    """When `slot` will have been cold for its unload_after_s (time.monotonic()), if it stays
    cold; None while it is not cold, or has no unload_after_s."""
    after_s = slot.config.unload_after_s
    if (
        after_s <= 0
        or slot.state is not SlotState.READY
        or slot.residency is not ResidencyState.COLD
        or slot.cold_since is None
    ):
        return None
    return slot.cold_since + after_s


def unload_due(slot: Slot, now: float) -> bool:
    """Whether `slot` has been cold for its unload_after_s by `now` (time.monotonic()); whether
    it is also idle (nothing queued) its worker's status says."""
    at = unload_at(slot)
    return at is not None and now >= at


def next_unload_check(slots: Iterable[Slot], retry: Mapping[str, float]) -> float | None:
    """When there is next a model to look at for unloading (time.monotonic()): the first
    moment one is due, or for one found due but not unloaded then, the time in `retry` (by
    name) to look at it again; None while none can become due, however long the daemon idles."""
    return min(
        (
            max(at, retry.get(slot.name, at))
            for slot in slots
            if (at := unload_at(slot)) is not None
        ),
        default=None,
    )


def new_slot(model: ModelConfig) -> Slot:
    """A slot for `model`: starting, or unloaded for a model loaded on demand."""
    return Slot(
        model, state=SlotState.UNLOADED if model.load is Load.DEMAND else SlotState.STARTING
    )


class Supervisor:
    """The daemon's `Service`, and what ties its parts together (the module docstring lists
    them).

    Over 400 lines, on purpose: it is every method the edges call plus the reactions to the
    parts' events, and each of those is a few lines that apply a decision made elsewhere — a
    pure function (budgets.ram_plan, liveness.judge, unload_due, Handoffs.observe) or a part's
    own method (a Slot's changes are slots.py's, a worker's lifecycle.py's, a request's path
    routing.py's). Split further, its pieces would each need most of the others.
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
        self._device_arenas: dict[Path, Arena] = {}  # a loading worker's, to see if it holds
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
            on_reading=self._fit_budgets,
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
        )
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
        self._keepers: dict[str, Keeper] = {}  # by group: each holds the token for its members
        self._fitting: dict[str, Keeper] = {}  # by device: the keeper of its fitting set
        # Each fitting set's budget as last measured, by device: replaced whole (the sampler's
        # thread writes it, status reads it).
        self._budgets: dict[str, DeviceBudget] = {}
        self._engine: EngineReport | None = None  # as the latest worker's hello says
        self._gpu_nodes: tuple[str, ...] | None = None  # this machine's, read at the first hello
        self._cpu_causes_said: set[CpuCause] = set()  # logged this run (offload.py)
        self._tasks: set[asyncio.Task[None]] = set()  # started here, not awaited by anyone
        # The host RAM budget's check: one at a time; asked again while one runs, it runs once
        # more after it.
        self._ram_check: asyncio.Task[None] | None = None
        self._ram_check_again = False
        # Set when a model may have become due for unloading sooner: a worker's residency
        # changed, or a reload changed the slots; the unload watch sleeps until then, or until
        # the first one is due (issue 29).
        self._unload_wake = asyncio.Event()
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
            await self._check_devices(self.config)
            self._start_missing_keepers()
            await asyncio.gather(*(self._start(slot) for slot in self._slots.values()))
        log.info("VRAM telemetry: %s", self._vram.readers.describe())
        self._vram.start()
        self._spawn(self._unload_idle())
        self._spawn(self._watch_holders())
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
        await self._stop_keepers(list(self._keepers))
        await self._stop_fitting(list(self._fitting))
        await self._aside.close()
        self._hold.close()
        await self._vram.stop()

    def _start_keeper(self, group: GroupConfig) -> None:
        keeper = Keeper(self._arena, group.name, priority=group.priority)
        keeper.start()
        self._keepers[group.name] = keeper

    async def _stop_changed_keepers(self, new: Config) -> None:
        """A group or fitting set whose members, class or budget change in `new` gets a new
        keeper: the old one stops here, once its old members left (_start_missing_keepers
        starts the new one)."""
        old = self.config
        await self._stop_keepers([n for n, g in old.groups.items() if new.groups.get(n) != g])
        await self._stop_fitting([d for d, c in old.devices.items() if new.devices.get(d) != c])

    def _start_missing_keepers(self) -> None:
        for name, group in self.config.groups.items():
            if name not in self._keepers:
                self._start_keeper(group)
        for device_id, device in self.config.devices.items():
            if device_id not in self._fitting:
                self._start_fitting(device)

    def _start_fitting(self, device: DeviceConfig) -> None:
        """The keeper of a device's fitting set (issue 44), in that device's arena, when the
        set has members; its budget as the latest reading measures it (_fit_budgets keeps it
        current)."""
        if not device.members:
            return
        members = [self.config.models[name] for name in device.members]
        budget = self._device_budget(device, self._vram.latest)
        keeper = Keeper(
            Arena(device_arena_of(device.device, self.config.daemon.arena)),
            FITTING_GROUP,
            priority=min((m.priority for m in members), key=lambda p: p.rank),
        )
        keeper.set_budget(budget.budget_bytes, device.reserve // 2)  # before it looks
        keeper.start()
        self._budgets = {**self._budgets, device.device: budget}
        self._fitting[device.device] = keeper

    def _device_budget(
        self, device: DeviceConfig, snapshot: TelemetrySnapshot | None
    ) -> DeviceBudget:
        """What `device`'s fitting set may hold now: as the host's RAM says for the CPU, else
        as the readers' `snapshot` measures the device."""
        measured: Measured | None
        if device.device == str(DeviceId(DeviceKind.CPU)):
            measured = measured_host(self._vram.models_by_pid)
        else:
            measured = measured_device(snapshot, device.device, device.members)
        return device_budget(device.memory, device.reserve, measured)

    def _fit_budgets(self, snapshot: TelemetrySnapshot) -> None:
        """Each fitting set's budget from a new reading (on the sampler's thread): a device
        whose free memory dropped makes members leave, one that grew lets waiters in."""
        budgets = {}
        for device_id, keeper in list(self._fitting.items()):
            device = self.config.devices.get(device_id)
            if device is None:  # a reload took it away; its keeper is stopping
                continue
            budget = budgets[device_id] = self._device_budget(device, snapshot)
            # Half the reserve for a budget that wavers: members leave for another program
            # once it has taken that much of the room kept for it (fitting.plan).
            keeper.set_budget(budget.budget_bytes, device.reserve // 2)
        self._budgets = budgets

    async def _check_devices(self, config: Config) -> None:
        """Refuse a config whose fitting sets cannot work: a [devices.ID] reserve not less than
        the device's memory as measured now (config.py refuses one against its `memory`), or
        an RPC server that serves one client at a time (its models could never be warm
        together: a second one would wait for the first to leave). A server that does not
        answer now is let be: its models say so when they warm up."""
        snapshot = await self._vram.fresh() if config.devices else None
        label = str(config.source) if config.source else "embedded default config"
        for device in config.devices.values():
            if not device.members:
                continue
            where = f"{label}: {key_path('devices', device.device)}"
            budget = await asyncio.to_thread(self._device_budget, device, snapshot)
            if budget.size_bytes is not None and device.reserve >= budget.size_bytes:
                raise ConfigError(
                    f"{where}.reserve: {format_bytes(device.reserve)} is not less than "
                    f"{device.device}'s {format_bytes(budget.size_bytes)} "
                    f"({budget.size_source}): nothing would be left for its models"
                )
            parsed = parse_device_id(device.device)
            if parsed.kind is not DeviceKind.RPC:
                continue
            endpoint = f"{parsed.host}:{parsed.port}"
            try:
                several = await asyncio.to_thread(rpc.serves_several, endpoint)
            except DeviceUnreachableError as exc:
                log.warning("%s: cannot tell whether it serves several clients: %s", where, exc)
                continue
            if not several:
                raise ConfigError(
                    f"{where}: the RPC server at {endpoint} serves one client at a time, so "
                    f"its models cannot be warm together; serve it with `arbiterd rpc-server "
                    f"--clients N`, or remove the table (its models then take turns)"
                )

    async def _stop_fitting(self, devices: list[str]) -> None:
        keepers = [self._fitting.pop(d) for d in devices if d in self._fitting]
        await asyncio.gather(*(asyncio.to_thread(keeper.stop) for keeper in keepers))

    async def _stop_keepers(self, names: list[str]) -> None:
        """Stop these groups' keepers: each lets go of the token once its members are cold
        (they are stopped or restarted first), so it is waited for in a thread."""
        keepers = [self._keepers.pop(name) for name in names]
        await asyncio.gather(*(asyncio.to_thread(keeper.stop) for keeper in keepers))

    def _groups_status(self) -> tuple[GroupStatus, ...]:
        return tuple(
            GroupStatus(
                name=group.name,
                models=tuple(group.models),
                priority=group.priority.value,
                holds_token=keeper.holding,
                handoffs=keeper.handoffs,
                failure=keeper.failure,
                device=DEFAULT_DEVICE,  # a [groups] table's models are on gpu0 (config.py)
            )
            for group in self.config.groups.values()
            if (keeper := self._keepers.get(group.name)) is not None
        ) + tuple(self._fitting_status(device, keeper) for device, keeper in self._fitting.items())

    def _fitting_status(self, device: str, keeper: Keeper) -> GroupStatus:
        warm = [(name, footprint) for name, is_warm, footprint in keeper.look() if is_warm]
        budget = self._budgets.get(device)
        return GroupStatus(
            name=FITTING_GROUP,
            models=self.config.devices[device].members,
            priority=keeper.priority.value,
            holds_token=keeper.holding,
            handoffs=keeper.handoffs,
            failure=keeper.failure,
            device=device,
            fitting=True,
            budget_bytes=keeper.budget or 0,
            warm=tuple(name for name, _ in warm),
            used_bytes=sum(footprint or 0 for _, footprint in warm),
            withdrawals=keeper.withdrawals,
            size_bytes=budget.size_bytes if budget else None,
            size_source=budget.size_source if budget else "",
            reserve_bytes=budget.reserve_bytes if budget else 0,
            others_bytes=budget.others_bytes if budget else 0,
        )

    # -- requests -----------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self.config.models)

    def resolve(self, model: str) -> str | None:
        return self.config.resolve(model)

    def strict_api(self, model: str) -> bool:
        return self.config.models[self._name(model)].strict_api

    def image_policy(self, model: str) -> ImagePolicy | None:
        config = self.config.models[self._name(model)]
        if config.mmproj is None:
            return None
        return ImagePolicy(
            model=config.name,
            max_bytes=config.max_image_bytes,
            max_pixels=config.max_image_pixels,
            allow_urls=config.allow_image_urls,
        )

    def _name(self, model: str) -> str:
        """The model `model` names; an unknown name as it is, for the router to refuse with the
        list of models."""
        return self.config.resolve(model) or model

    async def complete(self, model: str, request: GenerateRequest) -> dict[str, Any]:
        response = await self._router.complete(self._name(model), request)
        return {**response, "model": model}  # as asked: clients compare it with their request

    async def stream(
        self, model: str, request: GenerateRequest
    ) -> AsyncIterator[dict[str, Any] | WaitNews]:
        chunks = self._router.stream(self._name(model), request)
        try:
            async for chunk in chunks:
                if isinstance(chunk, WaitNews):
                    yield chunk
                else:
                    yield {**chunk, "model": model}  # as asked, as in `complete`
        finally:
            await chunks.aclose()  # when closed early, the router's close cancels the request

    # -- status and commands ------------------------------------------------------------------

    async def status(self) -> DaemonStatus:
        slots = list(self._slots.values())
        # A fresh reading, not the last periodic one (up to 5 s old when nobody subscribes).
        snapshot = await self._vram.fresh()
        models = await asyncio.gather(*(self._slot_status(s, snapshot) for s in slots))
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
            yield_watch=self._aside.describe(),
            groups=self._groups_status(),
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

    async def _slot_status(self, slot: Slot, snapshot: TelemetrySnapshot | None) -> ModelStatus:
        hello = slot.hello
        report = ModelStatus(
            name=slot.name,
            aliases=slot.config.aliases,
            path=str(slot.config.path),
            n_ctx=slot.n_ctx,
            parallel=slot.config.parallel,
            devices=slot.config.devices,
            host_copy=slot.config.host_copy.value,
            state=slot.shown_state,
            pinned=slot.pinned,
            restarts=slot.restarts,
            last_error=slot.last_error,
            last_handoff=slot.last_handoff,
            vram_bytes=self._vram.model_bytes(snapshot, slot.name),
            cold_footprint_bytes=self._vram.footprint(slot.name),
            # None until its first worker said hello.
            backend=None if hello is None else BackendKind(hello.backend),
            fallback_reason="" if hello is None else hello.fallback_reason,
        )
        worker = slot.worker
        if worker is None:
            return self._host_ram(slot, report)
        live, stale_s = await self._live_status(worker)
        state = live.get("state")
        report = dataclasses.replace(
            report,
            state=report.state if state is None else ResidencyState(state),
            pid=live.get("pid", report.pid),
            queue=live.get("queue", report.queue),
            sequences=int(live.get("sequences") or 0),
            tokens_per_s=float(live.get("tokens_per_s") or 0.0),
            resident_bytes=live.get("resident_bytes", report.resident_bytes),
            capabilities=tuple(live.get("capabilities") or report.capabilities),
            **model_info_fields(live.get("model_info")),
            prompt_tokens_evaluated=live.get("prompt_tokens_evaluated", 0),
            served=live.get("served", 0),
            last_error=live.get("last_error") or slot.last_error,
            host_kv_bytes=int(live.get("host_kv_bytes") or 0),
            host_weights_bytes=int(live.get("host_weights_bytes") or 0),
            stale_s=stale_s,
            silent_s=self._silence(slot, worker),
            turn=Turn.from_json(live["turn"]) if isinstance(live.get("turn"), dict) else None,
            footprint=_footprint(live.get("footprint")),
        )
        return self._host_ram(slot, report)

    async def _live_status(self, worker: WorkerClient) -> tuple[dict[str, Any], float | None]:
        """The worker's status and None; or, from a worker that does not answer within
        STATUS_ANSWER_S (or left a question unanswered that long already), what it said last
        and how many seconds ago: a frozen worker never holds up status or /v1/models."""
        if not stale(worker.heard, time.monotonic()):
            try:
                return await worker.status(timeout_s=STATUS_ANSWER_S), None
            except ArbiterError:
                pass  # a timeout, or gone meanwhile: what it said last is all there is
        heard = worker.heard
        return heard.status, round(time.monotonic() - heard.answered_at, 1)

    def _silence(self, slot: Slot, worker: WorkerClient) -> float | None:
        """How long `slot`'s worker, holding a token, has shown no sign of life, once that is
        reported (at [daemon] holder_timeout_s); else None."""
        now, timeout_s = time.monotonic(), self.config.daemon.holder_timeout_s
        holds = self._holds(slot, worker)
        if judge(worker.heard, holds=holds, now=now, timeout_s=timeout_s) is Verdict.LIVE:
            return None
        return round(silent_s(worker.heard, now), 1)

    def _holds(self, slot: Slot, worker: WorkerClient) -> bool:
        """Whether `slot`'s worker holds a token another model may wait for (liveness.holds_token):
        a loading one is looked up in its devices' arenas, which only a loading one costs (a read
        of /proc/locks per device, as status's holder is read)."""
        holders: set[int] = set()
        if slot.residency is ResidencyState.LOADING and not slot.config.group:
            # A group's member loads through its open gate: the keeper holds the token for it.
            holders = self._token_holders(slot.config.devices)
        return holds_token(slot.residency, pid=worker.pid, holders=holders)

    def _token_holders(self, devices: Iterable[str]) -> set[int]:
        """The pids that hold the tokens of `devices`' arenas now."""
        holders = set()
        try:
            for device in canonical_order(devices):
                path = device_arena_of(device, self.config.daemon.arena)
                arena = self._device_arenas.get(path)
                if arena is None:
                    arena = self._device_arenas[path] = Arena(path)
                holder = arena.observe().holder_pid
                if holder is not None:
                    holders.add(holder)
        except ArbiterError as exc:  # an arena that cannot be read holds nobody we can judge
            log.warning("cannot read the arenas of %s: %s", ", ".join(devices), exc)
        return holders

    def _host_ram(self, slot: Slot, report: ModelStatus) -> ModelStatus:
        """`report` with the model's host RAM: its share of the file's copy (split between the
        models that use it, so the shares add up to the total) plus what its worker keeps on
        the host for it alone: the KV cache, and the weights an in-place release moved off the
        device."""
        own = report.host_kv_bytes + report.host_weights_bytes
        lease = slot.copy_lease
        if lease is None:
            return dataclasses.replace(report, host_ram_bytes=own or None)
        models = lease.copy.models()
        return dataclasses.replace(
            report,
            host_ram_bytes=lease.copy.size // len(models) + own,
            host_copy_bytes=lease.copy.size,
            host_copy_shared_with=tuple(m for m in models if m != slot.name),
        )

    async def command(
        self,
        name: str,
        model: str | None = None,
        on_news: NewsListener | None = None,
        *,
        pid: int | None = None,
    ) -> dict[str, Any]:
        if name in MODEL_COMMANDS:
            if not model:
                raise ControlError(f"{name} needs a model name")
            return await self._model_command(name, self._name(model), on_news)
        if name == "hold":
            return await self._take_hold()
        if name == "unhold":
            return self._give_back_hold()
        if name in ("yield", "resume"):
            return await self._aside_command(name, pid)
        if name == "reload":
            return await self._reload()
        if name == "shutdown":
            self.stopped.set()
            return {"stopping": True}
        raise ControlError(f"unknown command {name!r}")

    async def _aside_command(self, name: str, pid: int | None) -> dict[str, Any]:
        """`yield` (step aside for program `pid` until it exits) or `resume` (end a step
        aside now)."""
        if name == "resume":
            return self._aside.resume()
        if pid is None:
            raise ControlError("yield needs the pid of the program to step aside for")
        return await self._aside.yield_to(pid)

    async def _model_command(
        self, name: str, model: str, on_news: NewsListener | None = None
    ) -> dict[str, Any]:
        """`name` for `model` (by its name: the reply names it so, also when asked by alias);
        `on_news` is told what it waits for while the model waits for the GPU."""
        slot = self._router.slot_of(model)
        if name == "unload":
            unloading = self._lifecycle.unload(slot, "command")
            saved = await (
                unloading if on_news is None else self._waits.command(slot, unloading, on_news)
            )
            return {"model": model, "state": slot.shown_state, **saved}
        if name == "release" and slot.state in (SlotState.UNLOADING, SlotState.UNLOADED):
            return {"model": model, "state": slot.shown_state}  # not started to release it
        worker = await self._router.worker_of(model)
        if name in ("pin", "unpin"):
            self._slots[model].pin(name == "pin")
        asked = worker.request(name, timeout_s=COMMAND_TIMEOUT_S)
        result = await (asked if on_news is None else self._waits.command(slot, asked, on_news))
        return {"model": model, **result}

    async def _reload(self) -> dict[str, Any]:
        """Re-read the config file: start added models, stop removed ones, restart changed
        ones (a failed one too); the others keep serving undisturbed, also when only their
        aliases changed (those apply at once), and apply [yield]. [daemon] changes need a
        restart."""
        if self._reload_config is None:
            raise ControlError("this daemon was given no way to read its config again")
        async with self._config_lock:
            result = await self._reload_from(self._reload_config)
        self._unload_wake.set()  # unload_after_s may have changed, slots come and gone
        return result

    async def _reload_from(self, read: Callable[[], Config]) -> dict[str, Any]:
        """The reload, under the config lock, of the config `read` returns."""
        new = await asyncio.to_thread(read)
        if new.source is None:  # the embedded default, and still no file where it looks
            raise ControlError(
                f"running on the embedded default: there is no config file at "
                f"{default_config_path()}; write one there (`arbiterd install` writes a starter "
                f"with the GGUFs it finds), then `arbiterd reload`"
            )
        # The whole new config is checked before anything changes: a bad file applies nothing.
        warnings = await asyncio.to_thread(
            check_models, new, copy_held=self._lifecycle.host_copies.holds
        )
        await self._check_devices(new)
        for warning in warnings:
            log.warning("%s", warning)
        old = self.config.models
        added = [n for n in new.models if n not in old]
        removed = [n for n in old if n not in new.models]
        changed = [
            n
            for n in new.models
            if n in old
            and (not new.models[n].same_worker(old[n]) or self._slots[n].state is SlotState.FAILED)
        ]
        aliases_changed = [
            n for n in new.models if n in old and new.models[n].aliases != old[n].aliases
        ]
        fresh = {name: new_slot(new.models[name]) for name in added + changed}
        # Started below, once the old slots are gone; read now: a changed model loaded on
        # demand is served from the start of its old one's retire, and a request may start it.
        to_start = [slot for slot in fresh.values() if slot.state is SlotState.STARTING]
        try:
            # Before the old slots let theirs go: a changed model whose file is gone from disk
            # restarts from the copy its old worker still holds.
            await asyncio.gather(*(self._lifecycle.hold_copy(slot) for slot in fresh.values()))
        except ArbiterError as exc:
            for slot in fresh.values():
                self._lifecycle.drop_copy(slot)
            raise ControlError(f"reload applied nothing: {exc}") from None
        for name in removed + changed:
            retired = self._slots.pop(name)
            self._vram.model_removed(name)
            self._handoffs.forget(name)
            retiring = asyncio.get_running_loop().create_task(self._lifecycle.retire(retired))
            if name in changed:
                # Its new slot serves the name from now on: a request waits for the new worker
                # (routing.py), which starts once the old one has stopped (issue 40: the name
                # was missing for the retire, and requests got 404 for a configured model).
                fresh[name].replacing(retiring)
                self._slots[name] = fresh[name]
            await retiring
            if name in removed:  # no config left to restore its prompt cache into
                await self._lifecycle.forget_prompt_cache(name)
        await self._stop_changed_keepers(new)
        self.config = Config(
            daemon=self.config.daemon,
            models=new.models,
            source=new.source,
            groups=new.groups,
            yield_rules=new.yield_rules,
            devices=new.devices,
        )
        await self._aside.apply(new.yield_rules)
        self._start_missing_keepers()
        for name, slot in self._slots.items():  # kept: the same worker, perhaps new aliases
            slot.reconfigure(new.models[name])
        for name, slot in fresh.items():
            self._slots[name] = slot
            self.metrics.add_model(name, slot.config.devices)
            if slot.state is SlotState.UNLOADED:  # held only to outlive the old slot's copy
                self._lifecycle.drop_copy(slot)
        await asyncio.gather(*(self._start(slot) for slot in to_start))
        self._bus.publish(
            ReloadEvent(
                added=tuple(added),
                removed=tuple(removed),
                changed=tuple(changed),
                aliases_changed=tuple(aliases_changed),
                warnings=tuple(warnings),
            )
        )
        return {
            "added": added,
            "removed": removed,
            "changed": changed,
            "aliases_changed": aliases_changed,
            "warnings": warnings,
        }

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
                await slot.worker.request("release", timeout_s=COMMAND_TIMEOUT_S)
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

    async def _unload_idle(self) -> None:
        """Unload each model that stayed cold and idle for its unload_after_s (issue 14).

        Sleeps until the first model is due (next_unload_check), or until woken because one
        may be due sooner (`_unload_wake`): a daemon none of whose models is cold with an
        unload_after_s never wakes for it (issue 29)."""
        retry: dict[str, float] = {}  # found due but not unloaded: looked at again then
        while True:
            self._unload_wake.clear()  # before the slots are read: a change after it wakes
            at = next_unload_check(self._slots.values(), retry)
            delay_s = None if at is None else max(0.0, at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await self._unload_wake.wait()
            now = time.monotonic()
            due = [s for s in self._slots.values() if unload_due(s, now)]
            retry = {s.name: retry[s.name] for s in due if s.name in retry}
            for slot in due:
                if retry.get(slot.name, now) <= now:
                    later = await self._unload_if_idle(slot, now)
                    if later is None:
                        retry.pop(slot.name, None)
                    else:
                        retry[slot.name] = later

    async def _unload_if_idle(self, slot: Slot, now: float) -> float | None:
        """Unload `slot`, due at `now`, if its worker is idle; else when to look again (None:
        no need, its residency changed meanwhile, which wakes the watch)."""
        worker = slot.worker
        assert worker is not None  # ready
        if self._lifecycle.unload_refusal(slot):
            # Its file is gone: it stays (`unload` says why, when asked), unless the file is
            # back by the next look.
            return now + slot.config.unload_after_s
        try:
            live = await worker.status(timeout_s=STATUS_TIMEOUT_S)
            # A request may wait cold for the GPU: not idle.
            if live.get("queue") or live.get("current"):
                return now + UNLOAD_RETRY_S
            if unload_due(slot, now):
                await self._lifecycle.unload(slot, "idle")
        except ArbiterError as exc:
            log.warning("%s: could not unload it: %s", slot.name, exc)
            return now + slot.config.unload_after_s
        return None

    async def _watch_holders(self) -> None:
        """Ask every worker that holds a token (warm, loading, warming, cooling: issues 24, 40)
        for its status each quarter of [daemon] holder_timeout_s (one question in flight per
        worker: a frozen one is sent no more) and apply the verdict on each (liveness.judge):
        one silent for holder_timeout_s is reported, and killed once silent twice that long, so
        the kernel frees its token and the lifecycle restarts it as after any crash. Only the
        holders are asked, and a reported one until it is said to live again: `judge` finds
        every other worker live, and asking it would wake it and the daemon for nothing (issue
        29); `status` asks everyone."""
        reported: set[WorkerClient] = set()  # the silent ones, each said once per silence
        while True:
            await asyncio.sleep(ping_interval_s(self.config.daemon.holder_timeout_s))
            now = time.monotonic()
            workers = [(slot, slot.worker) for slot in self._slots.values()]
            reported &= {worker for _, worker in workers if worker is not None}
            for slot, worker in workers:
                if worker is None:
                    continue
                holds = self._holds(slot, worker)
                if holds or worker in reported:
                    worker.ask()
                    self._judge(slot, worker, holds, now, reported)

    def _judge(
        self,
        slot: Slot,
        worker: WorkerClient,
        holds: bool,
        now: float,
        reported: set[WorkerClient],
    ) -> None:
        timeout_s = self.config.daemon.holder_timeout_s
        heard = worker.heard
        verdict = judge(heard, holds=holds, now=now, timeout_s=timeout_s)
        state = slot.residency or ResidencyState.LOADING
        if verdict is Verdict.LIVE:
            if worker in reported:
                reported.discard(worker)
                log.warning("%s shows signs of life again", slot.name)
            return
        silent = silent_s(heard, now)
        if verdict is Verdict.SILENT and worker not in reported:
            reported.add(worker)
            log.warning(
                "%s (pid %d, %s) holds the GPU and has shown no sign of life for %.1f s; "
                "it is killed at %g s",
                slot.name,
                worker.pid,
                state.value,
                silent,
                2 * timeout_s,
            )
        elif verdict is Verdict.KILL and not worker.killed_for:
            reason = kill_reason(silent, timeout_s, state)
            log.error("%s (pid %d) %s", slot.name, worker.pid, reason)
            worker.kill_for(reason)  # the lifecycle's watch of its exit restarts the model
        else:
            return  # said already
        self._bus.publish(
            HolderSilentEvent(
                model=slot.name,
                pid=worker.pid,
                silent_s=round(silent, 3),
                timeout_s=timeout_s,
                killed=verdict is Verdict.KILL,
                state=state.value,
            )
        )

    def _want_ram_check(self) -> None:
        """Look at the host RAM budget soon (a model went cold, or one loaded)."""
        if self.config.daemon.host_ram_budget_bytes <= 0:
            return
        self._ram_check_again = True
        if self._ram_check is None or self._ram_check.done():
            self._ram_check = self._spawn(self._ram_checks())

    async def _ram_checks(self) -> None:
        while self._ram_check_again:
            self._ram_check_again = False
            try:
                await self._keep_ram_budget()
            except ArbiterError as exc:
                log.warning("host RAM budget: %s", exc)

    async def _keep_ram_budget(self) -> None:
        """Unload the least recently used cold, idle models while the host copies and what the
        workers keep on the host (KV caches, weights' own copies) exceed [daemon] host_ram_budget
        (issue 14); each goes through the unload path, so its prompt cache waits on disk."""
        budget = self.config.daemon.host_ram_budget_bytes
        ready = [s for s in self._slots.values() if s.worker is not None]
        lives = await asyncio.gather(
            *(s.worker.status(timeout_s=STATUS_TIMEOUT_S) for s in ready if s.worker),
            return_exceptions=True,
        )
        copies = self._lifecycle.host_copies.leases()
        key = {id(copy): str(n) for n, (copy, _) in enumerate(copies)}
        own_bytes, cold = 0, []
        for slot, live in zip(ready, lives, strict=True):
            if isinstance(live, BaseException):
                continue  # a worker that does not answer is not unloaded by guesswork
            own = int(live.get("host_kv_bytes") or 0) + int(live.get("host_weights_bytes") or 0)
            own_bytes += own
            idle = not live.get("queue") and not live.get("current")
            if (
                slot.residency is ResidencyState.COLD
                and slot.cold_since is not None
                and idle
                and not slot.pinned
                and not self._lifecycle.unload_refusal(slot)
            ):
                lease = slot.copy_lease
                copy = None if lease is None else key.get(id(lease.copy))
                cold.append(ColdModel(slot.name, slot.cold_since, own, copy))
        plan = ram_plan(
            budget,
            copies={key[id(c)]: CopyUse(c.size, leases) for c, leases in copies},
            own_bytes=own_bytes,
            cold=cold,
        )
        if not plan.over:
            return
        if not plan.unload:
            log.info(
                "host RAM %d bytes over its budget %d bytes, and no cold, idle model to unload",
                plan.used_bytes,
                budget,
            )
            return
        log.info(
            "host RAM %d bytes over its budget %d bytes: unloading %s",
            plan.used_bytes,
            budget,
            ", ".join(plan.unload),
        )
        self._bus.publish(
            RamBudgetEvent(
                used_bytes=plan.used_bytes,
                budget_bytes=budget,
                unload=plan.unload,
                after_bytes=plan.after_bytes,
            )
        )
        for name in plan.unload:
            victim = self._slots.get(name)
            # Woken meanwhile (or gone): it is in use again, not least recently used.
            if (
                victim is None
                or victim.residency is not ResidencyState.COLD
                or victim.worker is None
            ):
                continue
            await self._lifecycle.unload(victim, "host_ram_budget")

    async def _pin_again(self, slot: Slot, worker: WorkerClient) -> None:
        try:
            await worker.request("pin")
        except ArbiterError as exc:
            log.warning("%s: could not pin its new worker: %s", slot.name, exc)

    def _on_gone(self, slot: Slot, worker: WorkerClient) -> None:
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
        self._unload_wake.set()  # cold now, or no longer: its unload is due at another time
        if event.to_state is ResidencyState.COLD or event.from_state is ResidencyState.LOADING:
            self._want_ram_check()
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

    def _on_leak(self, event: Event) -> None:
        log.warning("VRAM not freed after release: %s", event.to_json())
        self._bus.publish(event)


def _footprint(raw: object) -> ModelFootprint | None:
    """A worker status's "footprint" (issue 44) with the prediction's error; None from a worker
    that does not say."""
    if not isinstance(raw, dict):
        return None
    said = ModelFootprint.from_json(raw)
    return ModelFootprint.of(said.predicted, said.measured)
