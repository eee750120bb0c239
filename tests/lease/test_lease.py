"""A lease end to end in one process (issue 46): the lender (arbiterd/lease/lender.py) with its
real front (arbiterd/rpcserver/front.py, whose server processes here echo bytes instead of
running ggml's server: tests/support/echo_server.py) and its own arena, and the borrower
(arbiterd/lease/borrower.py) with the `rpc:` device's arena, each arena a real one in its own
folder as on two machines. A "model" of the borrower takes the device's token as a worker does,
holds a connection through the lender's front while warm, and releases when someone waits; a
"program" of the lender takes the lender's token as `arbiterd run` does. The two daemons on the
real engine are tests/device/test_lease_rpc.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from arbiterd.arena import Arena
from arbiterd.lease.borrower import Borrower, LeaseState, LeaseView
from arbiterd.lease.channel import BEAT_S, Op, proof
from arbiterd.lease.lender import Lender
from arbiterd.rpcserver.front import Front
from arbiterd.wire import LineReader, LineWriter
from tests.support.daemon import free_port
from tests.support.waiting import wait_until

KEY = b"the lease key"
TIMEOUT_S = 2.0  # the lender's lease timeout here: a silent borrower is gone after it
WITHIN_S = 10.0


@dataclass
class Lending:
    arena: Arena
    front: Front
    rpc: str  # the front's HOST:PORT
    lease: str  # the lease channel's
    said: list[str] = field(default_factory=list)

    def holder(self) -> str | None:
        state = self.arena.observe()
        return state.holder.name if state.holder else None


@contextlib.contextmanager
def lending(tmp_path: Path, timeout_s: float = TIMEOUT_S) -> Iterator[Lending]:
    arena = Arena(tmp_path / "lender" / "cpu")
    rpc = f"127.0.0.1:{free_port()}"
    front = Front(rpc, [sys.executable, "-m", "tests.support.echo_server"], 2, lending=True)
    serving = threading.Thread(target=front.serve_forever, daemon=True)
    serving.start()
    listener = socket.create_server(("127.0.0.1", 0))
    lease = f"127.0.0.1:{listener.getsockname()[1]}"
    found = Lending(arena, front, rpc, lease)
    lender = Lender(
        key=KEY,
        gateway=arena,
        devices=["cpu"],
        front=front,
        timeout_s=timeout_s,
        name="lender-host",
        say=found.said.append,
    )
    accepting = threading.Thread(target=lender.serve, args=(listener,), daemon=True)
    accepting.start()
    try:
        yield found
    finally:
        lender.close()  # as the lender's process ends: its listener and channels closed
        listener.close()
        front.stop()
        accepting.join(WITHIN_S)
        serving.join(WITHIN_S)


class Model:
    """A model of the borrower on the lent device: takes its arena's token, connects through
    the lender's front and sends `sent` bytes (its upload), holds both until someone waits,
    then closes the connection and hands the token over."""

    def __init__(self, arena: Arena, rpc: str, sent: int = 4096) -> None:
        self.warm = threading.Event()
        self.released = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(arena, rpc, sent), daemon=True)
        self._thread.start()

    def _run(self, arena: Arena, rpc: str, sent: int) -> None:
        try:
            with arena.acquire("model", timeout_s=WITHIN_S) as token:
                host, port = rpc.rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=WITHIN_S) as conn:
                    conn.sendall(b"w" * sent)
                    got = 0
                    while got < sent:
                        got += len(conn.recv(65536))
                    self.warm.set()
                    while not token.wanted():
                        time.sleep(0.005)
                token.hand_over()
                self.released.set()
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        self._thread.join(WITHIN_S)


class Program:
    """A program of the lender: waits for the lender's token and holds it until `end`."""

    def __init__(self, arena: Arena, name: str = "game") -> None:
        self.holds = threading.Event()
        self._end = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(arena, name), daemon=True)
        self._thread.start()

    def _run(self, arena: Arena, name: str) -> None:
        with arena.acquire(name, timeout_s=3 * WITHIN_S):
            self.holds.set()
            self._end.wait()

    def end(self) -> None:
        self._end.set()
        self._thread.join(WITHIN_S)


async def borrowing(
    tmp_path: Path, lent: Lending, views: list[LeaseView], key: bytes = KEY
) -> Borrower:
    """The borrower's lease of `lent`, started, once it holds its device for the lender (or
    was refused); every change of it appended to `views`."""
    lease = Borrower(
        device=f"rpc:{lent.rpc}",
        lender=lent.lease,
        key=key,
        arena=Arena(tmp_path / "borrower" / "rpc"),
        models=("m",),
        name="borrower-host",
        on_change=views.append,
    )
    lease.start()
    await asyncio.wait_for(lease.settled.wait(), WITHIN_S)
    return lease


