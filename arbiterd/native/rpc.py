"""llama.cpp's RPC backend (ggml-rpc): a device on another machine, or in another process, served
by ggml's own RPC server and used by this engine as one of its devices.

Owns three things:
- `probe`: asking a server, over its wire protocol, for its protocol version and its devices'
  memory, with timeouts (and `serves_several`: whether it answers a second client while a
  first is connected). ggml's own client aborts the process when a server is down, refuses,
  or speaks another protocol version (GGML_ABORT in its dispatcher), so a worker asks this
  first and fails with a reason instead of dying.
- `register_server`: making a server's devices devices of the loaded engine
  (`ggml_backend_rpc_add_server` + `ggml_backend_register`, reached through the RPC backend's
  proc addresses, as llama.cpp's own tools do).
- `serve`: running ggml's server (`ggml_backend_rpc_start_server`) on this process's devices,
  for `arbiterd rpc-server`.

A ggml RPC server serves **one client at a time** (it accepts the next connection when the
last one closes) and frees everything it holds for a client when that client disconnects;
`arbiterd rpc-server --clients N` serves several, each with a ggml server of its own
(rpcserver/front.py). A
worker is connected while it holds a buffer or a backend on the server, so the engine's
residency patch frees both on release (llama-residency.cpp, residency_detach_remote): the
server's memory goes back, and the next model placed on that server can connect. A probe of
a server that is serving a client waits in its queue of connections: `probe` says "busy"
after its timeout.

A probe is bounded whatever the server says (issue 40: a server that claimed 2^32-1 devices kept
a probe asking for ever, and a worker's list of them grew): at most MAX_DEVICES devices asked,
each reply read only when its size is the one its command has (under 2 KB in all), and
`timeout_s` for the whole probe, connection included, not for each read, so a server that
answers one byte at a time cannot stretch it either.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiterd.errors import DeviceUnreachableError, EngineError
from arbiterd.native.ggml import open_ggml

# The engine's RPC protocol (ggml-rpc.h, RPC_PROTO_*_VERSION of the pinned llama.cpp): a
# server of another major version, or a newer minor one, is refused by ggml's client.
PROTOCOL_MAJOR = 7
PROTOCOL_MINOR = 0
# enum rpc_cmd (ggml-rpc.cpp); HELLO is 14 in every version ("must be always 14").
_CMD_GET_DEVICE_MEMORY = 11
_CMD_HELLO = 14
_CMD_DEVICE_COUNT = 15
_CONN_CAPS_SIZE = 24  # rpc_msg_hello_req: the transport capabilities a client offers
_HELLO_REPLY = struct.Struct("<BBBx24s")  # rpc_msg_hello_rsp: major, minor, patch, caps
_SIZE = struct.Struct("<Q")
_MAX_REPLY = 1 << 16  # every reply probe reads is a few bytes; more is not a ggml server
PROBE_TIMEOUT_S = 2.0
# More devices than one ggml process can have: each GPU backend has at most 16 (GGML_CUDA_,
# GGML_VK_, GGML_METAL_MAX_DEVICES) or 48 (GGML_SYCL_MAX_DEVICES), and a server serves its
# process's devices. A server that claims more is not a ggml server, and is not asked for them.
MAX_DEVICES = 64


@dataclass(frozen=True)
class RemoteDevice:
    index: int  # the server's device number: rpc:HOST:PORT/index
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class ServerInfo:
    endpoint: str  # HOST:PORT
    version: tuple[int, int, int]
    devices: tuple[RemoteDevice, ...]


def probe(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> ServerInfo:
    """The server at `endpoint` (HOST:PORT): its protocol version and devices, within
    `timeout_s` in all. Raises DeviceUnreachableError naming the server and why: down, busy
    with another client for `timeout_s`, too slow, not a ggml RPC server, claiming more than
    MAX_DEVICES devices, or of a protocol the engine does not speak."""
    deadline = time.monotonic() + timeout_s
    with _connect(endpoint, timeout_s) as sock:
        conn = _Connection(sock, deadline)
        greeted = False
        try:
            major, minor, patch = _hello(conn)
            greeted = True
            _check_version(endpoint, (major, minor, patch))
            (count,) = struct.unpack("<I", conn.call(_CMD_DEVICE_COUNT, b"", 4))
            if count > MAX_DEVICES:
                raise DeviceUnreachableError(
                    f"RPC server {endpoint} claims {count} devices, more than a ggml RPC server"
                    f" has (at most {MAX_DEVICES}): it is not one; check what listens on"
                    " that port"
                )
            found = []
            for index in range(count):
                reply = conn.call(_CMD_GET_DEVICE_MEMORY, struct.pack("<I", index), 16)
                free, total = struct.unpack("<QQ", reply)
                found.append(RemoteDevice(index, free, total))
        except TimeoutError:
            if greeted:
                raise DeviceUnreachableError(
                    f"RPC server {endpoint} did not finish answering within {timeout_s:g} s (a"
                    " ggml RPC server answers in milliseconds): it is not one that works"
                ) from None
            raise DeviceUnreachableError(
                f"RPC server {endpoint} did not answer within {timeout_s:g} s: it serves one"
                " client at a time, and another is connected"
            ) from None
        except (OSError, _NotRpcError) as exc:
            raise DeviceUnreachableError(
                f"{endpoint} is not a ggml RPC server that answers: {exc}"
            ) from None
    return ServerInfo(endpoint, (major, minor, patch), tuple(found))


def serves_several(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at `endpoint` answers a second client while a first one is
    connected (`arbiterd rpc-server --clients N`), or serves one at a time (ggml's own
    server, whose next client waits until the one it serves leaves: a first connection it
    does not answer, while it serves someone else, says as much). DeviceUnreachableError
    when it takes no connection, or is no ggml server."""
    deadline = time.monotonic() + timeout_s
    with _connect(endpoint, timeout_s) as first:
        try:
            _hello(_Connection(first, deadline))
        except TimeoutError:
            return False
        except (OSError, _NotRpcError) as exc:
            raise DeviceUnreachableError(
                f"{endpoint} is not a ggml RPC server that answers: {exc}"
            ) from None
        try:
            probe(endpoint, max(0.1, deadline - time.monotonic()))
        except DeviceUnreachableError:
            return False
        return True


