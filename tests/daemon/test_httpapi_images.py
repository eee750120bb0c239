"""Images at the HTTP edge (issue 12): OpenAI image parts are checked against the model's
policy and reach the engine as base64 with a marker in the text; every bad one is a 400 that
names its field."""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from arbiterd.daemon import httpapi
from arbiterd.daemon.httpapi import create_app
from arbiterd.daemon.images import ImagePolicy
from arbiterd.spec import IMAGE_MARKER, MAX_IMAGES
from tests.daemon.test_httpapi import FakeService, assert_error, call
from tests.support.images import jpeg, png, png_data_url

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
    ("a webp", data_url(b"RIFF\x00\x00\x00\x00WEBPVP8 ", "image/webp"), "a WebP image"),
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
