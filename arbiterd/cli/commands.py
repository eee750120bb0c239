"""The CLI commands that start or talk to the daemon: daemon, status, devices, warm, release,
pin, unpin, unload, shutdown, hold, unhold, reload, events.

Owns their arguments and how their output is laid out (its phrases come from arbiterd.render).
Talks to a running daemon only through the control socket (cli/controlclient.py); `events` asks
the daemon for its journal, and reads the journal file itself only when told which (--journal)
or when the daemon its config names is not running, so history is readable while it is down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, Protocol

from arbiterd import render
from arbiterd.cli.controlclient import ControlClient
from arbiterd.config import (
    DEFAULT_HTTP,
    SOCKET_FILE,
    Config,
    default_config_path,
    load_config,
    load_daemon_config,
)
from arbiterd.control import DeviceEntry
from arbiterd.daemon.observe.journal import Journal, parse_since
from arbiterd.errors import BadValueError, DaemonError, DaemonNotRunningError
from arbiterd.events import parse_event
from arbiterd.states import ControlCommand
from arbiterd.status import (
    ACCOUNTING_SOURCE,
    STEP_ASIDE_SUFFIX,
    DaemonStatus,
    ModelStatus,
    SteppedAside,
    Turn,
)

# warm may load a model and hold may wait for every model to release: minutes, not seconds.
COMMAND_TIMEOUT_S = 600.0
# The model commands that may wait for the GPU, and say so while they do.
WAITING_COMMANDS = frozenset({ControlCommand.WARM, ControlCommand.RELEASE, ControlCommand.UNLOAD})
# Requests in flight are ended and every worker releases the GPU before the daemon exits: the
# systemd unit's TimeoutStopSec.
SHUTDOWN_TIMEOUT_S = 60.0
# How often `events --follow` asks for what is new (as the journal's follow polls its file).
FOLLOW_POLL_S: Final = 0.2


class AddCommand(Protocol):
    """Adds a subcommand whose --help page says what it does (`summary`) and shows examples."""

    def __call__(self, name: str, summary: str, *examples: str) -> argparse.ArgumentParser: ...


def add_commands(command: AddCommand) -> None:
    daemon = command(
        "daemon",
        "run the daemon (models, OpenAI API, control socket)",
        "arbiterd daemon --config ~/models/arbiterd.toml --verbose",
    )
    daemon.add_argument(
        "--config",
        type=Path,
        help="config file (default: $XDG_CONFIG_HOME/arbiterd/config.toml, else "
        "~/.config/arbiterd/config.toml; without one, the embedded default)",
    )
    daemon.add_argument(
        "--http",
        metavar="HOST:PORT",
        help=f"OpenAI API listen address (default: [daemon] http, else {DEFAULT_HTTP})",
    )
    daemon.add_argument(
        "--socket",
        type=Path,
        metavar="PATH",
        help="control socket path (default: [daemon] socket, else "
        f"$XDG_RUNTIME_DIR/arbiterd/{SOCKET_FILE})",
    )
    daemon.add_argument(
        "--arena",
        type=Path,
        metavar="DIR",
        help="arena directory (default: [daemon] arena, else $ARBITERD_ARENA, else "
        "$XDG_RUNTIME_DIR/arbiterd/arena/gpu0)",
    )
    daemon.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    daemon.set_defaults(handler=run_daemon)

    status = command(
        "status",
        "show each model's state and memory, and who holds the GPU",
        "arbiterd status",
        "arbiterd status --json",
    )
    _client_options(status)
    status.add_argument("--json", action="store_true", help="print the status object")
    status.set_defaults(handler=show_status)

    devices = command(
        "devices",
        "list the devices models can be placed on, with their memory, arenas and holders",
        "arbiterd devices",
        "arbiterd devices --json",
    )
    _client_options(devices)
    devices.add_argument("--json", action="store_true", help='print {"devices": [...]}')
    devices.set_defaults(handler=show_devices)

    for name, text in (
        ("warm", "load a model onto the GPU now"),
        ("release", "move a model off the GPU now (it stays resident in RAM)"),
        ("pin", "keep a model on the GPU whoever waits"),
        ("unpin", "let a pinned model release again"),
        ("unload", "stop a model's worker and free its RAM; its prompt cache waits on disk"),
    ):
        model_parser = command(name, text, f"arbiterd {name} chat")
        model_parser.add_argument("model", metavar="NAME")
        _client_options(model_parser)
        model_parser.set_defaults(handler=model_command)
    shutdown = command(
        "shutdown",
        "stop the daemon: requests in flight end with a 503 saying so, models release the GPU, "
        "the journal closes",
        "arbiterd shutdown",
        "arbiterd shutdown --timeout 120",
    )
    _client_options(shutdown)
    shutdown.add_argument(
        "--timeout",
        type=float,
        default=SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help=f"how long to wait for it to exit (default: {SHUTDOWN_TIMEOUT_S:g} s)",
    )
    shutdown.set_defaults(handler=shutdown_daemon)

    for name, text in (
        ("hold", "take the GPU for something else (game mode): every model goes cold"),
        ("unhold", "give the GPU back to the models"),
        ("reload", "re-read the config file"),
    ):
        plain_parser = command(name, text, f"arbiterd {name}")
        _client_options(plain_parser)
        plain_parser.set_defaults(handler=plain_command)

    yield_parser = command(
        "yield",
        "step aside for a program until it exits: every model goes cold, the GPU is the "
        "program's (for programs the [yield] rules do not catch)",
        "arbiterd yield --until-exit 4242",
        'arbiterd yield --until-exit "$(pidof blender)"',
    )
    yield_parser.add_argument(
        "--until-exit", type=int, required=True, metavar="PID", help="the program's pid"
    )
    _client_options(yield_parser)
    yield_parser.set_defaults(handler=yield_command)
    resume = command(
        "resume",
        "end a step aside now: the models may take the GPU again (the program is passed over "
        "until it exits)",
        "arbiterd resume",
    )
    _client_options(resume)
    resume.set_defaults(handler=plain_command)

    events = command(
        "events",
        "show the journal of handoffs, requests and failures",
        "arbiterd events --since 1h",
        "arbiterd events --follow --json",
    )
    events.add_argument(
        "--follow", "-f", action="store_true", help="print new events as they happen"
    )
    events.add_argument("--since", metavar="T", help="epoch, ISO time, or 10m / 2h / 1d ago")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    events.add_argument(
        "--journal", type=Path, metavar="PATH", help="read this journal file, not the daemon"
    )
    _client_options(events)
    events.set_defaults(handler=show_events)


def _client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", type=Path, metavar="PATH", help="control socket path")
    parser.add_argument("--config", type=Path, help="config file naming the socket")


def _socket(args: argparse.Namespace) -> Path:
    if args.socket is not None:
        return Path(args.socket)
    return load_daemon_config(args.config).socket


# -- handlers ---------------------------------------------------------------------------------


def run_daemon(args: argparse.Namespace) -> int:
    # Lazily: the client commands (and `arbiterd run` for a game) need none of the server's.
    from arbiterd.daemon.serve import serve  # noqa: PLC0415

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="arbiterd %(levelname)s %(name)s: %(message)s",
    )

    def load() -> Config:
        return load_config(args.config, http=args.http, socket=args.socket, arena=args.arena)

    config = load()
    if config.source is None:
        logging.getLogger("arbiterd").info(
            "no config file at %s: serving the embedded default models (write one there, "
            "then `arbiterd reload`)",
            default_config_path(),
        )
    asyncio.run(serve(config, load))
    return 0


def show_status(args: argparse.Namespace) -> int:
    with ControlClient.connect(_socket(args)) as client:
        status = client.call("status")
    if args.json:
        print(json.dumps(status))
    else:
        print(render_status(DaemonStatus.from_json(status)))
    return 0


def show_devices(args: argparse.Namespace) -> int:
    with ControlClient.connect(_socket(args)) as client:
        reply = client.call("devices")
    if args.json:
        print(json.dumps(reply))
        return 0
    raw = reply.get("devices")
    listed = (
        [DeviceEntry.from_json(item) for item in raw if isinstance(item, dict)]
        if isinstance(raw, list)
        else []
    )
    print(render_devices(listed))
    return 0


def model_command(args: argparse.Namespace) -> int:
    """A command to one model; `warm`, `release` and `unload` say on stderr what the model
    waits for while it waits for the GPU, and Ctrl-C withdraws the wait (exit 130)."""
    started = time.monotonic()
    said: str | None = None

    def progress(news: dict[str, Any]) -> None:
        nonlocal said
        text = news.get("text")
        if isinstance(text, str) and text != said:
            said = text
            model = news.get("model") or args.model
            print(f"arbiterd {args.command}: {model} is {text}", file=sys.stderr, flush=True)

    try:
        with ControlClient.connect(_socket(args)) as client:
            client.timeout_s = COMMAND_TIMEOUT_S
            if args.command in WAITING_COMMANDS:
                result = client.call_watched(args.command, progress, model=args.model)
            else:
                result = client.call(args.command, model=args.model)
    except KeyboardInterrupt:
        withdrawn = f"; {args.model} no longer waits for the GPU" if said is not None else ""
        print(f"arbiterd {args.command}: interrupted{withdrawn}", file=sys.stderr)
        return 130
    waited = f" (after {time.monotonic() - started:.1f} s waiting for the GPU)" if said else ""
    print(_describe(ControlCommand(args.command), result) + waited)
    return 0


def shutdown_daemon(args: argparse.Namespace) -> int:
    timeout_s: float = args.timeout
    if timeout_s < 0 or not math.isfinite(timeout_s):
        raise BadValueError(f"--timeout must be a non-negative number of seconds, got {timeout_s}")
    with ControlClient.connect(_socket(args)) as client:
        pid = client.peer_pid()
        unit = systemd_unit(pid)
        client.call("shutdown")
    if not _exited(pid, timeout_s):
        longer = max(2 * timeout_s, 60)
        raise DaemonError(
            f"arbiterd (pid {pid}) is still stopping after {timeout_s:g} s (its workers may "
            f"still be releasing the GPU); `arbiterd shutdown --timeout {longer:g}` waits longer"
        )
    print(f"arbiterd stopped (pid {pid})")
    if unit is not None:
        # The unit restarts only on failure: a clean exit leaves it inactive until it is
        # started again, at the next login or by hand.
        print(
            f"it ran as the systemd user unit {unit}, now inactive: it starts again at your "
            f"next login or with `systemctl --user start {unit}` (`systemctl --user disable "
            f"{unit}` keeps it from starting at login)"
        )
    return 0


def systemd_unit(pid: int) -> str | None:
    """The systemd user unit process `pid` runs in (`arbiterd.service`); None when it runs
    outside one (started by hand, by the demo, by a test)."""
    try:
        return unit_in_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return None


def unit_in_cgroup(cgroup: str) -> str | None:
    """The service a /proc/PID/cgroup text places its process in, the innermost: under a
    user manager, `0::/user.slice/user-1000.slice/user@1000.service/app.slice/arbiterd.service`
    (the manager's own user@ unit is not it; a terminal's shell is in a .scope)."""
    for line in cgroup.splitlines():
        for part in reversed(line.rpartition(":")[2].split("/")):
            if part.endswith(".service") and not part.startswith("user@"):
                return part
    return None


def _exited(pid: int, timeout_s: float) -> bool:
    """Whether `pid` exits within `timeout_s`, waited for on a pidfd (no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(fd)


def plain_command(args: argparse.Namespace) -> int:
    with ControlClient.connect(_socket(args)) as client:
        client.timeout_s = COMMAND_TIMEOUT_S
        result = client.call(args.command)
    print(_describe(ControlCommand(args.command), result))
    return 0


def yield_command(args: argparse.Namespace) -> int:
    with ControlClient.connect(_socket(args)) as client:
        client.timeout_s = COMMAND_TIMEOUT_S
        result = client.call(ControlCommand.YIELD, pid=args.until_exit)
    print(_describe(ControlCommand.YIELD, result))
    return 0


def show_events(args: argparse.Namespace) -> int:
    since = parse_since(args.since) if args.since else None
    if since is None and args.follow:
        since = time.time()  # like tail -f: what happens from now on
    try:
        for stored in _stored_events(args, since):
            line = json.dumps(stored) if args.json else render.event_line(parse_event(stored))
            print(line, flush=True)
    except KeyboardInterrupt:
        return 130
    return 0


def _stored_events(args: argparse.Namespace, since: float | None) -> Iterator[dict[str, Any]]:
    """The journal's events from `since` (with --follow, then each new one), as stored: from
    the daemon, or from the file --journal names or, when the daemon of --config is not
    running, the one its config names."""
    if args.journal is not None:
        return _from_journal(args.journal, since, follow=args.follow)
    if args.socket is not None:
        return _from_daemon(ControlClient.connect(args.socket), since, follow=args.follow)
    daemon = load_daemon_config(args.config)
    try:
        client = ControlClient.connect(daemon.socket)
    except DaemonNotRunningError:
        return _from_journal(daemon.journal, since, follow=args.follow)
    return _from_daemon(client, since, follow=args.follow)


def _from_daemon(
    client: ControlClient, since: float | None, *, follow: bool
) -> Iterator[dict[str, Any]]:
    with client:
        last: int | None = None
        while True:
            for stored in client.history(since=since if last is None else None, after_seq=last):
                yield stored
                seq = stored.get("seq")
                last = seq if isinstance(seq, int) else last
            if not follow:
                return
            time.sleep(FOLLOW_POLL_S)


def _from_journal(path: Path, since: float | None, *, follow: bool) -> Iterator[dict[str, Any]]:
    journal = Journal.open_readonly(path)
    try:
        stream = (
            journal.follow(since=since, poll_s=FOLLOW_POLL_S, stop=threading.Event())
            if follow
            else iter(journal.read(since=since))
        )
        for stored in stream:
            yield stored.to_json()
    finally:
        journal.close()


# -- rendering --------------------------------------------------------------------------------


def render_status(status: DaemonStatus) -> str:
    """The status as a table a person reads at a glance."""
    models = status.models
    rows: list[tuple[str, ...]] = [
        (
            "MODEL",
            "STATE",
            "BACKEND",
            status.memory_name.upper(),
            "COLD",
            "HOST RAM",
            "QUEUE",
            "SERVED",
            "LAST HANDOFF",
            "NOTE",
        )
    ]
    rows += [_status_row(model) for model in models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    ]
    engine = status.engine
    if engine is not None:
        lines.append(
            render.engine_line(engine.offload, engine.devices, engine.cpu_cause, engine.cpu_note)
        )
        if engine.cpu_warning:  # one cause for every model: said once
            lines.append(f"warning: {engine.cpu_warning}")
    # Every worker loads the same engine: a reason usually holds for all models.
    capabilities = ((m.name, render.capabilities_text(m.capabilities)) for m in models)
    for names, can in render.grouped(capabilities):
        lines.append(f"capabilities ({', '.join(names)}): {can}")
    lines += [f"file ({m.name}): {m.path}" for m in models if m.path]
    lines += [
        _footprint_line(status, m)
        for m in models
        if m.footprint is not None and (m.footprint.predicted or m.footprint.measured)
    ]
    for names, reason in render.grouped((m.name, m.fallback_reason) for m in models):
        lines.append(f"backend reload ({', '.join(names)}): {reason}")
    lines += [_turn_line(m.name, m.turn) for m in models if m.turn and m.turn.quantum_s]
    lines += _memory_lines(status)
    telemetry = status.telemetry
    source = telemetry.source if telemetry is not None and telemetry.source else "?"
    for device in status.devices:
        lines.append(
            f"{status.device_label(device)}: {render.format_bytes(device.used_bytes or 0)} used of "
            f"{render.format_bytes(device.total_bytes or 0)} ({source})"
        )
    for other in status.others:
        if other.used_bytes:
            lines.append(
                f"  also on {other.device}: {render.process(other.name, other.pid)} "
                f"{render.format_bytes(other.used_bytes)}"
            )
    for group in status.groups:
        holds = "holds the GPU" if group.holds_token else "does not hold the GPU"
        failure = f"; its keeper stopped: {group.failure}" if group.failure else ""
        if not group.fitting:
            lines.append(f"group {group.name} ({', '.join(group.models)}): {holds}{failure}")
            continue
        # A device's fitting set (issue 44): who is warm in it, and the room they leave.
        warm = ", ".join(group.warm) or "none"
        lines.append(
            f"fitting set on {group.device} ({', '.join(group.models)}): {holds}; warm: "
            f"{warm}, {render.format_bytes(group.used_bytes)} of {render.fitting_budget(group)}; "
            f"{group.withdrawals} made to leave{failure}"
        )
    lines += _holder_lines(status)
    return "\n".join(line.rstrip() for line in lines)


def _footprint_line(status: DaemonStatus, model: ModelStatus) -> str:
    """A model's footprint, predicted and measured by the engine; and, where a GPU reader
    measures the device (not the engines' own accounting), what it reads for the model's
    worker, its driver context included: the engine's figure checked against the device's."""
    assert model.footprint is not None
    line = f"footprint ({model.name}): {render.footprint_text(model.footprint)}"
    telemetry = status.telemetry
    source = telemetry.source if telemetry is not None else ""
    if source and source != ACCOUNTING_SOURCE and model.vram_bytes is not None:
        line += f"; {source} reads {render.format_bytes(model.vram_bytes)} for its worker"
    return line


def _holder_lines(status: DaemonStatus) -> list[str]:
    """Who holds the GPU and who waits; the user's hold and a step aside (issue 45)."""
    found: list[str] = []
    holder = status.holder
    if holder is not None:
        name = holder.name or ""
        shown = name if name.endswith(STEP_ASIDE_SUFFIX) else render.process(name, holder.pid)
        found.append(f"GPU held by {shown}")
    else:
        found.append("GPU free")
    if status.waiters:
        found.append(render.waiters_line([(w.name, w.pid) for w in status.waiters]))
    if status.hold:
        found.append("hold: the GPU is held for you (arbiterd unhold gives it back)")
    aside = status.stepped_aside
    if aside is not None:
        program = render.stepped_aside(aside.program, aside.pid, aside.used_bytes)
        found.append(f"stepped aside for {program}: {aside.reason} (arbiterd resume ends it)")
    if status.yield_watch:
        found.append(f"step aside: {status.yield_watch}")
    for lease in status.leases:
        found.append(
            f"lease of {lease.device}: "
            + render.lease(lease.state, lease.lender, lease.by, lease.reason)
        )
    return found


def _turn_line(name: str, turn: Turn) -> str:
    """How long `name` keeps the GPU for its queue while another waits, and why (issue 43)."""
    measured = "measured" if turn.handoff_measured else "not measured yet: the prior"
    return (
        f"turn {name}: {render.format_seconds(turn.quantum_s)} while another waits, from a "
        f"handoff of {render.format_seconds(turn.handoff_s)} ({measured}); {turn.served} "
        "served in its current or last turn"
    )


def render_devices(devices: list[DeviceEntry]) -> str:
    """The `devices` reply as a table: what each device is, its memory and who holds it."""
    if not devices:
        return (
            "no devices listed: no model's worker has said which devices its engine has yet, "
            "and [daemon] rpc_servers names none"
        )
    rows = [("DEVICE", "KIND", "DESCRIPTION", "FREE / TOTAL", "HOLDER", "NOTE")]
    for device in devices:
        description = device.description
        if device.ggml and device.ggml != description:
            description = f"{device.ggml}: {description}" if description else device.ggml
        note = device.reason or ""
        if not device.reachable:
            note = f"unreachable: {note}" if note else "unreachable"
        if device.lease:
            note = f"lease {device.lease}" + (f"; {note}" if note else "")
        rows.append(
            (
                device.id,
                device.kind or "?",
                description or "?",
                _memory(device.free_bytes, device.total_bytes),
                device.holder or "-",
                note,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]).rstrip()
        for row in rows
    )


