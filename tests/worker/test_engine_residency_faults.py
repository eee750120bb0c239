"""The in-place backend when things go wrong, on the real arbiterd engine build (issue 15).

- A restore that cannot allocate (RLIMIT_AS lowered under it: the CPU allocator then fails as
  a device allocator does when VRAM is full) raises OutOfDeviceMemoryError, stays cold with its
  weights' copy and its saved KV, and the next warm-up works as if nothing happened. On the CPU
  the buffer that cannot be had holds the weights the CPU repacked at load (the others are
  mapped from the host copy).
- The C side refuses misuse on its own: a second release, a restore while resident, a decode on
  a released context.
- In a real worker a release can never free buffers under a decode: the engine thread runs ops
  one at a time, so a release sent while a generation streams comes after its last chunk.

The first two run in a child process (sys.executable), which prints one JSON object: lowering
RLIMIT_AS, or a decode that crashed, must not take the test runner with it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from arbiterd.native.libllama import STATUS_TEXT, Status
from arbiterd.spec import KvPolicy, ModelSpec, Residency, WorkerConfig
from arbiterd.wire import LineReader, LineWriter
from tests.conftest import Processes
from tests.support.requests import request_for
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama

CHILD_TIMEOUT_S = 90
# ~34 MB of F32 weights in one device buffer: far more than the headroom the child leaves
# itself (tests/device).
RELEASABLE = TinyModelSpec(n_layer=2, n_embd=512, n_ff=1024, n_vocab=4096)
# On the CPU a model maps its weights from the host copy and owns only those it repacks at load:
# ~35 MB of Q4_0 layers, repacked into one CPU buffer.
REPACKED = TinyModelSpec(n_layer=4, n_embd=1024, n_ff=4096, n_vocab=4096, quantized=True)
HEADROOM_BYTES = 8 * 1024 * 1024

# Shared by the children: an in-place backend on argv[1], warm, with one greedy answer; its
# layers on the CPU (N_GPU_LAYERS 0, this tier) or on a device (-1: tests/device).
CHILD_PRELUDE = """
import json
import sys
from pathlib import Path

from arbiterd.worker.engine import InPlaceBackend, select_backend
from arbiterd.request import GenerateRequest
from arbiterd.spec import KvPolicy, ModelSpec, Residency

BODY = GenerateRequest.from_json({
    "kind": "completion", "prompt": " ".join(["the quick brown fox is not a dog"] * 10),
    "sampling": {"max_tokens": 8, "temperature": 0},
})
spec = ModelSpec(name="m", path=Path(sys.argv[1]), n_ctx=512, n_gpu_layers=N_GPU_LAYERS,
                 residency=Residency.IN_PLACE)
backend = select_backend(spec)
assert isinstance(backend, InPlaceBackend), backend
backend.load()
first = backend.generate(BODY, None)


def text(generation):
    return generation.response["choices"][0]["text"]
"""

RESTORE_WITHOUT_MEMORY = """
import resource

from arbiterd.errors import RequestError, RestoreError


def vm_size_bytes():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


released = backend.release(KvPolicy.HOST)
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
# Address space for small allocations only: the weights' buffer cannot be had.
resource.setrlimit(resource.RLIMIT_AS, (vm_size_bytes() + int(sys.argv[2]), hard))
try:
    backend.restore()
    error = error_class = None
except RestoreError as exc:
    error, error_class = str(exc), type(exc).__name__
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
if error is None:  # the restore succeeded: nothing more to see
    print(json.dumps({"released_weights_bytes": released.weights_bytes, "error": None}))
    sys.exit(0)
try:
    backend.generate(BODY, None)
    refused = None
except RequestError as exc:
    refused = str(exc)
after_failure = {
    "resident_bytes": backend.resident_bytes(),
    "host_kv_bytes": backend.host_kv_bytes(),
    "host_weights_bytes": backend.host_weights_bytes(),
    "generate": refused,
}
restored = backend.restore()
again = backend.generate(BODY, None)
print(json.dumps({
    "released_weights_bytes": released.weights_bytes,
    "released_kv_bytes": released.kv_bytes,
    "error": error,
    "error_class": error_class,
    "after_failure": after_failure,
    "restored_kv_bytes": restored.kv_bytes,
    "same_text": text(again) == text(first),
    "prompt_tokens_evaluated": again.prompt_tokens_evaluated,
}))
"""

MISUSE = """
import llama_cpp

