"""The `arbiterd` command line. Owns argument parsing and the mapping of errors to exit statuses.

Every ArbiterError becomes one line on stderr and the exit status its class names (errors.py);
nothing below this module prints a traceback for an expected failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

from arbiterd import __version__, render
from arbiterd.arena import Arena, ArenaState
from arbiterd.arena.devices import canonical_order
from arbiterd.cli import commands
from arbiterd.cli.demo import main as run_demo
from arbiterd.cli.discovery import FoundModel, find_models
from arbiterd.cli.install import Installer, copy_of_this_clone, how_to_start
from arbiterd.cli.runner import run_holding_token
from arbiterd.cli.served import Served, configured, served
from arbiterd.cli.starter import model_tables
from arbiterd.errors import (
    ArbiterError,
    BadValueError,
    DaemonNotRunningError,
    MissingPartError,
    UsageError,
)
from arbiterd.paths import DEFAULT_DEVICE, DEVICE_ID_SHAPES, device_arena_of, resolve_arena
from arbiterd.procs import holder_name, process_name, waiter_name
from arbiterd.rpcserver import server as rpcserver
from arbiterd.states import PRIORITY_CHOICES, Priority, parse_priority

RUN_USAGE = (
    "arbiterd run [--arena DIR] [--device ID]... [--name NAME] [--priority P] [--timeout S] "
    "-- CMD [ARG...]"
)
# A command whose reader closed the pipe ends as a shell reports one killed by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arbiterd",
        description="Share one GPU between resident llama.cpp models and programs.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"arbiterd {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = partial(_add_command, sub)
    run = command(
        "run",
        "run a program while it holds the GPU token",
        "arbiterd run -- blender --background scene.blend --render-frame 1",
        "arbiterd run --name comfyui --timeout 600 -- python main.py",
        "arbiterd run --device gpu0 --device gpu1 -- python train.py",
        usage=RUN_USAGE,
    )
    _add_arena_option(run)
    _add_device_option(run, "hold this device's token (repeat it to hold several)")
    run.add_argument("--name", help="how the holder is shown (default: the program's name)")
    run.add_argument("--timeout", type=float, metavar="S", help="give up waiting after S seconds")
    run.add_argument(
        "--priority",
        default=Priority.NORMAL.value,
        metavar="CLASS",
        help=f"its class in the GPU queue: {PRIORITY_CHOICES} (default: normal)",
    )

    arena = command("arena", "inspect an arena", "arbiterd arena status")
    arena_sub = arena.add_subparsers(dest="arena_command", required=True, metavar="COMMAND")
    status = _add_command(
        arena_sub, "status", "who holds the GPU token and who waits", "arbiterd arena status --json"
    )
    _add_arena_option(status)
    _add_device_option(status, "show this device's arena")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    commands.add_commands(command)
    rpc_server = command(
        "rpc-server",
        "serve this machine's GPU or CPU to other engines as a llama.cpp RPC server",
        "arbiterd rpc-server",
        "arbiterd rpc-server --listen 127.0.0.1:50053 --device cpu",
    )
    rpcserver.add_command(rpc_server)
    demo = command(
        "demo",
        "run two models on real requests and show every handoff live",
        "arbiterd demo --screenshot dashboard.png",
    )
    demo.add_argument(
        "--screenshot", type=Path, metavar="FILE.png", help="also render the dashboard of it"
    )
    demo.add_argument(
        "--devices",
        action="store_true",
        help="on two llama.cpp RPC servers on 127.0.0.1: one model split over both",
    )
    demo.set_defaults(handler=lambda args: run_demo(args.screenshot, devices=args.devices))
    sub.add_parser(
        "tray", help="the tray icon and dashboard (arbiterd tray --help)", add_help=False
    )
    models = command(
        "models",
        "list the models arbiterd serves, and the GGUFs found where Ollama, LM Studio and "
        "others keep them",
        "arbiterd models",
        "arbiterd models --json",
        "arbiterd models --toml >> ~/.config/arbiterd/config.toml",
    )
    models.add_argument(
        "--config", type=Path, help="the config whose models are served (and its daemon's socket)"
    )
    shown = models.add_mutually_exclusive_group()
    shown.add_argument(
        "--json", action="store_true", help='print {"served": {...}, "models": [...]}'
    )
    shown.add_argument(
        "--toml",
        action="store_true",
        help="print a [models.NAME] table for each, ready to paste into the config",
    )
    models.set_defaults(handler=_models)
    install = command(
        "install",
        "start the daemon and the tray at login",
        "arbiterd install --dry-run",
        "arbiterd install",
    )
    install.add_argument("--no-enable", action="store_true", help="write files, start nothing")
    install.add_argument("--dry-run", action="store_true", help="only say what would be done")
    install.add_argument(
        "--copy",
        action="store_true",
        help="install this clone into a venv of its own under ~/.local/share/arbiterd, so the "
        "service keeps running when the clone moves",
    )
    install.set_defaults(handler=_install)
    uninstall = command(
        "uninstall", "undo exactly what install did", "arbiterd uninstall --dry-run"
    )
    uninstall.add_argument("--dry-run", action="store_true", help="only say what would be done")
    uninstall.set_defaults(handler=_uninstall)
    return parser


def _add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    *examples: str,
    **options: Any,
) -> argparse.ArgumentParser:
    """A subcommand whose --help page says in a line what it does and shows how it is used."""
    return sub.add_parser(
        name,
        help=summary,
        description=f"{summary[0].upper()}{summary[1:]}.",
        epilog="\n  ".join(["examples:" if len(examples) > 1 else "example:", *examples]),
        formatter_class=_HelpFormatter,
        **options,
    )


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help pages with their examples laid out as written.

    Python 3.11 measures the command names of the main page without the indent they are printed
    with, so the longest ("uninstall") had its description pushed onto a line of its own
    (CPython gh-87041); this measures them where they stand.
    """

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            widest = max(map(len, action.choices)) + self._current_indent + self._indent_increment
            self._action_max_length = max(self._action_max_length, widest)


