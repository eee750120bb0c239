"""`arbiterd status` says where a model runs when it is not the one-GPU default (issue 27)."""

from __future__ import annotations

from arbiterd.cli.commands import render_status
from arbiterd.status import DaemonStatus


def test_status_names_the_devices_of_a_model_off_gpu0_and_nothing_on_gpu0() -> None:
    split = ["rpc:127.0.0.1:50052", "rpc:127.0.0.1:50053"]
    status = DaemonStatus.from_json(
        {
            "models": [
                {"name": "story", "state": "warm", "devices": split},
                {"name": "chat", "state": "cold", "devices": ["gpu0"]},
            ]
        }
    )
    story, chat = render_status(status).splitlines()[1:3]
    assert story.endswith("on rpc:127.0.0.1:50052 + rpc:127.0.0.1:50053")
    assert "on " not in chat
