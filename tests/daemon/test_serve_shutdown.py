"""`arbiterd shutdown` while requests are in flight, against a real daemon (issue 30): each ends
with an error that says the daemon is shutting down, in its route's shape, on a connection that
closes cleanly, and the daemon still exits 0."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from arbiterd.arena import Arena
from tests.support.daemon import Daemon, serving, tiny
from tests.support.waiting import wait_until

LONG = 5000  # tokens: the tiny model is still decoding when the shutdown comes
ASK = [{"role": "user", "content": "the fox"}]
SHUTTING_DOWN = "arbiterd is shutting down"
# The daemon must be gone well within the CLI's default --timeout (60 s): nothing it has to
# wait for generates on.
STOPPED_WITHIN_S = 30.0


@pytest.fixture
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    with serving({"alpha": tiny(tiny_model)}) as running:
        yield running


class Shutdown:
    """`arbiterd shutdown` run in a thread (it returns once the daemon has exited)."""

    def __init__(self, daemon: Daemon) -> None:
        self.done: subprocess.CompletedProcess[str] | None = None
        self._thread = threading.Thread(target=self._run, args=(daemon,), name="shutdown")

    def _run(self, daemon: Daemon) -> None:
        self.done = subprocess.run(
            [sys.executable, "-m", "arbiterd", "shutdown", "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def start(self) -> Shutdown:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def wait(self, daemon: Daemon) -> float:
        """How long it took; asserts that it, and the daemon, exited 0."""
        self._thread.join(timeout=120)
        assert self.done is not None
        assert self.done.returncode == 0, self.done.stderr
        assert daemon.process.wait(timeout=10) == 0
        return time.monotonic() - self.started


def streamed_until_shutdown(daemon: Daemon, path: str, body: dict[str, Any]) -> list[str]:
    """Every line of a streamed request to `path`, shut down once its first line has come.
    httpx raises (RemoteProtocolError: incomplete chunked read) if the connection is cut."""
    url = f"http://127.0.0.1:{daemon.port}{path}"
    shutdown = Shutdown(daemon)
    lines: list[str] = []
    with httpx.stream("POST", url, json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            lines.append(line)
            if len(lines) == 1:
                shutdown.start()
    assert shutdown.wait(daemon) < STOPPED_WITHIN_S
    return [line for line in lines if line]


def test_a_chat_stream_ends_with_an_error_event_then_done(daemon: Daemon) -> None:
    body = {"model": "alpha", "messages": ASK, "max_tokens": LONG, "stream": True}
    lines = streamed_until_shutdown(daemon, "/v1/chat/completions", body)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert SHUTTING_DOWN in error["message"]
    assert error["code"] == "shutting_down"
    # The generation was cut short, not let run to its end.
    assert len(lines) < LONG


def test_an_ollama_chat_stream_ends_with_an_error_line(daemon: Daemon) -> None:
    body = {"model": "alpha", "messages": ASK, "stream": True, "options": {"num_predict": LONG}}
    lines = streamed_until_shutdown(daemon, "/api/chat", body)
    last = json.loads(lines[-1])
    assert set(last) == {"error"}
    assert SHUTTING_DOWN in last["error"]
    assert all("error" not in json.loads(line) for line in lines[:-1])


def test_a_responses_stream_ends_with_response_failed(daemon: Daemon) -> None:
    body = {"model": "alpha", "input": "the fox", "max_output_tokens": LONG, "stream": True}
    lines = streamed_until_shutdown(daemon, "/v1/responses", body)
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    failed = events[-1]
    assert failed["type"] == "response.failed"
    assert failed["sequence_number"] == len(events) - 1
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert SHUTTING_DOWN in failed["response"]["error"]["message"]
    assert "response.completed" not in [event["type"] for event in events]


def test_a_request_waiting_for_the_gpu_is_a_503_naming_the_shutdown(daemon: Daemon) -> None:
    # In flight for sure when the shutdown comes: its model waits for the GPU `hold` keeps.
    with daemon.client() as client:
        client.call("hold")
        worker = next(m["pid"] for m in client.call("status")["models"] if m["name"] == "alpha")
    replies: list[httpx.Response] = []
    body = {"model": "alpha", "messages": ASK, "max_tokens": 4}
    url = f"http://127.0.0.1:{daemon.port}/v1/chat/completions"
    asking = threading.Thread(target=lambda: replies.append(httpx.post(url, json=body, timeout=60)))
    asking.start()
    queued = lambda: worker in {w.pid for w in Arena(daemon.arena).observe().queue}  # noqa: E731
    wait_until(queued, 30, "alpha's worker in the GPU queue")
    shutdown = Shutdown(daemon).start()
    asking.join(timeout=60)
    assert shutdown.wait(daemon) < STOPPED_WITHIN_S
    (reply,) = replies
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert SHUTTING_DOWN in error["message"]
    assert error["code"] == "shutting_down"
