"""The dashboard's timeline: VRAM by owner over the last minutes, stacked, with handoff markers.

    legend   ■ alpha  ■ beta  ■ other processes
    markers        ▼            ▼                  one per handoff, in the new holder's colour
    plot     ░░░░░░│▒▒▒▒▒▒▒▒▒▒▒▒│░░░░░░            a band for each owner (models in the daemon's
             ░░░░░░│▒▒▒▒▒▒▒▒▒▒▒▒│░░░░░░            order, other processes grey on top); a shaded
    axis     12:00      12:02       12:04   now    strip for each handoff's duration

Owns the drawing and its geometry (`x_of`, `plot_rect`, `marker_positions`), which the tests
read too; takes its data from a `History` and a time, never from a clock of its own.
"""

from __future__ import annotations

import math
import time

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

from arbiterd.clidaemon import human_bytes
from arbiterd.gui import palette
from arbiterd.gui.history import HandoffRecord, History, Sample
from arbiterd.gui.icon import qcolor
from arbiterd.gui.palette import RGB

MARGIN_LEFT = 70
MARGIN_RIGHT = 16
MARGIN_TOP = 40
MARGIN_BOTTOM = 24
MARKER_HEIGHT = 10
# A history shorter than the window (a fresh daemon, a demo) is drawn over its own span, but
# never less than this, so a burst of handoffs is not squeezed into the last few pixels.
MIN_SPAN_S = 20.0
OTHERS_LABEL = "other processes"
LABEL_GAP_PX = 8  # the least space between two handoff labels


def _tick_step(span: float, steps: tuple[float, ...], most: int) -> float:
    """The smallest of `steps` that gives at most `most` ticks over `span`."""
    for step in steps:
        if span / step <= most:
            return step
    return steps[-1] * math.ceil(span / (steps[-1] * most))


class TimelineWidget(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._history: History | None = None
        self._now = 0.0
        self.setMinimumSize(480, 200)

    def sizeHint(self) -> QSize:
        return QSize(900, 300)

    def set_history(self, history: History, now: float) -> None:
        self._history = history
        self._now = now
        self.update()

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

    def scale_bytes(self) -> float:
        """The byte count at the top of the plot: the devices' memory when known, else a
        little over the most seen in the window."""
        history = self._history
        if history is None:
            return float(1 << 30)
        if history.total_bytes:
            return float(history.total_bytes)
        peak = history.peak_bytes(self._now)
        return float(max(peak * 1.15, 64 << 20))

    def marker_positions(self) -> list[tuple[float, HandoffRecord]]:
        """Where each handoff in the window is marked: (x, record)."""
        if self._history is None:
            return []
        return [(self.x_of(h.at), h) for h in self._history.handoffs_in_window(self._now)]

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
        font = QFont(self.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.9))
        painter.setFont(font)
        self._paint_grid(painter, plot)
        history = self._history
        samples = history.visible(self._now) if history is not None else []
        if history is None or not samples:
            painter.setPen(qcolor(palette.TEXT))
            painter.drawText(plot, Qt.AlignmentFlag.AlignCenter, "no VRAM figures yet")
            return
        self._paint_bands(painter, plot, history, samples)
        self._paint_holds(painter, plot, history)
        self._paint_handoffs(painter, plot)
        self._paint_legend(painter, history)

    def _paint_grid(self, painter: QPainter, plot: QRectF) -> None:
        metrics = QFontMetricsF(painter.font())
        scale = self.scale_bytes()
        steps = tuple(float(1 << k) for k in range(20, 41))  # 1 MiB .. 1 TiB
        step = _tick_step(scale, steps, 5)
        painter.setPen(QPen(qcolor(palette.GRID), 1))
        value = 0.0
        while value <= scale + 1:
            y = plot.bottom() - value / scale * plot.height()
            painter.setPen(QPen(qcolor(palette.GRID), 1))
            painter.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
            painter.setPen(qcolor(palette.TEXT))
            label = human_bytes(int(value))
            painter.drawText(
                QRectF(0, y - metrics.height() / 2, MARGIN_LEFT - 6, metrics.height()),
                Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                label,
            )
            value += step
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

    def _owners(self, history: History) -> list[tuple[str, RGB]]:
        owners = [(name, palette.model_colour(name)) for name in history.models]
        return [*owners, (OTHERS_LABEL, palette.OTHER)]

    def _paint_bands(
        self, painter: QPainter, plot: QRectF, history: History, samples: list[Sample]
    ) -> None:
        scale = self.scale_bytes()

        def y_of(value: float) -> float:
            return plot.bottom() - min(1.0, value / scale) * plot.height()

        # Each sample holds from its time to the next one's (the last one until now).
        spans: list[tuple[float, float, list[float]]] = []
        for index, sample in enumerate(samples):
            end = samples[index + 1].at if index + 1 < len(samples) else self._now
            x0, x1 = self.x_of(sample.at), self.x_of(end)
            if x1 <= x0:
                continue
            values = dict(sample.models)
            stack = [float(values.get(name, 0)) for name in history.models]
            stack.append(float(sample.others_bytes))
            spans.append((x0, x1, stack))
        painter.setPen(Qt.PenStyle.NoPen)
        for k, (_name, colour) in enumerate(self._owners(history)):
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

    def _paint_holds(self, painter: QPainter, plot: QRectF, history: History) -> None:
        metrics = QFontMetricsF(painter.font())
        height = metrics.height() + 4
        for span in history.holds_in_window(self._now):
            x0 = self.x_of(span.start)
            x1 = self.x_of(self._now if span.end is None else span.end)
            strip = QRectF(x0, plot.top() + 1, max(2.0, x1 - x0), height)
            painter.fillRect(strip, qcolor(palette.PANEL, 200))
            painter.fillRect(strip, QBrush(qcolor(palette.TEXT, 90), Qt.BrushStyle.BDiagPattern))
            label = "game mode"
            if metrics.horizontalAdvance(label) + 8 <= strip.width():
                painter.setPen(qcolor(palette.TEXT))
                painter.drawText(strip, Qt.AlignmentFlag.AlignCenter, label)

    def _paint_handoffs(self, painter: QPainter, plot: QRectF) -> None:
        metrics = QFontMetricsF(painter.font())
        labels_end = -math.inf  # where the last label drawn ends
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        for x, record in self.marker_positions():
            colour = palette.model_colour(record.to_model)
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
            text = f"→ {record.to_model} {record.total_s:.2f} s"
            width = metrics.horizontalAdvance(text)
            # Right of the line, else left of it (where the plot ends first); left out where it
            # would overlap the label before it.
            for left in (x + 4, x - 4 - width):
                if left >= labels_end + LABEL_GAP_PX and left + width <= plot.right() - 2:
                    painter.setPen(qcolor(palette.TEXT))
                    painter.drawText(QPointF(left, plot.top() + metrics.ascent() + 2), text)
                    labels_end = left + width
                    break
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, False)

    def _paint_legend(self, painter: QPainter, history: History) -> None:
        metrics = QFontMetricsF(painter.font())
        x = float(MARGIN_LEFT)
        y = 4.0
        box = metrics.height() * 0.7
        for name, colour in self._owners(history):
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(qcolor(colour))
            painter.drawRect(QRectF(x, y + (metrics.height() - box) / 2, box, box))
            painter.setPen(qcolor(palette.TEXT))
            painter.drawText(QPointF(x + box + 4, y + metrics.ascent()), name)
            x += box + 4 + metrics.horizontalAdvance(name) + 16