from arbiterd.worker.engine.inplace import context_pointer
from arbiterd.errors import ResidencyCallError


def status_of(call):
    try:
        call()
    except ResidencyCallError as exc:
        return [int(exc.status), str(exc)]
    return None


llm = backend._require_llm()
ctx = context_pointer(llm)
api = backend._api
flags = backend._flags(KvPolicy.HOST)
backend.release(KvPolicy.HOST)
release_again = status_of(lambda: api.release_device(ctx, flags))
tokens = (llama_cpp.llama_token * 1)(llm.token_bos())
decode_released = int(llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(tokens, 1)))
backend.restore()
restore_warm = status_of(lambda: api.restore_device(ctx))
again = backend.generate(BODY, None)
print(json.dumps({
    "release_again": release_again,
    "decode_released": decode_released,
    "restore_warm": restore_warm,
    "same_text": text(again) == text(first),
    "prompt_tokens_evaluated": again.prompt_tokens_evaluated,
}))
"""


def run_child(
    script: str, *args: str, n_gpu_layers: int = 0, timeout_s: float = CHILD_TIMEOUT_S
) -> dict[str, Any]:
    """Run CHILD_PRELUDE + script in a fresh interpreter; its one line of JSON on stdout."""
    prelude = CHILD_PRELUDE.replace("N_GPU_LAYERS", str(n_gpu_layers))
    child = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert child.returncode == 0, f"child exited {child.returncode}:\n{child.stderr}"
    result: dict[str, Any] = json.loads(child.stdout)
    return result


@pytest.fixture(scope="module")
def repacked_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "repacked.gguf", REPACKED)


def test_a_restore_that_cannot_allocate_stays_cold_and_the_next_warm_up_works(
    repacked_model: Path,
) -> None:
    result = run_child(RESTORE_WITHOUT_MEMORY, str(repacked_model), str(HEADROOM_BYTES))
    weights = result["released_weights_bytes"]
    assert weights > 3 * HEADROOM_BYTES  # the headroom cannot hold the repacked weights' buffer
    error = result["error"]
    assert error is not None, "the restore succeeded under the lowered RLIMIT_AS"
    assert "restore failed" in error
    assert STATUS_TEXT[Status.DEVICE_ALLOC] in error  # "out of device memory"
    assert result["error_class"] == "OutOfDeviceMemoryError"  # what a fitting set retries
    # Still cold: nothing resident, the weights' copy and the saved KV both kept.
    after = result["after_failure"]
    assert result["released_kv_bytes"] > 0
    assert (after["resident_bytes"], after["host_kv_bytes"], after["generate"]) == (
        0,
        result["released_kv_bytes"],
        "m is not warm",
    )
    assert after["host_weights_bytes"] >= weights
    # The next warm-up brings back the same model and the same KV: no prefill again.
    assert result["restored_kv_bytes"] == result["released_kv_bytes"]
    assert result["same_text"] is True
    assert result["prompt_tokens_evaluated"] == 1


def test_the_engine_refuses_misuse_of_a_context(tiny_model: Path) -> None:
    result = run_child(MISUSE, str(tiny_model))
    for call in ("release_again", "restore_warm"):
        assert result[call] is not None, f"{call} was accepted"
        code, message = result[call]
        assert code == Status.STATE, message
        assert STATUS_TEXT[Status.STATE] in message
    assert result["decode_released"] == -1
    # Neither refused call changed the context: the same answer from the kept KV.
    assert result["same_text"] is True
    assert result["prompt_tokens_evaluated"] == 1


# -- a real worker -------------------------------------------------------------------------------


class WorkerLine:
    """A real worker process (python -m arbiterd.worker) on our end of a socketpair, its messages
    read in the order it sent them: one stream, so chunks, replies and events never reorder."""

    def __init__(self, procs: Processes, config: WorkerConfig) -> None:
        ours, theirs = socket.socketpair()
        ours.settimeout(CHILD_TIMEOUT_S)  # a worker that hangs fails the read, not the run
        self.sock = ours
        argv = [sys.executable, "-m", "arbiterd.worker", "--fd", str(theirs.fileno())]
        try:
            self.process = procs.start(
                [*argv, "--config", config.to_json()], pass_fds=[theirs.fileno()]
            )
        finally:
            theirs.close()
        self._reader = LineReader(ours)
        self._writer = LineWriter(ours)
        self.messages: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        assert self._writer.send(message), "the worker is gone"

    def until(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Read (and keep, in `messages`) up to the first message that matches."""
        while True:
            message = self._reader.read()
            assert message is not None, f"the worker closed its end after {self.messages[-3:]}"
            self.messages.append(message)
            if predicate(message):
                return message

    def index(self, predicate: Callable[[dict[str, Any]], bool], *, last: bool = False) -> int:
        found = [i for i, message in enumerate(self.messages) if predicate(message)]
        assert found, "no such message"
        return found[-1] if last else found[0]

    def close(self) -> None:
        self.sock.close()


