"""The pictures: the tray icon's pixels, and the timeline's bands and handoff markers."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from PySide6.QtGui import QImage
from pytestqt.qtbot import QtBot

from arbiterd.events import parse_event
from arbiterd.gui import palette
from arbiterd.gui.icon import fill_rect, frame_width, make_icon, render_icon
from arbiterd.gui.palette import RGB
from arbiterd.gui.state import IconLook, TrayState
from arbiterd.gui.timeline import MARKER_HEIGHT, MIN_SPAN_S, TimelineWidget
from tests.gui.fakes import GiB, MiB, model, status

T = 1_718_000_000.0
SIZE = 64


def rgb(image: QImage, x: float, y: float) -> RGB:
    colour = image.pixelColor(int(x), int(y))
    return (colour.red(), colour.green(), colour.blue())


def frame_pixel(image: QImage) -> RGB:
    return rgb(image, frame_width(SIZE) / 2, SIZE / 2)


def look_for(raw_status: dict[str, Any] | None, *, event: dict[str, Any] | None = None) -> IconLook:
    state = TrayState()
    if raw_status is not None:
        state.apply_status(raw_status, T)
    if event is not None:
        state.apply_event(parse_event(event))
    return state.icon_look(T + 1)


# -- the icon --------------------------------------------------------------------------------------


def test_the_icon_is_drawn_in_the_holders_colour(qtbot: QtBot) -> None:
    look = look_for(
        status(
            model("alpha", "warm", resident_bytes=4 * GiB),
            holder="alpha",
            devices=[{"device": "gpu0", "used_bytes": 4 * GiB, "total_bytes": 8 * GiB}],
        )
    )
    image = render_icon(look, SIZE)
    colour = palette.model_colours(["alpha"]).of("alpha")
    assert frame_pixel(image) == colour
    half = fill_rect(SIZE, 0.5)
    assert rgb(image, SIZE / 2, half.bottom() - 2) == colour  # inside the fill
    assert rgb(image, SIZE / 2, half.top() - 3) == palette.PANEL  # above it: 4 of 8 GiB


def test_the_fill_follows_the_vram_in_use(qtbot: QtBot) -> None:
    def filled_rows(used_bytes: int) -> int:
        look = look_for(
            status(
                model("alpha", "warm", resident_bytes=used_bytes),
                holder="alpha",
                devices=[{"device": "gpu0", "used_bytes": used_bytes, "total_bytes": 8 * GiB}],
            )
        )
        image = render_icon(look, SIZE)
        return sum(
            rgb(image, SIZE / 2, y) == palette.model_colours(["alpha"]).of("alpha")
            for y in range(int(frame_width(SIZE)) + 1, SIZE - int(frame_width(SIZE)) - 1)
        )

    assert filled_rows(1 * GiB) < filled_rows(4 * GiB) < filled_rows(8 * GiB)


def test_another_program_holding_the_gpu_is_grey(qtbot: QtBot) -> None:
    image = render_icon(look_for(status(model("alpha"), holder="steam")), SIZE)
    assert frame_pixel(image) == palette.OTHER


def test_a_warning_turns_the_frame_amber(qtbot: QtBot) -> None:
    look = look_for(
        status(model("alpha", "warm", resident_bytes=GiB), holder="alpha"),
        event={"event": "vram_not_freed", "at": T, "model": "beta", "bytes_after": GiB},
    )
    image = render_icon(look, SIZE)
    assert frame_pixel(image) == palette.AMBER
    # The fill still says who holds the GPU.
    fill = rgb(image, SIZE / 2, fill_rect(SIZE, look.fill).bottom() - 2)
    assert fill == palette.model_colours(["alpha"]).of("alpha")


def test_an_unreachable_daemon_is_red(qtbot: QtBot) -> None:
    image = render_icon(look_for(None), SIZE)
    assert frame_pixel(image) == palette.RED
    assert rgb(image, SIZE / 2, SIZE / 2) == palette.RED  # the cross


@pytest.mark.parametrize("size", [16, 22, 32, 128])
def test_every_tray_size_is_drawn_for_its_size(qtbot: QtBot, size: int) -> None:
    icon = make_icon(look_for(None))
    pixmap = icon.pixmap(size, size)
    assert pixmap.width() == size
    assert rgb(pixmap.toImage(), frame_width(size) / 2, size / 2) == palette.RED


# -- the timeline ----------------------------------------------------------------------------------


@pytest.fixture
def timeline(qtbot: QtBot) -> TimelineWidget:
    """Ten minutes: alpha holds 2 GiB, hands off to beta (3 GiB) half way; 1 GiB of others."""
    state = TrayState(window_s=600)
    state.apply_status(
        status(model("alpha", "warm", resident_bytes=2 * GiB), model("beta"), holder="alpha"), T
    )
    state.apply_event(
        parse_event(
            {"event": "residency", "at": T + 299, "model": "alpha", "from": "cooling", "to": "cold"}
        )
    )
    state.apply_event(
        parse_event(
            {"event": "handoff", "at": T + 300, "from": "alpha", "to": "beta", "release_s": 0.5}
        )
    )
    state.apply_status(
        status(
            model("alpha"),
            model("beta", "warm", resident_bytes=3 * GiB),
            holder="beta",
            others=[{"name": "firefox", "pid": 5, "used_bytes": GiB, "device": "gpu0"}],
        ),
        T + 300,
    )
    widget = TimelineWidget()
    qtbot.addWidget(widget)
    widget.resize(700, 320)
    widget.set_state(state, T + 600)
    return widget


def test_the_timeline_marks_each_handoff(timeline: TimelineWidget) -> None:
    plot = timeline.plot_rect()
    ((x, record),) = timeline.marker_positions()
    assert (record.from_model, record.to_model) == ("alpha", "beta")
    assert x == pytest.approx(plot.left() + plot.width() / 2)
    image = timeline.grab().toImage()
    # The marker above the plot is in the colour of the model that took the GPU.
    beta = palette.model_colours(["alpha", "beta"]).of("beta")
    assert rgb(image, x, plot.top() - MARKER_HEIGHT / 2) == beta
    assert rgb(image, x + 40, plot.top() - MARKER_HEIGHT / 2) == palette.PANEL


def test_the_timeline_stacks_each_owner_in_its_colour(timeline: TimelineWidget) -> None:
    image = timeline.grab().toImage()
    colours = palette.model_colours(["alpha", "beta"])
    y_of = timeline.y_of
    before, after = timeline.x_of(T + 150), timeline.x_of(T + 450)
    assert rgb(image, before, y_of(1 * GiB)) == colours.of("alpha")
    assert rgb(image, before, y_of(2.5 * GiB)) == palette.PANEL  # nothing above alpha's 2 GiB
    assert rgb(image, after, y_of(1.5 * GiB)) == colours.of("beta")
    assert rgb(image, after, y_of(3.5 * GiB)) == palette.OTHER  # firefox, stacked on beta


def test_an_empty_timeline_says_so(qtbot: QtBot) -> None:
    widget = TimelineWidget()
    qtbot.addWidget(widget)
    widget.resize(500, 240)
    widget.set_state(TrayState(), T)
    assert widget.marker_positions() == []
    assert not widget.grab().isNull()


def test_a_short_history_is_drawn_over_its_own_span(qtbot: QtBot) -> None:
    """A demo's burst of handoffs in its first seconds fills the plot, not its last pixels."""
    state = TrayState(window_s=600)
    state.apply_status(status(model("alpha", "warm", resident_bytes=GiB), holder="alpha"), T)
    state.apply_event(parse_event({"event": "handoff", "at": T + 5, "from": "alpha", "to": "beta"}))
    widget = TimelineWidget()
    qtbot.addWidget(widget)
    widget.resize(700, 320)
    widget.set_state(state, T + 10)
    assert widget.span_s == MIN_SPAN_S  # 10 s of history, drawn over at least 20
    plot = widget.plot_rect()
    ((x, _),) = widget.marker_positions()
    assert x == pytest.approx(plot.left() + plot.width() * 15 / 20)
    widget.set_state(state, T + 100)
    assert widget.span_s == pytest.approx(105.0)  # its own 100 s, and a little room
    widget.set_state(state, T + 900)  # later, the full window again
    assert widget.span_s == 600.0


