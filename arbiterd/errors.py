"""The exception tree of arbiterd, its stable codes, and what each code means at every edge.

    ArbiterError                      anything arbiterd reports on purpose
    ├── UsageError                    the caller asked for something malformed
    │   └── BadValueError             a value out of range, e.g. a negative timeout
    │       └── ReplayError           the tray's replay file cannot be read
    ├── RuntimeDirError               XDG_RUNTIME_DIR missing or insecure
    ├── ArenaError                    the arena directory cannot be used
    │   ├── ArenaUnwritableError      cannot create or open its files
    │   └── ArenaUnsupportedError     the filesystem does not support flock
    ├── AcquireError                  the token was not obtained
    │   ├── AcquireTimeoutError       the timeout ran out
    │   │   └── QueueTimeoutError     a request waited past its model's max_queue_s
    │   └── AcquireCancelledError     the caller gave up
    ├── CommandError                  `arbiterd run` could not start CMD
    │   ├── CommandNotFoundError      no such program
    │   └── CommandNotExecutableError found but not runnable
    ├── EngineError                   a model could not do what was asked
    │   ├── ModelLoadError            missing, unreadable or corrupt GGUF; context too large
    │   ├── RestoreError              warming a cold model failed (it stays cold)
    │   │   └── OutOfDeviceMemoryError ... for want of device memory (its copies kept)
    │   ├── ResidencyCallError        the engine build's residency call returned a status
    │   ├── DeviceUnreachableError    an RPC server it is placed on: down, or of another version
    │   └── RequestError              one request is bad; the model keeps serving
    │       └── ContextOverflowError  the prompt (plus max_tokens) exceeds the context
    ├── WorkerError                   the worker process or its protocol failed
    │   ├── WorkerGoneError           the worker was gone before a request reached it
    │   ├── InvalidTransitionError    a transition a state table forbids (a bug)
    │   └── ProtocolError             a malformed or unexpected message
    ├── InternalError                 a bug: an exception no code path expected (traceback logged)
    ├── ConfigError                   config.toml is wrong: file, key path, what was expected
    ├── MissingPartError              an optional part (the tray's PySide6) is not installed
    ├── TelemetryError                a VRAM reader could not measure
    ├── InstallError                  `arbiterd install` cannot write its files
    ├── TrayError                     the tray cannot show itself here
    │   ├── NoDisplayError            no X11 or Wayland display to show it on
    │   ├── BrokenQtError             Qt cannot start (its message says why)
    │   └── MissingQtPlatformError    Qt's xcb plugin lacks a system library (names the package)
    ├── ScreenshotError               the tray cannot write its screenshot
    └── DaemonError                   the daemon could not start, or talking to it failed
        ├── ListenError               the HTTP address is taken or cannot be bound
        ├── AlreadyRunningError       another daemon holds this control socket's lock
        ├── DaemonNotRunningError     nothing listens on the control socket
        ├── UnknownModelError         no model by that name
        ├── ShuttingDownError         the daemon is stopping: a request is refused or ended
        └── ControlError              the daemon answered a control command with an error
            └── ControlReplyError     ... for a reason of the control protocol's own

Each class has a `code` (ErrorCode), the string that crosses process boundaries (a worker's
error reply, the control socket) in place of a class name; `OUTCOMES` maps each code, in this
one place, to the HTTP status the API answers and the exit status the CLI ends with. Exit
statuses follow sysexits(3) and the shell's conventions, so codes of one kind share one (every
bad value exits 65); `error_from_wire` turns a code back into its class.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar


class ErrorCode(enum.StrEnum):
    ERROR = "error"
    USAGE = "usage"
    BAD_VALUE = "bad_value"
    RUNTIME_DIR = "runtime_dir"
    ARENA = "arena"
    ARENA_UNWRITABLE = "arena_unwritable"
    ARENA_UNSUPPORTED = "arena_unsupported"
    ACQUIRE = "acquire"
    ACQUIRE_TIMEOUT = "acquire_timeout"
    ACQUIRE_CANCELLED = "acquire_cancelled"
    COMMAND = "command"
    COMMAND_NOT_FOUND = "command_not_found"
    COMMAND_NOT_EXECUTABLE = "command_not_executable"
    ENGINE = "engine"
    MODEL_LOAD = "model_load"
    RESTORE = "restore"
    DEVICE_UNREACHABLE = "device_unreachable"
    BAD_REQUEST = "bad_request"
    CONTEXT_OVERFLOW = "context_overflow"
    WORKER = "worker"
    WORKER_GONE = "worker_gone"
    PROTOCOL = "bad_message"
    INTERNAL = "internal_error"
    CONFIG = "config"
    MISSING_PART = "missing_part"
    TELEMETRY = "telemetry"
    DAEMON = "daemon"
    LISTEN = "listen"
    ALREADY_RUNNING = "already_running"
    DAEMON_NOT_RUNNING = "daemon_not_running"
    UNKNOWN_MODEL = "unknown_model"
    SHUTTING_DOWN = "shutting_down"
    CONTROL = "control"
    INSTALL = "install"
    TRAY = "tray"
    SCREENSHOT = "screenshot"


@dataclass(frozen=True)
class Outcome:
    http_status: int
    exit_code: int


# sysexits(3): 64 EX_USAGE, 65 EX_DATAERR, 69 EX_UNAVAILABLE, 70 EX_SOFTWARE, 71 EX_OSERR,
# 73 EX_CANTCREAT, 74 EX_IOERR, 75 EX_TEMPFAIL (try again later), 78 EX_CONFIG; a shell's 126
# (not executable), 127 (not found) and 130 (128 + SIGINT, interrupted).
OUTCOMES: dict[ErrorCode, Outcome] = {
    ErrorCode.ERROR: Outcome(500, 1),
    ErrorCode.USAGE: Outcome(400, 64),
    ErrorCode.BAD_VALUE: Outcome(400, 65),
    ErrorCode.RUNTIME_DIR: Outcome(500, 78),
    ErrorCode.ARENA: Outcome(500, 74),
    ErrorCode.ARENA_UNWRITABLE: Outcome(500, 73),
    ErrorCode.ARENA_UNSUPPORTED: Outcome(500, 69),
    ErrorCode.ACQUIRE: Outcome(503, 75),
    ErrorCode.ACQUIRE_TIMEOUT: Outcome(503, 75),
    ErrorCode.ACQUIRE_CANCELLED: Outcome(503, 130),
    ErrorCode.COMMAND: Outcome(500, 126),
    ErrorCode.COMMAND_NOT_FOUND: Outcome(500, 127),
    ErrorCode.COMMAND_NOT_EXECUTABLE: Outcome(500, 126),
    ErrorCode.ENGINE: Outcome(503, 70),
    ErrorCode.MODEL_LOAD: Outcome(503, 70),
    ErrorCode.RESTORE: Outcome(503, 70),
    ErrorCode.DEVICE_UNREACHABLE: Outcome(503, 69),
    ErrorCode.BAD_REQUEST: Outcome(400, 65),
    ErrorCode.CONTEXT_OVERFLOW: Outcome(400, 65),
    ErrorCode.WORKER: Outcome(503, 70),
    ErrorCode.WORKER_GONE: Outcome(503, 70),
    ErrorCode.PROTOCOL: Outcome(503, 70),
    ErrorCode.INTERNAL: Outcome(500, 70),
    ErrorCode.CONFIG: Outcome(500, 78),
    ErrorCode.MISSING_PART: Outcome(500, 69),
    ErrorCode.TELEMETRY: Outcome(500, 69),
    ErrorCode.DAEMON: Outcome(500, 1),
    ErrorCode.LISTEN: Outcome(500, 71),
    ErrorCode.ALREADY_RUNNING: Outcome(500, 75),
    ErrorCode.DAEMON_NOT_RUNNING: Outcome(503, 69),
    ErrorCode.UNKNOWN_MODEL: Outcome(404, 65),
    ErrorCode.SHUTTING_DOWN: Outcome(503, 75),
    ErrorCode.CONTROL: Outcome(400, 1),
    ErrorCode.INSTALL: Outcome(500, 73),
    ErrorCode.TRAY: Outcome(500, 69),
    ErrorCode.SCREENSHOT: Outcome(500, 73),
}

_BY_CODE: dict[ErrorCode, type[ArbiterError]] = {}


class ArbiterError(Exception):
    """Base of every error arbiterd raises on purpose; its message is one line for a human.
    A subclass that names its own `code` is the class that code stands for on the wire; one
    that does not shares its parent's."""

    code: ClassVar[ErrorCode] = ErrorCode.ERROR
    exit_code: int = OUTCOMES[ErrorCode.ERROR].exit_code  # an instance may say more exactly

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            if cls.code in _BY_CODE:
                raise TypeError(f"{cls.code} already stands for {_BY_CODE[cls.code].__name__}")
            _BY_CODE[cls.code] = cls
        cls.exit_code = OUTCOMES[cls.code].exit_code

    @property
    def http_status(self) -> int:
        return OUTCOMES[self.code].http_status

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code.value, "message": str(self)}


