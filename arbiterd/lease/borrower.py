"""The borrower's side of a lease (issue 46): a daemon whose models are placed on a lent RPC
device (`[devices."rpc:HOST:PORT"] lease = "HOST:PORT"`) holds the lease channel to its lender,
and holds that device's arena token on the lender's behalf whenever the lease is not granted.

So a revoke needs no release path of its own: the borrower queues for the `rpc:` arena's token
as any local waiter would (in the interactive class), the model that holds it releases in place
at its next step boundary (its connection to the lender closes, the lender's server frees its
memory), and once the token is ours the lender hears `returned`. A request that comes meanwhile
waits in the arena's queue behind the lease, whose holder name says why ("lease of rpc:...:
revoked: the lender's game (pid N) wants its GPU"). When a model waits for the token while the
lease is not granted, the borrower says `want`; at `grant` it hands the token over to the
waiting model.

Owns one lease's channel (connect, prove the key, beats both ways, reconnect with back-off) and
the token it holds. A lender that cannot be reached, refuses, or falls silent for its timeout
ends the session: the token is let go, so a request for the device fails on the device itself,
naming it (the RPC faults of issue 27), rather than waiting for a lender that is gone; the lease
is asked for again every few seconds, and the models resume once the lender is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from arbiterd.arena import Arena, Token
from arbiterd.arena.doorbell import Doorbell, sleep_until_wanted
from arbiterd.errors import AcquireCancelledError, ArbiterError, ProtocolError
from arbiterd.lease.channel import (
    BEAT_S,
    CONNECT_TIMEOUT_S,
    HELLO_TIMEOUT_S,
    Op,
    proof,
    split_address,
)
from arbiterd.states import Priority
from arbiterd.wire import AsyncLineReader, encode

log = logging.getLogger(__name__)


class _Post(enum.Enum):
    """What the session's tasks and threads post to its queue: a message of the lender, the
    channel's end, the token taken, a model waiting for it."""

    MESSAGE = enum.auto()
    CLOSED = enum.auto()
    TAKEN = enum.auto()
    WANTED = enum.auto()


RETRY_MIN_S = 0.5  # the first try again after a session ended
RETRY_MAX_S = 5.0  # back-off ceiling: a lender that comes back is found within this
NAME_MAX = 200  # a lender's name or holder, as shown


class LeaseState(enum.StrEnum):
    CONNECTING = "connecting"
    NOT_GRANTED = "not granted"  # connected; the borrower holds the device for the lender
    ASKED = "asked"  # a model waits: `want` said, no grant yet
    WAITING = "waiting"  # the lender's GPU is held there (`by`); granted once it is free
    GRANTED = "granted"
    REVOKING = "revoking"  # the lender's `by` wants its GPU: the models release
    REVOKED = "revoked"  # released: the lender's `by` has it
    UNREACHABLE = "unreachable"  # no session: `reason`
    REFUSED = "refused"  # the lender refused the lease: `reason`


@dataclass(frozen=True)
class LeaseView:
    """What a lease is doing, for status (status.Lease has these fields), `arbiterd devices`
    and the events."""

    device: str
    lender: str  # HOST:PORT of its lease channel
    state: LeaseState
    since: float  # time.time() of the last change of state
    by: str | None = None  # who holds or wants the GPU on the lender
    reason: str | None = None  # why unreachable or refused
    lender_name: str | None = None  # the lender's host name, as its challenge said
    received_bytes: int | None = None  # what the lender's front took from this borrower
    sent_bytes: int | None = None


