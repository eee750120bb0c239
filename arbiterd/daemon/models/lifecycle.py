"""Starts, restarts and stops the worker of each model slot.

Owns the workers' processes through their slots: spawn (with the host copy of the model file,
shared by every slot on that file), the watch on each worker's exit (a task awaiting it), the
restart with backoff after a crash or a failed spawn, and the stop. A spawn that fails for a
reason that will not go away by itself (a config the worker refuses, a worker of another
protocol) fails the slot for good, with the reason, until a reload brings a new config.
Also the unload (issue 14): the worker saves its prompt cache to `<kv_dir>/<model>.kv` and
exits, the slot lets go of its host copy; the next `load` starts a worker that reads the file.
The folder stays within [daemon] prompt_cache_budget (budgets.PromptCache: the oldest files
go first; a file larger than the whole budget is not kept). A model with host_copy =
"page-cache" holds no host copy: its worker loads the file itself, which must be on disk.

A model whose file is gone from disk (issue 24) serves from what it holds (the host copy, or
the pages its worker mapped), so it is not unloaded: `unload` refuses, naming the file, rather
than drop the only copy. A start that does not find the file marks the slot's `missing_file`:
requests are then answered at once (routing.py) instead of waiting out the backoff, a request
that finds the file back starts it at once, and the start that finds it clears the note.
Everything runs on the daemon's event loop; copying a model file into memory runs in a thread.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from arbiterd.config import PROMPT_CACHE_BUDGET_BYTES, HostCopyMode, ModelConfig
from arbiterd.daemon.models.budgets import PromptCache, StateFile
from arbiterd.daemon.models.modelfile import model_traits
from arbiterd.daemon.models.slots import Slot
from arbiterd.daemon.models.workerclient import WorkerClient
from arbiterd.daemon.models.workerport import WorkerPort
from arbiterd.errors import (
    ArbiterError,
    ConfigError,
    ControlError,
    DaemonError,
    ModelLoadError,
    ProtocolError,
)
from arbiterd.events import Event, PromptCacheEvictEvent, UnloadEvent, WorkerEvent
from arbiterd.hostcopy import HostCopies, HostCopy
from arbiterd.offload import gpu_nodes
from arbiterd.spec import DEFAULT_TURNS, Turns
from arbiterd.states import SlotState, UnloadReason, WorkerOp

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_UPTIME_S = 60.0  # a worker up this long has its backoff reset
# Spawn failures that retrying cannot mend: the slot fails until the config changes.
PERMANENT = (ConfigError, ProtocolError)
# How long an unloading worker may take to finish what it has queued and write its prompt
# cache (a few GB at disk speed) before it is killed, unsaved.
UNLOAD_TIMEOUT_S = 300.0
STATUS_TIMEOUT_S = 10.0  # a worker answers status from its io thread, even mid-decode
# The Vulkan loader's filter of the drivers it loads (loader 1.3.234 and later): "*" loads none.
VULKAN_NO_DRIVERS = {"VK_LOADER_DRIVERS_DISABLE": "*"}
# The user's own choices of Vulkan drivers, which the daemon leaves alone.
VULKAN_DRIVER_KEYS = (
    "VK_LOADER_DRIVERS_DISABLE",
    "VK_LOADER_DRIVERS_SELECT",
    "VK_DRIVER_FILES",
    "VK_ICD_FILENAMES",
)
# ggml's abort attaches gdb to the process to print a backtrace (ggml.c, ggml_print_backtrace)
# unless this is set: seconds of a dying worker, and gdb's lines bury ggml's own message (an
# assert, "Remote RPC server crashed ...") in the last words the daemon reports.
GGML_NO_BACKTRACE = {"GGML_NO_BACKTRACE": "1"}


# The RPC servers a worker offers weights by hash first (the residency patch's ggml-rpc.cpp).
HASH_UPLOADS_ENV = "ARBITERD_RPC_HASH_UPLOADS"


def worker_env(
    base: Mapping[str, str], nodes: Sequence[str], hashed: Sequence[str] = ()
) -> dict[str, str]:
    """The environment a worker starts with: the daemon's without NOTIFY_SOCKET, and, on a
    machine with no GPU device node (`nodes`, offload.gpu_nodes), the Vulkan loader told to load
    no driver. There the only Vulkan devices are CPU ones (Mesa's llvmpipe), which ggml-vulkan
    lists only when GGML_VK_VISIBLE_DEVICES names them, so unless it names one the engine lists
    the same devices either way, and each worker is spared llvmpipe and LLVM: ~20 MB of shared
    and ~12 MB of its own memory (issue 28). The user's own Vulkan settings are left alone.
    ggml prints no backtrace on an abort (GGML_NO_BACKTRACE; a value of the user's is kept).
    `hashed`: the RPC servers (HOST:PORT) its weights are offered to by hash first ([devices.ID]
    uploads = "hashes", issue 46), none by default."""
    env = GGML_NO_BACKTRACE | {key: value for key, value in base.items() if key != "NOTIFY_SOCKET"}
    named = env.get("GGML_VK_VISIBLE_DEVICES", "").strip()
    if not nodes and not named and not any(key in env for key in VULKAN_DRIVER_KEYS):
        env |= VULKAN_NO_DRIVERS
    env.pop(HASH_UPLOADS_ENV, None)
    if hashed:
        env[HASH_UPLOADS_ENV] = ",".join(hashed)
    return env


class Lifecycle:
    def __init__(
        self,
        arena: Path,
        *,
        publish: Callable[[Event], object],
        on_worker_event: Callable[[Slot, dict[str, Any]], None],
        on_ready: Callable[[Slot], None],
        on_gone: Callable[[Slot, WorkerPort], None],
        kv_dir: Path | None = None,
        prompt_cache_budget_bytes: int = PROMPT_CACHE_BUDGET_BYTES,
        vram_budget: Callable[[ModelConfig], int] = lambda _: 0,
        turns: Turns = DEFAULT_TURNS,
        hashed: Callable[[ModelConfig], Sequence[str]] = lambda _: (),
    ) -> None:
        """`kv_dir`: the folder unloaded models keep their prompt caches in, within
        `prompt_cache_budget_bytes`; None: an unload keeps none. `vram_budget`: the device
        bytes a model's worker may reach (a vision projector must fit beside its model),
        modelfile.vram_budget_for; called in a thread as each worker starts. `turns`: [daemon]'s
        turn settings, which every worker applies. `hashed`: the RPC servers a model's weights
        are offered to by hash first (config.hashed_servers)."""
        self._arena = arena
        self._hashed = hashed
        self._turns = turns
        self._vram_budget = vram_budget
        self._kv_dir = kv_dir
        self.prompt_cache = (
            None if kv_dir is None else PromptCache(kv_dir, prompt_cache_budget_bytes)
        )
        self._publish = publish
        self._on_worker_event = on_worker_event
        self._on_ready = on_ready
        self._on_gone = on_gone
        self.host_copies = HostCopies()
        self._watches: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._gpu_nodes = gpu_nodes()  # read once: a GPU plugged in later needs a restart

    async def start(self, slot: Slot) -> None:
        """Spawn the slot's worker; on failure, say why and retry with backoff (or fail the slot
        for good when retrying cannot help)."""
        name = slot.name
        env = worker_env(os.environ, self._gpu_nodes, self._hashed(slot.config))
        if slot.replaces is not None:  # the old worker of its model goes first
            await asyncio.wait({slot.replaces})
        try:
            copy = await self.hold_copy(slot)
            if self._retired(slot):
                self._let_go(slot)
                return
            if copy is None:  # page-cache: the worker reads the file, which must be there
                _require_file(slot)
            slot.file_found()
            # From what the worker loads: ~0.1 s for a large vocabulary, in a thread.
            slot.decided(
                await asyncio.to_thread(
                    model_traits, slot.config, None if copy is None else copy.fd
                )
            )
            worker = await WorkerClient.spawn(
                slot.config.worker_config(
                    self._arena,
                    None if copy is None else copy.fd,
                    embedding=slot.embedding,
                    n_ctx=slot.n_ctx,
                    kv_file=self._kv_file(slot),
                    # None: the worker keys the state file by the file as it finds it.
                    model_version=(
                        None if copy is None else (copy.identity.size, copy.identity.mtime_ns)
                    ),
                    vram_budget=await asyncio.to_thread(self._vram_budget, slot.config),
                    turns=self._turns,
                ),
                env=env,
                on_event=lambda event: self._on_worker_event(slot, event),
            )
        except (ArbiterError, OSError) as exc:
            if slot.copy_lease is None and not slot.config.path.is_file():
                slot.file_missing()
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
        slot.serve(worker, now=time.monotonic())
        self._on_ready(slot)
        watch = asyncio.get_running_loop().create_task(self._watch(slot, worker))
        self._watches.add(watch)
        watch.add_done_callback(self._watches.discard)

    async def load(self, slot: Slot) -> None:
        """Start an unloaded slot's worker (a demand model's first request or `warm`, the first
        after an unload) and return once it is ready or could not start. Concurrent callers
        share one start, and one that is cancelled (a client gone) does not cancel it."""
        task = slot.load_task
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(slot))
            slot.loading(task)

            def forget(_: asyncio.Task[None]) -> None:
                slot.loading(None)

            task.add_done_callback(forget)
        await asyncio.shield(task)

    async def _load(self, slot: Slot) -> None:
        if slot.unload_task is not None:  # the next worker reads what this one writes
            await asyncio.shield(slot.unload_task)
        if self._stopping:
            return
        if slot.state is SlotState.RESTARTING and slot.missing_file is not None:
            back = await asyncio.to_thread(slot.missing_file.is_file)
            # Still gone: the caller says so at once. Or its backoff ran out meanwhile and a
            # start is under way already.
            if not back or slot.state is not SlotState.RESTARTING:
                return
            if slot.restart_task is not None:  # back: start now, not after the backoff
                slot.restart_task.cancel()
            slot.move(SlotState.STARTING)
            await self.start(slot)
        elif slot.state is SlotState.UNLOADED:
            slot.move(SlotState.STARTING)
            await self.start(slot)

    async def unload(self, slot: Slot, reason: UnloadReason) -> dict[str, Any]:
        """Unload the slot: its worker finishes what it has queued, saves its prompt cache
        and exits; the host copy goes. Returns what the worker said it saved ("kv_file",
        "kv_bytes", "tokens", "error"). ControlError for a slot that is starting or failed."""
        if slot.unload_task is not None:
            return await asyncio.shield(slot.unload_task)
        if slot.state is SlotState.UNLOADED:
            return _nothing_kept()
        refusal = self.unload_refusal(slot)  # before any await: the unload begins at once
        if refusal:
            raise ControlError(refusal)
        if slot.state is SlotState.RESTARTING:  # no worker to save anything: do not restart
            if slot.restart_task is not None:
                slot.restart_task.cancel()
            slot.move(SlotState.UNLOADED)
            self.drop_copy(slot)
            self._publish(UnloadEvent(model=slot.name, reason=reason))
            return _nothing_kept()
        worker = slot.worker
        if slot.state is not SlotState.READY or worker is None:
            raise ControlError(f"{slot.name} is {slot.shown_state}: it cannot be unloaded now")
        slot.move(SlotState.UNLOADING)  # new requests wait for the next worker
        task = asyncio.get_running_loop().create_task(self._unload(slot, worker, reason))
        slot.unloading(task)
        return await asyncio.shield(task)

    def unload_refusal(self, slot: Slot) -> str:
        """Why `slot` must not be unloaded now, or "": its model file is gone from disk and
        the slot holds what it serves from (one stat, as `_require_file`'s, on the loop)."""
        path = slot.config.path
        lease = slot.copy_lease
        if lease is not None and len(lease.copy.models()) > 1:
            return ""  # another model keeps the copy, and the next start takes it again
        if lease is None and slot.worker is None:
            return ""  # nothing held
        if path.is_file():
            return ""
        held = "the copy in the daemon's memory" if lease is not None else "what its worker mapped"
        return (
            f"{slot.name}'s model file {path} is gone from disk: unloading would drop the only "
            f"copy of it ({held}) and {slot.name} could not start again; put the file back "
            "first, or remove the model from the config and reload to let it go"
        )

    async def _unload(self, slot: Slot, worker: WorkerPort, reason: UnloadReason) -> dict[str, Any]:
        try:
            saved = await self._save_prompt_cache(slot, worker)
            await worker.shutdown()  # it exits by itself; reaped here (killed if it hangs)
            self._on_gone(slot, worker)
            if slot.state is SlotState.UNLOADING:  # not retired meanwhile
                slot.move(SlotState.UNLOADED)
            self._let_go(slot)
            event = UnloadEvent(
                model=slot.name,
                pid=worker.pid,
                reason=reason,
                kv_file=saved.get("kv_file"),
                kv_bytes=int(saved.get("kv_bytes") or 0),
                tokens=int(saved.get("tokens") or 0),
                error=str(saved.get("error") or ""),
            )
            if event.error:
                log.warning("%s unloaded without its prompt cache: %s", slot.name, event.error)
            else:
                log.info(
                    "%s unloaded (%s): %s bytes of prompt cache kept",
                    slot.name,
                    reason,
                    event.kv_bytes,
                )
            self._publish(event)
            return {
                "kv_file": event.kv_file,
                "kv_bytes": event.kv_bytes,
                "tokens": event.tokens,
                "error": event.error,
            }
        finally:
            slot.unloading(None)

    async def _save_prompt_cache(self, slot: Slot, worker: WorkerPort) -> dict[str, Any]:
        """Have the unloading worker save its prompt cache within the budget: room is made
        first when its size is known (a cold model's host KV), and a cache larger than the
        whole budget is not written at all; after the save, older files go until the folder
        fits (an event names them). Returns the worker's reply, its "error" saying why nothing
        was kept."""
        cache = self.prompt_cache
        if cache is None:
            return await self._ask_unload(worker)
        try:
            await asyncio.to_thread(cache.make_private)
        except DaemonError as exc:
            # Checked at start too (Supervisor.start); made loose since: the worker is not
            # asked to write a user's prompts where others could read them.
            log.warning("%s: its prompt cache is not kept: %s", slot.name, exc)
            return _nothing_kept(str(exc))
        expected = 0
        try:
            live = await worker.status(timeout_s=STATUS_TIMEOUT_S)
            expected = live.host_kv_bytes  # a cold model's KV, else 0
        except ArbiterError:
            pass  # the unload below finds out what is wrong with the worker
        if expected > cache.budget_bytes:
            await asyncio.to_thread(cache.remove, slot.name)  # an older cache is stale now
            return _nothing_kept(_too_large(expected, cache.budget_bytes))
        if expected:
            self._evicted(slot, await asyncio.to_thread(cache.make_room, slot.name, expected))
        saved = await self._ask_unload(worker)
        if saved.get("kv_file") is None:
            return saved
        settled = await asyncio.to_thread(cache.settle, slot.name)
        self._evicted(slot, settled.evicted)
        if settled.refused_bytes:
            return _nothing_kept(_too_large(settled.refused_bytes, cache.budget_bytes))
        return saved

    async def _ask_unload(self, worker: WorkerPort) -> dict[str, Any]:
        try:
            return await worker.request(WorkerOp.UNLOAD, timeout_s=UNLOAD_TIMEOUT_S)
        except ArbiterError as exc:
            return _nothing_kept(str(exc))

    def _evicted(self, slot: Slot, evicted: tuple[StateFile, ...]) -> None:
        """Say which state files were removed to make room for `slot`'s."""
        cache = self.prompt_cache
        if not evicted or cache is None:
            return
        event = PromptCacheEvictEvent(
            model=slot.name,
            evicted=tuple(f.model for f in evicted),
            evicted_bytes=sum(f.size_bytes for f in evicted),
            used_bytes=sum(f.size_bytes for f in cache.files()),
            budget_bytes=cache.budget_bytes,
        )
        log.info(
            "prompt cache of %s removed (%d bytes) to keep %s's within the budget",
            ", ".join(event.evicted),
            event.evicted_bytes,
            slot.name,
        )
        self._publish(event)

    async def forget_prompt_cache(self, name: str) -> None:
        """Remove the state file of a model that left the config: no later config could
        restore it as what it was made for."""
        if self.prompt_cache is None:
            return
        try:
            if await asyncio.to_thread(self.prompt_cache.remove, name):
                log.info("%s left the config: its prompt cache on disk is removed", name)
        except OSError as exc:
            log.warning("%s: could not remove its prompt cache: %s", name, _os_reason(exc))

    def _kv_file(self, slot: Slot) -> Path | None:
        return None if self.prompt_cache is None else self.prompt_cache.path(slot.name)

    async def retire(self, slot: Slot) -> None:
        """Stop the slot for good (removed or replaced by a reload): its worker's exit is not
        a crash; its host copy goes once the worker has let go of it."""
        if slot.restart_task is not None:
            slot.restart_task.cancel()
        unloading = slot.unload_task
        worker = slot.worker
        if slot.state is not SlotState.STOPPED:
            slot.move(SlotState.STOPPED)
        if worker is not None:
            self._on_gone(slot, worker)
            await worker.shutdown()
        if unloading is not None:  # its worker is reaped there
            await asyncio.gather(asyncio.shield(unloading), return_exceptions=True)
        self.drop_copy(slot)

    async def stop(self, slots: list[Slot]) -> None:
        """Stop every worker (in-flight requests finish first); nothing restarts after this."""
        self._stopping = True
        await asyncio.gather(*(self.retire(slot) for slot in slots))
        for watch in list(self._watches):
            watch.cancel()
        self.host_copies.close()

    async def hold_copy(self, slot: Slot) -> HostCopy | None:
        """The slot's host copy of its model file (shared with every slot on that file); None
        for a model with host_copy = "page-cache", which has none."""
        if slot.config.host_copy is HostCopyMode.PAGE_CACHE:
            return None
        lease = slot.copy_lease
        if lease is None:
            lease = await asyncio.to_thread(self.host_copies.acquire, slot.config.path, slot.name)
            slot.hold_copy(lease)
        return lease.copy

    def drop_copy(self, slot: Slot) -> None:
        lease = slot.drop_copy()
        if lease is not None:
            self.host_copies.release(lease)

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
            slot.drop_copy()
        else:
            self.drop_copy(slot)

    async def _watch(self, slot: Slot, worker: WorkerPort) -> None:
        code = await worker.wait()
        words = await worker.last_words()  # the pipe ends with the process: at once
        if slot.worker is not worker:  # retired: its exit was asked for
            return
        self._on_gone(slot, worker)
        uptime = time.monotonic() - slot.started_at
        slot.worker_exited(stable=uptime >= STABLE_UPTIME_S)
        delay = RESTART_BACKOFF_S[min(slot.failures_in_row, len(RESTART_BACKOFF_S) - 1)]
        reason = worker.killed_for or (  # the daemon's own kill says why
            f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        )
        if words and not worker.killed_for:
            log.warning(
                "worker for %s %s; its last words: %s", slot.name, reason, " | ".join(words)
            )
        self._restart_later(slot, f"worker {reason}", delay)
        self._publish(
            WorkerEvent(
                model=slot.name,
                pid=worker.pid,
                code=code,
                reason=reason,
                restart_in_s=delay,
                last_words=words,
            )
        )
        await worker.kill()  # closes its socket; the process is already reaped

    def _restart_later(self, slot: Slot, reason: str, delay_s: float | None = None) -> float:
        """Spawn the slot's worker again after `delay_s` (default: the next backoff step);
        returns the delay."""
        if delay_s is None:
            delay_s = RESTART_BACKOFF_S[min(slot.failures_in_row, len(RESTART_BACKOFF_S) - 1)]
            slot.start_failed()
        slot.move(SlotState.RESTARTING, reason=reason)
        if self._stopping:
            return delay_s

        async def restart() -> None:
            await asyncio.sleep(delay_s)
            slot.restarted()
            slot.move(SlotState.STARTING)
            await self.start(slot)

        slot.restarting(asyncio.get_running_loop().create_task(restart()))
        return delay_s


def _require_file(slot: Slot) -> None:
    """Refuse to start a page-cache model whose file is not on disk, saying what that means."""
    path = slot.config.path
    if not path.is_file():
        raise ModelLoadError(
            f'model file not found: {path}; with host_copy = "page-cache" no copy of it is '
            f"kept in memory, so {slot.name} cannot start until the file is back "
            '(host_copy = "memfd" keeps one that outlives the file)'
        )


def _too_large(kv_bytes: int, budget_bytes: int) -> str:
    return (
        f"its prompt cache ({kv_bytes} bytes) is larger than the whole prompt_cache_budget "
        f"({budget_bytes} bytes): not kept"
    )


def _nothing_kept(error: str = "") -> dict[str, Any]:
    """An unload's reply when no prompt cache was kept; `error` says why, when one should have
    been."""
    return {"kv_file": None, "kv_bytes": 0, "tokens": 0, "error": error}


def _os_reason(exc: OSError) -> str:
    """An OSError as one line: errno name and text ("EMFILE: Too many open files")."""
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{name}: {text}" if name else text