def check_listening(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Whether the server at `endpoint` is up: it accepts a connection (DeviceUnreachableError
    naming it if not). Asks it nothing: a server serving another client takes the connection
    into its queue and answers only when that client leaves, which is a busy server, not a
    down one; asking it (`probe`) would wait for that client."""
    _connect(endpoint, timeout_s).close()


def _connect(endpoint: str, timeout_s: float) -> socket.socket:
    host, port = split_endpoint(endpoint)
    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        raise DeviceUnreachableError(
            f"RPC server {endpoint} did not accept a connection within {timeout_s:g} s"
        ) from None
    except OSError as exc:
        raise DeviceUnreachableError(
            f"RPC server {endpoint} is not reachable: {exc.strerror or exc}"
        ) from None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT as ggml reads it (the host is what comes before the first colon)."""
    host, sep, port = endpoint.partition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EngineError(f"RPC endpoint {endpoint!r}: expected HOST:PORT")
    return host, int(port)


def register_server(libllama: Path, endpoint: str) -> list[int]:
    """Make the devices of the server at `endpoint` devices of the loaded engine; returns their
    ggml device handles in the server's order. Registering twice gives the same devices. Call
    `probe` first: ggml aborts the process when the server cannot be reached."""
    lib = open_ggml(libllama)
    add = _rpc_function(lib, b"ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
    reg_dev_count = lib.ggml_backend_reg_dev_count
    reg_dev_count.argtypes, reg_dev_count.restype = [ctypes.c_void_p], ctypes.c_size_t
    reg_dev_get = lib.ggml_backend_reg_dev_get
    reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    reg_dev_get.restype = ctypes.c_void_p
    reg = add(endpoint.encode())
    if not reg:
        raise DeviceUnreachableError(f"RPC server {endpoint} offers no device")
    devices = [int(reg_dev_get(reg, i)) for i in range(int(reg_dev_count(reg)))]
    if not set(devices) & set(_registered(lib)):
        register = lib.ggml_backend_register
        register.argtypes, register.restype = [ctypes.c_void_p], None
        register(reg)
    return devices


def serve(
    libllama: Path, endpoint: str, devices: Sequence[int], cache_dir: Path | None, n_threads: int
) -> None:
    """Run ggml's RPC server on `endpoint` with these ggml devices (handles) until the process
    ends: it returns only when the server cannot start (the port is taken, say)."""
    lib = open_ggml(libllama)
    start = _rpc_function(
        lib,
        b"ggml_backend_rpc_start_server",
        None,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p),
    )
    handles = (ctypes.c_void_p * len(devices))(*devices)
    cache = None if cache_dir is None else str(cache_dir).encode()
    start(endpoint.encode(), cache, n_threads, len(devices), handles)


class _NotRpcError(Exception):
    pass


def _hello(conn: _Connection) -> tuple[int, int, int]:
    reply = conn.call(_CMD_HELLO, bytes(_CONN_CAPS_SIZE), _HELLO_REPLY.size)
    major, minor, patch, _caps = _HELLO_REPLY.unpack(reply)
    return major, minor, patch


def _check_version(endpoint: str, version: tuple[int, int, int]) -> None:
    major, minor, patch = version
    if major != PROTOCOL_MAJOR or minor > PROTOCOL_MINOR:
        raise DeviceUnreachableError(
            f"RPC server {endpoint} speaks RPC protocol {major}.{minor}.{patch}; this engine"
            f" speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}: run the server from the same"
            " llama.cpp version (arbiterd rpc-server does)"
        )


class _Connection:
    """A probe's connection, every send and read of it within the probe's `deadline`
    (time.monotonic): TimeoutError once it has passed."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def call(self, command: int, payload: bytes, reply_size: int) -> bytes:
        self._arm()
        self._sock.sendall(bytes([command]) + _SIZE.pack(len(payload)) + payload)
        (size,) = _SIZE.unpack(self._read(_SIZE.size))
        if size != reply_size or size > _MAX_REPLY:
            raise _NotRpcError(f"a reply of {size} bytes where {reply_size} were expected")
        return self._read(size)

    def _read(self, size: int) -> bytes:
        chunks, left = [], size
        while left:
            self._arm()
            chunk = self._sock.recv(left)
            if not chunk:
                raise _NotRpcError("the connection closed mid-reply")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _arm(self) -> None:
        left_s = self._deadline - time.monotonic()
        if left_s <= 0:
            raise TimeoutError
        self._sock.settimeout(left_s)


def _rpc_function(
    lib: ctypes.CDLL, name: bytes, restype: object, *argtypes: object
) -> Callable[..., Any]:
    """A function the RPC backend offers through its registry entry's proc addresses."""
    by_name = lib.ggml_backend_reg_by_name
    by_name.argtypes, by_name.restype = [ctypes.c_char_p], ctypes.c_void_p
    address = lib.ggml_backend_reg_get_proc_address
    address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    address.restype = ctypes.c_void_p
    reg = by_name(b"RPC")
    pointer = address(reg, name) if reg else None
    if not pointer:
        raise EngineError(
            "this engine was built without ggml's RPC backend (GGML_RPC): run"
            " `bash scripts/setup.sh` again to rebuild it"
        )
    function: Callable[..., Any] = ctypes.CFUNCTYPE(restype, *argtypes)(pointer)  # type: ignore[arg-type]
    return function


def _registered(lib: ctypes.CDLL) -> list[int]:
    """The handles of every device in ggml's registry."""
    count = lib.ggml_backend_dev_count
    count.restype = ctypes.c_size_t
    get = lib.ggml_backend_dev_get
    get.argtypes, get.restype = [ctypes.c_size_t], ctypes.c_void_p
    return [int(get(index) or 0) for index in range(int(count()))]
