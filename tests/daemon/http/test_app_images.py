"""Images at the HTTP edge (issue 12): OpenAI image parts are checked against the model's
policy and reach the engine as base64 with a marker in the text; every bad one is a 400 that
names its field. The past responses /v1/responses keeps, images included, stay within their
budget in bytes (issue 40)."""

from __future__ import annotations

import base64
import json
import random
import struct
import subprocess
import sys
import zlib
from io import BytesIO
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from PIL import Image

from arbiterd.daemon.http import app as httpapi
from arbiterd.daemon.http.app import create_app
from arbiterd.daemon.service import ImagePolicy
from arbiterd.spec import IMAGE_MARKER, MAX_IMAGES
from tests.daemon.http.test_app import DEADLINE_S, FakeService, assert_error, call, serving
from tests.support.images import jpeg, pattern, png, png_data_url, webp

POLICY = ImagePolicy(model="tiny", max_bytes=64 * 1024, max_pixels=256 * 256, allow_urls=False)
FIELD = "messages[0].content[1]"


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def chat(url: str, model: str = "tiny", text: str = "what is this") -> dict[str, Any]:
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": model, "messages": [{"role": "user", "content": content}]}


@pytest.fixture
def service() -> FakeService:
    double = FakeService()
    double.vision["tiny"] = POLICY  # "small" has no projector
    return double


@pytest.fixture
def vision(service: FakeService) -> FastAPI:
    return create_app(service)


def test_a_png_reaches_the_engine_as_base64_with_a_marker(
    vision: FastAPI, service: FakeService
) -> None:
    image = png(20, 10)
    response = call(vision, "POST", "/v1/chat/completions", body=chat(png_data_url(image)))
    assert response.status_code == 200, response.text
    (_, kind, body) = service.calls[-1]
    assert kind == "chat"
    assert body["messages"][0]["content"] == f"what is this\n{IMAGE_MARKER}"
    assert body["images"] == [base64.b64encode(image).decode()]


def test_a_jpeg_is_taken_too(vision: FastAPI, service: FakeService) -> None:
    url = data_url(jpeg(), "image/jpeg")
    assert call(vision, "POST", "/v1/chat/completions", body=chat(url)).status_code == 200
    assert len(service.calls[-1][2]["images"]) == 1


def test_a_file_url_is_read_when_urls_are_allowed(
    vision: FastAPI, service: FakeService, tmp_path: Path
) -> None:
    (tmp_path / "cat.png").write_bytes(png())
    service.vision["tiny"] = ImagePolicy("tiny", 64 * 1024, 256 * 256, allow_urls=True)
    response = call(vision, "POST", "/v1/chat/completions", body=chat(f"file://{tmp_path}/cat.png"))
    assert response.status_code == 200, response.text
    assert service.calls[-1][2]["images"] == [base64.b64encode(png()).decode()]


def truncated_png() -> bytes:
    return png()[:-30]


def corrupt_png() -> bytes:
    data = bytearray(png())
    data[40] ^= 0xFF  # inside IDAT: its CRC no longer matches
    return bytes(data)


BAD: list[tuple[str, str, str]] = [
    ("not an image", data_url(b"hello, world", "text/plain"), "not an image"),
    ("a gif", data_url(b"GIF89a" + bytes(20), "image/gif"), "a GIF image"),
    ("truncated png", data_url(truncated_png()), "truncated or corrupt PNG"),
    ("corrupt png", data_url(corrupt_png()), "fails its checksum"),
    ("truncated jpeg", data_url(jpeg()[:-2], "image/jpeg"), "truncated JPEG"),
    ("too many bytes", data_url(png(200, 200, seed=1) + bytes(70_000)), "max_image_bytes"),
    ("too many pixels", data_url(png(300, 300)), "300x300 pixels, more than max_image_pixels"),
    ("not base64", "data:image/png;base64,@@@@", "not valid base64"),
    ("not a base64 data url", "data:image/png,rawbytes", "data:<type>;base64,<data>"),
    ("ftp", "ftp://example.com/cat.png", "unsupported URL scheme (ftp:)"),
    ("no scheme", "cat.png", "unsupported URL scheme (no scheme)"),
    ("http while off", "http://example.com/cat.png", "http: image URLs are off for tiny"),
    ("file while off", "file:///etc/passwd", "file: image URLs are off for tiny"),
]


