"""Images at the HTTP edge (issue 12): owns turning an OpenAI `image_url` content part into
checked image bytes for a vision model's worker, and every reason to refuse one.

A part is refused, each with the field it came in, when: its URL's scheme is not data:, file:,
http: or https:; it is a URL other than data: while the model's `allow_image_urls` is off; its
data: URL is not base64; its bytes are more than `max_image_bytes`; they are not a PNG or JPEG
(WebP and GIF are named: libmtmd's stb_image reads neither); the image is corrupt or truncated
(PNG: every chunk's CRC, IHDR to IEND and the pixel data inflating to the size IHDR promises;
JPEG: a frame header and the end-of-image marker); its width x height is more than
`max_image_pixels`; or the model has no projector.

Checks only bytes and headers: never decodes a JPEG's pixels (the worker's decoder does, and
its failure is a 400 too). Fetching a URL (when allowed) runs in a thread with a size cap and a
timeout; nothing here imports llama.cpp.
"""

from __future__ import annotations

import base64
import binascii
import struct
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

_SEND = "send PNG or JPEG"
FETCH_TIMEOUT_S = 10.0  # an http(s) image URL, when allowed
_PNG = b"\x89PNG\r\n\x1a\n"
_JPEG = b"\xff\xd8\xff"
# Formats people send that the engine's decoder cannot read, by their first bytes.
_UNSUPPORTED = {
    b"GIF87a": "a GIF",
    b"GIF89a": "a GIF",
    b"BM": "a BMP",
    b"II*\x00": "a TIFF",
    b"MM\x00*": "a TIFF",
}
# PNG colour types -> channels (PNG spec, IHDR).
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
# JPEG start-of-frame markers (ITU T.81 B.1.1.3): SOF0..SOF15 but DHT, JPG and DAC.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


@dataclass(frozen=True)
class ImagePolicy:
    """What a vision model accepts (its [models.NAME] table)."""

    model: str
    max_bytes: int
    max_pixels: int
    allow_urls: bool


