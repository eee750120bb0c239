"""Human output shared by the CLI and the tray: bytes, durations, processes, the engine, and the
line (or notification) for each event.

Owns every phrase a person reads about the daemon's figures and events, so `arbiterd status`,
`arbiterd events`, the tray's tooltip, its handoff table and its notifications say the same
thing the same way. Pure: no I/O and no clock of its own (callers pass times); imports only the
event records, never the daemon, the CLI or Qt.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterable, Sequence

from arbiterd.events import (
    EncoderEvent,
    Event,
    HandoffEvent,
    HolderSilentEvent,
    HoldEvent,
    LeaseEvent,
    OverflowEvent,
    PassedOverEvent,
    PromptCacheEvictEvent,
    RamBudgetEvent,
    ReloadEvent,
    RequestEvent,
    ResidencyEvent,
    StepAsideEvent,
    UnloadEvent,
    VramEvent,
    VramNotFreedEvent,
    WaitEvent,
    WorkerEvent,
)
from arbiterd.footprint import ModelFootprint, error, matched
from arbiterd.states import CpuCause, PassOverReason, ReleaseReason, ResidencyState
from arbiterd.status import GroupStatus

NONE = "—"  # what a missing name or figure shows as
KIND_WIDTH = 9  # "residency": the kinds line up in `arbiterd events`; longer ones push the text


# -- figures -------------------------------------------------------------------------------------


def format_bytes(count: float) -> str:
    """1536 → "1.5 KiB": binary units, as the GPU's memory is counted."""
    value = float(count)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def format_seconds(seconds: float | None) -> str:
    """0.4213 → "0.42 s"; None (not measured) → "—"."""
    return NONE if seconds is None else f"{seconds:.2f} s"


def format_ms(seconds: float | None) -> str:
    """0.0023 → "2.3 ms", for steps that take milliseconds (a projector's); None → "—"."""
    return NONE if seconds is None else f"{seconds * 1000:.1f} ms"


def format_ago(seconds: float) -> str:
    """How long ago, roughly: "12 s ago", "5 min ago", "2.5 h ago"."""
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def clock(at: float) -> str:
    """The local time of day of `at` (seconds since the epoch): "14:03:07"."""
    return time.strftime("%H:%M:%S", time.localtime(at))


def clock_ms(at: float) -> str:
    """The local time of day of `at` to the millisecond: "14:03:07.120"."""
    # Round once, in integer milliseconds: (at % 1) * 1000 turns .120 into 119.99….
    seconds, millis = divmod(round(at * 1000), 1000)
    return f"{clock(seconds)}.{millis:03d}"


# -- who holds the GPU, who waits ----------------------------------------------------------------


def process(name: str | None, pid: int | None) -> str:
    """A process as a person knows it: "steam (pid 4242)"; "pid 4242" without a name."""
    if pid is None:
        return name or "?"
    return f"{name} (pid {pid})" if name else f"pid {pid}"


def stepped_aside(program: str | None, pid: int | None, used_bytes: int | None) -> str:
    """The program the daemon stepped aside for (issue 45): "blender (pid 4242), 3.1 GiB"."""
    used = "" if used_bytes is None else f", {format_bytes(used_bytes)}"
    return process(program, pid) + used


def lease(state: str, lender: str, by: str | None, reason: str | None) -> str:
    """A lent device's lease (issue 46) in a few words: "granted by HOST:PORT", "revoked:
    the lender's game (pid 7) wants its GPU", "unreachable: HOST:PORT: Connection refused"."""
    if by and state in ("revoking", "revoked"):
        return f"{state}: the lender's {by} wants its GPU"
    if by and state == "waiting":
        return f"waiting: the lender's {by} has its GPU"
    if reason:
        return f"{state}: {reason}"
    return f"{state} by {lender}"


def silence(model: str, silent_s: float) -> str:
    """A warm model whose worker shows no sign of life (issue 24), as the status, the tray and
    the notification say it."""
    return f"{model} holds the GPU and has shown no sign of life for {silent_s:.0f} s"


def stale(stale_s: float) -> str:
    """Figures a worker gave `stale_s` ago and has not given since (it does not answer)."""
    return f"stale: no answer for {stale_s:.0f} s"


def waiters_line(waiters: Sequence[tuple[str | None, int | None]]) -> str:
    """Who waits for the GPU, each as (name, pid): "waiting: beta (pid 77)"."""
    if not waiters:
        return "waiting: nobody"
    return "waiting: " + ", ".join(process(name, pid) for name, pid in waiters)