def _memory(free_bytes: int | None, total_bytes: int | None) -> str:
    if free_bytes is None or total_bytes is None:
        return "?"
    return f"{render.format_bytes(free_bytes)} / {render.format_bytes(total_bytes)}"


def _memory_lines(status: DaemonStatus) -> list[str]:
    """Host RAM against its budget, and the prompt caches on disk against theirs (issue 14)."""
    lines = []
    ram = status.host_ram
    if ram is not None:
        budget = ram.budget_bytes
        lines.append(
            f"host RAM: {render.format_bytes(status.host_ram_bytes or 0)} = "
            f"model file copies {render.format_bytes(ram.host_copies_bytes)} "
            "(each counted once) + KV caches kept on the host "
            f"{render.format_bytes(ram.host_kv_bytes)} + weights' own copies "
            f"{render.format_bytes(ram.host_weights_bytes)}; budget "
            + (render.format_bytes(budget) if budget else "none")
        )
    elif status.host_ram_bytes is not None:  # a daemon from before issue 14's budgets
        lines.append(
            f"host RAM: {render.format_bytes(status.host_ram_bytes)} "
            "(model file copies, each counted once, and KV caches kept on the host)"
        )
    cache = status.prompt_cache
    if cache is not None:
        lines.append(
            f"prompt cache on disk: {render.format_bytes(cache.bytes_)} in "
            f"{cache.files} file(s); budget {render.format_bytes(cache.budget_bytes)}"
        )
    return lines


