"""The exception tree of arbiterd; every edge (CLI, later HTTP and the control socket) maps it once.

    ArbiterError                      anything arbiterd reports on purpose
    ├── UsageError                    the caller asked for something malformed (64)
    │   └── BadValueError             a value out of range, e.g. a negative timeout (65)
    ├── RuntimeDirError               XDG_RUNTIME_DIR missing or insecure (78)
    ├── ArenaError                    the arena directory cannot be used
    │   ├── ArenaUnwritableError      cannot create or open its files (73)
    │   └── ArenaUnsupportedError     the filesystem does not support flock (69)
    ├── AcquireError                  the token was not obtained
    │   ├── AcquireTimeoutError       the timeout ran out (75, EX_TEMPFAIL)
    │   └── AcquireCancelledError     the caller gave up (130, as for SIGINT)
    ├── CommandError                  `arbiterd run` could not start CMD
    │   ├── CommandNotFoundError      no such program (127, as a shell)
    │   └── CommandNotExecutableError found but not runnable (126, as a shell)
    ├── EngineError                   a model could not do what was asked
    │   ├── ModelLoadError            missing, unreadable or corrupt GGUF; context too large
    │   ├── RestoreError              warming a cold model failed (it stays cold)
    │   └── RequestError              one request is bad; the model keeps serving
    │       └── ContextOverflowError  the prompt (plus max_tokens) exceeds the context
    ├── WorkerError                   the worker process or its protocol failed
    │   └── ProtocolError             a malformed or unexpected message
    ├── ConfigError                   config.toml is wrong: file, key path, what was expected (78)
    ├── MissingPartError              an optional part (the tray's PySide6) is not installed (69)
    ├── TelemetryError                a VRAM reader could not measure (69)
    └── DaemonError                   the daemon could not start, or talking to it failed
        ├── ListenError               the HTTP address is taken or cannot be bound (71)
        ├── AlreadyRunningError       another daemon holds this control socket's lock (75)
        ├── DaemonNotRunningError     nothing listens on the control socket (69)
        ├── UnknownModelError         no model by that name (404 over HTTP)
        └── ControlError              the daemon answered a control command with an error

Each class carries the exit status the CLI uses, so every failure has its own distinct code.
"""

from __future__ import annotations


class ArbiterError(Exception):
    """Base of every error arbiterd raises on purpose; its message is one line for a human."""

    exit_code = 1


class UsageError(ArbiterError):
    exit_code = 64  # sysexits EX_USAGE


class BadValueError(UsageError):
    exit_code = 65  # sysexits EX_DATAERR


class RuntimeDirError(ArbiterError):
    exit_code = 78  # sysexits EX_CONFIG


class ArenaError(ArbiterError):
    exit_code = 74  # sysexits EX_IOERR


class ArenaUnwritableError(ArenaError):
    exit_code = 73  # sysexits EX_CANTCREAT


class ArenaUnsupportedError(ArenaError):
    exit_code = 69  # sysexits EX_UNAVAILABLE


class AcquireError(ArbiterError):
    exit_code = 75


class AcquireTimeoutError(AcquireError):
    exit_code = 75  # sysexits EX_TEMPFAIL: try again later


class AcquireCancelledError(AcquireError):
    exit_code = 130  # 128 + SIGINT, what a shell reports for an interrupted command


class CommandError(ArbiterError):
    exit_code = 126


class CommandNotFoundError(CommandError):
    exit_code = 127


class CommandNotExecutableError(CommandError):
    exit_code = 126


class EngineError(ArbiterError):
    exit_code = 70  # sysexits EX_SOFTWARE


class ModelLoadError(EngineError):
    pass


class RestoreError(EngineError):
    pass


class RequestError(EngineError):
    exit_code = 65


class ContextOverflowError(RequestError):
    pass


class WorkerError(ArbiterError):
    exit_code = 70


class ProtocolError(WorkerError):
    pass


class ConfigError(ArbiterError):
    exit_code = 78  # sysexits EX_CONFIG


class MissingPartError(ArbiterError):
    exit_code = 69  # sysexits EX_UNAVAILABLE


class TelemetryError(ArbiterError):
    """A reader could not measure: the driver went away, a file vanished, NVML failed."""

    exit_code = 69  # sysexits EX_UNAVAILABLE


class DaemonError(ArbiterError):
    exit_code = 1


class ListenError(DaemonError):
    exit_code = 71  # sysexits EX_OSERR: the system refused the address


class AlreadyRunningError(DaemonError):
    exit_code = 75  # sysexits EX_TEMPFAIL: it can start once the other one has stopped


class DaemonNotRunningError(DaemonError):
    exit_code = 69  # sysexits EX_UNAVAILABLE


class UnknownModelError(DaemonError):
    exit_code = 65


class ControlError(DaemonError):
    exit_code = 1
