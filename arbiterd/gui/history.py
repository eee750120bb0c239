"""What happened on the GPU lately: VRAM by owner over time, and every handoff with its cost.

Owns the dashboard's memory of the last minutes, fed from three sources that may overlap: the
daemon's journal (asked for over the control socket when the tray connects and when a window
opens), live events, and status snapshots. Status snapshots are the truth about bytes when there
are any; between them (and in the journal, which has no snapshots) residency events move a
model's bytes: to what its worker says it holds once moved (`resident_bytes`; an older daemon's
event: to `warm` with the bytes the move reported, to `cold` zero), to zero once it failed or
stopped.
Handoffs and waits are the daemon's own `handoff` and `wait` events, as measured by the model
that got the GPU; nothing here infers one. A vision request's projector steps (`encoder` events,
issue 12) are one record per request; an `unload` (issue 14) empties its model's bytes, and the
last one of each model is kept, with the `prompt_cache_evict` events that removed what it saved,
so the card of an unloaded model can say whether its prompt cache is still on disk. An event
seen twice (journal and live) counts once.

Pure bookkeeping, no Qt, no clock of its own: callers pass the times.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Collection
from dataclasses import dataclass, field

from arbiterd import render
from arbiterd.events import (
    EncoderEvent,
    Event,
    HandoffEvent,
    HoldEvent,
    PromptCacheEvictEvent,
    RequestEvent,
    ResidencyEvent,
    UnloadEvent,
    WaitEvent,
)
from arbiterd.states import ResidencyState
from arbiterd.status import DaemonStatus

DEFAULT_WINDOW_S = 600.0
# How far before the window the tray asks for history, so the window starts with each model's
# bytes (its last residency event may be older than the window).
HISTORY_LEAD_S = 3600.0
MAX_HANDOFFS = 500
MAX_ENCODER_RECORDS = 500
# A worker that failed or stopped holds nothing, whatever its event says it held as it went.
_GONE_STATES = frozenset({ResidencyState.FAILED, ResidencyState.STOPPED})


@dataclass(frozen=True)
class Sample:
    """VRAM by owner from `at` until the next sample."""

    at: float
    models: tuple[tuple[str, int], ...]  # (model, bytes), in the daemon's model order
    others_bytes: int  # everything that is not a model: shown grey

    @property
    def total_bytes(self) -> int:
        return self.bytes_of(None)

    def bytes_of(self, owners: Collection[str] | None) -> int:
        """What `owners` (None: every model) and other processes hold."""
        held = (b for name, b in self.models if owners is None or name in owners)
        return sum(held) + self.others_bytes


@dataclass
class HandoffRecord:
    """The GPU came to `to_model`: from another model (a `handoff` event), or after it waited
    behind a program that is not a model (a `wait` event). `at` is when the daemon said so."""

    event: HandoffEvent | WaitEvent
    at: float
    to_model: str
    tokens_evaluated: int | None = None  # prompt tokens the next request of to_model evaluated

    @property
    def from_model(self) -> str | None:
        """The model that held the GPU; None after a wait behind another program."""
        return self.event.from_model if isinstance(self.event, HandoffEvent) else None

    @property
    def title(self) -> str:
        return render.handoff_title(self.event)

    @property
    def label(self) -> str:
        return render.handoff_label(self.event)

    @property
    def release_s(self) -> float | None:
        return self.event.release_s if isinstance(self.event, HandoffEvent) else None

    @property
    def wait_s(self) -> float | None:
        return self.event.wait_s

    @property
    def restore_s(self) -> float | None:
        return self.event.restore_s if isinstance(self.event, HandoffEvent) else None

    @property
    def bytes_(self) -> int | None:
        """What the restore moved onto the device (weights + KV), when the daemon said."""
        return self.event.restored_bytes if isinstance(self.event, HandoffEvent) else None

    @property
    def total_s(self) -> float:
        return self.event.total_s

    @property
    def started_at(self) -> float:
        """When the model began waiting: measured, or (an older daemon's) `at` less the total."""
        waited_from = self.event.waited_from
        return self.at - self.total_s if waited_from is None else waited_from


@dataclass
class EncoderRecord:
    """What `model`'s projector did for one request (`request_id`), its `encoder` events in the
    order the worker sent them (load, encode, free; a resident projector only encodes)."""

    model: str
    request_id: str | None
    steps: list[EncoderEvent] = field(default_factory=list)

    @property
    def at(self) -> float:
        """When its first step was reported."""
        return self.steps[0].at or 0.0

    @property
    def total_s(self) -> float:
        return sum(step.duration_s or 0.0 for step in self.steps)

    @property
    def loaded_bytes(self) -> int | None:
        """The projector's weights it brought onto the device; None when it was not loaded."""
        return next((s.bytes_ for s in self.steps if s.action == "load"), None)

    @property
    def title(self) -> str:
        return f"{self.model}: {render.encoder_steps(self.steps, timed=False)}"


@dataclass
class HoldSpan:
    """The user held the GPU (game mode) from `start` until `end` (None: still holds it)."""

    start: float
    end: float | None = None


@dataclass
class History:
    window_s: float = DEFAULT_WINDOW_S
    samples: list[Sample] = field(default_factory=list)
    handoffs: list[HandoffRecord] = field(default_factory=list)
    encoder: list[EncoderRecord] = field(default_factory=list)  # in the window, by time
    # Kept past the window: what a card says of its model however long ago it happened.
    last_encoder: dict[str, EncoderRecord] = field(default_factory=dict)
    last_unload: dict[str, UnloadEvent] = field(default_factory=dict)
    evicted_at: dict[str, float] = field(default_factory=dict)  # model -> its cache removed
    holds: list[HoldSpan] = field(default_factory=list)
    models: list[str] = field(default_factory=list)  # every owner seen, in first-seen order
    total_bytes: int | None = None  # the devices' memory, once a status reported it
    _bytes: dict[str, int] = field(default_factory=dict)
    _others: int = 0
    _seen: dict[str, float] = field(default_factory=dict)  # each event's JSON -> its time

    # -- feeding -------------------------------------------------------------------------------

    def add_status(self, status: DaemonStatus, at: float) -> None:
        # The daemon's (config) order, so the bands stack the same way in every run; owners
        # it no longer lists (a model removed by reload) keep their place after them.
        order = [m.name for m in status.models]
        self.models = order + [name for name in self.models if name not in order]
        self._bytes = {m.name: m.device_bytes for m in status.models}
        self._others = status.others_bytes
        if status.total_bytes is not None:
            self.total_bytes = status.total_bytes
        self._hold(status.hold, at)
        self._sample(at)

    def add_event(self, event: Event) -> bool:
        """Apply one event; False when it was seen before (or has no time) and changed nothing."""
        at = event.at
        if at is None:
            return False
        # The whole event is its identity: the journal's copy and the live one are the same
        # object, and two events alike in every field are one.
        key = json.dumps(event.to_json(), sort_keys=True, default=str)
        if key in self._seen:
            return False
        self._seen[key] = at
        match event:
            case ResidencyEvent():
                self._on_residency(event, at)
            case HandoffEvent() | WaitEvent():
                self._on_arrival(event, at)
            case RequestEvent():
                self._on_request(event, at)
            case HoldEvent():
                self._hold(event.held, at)
            case EncoderEvent():
                self._on_encoder(event)
            case UnloadEvent():
                self._on_unload(event, at)
            case PromptCacheEvictEvent():
                for model in event.evicted:
                    self.evicted_at[model] = max(at, self.evicted_at.get(model, at))
        return True

    def _hold(self, held: bool, at: float) -> None:
        open_span = self.holds[-1] if self.holds and self.holds[-1].end is None else None
        if held and open_span is None:
            self.holds.append(HoldSpan(at))
        elif not held and open_span is not None and at >= open_span.start:
            open_span.end = at

    def _know(self, model: str) -> None:
        if model not in self.models:
            self.models.append(model)

    def _on_residency(self, event: ResidencyEvent, at: float) -> None:
        model, to = event.model, event.to_state
        if model is None or to is None:
            return
        self._know(model)
        if to in _GONE_STATES:
            self._bytes[model] = 0
        elif event.resident_bytes is not None:
            # What its worker holds once moved (issue 40: a CPU model's warm-up moves almost
            # nothing, and the timeline showed it at those few bytes while it was warm).
            self._bytes[model] = event.resident_bytes
        elif to is ResidencyState.WARM:  # an older daemon's event: what the move reported
            if event.moved_bytes > 0:
                self._bytes[model] = event.moved_bytes
        elif to is ResidencyState.COLD:
            self._bytes[model] = 0
        else:
            return  # loading, warming, cooling: the bytes move at the end
        self._sample(at)

    def _on_arrival(self, event: HandoffEvent | WaitEvent, at: float) -> None:
        model = event.to_model if isinstance(event, HandoffEvent) else event.model
        if model is None:
            return
        bisect.insort(self.handoffs, HandoffRecord(event, at, model), key=lambda h: h.at)
        del self.handoffs[:-MAX_HANDOFFS]

    def _on_request(self, event: RequestEvent, at: float) -> None:
        evaluated = event.prompt_tokens_evaluated
        if event.model is None or evaluated is None:
            return
        # The first request of the model to end after it got the GPU is the one whose prompt
        # the restored KV cache served (or not): its evaluated tokens are the handoff's.
        for record in reversed(self.handoffs):
            if record.to_model != event.model:
                continue
            if record.at <= at and record.tokens_evaluated is None:
                record.tokens_evaluated = evaluated
            return

    def _on_encoder(self, event: EncoderEvent) -> None:
        model = event.model
        if model is None:
            return
        last = self.last_encoder.get(model)
        # A worker serves one request at a time and sends its steps together: a step of the
        # request its model's last record is for belongs to that record.
        if (
            last is not None
            and event.request_id is not None
            and last.request_id == event.request_id
        ):
            # The journal sends a step again once the window no longer remembers it (`trim`
            # forgets it in _seen), and this record outlives the window.
            if event not in last.steps:
                bisect.insort(last.steps, event, key=lambda s: s.at or 0.0)
                self.encoder.sort(key=lambda r: r.at)  # its first step may have come late
            return
        record = EncoderRecord(model, event.request_id, [event])
        if last is None or record.at >= last.at:
            self.last_encoder[model] = record
        bisect.insort(self.encoder, record, key=lambda r: r.at)
        del self.encoder[:-MAX_ENCODER_RECORDS]

    def _on_unload(self, event: UnloadEvent, at: float) -> None:
        model = event.model
        if model is None:
            return
        last = self.last_unload.get(model)
        if last is None or at >= (last.at or 0.0):
            self.last_unload[model] = event
        self._know(model)
        self._bytes[model] = 0  # its worker exited: nothing of it is left on the device
        self._sample(at)

    def prompt_cache_kept(self, model: str) -> tuple[UnloadEvent | None, bool]:
        """`model`'s last unload, and whether a `prompt_cache_evict` removed what it saved."""
        unload = self.last_unload.get(model)
        if unload is None:
            return None, False
        evicted = self.evicted_at.get(model)
        return unload, evicted is not None and evicted >= (unload.at or 0.0)

    def _sample(self, at: float) -> None:
        models = tuple((name, self._bytes.get(name, 0)) for name in self.models)
        sample = Sample(at=at, models=models, others_bytes=self._others)
        index = bisect.bisect_right(self.samples, at, key=lambda s: s.at)
        self.samples.insert(index, sample)

    # -- reading -------------------------------------------------------------------------------

    def trim(self, now: float) -> None:
        """Forget what ended before the window; the last sample before it stays, since it says
        what the window starts with."""
        start = now - self.window_s
        first = bisect.bisect_right(self.samples, start, key=lambda s: s.at)
        del self.samples[: max(0, first - 1)]
        self.handoffs = [h for h in self.handoffs if h.at >= start]
        self.encoder = [r for r in self.encoder if r.at >= start]
        self.holds = [s for s in self.holds if s.end is None or s.end >= start]
        self._seen = {k: t for k, t in self._seen.items() if t >= start}

    def visible(self, now: float) -> list[Sample]:
        """The samples that cover [now - window_s, now], the one before the window included."""
        start = now - self.window_s
        first = bisect.bisect_right(self.samples, start, key=lambda s: s.at)
        end = bisect.bisect_right(self.samples, now, key=lambda s: s.at)
        return self.samples[max(0, first - 1) : end]

    def earliest(self, now: float) -> float | None:
        """When what the window holds begins (a sample or a handoff), or None when it is empty."""
        start = now - self.window_s
        times = [max(start, s.at) for s in self.visible(now)[:1]]
        times += [max(start, h.started_at) for h in self.handoffs_in_window(now)[:1]]
        return min(times, default=None)

    def peak_bytes(self, now: float, owners: Collection[str] | None = None) -> int:
        """The most in use in the window: of every owner, or of `owners` and other processes."""
        return max((s.bytes_of(owners) for s in self.visible(now)), default=0)

    def holds_in_window(self, now: float) -> list[HoldSpan]:
        start = now - self.window_s
        return [s for s in self.holds if s.start <= now and (s.end is None or s.end >= start)]

    def handoffs_in_window(self, now: float) -> list[HandoffRecord]:
        start = now - self.window_s
        return [h for h in self.handoffs if start <= h.at <= now]
