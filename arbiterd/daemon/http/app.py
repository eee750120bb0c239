"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions (streamed as
server-sent events or not), /v1/embeddings, /health and /metrics; /v1/responses as a chat
request (responses.py translates); and for any other route a 404 that names it.

Owns the routes, the bearer-token check and the refusal of users it does not serve (which
connections those are, server.py decides); streams are streams.py's, and arbiterd's errors
become OpenAI's error envelope in envelopes.py.
A body is checked field by field once, by openai_requests.py, into the one record the service
runs (arbiterd.request.GenerateRequest); what needs the config is checked here, once.
Talks to the daemon only through `Service`. Must never answer bad input with a 500 or a bare
string, never leave a stream open after its client has gone, and never import the engine
(llama_cpp loads native libraries the daemon process has no use for).

Guard ladder for a request: bearer token → body size (Content-Length, then the bytes actually
read) → JSON (every string valid Unicode, integers, nesting and containers bounded: jsonbody.py)
→ the body's fields (openai_requests.py), both on a parsing thread for a large body → model
exists (looked up once: `Service.model`) → strict_api → the priority header → images against
the model's policy. The service gets the record and the model's configured name; the answer
names the model as the client did.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import struct
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from arbiterd.config import RESPONSES_BUDGET_BYTES
from arbiterd.daemon.http import images, infill, jsonbody, ollama, responses
from arbiterd.daemon.http.envelopes import api_error, client_left, internal_error, unknown_model
from arbiterd.daemon.http.openai_requests import (
    PRIORITY_HEADER,
    ApiError,
    ApiRequest,
    parse_embedding_request,
    parse_priority_header,
    parse_request,
)
from arbiterd.daemon.http.streams import EventStream, close_chunks, unless_disconnected
from arbiterd.daemon.service import ImagePolicy, ServedModel, Service
from arbiterd.errors import (
    ArbiterError,
    RequestError,
)
from arbiterd.procs import WaitNews
from arbiterd.request import GenerateRequest
from arbiterd.spec import MAX_IMAGES, Capability, kind_refusal
from arbiterd.states import RequestKind
from arbiterd.status import ModelStatus
from arbiterd.wire import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
# A chat request reaches its worker as one wire message: the record, its data: URLs replaced by
# markers, and its images in base64. A worker answers a longer line with an error that names
# no request, which would leave the request waiting, so the images get what the largest body
# leaves. Images sent inline as PNG or JPEG fit by construction; a WebP goes as PNG, several
# times its size, and an image fetched from a URL (allow_image_urls) was never in the body.
MAX_IMAGES_MESSAGE_BYTES = MAX_MESSAGE_BYTES - MAX_BODY_BYTES
# The text format prometheus_client.generate_latest() writes. prometheus_client >= 0.22 points
# CONTENT_TYPE_LATEST at version=1.0.0, which is only right after content negotiation.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The response header that names the fields a request sent which changed nothing here.
IGNORED_HEADER = "x-arbiterd-ignored"
# A body larger than this is parsed on a parsing thread (issue 40: an 8 MiB body parsed on the
# event loop held /health for seconds). jsonbody.py bounds what parsing may hold the GIL for,
# so the loop gets its turns. One this size parses in a few milliseconds at worst, so it is
# parsed on the loop, where it never waits behind large ones for a parsing thread.
INLINE_BODY_BYTES = 64 * 1024
# Bodies parsed at once; others wait their turn. Parsing is CPU work under the GIL, which more
# threads would not speed up, and each holds a body's parsed copy.
MAX_PARSES_AT_ONCE = 2
_parsing = ThreadPoolExecutor(MAX_PARSES_AT_ONCE, thread_name_prefix="json-body")
_Built = TypeVar("_Built")


def _as_is(document: object) -> object:
    return document