def _status_row(model: ModelStatus) -> tuple[str, ...]:
    handoff = model.last_handoff
    last = "-"
    if handoff is not None and handoff.from_model is not None:
        ago = time.time() - (handoff.at or time.time())
        last = f"from {handoff.from_model} {render.format_seconds(handoff.total_s)}, "
        last += render.format_ago(ago)
    note = [placed] if (placed := render.placement(model.devices)) else []
    if model.sequences:
        note.append(render.decoding(model.sequences, model.parallel, model.tokens_per_s))
    if model.silent_s is not None:
        note.append(render.silence(model.name, model.silent_s))
    if model.stale_s is not None:
        note.append(render.stale(model.stale_s))
    if model.pinned:
        note.append("pinned")
    if model.restarts:
        note.append(f"{model.restarts} restarts")
    if model.host_copy_shared_with:
        note.append("file copy shared with " + ", ".join(model.host_copy_shared_with))
    if model.last_error:
        note.append(model.last_error)
    vram, cold, host = model.vram_bytes, model.cold_footprint_bytes, model.host_ram_bytes
    return (
        model.name,
        str(model.state),
        str(model.backend or "-"),
        "?" if vram is None else render.format_bytes(vram),
        "-" if cold is None else render.format_bytes(cold),
        "-" if host is None else render.format_bytes(host),
        str(model.queue),
        str(model.served),
        last,
        "; ".join(note),
    )