_BY_CODE[ErrorCode.ERROR] = ArbiterError


def error_from_wire(raw: object) -> ArbiterError:
    """The error a `to_wire` dict stands for, as its own class; an unknown code (or a garbled
    dict) is a WorkerError carrying whatever message came."""
    if not isinstance(raw, dict):
        return WorkerError(f"a malformed error: {raw!r}")
    message = str(raw.get("message", ""))
    try:
        kind = _BY_CODE[ErrorCode(str(raw.get("code")))]
    except ValueError:
        return WorkerError(message or f"an error of unknown code {raw.get('code')!r}")
    return kind(message)


class UsageError(ArbiterError):
    code = ErrorCode.USAGE


class BadValueError(UsageError):
    code = ErrorCode.BAD_VALUE


class ReplayError(BadValueError):
    """A replay file that cannot be read; the message names the file and line."""


class RuntimeDirError(ArbiterError):
    code = ErrorCode.RUNTIME_DIR


class ArenaError(ArbiterError):
    code = ErrorCode.ARENA


class ArenaUnwritableError(ArenaError):
    code = ErrorCode.ARENA_UNWRITABLE


class ArenaUnsupportedError(ArenaError):
    code = ErrorCode.ARENA_UNSUPPORTED


class AcquireError(ArbiterError):
    code = ErrorCode.ACQUIRE


