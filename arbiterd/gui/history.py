"""What happened on the GPU lately: VRAM by owner over time, and every handoff with its cost.

Owns the dashboard's memory of the last minutes, fed from three sources that may overlap: the
journal (read once when a window opens), live events, and status snapshots. Status snapshots
are the truth about bytes when there are any; between them (and in the journal, which has no
snapshots) residency events move a model's bytes: to `warm` with the bytes the move reported,
to `cold`/`failed`/`stopped` to zero. An event seen twice (journal and live) counts once.

Pure bookkeeping, no Qt, no clock of its own: callers pass the times.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbiterd.gui.status import Status
from arbiterd.journal import Journal

DEFAULT_WINDOW_S = 600.0
# A residency event and the handoff it belongs to are published within moments of each other
# (supervisor._on_residency publishes the handoff, then the event that caused it).
HANDOFF_MATCH_S = 5.0
MAX_HANDOFFS = 500
_EMPTY_STATES = frozenset({"cold", "failed", "stopped"})


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclass(frozen=True)
class Sample:
    """VRAM by owner from `at` until the next sample."""

    at: float
    models: tuple[tuple[str, int], ...]  # (model, bytes), in the daemon's model order
    others_bytes: int  # everything that is not a model: shown grey

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.models) + self.others_bytes


@dataclass
class HandoffRecord:
    """One handoff: `at` is when the new holder was warm; it began `total_s` before."""

    at: float
    from_model: str
    to_model: str
    release_s: float | None
    wait_s: float | None
    restore_s: float | None
    bytes_: int | None = None  # what the restore moved onto the device (weights + KV)
    tokens_evaluated: int | None = None  # prompt tokens the next request of to_model evaluated

    @property
    def total_s(self) -> float:
        return sum(s for s in (self.release_s, self.wait_s, self.restore_s) if s is not None)

    @property
    def started_at(self) -> float:
        return self.at - self.total_s


@dataclass
class HoldSpan:
    """The user held the GPU (game mode) from `start` until `end` (None: still holds it)."""

    start: float
    end: float | None = None


@dataclass
class _WarmMove:
    at: float
    bytes_: int


@dataclass
class History:
    window_s: float = DEFAULT_WINDOW_S
    samples: list[Sample] = field(default_factory=list)
    handoffs: list[HandoffRecord] = field(default_factory=list)
    holds: list[HoldSpan] = field(default_factory=list)
    models: list[str] = field(default_factory=list)  # every owner seen, in first-seen order
    total_bytes: int | None = None  # the devices' memory, once a status reported it
    _bytes: dict[str, int] = field(default_factory=dict)
    _others: int = 0
    _seen: dict[tuple[object, ...], float] = field(default_factory=dict)
    _warm_moves: dict[str, _WarmMove] = field(default_factory=dict)

    # -- feeding -------------------------------------------------------------------------------

    def add_status(self, status: Status, at: float) -> None:
        # The daemon's (config) order, so the bands stack the same way in every run; owners
        # it no longer lists (a model removed by reload) keep their place after them.
        order = [m.name for m in status.models]
        self.models = order + [name for name in self.models if name not in order]
        self._bytes = {m.name: m.resident_bytes for m in status.models}
        self._others = status.others_bytes
        if status.total_bytes is not None:
            self.total_bytes = status.total_bytes
        self._hold(status.hold, at)
        self._sample(at)

    def add_event(self, event: Mapping[str, Any]) -> bool:
        """Apply one event; False when it was seen before (or has no time) and changed nothing."""
        at = _number(event.get("at"))
        kind = event.get("event")
        if at is None or not isinstance(kind, str):
            return False
        key = (kind, round(at, 6), event.get("model"), event.get("from"), event.get("to"))
        if key in self._seen:
            return False
        self._seen[key] = at
        if kind == "residency":
            self._on_residency(event, at)
        elif kind == "handoff":
            self._on_handoff(event, at)
        elif kind == "request":
            self._on_request(event, at)
        elif kind == "hold":
            self._hold(event.get("held") is True, at)
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

    def _on_residency(self, event: Mapping[str, Any], at: float) -> None:
        model, to = event.get("model"), event.get("to")
        if not isinstance(model, str) or not isinstance(to, str):
            return
        self._know(model)
        weights, kv = _number(event.get("weights_bytes")), _number(event.get("kv_bytes"))
        moved = int((weights or 0) + (kv or 0))
        if to == "warm":
            if moved > 0:
                self._bytes[model] = moved
            self._warm_moves[model] = _WarmMove(at, moved)
            record = self._handoff_to(model, at)
            if record is not None and record.bytes_ is None and moved > 0:
                record.bytes_ = moved
        elif to in _EMPTY_STATES:
            self._bytes[model] = 0
        else:
            return  # loading, warming, cooling: the bytes move at the end
        self._sample(at)

    def _on_handoff(self, event: Mapping[str, Any], at: float) -> None:
        source, target = event.get("from"), event.get("to")
        if not isinstance(source, str) or not isinstance(target, str):
            return
        record = HandoffRecord(
            at=at,
            from_model=source,
            to_model=target,
            release_s=_number(event.get("release_s")),
            wait_s=_number(event.get("wait_s")),
            restore_s=_number(event.get("restore_s")),
        )
        move = self._warm_moves.get(target)
        if move is not None and abs(move.at - at) <= HANDOFF_MATCH_S and move.bytes_ > 0:
            record.bytes_ = move.bytes_
        bisect.insort(self.handoffs, record, key=lambda h: h.at)
        del self.handoffs[:-MAX_HANDOFFS]

    def _handoff_to(self, model: str, at: float) -> HandoffRecord | None:
        for record in reversed(self.handoffs):
            if record.to_model == model and abs(record.at - at) <= HANDOFF_MATCH_S:
                return record
        return None

    def _on_request(self, event: Mapping[str, Any], at: float) -> None:
        model = event.get("model")
        evaluated = _number(event.get("prompt_tokens_evaluated"))
        if not isinstance(model, str) or evaluated is None:
            return
        # The first request of the model to end after its latest handoff is the one whose
        # prompt the restored KV cache served (or not): its evaluated tokens are the handoff's.
        for record in reversed(self.handoffs):
            if record.to_model != model:
                continue
            if record.at <= at and record.tokens_evaluated is None:
                record.tokens_evaluated = int(evaluated)
            return

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
        self.holds = [s for s in self.holds if s.end is None or s.end >= start]
        self._seen = {k: t for k, t in self._seen.items() if t >= start - HANDOFF_MATCH_S}

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

    def peak_bytes(self, now: float) -> int:
        return max((s.total_bytes for s in self.visible(now)), default=0)

    def holds_in_window(self, now: float) -> list[HoldSpan]:
        start = now - self.window_s
        return [s for s in self.holds if s.start <= now and (s.end is None or s.end >= start)]

    def handoffs_in_window(self, now: float) -> list[HandoffRecord]:
        start = now - self.window_s
        return [h for h in self.handoffs if start <= h.at <= now]


# How far before the window the journal is read, so the window starts with each model's bytes
# (its last residency event may be older than the window).
JOURNAL_LEAD_S = 3600.0
JOURNAL_KINDS = ("residency", "handoff", "request", "worker", "hold", "vram_not_freed")


def read_journal(path: Path, since: float) -> list[dict[str, Any]]:
    """The journal's events since `since` (read-only; the daemon may be writing). DaemonError
    when there is no journal or it cannot be read."""
    journal = Journal.open_readonly(path)
    try:
        return [event.body for event in journal.read(since=since, kinds=JOURNAL_KINDS)]
    finally:
        journal.close()
