"""`arbiterd status` names what each model can be asked for (issue 30), once per distinct set."""

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
