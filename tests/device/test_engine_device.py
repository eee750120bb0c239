"""The in-place backend with the model on a Vulkan device (issue 25): the GPU path of the patch —
each device buffer freed, allocated again, every tensor re-pointed, its bytes uploaded again —
on the real engine, not the CPU shortcut. The bytes come back from the model file's host copy
the worker loaded from (issue 28: a release copies nothing), or, where that copy is not what
was loaded, from a host shadow the first release copies and later ones keep.

It is also where the first run of that path crashed: with the model on llvmpipe's Vulkan0, the
first decode after a restore corrupted the heap in about half of all processes (for every KV
policy). The cause was in ggml-vulkan, which wrote a descriptor set's first bindings only and
left the rest naming buffers since destroyed (the released context's compute buffers); lavapipe
reads every binding of a bound set and took a reference on the freed buffer. The patch now
writes every binding. `test_the_sequence_that_crashed_runs_clean_in_many_processes` is that
crash's regression test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from arbiterd.errors import RestoreError
from arbiterd.native import ggml
from arbiterd.native.libllama import STATUS_TEXT, Status
from arbiterd.spec import KvPolicy, ModelSpec, Residency
from arbiterd.worker import engine
from arbiterd.worker.engine import Generation, InPlaceBackend, select_backend
from tests.conftest import Processes
from tests.support.requests import request_for
from tests.support.tiny_gguf import write_tiny_llama
from tests.worker import test_batching as batching
from tests.worker.test_engine_residency_faults import (
    HEADROOM_BYTES,
    MISUSE,
    RELEASABLE,
    RESTORE_WITHOUT_MEMORY,
    release_during_a_stream,
    run_child,
)

PROMPT = " ".join(["the quick brown fox is not a dog"] * 10)
# The crash regression: round trips per KV policy in one process, and fresh processes (the
# crash came at the first decode after the first restore of a process as often as later).
CYCLES_PER_POLICY = 50
FRESH_PROCESSES = 8
CHILD_TIMEOUT_S = 240  # the first process on a machine compiles llvmpipe's pipelines (~1 min)

# Appended to the fault tests' CHILD_PRELUDE (a warm in-place backend, its first answer).
ROUND_TRIPS = """
kv, cycles = KvPolicy(sys.argv[2]), int(sys.argv[3])
same = released = 0
for _ in range(cycles):
    released += backend.release(kv).weights_bytes > 0
    backend.restore()
    same += text(backend.generate(BODY, None)) == text(first)
backend.close()
print(json.dumps({"cycles": cycles, "same": same, "released": released}))
"""


def greedy(max_tokens: int = 8) -> dict[str, object]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 5}


def choice(generation: Generation) -> dict[str, Any]:
    """The answer's text and every logprob it reports: floats compared exactly, so logits that
    differ in one bit of a top candidate show."""
    first: dict[str, Any] = generation.response["choices"][0]
    return {"text": first["text"], "logprobs": first["logprobs"]}


def on_device(model: Path, host_copy_fd: int | None = None) -> InPlaceBackend:
    spec = ModelSpec(
        name="m", path=model, n_ctx=512, residency=Residency.IN_PLACE, host_copy_fd=host_copy_fd
    )
    chosen = select_backend(spec)
    assert isinstance(chosen, InPlaceBackend), "the engine is not the arbiterd build"
    return chosen


def round_trips(model: Path, kv: KvPolicy, cycles: int) -> dict[str, int]:
    return run_child(
        ROUND_TRIPS, str(model), kv.value, str(cycles), n_gpu_layers=-1, timeout_s=CHILD_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def releasable_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "releasable.gguf", RELEASABLE)


@pytest.fixture
def backend(vulkan0: ggml.Device, tiny_model: Path) -> Iterator[InPlaceBackend]:
    chosen = on_device(tiny_model)
    chosen.load()
    yield chosen
    chosen.close()


@pytest.mark.parametrize("kv", list(KvPolicy))
def test_a_round_trip_on_the_device_gives_bit_identical_logits_and_keeps_the_prompt(
    backend: InPlaceBackend, kv: KvPolicy
) -> None:
    first = backend.generate(request_for("completion", greedy()), None)
    assert first.prompt_tokens_evaluated == first.prompt_tokens > 50
    # The control: the same request again on the warm context, which decodes what a restored
    # one with its KV decodes (the prompt's last token); with `drop` the whole prompt, as first.
    control = (
        first
        if kv is KvPolicy.DROP
        else backend.generate(request_for("completion", greedy()), None)
    )
    warm_bytes = backend.resident_bytes()
    released = backend.release(kv)
    assert released.weights_bytes > 0  # the weights were on the device, and left it
    # ... without a copy: every one comes back from the host copy of the file
    assert released.file_bytes == released.weights_bytes
    assert released.copied_bytes == 0
    assert (released.kv_bytes > 0) is (kv is KvPolicy.HOST)
    cold_bytes = backend.resident_bytes()
    if kv is KvPolicy.DEVICE:
        assert 0 < cold_bytes < warm_bytes  # the KV cache stayed on the device
    else:
        assert cold_bytes == 0
    assert backend.host_weights_bytes() == 0  # no shadow of the worker's own
    restored = backend.restore()
    assert (restored.weights_bytes, restored.kv_bytes, restored.disk_read_bytes) == (
        released.weights_bytes,
        released.kv_bytes,
        0,
    )
    assert restored.file_bytes == released.file_bytes
    assert backend.resident_bytes() == warm_bytes
    again = backend.generate(request_for("completion", greedy()), None)
    assert choice(again) == choice(control)
    assert again.prompt_tokens_evaluated == (first.prompt_tokens if kv is KvPolicy.DROP else 1)


@dataclass
class OnUnsealedCopy:
    """A warm model on the device, loaded from a host copy that can still change (the daemon's
    is sealed): the memfd, the model file's size, the backend."""

    fd: int
    size: int
    backend: InPlaceBackend


