"""The dashboard's cards and header for a given state: what the daemon said, or that it is gone."""

from __future__ import annotations

import pytest
from pytestqt.qtbot import QtBot

from arbiterd.gui.dashboard import DashboardWindow
from arbiterd.gui.state import TrayState
from tests.gui.fakes import GiB, MiB, model, status

T = 1_718_000_000.0


@pytest.fixture
def dashboard(qtbot: QtBot) -> DashboardWindow:
    window = DashboardWindow()
    qtbot.addWidget(window)
    return window


def test_an_unreachable_daemon_leaves_its_models_unknown(dashboard: DashboardWindow) -> None:
    state = TrayState()
    alpha = model("alpha", "warm", resident_bytes=3 * GiB, last_error="worker exited")
    state.apply_status(status(alpha, model("beta"), holder="alpha"), T)
    dashboard.refresh(state, T)
    assert dashboard.cards["alpha"].state.text() == "state: warm · holds the GPU"
    state.set_unreachable("arbiterd is not running")
    dashboard.refresh(state, T + 1)
    assert dashboard.unreachable.text() == "daemon not running — arbiterd is not running"
    for card in dashboard.cards.values():
        assert card.state.text() == "state: unknown"
        assert card.vram.text() == "VRAM: unknown"
        assert card.host_ram.text() == "host RAM: unknown"
        assert card.error.text() == ""
        assert not card.warm.isEnabled()
    assert dashboard.details.text() == ""
    state.apply_status(status(model("alpha"), model("beta")), T + 2)  # it is back
    dashboard.refresh(state, T + 2)
    assert dashboard.cards["alpha"].state.text() == "state: cold"
    assert dashboard.cards["alpha"].warm.isEnabled()


def test_each_card_shows_its_host_ram_and_the_header_the_total(dashboard: DashboardWindow) -> None:
    state = TrayState()
    state.apply_status(
        status(
            model("alpha", "warm", resident_bytes=GiB, host_ram_bytes=277 * MiB),
            model("beta", host_ram_bytes=122 * MiB),
            model("gamma"),  # a daemon that cannot tell (or an older one)
            holder="alpha",
            host_ram_bytes=399 * MiB,
        ),
        T,
    )
    dashboard.refresh(state, T)
    assert dashboard.cards["alpha"].host_ram.text() == "host RAM: 277.0 MiB"
    assert dashboard.cards["beta"].host_ram.text() == "host RAM: 122.0 MiB"
    assert dashboard.cards["gamma"].host_ram.text() == "host RAM: not reported"
    assert "host RAM: 399.0 MiB" in dashboard.details.text().split("   ·   ")


def test_a_status_without_host_ram_leaves_it_out_of_the_header(dashboard: DashboardWindow) -> None:
    state = TrayState()
    raw = status(model("alpha", "warm"), holder="alpha")
    del raw["host_ram_bytes"]
    del raw["models"][0]["host_ram_bytes"]
    state.apply_status(raw, T)
    dashboard.refresh(state, T)
    assert "host RAM" not in dashboard.details.text()
    assert dashboard.cards["alpha"].host_ram.text() == "host RAM: not reported"
