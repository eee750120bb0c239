"""The worker's way to the GPU: its arena gateway, the token once taken, and each wait for it.

Owns `gateway`, which arena (or group gate) a worker goes through; `Access`, its hold on the
token: the place it announces in the queue, the token it takes (its doorbell armed on the
token's bells from then on) and lets go of, given back or handed over; and `Waiting`, one way to
the token measured, however many tries it takes. Used by the engine thread alone
(worker/loop.py); what to do with the token is the loop's and worker/policy.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from arbiterd.arena import Arena, ArenaState, Gateway, Hold, Place
from arbiterd.arena.devices import device_arenas
from arbiterd.arena.doorbell import Doorbell
from arbiterd.arena.groups import Gate
from arbiterd.events import PassedOverEvent
from arbiterd.paths import device_arena_of
from arbiterd.procs import holder_name
from arbiterd.spec import WorkerConfig
from arbiterd.states import Priority
from arbiterd.wire import LineWriter
from arbiterd.worker.residency import Wait


def gateway(config: WorkerConfig, footprint: Callable[[], int | None]) -> Gateway:
    """The worker's way to the GPU: its group's gate in its device's arena (a group's models,
    a [groups] table's or a device's fitting set, are on one device: config/sharing.py sees to
    it), where it says `footprint()` to the keeper; else the arenas of its devices, taken in the
    canonical order (arena/devices.py). A model on one device goes through that device's arena
    alone: on the default ["gpu0"], gpu0's (`config.arena`), exactly as before devices had
    names; on ["cpu"], the cpu arena, shared only with the other models placed on the CPU."""
    if config.group:
        (device,) = config.spec.devices
        arena = Arena(device_arena_of(device, config.arena))
        return Gate(arena, config.group, config.spec.name, footprint)
    return device_arenas(config.spec.devices, config.arena)


class Waiting:
    """Measures one way to the token, however many tries it takes: from the first ask, with the
    holder the first busy try saw (the arena calls `saw` when a wait begins)."""

    def __init__(self) -> None:
        self._since, self._started = time.time(), time.monotonic()
        self._holder: ArenaState | None = None

    def saw(self, state: ArenaState) -> None:
        if self._holder is None:
            self._holder = state

    def done(self) -> Wait:
        holder = self._holder
        return Wait(
            since=self._since,
            wait_s=time.monotonic() - self._started,
            holder_pid=None if holder is None else holder.holder_pid,
            holder_name=None if holder is None else holder_name(holder),
        )


class Access:
    """The worker's hold on the GPU: `arena`, its gateway, and `token` while it holds it."""

    def __init__(
        self,
        config: WorkerConfig,
        footprint: Callable[[], int | None],
        doorbell: Doorbell,
        out: LineWriter,
    ) -> None:
        """`footprint`: what it says to a fitting set's keeper (`gateway`); `doorbell`: the
        engine thread's sleep, armed on the token's bells while it holds it; `out`: where the
        waiters it was let pass over are told."""
        self.name = config.spec.name
        self.arena = gateway(config, footprint)
        self.token: Hold | None = None
        self._doorbell = doorbell
        self._out = out

    def announce(self, priority: Priority) -> tuple[Place, Waiting]:
        """A place in the queue, which tells the holder at once, and the wait it starts."""
        waiting = Waiting()
        # Looked at before we announce: once we have, the holder may be gone at once.
        state = self.arena.observe()
        ticket = self.arena.queue(priority)
        if state.holder_pid is not None:
            waiting.saw(state)  # the holder we asked
        return ticket, waiting

    def got(self, token: Hold) -> None:
        """The token is ours: sleep on its bells from now on, so that a waiter who comes while
        the model loads or restores is seen at the first probe after."""
        self.token = token
        self._doorbell.arm(token.bells())
        for passed in token.passed_over:  # the arena logged each; the daemon's journal too
            event = PassedOverEvent(
                at=time.time(),
                model=self.name,
                pid=passed.waiter.pid,
                reason=passed.reason,
                free_s=passed.free_s,
                arena=str(passed.arena),
            )
            self._out.send(event.to_json())

    def give_up(self) -> None:
        """Let go of the token (if held): the next in the queue takes it when it can."""
        token, self.token = self.token, None
        self._doorbell.disarm()
        if token is not None:
            token.release()

    def hand_over(self) -> None:
        """Let go of the token for the waiter that wanted it (if held)."""
        token, self.token = self.token, None
        self._doorbell.disarm()
        if token is not None:
            token.hand_over()
