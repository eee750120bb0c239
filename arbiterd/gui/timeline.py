"""The dashboard's timeline: VRAM by owner over the last minutes, stacked, with handoff markers
(RAM, so named, where the engine runs the models on the CPU).

    legend   ■ alpha  ■ beta  ■ other processes                 device total 23.5 GiB ↑ off scale
    markers        ▼            ▼                  one per handoff (or wait behind another
                                                   program), in the new holder's colour
    labels         → beta 0.42 s                   in up to LABEL_ROWS rows, never overlapping
    plot     ░░░░░░│▒▒▒▒▒▒▒▒▒▒▒▒│░░░░░░            a band for each of the daemon's models (in its
             ░░░░░░│▒▒▒▒▒▒▒▒▒▒▒▒│░░░░░░            order; no other daemon's), other processes grey
                                                   on top; a shaded
    axis     12:00      12:02       12:04   now    strip for each handoff's duration

The VRAM axis (`vram_axis`) reaches a little over the peak in view, so a 235 MiB model next to a
24 GiB GPU is a band, not a line; once the peak is half the device or more the axis is the whole
device and its total is a line at the top. Either way the legend says the device's total.

Owns the drawing and its geometry (`x_of`, `y_of`, `plot_rect`, `marker_positions`,
`label_rects`, `legend_entries`), which the tests read too; takes its data from a `TrayState` and
a time, never from a clock of its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import (
    QBrush,
    QFont,
    QFontMetricsF,
    QPainter,
    QPaintEvent,
    QPen,
    QPolygonF,
)
from PySide6.QtWidgets import QWidget

from arbiterd import render
from arbiterd.gui import palette
from arbiterd.gui.history import HandoffRecord, History, Sample
from arbiterd.gui.icon import qcolor
from arbiterd.gui.palette import RGB
from arbiterd.gui.state import TrayState

MARGIN_LEFT = 70
MARGIN_RIGHT = 16
MARGIN_TOP = 40
MARGIN_BOTTOM = 24
MARKER_HEIGHT = 10
# A history shorter than the window (a fresh daemon, a demo) is drawn over its own span, but
# never less than this, so a burst of handoffs is not squeezed into the last few pixels.
MIN_SPAN_S = 20.0
OTHERS_LABEL = "other processes"
LABEL_GAP_PX = 8  # the least space between two handoff labels side by side
LABEL_ROWS = 3  # handoff labels stack in this many rows at the plot's top; more are left out
# The VRAM axis: the peak in view sits under HEADROOM of the axis; from WHOLE_DEVICE_FRACTION of
# the device up the axis is the whole device; never less than MIN_AXIS_BYTES.
HEADROOM = 1.15
WHOLE_DEVICE_FRACTION = 0.5
MIN_AXIS_BYTES = 64 << 20
BYTE_STEPS = tuple(float(1 << k) for k in range(20, 41))  # grid lines: 1 MiB .. 1 TiB apart
MOST_BYTE_STEPS = 5


def _tick_step(span: float, steps: tuple[float, ...], most: int) -> float:
    """The smallest of `steps` that gives at most `most` ticks over `span`."""
    for step in steps:
        if span / step <= most:
            return step
    return steps[-1] * math.ceil(span / (steps[-1] * most))


@dataclass(frozen=True)
class Axis:
    """The VRAM axis: 0 at the plot's bottom, `top_bytes` at its top, a grid line every
    `step_bytes`; `device_bytes` is the devices' memory (None until telemetry reports it)."""

    top_bytes: float
    step_bytes: float
    device_bytes: int | None

    @property
    def device_in_view(self) -> bool:
        return self.device_bytes is not None and self.device_bytes <= self.top_bytes

    def device_note(self) -> str | None:
        """What the legend says of the device, or None when its total is not known."""
        if self.device_bytes is None:
            return None
        total = f"device total {render.format_bytes(self.device_bytes)}"
        return total if self.device_in_view else f"{total} ↑ off scale"


def vram_axis(peak_bytes: int, device_bytes: int | None) -> Axis:
    """The axis for a view whose owners add up to `peak_bytes` at most: the whole device once
    the peak is WHOLE_DEVICE_FRACTION of it, else the peak and some headroom, up to a grid line
    (models much smaller than the device would be a line of pixels on a whole-device axis)."""
    if device_bytes and peak_bytes >= device_bytes * WHOLE_DEVICE_FRACTION:
        return Axis(
            device_bytes, _tick_step(device_bytes, BYTE_STEPS, MOST_BYTE_STEPS), device_bytes
        )
    wanted = max(peak_bytes * HEADROOM, MIN_AXIS_BYTES)
    step = _tick_step(wanted, BYTE_STEPS, MOST_BYTE_STEPS)
    return Axis(step * math.ceil(wanted / step), step, device_bytes)


