"""The control protocol: arbiterd's JSON command API on a Unix socket, in the style of mpv's IPC.

Owns what both ends agree on (docs/control-protocol.md): the commands' arguments (the commands
themselves are states.ControlCommand, the vocabulary every process shares), the
protocol's own error codes, the bounds, and the guard ladder a request line goes through
(`parse_request`). The daemon's side is arbiterd.daemon.control.server, the CLI's
arbiterd.cli.controlclient; the tray speaks it over Qt (arbiterd.gui.connection).

    client → daemon  {"command": NAME, "request_id": SCALAR, ...args}
    daemon → client  {"request_id", "progress": {...}}   before the reply, to a model command
                                                        sent with "progress": true
                     {"request_id", "error": "success", "data": {...}}
                     {"request_id", "error": MESSAGE, "code": CODE}   CODE_* or an ErrorCode
                     {"event": KIND, "at": SECONDS, ...}          after `subscribe`

The `devices` reply is `{"devices": [DeviceEntry, ...]}`: the record is here, where both ends
read it (the daemon's arbiterd.daemon.control.devicelist writes it, `arbiterd devices` reads it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Final

from arbiterd.errors import (
    ProtocolError,
)
from arbiterd.fields import Record
from arbiterd.states import ControlCommand
from arbiterd.wire import decode

log = logging.getLogger(__name__)

CONTROL_PROTOCOL: Final = 1
SERVER_NAME: Final = "arbiterd"
# A request is a command and a model name; a line this long is a bug or abuse (not counting the
# newline). The daemon's own lines (status, events) are not bounded by it.
MAX_LINE_BYTES: Final = 1024 * 1024
# The most events one `events` reply carries; a client asks on from the last seq while the reply
# says "more". A journaled event is a few hundred bytes: a page stays far below the 16 MiB a
# client accepts in a line (wire.MAX_MESSAGE_BYTES).
EVENTS_PAGE_MAX: Final = 500

# Error codes of the protocol itself, besides the codes of arbiterd errors (errors.ErrorCode,
# e.g. "unknown_model").
CODE_INVALID_REQUEST: Final = "invalid_request"  # not UTF-8/JSON/an object, no command string
CODE_UNKNOWN_COMMAND: Final = "unknown_command"
CODE_INVALID_ARGS: Final = "invalid_args"
CODE_PROTOCOL: Final = "protocol"  # hello with a protocol version this daemon does not speak
CODE_TOO_LARGE: Final = "too_large"  # a line over MAX_LINE_BYTES; the connection is closed
CODE_PERMISSION: Final = "permission"  # the peer is another user; the connection is closed
CODE_INTERNAL: Final = "internal"  # a bug in the daemon; logged with its traceback
# The protocol's own codes; every other code is an errors.ErrorCode (none share a name).
PROTOCOL_CODES: Final = frozenset(
    {
        CODE_INVALID_REQUEST,
        CODE_UNKNOWN_COMMAND,
        CODE_INVALID_ARGS,
        CODE_PROTOCOL,
        CODE_TOO_LARGE,
        CODE_PERMISSION,
        CODE_INTERNAL,
    }
)

# The commands the socket answers itself; every other one the daemon is told (Service.command's),
# MODEL_COMMANDS naming a model.
SOCKET_COMMANDS: Final = frozenset(
    {
        ControlCommand.HELLO,
        ControlCommand.STATUS,
        ControlCommand.DEVICES,
        ControlCommand.SUBSCRIBE,
        ControlCommand.UNSUBSCRIBE,
        ControlCommand.EVENTS,
    }
)
COMMANDS: Final = frozenset(ControlCommand) - SOCKET_COMMANDS
MODEL_COMMANDS: Final = frozenset(
    {
        ControlCommand.WARM,
        ControlCommand.RELEASE,
        ControlCommand.PIN,
        ControlCommand.UNPIN,
        ControlCommand.UNLOAD,
    }
)

_RESERVED_KEYS = frozenset({"command", "request_id"})
# Each command's arguments: name -> (type, required). Unknown arguments are refused, so a typo
# ("modle") is an error rather than a command applied to no model. A float argument takes any
# finite JSON number.
_ARGS: dict[ControlCommand, dict[str, tuple[type, bool]]] = {
    ControlCommand.HELLO: {"protocol": (int, False)},
    ControlCommand.STATUS: {},
    ControlCommand.DEVICES: {},
    ControlCommand.SUBSCRIBE: {},
    ControlCommand.UNSUBSCRIBE: {},
    ControlCommand.EVENTS: {
        "since": (float, False),
        "after_seq": (int, False),
        "limit": (int, False),
    },
    # "progress": while the model waits for the GPU, progress lines before the reply (issue 30).
    **{name: {"model": (str, True), "progress": (bool, False)} for name in MODEL_COMMANDS},
    # Step aside for program `pid` until it exits (issue 45).
    ControlCommand.YIELD: {"pid": (int, True)},
    **{name: {} for name in COMMANDS - MODEL_COMMANDS - {ControlCommand.YIELD}},
}
CONTROL_COMMANDS: Final = tuple(sorted(_ARGS))
# The values an integer argument may take, by name (a seq is an SQLite integer).
_RANGES: Final = {
    "limit": (1, EVENTS_PAGE_MAX),
    "after_seq": (0, 2**63 - 1),
    "pid": (1, 2**22),  # the kernel's pid_max at most
}


@dataclass(frozen=True)
class DeviceEntry(Record):
    """One device of the `devices` reply (docs/control-protocol.md § Devices): its arbiterd id
    (paths.DeviceId's spelling), ggml's name for it (None where only an engine that registered
    it names it: an RPC server's device is RPC0, RPC1, ... in each worker's own order), what
    it is, its memory (None: not known now), its arena folder and who holds that arena's token
    (None: nobody), and for an RPC server's device whether the server answers (`reason` says
    why not, or why the memory is not known while it serves another client). Reading never
    raises (arbiterd/fields.py's codec)."""

    id: str = ""
    ggml: str | None = None
    description: str = ""
    kind: str = ""  # ggml's: "cpu", "gpu", "igpu", ... (an RPC server's device is a "gpu")
    free_bytes: int | None = None
    total_bytes: int | None = None
    arena: str = ""
    holder: str | None = None
    reachable: bool = False
    reason: str | None = None
    lease: str | None = None  # a lent device's lease (issue 46), as render.lease says it


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _type_name(kind: type) -> str:
    names = {int: "an integer", str: "a string", float: "a number", bool: "true or false"}
    return names.get(kind, kind.__name__)


def _is_a(value: object, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # bool is an int to Python, never to a client
        return False
    if kind is float:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, kind)


def _check_args(command: ControlCommand, args: dict[str, Any]) -> str | None:
    """What is wrong with `args` for `command`, or None."""
    spec = _ARGS[command]
    unknown = sorted(set(args) - set(spec))
    if unknown:
        allowed = ", ".join(sorted(spec)) or "none"
        return f"{command}: unknown argument {unknown[0]!r} (arguments: {allowed})"
    for name, (kind, required) in spec.items():
        if name not in args:
            if required:
                return f"{command}: missing argument {name!r} ({_type_name(kind)})"
            continue
        value = args[name]
        if not _is_a(value, kind):
            return f"{command}: argument {name!r} must be {_type_name(kind)}, not {value!r}"
        if kind is str and not value:
            return f"{command}: argument {name!r} must not be empty"
        bounds = _RANGES.get(name)
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            low, high = bounds
            return f"{command}: argument {name!r} must be from {low} to {high}, not {value!r}"
    return None


@dataclass(frozen=True)
class Request:
    request_id: str | int | float | bool | None
    command: ControlCommand
    args: dict[str, Any]


class RequestRefused(Exception):
    """A request line fell off the guard ladder; answered with `code`, never raised further."""

    def __init__(self, request_id: object, message: str, code: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code


def parse_request(line: bytes) -> Request:
    """The guard ladder: UTF-8 → JSON → object → request_id scalar → command string → known
    command → arguments → protocol version. RequestRefused says where it fell off."""
    try:
        message = decode(line)
    except ProtocolError as exc:
        raise RequestRefused(None, str(exc), CODE_INVALID_REQUEST) from None
    request_id = message.get("request_id")
    if not _is_scalar(request_id):
        raise RequestRefused(None, "request_id must be a JSON scalar", CODE_INVALID_REQUEST)
    name = message.get("command")
    if not isinstance(name, str):
        raise RequestRefused(request_id, "command must be a string", CODE_INVALID_REQUEST)
    try:
        command = ControlCommand(name)
    except ValueError:
        known = ", ".join(CONTROL_COMMANDS)
        raise RequestRefused(
            request_id, f"unknown command {name!r} (commands: {known})", CODE_UNKNOWN_COMMAND
        ) from None
    args = {k: v for k, v in message.items() if k not in _RESERVED_KEYS}
    problem = _check_args(command, args)
    if problem is not None:
        raise RequestRefused(request_id, problem, CODE_INVALID_ARGS)
    if (
        command is ControlCommand.HELLO
        and args.get("protocol", CONTROL_PROTOCOL) != CONTROL_PROTOCOL
    ):
        raise RequestRefused(
            request_id,
            f"protocol {args['protocol']} is not supported "
            f"(this arbiterd speaks protocol {CONTROL_PROTOCOL})",
            CODE_PROTOCOL,
        )
    return Request(request_id, command, args)