@pytest.mark.parametrize(("url", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_image_is_a_400_naming_its_field(
    vision: FastAPI, service: FakeService, url: str, message: str
) -> None:
    response = call(vision, "POST", "/v1/chat/completions", body=chat(url))
    error = assert_error(response, 400, param=FIELD, code="invalid_image")
    assert message in error["message"]
    assert FIELD in error["message"]
    assert service.calls == []


def test_an_image_to_a_model_without_a_projector_is_refused(
    vision: FastAPI, service: FakeService
) -> None:
    response = call(vision, "POST", "/v1/chat/completions", body=chat(png_data_url(), "small"))
    error = assert_error(response, 400, param=FIELD, code="unsupported_value")
    assert "small takes no images: its config names no mmproj" in error["message"]
    assert service.calls == []


def test_the_marker_is_refused_in_text(vision: FastAPI, service: FakeService) -> None:
    body = chat(png_data_url(), text=f"sneaky {IMAGE_MARKER}")
    response = call(vision, "POST", "/v1/chat/completions", body=body)
    assert_error(response, 400, param="messages[0].content[0].text")
    plain = {"model": "tiny", "messages": [{"role": "user", "content": IMAGE_MARKER}]}
    assert_error(call(vision, "POST", "/v1/chat/completions", body=plain), 400)
    assert service.calls == []


def test_images_belong_in_user_messages(vision: FastAPI) -> None:
    body = chat(png_data_url())
    body["messages"][0]["role"] = "assistant"
    response = call(vision, "POST", "/v1/chat/completions", body=body)
    assert_error(response, 400, param=FIELD)


def test_a_request_carries_at_most_max_images(vision: FastAPI, service: FakeService) -> None:
    part = {"type": "image_url", "image_url": {"url": png_data_url(png(2, 2))}}
    content = [{"type": "text", "text": "count them"}, *[part] * (MAX_IMAGES + 1)]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    response = call(vision, "POST", "/v1/chat/completions", body=body)
    assert_error(response, 400, param=f"messages[0].content[{MAX_IMAGES + 1}]")
    assert service.calls == []


def test_images_too_large_for_the_worker_message_are_refused_by_part(
    vision: FastAPI, service: FakeService, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Images read from URLs were never in the body, which bounds the ones sent inline.
    service.vision["tiny"] = ImagePolicy("tiny", 64 * 1024, 256 * 256, allow_urls=True)
    small, large = png(4, 4), png(32, 32)
    (tmp_path / "small.png").write_bytes(small)
    (tmp_path / "large.png").write_bytes(large)
    ceiling = len(base64.b64encode(small)) + len(base64.b64encode(large)) - 1
    monkeypatch.setattr(httpapi, "MAX_IMAGES_MESSAGE_BYTES", ceiling)
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/small.png"}},
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/large.png"}},
    ]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    response = call(vision, "POST", "/v1/chat/completions", body=body)
    error = assert_error(response, 400, param="messages[0].content[2]", code="invalid_image")
    assert f"more than {ceiling} bytes as the engine takes them" in error["message"]
    assert service.calls == []
    monkeypatch.setattr(httpapi, "MAX_IMAGES_MESSAGE_BYTES", ceiling + 1)
    assert call(vision, "POST", "/v1/chat/completions", body=body).status_code == 200


def short_pixels_png() -> bytes:
    """A PNG whose chunks are all whole but whose pixel data is half what IHDR promises."""
    whole = png(16, 16)
    header = whole[8 : 8 + 25]  # the IHDR chunk, CRC included
    rows = zlib.compress(b"".join(b"\x00" + bytes(48) for _ in range(8)))
    idat = struct.pack(">I", len(rows)) + b"IDAT" + rows
    idat += struct.pack(">I", zlib.crc32(b"IDAT" + rows) & 0xFFFFFFFF)
    return whole[:8] + header + idat + whole[-12:]


def test_a_png_whose_pixels_end_early_is_truncated(vision: FastAPI) -> None:
    response = call(vision, "POST", "/v1/chat/completions", body=chat(data_url(short_pixels_png())))
    error = assert_error(response, 400, param=FIELD, code="invalid_image")
    assert "pixel data ends early" in error["message"]


# -- WebP: converted to PNG at the edge -------------------------------------------------------


def sent_image(service: FakeService) -> Image.Image:
    """The one image the engine was sent, checked to be a PNG, decoded."""
    (data,) = service.calls[-1][2]["images"]
    raw = base64.b64decode(data)
    assert raw.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(BytesIO(raw), formats=["PNG"])
    image.load()
    return image


def decoded(data: bytes) -> Image.Image:
    """libwebp's pixels for the WebP `data`, as Pillow decodes them."""
    image = Image.open(BytesIO(data), formats=["WEBP"])
    image.load()
    return image


def test_a_lossless_webp_reaches_the_engine_as_a_png_of_the_same_pixels(
    vision: FastAPI, service: FakeService
) -> None:
    url = data_url(webp(24, 12, lossless=True, seed=3), "image/webp")
    response = call(vision, "POST", "/v1/chat/completions", body=chat(url))
    assert response.status_code == 200, response.text
    assert service.calls[-1][2]["messages"][0]["content"] == f"what is this\n{IMAGE_MARKER}"
    image = sent_image(service)
    assert image.mode == "RGB"
    assert image.tobytes() == pattern(24, 12, seed=3).tobytes()


@pytest.mark.parametrize(
    ("options", "mode"),
    [
        ({}, "RGB"),
        ({"alpha": True}, "RGBA"),
        ({"alpha": True, "lossless": True}, "RGBA"),
    ],
    ids=["lossy", "lossy with alpha", "lossless with alpha"],
)
def test_a_webp_reaches_the_engine_as_a_png_of_its_decoded_pixels(
    vision: FastAPI, service: FakeService, options: dict[str, bool], mode: str
) -> None:
    # Alpha is kept: the worker's decoder drops it (it asks stb_image for RGB), as it does for
    # a PNG sent with alpha.
    data = webp(40, 30, seed=5, **options)
    response = call(vision, "POST", "/v1/chat/completions", body=chat(data_url(data)))
    assert response.status_code == 200, response.text
    image = sent_image(service)
    assert image.size == (40, 30)
    assert image.mode == mode
    assert image.tobytes() == decoded(data).tobytes()
    if mode == "RGBA":  # the alpha ramp made it through: transparent left, opaque right
        alpha = image.getchannel("A").tobytes()
        assert alpha[0] < 16
        assert alpha[39] > 239


def without_last_frame(animation: bytes) -> bytes:
    """`animation` (a WebP of two frames) less its last ANMF chunk: an animation of one frame."""
    last = animation.rindex(b"ANMF")
    data = animation[:last]
    return data[:4] + struct.pack("<I", len(data) - 8) + data[8:]


def test_an_animated_webp_of_one_frame_is_taken(vision: FastAPI, service: FakeService) -> None:
    data = without_last_frame(webp(16, 16, frames=2, lossless=True))
    assert data[12:16] == b"VP8X"
    assert data[20] & 0x02  # the animation flag
    assert data.count(b"ANMF") == 1
    response = call(vision, "POST", "/v1/chat/completions", body=chat(data_url(data)))
    assert response.status_code == 200, response.text
    assert sent_image(service).tobytes() == pattern(16, 16).tobytes()


def huge_webp_header(width: int, height: int) -> bytes:
    """A VP8X WebP that claims a `width` x `height` canvas and holds no pixel data at all:
    decoding it would fail as corrupt, so a refusal for its size was made before any decoding."""
    vp8x = (
        bytes([0, 0, 0, 0]) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    )
    chunk = b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def truncated_webp() -> bytes:
    return webp(32, 32)[:-20]


def corrupt_webp() -> bytes:
    """Whole chunks whose VP8 bitstream is garbage after its frame header."""
    data = bytearray(webp(32, 32))
    data[40:] = bytes(b ^ 0x5A for b in data[40:])
    return bytes(data)


WEBP_BAD: list[tuple[str, bytes, str]] = [
    ("truncated", truncated_webp(), "a truncated WebP"),
    ("corrupt", corrupt_webp(), "a corrupt or truncated WebP"),
    ("no header", b"RIFF\x04\x00\x00\x00WEBP", "a truncated WebP (no chunks)"),
    ("not vp8", b"RIFF\x0c\x00\x00\x00WEBPJUNK\x00\x00\x00\x00", "a corrupt WebP"),
    ("animated", webp(16, 16, frames=3), "an animated WebP (3 frames)"),
    (
        "too many pixels",
        webp(300, 300, lossless=True),
        "300x300 pixels, more than max_image_pixels",
    ),
    ("huge canvas", huge_webp_header(1 << 16, 1 << 16), "65536x65536 pixels, more than"),
]


@pytest.mark.parametrize(
    ("data", "message"), [b[1:] for b in WEBP_BAD], ids=[b[0] for b in WEBP_BAD]
)
def test_a_bad_webp_is_a_400_naming_its_field(
    vision: FastAPI, service: FakeService, data: bytes, message: str
) -> None:
    response = call(vision, "POST", "/v1/chat/completions", body=chat(data_url(data, "image/webp")))
    error = assert_error(response, 400, param=FIELD, code="invalid_image")
    assert message in error["message"]
    assert FIELD in error["message"]
    assert service.calls == []


def test_a_webp_over_the_pixel_limit_never_reaches_pillow(
    vision: FastAPI, service: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("Pillow was asked to open a WebP over the pixel limit")

    monkeypatch.setattr(Image, "open", no_decoding)
    for data in (webp(300, 300, lossless=True), huge_webp_header(16384, 16384)):
        response = call(vision, "POST", "/v1/chat/completions", body=chat(data_url(data)))
        assert "more than max_image_pixels" in assert_error(response, 400)["message"]
    assert service.calls == []


def test_a_webp_counts_as_its_png_against_the_worker_message(
    vision: FastAPI, service: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ceiling fits both images as sent, not the WebP's PNG, which is larger.
    small, packed = png(4, 4), webp(32, 32, lossless=True)
    ceiling = len(base64.b64encode(small)) + len(base64.b64encode(packed))
    monkeypatch.setattr(httpapi, "MAX_IMAGES_MESSAGE_BYTES", ceiling)
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": png_data_url(small)}},
        {"type": "image_url", "image_url": {"url": data_url(packed, "image/webp")}},
    ]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    response = call(vision, "POST", "/v1/chat/completions", body=body)
    error = assert_error(response, 400, param="messages[0].content[2]", code="invalid_image")
    assert f"more than {ceiling} bytes as the engine takes them" in error["message"]
    assert service.calls == []


def test_pillow_is_imported_only_when_a_webp_arrives(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png())
    (tmp_path / "a.jpeg").write_bytes(jpeg())
    (tmp_path / "a.webp").write_bytes(webp())
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from arbiterd.daemon.http import images\n"
        "from arbiterd.daemon.service import ImagePolicy\n"
        "def pillow(): return [m for m in sys.modules if m.partition('.')[0] == 'PIL']\n"
        "policy = ImagePolicy('m', 1 << 20, 1 << 20, allow_urls=False)\n"
        "for name in ('a.png', 'a.jpeg', 'a.webp'):\n"
        f"    images.check(name, Path({str(tmp_path)!r}, name).read_bytes(), policy)\n"
        "    print(name, bool(pillow()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.split("\n") == ["a.png False", "a.jpeg False", "a.webp True", ""]


# -- past responses keep their images within [daemon] responses_budget (issue 40) -------------

BUDGET_BYTES = 1 << 20


def noise_png(side: int, seed: int) -> bytes:
    """A PNG of random pixels: it does not compress, so its file is about 3 x side² bytes."""
    pixels = random.Random(seed).randbytes(side * side * 3)
    out = BytesIO()
    Image.frombytes("RGB", (side, side), pixels).save(out, format="PNG")
    return out.getvalue()


def image_input(image: bytes, text: str = "what is this") -> list[dict[str, Any]]:
    content = [
        {"type": "input_text", "text": text},
        {"type": "input_image", "image_url": png_data_url(image)},
    ]
    return [{"role": "user", "content": content}]


def test_past_responses_stay_within_the_budget_in_bytes_the_oldest_forgotten_first(
    service: FakeService,
) -> None:
    service.vision["tiny"] = ImagePolicy("tiny", 8 << 20, 1024 * 1024, allow_urls=False)
    app = create_app(service, responses_budget_bytes=BUDGET_BYTES)
    past = app.state.past_responses
    ids = []
    with serving(app) as url, httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
        # Each about 410 KB as its data: URL: two fit the 1 MiB budget, three do not.
        for seed in range(6):
            body = {"model": "tiny", "input": image_input(noise_png(320, seed))}
            if seed == 3:  # a streamed response is kept (and bounded) the same way
                answered = client.post("/v1/responses", json={**body, "stream": True})
                assert answered.status_code == 200, answered.text
                events = [
                    json.loads(line.removeprefix("data: "))
                    for line in answered.text.splitlines()
                    if line.startswith("data: {")
                ]
                assert events[-1]["type"] == "response.completed"
                ids.append(events[-1]["response"]["id"])
            else:
                answered = client.post("/v1/responses", json=body)
                assert answered.status_code == 200, answered.text
                ids.append(answered.json()["id"])
            assert 0 < past.bytes_ <= BUDGET_BYTES
        for old in ids[:4]:
            follow = {"model": "tiny", "input": "and then?", "previous_response_id": old}
            error = assert_error(client.post("/v1/responses", json=follow), 404)
            assert error["code"] == "previous_response_not_found"
            assert "responses_budget = 1.0 MiB" in error["message"]
        follow = {"model": "tiny", "input": "and then?", "previous_response_id": ids[-1]}
        assert client.post("/v1/responses", json=follow).status_code == 200
    (_, _, body) = service.calls[-1]
    assert len(body["images"]) == 1  # the remembered turn kept its image


def test_a_response_larger_than_the_whole_budget_is_not_kept(service: FakeService) -> None:
    service.vision["tiny"] = ImagePolicy("tiny", 8 << 20, 1024 * 1024, allow_urls=False)
    app = create_app(service, responses_budget_bytes=BUDGET_BYTES)
    past = app.state.past_responses
    with serving(app) as url, httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
        small = client.post("/v1/responses", json={"model": "tiny", "input": "hello"})
        kept = past.bytes_
        # About 1.4 MB as its data: URL: the engine takes it, the budget cannot keep it.
        body = {"model": "tiny", "input": image_input(noise_png(600, 7))}
        large = client.post("/v1/responses", json=body)
        assert large.status_code == 200, large.text
        assert past.bytes_ == kept  # neither kept nor making room by forgetting others
        follow = {"model": "tiny", "input": "and?", "previous_response_id": large.json()["id"]}
        error = assert_error(client.post("/v1/responses", json=follow), 404)
        assert error["code"] == "previous_response_not_found"
        follow["previous_response_id"] = small.json()["id"]
        assert client.post("/v1/responses", json=follow).status_code == 200