async def _parse_json(raw: bytes, build: Callable[[object], _Built]) -> _Built:
    """`build` of the body as JSON whose every string is valid Unicode and every integer of a
    size int() takes (jsonbody.py), or a 400 naming the field. A body of more than
    INLINE_BODY_BYTES is parsed and built on a parsing thread, so the event loop goes on
    serving meanwhile; `build` must touch nothing the loop owns."""

    def parse_and_build() -> _Built:
        try:
            document = jsonbody.parse(raw)
        except jsonbody.BodyRefused as exc:
            raise ApiError(400, str(exc), code=exc.code, param=exc.param) from None
        return build(document)

    if len(raw) <= INLINE_BODY_BYTES:
        return parse_and_build()
    return await asyncio.get_running_loop().run_in_executor(_parsing, parse_and_build)


async def _read_body(request: Request, limit_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit_bytes`."""
    too_large = ApiError(
        413, f"the request body exceeds {limit_bytes} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "the Content-Length header is not a number")
        if int(declared) > limit_bytes:
            raise too_large
    body = bytearray()
    # Checked again while reading: a chunked body has no Content-Length, and one may lie.
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise too_large
    return bytes(body)


def _encoded(response: dict[str, Any]) -> dict[str, Any]:
    """An embedding response with each vector as base64 of its little-endian float32s (the
    engine's numbers are float32 values: nothing is lost)."""
    data = []
    for item in response["data"]:
        vector = item["embedding"]
        packed = struct.pack(f"<{len(vector)}f", *vector)
        data.append({**item, "embedding": base64.b64encode(packed).decode("ascii")})
    return {**response, "data": data}


# -- who is served ----------------------------------------------------------------------------


def _has_api_key(headers: Headers, api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    )


def refuse_stranger(app: ASGIApp, *, api_key: str, reason: str) -> ASGIApp:
    """`app` as served on a connection from a user it does not serve: a request that carries the
    API key goes on to `app`; any other is a 403 before routing, `reason` its message, and the
    connection is closed after it."""

    async def gate(scope: Scope, receive: Receive, send: Send) -> None:
        if api_key and _has_api_key(Headers(scope=scope), api_key):
            await app(scope, receive, send)
            return
        refusal = ApiError(403, reason, code="user_not_allowed", headers={"connection": "close"})
        await refusal.response()(scope, receive, send)

    return gate


# -- the app ----------------------------------------------------------------------------------


def create_app(
    service: Service,
    *,
    api_key: str = "",
    max_body_bytes: int = MAX_BODY_BYTES,
    responses_budget_bytes: int = RESPONSES_BUDGET_BYTES,
) -> FastAPI:
    """The HTTP API over `service`. With `api_key`, every route but /health requires
    `Authorization: Bearer <api_key>`. /v1/responses keeps past responses within
    `responses_budget_bytes` ([daemon] responses_budget)."""
    created = int(time.time())
    app = FastAPI(title="arbiterd", docs_url=None, redoc_url=None, openapi_url=None)

    async def authorize(request: Request) -> None:
        if not api_key:
            return
        if not _has_api_key(request.headers, api_key):
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    guarded = [Depends(authorize)]

    async def on_api_error(request: Request, exc: Exception) -> Response:
        return api_error(exc, names).response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        codes = {404: "not_found", 405: "method_not_allowed"}
        detail = _not_served(request) if exc.status_code == 404 else str(exc.detail)
        return ApiError(
            exc.status_code,
            detail,
            code=codes.get(exc.status_code),
            headers=dict(exc.headers or {}),
        ).response()

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return ApiError(400, f"invalid request: {exc.errors()}").response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Starlette's ServerErrorMiddleware calls this, then re-raises for the server to log.
        return internal_error().response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(ArbiterError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)

    def names() -> list[str]:
        return list(service.model_names())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        return Response(await service.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models", dependencies=guarded)
    async def list_models() -> dict[str, Any]:
        # Each alias an entry too: clients pick the model they were set up for from this list.
        models = (await service.status()).models
        data = [_model_object(m, n, created) for m in models for n in (m.name, *m.aliases)]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model:path}", dependencies=guarded)
    async def get_model(model: str) -> dict[str, Any]:
        served = service.model(model)
        report = (await service.status()).model(served.name) if served is not None else None
        if report is not None:
            return _model_object(report, model, created)
        raise unknown_model(model, names())

    async def serve(request: Request, kind: RequestKind) -> Response:
        try:
            body = await _read_body(request, max_body_bytes)
            parsed = await _parse_json(body, partial(parse_request, kind))
            parsed = await _admit(service, request.headers, parsed, names)
        except Exception as exc:
            return api_error(exc, names).response()
        if parsed.stream:
            response: Response = EventStream(
                partial(_stream, service, parsed, parsed.request), names
            )
        else:
            outcome = await _complete(service, parsed, request.receive, names)
            response = outcome if isinstance(outcome, Response) else JSONResponse(outcome)
        if parsed.ignored:
            response.headers[IGNORED_HEADER] = ",".join(parsed.ignored)
        return response

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await serve(request, RequestKind.CHAT)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await serve(request, RequestKind.COMPLETION)

    for add in (_add_embeddings_route, _add_ollama_routes, _add_infill_route):
        add(app, service, guarded, names, max_body_bytes)
    _add_responses_route(
        app, service, guarded, names, max_body_bytes, budget_bytes=responses_budget_bytes
    )
    return app


async def _admit(
    service: Service, headers: Headers, parsed: ApiRequest, names: Callable[[], list[str]]
) -> ApiRequest:
    """What every model route checks once a body parsed, each once: the model exists (by name
    or alias), it serves the request's kind (an embedding model embeddings only), a strict model
    is not sent fields it would ignore, the request's class in the GPU
    queue (its header), and a chat request's images against the model's policy."""
    served = service.model(parsed.model)
    if served is None:
        raise unknown_model(parsed.model, names())
    refusal = kind_refusal(served.name, parsed.request.kind, served.embedding)
    if refusal:
        raise RequestError(refusal)
    _refuse_if_strict(served, parsed.model, parsed.ignored)
    priority = parse_priority_header(headers.get(PRIORITY_HEADER))
    loaded = await _load_images(served.images, parsed)
    return replace(
        parsed,
        name=served.name,
        request=replace(parsed.request, priority=priority, images=loaded),
    )


async def _load_images(policy: ImagePolicy | None, parsed: ApiRequest) -> tuple[str, ...]:
    """A chat request's image parts, checked against its model's policy (images.py), as the
    engine takes them: base64, in order. Each refusal is a 400 naming the part. images.load
    runs in threads: a URL may be fetched, a PNG is inflated to check it is whole, a WebP is
    converted to PNG."""
    if not parsed.image_urls:
        return ()
    if policy is None:
        raise ApiError(
            400,
            f"{parsed.model} takes no images: its config names no mmproj (a projector)",
            code="unsupported_value",
            param=parsed.image_urls[0][0],
        )
    if len(parsed.image_urls) > MAX_IMAGES:
        raise ApiError(
            400,
            f"a request may carry at most {MAX_IMAGES} images; this one has "
            f"{len(parsed.image_urls)}",
            code="invalid_image",
            param=parsed.image_urls[MAX_IMAGES][0],
        )
    loaded: list[str] = []
    total_bytes = 0
    for param, url in parsed.image_urls:
        try:
            image = await images.load(param, url, policy)
        except images.ImageRefused as exc:
            raise ApiError(400, str(exc), code="invalid_image", param=exc.param) from None
        loaded.append(base64.b64encode(image.data).decode("ascii"))
        total_bytes += len(loaded[-1])
        if total_bytes > MAX_IMAGES_MESSAGE_BYTES:
            raise ApiError(
                400,
                f"'{param}': the request's images come to more than "
                f"{MAX_IMAGES_MESSAGE_BYTES} bytes as the engine takes them (base64, a WebP "
                "converted to PNG); send fewer or smaller images",
                code="invalid_image",
                param=param,
            )
    return tuple(loaded)


def _refuse_if_strict(served: ServedModel, asked: str, ignored: tuple[str, ...]) -> None:
    """A 400 for fields that change nothing, when the model has strict_api = true; `asked`:
    the model as the client named it."""
    if ignored and served.strict_api:
        raise ApiError(
            400,
            f"{asked} has strict_api = true, and these fields would change nothing: "
            + ", ".join(ignored),
            code="unsupported_value",
            param=ignored[0],
        )


def _model_object(model: ModelStatus, id_: str, created: int) -> dict[str, Any]:
    """OpenAI's model object for `id_`, the name of the status report `model` or another name
    for it, with what a client choosing a model can use beyond OpenAI's fields."""
    entry: dict[str, Any] = {
        "id": id_,
        "object": "model",
        "created": created,
        "owned_by": "arbiterd",
        "context_length": model.n_ctx,
        "capabilities": list(model.capabilities),
        "state": model.state,
        "backend": model.backend,
    }
    if id_ == model.name:
        entry["aliases"] = list(model.aliases)
    else:
        entry["alias_of"] = model.name
    return entry


def _add_embeddings_route(
    app: FastAPI,
    service: Service,
    guarded: list[Any],
    names: Callable[[], list[str]],
    max_body_bytes: int,
) -> None:
    """OpenAI's POST /v1/embeddings: never streamed; base64 made here, from the engine's floats."""

    @app.post("/v1/embeddings", dependencies=guarded)
    async def embeddings(request: Request) -> Response:
        try:
            body = await _read_body(request, max_body_bytes)
            parsed = await _parse_json(body, parse_embedding_request)
            parsed = await _admit(service, request.headers, parsed, names)
        except Exception as exc:
            return api_error(exc, names).response()
        outcome = await _complete(service, parsed, request.receive, names)
        if isinstance(outcome, Response):  # an error, answered as such
            return outcome
        response = JSONResponse(_encoded(outcome) if parsed.base64 else outcome)
        if parsed.ignored:
            response.headers[IGNORED_HEADER] = ",".join(parsed.ignored)
        return response


def _add_responses_route(
    app: FastAPI,
    service: Service,
    guarded: list[Any],
    names: Callable[[], list[str]],
    max_body_bytes: int,
    *,
    budget_bytes: int,
) -> None:
    """OpenAI's POST /v1/responses, run as a chat request (daemon/http/responses.py translates); the
    past responses it remembers, within `budget_bytes`, live as long as the app (its
    state.past_responses, for a reader of its memory)."""
    past = responses.PastResponses(budget_bytes=budget_bytes)
    app.state.past_responses = past

    @app.post("/v1/responses", dependencies=guarded)
    async def create_response(request: Request) -> Response:
        try:
            payload = await _parse_json(await _read_body(request, max_body_bytes), _as_is)
            parsed = responses.parse_responses_request(payload, past)  # reads `past`: here
            api = await _admit(service, request.headers, parsed.api, names)
            parsed = replace(parsed, api=api)
        except Exception as exc:
            return api_error(exc, names).response()
        if api.stream:
            return EventStream(partial(_response_events, service, parsed, past, names), names)
        outcome = await _complete(service, api, request.receive, names)
        if isinstance(outcome, Response):  # an error, answered as such
            return outcome
        return JSONResponse(responses.answer(parsed, outcome, past))


async def _response_events(
    service: Service,
    parsed: responses.ResponsesRequest,
    past: responses.PastResponses,
    names: Callable[[], list[str]],
) -> AsyncIterator[dict[str, Any] | WaitNews]:
    """A streamed response's events, from the chat chunks with the usage chunk last; an error
    on the way is response.failed, mapped as every other error is."""
    chunks = _stream(service, parsed.api, replace(parsed.api.request, include_usage=True))
    failed = partial(api_error, names=names)
    try:
        async for event in responses.events(parsed, chunks, past, failed):
            yield event
    finally:
        await close_chunks(chunks)


# Ollama's routes that change the models it has: arbiterd's models are its config's.
OLLAMA_MODEL_ROUTES = frozenset(
    {"/api/pull", "/api/push", "/api/create", "/api/delete", "/api/copy"}
)


def _not_served(request: Request) -> str:
    """What a 404 says: the route, that arbiterd does not serve it, and for Ollama's routes that
    manage models, how to add one instead."""
    route = f"{request.method} {request.url.path}"
    if request.url.path in OLLAMA_MODEL_ROUTES:
        return (
            f"arbiterd does not serve {route}: it runs the models its config file names. To add "
            'one, add a [models.NAME] table with path = "/path/to/model.gguf" to the config '
            "file, then run `arbiterd reload` (or just save the file: the daemon watches it)"
        )
    return f"arbiterd does not serve {route}"


def _add_ollama_routes(
    app: FastAPI,
    service: Service,
    guarded: list[Any],
    names: Callable[[], list[str]],
    max_body_bytes: int,
) -> None:
    """Ollama's API on the same port (ollama.py translates), for apps that speak only it."""

    @app.get("/api/version", dependencies=guarded)
    async def ollama_version() -> dict[str, Any]:
        return {"version": ollama.VERSION}

    @app.get("/api/tags", dependencies=guarded)
    async def ollama_tags() -> dict[str, Any]:
        return ollama.tags((await service.status()).models)

    @app.get("/api/ps", dependencies=guarded)
    async def ollama_ps() -> dict[str, Any]:
        return ollama.ps((await service.status()).models)

    @app.post("/api/show", dependencies=guarded)
    async def ollama_show(request: Request) -> Response:
        try:
            model = await _parse_json(await _read_body(request, max_body_bytes), ollama.show_model)
        except Exception as exc:
            return api_error(exc, names).response()
        served = service.model(model)
        report = (await service.status()).model(served.name) if served is not None else None
        if report is None:
            return unknown_model(model, names()).response()
        return JSONResponse(ollama.show(report))

    async def serve_ollama(request: Request, route: str) -> Response:
        try:
            body = await _read_body(request, max_body_bytes)
            kind, parsed, stream = await _parse_json(body, partial(_from_ollama, route))
            parsed = await _admit(service, request.headers, parsed, names)
        except Exception as exc:
            return api_error(exc, names).response()
        started = time.monotonic()
        if stream:
            return EventStream(
                partial(_ollama_lines, service, parsed, route, started), names, ndjson=True
            )
        outcome = await _complete(service, parsed, request.receive, names)
        if isinstance(outcome, Response):  # an error, answered as such
            return outcome
        return JSONResponse(ollama.answer(kind, route, outcome, time.monotonic() - started))

    @app.post("/api/chat", dependencies=guarded)
    async def ollama_chat(request: Request) -> Response:
        return await serve_ollama(request, "chat")

    @app.post("/api/generate", dependencies=guarded)
    async def ollama_generate(request: Request) -> Response:
        return await serve_ollama(request, "generate")

    @app.post("/api/embed", dependencies=guarded)
    async def ollama_embed(request: Request) -> Response:
        try:
            body = await _read_body(request, max_body_bytes)
            parsed = await _parse_json(body, _from_ollama_embed)
            parsed = await _admit(service, request.headers, parsed, names)
        except Exception as exc:
            return api_error(exc, names).response()
        started = time.monotonic()
        outcome = await _complete(service, parsed, request.receive, names)
        if isinstance(outcome, Response):  # an error, answered as such
            return outcome
        return JSONResponse(ollama.embed_answer(outcome, time.monotonic() - started))


def _add_infill_route(
    app: FastAPI,
    service: Service,
    guarded: list[Any],
    names: Callable[[], list[str]],
    max_body_bytes: int,
) -> None:
    """llama-server's /infill (daemon/http/infill.py translates), for the editors that call it."""

    @app.post("/infill", dependencies=guarded)
    async def infill_route(request: Request) -> Response:
        try:
            body = await _read_body(request, max_body_bytes)
            models = (await service.status()).models
            coder = next((m.name for m in models if Capability.FIM in m.capabilities), None)
            parsed = await _parse_json(body, partial(infill.infill_request, default_model=coder))
            parsed = await _admit(service, request.headers, parsed, names)
        except Exception as exc:
            return api_error(exc, names).response()
        if parsed.stream:
            pieces = partial(_infill_pieces, service, parsed)
            return EventStream(pieces, names, done=False)
        outcome = await _complete(service, parsed, request.receive, names)
        if isinstance(outcome, Response):  # an error, answered as such
            return outcome
        return JSONResponse(infill.answer(parsed.model, outcome))


async def _infill_pieces(
    service: Service, parsed: ApiRequest
) -> AsyncIterator[dict[str, Any] | WaitNews]:
    """A streamed /infill: each piece of text, then the last object with the counts."""
    chunks = _stream(service, parsed, replace(parsed.request, include_usage=True))
    finish_reason, usage = None, None
    try:
        async for chunk in chunks:
            if isinstance(chunk, WaitNews):
                yield chunk  # an SSE comment, as any stream's wait
                continue
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                finish_reason = choice.get("finish_reason") or finish_reason
                if choice.get("text"):
                    yield infill.piece(choice["text"])
        yield infill.last(parsed.model, finish_reason, usage)
    finally:
        await close_chunks(chunks)


def _from_ollama(route: str, payload: object) -> tuple[RequestKind, ApiRequest, bool]:
    """An Ollama chat or generate body as the request it asks for, and whether it streams; a
    generate carries its prompt as written too, for a model without a chat template."""
    translate = ollama.chat_request if route == "chat" else ollama.generate_request
    kind, openai, stream = translate(payload)
    parsed = parse_request(kind, openai)
    if route == "generate" and kind is RequestKind.CHAT:
        plain = ollama.plain_prompt(payload)
        parsed = replace(parsed, request=replace(parsed.request, plain_prompt=plain))
    return kind, parsed, stream


def _from_ollama_embed(payload: object) -> ApiRequest:
    return parse_embedding_request(ollama.embed_request(payload))


async def _ollama_lines(
    service: Service, parsed: ApiRequest, route: str, started: float
) -> AsyncIterator[dict[str, Any]]:
    """A streamed request's chunks as Ollama's lines, the counts in the last (the usage chunk
    the engine sends when asked)."""
    chunks = _stream(service, parsed, replace(parsed.request, include_usage=True))
    kind = parsed.request.kind
    finish_reason, usage = None, None
    calls: dict[int, dict[str, Any]] = {}
    try:
        async for chunk in chunks:
            if isinstance(chunk, WaitNews):
                continue  # Ollama's lines have no shape for it
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                finish_reason = choice.get("finish_reason") or finish_reason
            ollama.collect_calls(chunk, calls)
            line = ollama.chunk(kind, route, chunk)
            if line is not None:
                yield line
        if calls:
            yield ollama.calls_line(parsed.model, calls)
        yield ollama.last_line(
            route, parsed.model, finish_reason, usage, time.monotonic() - started
        )
    finally:
        await close_chunks(chunks)


async def _stream(
    service: Service, parsed: ApiRequest, request: GenerateRequest
) -> AsyncIterator[dict[str, Any] | WaitNews]:
    """The service's chunks of an admitted request (`request`: it, or it changed for the
    route), each naming the model as the client asked: clients compare it with their request."""
    chunks = service.stream(parsed.name, request)
    try:
        async for chunk in chunks:
            yield chunk if isinstance(chunk, WaitNews) else {**chunk, "model": parsed.model}
    finally:
        await close_chunks(chunks)  # closed early: the service's close cancels the request


async def _complete(
    service: Service,
    parsed: ApiRequest,
    receive: Receive,
    names: Callable[[], list[str]],
) -> dict[str, Any] | Response:
    """A non-streamed completion's response, or the error response to send instead; cancelled
    if the client leaves before it ends: a long generation nobody will read must not hold the
    model."""
    outcome: dict[str, Any] | Exception = ApiError(500, "the request did not run")

    async def work() -> None:
        nonlocal outcome
        try:
            answer = await service.complete(parsed.name, parsed.request)
            outcome = {**answer, "model": parsed.model}  # as asked, as in `_stream`
        except Exception as exc:
            outcome = exc

    if await unless_disconnected(receive, work):
        return client_left().response()
    if isinstance(outcome, Exception):
        return api_error(outcome, names).response()
    return outcome