async def until(condition: object, what: str, within_s: float = WITHIN_S) -> None:
    deadline = time.monotonic() + within_s
    while not callable(condition) or not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s: {what}")
        await asyncio.sleep(0.01)


def state_of(lease: Borrower) -> LeaseState:
    """Read anew each time (no narrowing: the loop changes it between two reads)."""
    return lease.view.state


def states(views: list[LeaseView]) -> list[str]:
    return [str(v.state) for v in views]


def test_a_model_waiting_for_the_device_is_granted_it_and_the_lender_shows_whom_it_is_lent_to(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        with lending(tmp_path) as lent:
            views: list[LeaseView] = []
            lease = await borrowing(tmp_path, lent, views)
            # Not granted yet: the borrower holds its device for the lender, nobody lends.
            assert state_of(lease) is LeaseState.NOT_GRANTED
            held = lease_holder(tmp_path)
            assert held is not None
            assert "not granted yet by lender-host" in held
            assert lent.holder() is None
            model = Model(Arena(tmp_path / "borrower" / "rpc"), lent.rpc)
            await until(model.warm.is_set, "the model warm")
            assert state_of(lease) is LeaseState.GRANTED
            assert lent.holder() == "lent to borrower-host (m)"
            assert lent.front.serving() == 1
            await until(lambda: (lease.view.received_bytes or 0) >= 4096, "the bytes counted")
            await lease.close()
            # The channel closed: the lender ends the lease, its connections and its token.
            await until(lambda: lent.holder() is None, "the lender's token given back")
            await until(lambda: lent.front.serving() == 0, "the model's connection closed")
            model.join()
            assert "open to borrower-host" in " ".join(lent.said)
            assert "ended: it closed the channel" in lent.said[-1]

    asyncio.run(scenario())


def lease_holder(tmp_path: Path) -> str | None:
    state = Arena(tmp_path / "borrower" / "rpc").observe()
    return state.holder.name if state.holder else None


def test_a_program_of_the_lender_revokes_the_lease_gets_the_gpu_once_freed_and_it_comes_back(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        with lending(tmp_path) as lent:
            views: list[LeaseView] = []
            lease = await borrowing(tmp_path, lent, views)
            device = Arena(tmp_path / "borrower" / "rpc")
            model = Model(device, lent.rpc)
            await until(model.warm.is_set, "the model warm")
            game = Program(lent.arena)
            # The model releases at the revoke, the borrower returns, and only then, with no
            # connection of the borrower left, does the lender's program get its GPU.
            await until(game.holds.is_set, "the program holds the lender's GPU")
            assert model.released.is_set()
            assert lent.front.serving() == 0
            assert state_of(lease) is LeaseState.REVOKED
            assert lease.view.by is not None
            assert "game" in lease.view.by
            assert "revoked from borrower-host" in " ".join(lent.said)
            # A request meanwhile waits behind the lease, whose holder says why.
            held = lease_holder(tmp_path)
            assert held is not None
            assert "revoked: the lender's game" in held
            again = Model(device, lent.rpc)
            await until(lambda: state_of(lease) is LeaseState.WAITING, "the lender says waiting")
            assert not again.warm.is_set()
            game.end()
            await until(again.warm.is_set, "the model back once the program is gone")
            assert state_of(lease) is LeaseState.GRANTED
            assert states(views)[-4:] == ["revoked", "asked", "waiting", "granted"]
            await lease.close()
            again.join()
            assert model.error is None
            assert again.error is None

    asyncio.run(scenario())


def test_a_wrong_key_is_refused_and_logged_and_lends_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        with lending(tmp_path) as lent:
            views: list[LeaseView] = []
            lease = await borrowing(tmp_path, lent, views, key=b"not the key")
            assert state_of(lease) is LeaseState.REFUSED
            assert lease.view.reason == "wrong key: no lease"
            assert lent.said == ["refused a lease to 127.0.0.1: wrong key"]
            assert lease_holder(tmp_path) is None  # refused: nothing held for the lender
            # The front admits nobody: a connection is closed at once.
            host, port = lent.rpc.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=WITHIN_S) as conn:
                assert_closed(conn)
            await lease.close()

    asyncio.run(scenario())


def assert_closed(conn: socket.socket) -> None:
    """The front closed `conn` without serving it (an end of stream, or a reset for the byte
    sent)."""
    try:
        conn.sendall(b"x")
        assert conn.recv(1) == b""
    except ConnectionResetError:
        pass


def raw_borrower(lent: Lending) -> tuple[socket.socket, LineReader, LineWriter]:
    """A borrower speaking the channel by hand, proven and granted: one that can then go
    silent or keep the devices, as no well-behaved borrower does."""
    host, port = lent.lease.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=WITHIN_S)
    reader, writer = LineReader(conn), LineWriter(conn)
    challenge = reader.read()
    assert challenge is not None
    assert challenge["op"] == Op.CHALLENGE
    assert challenge["timeout_s"] == TIMEOUT_S
    writer.send({"op": Op.HELLO, "proof": proof(KEY, challenge["nonce"]), "borrower": "raw"})
    writer.send({"op": Op.WANT})
    while (message := reader.read()) is not None and message["op"] != Op.GRANT:
        pass
    return conn, reader, writer