class Borrower:
    """One lent device's lease, run as a task on the daemon's loop."""

    def __init__(
        self,
        *,
        device: str,
        lender: str,
        key: bytes,
        arena: Arena,
        models: tuple[str, ...],
        name: str,
        on_change: Callable[[LeaseView], None],
    ) -> None:
        self._host, self._port = split_address(lender, "lease")
        self._key = key
        self._arena = arena
        self._models = models
        self._name = name
        self._on_change = on_change
        self.view = LeaseView(device, lender, LeaseState.CONNECTING, time.time())
        self._task: asyncio.Task[None] | None = None
        self._token: Token | None = None
        self._taking: _Taking | None = None
        self._watching: _Watching | None = None
        self._events: asyncio.Queue[tuple[_Post, Any]] = asyncio.Queue()
        # Set once the first session holds the token for the lender, or ended: the models may
        # start then (a model that connects before the lease is open is refused by the lender).
        self.settled = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"lease {self.view.device}"
        )

    async def close(self) -> None:
        """End the lease: the channel closed (the lender ends its side), the token let go."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._let_go()

    async def _run(self) -> None:
        delay_s = RETRY_MIN_S
        while True:
            connected = False
            try:
                connected = await self._session()
                reason = "the lender closed the lease channel"
            except (OSError, TimeoutError) as exc:
                reason = _why(exc)
            except ProtocolError as exc:
                reason = f"the lender sent a bad message: {exc}"
            except _Refused as exc:
                await self._let_go()
                self._change(LeaseState.REFUSED, reason=str(exc))
                self.settled.set()
                await asyncio.sleep(RETRY_MAX_S)
                continue
            except _Silent as exc:
                reason = str(exc)
            await self._let_go()
            self._change(LeaseState.UNREACHABLE, reason=f"{self.view.lender}: {reason}")
            self.settled.set()
            delay_s = RETRY_MIN_S if connected else min(2 * delay_s, RETRY_MAX_S)
            await asyncio.sleep(delay_s)

    async def _session(self) -> bool:
        """One connection to the lender, to its end; True once the lender accepted us."""
        self._change(LeaseState.CONNECTING)
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(self._host, self._port)
        lines = AsyncLineReader(reader)
        try:
            challenge = await asyncio.wait_for(lines.read(), HELLO_TIMEOUT_S)
            if challenge is None or challenge.get("op") != Op.CHALLENGE:
                raise ProtocolError("the lease channel did not begin with a challenge")
            nonce, timeout_s = challenge.get("nonce"), challenge.get("timeout_s")
            if not isinstance(nonce, str) or not isinstance(timeout_s, int | float):
                raise ProtocolError("a challenge without its nonce or timeout")
            self.view = replace(self.view, lender_name=_text(challenge.get("lender")))
            writer.write(
                encode(
                    {
                        "op": Op.HELLO,
                        "proof": proof(self._key, nonce),
                        "borrower": self._name,
                        "models": list(self._models),
                    }
                )
            )
            await writer.drain()
            self._events = asyncio.Queue()
            reading = asyncio.create_task(self._read(lines))
            beating = asyncio.create_task(self._beat(writer))
            try:
                await self._drive(writer, float(timeout_s))
            finally:
                reading.cancel()
                beating.cancel()
                await asyncio.gather(reading, beating, return_exceptions=True)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return True

    async def _drive(self, writer: asyncio.StreamWriter, timeout_s: float) -> None:
        """The session's events, until the lender closes or falls silent. First of all the
        token is taken for the lender: nothing is granted yet."""
        self._change(LeaseState.NOT_GRANTED)
        self._take(f"lease of {self.view.device}: not granted yet by {self._lender_text()}")
        heard = time.monotonic()
        accepted = False
        while True:
            try:
                kind, value = await asyncio.wait_for(
                    self._events.get(), max(0.0, heard + timeout_s - time.monotonic())
                )
            except TimeoutError:
                raise _Silent(f"heard nothing from the lender for {timeout_s:g} s") from None
            if kind is _Post.MESSAGE:
                heard = time.monotonic()
                accepted = True  # it spoke after our hello: it admits our connections now
                await self._on_message(value, writer)
                if self._token is not None:
                    self.settled.set()
            elif kind is _Post.CLOSED:
                return
            elif kind is _Post.TAKEN and self.view.state is LeaseState.GRANTED:
                await asyncio.to_thread(value.hand_over)  # it came as the grant did
            elif kind is _Post.TAKEN:
                self._taking = None
                self._token = value
                if accepted:
                    self.settled.set()
                if self.view.state in (LeaseState.REVOKING, LeaseState.REVOKED):
                    self._change(LeaseState.REVOKED, by=self.view.by)
                    await _send(writer, Op.RETURNED)
                self._watch()
            elif kind is _Post.WANTED and self._token is not None:
                if self.view.state not in (LeaseState.ASKED, LeaseState.WAITING):
                    self._change(LeaseState.ASKED)
                await _send(writer, Op.WANT)

    async def _on_message(self, message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        op = message.get("op")
        if op == Op.BEAT:
            received, sent = message.get("received_bytes"), message.get("sent_bytes")
            if isinstance(received, int) and isinstance(sent, int):
                self.view = replace(self.view, received_bytes=received, sent_bytes=sent)
        elif op == Op.GRANT:
            await self._grant()
        elif op == Op.REVOKE:
            by = _text(message.get("by")) or "a program"
            self._change(LeaseState.REVOKING, by=by)
            label = f"lease of {self.view.device}: revoked: the lender's {by} wants its GPU"
            if self._token is not None:  # nothing of ours is on the devices
                self._token.rename(label)
                self._change(LeaseState.REVOKED, by=by)
                await _send(writer, Op.RETURNED)
            elif self._taking is None:
                self._take(label)
        elif op == Op.WAITING:
            by = _text(message.get("holder")) or "another program"
            self._change(LeaseState.WAITING, by=by)
            if self._token is not None:
                self._token.rename(
                    f"lease of {self.view.device}: waiting: the lender's {by} has its GPU"
                )
        elif op == Op.REFUSED:
            raise _Refused(_text(message.get("reason")) or "refused")

    async def _grant(self) -> None:
        await self._stop_watching()
        await self._stop_taking()
        token, self._token = self._token, None
        if token is not None:
            await asyncio.to_thread(token.hand_over)
        self._change(LeaseState.GRANTED)

    def _take(self, label: str) -> None:
        self._taking = _Taking(self._arena, label, self._events)

    def _watch(self) -> None:
        if self._token is not None:
            self._watching = _Watching(self._token, self._events)

    async def _stop_watching(self) -> None:
        if self._watching is not None:
            watching, self._watching = self._watching, None
            await watching.stop()

    async def _stop_taking(self) -> None:
        """Give up a take in flight; a token it got meanwhile is let go."""
        if self._taking is not None:
            taking, self._taking = self._taking, None
            taken = await taking.give_up()
            if taken is not None:
                taken.release()

    async def _let_go(self) -> None:
        """Hold nothing: the session is over."""
        await self._stop_watching()
        await self._stop_taking()
        token, self._token = self._token, None
        if token is not None:
            token.release()

    async def _read(self, lines: AsyncLineReader) -> None:
        try:
            while (message := await lines.read()) is not None:
                await self._events.put((_Post.MESSAGE, message))
        except (OSError, ProtocolError) as exc:
            log.warning("lease of %s: %s", self.view.device, exc)
        await self._events.put((_Post.CLOSED, None))

    async def _beat(self, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while True:
                await _send(writer, Op.BEAT)
                await asyncio.sleep(BEAT_S)

    def _change(
        self, state: LeaseState, *, by: str | None = None, reason: str | None = None
    ) -> None:
        if state == self.view.state and by == self.view.by and reason == self.view.reason:
            return
        self.view = replace(self.view, state=state, since=time.time(), by=by, reason=reason)
        self._on_change(self.view)

    def _lender_text(self) -> str:
        name = self.view.lender_name
        return f"{name} ({self.view.lender})" if name else self.view.lender


class _Taking:
    """The device's token taken for the lender, in a thread; posts TAKEN with the token."""

    def __init__(self, arena: Arena, label: str, events: asyncio.Queue[tuple[_Post, Any]]) -> None:
        self._cancel = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._events = events
        self._taken: Token | None = None
        self._done = _in_thread(lambda: self._run(arena, label), "lease-take")

    def _run(self, arena: Arena, label: str) -> None:
        try:
            token = arena.acquire(label, priority=Priority.INTERACTIVE, cancel=self._cancel)
        except AcquireCancelledError:
            return
        except ArbiterError as exc:
            log.warning("lease: could not take %s: %s", arena.path, exc)
            return
        if self._cancel.is_set():
            self._taken = token
            return
        self._loop.call_soon_threadsafe(self._events.put_nowait, (_Post.TAKEN, token))

    async def give_up(self) -> Token | None:
        """Stop waiting; the token, if it came and was not posted."""
        self._cancel.set()
        await self._done
        return self._taken


