"""The tray's colours: a distinct colour per model, and the colours that mean something.

Owns every colour the icon, the timeline and the dashboard use, as plain RGB tuples (no Qt), and
which model gets which (`model_colours`), so the same model has the same colour everywhere and
in every run. Red and amber are kept out of the models' palette: they mean "daemon unreachable"
and "warning"; grey means "not a model".
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

RGB = tuple[int, int, int]

# Eight hues for a dark panel, from Okabe-Ito (blue, yellow, pink), Tableau 10 (green) and a few
# of our own: every pair is at least 30 CIELAB ΔE apart, still 15 apart for deuteranopia and
# protanopia, and each is 25 or more from red, amber, both greys and the panel
# (tests/gui/test_palette.py measures all of it).
MODEL_PALETTE: tuple[RGB, ...] = (
    (0, 114, 178),  # blue
    (240, 228, 66),  # yellow
    (0, 200, 220),  # cyan
    (204, 121, 167),  # pink
    (89, 161, 79),  # green
    (250, 150, 120),  # salmon
    (120, 94, 240),  # violet
    (140, 230, 180),  # mint
)
OTHER: RGB = (150, 150, 150)  # other processes, the user's own hold
AMBER: RGB = (255, 176, 0)  # a warning is active (VRAM not freed, a worker restarting)
RED: RGB = (220, 38, 38)  # the daemon is unreachable
FREE: RGB = (96, 125, 139)  # nobody holds the GPU
PANEL: RGB = (30, 32, 36)  # the icon's body and the timeline's background
GRID: RGB = (70, 74, 80)
TEXT: RGB = (225, 228, 232)


def _slot(name: str) -> int:
    """The palette slot a name asks for: crc32, the same in every run (not the salted hash())."""
    return zlib.crc32(name.encode()) % len(MODEL_PALETTE)


@dataclass(frozen=True)
class ModelColours:
    """Which colour each model has; a name it was not given gets the colour of its slot."""

    by_name: Mapping[str, RGB]

    def of(self, name: str) -> RGB:
        return self.by_name.get(name) or MODEL_PALETTE[_slot(name)]


def model_colours(names: Iterable[str]) -> ModelColours:
    """Colours for `names`, in the daemon's order: each takes its own slot, or when an earlier
    name has it the next free one, so up to len(MODEL_PALETTE) models never share a colour and
    a model keeps its colour while the config keeps its models. Past that, names share."""
    by_name: dict[str, RGB] = {}
    free = list(range(len(MODEL_PALETTE)))
    for name in dict.fromkeys(names):
        wanted = _slot(name)
        # The first free slot at or after the one it asks for, wrapping round.
        slot = min(free, key=lambda s: (s - wanted) % len(MODEL_PALETTE), default=wanted)
        if free:
            free.remove(slot)
        by_name[name] = MODEL_PALETTE[slot]
    return ModelColours(by_name)


def hex_colour(rgb: RGB) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)