def _kept(result: dict[str, Any]) -> str:
    """What an unload kept of the prompt cache, as a suffix; "" for any other reply."""
    if result.get("error"):
        return f" (its prompt cache was not kept: {result['error']})"
    if result.get("kv_bytes"):
        kept = render.format_bytes(int(result["kv_bytes"]))
        return f" ({result.get('tokens')} tokens of prompt cache kept on disk, {kept})"
    return ""


def _aside_line(result: dict[str, Any]) -> str:
    aside = result["stepped_aside"]
    if isinstance(aside, dict):
        record = SteppedAside.from_json(aside)
        program = render.stepped_aside(record.program, record.pid, record.used_bytes)
        return f"stepped aside for {program}: {record.reason}"
    if result.get("resumed"):
        return "no longer stepped aside: the models may take the GPU again"
    return "not stepped aside for any program"


def _describe(command: ControlCommand, result: dict[str, Any]) -> str:
    if "model" in result and "state" in result:
        return f"{result['model']}: {result['state']}" + _kept(result)
    if "pinned" in result:
        return f"{result.get('model', '')}: {'pinned' if result['pinned'] else 'unpinned'}"
    if "hold" in result:
        return "GPU held for you" if result["hold"] else "GPU given back to the models"
    if "stepped_aside" in result:
        return _aside_line(result)
    if command is ControlCommand.RELOAD:
        parts = [
            f"{key.replace('_', ' ')}: {', '.join(result[key])}"
            for key in ("added", "removed", "changed", "aliases_changed")
            if result.get(key)
        ]
        lines = ["reloaded" + (" (" + "; ".join(parts) + ")" if parts else ", nothing changed")]
        lines += [f"warning: {warning}" for warning in result.get("warnings", [])]
        return "\n".join(lines)
    return json.dumps(result)
