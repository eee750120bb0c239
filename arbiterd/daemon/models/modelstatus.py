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

from arbiterd.daemon.models.liveness import STATUS_ANSWER_S, stale
from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.workerport import WorkerPort
from arbiterd.daemon.observe.telemetry import TelemetrySnapshot
from arbiterd.daemon.observe.vramwatch import VramWatch
from arbiterd.errors import ArbiterError
from arbiterd.reply import WorkerStatus
from arbiterd.states import BackendKind
from arbiterd.status import ModelStatus


async def model_status(
    slot: Slot,
    snapshot: TelemetrySnapshot | None,
    vram: VramWatch,
    silence: Callable[[Slot, WorkerPort], float | None],
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
    info = live.model_info
    report = dataclasses.replace(
        report,
        state=report.state if live.state is None else live.state,
        pid=report.pid if live.pid is None else live.pid,
        queue=report.queue if live.queue is None else live.queue,
        sequences=live.sequences,
        tokens_per_s=live.tokens_per_s,
        resident_bytes=(
            report.resident_bytes if live.resident_bytes is None else live.resident_bytes
        ),
        capabilities=live.capabilities or report.capabilities,
        **({} if info is None else dataclasses.asdict(info)),
        prompt_tokens_evaluated=live.prompt_tokens_evaluated,
        served=live.served,
        last_error=live.last_error or slot.last_error,
        host_kv_bytes=live.host_kv_bytes,
        host_weights_bytes=live.host_weights_bytes,
        stale_s=stale_s,
        silent_s=silence(slot, worker),
        turn=live.turn,
        footprint=live.footprint,
    )
    return host_ram(slot, report)


async def live_status(worker: WorkerPort) -> tuple[WorkerStatus, float | None]:
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