def test_a_release_sent_during_a_streaming_generation_comes_after_its_last_chunk(
    procs: Processes, tmp_path: Path, tiny_model: Path
) -> None:
    release_during_a_stream(procs, tmp_path, tiny_model, n_gpu_layers=0)


def release_during_a_stream(
    procs: Processes, tmp_path: Path, model: Path, *, n_gpu_layers: int
) -> None:
    """A release sent to a real worker while it streams is carried out after its last chunk
    (the device tier runs it with the model on a device)."""
    spec = ModelSpec(
        name="m", path=model, n_ctx=2048, n_gpu_layers=n_gpu_layers, residency=Residency.IN_PLACE
    )
    config = WorkerConfig(spec=spec, arena=tmp_path / "arena", kv_on_release=KvPolicy.HOST)
    worker = WorkerLine(procs, config)
    try:
        hello = worker.until(lambda m: "hello" in m)["hello"]
        assert hello["backend"] == "in-place", hello
        worker.until(lambda m: m.get("to") == "warm")
        asked = {"prompt": "the fox", "max_tokens": 1000, "temperature": 0}
        body = request_for("completion", asked).to_json()
        generate = {"op": "generate", "id": "long", "request": body}
        worker.send({**generate, "stream": True})
        worker.until(lambda m: m.get("id") == "long" and "chunk" in m)
        worker.send({"op": "release", "id": "release"})
        worker.send({"op": "status", "id": "status"})  # answered at once, by the io thread
        assert worker.until(lambda m: m.get("id") == "release")["result"] == {"state": "cold"}

        def chunk(m: dict[str, Any]) -> bool:
            return m.get("id") == "long" and "chunk" in m

        status_at = worker.index(lambda m: m.get("id") == "status")
        last_chunk_at = worker.index(chunk, last=True)
        result_at = worker.index(lambda m: m.get("id") == "long" and "result" in m)
        cooling_at = worker.index(lambda m: m.get("to") == "cooling")
        cold_at = worker.index(lambda m: m.get("to") == "cold")
        # The release was asked for while the generation streamed: the status sent after it
        # came before the last chunk, with the generation current and the release queued.
        status = worker.messages[status_at]["result"]
        assert (status["current"], status["queue"], status["state"]) == ("long", 1, "warm")
        assert status_at < last_chunk_at
        # And it was carried out only once the generation was over, all of it.
        assert last_chunk_at < result_at < cooling_at < cold_at
        generated = worker.messages[result_at]["result"]
        assert (generated["completion_tokens"], generated["cancelled"]) == (1000, False)
        assert worker.messages[cold_at]["reason"] == "command"
        worker.send({"op": "shutdown", "id": "bye"})
        assert worker.process.wait(timeout=CHILD_TIMEOUT_S) == 0
    finally:
        worker.close()
