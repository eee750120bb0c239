"""`arbiterd status` names what each model can be asked for (issue 30), once per distinct set,
and how long its turn lasts (issue 43)."""

from __future__ import annotations

from arbiterd.cli.commands import render_status
from arbiterd.status import DaemonStatus


def test_status_names_each_models_capabilities_once_per_set() -> None:
    chat = ["completion", "chat", "tools"]
    status = DaemonStatus.from_json(
        {
            "models": [
                {"name": "story", "state": "cold", "capabilities": chat},
                {"name": "chat", "state": "warm", "capabilities": chat},
                {"name": "embed", "state": "cold", "capabilities": ["embedding"]},
                {"name": "new", "state": "starting"},
            ]
        }
    )
    lines = render_status(status).splitlines()
    assert "capabilities (story, chat): completion, chat, tools" in lines
    assert "capabilities (embed): embedding" in lines
    assert not [line for line in lines if line.startswith("capabilities") and "new" in line]


def test_status_says_each_models_turn_and_the_handoff_it_is_sized_from() -> None:
    turn = {"quantum_s": 0.9, "handoff_s": 0.1, "handoff_measured": True, "served": 3}
    status = DaemonStatus.from_json(
        {
            "models": [
                {"name": "chat", "state": "warm", "turn": turn},
                {"name": "new", "state": "cold", "turn": {"quantum_s": 2.7, "handoff_s": 0.3}},
                {"name": "old", "state": "cold"},  # a worker from before turns says none
            ]
        }
    )
    lines = render_status(status).splitlines()
    assert (
        "turn chat: 0.90 s while another waits, from a handoff of 0.10 s (measured);"
        " 3 served in its current or last turn"
    ) in lines
    assert "turn new: 2.70 s while another waits, from a handoff of 0.30 s (not measured yet:" in (
        " ".join(lines)
    )
    assert not [line for line in lines if line.startswith("turn old")]


def test_status_names_each_models_file() -> None:
    """Issue 47: where each model's GGUF is, to copy into a config of one's own."""
    status = DaemonStatus.from_json(
        {
            "models": [
                {"name": "coder", "state": "cold", "path": "/models/qwen-coder.gguf"},
                {"name": "old", "state": "cold"},  # a daemon from before said none
            ]
        }
    )
    lines = render_status(status).splitlines()
    assert "file (coder): /models/qwen-coder.gguf" in lines
    assert not [line for line in lines if line.startswith("file (old)")]