@pytest.fixture
def on_unsealed_copy(vulkan0: ggml.Device, tiny_model: Path) -> Iterator[OnUnsealedCopy]:
    data = tiny_model.read_bytes()
    fd = os.memfd_create("test-host-copy", os.MFD_CLOEXEC)
    os.write(fd, data)
    chosen = on_device(tiny_model, host_copy_fd=fd)  # closes fd with the backend
    try:
        chosen.load()
        chosen.generate(request_for("completion", greedy()), None)
        yield OnUnsealedCopy(fd, len(data), chosen)
    finally:
        chosen.close()


def test_a_host_copy_of_another_size_makes_the_first_release_copy_and_later_ones_keep_it(
    on_unsealed_copy: OnUnsealedCopy,
) -> None:
    chosen = on_unsealed_copy.backend
    # the control: what a context with the prompt's KV decodes (its last token again)
    control = choice(chosen.generate(request_for("completion", greedy()), None))
    # grown: no longer the file the weights were loaded from
    os.ftruncate(on_unsealed_copy.fd, on_unsealed_copy.size + 4096)
    for round_trip in range(3):
        released = chosen.release(KvPolicy.HOST)
        assert released.file_bytes == 0
        copied = released.copied_bytes
        # the first copies the weights to a shadow; weights never change, so it is kept
        assert copied >= released.weights_bytes if round_trip == 0 else copied == 0
        assert chosen.host_weights_bytes() >= released.weights_bytes
        chosen.restore()
        assert chosen.host_weights_bytes() >= released.weights_bytes  # kept while warm
        assert choice(chosen.generate(request_for("completion", greedy()), None)) == control