def timeline_of(qtbot: QtBot, state: TrayState, now: float) -> TimelineWidget:
    widget = TimelineWidget()
    qtbot.addWidget(widget)
    widget.resize(700, 320)
    widget.set_state(state, now)
    return widget


def device(total_bytes: int, used_bytes: int) -> list[dict[str, Any]]:
    return [{"device": "gpu0", "used_bytes": used_bytes, "total_bytes": total_bytes}]


def test_a_small_model_on_a_big_device_is_a_band_not_a_line(qtbot: QtBot) -> None:
    """The issue's case: 235 MiB on a 23.5 GiB axis was 2 pixels high."""
    size, total = 235 * MiB, int(23.5 * GiB)
    state = TrayState()
    raw = status(
        model("tiny", "warm", resident_bytes=size), holder="tiny", devices=device(total, size)
    )
    state.apply_status(raw, T)
    widget = timeline_of(qtbot, state, T + 60)
    plot = widget.plot_rect()
    band = plot.bottom() - widget.y_of(size)
    assert band >= 0.6 * plot.height()
    image = widget.grab().toImage()
    assert rgb(image, widget.x_of(T + 30), plot.bottom() - band / 2) == state.colours().of("tiny")
    # The device's total is still said, as off the scale.
    assert widget.axis().device_note() == "device total 23.5 GiB ↑ off scale"


