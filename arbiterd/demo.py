"""`arbiterd demo`: the daemon with two resident models sharing one GPU, driven by real requests.

Starts a real daemon (a subprocess, on private paths) with two configurations of the embedded
gemma-3-270m model, sends alternating requests through the OpenAI API with the `openai` SDK,
prints every handoff as the daemon reports it (who released, who restored, how long, how many
prompt tokens were evaluated), then a summary, and shuts the daemon down. Nothing here is
simulated: the figures are the daemon's own events.
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
from pathlib import Path
from typing import Any

from arbiterd.config import embedded_model_path
from arbiterd.control import ControlClient
from arbiterd.errors import ArbiterError, DaemonNotRunningError

MODELS = ("gemma-story", "gemma-notes")
# Each model keeps its own long conversation: after a handoff it must not re-read it.
CONTEXTS = {
    "gemma-story": (
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
        "had no hands at all, only a face painted with stars. "
    ),
    "gemma-notes": (
        "Meeting notes, design team, Thursday. Attendees: Ana (engine), Bo (daemon), Chen "
        "(tray app), Dee (packaging). First topic: the release schedule. The engine must be "
        "frozen two weeks before the release; the daemon can take fixes until the last week. "
        "Second topic: the handoff benchmark. Bo measured the handoff between two models on "
        "the small test machine; most of the time goes into re-reading the vocabulary when "
        "the model is loaded again, and very little into copying the cache back. Ana will "
        "look at keeping the vocabulary in memory. Third topic: the tray icon colours. Chen "
        "proposed one colour per model, grey for other programs, amber for warnings and red "
        "when the daemon is unreachable. Dee asked that the icon also work on a dark panel. "
        "Fourth topic: packaging. The user service starts at login and the tray app follows. "
        "Action items: "
    ),
}
ROUNDS = 4
START_TIMEOUT_S = 300.0


def main(screenshot: Path | None = None) -> int:
    """Run the demo; with `screenshot`, the tray's dashboard of it is rendered there at the end
    (needs the gui extra)."""
    with tempfile.TemporaryDirectory(prefix="arbiterd-demo-") as tmp:
        base = Path(tmp)
        port = _free_port()
        config = _write_config(base, port)
        print(f"arbiterd demo: two models on {embedded_model_path().name}, one GPU token")
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
    client_control = _wait_for_daemon(control)
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    listener = ControlClient.connect(control)
    listener.call("subscribe")
    threading.Thread(target=_pump, args=(listener, events), name="demo-events", daemon=True).start()
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo")
    history = {name: CONTEXTS[name] for name in MODELS}
    requests, handoffs = [], []
    print(f"{'':4}{'model':12} {'latency':>8} {'prompt':>7} {'evaluated':>9}  answer")
    for round_ in range(ROUNDS):
        for name in MODELS:
            history[name] += f"Part {round_ + 1}:"
            started = time.monotonic()
            reply = api.completions.create(
                model=name, prompt=history[name], max_tokens=12, temperature=0
            )
            latency = time.monotonic() - started
            text = reply.choices[0].text
            history[name] += text + " "
            for event in _drain(events, lambda e: e.get("event") == "request"):
                if event.get("event") == "handoff":
                    handoffs.append(event)
                    print(_handoff_line(event))
                elif event.get("event") == "request":
                    requests.append(event)
                    print(
                        f"{'':4}{name:12} {latency:7.2f}s {event['prompt_tokens']:7d} "
                        f"{event['prompt_tokens_evaluated']:9d}  {text.strip()[:40]!r}"
                    )
    _summary(requests, handoffs)
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


def _wait_for_daemon(control: Path) -> ControlClient:
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
        states = {m["name"]: m["state"] for m in client.call("status")["models"]}
        if all(s in ("warm", "cold") for s in states.values()):
            print("ready: " + ", ".join(f"{n} {s}" for n, s in states.items()))
            return client
        client.close()
        if time.monotonic() > deadline or "failed" in states.values():
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


def _handoff_line(event: dict[str, Any]) -> str:
    total = event["release_s"] + event["wait_s"] + event["restore_s"]
    return (
        f"  ⇄ handoff {event['from']} → {event['to']}: release {event['release_s']:.2f} s, "
        f"wait {event['wait_s']:.2f} s, restore {event['restore_s']:.2f} s "
        f"(total {total:.2f} s)"
    )


def _summary(requests: list[dict[str, Any]], handoffs: list[dict[str, Any]]) -> None:
    after_first = requests[len(MODELS) :]
    prompt = sum(r["prompt_tokens"] for r in after_first)
    evaluated = sum(r["prompt_tokens_evaluated"] for r in after_first)
    totals = [h["release_s"] + h["wait_s"] + h["restore_s"] for h in handoffs]
    print("summary:")
    print(
        f"  requests {len(requests)}, handoffs {len(handoffs)}"
        + (f", median handoff {statistics.median(totals):.2f} s" if totals else "")
    )
    print(
        f"  after the first request of each model: {prompt} prompt tokens, {evaluated} "
        f"evaluated ({evaluated / max(prompt, 1):.1%}): the KV cache survived every release"
    )


def _write_config(base: Path, port: int) -> Path:
    model = embedded_model_path()
    lines = [
        "[daemon]",
        f'http = "127.0.0.1:{port}"',
        f'socket = "{base / "control.sock"}"',
        f'arena = "{base / "arena"}"',
        f'journal = "{base / "journal.sqlite3"}"',
    ]
    for name in MODELS:
        lines += [
            "",
            f"[models.{name}]",
            f'path = "{model}"',
            "n_ctx = 2048",
            "n_gpu_layers = -1",
            'chat_format = "gemma"',
            "min_hold_s = 0.1",
        ]
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
