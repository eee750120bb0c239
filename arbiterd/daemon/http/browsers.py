"""What the HTTP API takes from web browsers: owns the checks that keep a web page the owner
visits from using the API (issue 24), as an ASGI wrapper the HTTP server puts around the app on
each listener. Reads only a request's head: never its body, never a route.

A browser runs as the owner, so the peer check (arbiterd.daemon.http.peers) lets its connections in,
and without these checks any page could:
- send a *simple* cross-origin request, which a browser sends without asking the server first
  (no CORS preflight): a POST whose Content-Type is text/plain, a form's
  application/x-www-form-urlencoded or multipart/form-data. The page cannot read the answer, but
  the request runs: a generation, or a request that knocks a model offline.
- read the answers too, by DNS rebinding: the page's host name, pointed at 127.0.0.1 once the
  page has loaded, makes the API the page's own origin. Only the Host header, which still
  names the page's host, tells.

The checks, in order, each answered in the OpenAI error envelope:
1. Host (TCP only): the configured listen host, `localhost`, or a loopback address (127.0.0.0/8,
   [::1]), with any port (a tunnel such as `ssh -L` changes the port, and rebinding changes only
   the name), else 421. A wildcard listen address (0.0.0.0, ::) names no host, so any is taken
   there; such a daemon has an api_key (the config insists), which a page cannot send without a
   preflight. No browser can open a Unix socket, and clients write any name there (curl
   `--unix-socket` and httpx send the URL's host, whatever it is): Host is not checked on
   api.sock.
2. Origin: browsers send it on every cross-origin request, every POST and every WebSocket
   (arbiterd.daemon.http.server never upgrades one: it is a request like others). A request
   that carries one must name an origin in `[daemon] allow_origins`, else 403. A preflight
   (OPTIONS with Access-Control-Request-Method) from an allowed origin is answered here, and
   answers to an allowed origin carry Access-Control-Allow-Origin, so that its page may read
   them.
3. Content-Type of a POST: application/json (parameters such as `; charset=utf-8` allowed),
   else 415. A page can send JSON only after a preflight, which 2 refuses; POST is the only
   method of a simple request that has a body. A POST with no Content-Type at all is taken
   when it has no Origin either (issue 40: litellm's Ollama providers send no type): a
   browser sends Origin with every POST (the Fetch standard, "append a request `Origin`
   header"), a page's fetch() of an untyped Blob included, and an HTML form always has a type.
Both listeners check 2 and 3: a relay (socat) in front of api.sock would put a browser there.
"""

from __future__ import annotations

import ipaddress

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from arbiterd.config import is_loopback
from arbiterd.daemon.http.app import IGNORED_HEADER
from arbiterd.daemon.http.openai_requests import ApiError

JSON_MEDIA_TYPE = "application/json"
# A preflight's answer: what an allowed origin's page may send, and how long its browser may
# remember that.
CORS_METHODS = "GET, POST"
PREFLIGHT_MAX_AGE_S = 600
MAX_SHOWN_CHARS = 60  # of a refused header's value, in an error message


def accepted_hosts(listen_host: str) -> frozenset[str] | None:
    """The host names a request's Host header may give on the TCP port the daemon listens on
    at `listen_host` (as the config writes it, IPv6 without brackets), besides loopback
    addresses; None: any, for a wildcard address, which names no host."""
    try:
        if ipaddress.ip_address(listen_host).is_unspecified:
            return None
    except ValueError:
        pass  # a host name
    return frozenset({"localhost", listen_host.lower()})


def host_name(value: str) -> str | None:
    """The name in a Host header ("name", "name:port", "[v6]", "[v6]:port"), lowercased and
    without brackets; None when it is not one."""
    if value.startswith("["):
        name, bracket, port = value[1:].partition("]")
        if not bracket:
            return None
    else:
        name, colon, number = value.partition(":")
        port = colon + number
    if port and not (port[0] == ":" and port[1:].isascii() and port[1:].isdigit()):
        return None
    return name.lower() or None


def _shown(value: str) -> str:
    shown = repr(value)
    return shown if len(shown) <= MAX_SHOWN_CHARS else shown[: MAX_SHOWN_CHARS - 3] + "..."


