"""The tray's colours: one stable colour per model name, and the colours that mean something.

Owns every colour the icon, the timeline and the dashboard use, as plain RGB tuples (no Qt), so
the same model has the same colour everywhere and in every run. Red and amber are kept out of
the models' palette: they mean "daemon unreachable" and "warning"; grey means "not a model".
"""

from __future__ import annotations

import zlib

RGB = tuple[int, int, int]

# Distinct hues away from red, amber and grey (Tableau-like, tuned for a dark and a light panel).
MODEL_PALETTE: tuple[RGB, ...] = (
    (66, 133, 244),  # blue
    (52, 168, 83),  # green
    (155, 89, 182),  # purple
    (0, 172, 193),  # teal
    (233, 30, 140),  # pink
    (92, 107, 192),  # indigo
    (139, 195, 74),  # lime
    (3, 105, 161),  # deep sky
    (121, 85, 72),  # brown
    (186, 104, 200),  # orchid
)
OTHER: RGB = (150, 150, 150)  # other processes, the user's own hold
AMBER: RGB = (255, 176, 0)  # a warning is active (VRAM not freed, a worker restarting)
RED: RGB = (220, 38, 38)  # the daemon is unreachable
FREE: RGB = (96, 125, 139)  # nobody holds the GPU
PANEL: RGB = (30, 32, 36)  # the icon's body and the timeline's background
GRID: RGB = (70, 74, 80)
TEXT: RGB = (225, 228, 232)


def model_colour(name: str) -> RGB:
    """The same colour for the same name in every run (crc32, not the salted hash())."""
    return MODEL_PALETTE[zlib.crc32(name.encode()) % len(MODEL_PALETTE)]


def hex_colour(rgb: RGB) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)
