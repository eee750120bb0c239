"""The dashboard's cards and header for a given state: what the daemon said, or that it is gone."""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QTableWidget
from pytestqt.qtbot import QtBot

from arbiterd import render
from arbiterd.events import parse_event
from arbiterd.gui.dashboard import DashboardWindow
from arbiterd.gui.state import TrayState
from tests.gui.fakes import GiB, MiB, model, status

T = 1_718_000_000.0


def cell_text(table: QTableWidget, row: int, column: int) -> str:
    item = table.item(row, column)
    assert item is not None, (row, column)
    return item.text()


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
        assert card.vram.text() == "memory: unknown"  # neither engine nor device said
        assert card.host_ram.text() == "host RAM: unknown"
        assert card.error.text() == ""
        assert not card.warm.isEnabled()
    assert dashboard.details.text() == ""
    state.apply_status(status(model("alpha"), model("beta")), T + 2)  # it is back
    dashboard.refresh(state, T + 2)
    assert dashboard.cards["alpha"].state.text() == "state: cold"
    assert dashboard.cards["alpha"].warm.isEnabled()


def test_a_silent_holders_card_says_so_and_that_its_figures_are_stale(
    dashboard: DashboardWindow,
) -> None:
    state = TrayState()
    frozen = model("alpha", "warm", stale_s=4.2, silent_s=31.0)
    state.apply_status(status(frozen, model("beta"), holder="alpha"), T)
    dashboard.refresh(state, T)
    card = dashboard.cards["alpha"]
    assert card.state.text() == "state: warm · holds the GPU · stale: no answer for 4 s"
    assert card.error.text() == "⚠ alpha holds the GPU and has shown no sign of life for 31 s"
    assert dashboard.cards["beta"].state.text() == "state: cold"


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
    # An older daemon's total, without the budget (`host_ram`) issue 14 added.
    assert dashboard.memory.text() == "host RAM: 399.0 MiB"


def test_a_status_without_host_ram_leaves_it_out_of_the_header(dashboard: DashboardWindow) -> None:
    state = TrayState()
    raw = status(model("alpha", "warm"), holder="alpha")
    del raw["host_ram_bytes"]
    del raw["models"][0]["host_ram_bytes"]
    state.apply_status(raw, T)
    dashboard.refresh(state, T)
    assert "host RAM" not in dashboard.details.text()
    assert dashboard.memory.text() == ""
    assert not dashboard.memory.isVisibleTo(dashboard)
    assert dashboard.cards["alpha"].host_ram.text() == "host RAM: not reported"


# -- memory over a day (issue 14) and vision (issue 12) ------------------------------------------


def test_the_header_shows_host_ram_and_the_prompt_cache_against_their_budgets(
    dashboard: DashboardWindow,
) -> None:
    state = TrayState()
    state.apply_status(
        status(
            model("a", "warm"),
            holder="a",
            host_ram_bytes=5 * GiB,
            host_ram={"host_copies_bytes": 4 * GiB, "host_kv_bytes": GiB, "budget_bytes": 8 * GiB},
            prompt_cache={"bytes": 12 * MiB, "files": 2, "budget_bytes": 4 * GiB},
        ),
        T,
    )
    dashboard.refresh(state, T)
    assert dashboard.memory.text() == (
        "host RAM: 5.0 GiB of 8.0 GiB budget   ·   "
        "prompt cache on disk: 12.0 MiB in 2 files of 4.0 GiB budget"
    )
    assert dashboard.memory.isVisibleTo(dashboard)
    assert dashboard.memory.toolTip() == (
        "model file copies 4.0 GiB (each counted once) + KV caches kept on the host 1.0 GiB + "
        "weights' own copies 0 B"
    )


def test_an_unloaded_models_card_is_dimmed_and_holds_nothing(dashboard: DashboardWindow) -> None:
    state = TrayState()
    state.apply_status(status(model("a", "unloaded"), model("b", "cold", host_ram_bytes=GiB)), T)
    state.apply_event(
        parse_event(
            {
                "event": "unload",
                "at": T - 5,
                "model": "a",
                "reason": "idle",
                "kv_bytes": 12 * MiB,
                "tokens": 1310,
            }
        )
    )
    dashboard.refresh(state, T)
    a, b = dashboard.cards["a"], dashboard.cards["b"]
    assert a.state.text() == "state: unloaded — prompt cache on disk (1310 tokens, 12.0 MiB)"
    assert (a.vram.text(), a.host_ram.text()) == ("memory: none", "host RAM: none")
    assert a.dimmed
    assert not a.release.isEnabled()  # no worker: nothing to release
    assert a.warm.isEnabled()  # warm starts it
    # Cold is not unloaded: its worker and host copy are there.
    assert (b.state.text(), b.host_ram.text(), b.dimmed) == (
        "state: cold",
        "host RAM: 1.0 GiB",
        False,
    )
    state.apply_status(
        status(model("a", "warm", resident_bytes=GiB), model("b"), holder="a"), T + 9
    )
    dashboard.refresh(state, T + 9)
    assert (a.state.text(), a.vram.text(), a.dimmed) == (
        "state: warm · holds the GPU",
        "memory: 1.0 GiB",
        False,
    )
    assert a.release.isEnabled()


