"""`arbiterd run -- CMD`: run any program (a game, Blender, ComfyUI) while it holds the GPU token.

Owns the child process: it is started only once the token is held, every forwarded signal goes to
it, it is always reaped, and the token is released only after it exited. Must be called from the
main thread (it installs signal handlers).

The token outlives the runner for as long as CMD runs (issue 10 item 4). CMD inherits the
token's open file description (pass_fds); flock locks belong to the description, and the kernel
unlocks it only once every process sharing it has closed it (flock(2)). A runner killed with
SIGKILL, which can release nothing, thus leaves the token held until CMD exits too, instead of
letting the next holder onto the GPU beside a CMD still using it. holder.json names both: `pid`
is the runner, `command_pid` CMD, whom observers name once the runner is gone. When CMD exits
the runner releases as it always did: clear holder.json, unlock, which unlocks the description
for every process that shares it.

Not PR_SET_PDEATHSIG on CMD: it would turn the runner's death into CMD's, and the user would lose
the game or the render because the process watching it died, which the shared lock avoids at no
cost. (It is also set per thread, lost across a setuid exec, and racy against a parent that
dies before the child sets it.)

With `--device` (issue 27) CMD holds the token of each device named, taken in the canonical
order (arbiterd/arena/devices.py says why that order cannot deadlock) and inherited all the same
way: each token's description is passed to CMD and holder.json of each arena names it.

What sharing implies:
- CMD's own children inherit the description too, unless CMD closes it for them (many launchers
  do: Python's subprocess closes every fd it is not told to pass). After a SIGKILL of the runner,
  the GPU therefore stays held until the last process of the tree that inherited it exits. That
  is the safe side, and usually what the user wants: a launcher that starts the game and exits
  leaves the game holding the token. A helper CMD left behind (a server it started and forgot)
  holds it too; `fuser -v ARENA/token.lock` names it. Once CMD runs, nothing outside it can close
  the descriptor in the processes it starts, so this is documented, not prevented.
- On the normal path the token ends with CMD, as before: a launcher that exits at once ends the
  hold while its game still runs. Run the game itself, or the launcher's "wait" mode.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TextIO

from arbiterd.arena import Arena, ArenaState, Token
from arbiterd.arena.devices import Devices, DevicesHold, canonical_order
from arbiterd.errors import (
    AcquireCancelledError,
    ArenaError,
    CommandNotExecutableError,
    CommandNotFoundError,
    UsageError,
)
from arbiterd.paths import DeviceId
from arbiterd.procs import WaitNews, holder_label, news_for
from arbiterd.states import Priority

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How often a wait looks again at who holds the GPU and at its place in the queue.
REPORT_EVERY_S = 1.0

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
    target: Arena | Sequence[tuple[str | DeviceId, Arena]],
    cmd: Sequence[str],
    *,
    name: str | None,
    timeout_s: float | None,
    priority: Priority = Priority.NORMAL,
    stderr: TextIO = sys.stderr,
) -> int:
    """Wait for the token, run CMD, release; return CMD's exit status (128+N if killed by N).

    `target` is one arena, or (device id, arena) pairs: the arenas of `arbiterd run --device`,
    whose tokens are taken in the canonical order (arbiterd/arena/devices.py) and all held,
    each inherited by CMD, while it runs. One pair is that arena alone."""
    parts = _parts(target)
    executable = resolve_command(cmd)
    label = name or Path(cmd[0]).name
    started = time.monotonic()
    report = _WaitReport(parts, stderr)
    gateway: Arena | Devices = parts[0][1] if len(parts) == 1 else Devices(parts)
    previous = _install(dict.fromkeys(FORWARDED_SIGNALS, _raise_interrupted))
    try:
        held = gateway.acquire(label, priority=priority, timeout_s=timeout_s, on_wait=report.began)
    except (_Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, _Interrupted) else signal.SIGINT
        error = AcquireCancelledError(f"{signal.Signals(signum).name} while waiting for the GPU")
        error.exit_code = 128 + signum  # what a shell reports for a command killed by it
        raise error from None
    finally:
        report.stop()
        _install(previous)
    try:
        if report.waited:
            print(
                f"arbiterd run: got the GPU after {time.monotonic() - started:.1f} s", file=stderr
            )
        for passed in held.passed_over:  # issue 40 item 1: said where the user looks
            print(f"arbiterd run: {passed.text}; it keeps its place", file=stderr)
        return _run_child(_tokens(held), executable, cmd, stderr)
    finally:
        held.release()


def _parts(target: Arena | Sequence[tuple[str | DeviceId, Arena]]) -> list[tuple[str, Arena]]:
    """(device, arena) pairs in the order their tokens are taken; "" names the device of a
    plain arena (nothing to say which, as before devices had names)."""
    if isinstance(target, Arena):
        return [("", target)]
    by_id = {str(device): arena for device, arena in target}
    order = canonical_order(device for device, _ in target)  # refuses a device named twice
    return [(str(device), by_id[str(device)]) for device in order]


def _tokens(held: Token | DevicesHold) -> list[Token]:
    """The tokens CMD inherits: every device's (the arenas' gateways give Tokens)."""
    if isinstance(held, Token):
        return [held]
    return [hold for _, hold in held.parts if isinstance(hold, Token)]


class _WaitReport:
    """Says what the wait is for as it begins, then again whenever the holder or our place in
    the queue changes, looked at every REPORT_EVERY_S from a thread of its own (the main thread
    is blocked in the acquire). Over several devices, each line names the device waited on."""

    def __init__(self, parts: list[tuple[str, Arena]], stderr: TextIO) -> None:
        self._arenas = {arena.path: (device, arena) for device, arena in parts}
        self._named = len(parts) > 1
        self._stderr = stderr
        self._on: tuple[str, Arena] = parts[0]  # the device waited on now
        self._said: tuple[str, int | None, int | None, tuple[int, ...]] | None = None
        self._stopped = threading.Event()
        self._watch: threading.Thread | None = None
        self._lock = threading.Lock()  # `began` (main thread) and the watch share `_on`
        self.waited = False

    def began(self, before: ArenaState) -> None:
        """The arena's on_wait, once per device waited on: `before` was read before we
        queued, so it still names a holder that let go as soon as it saw us; our place is read
        now that we have a ticket."""
        self.waited = True
        with self._lock:
            self._on = self._arenas.get(before.path, self._on)
        device, arena = self._on
        news = news_for(arena.observe(), os.getpid())
        if before.holder_pid is not None and news.holder_pid != before.holder_pid:
            news = replace(news, holder=holder_label(before), holder_pid=before.holder_pid)
        self._say(device, news)
        if self._watch is None:
            # Started before it is kept: a signal between the two leaves `stop` nothing to join
            # (the thread sees `_stopped` and ends), never a thread it cannot join.
            watch = threading.Thread(target=self._look_again, name="wait-report", daemon=True)
            watch.start()
            self._watch = watch

    def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.join()

    def _look_again(self) -> None:
        while not self._stopped.wait(REPORT_EVERY_S):
            with self._lock:
                device, arena = self._on
            try:
                news = news_for(arena.observe(), os.getpid())
            except (ArenaError, OSError):
                continue  # the next look may succeed; the wait itself reports what breaks
            if not self._stopped.is_set():
                self._say(device, news)

    def _say(self, device: str, news: WaitNews) -> None:
        seen = (device, news.holder_pid, news.place, news.stopped_ahead)
        if seen != self._said:
            self._said = seen
            where = f"{device}: " if self._named else ""
            print(f"arbiterd run: {where}{news.text}", file=self._stderr, flush=True)


def _run_child(tokens: Sequence[Token], executable: str, cmd: Sequence[str], stderr: TextIO) -> int:
    try:
        # CMD shares each locked description: the module docstring says why.
        fds = tuple(token.fd for token in tokens)
        child = subprocess.Popen([executable, *cmd[1:]], pass_fds=fds)
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
        for token in tokens:
            try:
                token.record_command(child.pid)
            except (ArenaError, OSError) as exc:
                # holder.json is informational; CMD runs and holds the token all the same.
                print(f"arbiterd run: holder.json not updated: {exc}", file=stderr)
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