class AcquireTimeoutError(AcquireError):
    code = ErrorCode.ACQUIRE_TIMEOUT


class QueueTimeoutError(AcquireTimeoutError):
    """A request waited longer than its model's max_queue_s for the GPU (issue 30); the HTTP
    API answers it 503 with Retry-After: `retry_after_s`."""

    retry_after_s: int = 1


class AcquireCancelledError(AcquireError):
    code = ErrorCode.ACQUIRE_CANCELLED


class CommandError(ArbiterError):
    code = ErrorCode.COMMAND


class CommandNotFoundError(CommandError):
    code = ErrorCode.COMMAND_NOT_FOUND


class CommandNotExecutableError(CommandError):
    code = ErrorCode.COMMAND_NOT_EXECUTABLE


class EngineError(ArbiterError):
    code = ErrorCode.ENGINE


class ModelLoadError(EngineError):
    code = ErrorCode.MODEL_LOAD


class RestoreError(EngineError):
    code = ErrorCode.RESTORE


class OutOfDeviceMemoryError(RestoreError):
    """A restore could not allocate the model's device buffers (libllama.Status DEVICE_ALLOC or
    COMPUTE): it is still released, its weights' copy and its KV kept, and may be tried again
    once the device has room (a fitting set's member then tries once more alone, issue 44).
    It crosses the wire as a RestoreError."""


class DeviceUnreachableError(EngineError):
    """A device the model is placed on cannot be reached: an RPC server down, busy with another
    client past the wait, or speaking another protocol version (native/rpc.py)."""

    code = ErrorCode.DEVICE_UNREACHABLE


class ResidencyCallError(EngineError):
    """A residency call of the engine build (native/libllama.py) returned non-zero `status`
    (a libllama.Status when the ABI names it)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class RequestError(EngineError):
    code = ErrorCode.BAD_REQUEST


class ContextOverflowError(RequestError):
    code = ErrorCode.CONTEXT_OVERFLOW


class WorkerError(ArbiterError):
    code = ErrorCode.WORKER


class WorkerGoneError(WorkerError):
    """Nothing of the request ran: it may be sent again to the worker's successor."""

    code = ErrorCode.WORKER_GONE


class InvalidTransitionError(WorkerError):
    """A transition a state table (a model's residency, a daemon's slot) does not allow: a bug,
    never a user error."""


class ProtocolError(WorkerError):
    """A message that cannot be read or does not follow the protocol; `request_id` is the
    request it was, when that could be read from it (the reply then goes to that request)."""

    code = ErrorCode.PROTOCOL

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class InternalError(ArbiterError):
    """An exception no code path expected, where it stops one request rather than its process
    (a worker serves the next request): a bug, never the caller's fault. Where it is raised, the
    original is logged with its traceback; the message says where to find it."""

    code = ErrorCode.INTERNAL


class ConfigError(ArbiterError):
    code = ErrorCode.CONFIG


class MissingPartError(ArbiterError):
    code = ErrorCode.MISSING_PART


class TelemetryError(ArbiterError):
    """A reader could not measure: the driver went away, a file vanished, NVML failed."""

    code = ErrorCode.TELEMETRY


class InstallError(ArbiterError):
    code = ErrorCode.INSTALL


class TrayError(ArbiterError):
    code = ErrorCode.TRAY


class NoDisplayError(TrayError):
    pass


class BrokenQtError(TrayError):
    pass


class MissingQtPlatformError(TrayError):
    pass


class ScreenshotError(ArbiterError):
    code = ErrorCode.SCREENSHOT


class DaemonError(ArbiterError):
    code = ErrorCode.DAEMON


class ListenError(DaemonError):
    code = ErrorCode.LISTEN


class AlreadyRunningError(DaemonError):
    code = ErrorCode.ALREADY_RUNNING


class DaemonNotRunningError(DaemonError):
    code = ErrorCode.DAEMON_NOT_RUNNING


class UnknownModelError(DaemonError):
    code = ErrorCode.UNKNOWN_MODEL


class ShuttingDownError(DaemonError):
    code = ErrorCode.SHUTTING_DOWN


class ControlError(DaemonError):
    code = ErrorCode.CONTROL


class ControlReplyError(ControlError):
    """The daemon refused a request for a reason of the control protocol's own: `reply_code` is
    one of control.py's CODE_* strings (docs/control-protocol.md). An error of arbiterd's (a
    code of ErrorCode) is raised as its own class instead."""

    def __init__(self, message: str, reply_code: str) -> None:
        super().__init__(message)
        self.reply_code = reply_code
