"""A model on several devices: their arenas taken as one way to the GPU (issue 27). Owns the
order in which a program takes several arenas and what it holds meanwhile: `Devices` (a
Gateway over the gateways of a model's devices), `DevicesPlace` and `DevicesHold`. Never takes
a lock itself: each device's gateway does (the arena's token, token.py, or a group's gate,
groups.py), and this module only sequences them.

A model on several devices holds every one of their tokens while it is warm, and lets go of all
of them when any of them is wanted: a waiter on one device holds that arena's want.lock, so it
makes the holders on that device release, and only those. It takes them one by one, in the
**canonical order** (`canonical_order`: device ids in their canonical spelling, sorted as
strings, which for these ASCII ids is byte order): it queues on the first arena, waits for its
token, only then queues on the next one, and so on, holding what it has while it waits for the
rest (hold-and-wait). On a cancel, a timeout or an error before it holds everything, it lets go
of what it holds, in reverse order, and raises: nothing is held for a program that is not warm.

Why hold-and-wait in one order cannot deadlock. A waiter on arena k waits either for the
holder of k's token or for the ticket just ahead of its own in k's queue, whose owner also
waits on k. A program waiting on k holds only arenas before k in the order (it took them
first). So every wait is on a program that holds k, or waits on k, and the holder of k, when
it waits at all, waits only on an arena after k: along any chain of waits the arenas only go
forward, and a cycle would need one to go back. The chain ends at a program that waits for
nothing: it holds all it asked for, sees the waiter on its arena (want.lock) and releases
within its own policy (arbiterd's min hold, a foreign program when it is done), and the chain
unwinds. Within one arena the tickets' order never changes while they wait (__init__.py), so
no two waiters of one arena wait on each other. Programs of one arena only, arbiterd's own
single-device models as well as foreign programs of the bare protocol (token.lock and
want.lock), are the case of a single device and fit the order as they are. What the order
forbids is announcing early: a ticket put in arena k's queue while its owner still waits for
an arena before k makes k's waiters behind it wait on a program that waits on them.

What it costs. A model that holds gpu0 while it waits for rpc:HOST:PORT keeps gpu0 until it
has the rest: gpu0 is held, idle, by a model that cannot run yet, and a model that needs only
gpu0 waits meanwhile (a waiting model has no Hold, so it probes nothing: it sees that waiter
only once it holds everything and is warm). And a model on several devices goes cold on all of
them for a waiter that wants one: its residency is one model's, warm on every device or none.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from arbiterd.arena.doorbell import Bell
from arbiterd.arena.records import ArenaState, Gateway, Hold, PassedOver, Place
from arbiterd.arena.token import Arena
from arbiterd.errors import (
    AcquireCancelledError,
    AcquireTimeoutError,
    ArenaError,
    BadValueError,
)
from arbiterd.paths import DeviceId, device_arena_of, parse_device_id
from arbiterd.states import Priority


def canonical_order(devices: Iterable[str | DeviceId]) -> tuple[DeviceId, ...]:
    """`devices` parsed and in the order every program takes them: sorted by their canonical
    spelling (docs/arena-protocol.md § Devices). A device named twice is refused: a program
    would then take one token twice and wait for itself."""
    parsed = [parse_device_id(d) if isinstance(d, str) else d for d in devices]
    twice = sorted(d for d, n in collections.Counter(str(d) for d in parsed).items() if n > 1)
    if twice:
        raise BadValueError(f"device {', '.join(twice)} named twice")
    return tuple(sorted(parsed))  # by canonical spelling (DeviceId.__lt__)


class Devices:
    """A way to the GPU over several devices' gateways (an Arena or a group's Gate each),
    taken in the canonical order. A Gateway: a worker uses it as it uses one arena."""

    def __init__(self, gateways: Iterable[tuple[str | DeviceId, Gateway]]) -> None:
        pairs = [(parse_device_id(d) if isinstance(d, str) else d, g) for d, g in gateways]
        if not pairs:
            raise BadValueError("a way to the GPU needs at least one device")
        by_id = {str(device): gateway for device, gateway in pairs}
        order = canonical_order(device for device, _ in pairs)  # refuses one named twice
        self.parts: tuple[tuple[DeviceId, Gateway], ...] = tuple(
            (device, by_id[str(device)]) for device in order
        )

    @property
    def devices(self) -> tuple[DeviceId, ...]:
        return tuple(device for device, _ in self.parts)

    def queue(self, priority: Priority) -> DevicesPlace:
        """A place in the first device's queue; the others' come in their turn (`take`)."""
        return DevicesPlace(self.parts, priority)

    def acquire(
        self,
        name: str,
        *,
        model: str | None = None,
        priority: Priority = Priority.NORMAL,
        timeout_s: float | None = None,
        cancel: threading.Event | None = None,
        on_wait: Callable[[ArenaState], None] | None = None,
    ) -> DevicesHold:
        """Every device's token, as Arena.acquire takes one arena's (for `arbiterd run`)."""
        place = self.queue(priority)
        try:
            return place.take(
                name, model=model, cancel=cancel, on_wait=on_wait, timeout_s=timeout_s
            )
        finally:
            place.leave()

    def observe(self) -> ArenaState:
        """The first device's arena, in the canonical order, that someone holds, else the first
        one's: who holds the GPU, for a caller that shows one holder and its queue."""
        states = (gateway.observe() for _, gateway in self.parts)
        first = next(states)
        if first.holder_pid is not None:
            return first
        return next((state for state in states if state.holder_pid is not None), first)

    def first_class_waiting(self) -> int | None:
        """The most urgent class (rank) waiting on any of the devices."""
        ranks = [gateway.first_class_waiting() for _, gateway in self.parts]
        waiting = [rank for rank in ranks if rank is not None]
        return min(waiting) if waiting else None


