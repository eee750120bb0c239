"""One model's status record (arbiterd/status.py's `ModelStatus`), built from its slot, its
worker's status and what the VRAM watch measures.

Owns how those sources combine into the record: the slot's state and its worker's residency,
what a worker that does not answer said last (marked stale: a frozen worker never holds up
status or /v1/models), and the model's share of host RAM. Reads; never changes a slot. The
supervisor gathers one per model into the daemon's `DaemonStatus`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from arbiterd.daemon.models.liveness import STATUS_ANSWER_S, stale
from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.workerclient import WorkerClient
from arbiterd.daemon.observe.telemetry import TelemetrySnapshot
from arbiterd.daemon.observe.vramwatch import VramWatch
from arbiterd.errors import ArbiterError
from arbiterd.footprint import ModelFootprint
from arbiterd.states import BackendKind, ResidencyState
from arbiterd.status import ModelStatus, Turn, model_info_fields


async def model_status(
    slot: Slot,
    snapshot: TelemetrySnapshot | None,
    vram: VramWatch,
    silence: Callable[[Slot, WorkerClient], float | None],
) -> ModelStatus:
    """`slot`'s model as status shows it, its VRAM as `snapshot` measures it; `silence` says how
    long its worker has been silent while holding a token (holderwatch.HolderWatch.silence)."""
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
        vram_bytes=vram.model_bytes(snapshot, slot.name),
        cold_footprint_bytes=vram.footprint(slot.name),
        # None until its first worker said hello.
        backend=None if hello is None else BackendKind(hello.backend),
        fallback_reason="" if hello is None else hello.fallback_reason,
    )
    worker = slot.worker
    if worker is None:
        return host_ram(slot, report)
    live, stale_s = await live_status(worker)
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
        silent_s=silence(slot, worker),
        turn=Turn.from_json(live["turn"]) if isinstance(live.get("turn"), dict) else None,
        footprint=_footprint(live.get("footprint")),
    )
    return host_ram(slot, report)


async def live_status(worker: WorkerClient) -> tuple[dict[str, Any], float | None]:
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


def host_ram(slot: Slot, report: ModelStatus) -> ModelStatus:
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


def _footprint(raw: object) -> ModelFootprint | None:
    """A worker status's "footprint" (issue 44) with the prediction's error; None from a worker
    that does not say."""
    if not isinstance(raw, dict):
        return None
    said = ModelFootprint.from_json(raw)
    return ModelFootprint.of(said.predicted, said.measured)
