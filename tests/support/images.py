"""Small images made by the tests: PNGs written with the standard library (zlib + CRC)."""

from __future__ import annotations

import base64
import struct
import zlib

__all__ = ["png", "png_data_url"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png(width: int = 32, height: int = 32, seed: int = 0) -> bytes:
    """An 8-bit RGB PNG of `width` x `height` pixels, a pattern that depends on `seed`."""
    rows = b"".join(
        b"\x00"  # filter type 0 (none) per scanline
        + bytes(
            ((x * 7 + y * 13 + seed * 31 + c * 85) & 0xFF) for x in range(width) for c in range(3)
        )
        for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows))
        + _chunk(b"IEND", b"")
    )


def png_data_url(data: bytes | None = None) -> str:
    """A `data:image/png;base64,…` URL for `data` (a fresh 32x32 PNG when None)."""
    return "data:image/png;base64," + base64.b64encode(png() if data is None else data).decode()