def over_devices(gateways: Iterable[tuple[str | DeviceId, Gateway]]) -> Gateway:
    """The way to the GPU over `gateways` ((device id, gateway) pairs): the one gateway itself
    for a single device, so that a model on one device takes exactly the path it always took,
    else `Devices`."""
    devices = Devices(gateways)
    if len(devices.parts) == 1:
        return devices.parts[0][1]
    return devices


def device_arenas(devices: Iterable[str | DeviceId], gpu0_arena: Path) -> Gateway:
    """The arenas of `devices` when gpu0's arena is `gpu0_arena` (paths.device_arena_of), as one
    way to the GPU (`over_devices`)."""
    parsed = canonical_order(devices)
    return over_devices((device, Arena(device_arena_of(device, gpu0_arena))) for device in parsed)


class DevicesPlace:
    """A place in line for every device: a place in the first device's queue, kept across
    tries that a cancel interrupts while it is the one waited on. A try interrupted later, with
    part of the tokens held, lets them go and queues afresh at the next try."""

    def __init__(self, parts: tuple[tuple[DeviceId, Gateway], ...], priority: Priority) -> None:
        self._parts = parts
        self._priority = priority
        self._first: Place | None = parts[0][1].queue(priority)
        self._left = False

    def take(
        self,
        name: str,
        *,
        model: str | None = None,
        cancel: threading.Event | None = None,
        on_wait: Callable[[ArenaState], None] | None = None,
        timeout_s: float | None = None,
    ) -> DevicesHold:
        """Every device's token (or gate), in the canonical order. `on_wait` is called as each
        device's gateway calls it, when a wait on that device begins, with that arena's state
        (ArenaState.path says which). Setting `cancel` gives up (AcquireCancelledError),
        `timeout_s` bounds the whole take (AcquireTimeoutError); either way, and on any error,
        what was taken is let go first."""
        if self._left:
            raise ArenaError("take() on a place that left")
        if timeout_s is not None and timeout_s < 0:
            raise BadValueError(f"timeout must be >= 0 seconds, got {timeout_s}")
        stop = cancel if timeout_s is None else _Deadline(cancel, timeout_s)
        held: list[tuple[DeviceId, Hold]] = []
        try:
            for device, gateway in self._parts:
                hold = self._take_one(
                    gateway, first=not held, name=name, model=model, cancel=stop, on_wait=on_wait
                )
                held.append((device, hold))
        except AcquireCancelledError:
            _each_reversed(held, lambda hold: hold.release())
            if isinstance(stop, _Deadline) and stop.expired():
                devices = ", ".join(str(device) for device, _ in self._parts)
                raise AcquireTimeoutError(
                    f"the GPU tokens of {devices} were not all free within {timeout_s:g} s"
                ) from None
            raise
        except BaseException:
            _each_reversed(held, lambda hold: hold.release())
            raise
        return DevicesHold(tuple(held))

    def _take_one(
        self,
        gateway: Gateway,
        *,
        first: bool,
        name: str,
        model: str | None,
        cancel: threading.Event | None,
        on_wait: Callable[[ArenaState], None] | None,
    ) -> Hold:
        """One device's hold, in its queue: the kept place for the first device, a new one for
        each of the others, queued only now that it is their turn (the module says why)."""
        if first:
            if self._first is None:  # used up by an earlier try that then let go
                self._first = gateway.queue(self._priority)
            place = self._first
        else:
            place = gateway.queue(self._priority)
        try:
            hold = place.take(name, model=model, cancel=cancel, on_wait=on_wait)
        except BaseException:
            if not first:
                place.leave()
            raise
        place.leave()  # used up (a place leaves its queue once it holds; idempotent)
        if first:
            self._first = None
        return hold

    def leave(self) -> None:
        """Stop waiting. Idempotent."""
        self._left = True
        place, self._first = self._first, None
        if place is not None:
            place.leave()


