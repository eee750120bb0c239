"""Waits that say what they wait for (issue 30), on a real daemon whose GPU `arbiterd hold`
keeps: `arbiterd warm` names the holder and withdraws on Ctrl-C, a stream gets SSE comments,
a model's max_queue_s answers 503 with Retry-After."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from arbiterd.arena import Arena
from tests.support.daemon import Daemon, serving, tiny
from tests.support.waiting import wait_until

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@pytest.fixture
def held(tiny_model: Path) -> Iterator[Daemon]:
    """A daemon of two cold models (`alpha`; `patient` gives up after 0.5 s) whose GPU
    `arbiterd hold` keeps."""
    models = {"alpha": tiny(tiny_model), "patient": tiny(tiny_model, max_queue_s=0.5)}
    with serving(models) as daemon:
        with daemon.client() as client:
            client.call("hold")
        yield daemon


def worker_pid(daemon: Daemon, model: str) -> int:
    with daemon.client() as client:
        status = client.call("status")
    pid: int = next(m["pid"] for m in status["models"] if m["name"] == model)
    return pid


def queued_pids(daemon: Daemon) -> set[int]:
    return {waiter.pid for waiter in Arena(daemon.arena).observe().queue}


def state_of(daemon: Daemon, model: str) -> str:
    with daemon.client() as client:
        status = client.call("status")
    state: str = next(m["state"] for m in status["models"] if m["name"] == model)
    return state


class Lines:
    """A process's stderr read in a thread, each line with the moment it came."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        assert process.stderr is not None
        self._stderr = process.stderr
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def join(self) -> list[str]:
        self._reader.join(timeout=30)
        return [line for _, line in self.lines]


def test_warm_under_a_hold_names_the_holder_within_a_second_and_ctrl_c_withdraws_it(
    held: Daemon,
) -> None:
    worker = worker_pid(held, "alpha")
    argv = [sys.executable, "-m", "arbiterd", "warm", "alpha", "--socket", str(held.socket)]
    # As from a terminal: SIGINT at its default, even where the test runner was started in the
    # background by a shell without job control, which ignores it there (and children inherit).
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509 (one syscall)
    ) as warm:
        try:
            lines = Lines(warm)
            wait_until(lambda: worker in queued_pids(held), 30, "alpha's worker in the queue")
            began = time.monotonic()
            wait_until(lambda: bool(lines.lines), 10, "warm to say what it waits for")
            said_at, said = lines.lines[0]
            assert said == (
                f"arbiterd warm: alpha is waiting for the GPU, held by arbiterd hold "
                f"(pid {held.process.pid}), 1st in queue"
            )
            assert said_at - began < 1.0
            warm.send_signal(signal.SIGINT)  # Ctrl-C
            assert warm.wait(timeout=30) == 130
        finally:
            if warm.poll() is None:
                warm.kill()
    assert lines.join()[-1] == "arbiterd warm: interrupted; alpha no longer waits for the GPU"
    # Withdrawn: the worker leaves the queue, and does not warm once the hold ends.
    wait_until(lambda: worker not in queued_pids(held), 10, "alpha's worker to leave the queue")
    with held.client() as client:
        client.call("unhold")
    time.sleep(0.5)  # a window in which a worker still queued would warm: an absence needs one
    assert state_of(held, "alpha") == "cold"


def test_a_stream_waiting_behind_a_hold_gets_sse_comments_then_its_answer(held: Daemon) -> None:
    with (
        httpx.Client(base_url=held.url, timeout=60) as http,
        http.stream(
            "POST", "/chat/completions", json={**CHAT, "model": "alpha", "stream": True}
        ) as reply,
    ):
        assert reply.status_code == 200
        lines = reply.iter_lines()
        first = next(lines)
        assert first == (
            f": waiting for the GPU, held by arbiterd hold (pid {held.process.pid}), 1st in queue"
        )
        with held.client() as client:
            client.call("unhold")
        rest = [line for line in lines if line]
    data = [line for line in rest if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert any('"content"' in line for line in data[:-1])


def test_a_request_past_its_models_max_queue_s_is_a_503_naming_the_holder(held: Daemon) -> None:
    worker = worker_pid(held, "patient")
    with httpx.Client(base_url=held.url, timeout=60) as http:
        reply = http.post("/chat/completions", json={**CHAT, "model": "patient"})
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1"
    message = reply.json()["error"]["message"]
    assert message.startswith("patient waited ")
    assert f"held by arbiterd hold (pid {held.process.pid}); try again in 1 s" in message
    wait_until(lambda: worker not in queued_pids(held), 10, "patient's worker to leave the queue")