def describe_engine(offload: bool, devices: Sequence[str]) -> str:
    """What the engine runs on, in a few words (the CLI's status and the tray say it so)."""
    if not offload:
        return "CPU only (this engine cannot offload to a GPU)"
    # The CPU is always one of the devices: name those that take the offloaded layers.
    gpus = [device for device in devices if not device.startswith("CPU")]
    return f"{', '.join(gpus)} (GPU offload)" if gpus else "GPU offload"


def engine_line(
    offload: bool, devices: Sequence[str], cpu_cause: CpuCause | None, cpu_note: str
) -> str:
    """The engine's line: what it runs on; on a machine without a GPU, the note that says so
    (the CPU is all there is: nothing to warn of). The warning of a GPU the engine does not use
    is a line of its own (status.Engine.cpu_warning)."""
    if cpu_cause is CpuCause.NO_GPU and cpu_note:
        return "engine: " + cpu_note
    return "engine: " + describe_engine(offload, devices)


def turn_text(quantum_s: float | None, served: int) -> str | None:
    """A holder's turn (issue 43): "turn 0.50 s, 3 served"; None before it was sized."""
    if quantum_s is None:
        return None
    return f"turn {format_seconds(quantum_s)}, {served} served"


def decoding(sequences: int, parallel: int, tokens_per_s: float) -> str:
    """A model's batch as it decodes: "decoding 3 of 4 · 120 tok/s"."""
    return f"decoding {sequences} of {parallel} · {tokens_per_s:.0f} tok/s"


def capabilities_text(capabilities: Sequence[str]) -> str:
    """What a model can be asked for, as the CLI's status and the tray say it ("" before its
    worker told: nothing is claimed)."""
    return ", ".join(capabilities)


# The device a model is on unless its config says otherwise (paths.DEFAULT_DEVICE); render.py
# imports only event records, so the id is spelled here.
_DEFAULT_DEVICES = ("gpu0",)


def placement(devices: Sequence[str]) -> str:
    """Where a model runs, as the CLI's status and the tray say it: "on rpc:127.0.0.1:50052 +
    rpc:127.0.0.1:50053"; "" on the default gpu0 (or from a daemon that did not say), so that a
    machine whose models are all on one GPU reads as it did before devices had names."""
    if tuple(devices) in ((), _DEFAULT_DEVICES):
        return ""
    return "on " + " + ".join(devices)


def footprint_text(footprint: ModelFootprint) -> str:
    """Each device's footprint, predicted and measured, with the prediction's error (issue 44):
    "gpu0 predicted 102.9 MiB, measured 104.7 MiB (-1.7 %); cpu ..."."""
    parts = []
    for device, guess, found in matched(footprint.predicted, footprint.measured):
        said = [] if guess is None else [f"predicted {format_bytes(guess.total_bytes)}"]
        if found is not None:
            said.append(f"measured {format_bytes(found.total_bytes)}")
            if guess is not None:
                said[-1] += f" ({100 * error([guess], [found]):+.1f} %)"
        parts.append(f"{device} " + ", ".join(said))
    if not footprint.measured:
        parts.append("not measured yet")
    return "; ".join(parts)