def _misdirected(host: str | None, hosts: frozenset[str]) -> ApiError | None:
    """Check 1; the refusal, or None."""
    name = None if host is None else host_name(host)
    if name is not None and (name in hosts or is_loopback(name)):
        return None
    named = "no Host header" if host is None else f"the Host {_shown(host)}"
    return ApiError(
        421,
        f"this request names {named}, and this arbiterd answers only to "
        f"{', '.join(sorted(hosts))} or a loopback address: a web page whose own host name was "
        "pointed at this address (DNS rebinding) would name its own host; use one of those in "
        "the URL",
        code="misdirected_request",
    )


def _foreign_origin(origins: list[str], allowed: frozenset[str]) -> ApiError | None:
    """Check 2; the refusal, or None."""
    for origin in origins:
        if origin in allowed:
            continue
        page = (
            "a web page without an origin (a sandboxed or file:// page)"
            if origin == "null"
            else f"a web page at {_shown(origin)}"
        )
        return ApiError(
            403,
            f"this request comes from {page}, and web pages may not use this API unless the "
            "owner lists their origin in [daemon] allow_origins",
            code="origin_not_allowed",
        )
    return None


def _not_json(content_types: list[str], *, origin: str | None) -> ApiError | None:
    """Check 3, for a POST that carries `origin` (None: no Origin); the refusal, or None."""
    if not content_types and origin is None:
        return None  # not a browser's: see the module's docstring
    if len(content_types) == 1:
        media_type = content_types[0].partition(";")[0].strip().lower()
        if media_type == JSON_MEDIA_TYPE:
            return None
    sent = (
        "no Content-Type"
        if not content_types
        else f"the Content-Type {', '.join(_shown(given) for given in content_types)}"
    )
    return ApiError(
        415,
        f"this request has {sent}: a body must be JSON, sent with 'Content-Type: "
        f"{JSON_MEDIA_TYPE}' (curl: --json, or -H 'Content-Type: {JSON_MEDIA_TYPE}' with -d)",
        code="unsupported_media_type",
    )


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-expose-headers", IGNORED_HEADER.encode()),
        (b"vary", b"Origin"),
    ]


def _preflight_headers(origin: str, headers: Headers) -> list[tuple[bytes, bytes]]:
    """The answer to an allowed origin's preflight: the methods the API has, the headers the
    page asked to send (its owner trusts it: the openai SDK sends several x-stainless-*), and,
    for Chrome's Private Network Access, leave for a public page to reach this host."""
    answer = [
        *_cors_headers(origin),
        (b"access-control-allow-methods", CORS_METHODS.encode()),
        (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
    ]
    asked = headers.get("access-control-request-headers")
    if asked:
        answer.append((b"access-control-allow-headers", asked.encode("latin-1")))
    if headers.get("access-control-request-private-network", "").lower() == "true":
        answer.append((b"access-control-allow-private-network", b"true"))
    return answer


def _adding(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    """`send` with `headers` added to the response's."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return sending


def guard(app: ASGIApp, *, hosts: frozenset[str] | None, origins: frozenset[str]) -> ASGIApp:
    """`app` behind the browser checks: `hosts` as accepted_hosts gives them (None: Host is not
    checked), `origins` the allowed origins ([daemon] allow_origins)."""

    async def checked(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        sent_origins = headers.getlist("origin")
        refusal = None if hosts is None else _misdirected(headers.get("host"), hosts)
        if refusal is None:
            refusal = _foreign_origin(sent_origins, origins)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        origin = sent_origins[0] if sent_origins else None
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        if origin is not None and preflight:
            start = {"status": 204, "headers": _preflight_headers(origin, headers)}
            await send({"type": "http.response.start", **start})
            await send({"type": "http.response.body", "body": b""})
            return
        reply = send if origin is None else _adding(send, _cors_headers(origin))
        if scope["method"] == "POST":
            refusal = _not_json(headers.getlist("content-type"), origin=origin)
            if refusal is not None:
                await refusal.response()(scope, receive, reply)
                return
        await app(scope, receive, reply)

    return checked