def state_memory(state: TrayState | None) -> str:
    """What the plotted bytes are: "VRAM" only of a GPU's memory (TrayState.memory_name)."""
    return "memory" if state is None else state.memory_name()


def y_on(axis: Axis, plot: QRectF, bytes_: float) -> float:
    """Where `bytes_` lies on `plot`'s height; past the axis's top, at the top."""
    return plot.bottom() - min(1.0, bytes_ / axis.top_bytes) * plot.height()


def _spots(x: float, width: float, bounds: QRectF, row_height: float) -> Iterator[QRectF]:
    """Where a label of `width` for the marker at `x` may go, best first: right of the marker,
    else left of it, in the top row of `bounds`, else the next one down."""
    for row in range(max(1, int(bounds.height() // row_height))):
        top = bounds.top() + row * row_height
        for left in (x + 4, x - 4 - width):
            if bounds.left() <= left and left + width <= bounds.right():
                yield QRectF(left, top, width, row_height)


def place_labels(
    wanted: Sequence[tuple[float, float]],
    bounds: QRectF,
    row_height: float,
    taken: Sequence[QRectF],
) -> list[QRectF | None]:
    """Where each label goes, in order, given (x of its marker, its width): the first of its
    spots that keeps LABEL_GAP_PX from every label placed before it and from all of `taken`;
    None where none does (it is left out: the table under the timeline lists every handoff)."""
    placed: list[QRectF] = []
    spots: list[QRectF | None] = []
    for x, width in wanted:
        spot = next(
            (
                rect
                for rect in _spots(x, width, bounds, row_height)
                if not any(
                    rect.adjusted(-LABEL_GAP_PX, 0, LABEL_GAP_PX, 0).intersects(other)
                    for other in [*placed, *taken]
                )
            ),
            None,
        )
        spots.append(spot)
        if spot is not None:
            placed.append(spot)
    return spots


class TimelineWidget(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._state: TrayState | None = None
        self._now = 0.0
        self.setMinimumSize(480, 200)

    def sizeHint(self) -> QSize:
        return QSize(900, 300)

    def set_state(self, state: TrayState, now: float) -> None:
        self._state = state
        self._now = now
        self.update()

    @property
    def _history(self) -> History | None:
        return self._state.history if self._state is not None else None

    # -- geometry ------------------------------------------------------------------------------

    @property
    def window_s(self) -> float:
        return self._history.window_s if self._history is not None else 600.0

    @property
    def span_s(self) -> float:
        """The seconds drawn, up to now: the window, or the history's own span when shorter."""
        history = self._history
        earliest = history.earliest(self._now) if history is not None else None
        if earliest is None:
            return self.window_s
        return min(self.window_s, max(MIN_SPAN_S, (self._now - earliest) * 1.05))

    def plot_rect(self) -> QRectF:
        return QRectF(
            MARGIN_LEFT,
            MARGIN_TOP,
            max(1.0, self.width() - MARGIN_LEFT - MARGIN_RIGHT),
            max(1.0, self.height() - MARGIN_TOP - MARGIN_BOTTOM),
        )

    def x_of(self, at: float) -> float:
        plot = self.plot_rect()
        span = self.span_s
        fraction = (at - (self._now - span)) / span
        return plot.left() + max(0.0, min(1.0, fraction)) * plot.width()

    def axis(self) -> Axis:
        state, history = self._state, self._history
        if state is None or history is None:
            return vram_axis(0, None)
        peak = history.peak_bytes(self._now, set(state.drawn_models()))
        return vram_axis(peak, history.total_bytes)

    def y_of(self, bytes_: float) -> float:
        return y_on(self.axis(), self.plot_rect(), bytes_)

    def text_font(self) -> QFont:
        font = QFont(self.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.9))
        return font

    def marker_positions(self) -> list[tuple[float, HandoffRecord]]:
        """Where each handoff in the window is marked: (x, record)."""
        if self._history is None:
            return []
        return [(self.x_of(h.at), h) for h in self._history.handoffs_in_window(self._now)]

    def hold_strips(self) -> list[QRectF]:
        """The strip across the plot's top for each time the user held the GPU."""
        history = self._history
        if history is None:
            return []
        plot = self.plot_rect()
        height = self._row_height()
        strips = []
        for span in history.holds_in_window(self._now):
            x0 = self.x_of(span.start)
            x1 = self.x_of(self._now if span.end is None else span.end)
            strips.append(QRectF(x0, plot.top() + 1, max(2.0, x1 - x0), height))
        return strips

    def label_rects(self) -> list[tuple[QRectF, HandoffRecord]]:
        """Where each handoff's label is drawn (those with no room left out): (rect, record)."""
        metrics = QFontMetricsF(self.text_font())
        markers = self.marker_positions()
        plot = self.plot_rect()
        row_height = self._row_height()
        bounds = QRectF(plot.left() + 2, plot.top() + 1, plot.width() - 4, row_height * LABEL_ROWS)
        wanted = [(x, metrics.horizontalAdvance(record.label)) for x, record in markers]
        spots = place_labels(wanted, bounds, row_height, self.hold_strips())
        return [
            (spot, record)
            for spot, (_x, record) in zip(spots, markers, strict=True)
            if spot is not None
        ]

    def legend_entries(self) -> list[tuple[str, RGB]]:
        """The models drawn (TrayState.drawn_models: the daemon's, as its status lists them),
        then other processes. A model the daemon does not have (another daemon's, read from a
        journal both wrote, or one a reload removed) has no band, so no entry."""
        state = self._state
        if state is None:
            return []
        colours = state.colours()
        names = state.drawn_models()
        return [*((name, colours.of(name)) for name in names), (OTHERS_LABEL, palette.OTHER)]

    def _row_height(self) -> float:
        return QFontMetricsF(self.text_font()).height() + 4

    # -- drawing -------------------------------------------------------------------------------

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        try:
            self._paint(painter)
        finally:
            painter.end()

    def _paint(self, painter: QPainter) -> None:
        painter.fillRect(self.rect(), qcolor(palette.PANEL))
        plot = self.plot_rect()
        painter.setFont(self.text_font())
        axis = self.axis()
        self._paint_grid(painter, plot, axis)
        state, history = self._state, self._history
        samples = history.visible(self._now) if history is not None else []
        if state is None or history is None or not samples:
            painter.setPen(qcolor(palette.TEXT))
            painter.drawText(
                plot, Qt.AlignmentFlag.AlignCenter, f"no {state_memory(state)} figures yet"
            )
            return
        self._paint_bands(painter, plot, axis, state, samples)
        self._paint_device(painter, plot, axis)
        self._paint_holds(painter)
        self._paint_handoffs(painter, plot, state)
        self._paint_legend(painter, plot, axis)

    def _paint_grid(self, painter: QPainter, plot: QRectF, axis: Axis) -> None:
        metrics = QFontMetricsF(painter.font())
        value = 0.0
        while value <= axis.top_bytes + 1:
            y = y_on(axis, plot, value)
            painter.setPen(QPen(qcolor(palette.GRID), 1))
            painter.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
            if not axis.device_in_view or abs(y - plot.top()) >= metrics.height():
                self._axis_label(painter, y, render.format_bytes(value))
            value += axis.step_bytes
        window = self.span_s
        tick_s = _tick_step(window, (5, 10, 30, 60, 120, 300, 600, 1800, 3600), 6)
        first = math.ceil((self._now - window) / tick_s) * tick_s
        tick = first
        while tick <= self._now:
            x = self.x_of(tick)
            painter.setPen(QPen(qcolor(palette.GRID), 1, Qt.PenStyle.DotLine))
            painter.drawLine(QPointF(x, plot.top()), QPointF(x, plot.bottom()))
            painter.setPen(qcolor(palette.TEXT))
            text = time.strftime("%H:%M:%S" if tick_s < 60 else "%H:%M", time.localtime(tick))
            width = metrics.horizontalAdvance(text)
            left = min(x - width / 2, self.width() - width - 2)  # the last one stays whole
            painter.drawText(QPointF(left, plot.bottom() + metrics.ascent() + 4), text)
            tick += tick_s
        painter.setPen(QPen(qcolor(palette.GRID), 1))
        painter.drawRect(plot)

    def _axis_label(self, painter: QPainter, y: float, text: str) -> None:
        height = QFontMetricsF(painter.font()).height()
        painter.setPen(qcolor(palette.TEXT))
        painter.drawText(
            QRectF(0, y - height / 2, MARGIN_LEFT - 6, height),
            Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
            text,
        )

    def _paint_bands(
        self, painter: QPainter, plot: QRectF, axis: Axis, state: TrayState, samples: list[Sample]
    ) -> None:
        colours = state.colours()
        drawn = state.drawn_models()

        def y_of(value: float) -> float:
            return y_on(axis, plot, value)

        owners = [*(colours.of(name) for name in drawn), palette.OTHER]
        # Each sample holds from its time to the next one's (the last one until now).
        spans: list[tuple[float, float, list[float]]] = []
        for index, sample in enumerate(samples):
            end = samples[index + 1].at if index + 1 < len(samples) else self._now
            x0, x1 = self.x_of(sample.at), self.x_of(end)
            if x1 <= x0:
                continue
            values = dict(sample.models)
            stack = [float(values.get(name, 0)) for name in drawn]
            stack.append(float(sample.others_bytes))
            spans.append((x0, x1, stack))
        painter.setPen(Qt.PenStyle.NoPen)
        for k, colour in enumerate(owners):
            if not any(stack[k] > 0 for _, _, stack in spans):
                continue
            top: list[QPointF] = []
            bottom: list[QPointF] = []
            for x0, x1, stack in spans:
                below = sum(stack[:k])
                above = below + stack[k]
                top += [QPointF(x0, y_of(above)), QPointF(x1, y_of(above))]
                bottom += [QPointF(x0, y_of(below)), QPointF(x1, y_of(below))]
            polygon = QPolygonF([*top, *reversed(bottom)])
            painter.setBrush(qcolor(colour))
            painter.drawPolygon(polygon)

    def _paint_device(self, painter: QPainter, plot: QRectF, axis: Axis) -> None:
        """The device's total as a line with its figure on the axis, when it is in view."""
        if axis.device_bytes is None or not axis.device_in_view:
            return
        y = y_on(axis, plot, axis.device_bytes)
        painter.setPen(QPen(qcolor(palette.TEXT), 1.5, Qt.PenStyle.DashLine))
        painter.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
        self._axis_label(painter, y, render.format_bytes(axis.device_bytes))

    def _paint_holds(self, painter: QPainter) -> None:
        metrics = QFontMetricsF(painter.font())
        for strip in self.hold_strips():
            painter.fillRect(strip, qcolor(palette.PANEL, 200))
            painter.fillRect(strip, QBrush(qcolor(palette.TEXT, 90), Qt.BrushStyle.BDiagPattern))
            label = "game mode"
            if metrics.horizontalAdvance(label) + 8 <= strip.width():
                painter.setPen(qcolor(palette.TEXT))
                painter.drawText(strip, Qt.AlignmentFlag.AlignCenter, label)

    def _paint_handoffs(self, painter: QPainter, plot: QRectF, state: TrayState) -> None:
        colours = state.colours()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        for x, record in self.marker_positions():
            colour = colours.of(record.to_model)
            start_x = self.x_of(record.started_at)
            if x - start_x >= 1:
                painter.fillRect(
                    QRectF(start_x, plot.top(), x - start_x, plot.height()), qcolor(colour, 70)
                )
            pen = QPen(qcolor(palette.TEXT, 220), 1.5, Qt.PenStyle.DashLine)
            painter.setPen(pen)
            painter.drawLine(QPointF(x, plot.top()), QPointF(x, plot.bottom()))
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(qcolor(colour))
            half = MARKER_HEIGHT * 0.7
            painter.drawPolygon(
                QPolygonF(
                    [
                        QPointF(x - half, plot.top() - MARKER_HEIGHT - 1),
                        QPointF(x + half, plot.top() - MARKER_HEIGHT - 1),
                        QPointF(x, plot.top() - 1),
                    ]
                )
            )
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        for rect, record in self.label_rects():
            # On a backing of the panel's colour: a label may lie over a band or a line.
            painter.fillRect(rect, qcolor(palette.PANEL, 210))
            painter.setPen(qcolor(palette.TEXT))
            painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, record.label)

    def _paint_legend(self, painter: QPainter, plot: QRectF, axis: Axis) -> None:
        metrics = QFontMetricsF(painter.font())
        y = 4.0
        box = metrics.height() * 0.7
        box_top = y + (metrics.height() - box) / 2
        end = plot.right()
        note = axis.device_note()
        if note is not None:
            width = metrics.horizontalAdvance(note)
            left = plot.right() - width
            painter.setPen(qcolor(palette.TEXT))
            painter.drawText(QPointF(left, y + metrics.ascent()), note)
            if axis.device_in_view:  # a swatch of the line that marks it
                painter.setPen(QPen(qcolor(palette.TEXT), 1.5, Qt.PenStyle.DashLine))
                swatch_y = y + metrics.height() / 2
                painter.drawLine(QPointF(left - 4 - 2 * box, swatch_y), QPointF(left - 4, swatch_y))
                left -= 4 + 2 * box
            end = left - 16
        x = float(MARGIN_LEFT)
        for name, colour in self.legend_entries():
            width = box + 4 + metrics.horizontalAdvance(name)
            if x + width > end:  # no room before the note: say that more were left out
                painter.setPen(qcolor(palette.TEXT))
                painter.drawText(QPointF(x, y + metrics.ascent()), "…")
                break
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(qcolor(colour))
            painter.drawRect(QRectF(x, box_top, box, box))
            painter.setPen(qcolor(palette.TEXT))
            painter.drawText(QPointF(x + box + 4, y + metrics.ascent()), name)
            x += width + 16
