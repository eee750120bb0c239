"""`arbiterd reload`: a re-read config applied to the running daemon (configwatch.py applies a
saved file the same way).

Owns the order of a reload: the whole new config is checked before anything changes (a bad
file applies nothing); which models are added, removed, changed or only renamed is a pure
function of the old and new [models] tables (`plan_reload`); removed and changed models retire
their slots, changed ones are served by their new slot from the start of that retire (issue
40), the keepers and [yield] follow the new config, added and changed models start, and one
`reload` event says what changed. [daemon] changes need a restart: its table is kept.

Composes the rooms as the supervisor does, and acts only through their methods: the slots are
the supervisor's (this module replaces entries, as the supervisor would), the config is the
supervisor's too, replaced through the setter it is given.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Coroutine, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from arbiterd.config import Config, ModelConfig, default_config_path
from arbiterd.daemon.models.handoffs import Handoffs
from arbiterd.daemon.models.keepers import Keepers
from arbiterd.daemon.models.lifecycle import Lifecycle
from arbiterd.daemon.models.modelfile import check_models
from arbiterd.daemon.models.slots import Slot, new_slot
from arbiterd.daemon.observe.metrics import Metrics
from arbiterd.daemon.observe.vramwatch import VramWatch
from arbiterd.daemon.stepaside.aside import StepAside
from arbiterd.errors import ArbiterError, ControlError
from arbiterd.events import Event, ReloadEvent
from arbiterd.states import SlotState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReloadPlan:
    """Which configured models a reload adds, removes, restarts (`changed`: a new worker) and
    renames (`aliases_changed`: applied at once, the worker kept unless it changed too)."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    aliases_changed: tuple[str, ...]


def plan_reload(
    old: Mapping[str, ModelConfig], new: Mapping[str, ModelConfig], failed: Collection[str]
) -> ReloadPlan:
    """What a reload from the [models] table `old` to `new` does; a model in `failed` (its slot
    FAILED) restarts though its table did not change."""
    return ReloadPlan(
        added=tuple(n for n in new if n not in old),
        removed=tuple(n for n in old if n not in new),
        changed=tuple(
            n for n in new if n in old and (not new[n].same_worker(old[n]) or n in failed)
        ),
        aliases_changed=tuple(n for n in new if n in old and new[n].aliases != old[n].aliases),
    )


class Reload:
    """Applies a re-read config to the running daemon (one at a time: the caller holds the
    supervisor's config lock)."""

    def __init__(
        self,
        *,
        slots: MutableMapping[str, Slot],
        config: Callable[[], Config],
        replace_config: Callable[[Config], None],
        start: Callable[[Slot], Coroutine[Any, Any, None]],
        lifecycle: Lifecycle,
        keepers: Keepers,
        vram: VramWatch,
        handoffs: Handoffs,
        aside: StepAside,
        metrics: Metrics,
        publish: Callable[[Event], object],
    ) -> None:
        self._slots = slots
        self._config = config
        self._replace_config = replace_config
        self._start = start  # a new slot's worker, unless it is loaded on demand
        self._lifecycle = lifecycle
        self._keepers = keepers
        self._vram = vram
        self._handoffs = handoffs
        self._aside = aside
        self._metrics = metrics
        self._publish = publish

    async def apply(self, read: Callable[[], Config]) -> dict[str, Any]:
        """The reload of the config `read` returns: start added models, stop removed ones,
        restart changed ones (a failed one too); the others keep serving undisturbed, also
        when only their aliases changed (those apply at once), and apply [yield]."""
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
        await self._keepers.check_devices(new)
        for warning in warnings:
            log.warning("%s", warning)
        failed = [n for n, slot in self._slots.items() if slot.state is SlotState.FAILED]
        plan = plan_reload(self._config().models, new.models, failed)
        removed, changed = plan.removed, plan.changed
        # In a thread: a slot reads its GGUF's header (whether it serves embeddings) as it is made.
        fresh = await asyncio.to_thread(
            lambda: {name: new_slot(new.models[name]) for name in plan.added + changed}
        )
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
        await self._keepers.stop_changed(new)
        self._replace_config(
            Config(
                daemon=self._config().daemon,
                models=new.models,
                source=new.source,
                groups=new.groups,
                yield_rules=new.yield_rules,
                devices=new.devices,
            )
        )
        await self._aside.apply(new.yield_rules)
        self._keepers.start_missing()
        for name, slot in self._slots.items():  # kept: the same worker, perhaps new aliases
            slot.reconfigure(new.models[name])
        for name, slot in fresh.items():
            self._slots[name] = slot
            self._metrics.add_model(name, slot.config.devices)
            if slot.state is SlotState.UNLOADED:  # held only to outlive the old slot's copy
                self._lifecycle.drop_copy(slot)
        await asyncio.gather(*(self._start(slot) for slot in to_start))
        self._publish(
            ReloadEvent(
                added=plan.added,
                removed=removed,
                changed=changed,
                aliases_changed=plan.aliases_changed,
                warnings=tuple(warnings),
            )
        )
        return {
            "added": list(plan.added),
            "removed": list(removed),
            "changed": list(changed),
            "aliases_changed": list(plan.aliases_changed),
            "warnings": warnings,
        }
