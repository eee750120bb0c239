"""The image checks' memory (issue 24): a PNG is inflated as a stream within a small budget, a
WebP too large to convert within the budget is refused before Pillow sees it, and no more than
MAX_DECODES_AT_ONCE images are checked at once. Peaks are the kernel's (VmHWM) in a subprocess.
Every other refusal is checked at the HTTP edge (test_httpapi_images.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from io import BytesIO
from pathlib import Path

import pytest
from PIL import Image

from arbiterd.daemon.http import images
from arbiterd.daemon.http.images import ImageRefused
from arbiterd.daemon.service import ImagePolicy
from tests.daemon.http.test_app_images import huge_webp_header
from tests.support.images import flat_png, interlaced_png, pattern

MiB = 1 << 20
POLICY = ImagePolicy(model="m", max_bytes=5 * MiB, max_pixels=8192 * 4096, allow_urls=False)

# Loads the image in argv[1] (a data: URL) for argv[2] requests at once, as the HTTP edge does,
# then prints the peak resident memory the checks added and their results.
CHECK_AT_ONCE = """
import asyncio, base64, json, os, sys
from pathlib import Path
from arbiterd.daemon.http import images
from arbiterd.daemon.service import ImagePolicy
from tests.support.memory import peak_bytes, reset_peak

url = "data:image/png;base64," + base64.b64encode(Path(sys.argv[1]).read_bytes()).decode()
policy = ImagePolicy("m", 5 << 20, 8192 * 4096, allow_urls=False)

async def requests():
    return await asyncio.gather(
        *(images.load(f"p{i}", url, policy) for i in range(int(sys.argv[2])))
    )

reset_peak(os.getpid())
before = peak_bytes(os.getpid())
results = [image.format for image in asyncio.run(requests())]
print(json.dumps({"peak_growth_bytes": peak_bytes(os.getpid()) - before, "results": results}))
"""


@pytest.fixture(scope="module")
def big_png() -> bytes:
    """The audit's PNG: 8192x4096 RGBA16, every limit's most, 261 KB that inflate to 268 MB."""
    return flat_png(8192, 4096)


def check_at_once(image: Path, n: int) -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", CHECK_AT_ONCE, str(image), str(n)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(done.stdout)
    return out["peak_growth_bytes"], out["results"]


def test_six_8192x4096_rgba16_pngs_at_once_are_checked_in_under_64_mb(
    tmp_path: Path, big_png: bytes
) -> None:
    (tmp_path / "big.png").write_bytes(big_png)
    growth, results = check_at_once(tmp_path / "big.png", 6)
    assert results == ["png"] * 6
    # Inflated in one buffer, one took 512 MB and six 1.78 GB; streamed, about 1 MB each.
    assert growth < 64 * MiB, f"{growth / MiB:.1f} MiB"


def test_six_webps_at_once_are_converted_at_most_two_at_a_time(tmp_path: Path) -> None:
    side = 2048
    out = BytesIO()
    Image.new("RGB", (side, side), (40, 90, 160)).save(out, format="WEBP", quality=80, method=0)
    (tmp_path / "photo.webp").write_bytes(out.getvalue())
    growth, results = check_at_once(tmp_path / "photo.webp", 6)
    assert results == ["png"] * 6
    # One conversion's decode takes 16 bytes a pixel (WEBP_BYTES_PER_PIXEL's measure, less the
    # PNG, which is small for one colour). Two at a time measured 136 to 168 MiB here; all six
    # at once, 351 MiB: a third at once would pass the bound.
    decode_bytes = side * side * 16
    assert images.MAX_DECODES_AT_ONCE == 2
    assert growth < 3 * decode_bytes, f"{growth / MiB:.1f} MiB"


def test_a_webp_over_the_decode_budget_is_refused_before_pillow_with_its_way_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("Pillow was asked to open a WebP over the decode budget")

    monkeypatch.setattr(Image, "open", no_decoding)
    width, height = 8192, 4096  # within max_image_pixels, not within the budget
    assert width * height * images.WEBP_BYTES_PER_PIXEL > images.DECODE_BUDGET_BYTES
    with pytest.raises(ImageRefused) as refused:
        images.check("p", huge_webp_header(width, height), POLICY)
    assert f"a WebP of {width}x{height} pixels takes about" in refused.value.reason
    assert f"more than the daemon gives one image ({images.DECODE_BUDGET_BYTES})" in str(
        refused.value
    )
    assert refused.value.reason.endswith("send it as PNG or JPEG")


def test_the_budget_takes_a_4096x4096_webp_and_refuses_a_pixel_more() -> None:
    assert 4096 * 4096 * images.WEBP_BYTES_PER_PIXEL <= images.DECODE_BUDGET_BYTES
    with pytest.raises(ImageRefused, match="takes about"):
        images.check("p", huge_webp_header(4097, 4096), POLICY)


@pytest.mark.parametrize(("width", "height"), [(37, 23), (1, 1), (3, 9), (8, 8)])
def test_an_interlaced_png_inflates_to_the_size_of_its_seven_passes(
    width: int, height: int
) -> None:
    data = interlaced_png(width, height)
    decoded = Image.open(BytesIO(data), formats=["PNG"])
    assert decoded.info.get("interlace") == 1
    assert decoded.convert("RGB").tobytes() == pattern(width, height).tobytes()  # made right
    assert images.check("p", data, POLICY).format == "png"


def test_an_interlaced_png_whose_pixels_end_early_is_truncated() -> None:
    with pytest.raises(ImageRefused, match="pixel data ends early"):
        images.check("p", interlaced_png(37, 23, cut_bytes=1), POLICY)


def test_a_png_with_an_unknown_interlace_method_is_corrupt() -> None:
    data = bytearray(interlaced_png(8, 8))
    data[28] = 2  # IHDR's interlace method: 0 or 1 (its CRC fixed below)
    crc = zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF
    data[29:33] = crc.to_bytes(4, "big")
    with pytest.raises(ImageRefused, match="its header is invalid"):
        images.check("p", bytes(data), POLICY)