class _Watching:
    """Sleeps on the arena's doorbell while the lease holds the token; posts WANTED once a model
    waits for it."""

    def __init__(self, token: Token, events: asyncio.Queue[tuple[_Post, Any]]) -> None:
        self._stop = threading.Event()
        self._doorbell = Doorbell()
        loop = asyncio.get_running_loop()

        def run() -> None:
            if sleep_until_wanted(token, self._doorbell, self._stop):
                loop.call_soon_threadsafe(events.put_nowait, (_Post.WANTED, None))

        self._done = _in_thread(run, "lease-watch")

    async def stop(self) -> None:
        self._stop.set()
        self._doorbell.wake()
        await self._done
        self._doorbell.close()


def _in_thread(work: Callable[[], None], name: str) -> asyncio.Future[None]:
    """Run `work` in a thread of its own: a lease may wait or watch for hours, and the loop's
    default executor has a few threads, which status and reload need (control/devicelist.py)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def run() -> None:
        try:
            work()
        finally:
            loop.call_soon_threadsafe(settle)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


class _Refused(Exception):
    """The lender said no (a wrong key, lent to another borrower)."""


class _Silent(Exception):
    """The lender said nothing for its timeout."""


async def _send(writer: asyncio.StreamWriter, op: Op) -> None:
    writer.write(encode({"op": op}))
    await writer.drain()


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def _text(value: object) -> str:
    return value[:NAME_MAX] if isinstance(value, str) else ""