def _version() -> str:
    try:
        return metadata.version("arbiterd")
    except metadata.PackageNotFoundError:
        # Imported from a source tree that pip never installed (PYTHONPATH=...): no metadata.
        return f"{__version__} (source tree, not installed)"


def _add_arena_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arena",
        metavar="DIR",
        help="arena directory (default: $ARBITERD_ARENA, else "
        "$XDG_RUNTIME_DIR/arbiterd/arena/gpu0)",
    )


def _add_device_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--device",
        action="append",
        metavar="ID",
        help=f"{what}: {DEVICE_ID_SHAPES}; its arena is --arena's for gpu0 and the sibling "
        "folder named by the device for any other (default: gpu0)",
    )


def arenas_of_devices(devices: Sequence[str] | None, gpu0_arena: Path) -> list[tuple[str, Arena]]:
    """The arenas of `--device`s (gpu0's alone without any), each device with its own, in the
    canonical order; a device named twice, or an id of no known shape, is refused."""
    if not devices:
        return [(DEFAULT_DEVICE, Arena(gpu0_arena))]
    return [(str(d), Arena(device_arena_of(d, gpu0_arena))) for d in canonical_order(devices)]


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    prefix = "arbiterd"
    if args_list and not args_list[0].startswith("-"):
        prefix += f" {args_list[0]}"
    try:
        return _dispatch(args_list)
    except DaemonNotRunningError as exc:
        print(f"{prefix}: {exc}; {how_to_start(os.environ)}", file=sys.stderr)
        return exc.exit_code
    except ArbiterError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # The reader went away (`arbiterd events | head -1`): not an error of ours. Whatever
        # is still buffered goes nowhere, so the interpreter's last flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["tray"]:
        # Its own parser, and Qt is loaded only for it (never by the daemon or `run`).
        try:
            from arbiterd.gui.app import main as tray_main  # noqa: PLC0415
        except ImportError as exc:
            raise MissingPartError(
                f"the tray needs PySide6, which is not installed ({exc.msg}): "
                "pip install 'arbiterd[gui]'"
            ) from None
        return tray_main(argv[1:])
    cmd: list[str] = []
    if argv[:1] == ["run"]:
        # Only the runner's own options come before "--"; all after it is the command's, its
        # --help included. Without "--", a help request is the one thing that makes sense.
        if "--" in argv:
            split = argv.index("--")
            argv, cmd = argv[:split], argv[split + 1 :]
        elif not {"-h", "--help"} & set(argv):
            raise UsageError(f"put '--' before the command: {RUN_USAGE}")
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _run(args, cmd)
    if args.command == "arena":
        return _arena_status(args)
    code: int = args.handler(args)
    return code


def _run(args: argparse.Namespace, cmd: list[str]) -> int:
    timeout_s: float | None = args.timeout
    if timeout_s is not None and (timeout_s < 0 or not math.isfinite(timeout_s)):
        raise BadValueError(f"--timeout must be a non-negative number of seconds, got {timeout_s}")
    if not cmd:
        raise UsageError(f"no command after '--': {RUN_USAGE}")
    priority = parse_priority(args.priority, "--priority")
    arenas = arenas_of_devices(args.device, resolve_arena(args.arena))
    return run_holding_token(arenas, cmd, name=args.name, timeout_s=timeout_s, priority=priority)