def test_a_host_copy_truncated_while_the_model_is_cold_is_refused_by_the_restore(
    on_unsealed_copy: OnUnsealedCopy,
) -> None:
    chosen = on_unsealed_copy.backend
    assert chosen.release(KvPolicy.HOST).file_bytes > 0
    os.ftruncate(on_unsealed_copy.fd, on_unsealed_copy.size // 2)
    with pytest.raises(RestoreError, match=STATUS_TEXT[Status.SOURCE]):
        chosen.restore()
    assert chosen.resident_bytes() == 0  # still cold: never wrong weights


@pytest.mark.parametrize("kv", list(KvPolicy))
def test_the_sequence_that_crashed_runs_clean_many_times_in_one_process(
    vulkan0: ggml.Device, tiny_model: Path, kv: KvPolicy
) -> None:
    result = round_trips(tiny_model, kv, CYCLES_PER_POLICY)
    n = CYCLES_PER_POLICY
    assert result == {"cycles": n, "same": n, "released": n}


def test_the_sequence_that_crashed_runs_clean_in_many_processes(
    vulkan0: ggml.Device, tiny_model: Path
) -> None:
    results = [round_trips(tiny_model, KvPolicy.HOST, 3) for _ in range(FRESH_PROCESSES)]
    assert results == [{"cycles": 3, "same": 3, "released": 3}] * FRESH_PROCESSES


def test_a_restore_that_cannot_allocate_on_the_device_stays_cold_and_the_next_works(
    vulkan0: ggml.Device, releasable_model: Path
) -> None:
    # llvmpipe's device memory is the process's own: RLIMIT_AS makes the device full.
    result = run_child(
        RESTORE_WITHOUT_MEMORY, str(releasable_model), str(HEADROOM_BYTES), n_gpu_layers=-1
    )
    assert result["released_weights_bytes"] > 3 * HEADROOM_BYTES
    error = result["error"]
    assert error is not None, "the restore succeeded under the lowered RLIMIT_AS"
    assert "restore failed" in error
    assert STATUS_TEXT[Status.DEVICE_ALLOC] in error  # "out of device memory"
    assert result["error_class"] == "OutOfDeviceMemoryError"
    after = result["after_failure"]
    assert (after["resident_bytes"], after["generate"]) == (0, "m is not warm")
    assert after["host_kv_bytes"] == result["released_kv_bytes"] > 0
    assert after["host_weights_bytes"] == 0  # they come back from the host copy of the file
    assert result["restored_kv_bytes"] == result["released_kv_bytes"]
    assert (result["same_text"], result["prompt_tokens_evaluated"]) == (True, 1)


def test_the_engine_refuses_misuse_of_a_context_on_the_device(
    vulkan0: ggml.Device, tiny_model: Path
) -> None:
    result = run_child(MISUSE, str(tiny_model), n_gpu_layers=-1)
    for call in ("release_again", "restore_warm"):
        assert result[call] is not None, f"{call} was accepted"
        code, message = result[call]
        assert code == Status.STATE, message
    assert result["decode_released"] == -1  # a decode on released buffers is refused
    assert (result["same_text"], result["prompt_tokens_evaluated"]) == (True, 1)


def test_a_release_sent_while_the_device_decodes_comes_after_the_last_chunk(
    vulkan0: ggml.Device, procs: Processes, tmp_path: Path, tiny_model: Path
) -> None:
    release_during_a_stream(procs, tmp_path, tiny_model, n_gpu_layers=-1)


def test_the_device_is_named_as_a_vulkan_device_that_runs_on_the_cpu(
    vulkan0: ggml.Device,
) -> None:
    info = engine.engine_info()
    assert info.offload
    assert vulkan0.label in info.devices
    if "llvmpipe" in vulkan0.description:
        assert vulkan0.on_cpu
        assert vulkan0.label.endswith("[runs on the CPU]")


def test_a_batch_of_four_resumes_after_a_round_trip_on_the_device(
    vulkan0: ggml.Device, tiny_model: Path
) -> None:
    # Issue 42: four sequences decoded in one batch on Vulkan0, released and restored while
    # they are in flight, answer exactly as the same batch does with no round trip (texts and
    # every logprob). Not as each does alone: on this device the batch's kernels sum in
    # another order than a single sequence's (llama.cpp's batch-size nondeterminism), and a
    # near-tie of the tiny random model's logits can then take the other branch.
    bodies = {key: batching.greedy(p, max_tokens=40) for key, p in batching.PROMPTS.items()}
    released: list[int] = []

    def between(step: int) -> None:
        if step == 6:
            assert chosen.generating == len(bodies)
            released.append(chosen.release(KvPolicy.HOST).weights_bytes)
            chosen.restore()

    answers = []
    for round_trip in (False, True):
        chosen = batching.in_place(tiny_model, n_gpu_layers=-1)
        chosen.load()
        try:
            ended = batching.together(chosen, bodies, between=between if round_trip else None)
        finally:
            chosen.close()
        answers.append({key: batching.answer(ended[key]) for key in bodies})
    assert released[0] > 0  # the weights were on the device, and left it
    control, resumed = answers
    assert resumed == control
