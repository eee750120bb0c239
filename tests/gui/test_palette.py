"""Model colours: far apart for every eye, clear of the colours that mean something, stable."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

from arbiterd.gui import palette
from arbiterd.gui.palette import RGB

# Colour vision deficiency, simulated on linear RGB (Machado, Oliveira & Fernandes 2009,
# severity 1.0): the two most common kinds.
DEFICIENCIES = {
    "deuteranopia": (
        (0.367322, 0.860646, -0.227968),
        (0.280085, 0.672501, 0.047413),
        (-0.011820, 0.042940, 0.968881),
    ),
    "protanopia": (
        (0.152286, 1.052583, -0.204868),
        (0.114503, 0.786281, 0.099216),
        (-0.003882, -0.048116, 1.051998),
    ),
}


def _linear(channel: float) -> float:
    channel /= 255
    return channel / 12.92 if channel <= 0.04045 else ((channel + 0.055) / 1.055) ** 2.4


def _encoded(channel: float) -> float:
    channel = min(1.0, max(0.0, channel))
    return 255 * (12.92 * channel if channel <= 0.0031308 else 1.055 * channel ** (1 / 2.4) - 0.055)


def lab(rgb: tuple[float, float, float]) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour."""
    r, g, b = (_linear(c) for c in rgb)
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return (116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z)))


def delta_e(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """CIE76 ΔE: about 2 is just noticeable, 30 and more reads as another colour."""
    return math.dist(lab(a), lab(b))


def seen_with(rgb: RGB, deficiency: str) -> tuple[float, float, float]:
    linear = [_linear(c) for c in rgb]
    rows = DEFICIENCIES[deficiency]
    simulated = [sum(m * c for m, c in zip(row, linear, strict=True)) for row in rows]
    return (_encoded(simulated[0]), _encoded(simulated[1]), _encoded(simulated[2]))


def test_every_pair_of_model_colours_is_far_apart() -> None:
    pairs = list(itertools.combinations(palette.MODEL_PALETTE, 2))
    assert len(palette.MODEL_PALETTE) >= 8
    assert min(delta_e(a, b) for a, b in pairs) >= 30


def test_model_colours_stay_apart_for_colour_blind_eyes() -> None:
    for deficiency in DEFICIENCIES:
        pairs = itertools.combinations(palette.MODEL_PALETTE, 2)
        worst = min(delta_e(seen_with(a, deficiency), seen_with(b, deficiency)) for a, b in pairs)
        assert worst >= 15, deficiency


def test_model_colours_stay_clear_of_the_colours_that_mean_something() -> None:
    meaning = (palette.RED, palette.AMBER, palette.OTHER, palette.FREE, palette.PANEL)
    for colour in palette.MODEL_PALETTE:
        assert min(delta_e(colour, other) for other in meaning) >= 25, colour


def test_three_models_get_clearly_different_colours() -> None:
    # Names whose digests all ask for the same slot: the later ones move on to free ones.
    names = ["alpha", "chat", "writer"]
    colours = palette.model_colours(names)
    found = [colours.of(name) for name in names]
    assert min(delta_e(a, b) for a, b in itertools.combinations(found, 2)) >= 30


def test_up_to_a_palette_of_models_never_share_a_colour() -> None:
    names = [f"model-{k}" for k in range(len(palette.MODEL_PALETTE))]
    colours = palette.model_colours(names)
    assert len({colours.of(name) for name in names}) == len(names)


def test_a_models_colour_is_the_same_in_every_run() -> None:
    names = ["qwen-coder", "llama-chat", "gemma-3-270m"]
    here = [palette.model_colours(names).of(name) for name in names]
    code = (
        "from arbiterd.gui import palette; "
        f"names = {names!r}; print([palette.model_colours(names).of(n) for n in names])"
    )
    for seed in ("1", "2"):  # str hashes differ with the seed; the colours must not
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.strip() == repr(here)


def test_the_first_model_gets_the_colour_of_its_name_alone() -> None:
    """Adding a model after it (a config that grew) leaves its colour as it was."""
    alone = palette.model_colours(["qwen-coder"]).of("qwen-coder")
    assert palette.model_colours(["qwen-coder", "llama-chat"]).of("qwen-coder") == alone
    # A name it was not given (a handoff to a model the history never saw) still gets one.
    assert palette.model_colours([]).of("qwen-coder") == alone
