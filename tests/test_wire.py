"""JSON-lines framing: whole messages from any cut of the stream, and the guard ladder per line."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from arbiterd import wire
from arbiterd.errors import ProtocolError
from arbiterd.wire import AsyncLineReader, Framer, LineReader, LineWriter, decode, encode
from tests.support.waiting import to_first_wait

LIMIT = 64  # a small MAX_MESSAGE_BYTES, so an oversized line is cheap to make


@pytest.fixture
def small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", LIMIT)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


def drain(framer: Framer) -> list[dict[str, Any]]:
    messages = []
    while (message := framer.next()) is not None:
        messages.append(message)
    return messages


def test_a_message_is_one_line_even_when_its_text_has_newlines() -> None:
    message = {"op": "generate", "body": {"prompt": "one\ntwo"}, "n": 3}
    line = encode(message)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert decode(line[:-1]) == message


def test_a_message_cut_into_single_bytes_comes_out_whole_at_its_last_byte() -> None:
    framer = Framer()
    line = encode({"op": "status", "id": "r1"})
    for byte in line[:-1]:
        framer.feed(bytes([byte]))
        assert framer.next() is None
    framer.feed(line[-1:])
    assert framer.next() == {"op": "status", "id": "r1"}
    assert framer.next() is None


def test_messages_joined_in_one_chunk_come_out_one_by_one_in_order() -> None:
    framer = Framer()
    framer.feed(b"".join(encode({"n": n}) for n in range(3)) + b'{"n":')
    assert drain(framer) == [{"n": 0}, {"n": 1}, {"n": 2}]
    framer.feed(b"3}\n")  # the partial fourth line, completed later
    assert drain(framer) == [{"n": 3}]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"op": ', "not JSON"),
        (b"", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'"status"', "not a JSON object"),
        (b"42", "not a JSON object"),
    ],
)
def test_a_bad_line_names_its_rung_and_the_next_line_reads(line: bytes, problem: str) -> None:
    framer = Framer()
    framer.feed(line + b"\n" + encode({"op": "status"}))
    with pytest.raises(ProtocolError, match=problem):
        framer.next()
    assert framer.next() == {"op": "status"}


@pytest.mark.usefixtures("small_limit")
def test_a_whole_line_over_the_limit_is_refused_and_the_next_line_reads() -> None:
    framer = Framer()
    framer.feed(encode({"pad": "x" * LIMIT}) + encode({"op": "status"}))
    with pytest.raises(ProtocolError, match=f"exceeds {LIMIT}"):
        framer.next()
    assert framer.next() == {"op": "status"}


@pytest.mark.usefixtures("small_limit")
def test_a_line_that_grows_past_the_limit_is_refused_before_it_ends_and_skipped_to_its_end() -> (
    None
):
    framer = Framer()
    framer.feed(b'{"pad": "' + b"x" * LIMIT)  # no newline yet: the framer must not keep it all
    with pytest.raises(ProtocolError, match=f"exceeds {LIMIT}"):
        framer.next()
    framer.feed(b"x" * LIMIT)  # more of the same line
    assert framer.next() is None
    framer.feed(b'x"}\n' + encode({"op": "status"}))  # its end, then a good line
    assert framer.next() == {"op": "status"}  # the oversized line's tail is not a message
    assert framer.next() is None


@pytest.mark.usefixtures("small_limit")
def test_the_tail_of_an_oversized_line_is_never_read_as_a_message() -> None:
    framer = Framer()
    framer.feed(b"x" * (LIMIT + 1))
    with pytest.raises(ProtocolError):
        framer.next()
    framer.feed(encode({"op": "shutdown"}))  # still the same line: it began with the x's
    framer.feed(encode({"op": "status"}))
    assert drain(framer) == [{"op": "status"}]


@pytest.mark.parametrize(
    ("line", "request_id"),
    [
        (b'{"op": "generate", "id": "r7", "body": {', "r7"),  # not JSON
        (b'{"op":"generate","id":"r8","body":"\xff"}', "r8"),  # not UTF-8
        (b'{"op": "generate", "body": {', None),  # names no id
        (b'[{"id": "r9"}]', None),  # JSON but not an object: it is no request
        (b'{"op": "generate", "pad": "' + b"x" * 300 + b'", "id": "late", ', None),  # past the peek
    ],
)
def test_a_line_that_cannot_be_read_names_the_request_id_it_plainly_carries(
    line: bytes, request_id: str | None
) -> None:
    with pytest.raises(ProtocolError) as refused:
        decode(line)
    assert refused.value.request_id == request_id


@pytest.mark.usefixtures("small_limit")
def test_a_line_refused_for_its_size_before_it_ends_names_its_request_id() -> None:
    framer = Framer()
    framer.feed(b'{"op":"generate","id":"big","body":"' + b"x" * LIMIT)
    with pytest.raises(ProtocolError, match=f"exceeds {LIMIT}") as refused:
        framer.next()
    assert refused.value.request_id == "big"


def test_the_line_reader_reads_messages_then_none_at_the_end_of_the_stream(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    reader = LineReader(ours)
    theirs.sendall(encode({"n": 1}) + b"not json\n" + encode({"n": 2}) + b'{"partial"')
    theirs.shutdown(socket.SHUT_WR)
    assert reader.read() == {"n": 1}
    with pytest.raises(ProtocolError, match="not JSON"):
        reader.read()
    assert reader.read() == {"n": 2}
    assert reader.read() is None  # a line the peer never finished is not a message


def test_the_line_writer_says_false_once_the_peer_is_gone(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    writer = LineWriter(theirs)
    assert writer.send({"n": 1})
    assert LineReader(ours).read() == {"n": 1}
    ours.close()
    assert writer.send({"n": 2}) is False


def test_lines_written_from_several_threads_never_interleave(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    writer = LineWriter(theirs)
    pad = "y" * 200_000  # far more than one send() takes: sendall loops

    def write(thread: int) -> None:
        for n in range(5):
            assert writer.send({"thread": thread, "n": n, "pad": pad})

    threads = [threading.Thread(target=write, args=(t,), name=f"writer-{t}") for t in range(4)]
    for thread in threads:
        thread.start()
    reader = LineReader(ours)
    received = [reader.read() for _ in range(20)]
    for thread in threads:
        thread.join(timeout=30)
    assert all(m is not None and m["pad"] == pad for m in received)
    by_thread = [[m["n"] for m in received if m is not None and m["thread"] == t] for t in range(4)]
    assert by_thread == [list(range(5))] * 4


def test_the_async_reader_waits_for_a_whole_line_then_none_at_eof() -> None:
    async def scenario() -> list[object]:
        stream = asyncio.StreamReader()
        reader = AsyncLineReader(stream)
        line = encode({"op": "status", "id": "r1"})
        stream.feed_data(line[:5])
        pending = await to_first_wait(reader.read())  # it took the half, and waits for more
        half_done = pending.done()
        stream.feed_data(line[5:] + b"[]\n")
        first = await asyncio.wait_for(pending, timeout=10)
        try:
            await reader.read()
        except ProtocolError as exc:
            bad: object = str(exc)
        stream.feed_eof()
        return [half_done, first, bad, await reader.read()]

    assert asyncio.run(scenario()) == [
        False,
        {"op": "status", "id": "r1"},
        "message is not a JSON object",
        None,
    ]


def test_the_async_reader_reads_what_a_socket_peer_wrote(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    messages = [{"n": n, "text": "é" * n} for n in range(50)]
    theirs.sendall(b"".join(encode(m) for m in messages))
    theirs.shutdown(socket.SHUT_WR)

    async def scenario() -> list[dict[str, Any]]:
        stream, writer = await asyncio.open_unix_connection(sock=ours)
        reader = AsyncLineReader(stream)
        read = []
        while (message := await reader.read()) is not None:
            read.append(message)
        writer.close()
        await writer.wait_closed()
        return read

    assert asyncio.run(scenario()) == messages
    assert json.loads(encode(messages[3])) == messages[3]
