"""What a web page in the owner's browser can send to the HTTP API (issue 24 item 3): the requests
a browser makes for a page, each refused before the app sees it, and the clients that are not
browsers still served. Through a real HttpServer in this process (the checks are per listener),
and against a real daemon for the routes and the client libraries."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from openai.types.chat import ChatCompletionMessageParam
from starlette.types import Receive, Scope, Send

from arbiterd.daemon.http.browsers import PREFLIGHT_MAX_AGE_S, accepted_hosts, host_name
from arbiterd.daemon.http.peers import Peer
from arbiterd.daemon.http.server import UnixListener
from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.inprocess_http import DEADLINE_S, Served
from tests.support.inprocess_http import serving as serving_http

PAGE = "http://evil.example"  # a page the owner happens to visit
REBOUND = "evil.example:8642"  # its host name, pointed at 127.0.0.1 (DNS rebinding)
ALLOWED = "http://localhost:3000"  # a web UI the owner runs, listed in allow_origins
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": ASK}
BODY = json.dumps(CHAT)
# What browsers send with a page's request: the type of a simple request's body (a fetch() of a
# string, and the three encodings of an HTML form).
TEXT_PLAIN = "text/plain;charset=UTF-8"
FORM_TYPES = ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain"]
JSON_TYPE = "application/json"
POST_ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/api/chat",
    "/api/generate",
    "/api/embed",
]


class Recorder:
    """The app behind the checks: 200 "hello" on every path, and a record of what reached it."""

    def __init__(self) -> None:
        self.reached: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.reached.append(f"{scope['method']} {scope['path']}")
        headers = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"hello"})


@pytest.fixture
def app() -> Recorder:
    return Recorder()


@pytest.fixture
def served(app: Recorder) -> Iterator[Served]:
    with serving_http(
        app=app, peer=Peer(os.getuid()), allow_origins=frozenset({ALLOWED})
    ) as running:
        yield running


def error(response: httpx.Response) -> dict[str, Any]:
    payload = response.json()
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "code", "param"}
    found: dict[str, Any] = payload["error"]
    return found


# -- what a page sends --------------------------------------------------------------------------


def test_a_cross_origin_text_plain_post_is_refused(served: Served, app: Recorder) -> None:
    # fetch("http://127.0.0.1:8642/v1/chat/completions", {method: "POST", mode: "no-cors",
    # body: JSON.stringify(...)}): a simple request, sent without a preflight.
    headers = {"origin": PAGE, "content-type": TEXT_PLAIN, "sec-fetch-mode": "no-cors"}
    response = httpx.post(f"{served.url}/v1/chat/completions", content=BODY, headers=headers)
    assert response.status_code == 403
    assert error(response)["code"] == "origin_not_allowed"
    assert PAGE in error(response)["message"]
    assert "access-control-allow-origin" not in response.headers
    assert app.reached == []


@pytest.mark.parametrize("content_type", FORM_TYPES)
def test_a_form_post_is_refused(served: Served, app: Recorder, content_type: str) -> None:
    # <form method="post" enctype="text/plain"> can even spell JSON: <input name='{"model":
    # "tiny", "prompt": "' value='"}'>. Browsers send Origin with it; some sent none, or "null".
    url = f"{served.url}/api/generate"
    form = '{"model": "tiny", "prompt": "="}'
    for origin, status, code in [
        (PAGE, 403, "origin_not_allowed"),
        ("null", 403, "origin_not_allowed"),
        (None, 415, "unsupported_media_type"),
    ]:
        headers = {"content-type": content_type, **({"origin": origin} if origin else {})}
        response = httpx.post(url, content=form, headers=headers)
        assert (response.status_code, error(response)["code"]) == (status, code), origin
    assert app.reached == []


def test_a_dns_rebinding_host_is_misdirected(served: Served, app: Recorder) -> None:
    # Once evil.example points at 127.0.0.1, the page is same-origin with the API: its GET
    # carries no Origin, its POST the page's own. Only Host still names the page's host.
    same_origin = f"http://{REBOUND}"
    for method, headers in [
        ("GET", {"host": REBOUND}),
        ("POST", {"host": REBOUND, "origin": same_origin, "content-type": JSON_TYPE}),
    ]:
        response = httpx.request(method, f"{served.url}/v1/models", headers=headers, content=BODY)
        assert response.status_code == 421, method
        assert error(response)["code"] == "misdirected_request"
        assert repr(REBOUND) in error(response)["message"]
    assert app.reached == []


def test_an_origin_that_is_not_allowed_is_refused(served: Served, app: Recorder) -> None:
    response = httpx.get(f"{served.url}/v1/models", headers={"origin": PAGE})
    assert response.status_code == 403
    assert "allow_origins" in error(response)["message"]
    assert app.reached == []


def test_a_preflight_is_refused_unless_its_origin_is_allowed(served: Served, app: Recorder) -> None:
    # What a page's fetch() with a JSON body (or an Authorization header) asks first.
    asked = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type,x-stainless-lang",
    }
    url = f"{served.url}/v1/chat/completions"
    refused = httpx.options(url, headers={"origin": PAGE, **asked})
    assert refused.status_code == 403
    assert "access-control-allow-origin" not in refused.headers

    allowed = httpx.options(
        url,
        headers={"origin": ALLOWED, "access-control-request-private-network": "true", **asked},
    )
    assert allowed.status_code == 204
    assert allowed.headers["access-control-allow-origin"] == ALLOWED
    assert allowed.headers["access-control-allow-methods"] == "GET, POST"
    assert (
        allowed.headers["access-control-allow-headers"] == asked["access-control-request-headers"]
    )
    assert allowed.headers["access-control-max-age"] == str(PREFLIGHT_MAX_AGE_S)
    assert allowed.headers["access-control-allow-private-network"] == "true"
    assert allowed.headers["vary"] == "Origin"
    assert app.reached == []  # a preflight is answered before the app

    posted = httpx.post(url, content=BODY, headers={"origin": ALLOWED, "content-type": JSON_TYPE})
    assert posted.text == "hello"
    assert posted.headers["access-control-allow-origin"] == ALLOWED
    assert app.reached == ["POST /v1/chat/completions"]


def test_an_allowed_origin_may_read_its_refusals(served: Served, app: Recorder) -> None:
    response = httpx.post(f"{served.url}/v1/completions", content=BODY, headers={"origin": ALLOWED})
    assert response.status_code == 415
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert app.reached == []


def test_a_websocket_a_page_opens_is_refused_like_any_request(
    served: Served, app: Recorder
) -> None:
    # new WebSocket("ws://127.0.0.1:8642/"): no CORS applies to it. uvicorn would have handed
    # the connection to its WebSocket protocol, which serves the app past every check.
    upgrade = (
        f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{served.port}\r\nOrigin: {PAGE}\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", served.port), timeout=DEADLINE_S) as client:
        client.sendall(upgrade.encode())
        answer = b""
        while not answer.endswith(b"}}"):  # the error envelope's end
            chunk = client.recv(65536)
            assert chunk, f"closed after {answer!r}"
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 403 "), answer[:100]
    assert b"origin_not_allowed" in answer
    assert app.reached == []


# -- what clients that are not browsers send ------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_json_bodies_are_served_with_or_without_parameters(
    served: Served, app: Recorder, content_type: str
) -> None:
    response = httpx.post(
        f"{served.url}/v1/completions", content=BODY, headers={"content-type": content_type}
    )
    assert response.text == "hello"
    assert "access-control-allow-origin" not in response.headers  # no Origin, no CORS


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/json"])
def test_a_post_that_is_not_json_is_unsupported(
    served: Served, app: Recorder, content_type: str
) -> None:
    # curl -d sends application/x-www-form-urlencoded.
    response = httpx.post(
        f"{served.url}/api/chat", content=BODY, headers={"content-type": content_type}
    )
    assert response.status_code == 415
    assert "Content-Type: application/json" in error(response)["message"]
    assert app.reached == []


def test_a_post_with_no_type_is_served_only_without_an_origin(
    served: Served, app: Recorder
) -> None:
    # litellm's Ollama providers and requests' data= with a string send no type, and no
    # Origin: no browser's POST lacks one (issue 40). A page's fetch() of an untyped Blob
    # carries its Origin, refused unless allowed, and even an allowed one must send JSON.
    url = f"{served.url}/api/chat"
    assert httpx.post(url, content=BODY).text == "hello"
    assert "content-type" not in httpx.Request("POST", url, content=BODY).headers
    for origin, status, code in [
        (PAGE, 403, "origin_not_allowed"),
        ("null", 403, "origin_not_allowed"),
        (ALLOWED, 415, "unsupported_media_type"),
    ]:
        response = httpx.post(url, content=BODY, headers={"origin": origin})
        assert (response.status_code, error(response)["code"]) == (status, code), origin
    assert app.reached == ["POST /api/chat"]


@pytest.mark.parametrize(
    "host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "127.0.0.2:9", "[::1]:{port}"]
)
def test_loopback_hosts_are_served(served: Served, app: Recorder, host: str) -> None:
    response = httpx.get(served.url, headers={"host": host.format(port=served.port)})
    assert response.text == "hello"


def test_the_unix_socket_takes_any_host_and_still_checks_origin_and_type(
    tmp_path: Path, app: Recorder
) -> None:
    with (
        UnixListener.bind(tmp_path / "api.sock") as api,
        serving_http(app=app, listeners=[api.sock]),
        httpx.Client(transport=httpx.HTTPTransport(uds=str(api.path))) as client,
    ):
        assert client.get("http://arbiterd/").text == "hello"
        assert client.get("http://localhost/", headers={"host": REBOUND}).text == "hello"
        assert client.get("http://arbiterd/", headers={"origin": PAGE}).status_code == 403
        url = "http://arbiterd/v1/completions"
        posted = client.post(url, content=BODY, headers={"content-type": TEXT_PLAIN})
        assert posted.status_code == 415
        assert client.post(url, content=BODY).text == "hello"  # no type, no Origin
    assert app.reached == ["GET /", "GET /", "POST /v1/completions"]


def test_host_names_are_read_from_every_form_of_host() -> None:
    assert host_name("Example.COM:8642") == "example.com"
    assert host_name("localhost") == "localhost"
    assert host_name("[::1]:8642") == "::1"
    assert host_name("[::1]") == "::1"
    for malformed in ["", ":8642", "[::1", "[::1]x", "a:b", "a:1:2", "::1", "a:", "a:\u0661"]:
        assert host_name(malformed) is None, malformed


def test_a_daemon_off_loopback_answers_to_its_configured_host() -> None:
    assert accepted_hosts("127.0.0.1") == frozenset({"localhost", "127.0.0.1"})
    assert accepted_hosts("MyBox.lan") == frozenset({"localhost", "mybox.lan"})
    assert accepted_hosts("192.0.2.7") == frozenset({"localhost", "192.0.2.7"})
    # A wildcard address names no host; such a daemon has an api_key (the config insists).
    assert accepted_hosts("0.0.0.0") is None
    assert accepted_hosts("::") is None


# -- a real daemon ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    with serving({"tiny": tiny(tiny_model)}) as running:
        yield running


def _requests_served(daemon: Daemon) -> float:
    metrics = httpx.get(daemon.url.removesuffix("/v1") + "/metrics").text
    return sum(
        float(line.rpartition(" ")[2])
        for line in metrics.splitlines()
        if line.startswith("arbiterd_requests_total{")
    )


@pytest.mark.parametrize("route", POST_ROUTES)
def test_no_route_of_the_daemon_takes_what_a_page_sends(daemon: Daemon, route: str) -> None:
    url = daemon.url.removesuffix("/v1") + route
    before = _requests_served(daemon)
    plain = httpx.post(url, content=BODY, headers={"content-type": TEXT_PLAIN})
    foreign = httpx.post(url, content=BODY, headers={"origin": PAGE, "content-type": JSON_TYPE})
    rebound = httpx.post(url, json=CHAT, headers={"host": REBOUND})
    assert [answer.status_code for answer in (plain, foreign, rebound)] == [415, 403, 421]
    assert _requests_served(daemon) == before  # none reached a worker


def test_real_clients_are_still_served(daemon: Daemon) -> None:
    # The openai SDK and the ollama client send application/json, and the Host of the URL.
    with openai_client(daemon) as api:
        answer = api.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert answer.choices[0].finish_reason in {"stop", "length"}
    client = ollama.Client(host=daemon.url.removesuffix("/v1"), timeout=60)
    try:
        generated = client.generate(model="tiny", prompt="hi", options={"num_predict": 2})
        chatted = client.chat(model="tiny", messages=ASK, options={"num_predict": 2})
    finally:
        client.close()  # type: ignore[no-untyped-call]  # ollama leaves it unannotated
    assert generated.done
    assert chatted.done
