"""What one large PNG costs a real daemon and its vision worker (issue 24): the audit's 8192x4096
RGBA16 PNG, 261 KB within every limit, added 515 MB to the daemon's peak (inflated in one
buffer) and 518 MB to the worker's. The daemon now checks it as a stream; the worker's decoder
(stb_image, in libmtmd) holds the image whole, once per worker, within max_image_pixels."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import psutil

from tests.support.daemon import serving
from tests.support.daemon import tiny as tiny_table
from tests.support.images import flat_png
from tests.support.memory import peak_bytes, reset_peak

MiB = 1 << 20
WIDTH, HEIGHT = 8192, 4096  # max_image_pixels' default, width x height
# What stb_image takes for an RGBA16 PNG at its peak: the inflated rows (8 bytes a pixel) and
# the unfiltered image (8 more) at once, before it converts to the RGB the projector takes.
STB_BYTES_PER_PIXEL = 16


def test_an_8192x4096_rgba16_png_adds_under_64_mb_to_the_daemon(
    tiny_model: Path, tiny_mmproj: Path
) -> None:
    url = "data:image/png;base64," + base64.b64encode(flat_png(WIDTH, HEIGHT)).decode()
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": "eye", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    with serving({"eye": tiny_table(tiny_model, n_ctx=1024, mmproj=tiny_mmproj)}) as daemon:
        (worker,) = psutil.Process(daemon.process.pid).children()
        pids = (daemon.process.pid, worker.pid)
        for pid in pids:
            reset_peak(pid)
        before = {pid: peak_bytes(pid) for pid in pids}
        response = httpx.post(f"{daemon.url}/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        daemon_growth, worker_growth = (peak_bytes(pid) - before[pid] for pid in pids)
    assert daemon_growth < 64 * MiB, f"{daemon_growth / MiB:.1f} MiB"  # measured: 4.5 MiB
    # The worker's decode is stb_image's: bounded by max_image_pixels, not by the daemon.
    assert worker_growth < (STB_BYTES_PER_PIXEL + 1) * WIDTH * HEIGHT, f"{worker_growth / MiB}"
