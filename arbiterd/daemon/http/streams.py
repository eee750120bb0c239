"""Streamed answers at the HTTP edge: server-sent events (OpenAI's) and NDJSON lines (Ollama's),
a wait's news as SSE comments, and a stream never left open after its client has gone (closing
the service's iterator cancels the request)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import anyio
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from arbiterd.daemon.http.envelopes import api_error
from arbiterd.procs import WaitNews

log = logging.getLogger(__name__)

# How long closing an abandoned stream may take (the service cancels the request in its worker).
STREAM_CLOSE_TIMEOUT_S = 10.0
SSE_DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    return (
        b"data: "
        + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode(errors="replace")
        + b"\n\n"
    )


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Run `work` (which must not raise) until it returns, or until the client disconnects, when
    it is cancelled. True if the client left first.

    Needed because uvicorn (ASGI spec 2.3) neither cancels a handler nor fails a send when the
    client goes away: only `receive()` tells, and only if someone is waiting on it. The body has
    been read by then, so the next message is the disconnect."""
    left = False
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            group.cancel_scope.cancel()

        group.start_soon(watch)
        await work()
        group.cancel_scope.cancel()
    return left


async def close_chunks(chunks: AsyncIterator[object]) -> None:
    """Close the service's iterator, so it cancels the request in its worker; shielded, as this
    runs while the response is being cancelled, and bounded."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    with anyio.move_on_after(STREAM_CLOSE_TIMEOUT_S, shield=True) as scope:
        try:
            await aclose()
        except Exception:
            log.exception("closing the service's chunk iterator failed")
    if scope.cancelled_caught:
        log.warning("closing the service's chunk iterator took over %s s", STREAM_CLOSE_TIMEOUT_S)


def ndjson_line(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"


def sse_comment(news: WaitNews) -> bytes:
    """A wait's news as an SSE comment line: every SSE client skips it, `curl -N` shows it."""
    text = news.text.replace("\r", " ").replace("\n", " ")
    return b": " + text.encode("utf-8", errors="replace") + b"\n\n"


class EventStream(Response):
    """A streamed completion as server-sent events (or, for Ollama's routes, NDJSON lines),
    owning the service's chunk iterator from opening to closing.

    The first chunk is awaited before the status line is sent, so an error raised before it is
    an ordinary HTTP error. While the model waits for the GPU, the service's news of the wait
    become SSE comments (`: waiting for the GPU, held by ...`), the first of which sends the
    status line; NDJSON has no shape for them and skips them. A later error becomes one
    `data: {"error": ...}` event, then `data: [DONE]` (NDJSON: one `{"error": MESSAGE}` line).
    If the client disconnects at any point, the pending read is cancelled and the iterator
    closed (the Service contract: closing early cancels the request)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        chunks: Callable[[], AsyncIterator[dict[str, Any] | WaitNews]],
        names: Callable[[], list[str]],
        *,
        ndjson: bool = False,
        done: bool = True,
    ) -> None:
        """`done`: an SSE stream ends with `data: [DONE]` (OpenAI's); llama-server's /infill
        ends with its last object."""
        # Not Response.__init__: it would render an empty body with Content-Length: 0.
        self.status_code = 200
        self.background = None
        self._open = chunks
        self._names = names
        self._line = ndjson_line if ndjson else sse
        self._end = SSE_DONE if done and not ndjson else b""
        self._ndjson = ndjson
        if ndjson:
            self.media_type = "application/x-ndjson"
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            chunks = self._open()
        except Exception as exc:  # a service may check eagerly, before its iterator runs
            await api_error(exc, self._names).response()(scope, receive, send)
            return
        try:
            await unless_disconnected(receive, partial(self._relay, chunks, scope, receive, send))
        finally:
            await close_chunks(chunks)

    def _encode(self, item: dict[str, Any] | WaitNews) -> bytes | None:
        """What one item of the service's stream sends; None: nothing."""
        if isinstance(item, WaitNews):
            return None if self._ndjson else sse_comment(item)
        return self._line(item)

    async def _first(self, chunks: AsyncIterator[dict[str, Any] | WaitNews]) -> bytes | None:
        """The first bytes to send (None: the stream ended before any)."""
        while True:
            try:
                first = self._encode(await anext(chunks))
            except StopAsyncIteration:
                return None
            if first is not None:
                return first

    async def _relay(
        self,
        chunks: AsyncIterator[dict[str, Any] | WaitNews],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        try:
            try:
                first = await self._first(chunks)
            except Exception as exc:
                await api_error(exc, self._names).response()(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
            while True:
                try:
                    event = self._encode(await anext(chunks))
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    failed = api_error(exc, self._names)
                    error = (
                        ndjson_line({"error": failed.message})
                        if self._ndjson
                        else (sse(failed.envelope()))
                    )
                    await send({"type": "http.response.body", "body": error, "more_body": True})
                    break
                if event is not None:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": self._end, "more_body": False})
        except OSError:
            return  # ASGI 2.4 servers report a gone client by failing `send`
