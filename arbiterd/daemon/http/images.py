"""Images at the HTTP edge (issue 12): owns turning an OpenAI `image_url` content part into
checked image bytes for a vision model's worker, and every reason to refuse one. The only module
that imports Pillow, and only when a WebP arrives (ruff's TID253 keeps it out of module level):
the daemon's import time and memory are what they were for everyone who sends none.

A part is refused, each with the field it came in, when: its URL's scheme is not data:, file:,
http: or https:; it is a URL other than data: while the model's `allow_image_urls` is off; its
data: URL is not base64; its bytes are more than `max_image_bytes`; they are not a PNG, JPEG or
WebP (GIF, BMP and TIFF are named: libmtmd's stb_image reads none of them); the image is corrupt
or truncated (PNG: every chunk's CRC, IHDR to IEND and the pixel data inflating to the size IHDR
promises; JPEG: a frame header and the end-of-image marker; WebP: its RIFF chunks whole, a VP8,
VP8L or VP8X header, and libwebp decoding it); its width x height is more than
`max_image_pixels`; it is an animated WebP of more than one frame; or the model has no projector.

WebP is converted here to PNG, because stb_image cannot read it (libmtmd would hand it to an
ffmpeg subprocess, which a worker never starts: arbiterd/worker/vision.py). Its size comes from
its own header, read here, and is checked before Pillow sees the bytes: before 13.0, Pillow's
WebP plugin allocates the whole canvas as it opens a file (10.x without libwebp's animation API
even decodes it), before any size check. That explicit check is the one pixel limit, per model,
so Pillow's process-wide one (Image.MAX_IMAGE_PIXELS) is turned off. The PNG keeps the WebP's
width, height and alpha: the worker's decoder asks stb_image for RGB and drops alpha, as it
does for a PNG sent with it. An animation is refused rather than cut to its first frame (as
OpenAI takes only non-animated GIFs): a first frame alone can say something else than the
animation the client sent. The PNG is larger than the WebP (0.3 to 1.5 bytes a pixel on the
photos in docs/http-api.md): app.py bounds a request's images as the worker takes them.

Checks only bytes and headers of PNG and JPEG: never decodes a JPEG's pixels (the worker's
decoder does, and its failure is a 400 too). `check` is blocking; `load`, on the event loop,
reads a URL (when allowed) in a thread and runs `check` on the image threads. Nothing here
imports llama.cpp.

Memory (issue 24): what the daemon spends on one image beyond its bytes is bounded by
DECODE_BUDGET_BYTES, and at most MAX_DECODES_AT_ONCE images are checked at once, however many
requests bring them: `load` runs checks on that many threads of their own, the others wait their
turn in the event loop (a client that leaves drops its turn). Threads of their own, not a
semaphore across a shared pool: glibc gives each thread a malloc arena, which keeps memory freed
under its mmap threshold (up to 32 MiB) for its next allocation, so checks spread over anyio's
40 threads would each leave up to one image's peak behind. So the daemon's images never take
more than the one times the other. A PNG's pixel data is inflated as a stream, INFLATE_PIECE_BYTES
at a time, counted and dropped: never one buffer of the whole image (an 8192x4096 RGBA16 PNG
of 261 KB inflates to 268 MB; its check took 512 MB at its peak, now about 1 MB). A WebP cannot
be converted so: libwebp decodes the whole canvas and Pillow copies it, so one whose conversion
would take more than the budget (WEBP_BYTES_PER_PIXEL, measured) is refused, named, with its
way round (the same image as PNG or JPEG, which the daemon never decodes whole).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import struct
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from arbiterd.daemon.service import ImagePolicy

_SEND = "send PNG, JPEG or WebP"
FETCH_TIMEOUT_S = 10.0  # an http(s) image URL, when allowed
# The most memory the daemon gives one image's check beyond its bytes, and how many images are
# checked at once (see the module's docstring): 640 MiB at most for every request's images.
DECODE_BUDGET_BYTES = 320 * 1024 * 1024
MAX_DECODES_AT_ONCE = 2
# A PNG's pixel data is fed to zlib this much at a time and inflated this much at a time: its
# unconsumed input is copied at each step (zlib's unconsumed_tail), so both stay small.
INFLATE_INPUT_BYTES = 64 * 1024
INFLATE_PIECE_BYTES = 256 * 1024
# What converting a WebP takes per pixel at its peak, measured (VmHWM, Pillow 13): 16 to decode
# (libwebp's animation decoder keeps two RGBA canvases, Pillow copies one as bytes, then into
# its image), and up to 4 more for the PNG written from it (RGBA that does not compress). The
# budget takes WebPs up to 4096x4096 (16.8 Mpx); larger ones are refused.
WEBP_BYTES_PER_PIXEL = 20
# The image threads (see the module's docstring); started as the first checks come.
_checking = ThreadPoolExecutor(MAX_DECODES_AT_ONCE, thread_name_prefix="image-check")
_PNG = b"\x89PNG\r\n\x1a\n"
_JPEG = b"\xff\xd8\xff"
# WebP's container (Google's "WebP Container Specification"): RIFF, size, WEBP, then chunks.
_VP8_START = b"\x9d\x01\x2a"  # a VP8 key frame's start code (RFC 6386, 9.1)
_VP8L_SIGNATURE = 0x2F  # a VP8L bitstream's first byte
_VP8X_ANIMATION = 0x02  # VP8X's flags: the file is an animation (its frames are ANMF chunks)
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
# Adam7's passes (PNG spec, 8.2): each one's first column and row, and its steps across and down.
_ADAM7 = (
    (0, 0, 8, 8),
    (4, 0, 8, 8),
    (0, 4, 4, 8),
    (2, 0, 4, 4),
    (0, 2, 2, 4),
    (1, 0, 2, 2),
    (0, 1, 1, 2),
)
# JPEG start-of-frame markers (ITU T.81 B.1.1.3): SOF0..SOF15 but DHT, JPG and DAC.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


class ImageRefused(Exception):
    """One image part is refused: `param` names the field (e.g. messages[0].content[1]),
    `reason` says why. app.py answers it as a 400 with that param."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"'{param}': {reason}")
        self.param = param
        self.reason = reason


