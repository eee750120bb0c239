"""The lender's side of a lease (issue 46): `arbiterd rpc-server --lend` serves its devices to one
borrower at a time, and only while it holds those devices' tokens in this machine's own arenas.
So the lender's own programs (its arbiterd models, `arbiterd run`, a program of the bare
protocol, the daemon stepping aside for a game) wait for the GPU as for any holder, and the
lender revokes the lease as soon as one of them does.

Owns the lease channel's listener, the one lease at a time, and what the front (front.py)
admits. A lease goes through:

    idle       connected and proven, nothing granted
    taking     the borrower wants the devices: the lender queues for its tokens (in the batch
               class, behind the lender's own interactive and normal waiters)
    granted    the tokens held, named "lent to BORROWER (models)"; the lender sleeps on its
               arenas' doorbells for a waiter
    revoking   a waiter came: `revoke {by}` sent; once the borrower says `returned` and none of
               its connections is left, the idle server processes are stopped and the tokens
               go to the waiter (hand_over); a borrower that has not done so within the lease's
               timeout has its connections closed and their server processes stopped first.
               The lease goes back to idle: taking again at the borrower's next `want`

The front admits the borrower's address for as long as its lease is open, granted or not: ggml's
client connects for short questions (how many devices, how much memory) whenever a worker
starts, and those hold nothing. Holding memory on the devices only while granted is the
borrower's side of the protocol: its models use an `rpc:` device only while they hold its arena's
token, which the borrower's lease holds while the lease is not granted (borrower.py). Any other
address is refused.

A borrower that closes the channel, or says nothing for the timeout, ends its lease: its
connections are closed the same way and the tokens released.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from arbiterd.arena.doorbell import Doorbell, sleep_until_wanted
from arbiterd.arena.records import ArenaState, Gateway, Hold, Place
from arbiterd.errors import AcquireCancelledError, ArbiterError, ProtocolError
from arbiterd.lease.channel import BEAT_S, HELLO_TIMEOUT_S, Op, proves
from arbiterd.procs import holder_name, waiter_name
from arbiterd.states import Priority
from arbiterd.wire import LineReader, LineWriter

log = logging.getLogger(__name__)


class _Post(enum.Enum):
    """What a lease's threads post to its queue: a message of the borrower, the channel's end,
    the tokens taken (or not), who holds them meanwhile, a waiter come."""

    MESSAGE = enum.auto()
    GONE = enum.auto()
    TAKEN = enum.auto()
    NOT_TAKEN = enum.auto()
    WAITING = enum.auto()
    WANTED = enum.auto()


REVOKE_POLL_S = 0.01  # how often a revoke looks whether the borrower's connections are gone
NAME_MAX = 120  # a borrower's or a model's name, as the lender shows it


class Front(Protocol):
    """What the lender asks of the RPC front (front.Front)."""

    def admit(self, address: str | None) -> None: ...

    def serving(self) -> int: ...

    def close_all(self) -> None: ...

    def drop_spares(self) -> None: ...

    def counted(self) -> tuple[int, int]: ...


class State(enum.StrEnum):
    IDLE = "idle"
    TAKING = "taking"
    GRANTED = "granted"
    REVOKING = "revoking"


@dataclass(frozen=True)
class Borrower:
    address: str  # where its channel comes from: the one address the front admits
    name: str  # as it calls itself (its host name), else its address
    models: tuple[str, ...]

    @property
    def label(self) -> str:
        """The holder's name in the lender's arenas while lent."""
        models = f" ({', '.join(self.models)})" if self.models else ""
        return f"lent to {self.name}{models}"


class Lender:
    """Serves lease channels on a listening socket, one lease at a time, for the devices whose
    arenas `gateway` takes together (arena.device_arenas)."""

    def __init__(
        self,
        *,
        key: bytes,
        gateway: Gateway,
        devices: Sequence[str],
        front: Front,
        timeout_s: float,
        name: str,
        say: Callable[[str], None],
    ) -> None:
        self._key = key
        self._gateway = gateway
        self._devices = list(devices)
        self._front = front
        self._timeout_s = timeout_s
        self._name = name
        self._say = say  # a line for the lender's own log (its standard output)
        self._lock = threading.Lock()
        self._lent_to: Borrower | None = None
        self._open: set[socket.socket] = set()  # the listener and the channels, for close()

    def serve(self, listener: socket.socket) -> None:
        """Accept borrowers until `close`; each channel has a thread."""
        with self._lock:
            self._open.add(listener)
        while True:
            try:
                conn, (address, *_) = listener.accept()
            except OSError:
                return
            with self._lock:
                self._open.add(conn)
            threading.Thread(
                target=self._channel, args=(conn, address), name="lease", daemon=True
            ).start()

    def close(self) -> None:
        """Stop listening and end every channel (each lease ends as for a borrower gone)."""
        with self._lock:
            sockets = list(self._open)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _channel(self, conn: socket.socket, address: str) -> None:
        try:
            self._serve_channel(conn, address)
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _serve_channel(self, conn: socket.socket, address: str) -> None:
        conn.settimeout(HELLO_TIMEOUT_S)
        reader, writer = LineReader(conn), LineWriter(conn)
        nonce = secrets.token_hex(16)
        writer.send(
            {
                "op": Op.CHALLENGE,
                "nonce": nonce,
                "lender": self._name,
                "devices": self._devices,
                "timeout_s": self._timeout_s,
            }
        )
        try:
            hello = reader.read()
        except (OSError, ProtocolError):
            hello = None
        if hello is None or hello.get("op") != Op.HELLO:
            log.warning("lease: %s did not answer the challenge: refused", address)
            return
        if not proves(self._key, nonce, hello.get("proof")):
            log.warning("lease: %s answered with a wrong key: refused, no lease", address)
            self._say(f"refused a lease to {address}: wrong key")
            writer.send({"op": Op.REFUSED, "reason": "wrong key: no lease"})
            return
        borrower = Borrower(
            address,
            _text(hello.get("borrower")) or address,
            tuple(_text(m) for m in hello.get("models") or () if _text(m)),
        )
        with self._lock:
            busy, self._lent_to = self._lent_to, self._lent_to or borrower
        if busy is not None:
            writer.send(
                {"op": Op.REFUSED, "reason": f"{self._devices_text()} {busy.label} already"}
            )
            return
        conn.settimeout(None)
        self._front.admit(address)
        self._say(f"lease open to {borrower.name} ({address}): {self._devices_text()}")
        try:
            _Lease(self, borrower, reader, writer).run()
        finally:
            with self._lock:
                self._lent_to = None

    def _devices_text(self) -> str:
        return ", ".join(self._devices)


class _Lease:
    """One borrower's lease, driven from its channel's thread; a reader thread, a taker and a
    watcher post to its queue."""

    def __init__(
        self, lender: Lender, borrower: Borrower, reader: LineReader, writer: LineWriter
    ) -> None:
        self._lender = lender
        self._front = lender._front
        self._borrower = borrower
        self._reader = reader
        self._writer = writer
        self._events: queue.Queue[tuple[_Post, Any]] = queue.Queue()
        self._state = State.IDLE
        self._hold: Hold | None = None
        self._taking: _Taking | None = None
        self._watching: _Watching | None = None
        self._returned = False  # the borrower said it holds nothing on the devices
        self._wants_again = False  # a `want` came while revoking
        self._revoke_deadline = 0.0

    def run(self) -> None:
        threading.Thread(target=self._read, name="lease-read", daemon=True).start()
        timeout_s = self._lender._timeout_s
        heard = next_beat = time.monotonic()
        why = ""
        try:
            while not why:
                now = time.monotonic()
                if now >= next_beat:
                    received, sent = self._front.counted()
                    self._send(Op.BEAT, received_bytes=received, sent_bytes=sent)
                    next_beat = now + BEAT_S
                if now - heard > timeout_s:
                    why = f"heard nothing for {timeout_s:g} s"
                    break
                if self._state is State.REVOKING:
                    self._settle_revoke(now)
                wait_s = max(0.0, min(next_beat, heard + timeout_s) - now)
                if self._state is State.REVOKING:
                    wait_s = min(wait_s, REVOKE_POLL_S)
                try:
                    kind, value = self._events.get(timeout=wait_s)
                except queue.Empty:
                    continue
                if kind is _Post.MESSAGE:
                    heard = time.monotonic()
                    why = self._on_message(value)
                elif kind is _Post.GONE:
                    why = value
                else:
                    self._on_local(kind, value)
        finally:
            self._end(why)

    def _read(self) -> None:
        while True:
            try:
                message = self._reader.read()
            except ProtocolError as exc:
                self._events.put((_Post.GONE, f"it sent a bad message: {exc}"))
                return
            except OSError as exc:
                self._events.put((_Post.GONE, f"its channel broke: {exc.strerror or exc}"))
                return
            if message is None:
                self._events.put((_Post.GONE, "it closed the channel"))
                return
            self._events.put((_Post.MESSAGE, message))

    def _on_message(self, message: dict[str, Any]) -> str:
        """A message from the borrower; returns why the lease ends, or ""."""
        op = message.get("op")
        if op == Op.WANT:
            if self._state is State.IDLE:
                self._take()
            elif self._state is State.REVOKING:
                self._wants_again = True
        elif op == Op.RETURNED:
            if self._state is State.REVOKING:
                self._returned = True
        elif op != Op.BEAT:
            return f"it sent {op!r}, which a borrower never sends"
        return ""

    def _on_local(self, kind: _Post, value: Any) -> None:
        if kind is _Post.TAKEN and self._state is State.TAKING:
            self._hold, self._taking = value, None
            self._state = State.GRANTED
            self._send(Op.GRANT)
            self._lender._say(f"granted to {self._borrower.name}")
            gateway = self._lender._gateway
            self._watching = _Watching(value, self._events, lambda: _who_waits(gateway.observe()))
        elif kind is _Post.NOT_TAKEN:
            self._taking = None
            self._state = State.IDLE
            self._lender._say(f"could not take the devices for {self._borrower.name}: {value}")
        elif kind is _Post.WAITING and self._state is State.TAKING:
            self._send(Op.WAITING, holder=value)
        elif kind is _Post.WANTED and self._state is State.GRANTED:
            self._revoke(value)

    def _take(self) -> None:
        self._state = State.TAKING
        self._taking = _Taking(self._lender._gateway, self._borrower, self._events)

    def _revoke(self, by: str) -> None:
        self._stop_watching()
        self._state = State.REVOKING
        self._returned = False
        self._revoke_deadline = time.monotonic() + self._lender._timeout_s
        self._send(Op.REVOKE, by=by)
        self._lender._say(f"revoked from {self._borrower.name}: {by} wants the GPU")

    def _settle_revoke(self, now: float) -> None:
        """Give the tokens to the waiter once the borrower holds nothing, or by force once it
        took too long."""
        if self._returned and self._front.serving() == 0:
            self._lender._say(f"returned by {self._borrower.name}")
        elif now >= self._revoke_deadline:
            self._lender._say(
                f"{self._borrower.name} did not return the devices within "
                f"{self._lender._timeout_s:g} s: its connections closed"
            )
            self._front.close_all()
        else:
            return
        self._front.drop_spares()
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.hand_over()
        self._state = State.IDLE
        if self._wants_again:
            self._wants_again = False
            self._take()

    def _end(self, why: str) -> None:
        self._lender._say(f"lease of {self._borrower.name} ended: {why}")
        self._stop_watching()
        if self._taking is not None:
            taken = self._taking.give_up()
            if taken is not None:
                taken.release()
        while not self._events.empty():  # taken as the lease ended: posted, never granted
            kind, value = self._events.get_nowait()
            if kind is _Post.TAKEN:
                value.release()
        self._front.admit(None)
        self._front.close_all()
        self._front.drop_spares()
        if self._hold is not None:
            self._hold.release()
            self._hold = None

    def _stop_watching(self) -> None:
        if self._watching is not None:
            self._watching.stop()
            self._watching = None

    def _send(self, op: Op, **fields: object) -> None:
        self._writer.send({"op": op, **fields})


class _Taking:
    """The lender queued for its tokens, in a thread: posts TAKEN with the hold, WAITING with
    the holder when someone holds them now, or NOT_TAKEN with why."""

    def __init__(
        self, gateway: Gateway, borrower: Borrower, events: queue.Queue[tuple[_Post, Any]]
    ) -> None:
        self._events = events
        self._cancel = threading.Event()
        self._place: Place = gateway.queue(Priority.BATCH)
        self._taken: Hold | None = None
        self._thread = threading.Thread(
            target=self._run, args=(borrower,), name="lease-take", daemon=True
        )
        self._thread.start()

    def _run(self, borrower: Borrower) -> None:
        def waiting(state: ArenaState) -> None:
            self._events.put((_Post.WAITING, holder_name(state) or "another program"))

        try:
            hold = self._place.take(borrower.label, cancel=self._cancel, on_wait=waiting)
        except AcquireCancelledError:
            return
        except ArbiterError as exc:
            self._events.put((_Post.NOT_TAKEN, str(exc)))
            return
        finally:
            self._place.leave()
        if self._cancel.is_set():
            self._taken = hold
            return
        self._events.put((_Post.TAKEN, hold))

    def give_up(self) -> Hold | None:
        """Stop waiting; the tokens, if they came meanwhile and were not posted."""
        self._cancel.set()
        self._thread.join()
        return self._taken


class _Watching:
    """Sleeps on the arenas' doorbells while lent; posts WANTED with who once someone waits."""

    def __init__(
        self, hold: Hold, events: queue.Queue[tuple[_Post, Any]], who: Callable[[], str]
    ) -> None:
        self._stop = threading.Event()
        self._doorbell = Doorbell()
        self._thread = threading.Thread(
            target=self._run, args=(hold, events, who), name="lease-watch", daemon=True
        )
        self._thread.start()

    def _run(
        self, hold: Hold, events: queue.Queue[tuple[_Post, Any]], who: Callable[[], str]
    ) -> None:
        if sleep_until_wanted(hold, self._doorbell, self._stop):
            events.put((_Post.WANTED, who()))

    def stop(self) -> None:
        self._stop.set()
        self._doorbell.wake()
        self._thread.join()
        self._doorbell.close()


def _who_waits(state: ArenaState) -> str:
    """The first waiter, as the lender's arena names it (the lender itself waits for nothing
    while it holds the tokens: its ticket went as it took them)."""
    pids = [waiter.pid for waiter in state.queue] or list(state.waiter_pids)
    if not pids:
        return "a program of the lender"
    return f"{waiter_name(state, pids[0]) or 'a program'} (pid {pids[0]})"


def _text(value: object) -> str:
    return value[:NAME_MAX] if isinstance(value, str) else ""
