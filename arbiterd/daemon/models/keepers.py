"""The keepers the daemon runs for its models: one per [groups.NAME] table (the group's gate, on
gpu0's arena) and one per [devices.ID] table with members (the fitting set's, issue 44, on that
device's arena), and each fitting set's budget as last measured.

Owns the keepers (arena/groups.py's `Keeper`, each a thread of its own) and the budgets: starts
and stops them as the config comes and goes, gives each fitting keeper its budget at every
telemetry reading (budgets.device_budget decides it, a pure function), and says what they do for
status. Refuses, before anything changes, a config whose fitting sets cannot work
(`check_devices`). Reads the config through the getter it is given: the supervisor owns it, and
a reload replaces it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from arbiterd.arena import Arena
from arbiterd.arena.groups import Keeper
from arbiterd.config import FITTING_GROUP, Config, DeviceConfig, GroupConfig
from arbiterd.daemon.models.budgets import (
    DeviceBudget,
    Measured,
    device_budget,
    measured_device,
    measured_host,
)
from arbiterd.daemon.observe.telemetry import TelemetrySnapshot
from arbiterd.daemon.observe.vramwatch import VramWatch
from arbiterd.errors import ConfigError, DeviceUnreachableError
from arbiterd.native import rpc
from arbiterd.paths import DEFAULT_DEVICE, DeviceId, DeviceKind, device_arena_of, parse_device_id
from arbiterd.render import format_bytes
from arbiterd.status import GroupStatus
from arbiterd.tomltable import key_path

log = logging.getLogger(__name__)


class Keepers:
    """The groups' and the fitting sets' keepers, and the fitting sets' budgets."""

    def __init__(self, arena: Arena, vram: VramWatch, config: Callable[[], Config]) -> None:
        self._arena = arena  # gpu0's: the groups' keepers hold its token (groups are on gpu0)
        self._vram = vram
        self._config = config  # as it is now: a reload replaces it
        self._keepers: dict[str, Keeper] = {}  # by group: each holds the token for its members
        self._fitting: dict[str, Keeper] = {}  # by device: the keeper of its fitting set
        # Each fitting set's budget as last measured, by device: replaced whole (the sampler's
        # thread writes it, status reads it).
        self._budgets: dict[str, DeviceBudget] = {}

    @property
    def config(self) -> Config:
        return self._config()

    def _start_keeper(self, group: GroupConfig) -> None:
        keeper = Keeper(self._arena, group.name, priority=group.priority)
        keeper.start()
        self._keepers[group.name] = keeper

    async def stop_changed(self, new: Config) -> None:
        """A group or fitting set whose members, class or budget change in `new` gets a new
        keeper: the old one stops here, once its old members left (start_missing starts the
        new one). Called before the config is replaced."""
        old = self.config
        await self._stop_keepers([n for n, g in old.groups.items() if new.groups.get(n) != g])
        await self._stop_fitting([d for d, c in old.devices.items() if new.devices.get(d) != c])

    def start_missing(self) -> None:
        """A keeper for each group and fitting set of the config that has none yet."""
        for name, group in self.config.groups.items():
            if name not in self._keepers:
                self._start_keeper(group)
        for device_id, device in self.config.devices.items():
            if device_id not in self._fitting:
                self._start_fitting(device)

    async def stop(self) -> None:
        """Stop every keeper (once the models are stopped)."""
        await self._stop_keepers(list(self._keepers))
        await self._stop_fitting(list(self._fitting))

    def _start_fitting(self, device: DeviceConfig) -> None:
        """The keeper of a device's fitting set (issue 44), in that device's arena, when the
        set has members; its budget as the latest reading measures it (fit_budgets keeps it
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

    def fit_budgets(self, snapshot: TelemetrySnapshot) -> None:
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

    async def check_devices(self, config: Config) -> None:
        """Refuse a config whose fitting sets cannot work: a [devices.ID] reserve not less than
        the device's memory as measured now (config/sharing.py refuses one against its `memory`), or
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

    def status(self) -> tuple[GroupStatus, ...]:
        """What each keeper does now: status `groups`."""
        return tuple(
            GroupStatus(
                name=group.name,
                models=tuple(group.models),
                priority=group.priority,
                holds_token=keeper.holding,
                handoffs=keeper.handoffs,
                failure=keeper.failure,
                device=DEFAULT_DEVICE,  # a [groups] table's models are on gpu0 (config/sharing.py)
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
            priority=keeper.priority,
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