@dataclass(frozen=True)
class Image:
    data: bytes
    format: str  # of `data`: "png" or "jpeg" (a WebP arrives as "png", converted)
    width: int
    height: int


async def load(param: str, url: str, policy: ImagePolicy) -> Image:
    """The checked image that `url` (an image_url part's, at `param`) holds or names: its bytes
    read in a thread (a URL may be fetched), then checked on the image threads."""
    data = await asyncio.to_thread(_read, param, url, policy)
    return await asyncio.get_running_loop().run_in_executor(_checking, check, param, data, policy)


def _read(param: str, url: str, policy: ImagePolicy) -> bytes:
    """The bytes `url` holds (a data: URL) or names (blocking: a URL is fetched)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower() if ":" in url else ""
    if scheme == "data":
        return _from_data_url(param, url, policy)
    if scheme in ("file", "http", "https"):
        if not policy.allow_urls:
            raise ImageRefused(
                param,
                f"{scheme}: image URLs are off for {policy.model} (allow_image_urls = false); "
                "send the image inline as a data: URL",
            )
        return _fetch(param, url, scheme, policy)
    shown = f"{scheme}:" if scheme else "no scheme"
    raise ImageRefused(
        param, f"unsupported URL scheme ({shown}); expected data:, file:, http: or https:"
    )


def check(param: str, data: bytes, policy: ImagePolicy) -> Image:
    """`data` checked to be one whole PNG, JPEG or WebP within the policy's limits; a WebP comes
    back converted to PNG (blocking: see the module's docstring)."""
    if len(data) > policy.max_bytes:
        raise ImageRefused(
            param, f"the image is {len(data)} bytes, more than max_image_bytes ({policy.max_bytes})"
        )
    if data.startswith(_PNG):
        kind, (width, height, inflated_bytes) = "png", _png_size(param, data)
    elif data.startswith(_JPEG):
        kind, (width, height) = "jpeg", _jpeg_size(param, data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        kind, (width, height) = "webp", _webp_size(param, data)
    else:
        for signature, name in _UNSUPPORTED.items():
            if data.startswith(signature):
                raise ImageRefused(param, f"{name} image, which this engine cannot decode; {_SEND}")
        raise ImageRefused(param, "not an image (expected PNG, JPEG or WebP bytes)")
    if width * height > policy.max_pixels:
        raise ImageRefused(
            param,
            f"the image is {width}x{height} pixels, more than max_image_pixels "
            f"({policy.max_pixels})",
        )
    if kind == "webp" and width * height * WEBP_BYTES_PER_PIXEL > DECODE_BUDGET_BYTES:
        raise ImageRefused(
            param,
            f"a WebP of {width}x{height} pixels takes about "
            f"{width * height * WEBP_BYTES_PER_PIXEL} bytes to convert, more than the daemon "
            f"gives one image ({DECODE_BUDGET_BYTES}); send it as PNG or JPEG",
        )
    # Inflated or decoded only now: the pixel limit keeps a decompression bomb out.
    if kind == "png":
        _png_inflates(param, data, inflated_bytes)
    elif kind == "webp":
        return Image(_webp_to_png(param, data, width, height), "png", width, height)
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
    """Width, height and the bytes its pixel data inflates to (every pass's filtered rows, for
    an interlaced image) of a whole PNG, every chunk's CRC checked."""
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
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            size = (width, height, depth, colour, interlace)
        elif kind == b"IEND":
            seen_end = True
            break
        at += 12 + length
    if size is None or not seen_end:
        raise ImageRefused(param, "a truncated or corrupt PNG (no IHDR or no IEND)")
    width, height, depth, colour, interlace = size
    if width == 0 or height == 0 or colour not in _PNG_CHANNELS or interlace not in (0, 1):
        raise ImageRefused(param, "a corrupt PNG (its header is invalid)")
    bits = _PNG_CHANNELS[colour] * depth  # per pixel
    if not interlace:
        return width, height, height * (1 + (width * bits + 7) // 8)
    inflated = 0
    for x0, y0, dx, dy in _ADAM7:
        columns, rows = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
        if columns > 0 and rows > 0:  # a pass of no pixels has no rows, not even filter bytes
            inflated += rows * (1 + (columns * bits + 7) // 8)
    return width, height, inflated


def _png_inflates(param: str, data: bytes, expected: int) -> None:
    """The PNG's pixel data (its IDAT chunks, whose CRCs `_png_size` checked) inflates to the
    `expected` bytes. Inflated as a stream and counted, never held (the module's docstring)."""
    inflater, inflated = zlib.decompressobj(), 0
    try:
        for piece in _idat_pieces(data):
            pending: bytes | memoryview = piece
            while pending and inflated < expected and not inflater.eof:
                out = inflater.decompress(pending, min(INFLATE_PIECE_BYTES, expected - inflated))
                inflated += len(out)
                pending = inflater.unconsumed_tail  # what max_length left of this piece
            if inflated >= expected or inflater.eof:
                break
    except zlib.error:
        raise ImageRefused(param, "a corrupt PNG (its pixel data does not inflate)") from None
    if inflated < expected:
        raise ImageRefused(param, "a truncated PNG (its pixel data ends early)")


def _idat_pieces(data: bytes) -> Iterator[memoryview]:
    """The PNG's pixel data (the bodies of its IDAT chunks, in order), INFLATE_INPUT_BYTES at a
    time, without copying it."""
    view, at = memoryview(data), len(_PNG)
    while at + 8 <= len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        if data[at + 4 : at + 8] == b"IDAT":
            body = view[at + 8 : at + 8 + length]
            for start in range(0, len(body), INFLATE_INPUT_BYTES):
                yield body[start : start + INFLATE_INPUT_BYTES]
        at += 12 + length


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


def _webp_size(param: str, data: bytes) -> tuple[int, int]:
    """Width and height of a WebP from its first chunk (VP8, VP8L or VP8X), every chunk whole
    within the RIFF size; an animation of more than one frame is refused by name."""
    (riff_bytes,) = struct.unpack("<I", data[4:8])
    if riff_bytes + 8 > len(data):
        raise ImageRefused(
            param,
            f"a truncated WebP (its header promises {riff_bytes + 8} bytes, {len(data)} came)",
        )
    at, end, first, frames = 12, riff_bytes + 8, None, 0
    while at + 8 <= end:
        kind = data[at : at + 4]
        (length,) = struct.unpack("<I", data[at + 4 : at + 8])
        if at + 8 + length > end:
            raise ImageRefused(param, f"a truncated WebP (chunk {kind!r} ends early)")
        first = first or (kind, data[at + 8 : at + 8 + length])
        frames += kind == b"ANMF"
        at += 8 + length + (length & 1)  # chunks are padded to an even size
    if first is None:
        raise ImageRefused(param, "a truncated WebP (no chunks)")
    kind, body = first
    size = None
    if kind == b"VP8 " and len(body) >= 10 and body[3:6] == _VP8_START:
        width, height = struct.unpack("<HH", body[6:10])
        size = width & 0x3FFF, height & 0x3FFF  # the top 2 bits are an upscaling hint
    elif kind == b"VP8L" and len(body) >= 5 and body[0] == _VP8L_SIGNATURE:
        (bits,) = struct.unpack("<I", body[1:5])  # 14 bits width - 1, 14 bits height - 1, ...
        if bits >> 29 == 0:  # ... 1 bit alpha, 3 bits version (0)
            size = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    elif kind == b"VP8X" and len(body) >= 10:
        # flags, 3 reserved bytes, then the canvas's width - 1 and height - 1 in 24 bits each
        width = int.from_bytes(body[4:7], "little") + 1
        height = int.from_bytes(body[7:10], "little") + 1
        if body[0] & _VP8X_ANIMATION and frames > 1:
            raise ImageRefused(
                param, f"an animated WebP ({frames} frames); send one frame as PNG, JPEG or WebP"
            )
        size = width, height
    if size is None or 0 in size:
        raise ImageRefused(param, "a corrupt WebP (no valid VP8, VP8L or VP8X header)")
    return size


def _webp_to_png(param: str, data: bytes, width: int, height: int) -> bytes:
    """The WebP `data`, whose header says `width` x `height`, decoded by libwebp (through Pillow)
    and written as a PNG of the same size and mode (RGB, or RGBA when it has alpha)."""
    from PIL import Image as PILImage  # lazily (TID253): see the module docstring

    # `check` applied the model's max_image_pixels before Pillow sees the bytes; Pillow's own,
    # process-wide limit would warn or refuse at other sizes than the one configured.
    PILImage.MAX_IMAGE_PIXELS = None
    try:
        # formats: only the WebP plugin may read it, whatever else the bytes might pass for.
        with PILImage.open(BytesIO(data), formats=["WEBP"]) as image:
            if image.size != (width, height):
                raise ImageRefused(
                    param,
                    f"a corrupt WebP (its header says {width}x{height}, its image is "
                    f"{image.size[0]}x{image.size[1]})",
                )
            image.load()
            out = BytesIO()
            image.save(out, format="PNG")
    except (OSError, ValueError) as exc:
        # Pillow says OSError for a file it cannot read (UnidentifiedImageError is one, and so
        # is "WEBP support not installed"), ValueError for some malformed headers.
        raise ImageRefused(param, f"a corrupt or truncated WebP ({exc})") from None
    return out.getvalue()