def grouped(pairs: Iterable[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """(names, text) for each distinct non-empty text of (name, text) pairs, in the order each
    text first comes: the same warning for several models is said once, naming them all."""
    names_of: dict[str, list[str]] = {}
    for name, text in pairs:
        if text:
            names_of.setdefault(text, []).append(name)
    return [(names, text) for text, names in names_of.items()]


# -- events --------------------------------------------------------------------------------------


def event_line(event: Event) -> str:
    """One line for `arbiterd events`: local time to the millisecond, the kind, what happened."""
    stamp = "--:--:--.---" if event.at is None else clock_ms(event.at)
    return f"{stamp}  {event.kind:<{KIND_WIDTH}} {event_detail(event)}".rstrip()


def event_detail(event: Event) -> str:  # noqa: PLR0911, PLR0912 (one return per kind)
    """What happened, in a line, without the time and the kind."""
    match event:
        case ResidencyEvent():
            return _residency(event)
        case HandoffEvent():
            return _handoff(event)
        case WaitEvent():
            return _wait(event)
        case RequestEvent():
            return _request(event)
        case WorkerEvent():
            return _worker(event)
        case ReloadEvent():
            return _reload(event)
        case HoldEvent():
            return _hold(event)
        case StepAsideEvent():
            return _step_aside(event)
        case LeaseEvent():
            return f"lease of {event.device}: " + lease(
                event.state or "?", event.lender or "?", event.by, event.reason
            )
        case UnloadEvent():
            return _unload(event)
        case RamBudgetEvent():
            return _ram_budget(event)
        case PromptCacheEvictEvent():
            return _prompt_cache_evict(event)
        case EncoderEvent():
            return _encoder(event)
        case VramEvent():
            return _vram(event)
        case VramNotFreedEvent():
            return _vram_not_freed(event)
        case HolderSilentEvent():
            return _holder_silent(event)
        case PassedOverEvent():
            return _passed_over(event)
        case OverflowEvent():
            return "this client fell behind and missed events; the daemon dropped it"
        case _:
            return _fields(event)


def handoff_title(event: HandoffEvent | WaitEvent) -> str:
    """How the GPU came to a model: "alpha → beta", "alpha → beta (alpha paused)" when alpha
    was preempted mid-generation, or "beta waited behind steam (pid 9)"."""
    if isinstance(event, HandoffEvent):
        title = f"{_name(event.from_model)} → {_name(event.to_model)}"
        if event.release_reason is ReleaseReason.PREEMPTED:
            title += f" ({_name(event.from_model)} paused)"
        return title
    return f"{_name(event.model)} waited behind {process(event.holder_name, event.holder_pid)}"


def handoff_label(event: HandoffEvent | WaitEvent) -> str:
    """The short form, for a marker on the timeline: "→ beta 1.40 s", "→ beta 3.20 s after
    steam"."""
    if isinstance(event, HandoffEvent):
        return f"→ {_name(event.to_model)} {format_seconds(event.total_s)}"
    behind = event.holder_name or process(None, event.holder_pid)
    return f"→ {_name(event.model)} {format_seconds(event.total_s)} after {behind}"


def failure(event: Event) -> tuple[str, str] | None:
    """(summary, body) when `event` reports a failure worth interrupting someone for: VRAM not
    freed, a holder that shows no sign of life, a model that failed, a worker that crashed or
    could not start. Else None."""
    if isinstance(event, VramNotFreedEvent):
        held = f"{format_bytes(event.bytes_after)} are" if event.bytes_after else "its memory is"
        where = f" on {event.device}" if event.device else ""
        model = event.model or "a model"
        return ("VRAM not freed", f"{model} released the GPU but {held} still in use{where}")
    if isinstance(event, HolderSilentEvent):
        return _holder_failure(event)
    if isinstance(event, ResidencyEvent) and event.to_state is ResidencyState.FAILED:
        reason = event.reason or "no reason given"
        return ("Model failed", f"{event.model or 'a model'} failed: {reason}")
    if isinstance(event, WorkerEvent):
        then = "" if event.restart_in_s is None else f"; restarting in {event.restart_in_s:.0f} s"
        body = f"{event.model or 'a model'}: {event.reason or 'exited'}{then}"
        if event.code is None:
            return ("Worker failed to start", body)
        return ("Worker crashed", body)
    return None


def _holder_failure(event: HolderSilentEvent) -> tuple[str, str]:
    body = silence(event.model or "a model", event.silent_s or 0.0)
    if event.killed:
        return ("GPU holder killed", f"{body}: killed, so the GPU moves on; it restarts")
    return ("GPU holder not answering", f"{body}; killed if it stays silent")


def _name(value: str | None) -> str:
    return value or NONE


def _residency(event: ResidencyEvent) -> str:
    left = _name(event.from_state)
    line = f"{_name(event.model)} {left} → {_name(event.to_state)}"
    if event.reason:
        line += f" ({event.reason})"
    parts = [line]
    if event.duration_s is not None:  # how long the state it left lasted
        parts.append(f"{left} for {format_seconds(event.duration_s)}")
    for size, label in (
        (event.weights_bytes, "weights"),
        (event.kv_bytes, "kv"),
        (event.disk_read_bytes, "read"),
    ):
        if size:
            parts.append(f"{label} {format_bytes(size)}")
    return "  ".join(parts)


def _handoff(event: HandoffEvent) -> str:
    parts = [handoff_title(event)]
    for seconds, label in (
        (event.release_s, "release"),
        (event.wait_s, "wait"),
        (event.restore_s, "restore"),
    ):
        if seconds is not None:
            parts.append(f"{label} {format_seconds(seconds)}")
    if event.restored_bytes:
        parts.append(f"restored {format_bytes(event.restored_bytes)}")
    return "  ".join([*parts, placement(event.devices)]).rstrip()


def _wait(event: WaitEvent) -> str:
    parts = [handoff_title(event)]
    if event.wait_s is not None:
        parts.append(f"wait {format_seconds(event.wait_s)}")
    return "  ".join([*parts, placement(event.devices)]).rstrip()


def _request(event: RequestEvent) -> str:
    line = _name(event.model)
    if event.prompt_tokens is not None:
        line += f" {event.prompt_tokens} tokens"
        if event.prompt_tokens_evaluated is not None:
            line += f" ({event.prompt_tokens_evaluated} evaluated)"
    if event.completion_tokens is not None:
        line += f", {event.completion_tokens} generated"
    if event.duration_s is not None:
        line += f" {format_seconds(event.duration_s)}"
    if event.outcome:
        line += f" {event.outcome}"
    if event.error:
        line += f": {event.error}"
    if event.request_id:
        line += f"  {event.request_id}"
    return line


def _worker(event: WorkerEvent) -> str:
    line = _name(event.model)
    if event.pid is not None:
        line += f" pid {event.pid}"
    if event.code is None:
        line += " started"
    else:
        line += f" exited code {event.code}"
        if event.code < 0:
            with contextlib.suppress(ValueError):  # not a signal this system names
                line += f" ({signal.Signals(-event.code).name})"
    if event.reason:
        line += f": {event.reason}"
    if event.restart_in_s is not None:
        line += f", restarting in {event.restart_in_s:.1f} s"
    if event.last_words:
        line += f"; its last words: {event.last_words[-1]}"
    return line


def _reload(event: ReloadEvent) -> str:
    parts = [
        f"{label} {', '.join(names)}"
        for label, names in (
            ("added", event.added),
            ("removed", event.removed),
            ("changed", event.changed),
            ("aliases changed", event.aliases_changed),
        )
        if names
    ]
    parts += [f"warning: {warning}" for warning in event.warnings]
    return "  ".join(parts) or "nothing changed"


def _hold(event: HoldEvent) -> str:
    return "GPU held by the user" if event.held else "GPU given back by the user"


def _step_aside(event: StepAsideEvent) -> str:
    program = stepped_aside(event.program, event.pid, event.used_bytes)
    if event.aside:
        return f"stepped aside for {program}: {event.reason}"
    return f"back from stepping aside for {program}: {event.why}"


def _unload(event: UnloadEvent) -> str:
    line = f"{_name(event.model)} unloaded"
    if event.reason:
        line += f" ({event.reason})"
    if event.error:
        return f"{line}: {event.error}"
    if event.kv_bytes:
        line += f", {event.tokens} tokens of prompt cache kept ({format_bytes(event.kv_bytes)})"
    return line


def _ram_budget(event: RamBudgetEvent) -> str:
    used = NONE if event.used_bytes is None else format_bytes(event.used_bytes)
    budget = NONE if event.budget_bytes is None else format_bytes(event.budget_bytes)
    line = f"host RAM {used} over its budget {budget}"
    if not event.unload:
        return f"{line}: no cold model to unload"
    after = NONE if event.after_bytes is None else format_bytes(event.after_bytes)
    return f"{line}: unloading {', '.join(event.unload)} (then {after})"


def _prompt_cache_evict(event: PromptCacheEvictEvent) -> str:
    evicted = NONE if event.evicted_bytes is None else format_bytes(event.evicted_bytes)
    used = NONE if event.used_bytes is None else format_bytes(event.used_bytes)
    budget = NONE if event.budget_bytes is None else format_bytes(event.budget_bytes)
    return (
        f"prompt cache of {', '.join(event.evicted) or NONE} removed ({evicted}) to keep "
        f"{_name(event.model)}'s: {used} on disk of {budget}"
    )


def encoder_steps(events: Iterable[EncoderEvent], *, timed: bool = True) -> str:
    """What a vision request's projector did, in order: "projector loaded in 2.3 ms, encoded 1
    image in 0.4 ms, freed in 0.1 ms" (a swap adds "weights released" first and "weights
    restored" last); without `timed`, "projector loaded, encoded 1 image, freed" (the tray's
    card and handoff table, issue 12)."""
    steps = [
        f"{_encoder_did(e)} in {format_ms(e.duration_s)}" if timed else _encoder_did(e)
        for e in events
    ]
    text = ", ".join(steps) or NONE
    return text if text.startswith(("projector", "weights")) else f"projector {text}"


def _encoder_did(event: EncoderEvent) -> str:
    if event.action == "encode":
        count = event.images or 0
        return f"encoded {count} image{'s' if count != 1 else ''}"
    return {
        "load": "projector loaded",
        "free": "freed",
        "release": "weights released",
        "restore": "weights restored",
    }.get(event.action, event.action or NONE)


def _encoder(event: EncoderEvent) -> str:
    """ "eye: projector loaded in 2.3 ms (155 KiB), beside, peak 6.6 MiB", "... encoded 1 image
    in 0.4 ms (1.0 KiB)", "eye: weights released for the projector in 0.2 ms (545 KiB), swap,
    peak 6.4 MiB"; a swap's or a refused swap's reason follows its load."""
    size = NONE if event.bytes_ is None else format_bytes(event.bytes_)
    what = {
        "free": "projector freed",
        "release": "weights released for the projector",
        "restore": "weights restored after it",
    }.get(event.action) or _encoder_did(event)
    if event.action == "encode":
        what = f"projector {what}"
    line = f"{_name(event.model)}: {what} in {format_ms(event.duration_s)} ({size})"
    if event.path:
        line += f", {event.path}"
    if event.peak_bytes:
        line += f", peak {format_bytes(event.peak_bytes)}"
    if event.reason and event.action == "load":
        line += f": {event.reason}"
    return line


def _vram(event: VramEvent) -> str:
    parts = []
    for device in event.devices:
        used = NONE if device.used_bytes is None else format_bytes(device.used_bytes)
        total = NONE if device.total_bytes is None else format_bytes(device.total_bytes)
        parts.append(f"{_name(device.device)} {used} used of {total}")
    for model, size in event.models:
        parts.append(f"{model} {NONE if size is None else format_bytes(size)}")
    return "  ".join(parts)


def _vram_not_freed(event: VramNotFreedEvent) -> str:
    line = _name(event.model)
    if event.pid is not None:
        line += f" pid {event.pid}"
    after = NONE if event.bytes_after is None else format_bytes(event.bytes_after)
    line += f" still holds {after}"
    if event.device:
        line += f" on {event.device}"
    if event.waited_s is not None:
        line += f" {format_seconds(event.waited_s)} after its release"
    if event.expected_bytes is not None:
        line += f" (cold footprint {format_bytes(event.expected_bytes)})"
    return line


def _holder_silent(event: HolderSilentEvent) -> str:
    line = _name(event.model)
    if event.pid is not None:
        line += f" pid {event.pid}"
    line += " holds the GPU" + (f" while {event.state}" if event.state else "")
    line += f", no sign of life for {format_seconds(event.silent_s)}"
    if event.timeout_s is not None:
        line += f" (holder_timeout_s {format_seconds(event.timeout_s)})"
    return line + (": killed" if event.killed else ": reported")


def _passed_over(event: PassedOverEvent) -> str:
    line = f"{_name(event.model)} went before pid {event.pid}, ahead of it in the queue"
    if event.reason is PassOverReason.STOPPED:
        line += ": stopped"
    elif event.free_s is not None:
        line += f": left the free GPU untaken for {format_seconds(event.free_s)}"
    return line + "; it keeps its place"


def _fields(event: Event) -> str:
    fields = {k: v for k, v in event.to_json().items() if k not in {"event", "at", "seq"}}
    return " ".join(
        f"{key}={json.dumps(value, ensure_ascii=False, default=str)}"
        for key, value in fields.items()
    )


def fitting_budget(group: GroupStatus) -> str:
    """A fitting set's budget and what made it: "7.5 GiB (8 GiB by nvml - 512 MiB reserve -
    1.2 GiB others)"; with none, why each member is warm alone."""
    if group.size_bytes is None:
        return f"no budget: {group.device}'s memory is not known, each warm alone"
    made = (
        f"{format_bytes(group.size_bytes)} by {group.size_source} - "
        f"{format_bytes(group.reserve_bytes)} reserve - {format_bytes(group.others_bytes)} others"
    )
    if not group.budget_bytes:
        return f"no room ({made}), each warm alone"
    return f"{format_bytes(group.budget_bytes)} ({made})"