def test_a_borrower_that_falls_silent_loses_the_lease_and_its_connections(
    tmp_path: Path,
) -> None:
    with lending(tmp_path) as lent:
        conn, _, _ = raw_borrower(lent)
        with conn:
            assert lent.holder() == "lent to raw"
            host, port = lent.rpc.rsplit(":", 1)
            upload = socket.create_connection((host, int(port)), timeout=WITHIN_S)
            wait_until(lambda: lent.front.serving() == 1, WITHIN_S, "the upload served")
            started = time.monotonic()
            # Silent from now on (no beat): SIGSTOPped, or its network cut.
            wait_until(lambda: lent.holder() is None, WITHIN_S, "the lease timed out")
            assert TIMEOUT_S - BEAT_S <= time.monotonic() - started < TIMEOUT_S + 2 * BEAT_S
            assert lent.front.serving() == 0
            assert upload.recv(1) == b""  # its connection was closed
            upload.close()
            assert f"heard nothing for {TIMEOUT_S:g} s" in lent.said[-1]


def test_a_borrower_that_keeps_the_devices_after_a_revoke_has_them_taken_back(
    tmp_path: Path,
) -> None:
    with lending(tmp_path) as lent:
        conn, reader, writer = raw_borrower(lent)
        with conn:
            host, port = lent.rpc.rsplit(":", 1)
            upload = socket.create_connection((host, int(port)), timeout=WITHIN_S)
            wait_until(lambda: lent.front.serving() == 1, WITHIN_S, "the upload served")
            game = Program(lent.arena)
            while (message := reader.read()) is not None and message["op"] != Op.REVOKE:
                writer.send({"op": Op.BEAT})
            assert message is not None
            assert "game" in message["by"]
            started = time.monotonic()
            while not game.holds.is_set():  # it beats on, and keeps its connection
                writer.send({"op": Op.BEAT})
                time.sleep(0.2)
                assert time.monotonic() - started < TIMEOUT_S + WITHIN_S
            assert time.monotonic() - started >= TIMEOUT_S - 0.5
            assert lent.front.serving() == 0
            assert upload.recv(1) == b""
            upload.close()
            assert "did not return the devices within 2 s" in " ".join(lent.said)
            game.end()


def test_a_second_borrower_is_refused_while_the_first_holds_the_lease(tmp_path: Path) -> None:
    with lending(tmp_path) as lent:
        conn, _, _ = raw_borrower(lent)
        with conn:
            host, port = lent.lease.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=WITHIN_S) as other:
                reader, writer = LineReader(other), LineWriter(other)
                challenge = reader.read()
                assert challenge is not None
                writer.send({"op": Op.HELLO, "proof": proof(KEY, challenge["nonce"])})
                refused = reader.read()
                assert refused == {"op": "refused", "reason": "cpu lent to raw already"}


def test_a_lender_that_is_gone_lets_the_device_go_so_requests_fail_on_it(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        views: list[LeaseView] = []
        with lending(tmp_path) as lent:
            lease = await borrowing(tmp_path, lent, views)
            assert lease_holder(tmp_path) is not None
        # The lender stopped (its listener and front closed): the session ends, and the
        # borrower holds nothing, so a model that asks now meets the device itself.
        await until(lambda: state_of(lease) is LeaseState.UNREACHABLE, "unreachable")
        assert lease_holder(tmp_path) is None
        assert lease.view.reason is not None
        await lease.close()

    asyncio.run(scenario())


def test_the_front_serves_only_the_borrower_and_counts_what_it_passed_each_way(
    tmp_path: Path,
) -> None:
    with lending(tmp_path) as lent:
        host, port = lent.rpc.rsplit(":", 1)
        # No lease open: nobody is admitted, and the connection closes at once.
        with socket.create_connection((host, int(port)), timeout=WITHIN_S) as early:
            assert_closed(early)
        conn, reader, _ = raw_borrower(lent)
        with conn, socket.create_connection((host, int(port)), timeout=WITHIN_S) as upload:
            upload.sendall(b"u" * (1 << 20))
            got = 0
            while got < 1 << 20:
                got += len(upload.recv(1 << 16))
            assert lent.front.counted() == (1 << 20, 1 << 20)
            while (beat := reader.read()) is not None and beat.get("received_bytes") != 1 << 20:
                pass
            assert beat == {"op": "beat", "received_bytes": 1 << 20, "sent_bytes": 1 << 20}