def _models(args: argparse.Namespace) -> int:
    found = find_models()
    for warning in found.warnings:
        print(f"arbiterd models: warning: {warning}", file=sys.stderr)
    if args.toml:
        # Appended to the config, a model it serves already would be a second table for one
        # file (or one name twice); the embedded default's models are not in a file.
        serving = configured(args.config)
        new = [m for m in found.models if serving.config is None or not serving.name_of(m.path)]
        if len(new) < len(found.models):
            left = ", ".join(m.name for m in found.models if m not in new)
            print(
                f"arbiterd models: left out, as {serving.config} serves them already: {left}",
                file=sys.stderr,
            )
        tables = model_tables(new)
        if tables:  # nothing found: nothing printed, and a config it is appended to stays valid
            print("\n".join(tables).lstrip("\n"))
        return 0
    serving = served(args.config)
    if args.json:
        models = [
            {**model.to_json(), "served_as": serving.name_of(model.path)} for model in found.models
        ]
        print(json.dumps({"served": serving.to_json(), "models": models}))
        return 0
    print(f"{serving.by}:\n{render_served(serving)}\n")
    if not found.models:
        looked = "\n".join(f"  {place.folder} ({place.source})" for place in found.places)
        print(
            f"no GGUF models found; looked in:\n{looked}\n"
            "a model pulled by Ollama or LM Studio, or a .gguf file put in ~/models, is found"
        )
        return 0
    print("found (`arbiterd models --toml` prints a [models.NAME] table for each):")
    print(render_models(found.models, serving))
    return 0


def render_served(serving: Served) -> str:
    """The models served as a table, indented under its heading: NAME (and its aliases), FILE."""
    rows = [("NAME", "FILE")]
    rows += [(", ".join((m.name, *m.aliases)), str(m.path)) for m in serving.models]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name.ljust(width)}  {path}" for name, path in rows)


def render_models(models: list[FoundModel], serving: Served) -> str:
    """The models found as a table; NAME is what the starter config serves each under (and its
    aliases: its other names in Ollama's store); SERVED, the name the daemon serves its file
    under, if it does."""
    rows = [("NAME", "SIZE", "ARCH", "CONTEXT", "CHAT TEMPLATE", "SOURCE", "SERVED", "PATH")]
    rows += [
        (
            ", ".join((model.name, *model.aliases)),
            render.format_bytes(model.size_bytes),
            model.architecture or "?",
            "?" if model.context_length is None else str(model.context_length),
            "yes" if model.chat_template else "no",
            model.source,
            serving.name_of(model.path) or "-",
            str(model.path),
        )
        for model in models
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
        + "  "
        + row[-1]
        for row in rows
    )


def _install(args: argparse.Namespace) -> int:
    copy = copy_of_this_clone(os.environ) if args.copy else None
    Installer(dry_run=args.dry_run).install(enable=not args.no_enable, copy=copy)
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    Installer(dry_run=args.dry_run).uninstall()
    return 0


def arena_status_json(state: ArenaState) -> dict[str, object]:
    """The `arena status --json` object; its keys are a public interface."""
    holder: dict[str, object] | None = None
    if state.holder_pid is not None:
        holder = {
            "pid": state.holder_pid,
            "name": holder_name(state),
            "since": state.holder.since if state.holder else None,
            "model": state.holder.model if state.holder else None,
        }
    return {
        "arena": str(state.path),
        "holder": holder,
        "waiters": [{"pid": pid, "name": waiter_name(state, pid)} for pid in state.waiter_pids],
        # the queued waiters, first to be served first (aging included: the order a waiter
        # keeps); a waiter missing here has no ticket (a program that speaks only token.lock +
        # want.lock). A stopped one keeps its place, and the waiters behind pass it over.
        "queue": [
            {
                **waiter.to_json(state.observed_ns),
                "name": waiter.name or process_name(waiter.pid),
                "stopped": waiter.pid in state.stopped_pids,
            }
            for waiter in state.queue
        ],
        "stale_holder_file": state.stale_holder.to_json() if state.stale_holder else None,
    }


def _arena_status(args: argparse.Namespace) -> int:
    devices: list[str] | None = args.device
    if devices is not None and len(devices) > 1:
        raise UsageError("arena status shows one device's arena: give --device once")
    [(_, arena)] = arenas_of_devices(devices, resolve_arena(args.arena))
    state = arena.observe()
    report = arena_status_json(state)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"arena    {report['arena']}")
    holder = state.holder_pid
    if holder is None:
        print("holder   none (the GPU is free)")
    else:
        line = f"holder   {render.process(holder_name(state), holder)}"
        if state.holder is not None:
            line += f" since {render.clock(state.holder.since)}"
            if state.holder.model:
                line += f" (model {state.holder.model})"
        print(line)
    waiters = ", ".join(render.process(waiter_name(state, pid), pid) for pid in state.waiter_pids)
    print(f"waiters  {waiters or 'none'}")
    for place, waiter in enumerate(state.queue, start=1):
        who = render.process(waiter.name or process_name(waiter.pid), waiter.pid)
        aged = waiter.competes_as(state.observed_ns)
        klass = waiter.priority.value + ("" if aged is waiter.priority else f", aged to {aged}")
        waited = render.format_seconds(waiter.waited_s(state.observed_ns))
        stop = ", stopped: passed over" if waiter.pid in state.stopped_pids else ""
        print(f"queue {place:<3}{who} ({klass}) waiting {waited}{stop}")
    if state.stale_holder is not None:
        print(
            f"note     holder.json names pid {state.stale_holder.pid} "
            f"({state.stale_holder.name}), which does not hold the token: stale"
        )
    return 0