class DevicesHold:
    """Every device of a model held: their tokens (or places in their groups' gates)."""

    def __init__(self, parts: tuple[tuple[DeviceId, Hold], ...]) -> None:
        self.parts = parts  # in the order taken; a Token among them gives `fd` to a command

    @property
    def passed_over(self) -> tuple[PassedOver, ...]:
        """The waiters passed over on the way, on every device."""
        return tuple(itertools.chain.from_iterable(hold.passed_over for _, hold in self.parts))

    def wanted(self) -> bool:
        """True when someone the holder must yield to waits on any of the devices."""
        return any(hold.wanted() for _, hold in self.parts)

    def wanted_on(self) -> tuple[DeviceId, ...]:
        """The devices on which someone waits: whom a release is for."""
        return tuple(device for device, hold in self.parts if hold.wanted())

    def bells(self) -> tuple[Bell, ...]:
        """Every device's bells: a waiter on any of them rings."""
        return tuple(itertools.chain.from_iterable(hold.bells() for _, hold in self.parts))

    def used(self) -> None:
        """Nothing to say: a model on several devices is in no group (Hold)."""

    def hand_over(self) -> None:
        """Hand each device over to its waiters, the last taken first."""
        _each_reversed(self.parts, lambda hold: hold.hand_over())

    def release(self) -> None:
        """Let go of every device, the last taken first. Idempotent."""
        _each_reversed(self.parts, lambda hold: hold.release())


def _each_reversed(parts: Iterable[tuple[DeviceId, Hold]], act: Callable[[Hold], None]) -> None:
    """`act` on each hold, the last taken first; one that fails does not keep the others held
    (the first failure is raised once all were tried)."""
    failure: BaseException | None = None
    for _, hold in reversed(list(parts)):
        try:
            act(hold)
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


class _Deadline(threading.Event):
    """A cancel that is set, too, once `timeout_s` has passed, or once the caller's `cancel`
    is: a gateway's place takes a cancel and no deadline, and it looks at the cancel only
    through is_set(), at least every locks.CANCEL_POLL_S while it waits (token.py's Turn,
    groups.py's GateTicket). So one bound holds for the whole take, however many devices."""

    def __init__(self, cancel: threading.Event | None, timeout_s: float) -> None:
        super().__init__()
        self._cancel = cancel
        self._deadline = time.monotonic() + timeout_s

    def expired(self) -> bool:
        return time.monotonic() >= self._deadline and not (
            self._cancel is not None and self._cancel.is_set()
        )

    def is_set(self) -> bool:
        cancelled = self._cancel is not None and self._cancel.is_set()
        return super().is_set() or cancelled or time.monotonic() >= self._deadline
