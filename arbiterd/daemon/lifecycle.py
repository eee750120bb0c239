"""Starts, restarts and stops the worker of each model slot.

Owns the workers' processes through their slots: spawn (with the host copy of the model file,
shared by every slot on that file), the watch on each worker's exit (a task awaiting it), the
restart with backoff after a crash or a failed spawn, and the stop. A spawn that fails for a
reason that will not go away by itself (a config the worker refuses, a worker of another
protocol) fails the slot for good, with the reason, until a reload brings a new config.
Everything runs on the daemon's event loop; copying a model file into memory runs in a thread.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arbiterd.daemon.modelfile import serves_embeddings
from arbiterd.daemon.slots import Slot, SlotState
from arbiterd.daemon.workerclient import WorkerClient
from arbiterd.errors import ArbiterError, ConfigError, ProtocolError
from arbiterd.events import Event, WorkerEvent
from arbiterd.hostcopy import HostCopies, HostCopy

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_UPTIME_S = 60.0  # a worker up this long has its backoff reset
# Spawn failures that retrying cannot mend: the slot fails until the config changes.
PERMANENT = (ConfigError, ProtocolError)


class Lifecycle:
    def __init__(
        self,
        arena: Path,
        *,
        publish: Callable[[Event], object],
        on_worker_event: Callable[[Slot, dict[str, Any]], None],
        on_ready: Callable[[Slot], None],
        on_gone: Callable[[Slot, WorkerClient], None],
    ) -> None:
        self._arena = arena
        self._publish = publish
        self._on_worker_event = on_worker_event
        self._on_ready = on_ready
        self._on_gone = on_gone
        self.host_copies = HostCopies()
        self._watches: set[asyncio.Task[None]] = set()
        self._stopping = False

    async def start(self, slot: Slot) -> None:
        """Spawn the slot's worker; on failure, say why and retry with backoff (or fail the slot
        for good when retrying cannot help)."""
        name = slot.name
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        try:
            copy = await self.hold_copy(slot)
            if self._retired(slot):
                self._let_go(slot)
                return
            # From the copy the worker loads: ~0.1 s for a large vocabulary, in a thread.
            slot.embedding = await asyncio.to_thread(serves_embeddings, slot.config, copy.fd)
            worker = await WorkerClient.spawn(
                slot.config.worker_config(self._arena, copy.fd, embedding=slot.embedding),
                env=env,
                on_event=lambda event: self._on_worker_event(slot, event),
            )
        except (ArbiterError, OSError) as exc:
            if self._retired(slot):  # its failure is news to nobody, and it is stopped already
                self._let_go(slot)
            elif isinstance(exc, PERMANENT):
                slot.move(SlotState.FAILED, reason=f"could not start: {exc}")
                log.error("%s could not start: %s", name, exc)
                self._publish(WorkerEvent(model=name, reason=slot.last_error))
            else:
                # OSError: no fd for the socketpair (EMFILE), no memory to fork, ... —
                # transient, like a copy or a hello that failed; said and retried with backoff.
                reason = str(exc) if isinstance(exc, ArbiterError) else _os_reason(exc)
                delay = self._restart_later(slot, f"could not start: {reason}")
                log.warning("%s could not start (%s); retrying in %.0f s", name, reason, delay)
                self._publish(WorkerEvent(model=name, reason=slot.last_error, restart_in_s=delay))
            return
        if self._retired(slot):
            await worker.shutdown()
            self._let_go(slot)
            return
        slot.started_at = time.monotonic()
        slot.move(SlotState.READY, worker=worker)
        slot.residency = "loading"  # a worker loads (or waits to) once it said hello
        self._on_ready(slot)
        watch = asyncio.get_running_loop().create_task(self._watch(slot, worker))
        self._watches.add(watch)
        watch.add_done_callback(self._watches.discard)

    async def retire(self, slot: Slot) -> None:
        """Stop the slot for good (removed or replaced by a reload): its worker's exit is not
        a crash; its host copy goes once the worker has let go of it."""
        if slot.restart_task is not None:
            slot.restart_task.cancel()
        worker = slot.worker
        if slot.state is not SlotState.STOPPED:
            slot.move(SlotState.STOPPED)
        if worker is not None:
            self._on_gone(slot, worker)
            await worker.shutdown()
        self.drop_copy(slot)

    async def stop(self, slots: list[Slot]) -> None:
        """Stop every worker (in-flight requests finish first); nothing restarts after this."""
        self._stopping = True
        await asyncio.gather(*(self.retire(slot) for slot in slots))
        for watch in list(self._watches):
            watch.cancel()
        self.host_copies.close()

    async def hold_copy(self, slot: Slot) -> HostCopy:
        """The slot's host copy of its model file (shared with every slot on that file)."""
        if slot.copy_lease is None:
            slot.copy_lease = await asyncio.to_thread(
                self.host_copies.acquire, slot.config.path, slot.name
            )
        return slot.copy_lease.copy

    def drop_copy(self, slot: Slot) -> None:
        if slot.copy_lease is not None:
            self.host_copies.release(slot.copy_lease)
            slot.copy_lease = None

    def _retired(self, slot: Slot) -> bool:
        """Whether `retire` or `stop` came while `start` awaited (only `start` moves a slot
        out of starting otherwise)."""
        return self._stopping or slot.state is not SlotState.STARTING

    def _let_go(self, slot: Slot) -> None:
        """A start that found its slot retired gives back the host copy it took meanwhile
        (retire could not: the lease was not the slot's yet)."""
        if self._stopping:
            # stop() closes every copy, perhaps already this one: releasing it again would
            # close its fd twice. The daemon is going away.
            slot.copy_lease = None
        else:
            self.drop_copy(slot)

    async def _watch(self, slot: Slot, worker: WorkerClient) -> None:
        code = await worker.wait()
        if slot.worker is not worker:  # retired: its exit was asked for
            return
        self._on_gone(slot, worker)
        uptime = time.monotonic() - slot.started_at
        slot.failures_in_row = 0 if uptime >= STABLE_UPTIME_S else slot.failures_in_row + 1
        delay = RESTART_BACKOFF_S[min(slot.failures_in_row, len(RESTART_BACKOFF_S) - 1)]
        reason = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self._restart_later(slot, f"worker {reason}", delay)
        self._publish(
            WorkerEvent(
                model=slot.name, pid=worker.pid, code=code, reason=reason, restart_in_s=delay
            )
        )
        await worker.kill()  # closes its socket; the process is already reaped

    def _restart_later(self, slot: Slot, reason: str, delay_s: float | None = None) -> float:
        """Spawn the slot's worker again after `delay_s` (default: the next backoff step);
        returns the delay."""
        if delay_s is None:
            delay_s = RESTART_BACKOFF_S[min(slot.failures_in_row, len(RESTART_BACKOFF_S) - 1)]
            slot.failures_in_row += 1
        slot.move(SlotState.RESTARTING, reason=reason)
        if self._stopping:
            return delay_s

        async def restart() -> None:
            await asyncio.sleep(delay_s)
            slot.restarts += 1
            slot.move(SlotState.STARTING)
            await self.start(slot)

        slot.restart_task = asyncio.get_running_loop().create_task(restart())
        return delay_s


def _os_reason(exc: OSError) -> str:
    """An OSError as one line: errno name and text ("EMFILE: Too many open files")."""
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{name}: {text}" if name else text
