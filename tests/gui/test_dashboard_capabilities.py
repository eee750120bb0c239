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
