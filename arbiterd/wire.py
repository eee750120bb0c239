"""JSON-lines framing for arbiterd's sockets: one JSON object per line, bounded in size.

Owns encoding, decoding and the guard ladder every incoming line goes through (size → UTF-8 →
JSON → object); callers check the keys they need. The blocking reader and writer never block on
anything but their socket; the asyncio reader is the daemon's.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from typing import TYPE_CHECKING, Any

from arbiterd.errors import ProtocolError

if TYPE_CHECKING:
    # The daemon's alone: a worker imports this module too, and asyncio (with ssl and the
    # rest it imports) is ~3 MB of private memory in each worker (issue 28).
    import asyncio

# One message may carry a long prompt or a streamed chunk; anything larger is a bug or abuse.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
RECV_BYTES = 65536
# How far into a line that cannot be read the ladder looks for the request id it names, so the
# refusal can be answered to that request: the daemon writes "id" second, after "op".
ID_PEEK_BYTES = 256
_PLAIN_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,128})"')


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """Parse one line; ProtocolError says which rung of the ladder it fell from."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise _refused(f"message of {len(line)} bytes exceeds {MAX_MESSAGE_BYTES}", line)
    try:
        text = line.decode()
    except UnicodeDecodeError:
        raise _refused("message is not UTF-8", line) from None
    try:
        message = json.loads(text)
    except RecursionError:  # the parser recurses once per level (issue 24: it dropped the line)
        raise _refused("message is not JSON: nested too deeply", line) from None
    except ValueError as exc:
        raise _refused(f"message is not JSON: {exc}", line) from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a JSON object")
    return message


def _refused(problem: str, line: bytes) -> ProtocolError:
    """The ProtocolError for a line the ladder refused, with the request id its first
    ID_PEEK_BYTES name as a plain string, if they do."""
    found = _PLAIN_ID.search(line[:ID_PEEK_BYTES])
    request_id = found.group(1).decode(errors="replace") if found else None
    return ProtocolError(problem, request_id=request_id)


class Framer:
    """Cuts a byte stream into messages: the ladder for each whole line, and a bound on a line
    that has not ended yet."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        # Refused for its size before it ended: the rest of that line is dropped as it comes,
        # never read as a message of its own.
        self._skipping = False

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next(self) -> dict[str, Any] | None:
        """The next whole message, or None until more bytes come. Raises ProtocolError for a
        bad line (the line is consumed, so the caller may answer and go on)."""
        end = self._buffer.find(b"\n")
        if self._skipping:
            if end < 0:
                self._buffer.clear()
                return None
            del self._buffer[: end + 1]
            self._skipping = False
            end = self._buffer.find(b"\n")
        if end >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            return decode(line)
        if len(self._buffer) > MAX_MESSAGE_BYTES:
            error = _refused(
                f"message exceeds {MAX_MESSAGE_BYTES} bytes", bytes(self._buffer[:ID_PEEK_BYTES])
            )
            self._buffer.clear()
            self._skipping = True
            raise error
        return None


class LineReader:
    """Reads newline-terminated messages from a stream socket it does not own."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._framer = Framer()

    def read(self) -> dict[str, Any] | None:
        """The next message, or None at end of stream. Raises ProtocolError for a bad line
        (the line is consumed, so the caller may answer and go on)."""
        while True:
            message = self._framer.next()
            if message is not None:
                return message
            data = self._sock.recv(RECV_BYTES)
            if not data:
                return None
            self._framer.feed(data)


class AsyncLineReader:
    """Reads newline-terminated messages from an asyncio stream, as LineReader does."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self._stream = stream
        self._framer = Framer()

    async def read(self) -> dict[str, Any] | None:
        """The next message, or None at end of stream (ProtocolError as LineReader.read)."""
        while True:
            message = self._framer.next()
            if message is not None:
                return message
            data = await self._stream.read(RECV_BYTES)
            if not data:
                return None
            self._framer.feed(data)


class LineWriter:
    """Writes messages to a stream socket from any thread, one whole line at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> bool:
        """False when the peer is gone (the caller decides what that means)."""
        data = encode(message)
        with self._lock:
            try:
                self._sock.sendall(data)
            except OSError:
                return False
        return True