def test_group_members_hold_the_gpu_together_on_their_cards(dashboard: DashboardWindow) -> None:
    state = TrayState()
    rag = {"name": "rag", "models": ["qwen", "nomic"], "holds_token": True, "failure": ""}
    state.apply_status(
        status(
            model("qwen", "warm", resident_bytes=4 * GiB),
            model("nomic", "warm", resident_bytes=GiB),
            model("eye"),
            holder="group rag",
            groups=[rag],
        ),
        T,
    )
    dashboard.refresh(state, T)
    assert dashboard.headline.text() == "GPU: group rag — qwen, nomic"
    cards = dashboard.cards
    assert cards["qwen"].state.text() == "state: warm · holds the GPU with nomic (group rag)"
    assert cards["nomic"].state.text() == "state: warm · holds the GPU with qwen (group rag)"
    assert cards["eye"].state.text() == "state: cold"
    assert "group rag" in cards["qwen"].queue.text().split(" · ")
    assert "group" not in cards["eye"].queue.text()


def test_a_vision_models_card_and_the_table_show_its_projector(dashboard: DashboardWindow) -> None:
    state = TrayState()
    state.apply_status(status(model("eye", "warm"), model("text")), T)
    state.apply_event(
        parse_event(
            {
                "event": "handoff",
                "at": T + 1,
                "from": "text",
                "to": "eye",
                "release_s": 0.2,
                "wait_s": 0.0,
                "restore_s": 0.5,
            }
        )
    )
    steps = [("load", 0.0023, 155 * 1024, None), ("encode", 0.0004, 1024, 1),
             ("free", 0.0001, 155 * 1024, None)]  # fmt: skip
    for index, (action, took, size, images) in enumerate(steps):
        state.apply_event(
            parse_event(
                {
                    "event": "encoder",
                    "at": T + 2 + index / 100,
                    "model": "eye",
                    "id": "r1",
                    "action": action,
                    "duration_s": took,
                    "bytes": size,
                    "images": images,
                }
            )
        )
    dashboard.refresh(state, T + 3)
    card = dashboard.cards["eye"]
    assert card.encoder.isVisibleTo(card)
    assert card.encoder.text() == (
        "projector loaded in 2.3 ms, encoded 1 image in 0.4 ms, freed in 0.1 ms"
        f" (at {render.clock(T + 2)})"
    )
    assert card.encoder.toolTip().splitlines()[0] == "eye: projector loaded in 2.3 ms (155.0 KiB)"
    assert not dashboard.cards["text"].encoder.isVisibleTo(dashboard.cards["text"])
    table = dashboard.table
    assert table.rowCount() == 2
    row = [cell_text(table, 0, column) for column in range(table.columnCount())]
    assert row == [
        render.clock(T + 2),
        "eye: projector loaded, encoded 1 image, freed",
        "—",
        "—",
        "—",
        "2.8 ms",
        "155.0 KiB",
        "—",
    ]
    assert cell_text(table, 1, 1) == "text → eye"  # the handoff before it, below: newest first


def test_the_table_keeps_and_marks_the_handoffs_of_a_model_not_served_now(
    dashboard: DashboardWindow,
) -> None:
    state = TrayState()
    state.apply_status(status(model("alpha", "warm", resident_bytes=GiB), holder="alpha"), T)
    for event in (
        {"event": "handoff", "at": T - 50, "from": "alpha", "to": "theirs", "release_s": 0.1},
        {"event": "handoff", "at": T - 40, "from": "theirs", "to": "alpha", "release_s": 0.1},
        {"event": "wait", "at": T - 30, "model": "alpha", "wait_s": 1.0},
    ):
        state.apply_event(parse_event(event))
    dashboard.refresh(state, T)
    titles = [cell_text(dashboard.table, row, 1) for row in range(dashboard.table.rowCount())]
    assert titles[1:] == [
        "theirs → alpha (theirs not served now)",
        "alpha → theirs (theirs not served now)",
    ]
    assert "not served" not in titles[0]  # a wait of alpha's: served
    assert list(dashboard.cards) == ["alpha"]


def test_the_holders_card_shows_its_turn(dashboard: DashboardWindow) -> None:
    # Issue 43: how long the holder keeps the GPU for its queue while another waits, and what
    # its turn has served; a model that does not hold the GPU shows no turn.
    turn = {"quantum_s": 0.5, "handoff_s": 0.06, "handoff_measured": True, "served": 3}
    state = TrayState()
    state.apply_status(
        status(model("alpha", "warm", turn=turn), model("beta", turn=turn), holder="alpha"), T
    )
    dashboard.refresh(state, T)
    assert dashboard.cards["alpha"].state.text() == (
        "state: warm · holds the GPU · turn 0.50 s, 3 served"
    )
    assert dashboard.cards["beta"].state.text() == "state: cold"
