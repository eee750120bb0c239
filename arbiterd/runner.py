"""`arbiterd run -- CMD`: run any program (a game, Blender, ComfyUI) while it holds the GPU token.

Owns the child process: it is started only once the token is held, every forwarded signal goes to
it, it is always reaped, and the token is released only after it exited. Must be called from the
main thread (it installs signal handlers).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TextIO

from arbiterd.arena import Arena, ArenaState
from arbiterd.errors import (
    AcquireCancelledError,
    CommandNotExecutableError,
    CommandNotFoundError,
    UsageError,
)
from arbiterd.procs import describe_holder

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class _Interrupted(BaseException):
    """A signal arrived while we still waited for the token."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def resolve_command(cmd: Sequence[str]) -> str:
    """The executable CMD names, checked before we queue for the GPU rather than after."""
    if not cmd:
        raise UsageError("no command after '--'")
    program = cmd[0]
    found = shutil.which(program) if os.sep not in program else program
    if found is None or not Path(found).exists():
        raise CommandNotFoundError(f"command not found: {program}")
    if Path(found).is_dir() or not os.access(found, os.X_OK):
        raise CommandNotExecutableError(f"not executable: {found}")
    return found


def run_holding_token(
    arena: Arena,
    cmd: Sequence[str],
    *,
    name: str | None,
    timeout_s: float | None,
    stderr: TextIO = sys.stderr,
) -> int:
    """Wait for the token, run CMD, release; return CMD's exit status (128+N if killed by N)."""
    executable = resolve_command(cmd)
    label = name or Path(cmd[0]).name
    started = time.monotonic()
    waited = False

    def on_wait(state: ArenaState) -> None:
        nonlocal waited
        waited = True
        print(f"arbiterd run: waiting for the GPU, {describe_holder(state)}", file=stderr)

    previous = _install(dict.fromkeys(FORWARDED_SIGNALS, _raise_interrupted))
    try:
        token = arena.acquire(label, timeout_s=timeout_s, on_wait=on_wait)
    except (_Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, _Interrupted) else signal.SIGINT
        error = AcquireCancelledError(f"{signal.Signals(signum).name} while waiting for the GPU")
        error.exit_code = 128 + signum  # what a shell reports for a command killed by it
        raise error from None
    finally:
        _install(previous)
    with token:
        if waited:
            print(
                f"arbiterd run: got the GPU after {time.monotonic() - started:.1f} s", file=stderr
            )
        return _run_child(executable, cmd)


def _run_child(executable: str, cmd: Sequence[str]) -> int:
    try:
        child = subprocess.Popen([executable, *cmd[1:]])
    except FileNotFoundError:
        raise CommandNotFoundError(f"command not found: {cmd[0]}") from None
    except PermissionError:
        raise CommandNotExecutableError(f"not executable: {executable}") from None

    def forward(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and _terminal_sent_to_group():
            return  # the terminal delivered Ctrl-C to our whole process group, CMD included
        child.send_signal(signum)

    previous = _install(dict.fromkeys(FORWARDED_SIGNALS, forward))
    try:
        status = child.wait()  # PEP 475: resumed after each forwarded signal
    finally:
        _install(previous)
    return 128 - status if status < 0 else status


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    raise _Interrupted(signum)


def _terminal_sent_to_group() -> bool:
    """True when we run in the foreground of a terminal, where Ctrl-C reaches CMD directly."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def _install(handlers: dict[signal.Signals, _Handler]) -> dict[signal.Signals, _Handler]:
    return {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