class ImageRefused(Exception):
    """One image part is refused: `param` names the field (e.g. messages[0].content[1]),
    `reason` says why. httpapi.py answers it as a 400 with that param."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"'{param}': {reason}")
        self.param = param
        self.reason = reason


@dataclass(frozen=True)
class Image:
    data: bytes
    format: str  # "png" or "jpeg"
    width: int
    height: int


def load(param: str, url: str, policy: ImagePolicy) -> Image:
    """The checked image that `url` (an image_url part's, at `param`) holds or names."""
    scheme = urllib.parse.urlsplit(url).scheme.lower() if ":" in url else ""
    if scheme == "data":
        data = _from_data_url(param, url, policy)
    elif scheme in ("file", "http", "https"):
        if not policy.allow_urls:
            raise ImageRefused(
                param,
                f"{scheme}: image URLs are off for {policy.model} (allow_image_urls = false); "
                "send the image inline as a data: URL",
            )
        data = _fetch(param, url, scheme, policy)
    else:
        shown = f"{scheme}:" if scheme else "no scheme"
        raise ImageRefused(
            param, f"unsupported URL scheme ({shown}); expected data:, file:, http: or https:"
        )
    return check(param, data, policy)


def check(param: str, data: bytes, policy: ImagePolicy) -> Image:
    """`data` checked to be one whole PNG or JPEG within the policy's limits."""
    if len(data) > policy.max_bytes:
        raise ImageRefused(
            param, f"the image is {len(data)} bytes, more than max_image_bytes ({policy.max_bytes})"
        )
    if data.startswith(_PNG):
        kind, (width, height, row_bytes) = "png", _png_size(param, data)
    elif data.startswith(_JPEG):
        kind, (width, height) = "jpeg", _jpeg_size(param, data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise ImageRefused(param, f"a WebP image, which this engine cannot decode; {_SEND}")
    else:
        for signature, name in _UNSUPPORTED.items():
            if data.startswith(signature):
                raise ImageRefused(
                    param, f"{name} image, which this engine cannot decode; send PNG or JPEG"
                )
        raise ImageRefused(param, "not an image (expected PNG or JPEG bytes)")
    if width * height > policy.max_pixels:
        raise ImageRefused(
            param,
            f"the image is {width}x{height} pixels, more than max_image_pixels "
            f"({policy.max_pixels})",
        )
    if kind == "png":  # inflated only now: the pixel limit keeps a decompression bomb out
        _png_inflates(param, data, row_bytes * height)
    return Image(data, kind, width, height)


def _from_data_url(param: str, url: str, policy: ImagePolicy) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise ImageRefused(param, "a data: URL must be data:<type>;base64,<data>")
    # base64 is 4 characters per 3 bytes: refuse a huge payload before decoding it.
    if len(payload) > (policy.max_bytes + 2) // 3 * 4 + 4:
        raise ImageRefused(
            param, f"the image is more than max_image_bytes ({policy.max_bytes}) bytes"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused(param, "the data: URL's payload is not valid base64") from None


def _fetch(param: str, url: str, scheme: str, policy: ImagePolicy) -> bytes:
    """The bytes a file: or http(s): URL names, at most max_bytes + 1 of them (blocking: the
    caller runs it in a thread)."""
    try:
        if scheme == "file":
            path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
            with open(path, "rb") as f:
                return f.read(policy.max_bytes + 1)
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310
            data: bytes = response.read(policy.max_bytes + 1)
            return data
    except (OSError, ValueError) as exc:
        raise ImageRefused(param, f"cannot read the image at {url}: {exc}") from None


def _png_size(param: str, data: bytes) -> tuple[int, int, int]:
    """Width, height and bytes per filtered row of a whole PNG, every chunk's CRC checked."""
    at, size, seen_end = len(_PNG), None, False
    while at + 8 <= len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind = data[at + 4 : at + 8]
        body = data[at + 8 : at + 8 + length]
        crc = data[at + 8 + length : at + 12 + length]
        if len(body) != length or len(crc) != 4:
            break
        if zlib.crc32(kind + body) & 0xFFFFFFFF != struct.unpack(">I", crc)[0]:
            raise ImageRefused(param, f"a corrupt PNG (chunk {kind!r} fails its checksum)")
        if kind == b"IHDR" and length == 13:
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            size = (width, height, depth, colour)
        elif kind == b"IEND":
            seen_end = True
            break
        at += 12 + length
    if size is None or not seen_end:
        raise ImageRefused(param, "a truncated or corrupt PNG (no IHDR or no IEND)")
    width, height, depth, colour = size
    if width == 0 or height == 0 or colour not in _PNG_CHANNELS:
        raise ImageRefused(param, "a corrupt PNG (its header is invalid)")
    return width, height, 1 + (width * _PNG_CHANNELS[colour] * depth + 7) // 8


def _png_inflates(param: str, data: bytes, expected: int) -> None:
    """The PNG's pixel data (its IDAT chunks, whose CRCs `_png_size` checked) inflates to the
    `expected` bytes (an interlaced image's passes take more: only inflating is checked)."""
    at, idat = len(_PNG), bytearray()
    while at + 8 <= len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        if data[at + 4 : at + 8] == b"IDAT":
            idat += data[at + 8 : at + 8 + length]
        at += 12 + length
    try:
        pixels = zlib.decompressobj().decompress(bytes(idat), expected + 1)
    except zlib.error:
        raise ImageRefused(param, "a corrupt PNG (its pixel data does not inflate)") from None
    interlaced = data[28] == 1  # IHDR's interlace method, at a fixed offset
    if len(pixels) < expected and not interlaced:
        raise ImageRefused(param, "a truncated PNG (its pixel data ends early)")


def _jpeg_size(param: str, data: bytes) -> tuple[int, int]:
    """Width and height from a JPEG's frame header; it must end with the EOI marker."""
    if not data.rstrip(b"\x00").endswith(b"\xff\xd9"):
        raise ImageRefused(param, "a truncated JPEG (no end-of-image marker)")
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            break
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        (length,) = struct.unpack(">H", data[at + 2 : at + 4])
        if marker in _JPEG_SOF and at + 9 <= len(data):
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            if width == 0 or height == 0:
                break
            return width, height
        if marker == 0xDA:  # start of scan before any frame header
            break
        at += 2 + length
    raise ImageRefused(param, "a corrupt JPEG (no valid frame header)")