def test_a_model_of_half_the_device_or_more_is_drawn_on_the_whole_device(qtbot: QtBot) -> None:
    size, total = 14 * GiB, 24 * GiB
    state = TrayState()
    raw = status(
        model("big", "warm", resident_bytes=size), holder="big", devices=device(total, size)
    )
    state.apply_status(raw, T)
    widget = timeline_of(qtbot, state, T + 60)
    axis = widget.axis()
    assert axis.top_bytes == total
    assert axis.device_note() == "device total 24.0 GiB"
    plot = widget.plot_rect()
    assert plot.bottom() - widget.y_of(size) == pytest.approx(plot.height() * 14 / 24)


def test_handoff_labels_never_overlap(qtbot: QtBot) -> None:
    """A demo's burst: a handoff every 0.6 s, each label wider than the gap between markers,
    and the user's hold right after them."""
    state = TrayState()
    state.apply_status(status(model("alpha", "warm", resident_bytes=GiB), holder="alpha"), T)
    for k in range(12):
        source, target = ("alpha", "beta") if k % 2 == 0 else ("beta", "alpha")
        handoff = {"event": "handoff", "at": T + 5 + 0.6 * k, "from": source, "to": target,
                   "release_s": 0.1, "restore_s": 0.2}  # fmt: skip
        state.apply_event(parse_event(handoff))
    state.apply_event(parse_event({"event": "hold", "at": T + 13, "held": True}))
    widget = timeline_of(qtbot, state, T + 20)
    labels = widget.label_rects()
    assert len(labels) >= 3  # stacked in rows, not all but one left out
    rects = [rect for rect, _ in labels]
    for a, b in itertools.combinations(rects, 2):
        assert not a.intersects(b), (a, b)
    plot = widget.plot_rect()
    for rect in rects:
        assert plot.contains(rect), rect
        assert not any(rect.intersects(strip) for strip in widget.hold_strips())


def test_the_legend_lists_the_models_of_the_daemon_it_is_connected_to(qtbot: QtBot) -> None:
    state = TrayState()
    # A shared journal: another daemon's model, warm and cold again before the window.
    for at, source, target in ((T - 3000, "warming", "warm"), (T - 2900, "cooling", "cold")):
        residency = {"event": "residency", "at": at, "model": "theirs", "from": source,
                     "to": target, "weights_bytes": GiB}  # fmt: skip
        state.apply_event(parse_event(residency))
    state.apply_status(
        status(model("alpha", "warm", resident_bytes=GiB), model("beta"), holder="alpha"), T
    )
    widget = timeline_of(qtbot, state, T + 60)
    assert [name for name, _ in widget.legend_entries()] == ["alpha", "beta", "other processes"]
    # Each in the colour its bands and cards have.
    assert dict(widget.legend_entries())["alpha"] == state.colours().of("alpha")


def test_a_model_a_reload_removed_is_no_longer_drawn(qtbot: QtBot) -> None:
    """The chart draws what `arbiterd status` lists (issue 30): a removed model has no band."""
    state = TrayState()
    state.apply_status(status(model("old", "warm", resident_bytes=GiB), holder="old"), T)
    state.apply_status(status(model("new", "warm", resident_bytes=GiB), holder="new"), T + 30)
    widget = timeline_of(qtbot, state, T + 60)
    assert [name for name, _ in widget.legend_entries()] == ["new", "other processes"]
    assert not colour_in_plot(widget, state.colours().of("old"))
    assert colour_in_plot(widget, state.colours().of("new"))


def colour_in_plot(widget: TimelineWidget, colour: RGB) -> bool:
    image = widget.grab().toImage()
    plot = widget.plot_rect()
    return any(
        rgb(image, x, y) == colour
        for x in range(int(plot.left()) + 1, int(plot.right()), 3)
        for y in range(int(plot.top()) + 1, int(plot.bottom()), 3)
    )


def test_a_stopped_daemons_model_from_a_shared_journal_is_not_drawn(qtbot: QtBot) -> None:
    """The tray asks for the journal after the first status: a model of a daemon that stopped
    (same journal) went warm in the window and was never cold again. Before issue 30 its band
    ran on to now and the axis made room for it, though `status` does not list it."""
    state = TrayState()
    state.apply_status(status(model("alpha", "warm", resident_bytes=GiB), holder="alpha"), T)
    for event in (
        {"event": "residency", "at": T - 50, "model": "theirs", "from": "warming", "to": "warm",
         "weights_bytes": 6 * GiB},
        {"event": "handoff", "at": T - 50, "from": "alpha", "to": "theirs", "release_s": 0.1,
         "restore_s": 0.2},
    ):  # fmt: skip
        state.apply_event(parse_event(event))
    widget = timeline_of(qtbot, state, T + 30)
    assert state.drawn_models() == ["alpha"]
    assert [name for name, _ in widget.legend_entries()] == ["alpha", "other processes"]
    assert widget.axis().top_bytes < 6 * GiB  # scaled to what is drawn
    assert not colour_in_plot(widget, state.colours().of("theirs"))
    assert colour_in_plot(widget, state.colours().of("alpha"))
