"""`arbiterd demo --devices` as a user runs it (issue 27 item 7): two `arbiterd rpc-server`s on
127.0.0.1, the story model split over both and the chat model on the second; both load at once
(the chat model's server is then busy with the story model, which is no reason to fail), every
handoff is in place and names its devices, and the prompt caches survive every release."""

from __future__ import annotations

import re
import subprocess
import sys

DEMO_TIMEOUT_S = 600


def test_the_devices_demo_alternates_two_models_on_two_rpc_servers() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "arbiterd", "demo", "--devices"],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    servers = re.findall(r"rpc:127\.0\.0\.1:\d+", done.stdout.splitlines()[0])
    assert len(set(servers)) == 2, done.stdout
    lines = done.stdout.splitlines()
    ready = next(line for line in lines if line.startswith("ready:"))
    assert "gemma-story warm" in ready or "gemma-story cold" in ready, done.stdout
    assert "smollm-chat warm" in ready or "smollm-chat cold" in ready, done.stdout
    # The first request finds either model warm (whichever finished its warm-up last); every
    # later one finds the other model warm, so a handoff line comes before each of them.
    rows = [i for i, line in enumerate(lines) if line.startswith(("    gemma", "    smollm"))]
    assert len(rows) == 8, done.stdout
    assert all("⇄ handoff" in lines[i - 1] for i in rows[1:]), done.stdout
    handoffs = [line for line in lines if "⇄ handoff" in line]
    split, single = f"in-place on {servers[0]} + {servers[1]}", f"in-place on {servers[1]})"
    for line in handoffs:
        assert (split in line) if line.split("→")[1].startswith(" gemma") else (single in line)
    assert "the KV cache survived every release" in done.stdout
