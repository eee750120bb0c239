"""Small images made by the tests: PNGs written with the standard library (zlib + CRC),
baseline JPEGs of one grey, written by hand (the standard library has no JPEG encoder), and
WebPs written with Pillow (libwebp), still or animated."""

from __future__ import annotations

import base64
import struct
import zlib
from io import BytesIO

from PIL import Image

__all__ = ["flat_png", "interlaced_png", "jpeg", "pattern", "png", "png_data_url", "webp"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png(width: int = 32, height: int = 32, seed: int = 0) -> bytes:
    """An 8-bit RGB PNG of `width` x `height` pixels, a pattern that depends on `seed`."""
    pixels, row_bytes = _pixels(width, height, seed), width * 3
    rows = b"".join(
        b"\x00" + pixels[y * row_bytes : (y + 1) * row_bytes]  # filter type 0 (none) per scanline
        for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows))
        + _chunk(b"IEND", b"")
    )


def flat_png(width: int, height: int, *, depth: int = 16, channels: int = 4) -> bytes:
    """A PNG of `width` x `height` black pixels (RGBA16 by default: 8192x4096 of them inflate to
    268 MB, and compress to 261 KB), deflated a row at a time: never one buffer of its pixels."""
    colour = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    row = b"\x00" + bytes(width * channels * depth // 8)
    deflate = zlib.compressobj(9)
    rows = b"".join([deflate.compress(row) for _ in range(height)] + [deflate.flush()])
    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", rows)
        + _chunk(b"IEND", b"")
    )


def interlaced_png(width: int, height: int, *, cut_bytes: int = 0) -> bytes:
    """`png`'s pixels as an Adam7-interlaced PNG: each pass picks its pixels from the whole
    image (PNG spec, 8.2), its rows filtered with type 0; `cut_bytes` leaves that many bytes of
    the pixel data out (a truncated image whose chunks are all whole)."""
    pixels = _pixels(width, height, 0)
    passes = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2))
    data = bytearray()
    for x0, y0, dx, dy in (*passes, (0, 1, 1, 2)):
        columns = range(x0, width, dx)
        if not columns:
            continue
        for y in range(y0, height, dy):
            data += b"\x00" + b"".join(
                pixels[(y * width + x) * 3 : (y * width + x + 1) * 3] for x in columns
            )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 1)  # interlace method 1: Adam7
    rows = zlib.compress(bytes(data[: len(data) - cut_bytes]))
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", rows)
        + _chunk(b"IEND", b"")
    )


def png_data_url(data: bytes | None = None) -> str:
    """A `data:image/png;base64,…` URL for `data` (a fresh 32x32 PNG when None)."""
    return "data:image/png;base64," + base64.b64encode(png() if data is None else data).decode()


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


def jpeg(width: int = 8, height: int = 8, *, lossless: bool = False) -> bytes:
    """A baseline greyscale JPEG of `width` x `height` mid-grey pixels: every 8x8 block is one
    DC difference of 0 and an end-of-block, each a 1-bit Huffman code (ITU T.81, Annex B/C).
    `lossless`: marked as a lossless JPEG (SOF3), which stb_image does not decode, while every
    header the HTTP edge reads stays whole."""
    codes = bytes([1] + [0] * 15)  # how many codes of each length 1..16: one of length 1
    symbols = b"\x00"
    blocks = ((width + 7) // 8) * ((height + 7) // 8)
    bits = "00" * blocks
    bits += "1" * (-len(bits) % 8)  # pad with 1s to a byte
    scan = bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))
    return (
        b"\xff\xd8"
        + _segment(0xDB, b"\x00" + bytes([1] * 64))  # one quantization table of 1s
        + _segment(
            0xC3 if lossless else 0xC0,
            struct.pack(">BHHB", 8, height, width, 1) + b"\x01\x11\x00",
        )
        + _segment(0xC4, b"\x00" + codes + symbols)  # DC table 0
        + _segment(0xC4, b"\x10" + codes + symbols)  # AC table 0
        + _segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")
        + scan.replace(b"\xff", b"\xff\x00")
        + b"\xff\xd9"
    )


def pattern(
    width: int = 32, height: int = 32, *, alpha: bool = False, seed: int = 0
) -> Image.Image:
    """The pixels `png` writes, as a Pillow image; with `alpha`, a left-to-right alpha ramp."""
    image = Image.frombytes("RGB", (width, height), _pixels(width, height, seed))
    if alpha:
        ramp = bytes(x * 255 // max(width - 1, 1) for _ in range(height) for x in range(width))
        image.putalpha(Image.frombytes("L", (width, height), ramp))
    return image


def _pixels(width: int, height: int, seed: int) -> bytes:
    return bytes(
        ((x * 7 + y * 13 + seed * 31 + c * 85) & 0xFF)
        for y in range(height)
        for x in range(width)
        for c in range(3)
    )


def webp(
    width: int = 32,
    height: int = 32,
    *,
    lossless: bool = False,
    alpha: bool = False,
    frames: int = 1,
    seed: int = 0,
) -> bytes:
    """A WebP of `pattern`'s pixels: lossy (VP8, or VP8X with an ALPH chunk for `alpha`) or
    `lossless` (VP8L); with `frames` > 1, an animation (VP8X + ANIM + one ANMF a frame), each
    frame another seed."""
    first, *rest = [
        pattern(width, height, alpha=alpha, seed=seed + i) for i in range(max(frames, 1))
    ]
    out = BytesIO()
    first.save(
        out,
        format="WEBP",
        lossless=lossless,
        quality=90,
        save_all=frames > 1,
        append_images=rest,
    )
    return out.getvalue()
