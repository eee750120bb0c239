"""A model that cannot be served (worker/unavailable.py): the stand-in backend says hello, fails
its load with the reason, and the worker answers each request with it until shut down."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from arbiterd.arena import Arena
from arbiterd.daemon.models.workerclient import WorkerHello
from arbiterd.errors import ModelLoadError
from arbiterd.spec import ModelSpec, Residency, WorkerConfig
from arbiterd.wire import LineReader, LineWriter
from arbiterd.worker.engine import EngineInfo
from arbiterd.worker.loop import Worker
from arbiterd.worker.unavailable import Unavailable

FAKE_ENGINE = EngineInfo(offload=True, devices=("CPU: test cpu", "CUDA0: test gpu"))


def test_a_backend_that_cannot_be_made_is_a_failed_model_that_says_why(tmp_path: Path) -> None:
    """residency = "in-place" on an engine without the API: the worker says hello, fails its
    load with the reason and keeps answering with it (not a crash the daemon retries for ever)."""
    ours, theirs = socket.socketpair()
    spec = ModelSpec(name="strict", path=Path("/x"), residency=Residency.IN_PLACE)
    refused = ModelLoadError('strict asks for residency = "in-place": a stock build')
    worker = Worker(
        WorkerConfig(spec=spec, arena=tmp_path / "arena"),
        Unavailable(spec, refused),
        theirs,
        FAKE_ENGINE,
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    reader, writer = LineReader(ours), LineWriter(ours)
    hello = WorkerHello.read((reader.read() or {}).get("hello"))
    assert (hello.backend, hello.fallback_reason) == ("in-place", "")
    failed = reader.read()
    assert failed is not None
    assert (failed["to"], failed["reason"]) == ("failed", str(refused))
    writer.send({"op": "generate", "id": "1", "request": {"kind": "completion", "prompt": "x"}})
    reply = reader.read()
    assert reply is not None
    assert reply["error"]["message"] == f"strict failed to load: {refused}"
    assert Arena(tmp_path / "arena").observe().holder_pid is None
    ours.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    theirs.close()
