"""Everything the tray shows, as one object fed by status snapshots and events: pure, no Qt.

Owns what the icon, the tooltip, the menu and the dashboard derive from the daemon — who holds
the GPU, how full it is, which warnings are active, whether the daemon can be reached — so each
of those is a function of this state and a time, tested without a socket or a window.

Warnings (the icon turns amber while one is active):
    a model in state failed / restarting        while the status says so
    a warm model's worker silent (`silent_s`)   while the status says so (issue 24)
    a group whose keeper stopped                while the status says so
    vram_not_freed                              WARNING_HOLD_S, or until that model is warm again
    worker (a crash or a failed start)          WARNING_HOLD_S, or until that model is warm again
    residency to failed                         WARNING_HOLD_S, or until that model is warm again
    holder_silent (reported, then killed)       WARNING_HOLD_S, or until that model is warm again

Notices (shown once in the tooltip, the menu and the dashboard; the icon stays as it is,
because they describe the setup, not something that just went wrong):
    the engine's `cpu_warning` in the status     while the status says so: models that ask for
                                                 GPU layers run on the CPU of a machine with a
                                                 GPU (offload.py; one cause, said once, issue 30)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from arbiterd import render
from arbiterd.events import (
    Event,
    HolderSilentEvent,
    ResidencyEvent,
    VramNotFreedEvent,
    WorkerEvent,
)
from arbiterd.gui import palette
from arbiterd.gui.history import DEFAULT_WINDOW_S, History
from arbiterd.gui.palette import RGB, ModelColours
from arbiterd.states import ResidencyState, SlotState
from arbiterd.status import HOLD_HOLDER_NAME, DaemonStatus, ModelStatus

WARNING_HOLD_S = 300.0


@dataclass(frozen=True)
class ActiveWarning:
    """One active warning: `model` clears it when that model is warm again."""

    text: str
    at: float
    model: str | None


@dataclass(frozen=True)
class IconLook:
    """What the tray icon shows; `icon.render_icon` draws it."""

    frame: RGB  # the holder's colour, or amber / red / the free colour
    fill_colour: RGB  # the holder's colour (grey for other processes)
    fill: float  # 0..1: how full the VRAM is
    unreachable: bool = False
    warning: bool = False


class TrayState:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.status: DaemonStatus | None = None
        self.reachable = False
        self.unreachable_reason = "connecting to arbiterd…"
        self.history = History(window_s=window_s)
        self._warnings: dict[tuple[str, str | None], ActiveWarning] = {}

    # -- feeding -------------------------------------------------------------------------------

    def apply_status(self, raw: Mapping[str, Any], at: float) -> None:
        self.status = DaemonStatus.from_json(raw)
        self.reachable = True
        self.history.add_status(self.status, at)

    def apply_event(self, event: Event) -> bool:
        """Apply one event; False when it was already seen (a journal event that also came live)."""
        if not self.history.add_event(event):
            return False
        at = event.at or 0.0
        # The kinds that may warn (render.failure) are each about one model.
        about = ResidencyEvent | WorkerEvent | VramNotFreedEvent | HolderSilentEvent
        model = event.model if isinstance(event, about) else None
        warm = isinstance(event, ResidencyEvent) and event.to_state is ResidencyState.WARM
        if warm and model is not None:
            # Warm again: whatever went wrong with it before is over.
            self._warnings = {k: w for k, w in self._warnings.items() if w.model != model}
        failure = render.failure(event)
        if failure is not None:
            summary, body = failure
            self._warnings[(summary, model)] = ActiveWarning(f"{summary}: {body}", at, model)
        return True

    def set_unreachable(self, reason: str) -> None:
        self.reachable = False
        self.unreachable_reason = reason

    # -- reading -------------------------------------------------------------------------------

    def warnings(self, now: float) -> list[str]:
        self._warnings = {k: w for k, w in self._warnings.items() if now - w.at <= WARNING_HOLD_S}
        texts = [w.text for w in sorted(self._warnings.values(), key=lambda w: w.at)]
        if self.status is not None:
            for model in self.status.troubled:
                line = f"{model.name} is {model.state}"
                if model.last_error:
                    line += f": {model.last_error}"
                texts.insert(0, line)
            for model in self.status.models:
                if model.silent_s is not None:
                    texts.insert(0, render.silence(model.name, model.silent_s))
            for group in self.status.groups:
                if group.failure:
                    texts.insert(0, f"group {group.name}: its keeper stopped: {group.failure}")
        return texts

    def notices(self) -> list[str]:
        """What the setup costs and what would help: the engine's one warning, or nothing."""
        engine = self.status.engine if self.status is not None else None
        return [engine.cpu_warning] if engine is not None and engine.cpu_warning else []

    def engine_text(self) -> str | None:
        """What the daemon's engine runs on (on a machine without a GPU, that it has none), or
        None when it does not say."""
        engine = self.status.engine if self.status is not None else None
        if engine is None:
            return None
        return render.engine_line(engine.offload, engine.devices, engine.cpu_cause, engine.cpu_note)

    def memory_name(self) -> str:
        """What the models' bytes are called: "VRAM" only of a GPU's (DaemonStatus.memory_name)."""
        return "memory" if self.status is None else self.status.memory_name

    def drawn_models(self) -> list[str]:
        """The models the timeline draws: those of the daemon it talks to, as its status lists
        them (a model of a daemon that stopped, or one a reload removed, keeps its history in
        the table but has no band: the chart says what `arbiterd status` says); before any
        status, every model the history knows."""
        if self.status is None:
            return list(self.history.models)
        return [m.name for m in self.status.models]

    def not_served(self, *names: str | None) -> list[str]:
        """Those of `names` the daemon it talks to does not serve now (none before a status)."""
        status = self.status
        if status is None:
            return []
        return [n for n in names if n is not None and status.model(n) is None]

    def colours(self) -> ModelColours:
        """Each model's colour: the daemon's models pick first, in its order (history lists
        them first once a status came), then any other owner the history holds."""
        return palette.model_colours(self.history.models)

    def holder_colour(self) -> RGB:
        status = self.status
        if status is None or status.holder is None:
            return palette.FREE
        if status.holder_model is not None:
            return self.colours().of(status.holder_model)
        group = status.holder_group
        if group is not None and group.models:  # our models, warm together: the first's colour
            return self.colours().of(group.models[0])
        return palette.OTHER

    def fill(self, now: float) -> float:
        """How full the VRAM is, 0..1: of the devices' memory once telemetry reports it, else
        of the most this window has seen in use (a relative level, still telling warm from
        cold)."""
        if self.status is None:
            return 0.0
        used = self.status.used_bytes
        total = self.status.total_bytes or self.history.total_bytes
        if total is None:
            total = max(self.history.peak_bytes(now), used)
        return 0.0 if total <= 0 else min(1.0, used / total)

    def icon_look(self, now: float) -> IconLook:
        if not self.reachable:
            return IconLook(palette.RED, palette.RED, 0.0, unreachable=True)
        colour = self.holder_colour()
        if self.warnings(now):
            return IconLook(palette.AMBER, colour, self.fill(now), warning=True)
        return IconLook(colour, colour, self.fill(now))

    def holder_text(self) -> str:
        status = self.status
        if not self.reachable or status is None:
            return "daemon not running"
        aside = status.stepped_aside
        if aside is not None:  # issue 45: whoever holds the token at this instant
            used = "" if aside.used_bytes is None else f" ({render.format_bytes(aside.used_bytes)})"
            return f"stepped aside for {aside.program or 'a program'}{used}"
        if status.holder is None:
            return "GPU free"
        if status.hold or status.holder.name == HOLD_HOLDER_NAME:
            return "GPU held for you (game mode)"
        return f"GPU: {self._holder_name(status)}"

    @staticmethod
    def _holder_name(status: DaemonStatus) -> str:
        """Who holds the GPU, when it is neither the user's hold nor a step aside."""
        assert status.holder is not None
        if status.holder_model is not None:
            return status.holder_model
        group = status.holder_group
        if group is not None and group.fitting:  # a device's fitting set (issue 44)
            return f"{', '.join(group.warm) or 'nobody'} warm together (they fit)"
        if group is not None:
            return f"group {group.name} — {', '.join(group.models)}"
        return render.process(status.holder.name or "another program", status.holder.pid)

    def vram_text(self) -> str:
        """The memory in use, of the devices' total when telemetry reports it; "RAM" where the
        models run on the CPU, "VRAM" only of a GPU's."""
        status = self.status
        if status is None:
            return "memory: unknown"
        name = status.memory_name
        used = render.format_bytes(status.used_bytes)
        total = status.total_bytes
        if total is None:
            return f"{name}: {used} (models' own count)"
        return f"{name}: {used} / {render.format_bytes(total)}"

    def host_ram_text(self) -> str | None:
        """The host RAM the daemon keeps (host copies and KV) and its budget, or None when it
        does not say."""
        status = self.status
        if status is None or status.host_ram_bytes is None:
            return None
        text = f"host RAM: {render.format_bytes(status.host_ram_bytes)}"
        if status.host_ram is None:  # a daemon from before issue 14's budgets
            return text
        budget = status.host_ram.budget_bytes
        return text + (f" of {render.format_bytes(budget)} budget" if budget else " (no budget)")

    def host_ram_parts_text(self) -> str | None:
        """What the host RAM is made of, as `arbiterd status` says it, or None when the daemon
        does not break it down."""
        ram = self.status.host_ram if self.status is not None else None
        if ram is None:
            return None
        return (
            f"model file copies {render.format_bytes(ram.host_copies_bytes)} (each counted once) + "
            f"KV caches kept on the host {render.format_bytes(ram.host_kv_bytes)} + "
            f"weights' own copies {render.format_bytes(ram.host_weights_bytes)}"
        )

    def fitting_texts(self) -> list[str]:
        """Each device's fitting set (issue 44): who is warm on it together, and the room they
        take of its budget."""
        groups = self.status.groups if self.status is not None else ()
        return [
            f"{g.device}: {', '.join(g.warm) or 'nobody'} warm · "
            f"{render.format_bytes(g.used_bytes)} of {render.fitting_budget(g)}"
            for g in groups
            if g.fitting
        ]

    def prompt_cache_text(self) -> str | None:
        """The prompt caches kept on disk against their budget, or None when it does not say."""
        cache = self.status.prompt_cache if self.status is not None else None
        if cache is None:
            return None
        files = f"{cache.files} file{'s' if cache.files != 1 else ''}"
        return (
            f"prompt cache on disk: {render.format_bytes(cache.bytes_)} in {files} of "
            f"{render.format_bytes(cache.budget_bytes)} budget"
        )

    def holding_text(self, model: ModelStatus) -> str | None:
        """How `model` holds the GPU: "holds the GPU", with its group's other members when it
        holds it with them ("holds the GPU with nomic (group rag)"); None when it does not."""
        status = self.status
        if status is None:
            return None
        if status.holder_model == model.name:
            return "holds the GPU"
        group = status.holder_group
        # A fitting set's members hold it while warm in it; a group's, all of them.
        holding = group.warm if group is not None and group.fitting else ()
        if group is None or model.name not in (holding or group.models):
            return None
        others = [name for name in holding or group.models if name != model.name]
        with_ = f" with {', '.join(others)}" if others else ""
        why = f"they fit on {group.device}" if group.fitting else f"group {group.name}"
        return f"holds the GPU{with_} ({why})"

    def unloaded_text(self, model: ModelStatus) -> str | None:
        """What is left of an unloaded model (issue 14), or None when it is not unloaded."""
        if not model.unloaded:
            return None
        if model.state is SlotState.UNLOADING:
            return "unloading — saving its prompt cache"
        return "unloaded — " + self._prompt_cache_fate(model.name)

    def _prompt_cache_fate(self, model: str) -> str:
        """Whether `model`'s prompt cache is on disk, as its last `unload` event said and no
        `prompt_cache_evict` undid."""
        unload, evicted = self.history.prompt_cache_kept(model)
        if unload is None:  # loaded on demand and not started yet, or unloaded long ago
            return "starts on its next request"
        if unload.error:
            return f"prompt cache not kept: {unload.error}"
        if evicted:
            return "prompt cache evicted for room on disk"
        if not unload.kv_bytes:
            return "no prompt cache to keep"
        tokens = f"{unload.tokens} tokens, " if unload.tokens is not None else ""
        return f"prompt cache on disk ({tokens}{render.format_bytes(unload.kv_bytes)})"

    def encoder_text(self, model: str) -> str | None:
        """`model`'s projector at its last image (issue 12), or None when it has not run."""
        record = self.history.last_encoder.get(model)
        if record is None:
            return None
        return render.encoder_steps(record.steps) + f" (at {render.clock(record.at)})"

    def waiters_text(self) -> str:
        waiters = self.status.waiters if self.status is not None else ()
        return render.waiters_line([(w.name, w.pid) for w in waiters])

    def tooltip(self, now: float) -> str:
        if not self.reachable:
            return f"arbiterd — daemon not running\n{self.unreachable_reason}"
        lines = ["arbiterd — " + self.holder_text(), self.vram_text(), *self.fitting_texts()]
        lines += [t for t in (self.host_ram_text(), self.prompt_cache_text()) if t is not None]
        lines.append(self.waiters_text())
        lines += [f"⚠ {w}" for w in self.warnings(now) + self.notices()]
        return "\n".join(lines)
