"""The tray icon, drawn from an `IconLook`: a pure function from what to show to a QImage.

    ┌──────────┐   frame: the holder's colour; amber on a warning; red when unreachable
    │          │   body: dark
    │▓▓▓▓▓▓▓▓▓▓│   fill from the bottom: the VRAM in use, in the holder's colour
    └──────────┘   unreachable: a red cross instead of a fill

Owns the icon's geometry; takes its colours from `palette` via the look. Needs a QGuiApplication
(QPainter on a QImage), nothing else: no window, no tray.
"""

from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QImage, QPainter, QPen, QPixmap

from arbiterd.gui import palette
from arbiterd.gui.palette import RGB
from arbiterd.gui.state import IconLook

DEFAULT_SIZE = 64
# Sizes a tray asks for (16 to 64 px on common panels, x2 on HiDPI).
ICON_SIZES = (16, 22, 24, 32, 48, 64, 128)


def qcolor(rgb: RGB, alpha: int = 255) -> QColor:
    return QColor(rgb[0], rgb[1], rgb[2], alpha)


def frame_width(size: int) -> float:
    return max(2.0, size * 0.125)


def fill_rect(size: int, fill: float) -> QRectF:
    """Where the VRAM fill is drawn inside the frame (for the tests as for the painter)."""
    inset = frame_width(size) + max(1.0, size / 32)
    inner = QRectF(inset, inset, size - 2 * inset, size - 2 * inset)
    height = inner.height() * max(0.0, min(1.0, fill))
    return QRectF(inner.left(), inner.bottom() - height, inner.width(), height)


def render_icon(look: IconLook, size: int = DEFAULT_SIZE) -> QImage:
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    try:
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        width = frame_width(size)
        outer = QRectF(width / 2, width / 2, size - width, size - width)
        radius = size * 0.16
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(qcolor(palette.PANEL))
        painter.drawRoundedRect(outer, radius, radius)
        if look.unreachable:
            inset = size * 0.3
            pen = QPen(qcolor(palette.RED), max(2.0, size * 0.1))
            pen.setCapStyle(Qt.PenCapStyle.RoundCap)
            painter.setPen(pen)
            painter.drawLine(QPointF(inset, inset), QPointF(size - inset, size - inset))
            painter.drawLine(QPointF(size - inset, inset), QPointF(inset, size - inset))
        elif look.fill > 0:
            painter.setRenderHint(QPainter.RenderHint.Antialiasing, False)
            painter.fillRect(fill_rect(size, look.fill), qcolor(look.fill_colour))
            painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        painter.setPen(QPen(qcolor(look.frame), width))
        painter.drawRoundedRect(outer, radius, radius)
    finally:
        painter.end()
    return image


def make_icon(look: IconLook) -> QIcon:
    """A QIcon holding the look at every size a tray may ask for, each drawn for its size."""
    icon = QIcon()
    for size in ICON_SIZES:
        icon.addPixmap(QPixmap.fromImage(render_icon(look, size)))
    return icon
