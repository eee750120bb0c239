"""A model's card names what it can be asked for (issue 30), once its worker has told."""

from __future__ import annotations

import pytest
from pytestqt.qtbot import QtBot

from arbiterd.gui.dashboard import DashboardWindow
from arbiterd.gui.state import TrayState
from tests.gui.fakes import model, status

T = 1_718_000_000.0


@pytest.fixture
def dashboard(qtbot: QtBot) -> DashboardWindow:
    window = DashboardWindow()
    qtbot.addWidget(window)
    return window


def test_a_card_names_the_models_capabilities(dashboard: DashboardWindow) -> None:
    state = TrayState()
    state.apply_status(
        status(
            model("chat", capabilities=["completion", "chat", "tools"]),
            model("new"),
        ),
        T,
    )
    dashboard.refresh(state, T)
    cards = dashboard.cards
    assert "completion, chat, tools" in cards["chat"].queue.text().split(" · ")
    assert cards["new"].queue.text() == "queue: 0"


def test_a_card_shows_the_batch_a_warm_model_decodes(dashboard: DashboardWindow) -> None:
    # Issue 42: the requests decoding together, of how many, and their tokens per second.
    state = TrayState()
    state.apply_status(
        status(
            model("busy", "warm", queue=2, sequences=3, parallel=4, tokens_per_s=118.6),
            model("idle", "warm", parallel=4),
        ),
        T,
    )
    dashboard.refresh(state, T)
    cards = dashboard.cards
    assert cards["busy"].queue.text().split(" · ")[:3] == [
        "queue: 2",
        "decoding 3 of 4",
        "119 tok/s",
    ]
    assert "decoding" not in cards["idle"].queue.text()
