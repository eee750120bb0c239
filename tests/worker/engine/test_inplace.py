"""The in-place backend on the real arbiterd engine build (llama-residency.patch), CPU only.

No double: select_backend binds the residency API of the libllama llama_cpp loaded, and every
release and restore moves real buffers. On the CPU the model maps its weights from the host copy
of its file (issue 28: the pages of the one copy in RAM, never the worker's own), and releases
with HOST_BUFFERS the buffers it does own: the weights the CPU repacks at load (Q4_0 here), the
KV cache and the compute buffers. Repacked weights go to a memfd, outside the process's
mappings, which the restore maps back: the process's private memory is what a release frees.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from arbiterd.errors import ModelLoadError, RequestError, RestoreError
from arbiterd.native.libllama import ProbeMiss, ResidencyApi, probe_residency_api
from arbiterd.spec import KvPolicy, ModelSpec, Residency
from arbiterd.worker import engine
from arbiterd.worker.engine import Generation, InPlaceBackend, ReloadBackend, select_backend
from arbiterd.worker.engine import backend as engine_backend
from tests.support.pagecache import drop_page_cache
from tests.support.requests import request_for
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama

PROMPT = " ".join(["the quick brown fox is not a dog"] * 10)
# ~34 MB of F32 weights (mapped from the host copy: the CPU repacks no F32), and ~35 MB of Q4_0
# layers the CPU repacks into a buffer of the worker's own: sizes that stand far out of the
# process's noise.
MAPPED = TinyModelSpec(n_layer=2, n_embd=512, n_ff=1024, n_vocab=4096)
REPACKED = TinyModelSpec(n_layer=4, n_embd=1024, n_ff=4096, n_vocab=4096, quantized=True)
# How much of the released weights' bytes must show in the RSS (the rest is slack for
# allocations the release or restore makes around them: the saved KV, Python objects).
RSS_SHARE = 0.9
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
SETUP_HINT = "the installed llama_cpp is not the arbiterd engine build: run bash scripts/setup.sh"


def greedy(prompt: str = PROMPT, max_tokens: int = 8) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def text_of(generation: Generation) -> str:
    return str(generation.response["choices"][0]["text"])


def rss_bytes() -> int:
    """This process's resident memory (the second field of /proc/self/statm, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE_BYTES


def status_bytes(field: str) -> int:
    """A memory figure of /proc/self/status (RssAnon: private memory, RssShmem: memfd pages)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def in_place(
    model: Path, *, host_copy: bool = True, n_threads: int | None = None, repack: bool = True
) -> InPlaceBackend:
    spec = ModelSpec(
        name="m",
        path=model,
        n_ctx=512,
        n_gpu_layers=0,
        n_threads=n_threads,
        residency=Residency.IN_PLACE,
        host_copy=host_copy,
        repack=repack,
    )
    chosen = select_backend(spec)
    assert isinstance(chosen, InPlaceBackend), SETUP_HINT
    return chosen


@pytest.fixture(scope="module")
def mapped_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "mapped.gguf", MAPPED)


@pytest.fixture(scope="module")
def repacked_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "repacked.gguf", REPACKED)


@pytest.fixture
def backend(tiny_model: Path) -> Iterator[InPlaceBackend]:
    chosen = in_place(tiny_model)
    chosen.load()
    yield chosen
    chosen.close()


def test_the_installed_engine_is_the_arbiterd_build() -> None:
    probed = probe_residency_api()
    assert isinstance(probed, ResidencyApi), f"{SETUP_HINT} ({probed.reason})"


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("kv", list(KvPolicy))
def test_a_round_trip_gives_the_same_text(backend: InPlaceBackend, kv: KvPolicy) -> None:
    first = backend.generate(request_for("completion", greedy()), None)
    assert first.prompt_tokens_evaluated == first.prompt_tokens > 50
    warm_bytes = backend.resident_bytes()
    assert warm_bytes > 0
    released = backend.release(kv)
    assert released.weights_bytes == 0  # F32: mapped from the host copy, nothing of its own
    assert (released.kv_bytes > 0) is (kv is KvPolicy.HOST)  # only `host` saves it
    cold_bytes = backend.resident_bytes()
    if kv is KvPolicy.DEVICE:
        assert 0 < cold_bytes < warm_bytes  # the KV cache stayed, the weights left
    else:
        assert cold_bytes == 0
    restored = backend.restore()
    assert (restored.weights_bytes, restored.kv_bytes) == (
        released.weights_bytes,
        released.kv_bytes,
    )
    assert restored.disk_read_bytes == 0
    assert backend.resident_bytes() == warm_bytes
    again = backend.generate(request_for("completion", greedy()), None)
    assert text_of(again) == text_of(first)
    # host and device kept the prompt's KV: only the last token is decoded again.
    expected = first.prompt_tokens if kv is KvPolicy.DROP else 1
    assert again.prompt_tokens_evaluated == expected


def test_a_follow_up_after_a_round_trip_evaluates_only_its_suffix(backend: InPlaceBackend) -> None:
    first = backend.generate(request_for("completion", greedy()), None)
    backend.release(KvPolicy.HOST)
    backend.restore()
    follow_up = backend.generate(request_for("completion", greedy(PROMPT + " and the cat")), None)
    suffix_tokens = follow_up.prompt_tokens - first.prompt_tokens
    assert 0 < suffix_tokens < 10
    assert follow_up.prompt_tokens_evaluated <= suffix_tokens + 1


@dataclass(frozen=True)
class LoadGrowth:
    """What loading a model and decoding once added to a process's memory."""

    anon_bytes: int  # RssAnon: the process's own pages
    shmem_bytes: int  # RssShmem: pages of memory files it maps (the host copy)
    text: str


def load_and_decode(model: Path, repack: bool) -> LoadGrowth:
    anon_before, shmem_before = status_bytes("RssAnon"), status_bytes("RssShmem")
    chosen = in_place(model, repack=repack)
    try:
        chosen.load()
        text = text_of(chosen.generate(request_for("completion", greedy()), None))
        return LoadGrowth(
            status_bytes("RssAnon") - anon_before, status_bytes("RssShmem") - shmem_before, text
        )
    finally:
        chosen.close()


def warmed_up_then(model: Path, repack: bool, warm_up: Path) -> LoadGrowth:
    load_and_decode(warm_up, repack)  # the engine's one-time set-up, not the model's memory
    return load_and_decode(model, repack)


def measured_alone(model: Path, warm_up: Path, *, repack: bool = True) -> LoadGrowth:
    """load_and_decode in a fresh interpreter, after a warm-up on a model too small for its
    freed memory to hide the measured one's. Inside the test process the figure also counts what
    earlier tests' threads and heap do meanwhile (CI once saw 28 MB of private growth there for a
    load that adds 11 MB alone), and the first load of a process adds the engine's own set-up
    (20 MB)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(warmed_up_then, (model, repack, warm_up))


def test_a_cpu_models_weights_are_the_host_copys_pages_never_the_workers_own(
    mapped_model: Path, tiny_model: Path
) -> None:
    weights = mapped_model.stat().st_size
    growth = measured_alone(mapped_model, tiny_model)
    # Every layer was read by the decode: its pages are the memfd's, not the process's.
    assert growth.shmem_bytes >= weights / 2
    assert growth.anon_bytes < weights / 4
    chosen = in_place(mapped_model)
    try:
        chosen.load()
        released = chosen.release(KvPolicy.HOST)
        assert (released.weights_bytes, released.copied_bytes) == (0, 0)
        assert chosen.host_weights_bytes() == 0
        chosen.restore()
        assert text_of(chosen.generate(request_for("completion", greedy()), None)) == growth.text
    finally:
        chosen.close()


@pytest.mark.parametrize("kv", list(KvPolicy))
def test_a_release_frees_the_repacked_weights_and_a_restore_takes_them_back(
    repacked_model: Path, kv: KvPolicy
) -> None:
    chosen = in_place(repacked_model)
    try:
        chosen.load()
        first = chosen.generate(request_for("completion", greedy()), None)
        warm_rss = rss_bytes()
        released = chosen.release(kv)
        cold_rss = rss_bytes()
        weights = released.weights_bytes
        assert weights > 30_000_000  # the repacked layers, all of them
        assert released.file_bytes == 0  # repacked: not the file's bytes
        assert chosen.host_weights_bytes() >= weights  # their copy, in the memfd
        assert warm_rss - cold_rss >= RSS_SHARE * weights, (warm_rss, cold_rss, weights)
        chosen.restore()
        assert rss_bytes() - cold_rss >= RSS_SHARE * weights
        assert chosen.host_weights_bytes() == 0
        assert text_of(chosen.generate(request_for("completion", greedy()), None)) == text_of(first)
    finally:
        chosen.close()


def test_without_repacking_a_cpu_model_owns_none_of_its_weights(
    repacked_model: Path, tiny_model: Path
) -> None:
    file_bytes = repacked_model.stat().st_size
    growth = measured_alone(repacked_model, tiny_model, repack=False)
    assert growth.shmem_bytes >= file_bytes / 2
    assert growth.anon_bytes < file_bytes / 4
    chosen = in_place(repacked_model, repack=False)
    try:
        chosen.load()
        released = chosen.release(KvPolicy.HOST)
        assert (released.weights_bytes, chosen.host_weights_bytes()) == (0, 0)
        chosen.restore()
        assert text_of(chosen.generate(request_for("completion", greedy()), None)) == growth.text
    finally:
        chosen.close()


def mapped_memfd_bytes() -> int:
    """Bytes of this process's mappings of the engine's memory files (/proc/self/maps)."""
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "memfd:llama-residency" in line:
            start, end = line.split()[0].split("-")
            total += int(end, 16) - int(start, 16)
    return total


def io_bytes() -> tuple[int, int]:
    """Bytes this process read and wrote through system calls (rchar, wchar of /proc/self/io):
    a copy into or out of a memory file counts there, a mapping's pages do not."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def test_a_restored_cpu_model_runs_on_its_memfd_so_later_round_trips_copy_nothing(
    repacked_model: Path,
) -> None:
    chosen = in_place(repacked_model)
    try:
        chosen.load()
        first = text_of(chosen.generate(request_for("completion", greedy()), None))
        assert mapped_memfd_bytes() == 0  # loaded into ordinary memory
        for round_trip in range(3):
            warm_rss = rss_bytes()
            read_before, written_before = io_bytes()
            released = chosen.release(KvPolicy.DEVICE)
            weights = released.weights_bytes
            assert warm_rss - rss_bytes() >= RSS_SHARE * weights  # unmapped: out of the RSS
            assert (released.copied_bytes >= weights) is (round_trip == 0)
            assert mapped_memfd_bytes() == 0
            chosen.restore()
            read, written = io_bytes()
            if round_trip == 0:
                assert written - written_before >= weights  # the first release copies
            else:
                assert written - written_before < weights / 100  # later ones only unmap
            assert read - read_before < weights / 100  # a restore maps, it never reads back
            assert mapped_memfd_bytes() >= weights
            assert text_of(chosen.generate(request_for("completion", greedy()), None)) == first
    finally:
        chosen.close()


def test_a_restore_reads_nothing_from_disk_even_without_the_host_copy(tiny_model: Path) -> None:
    # The reload backend reads the file again here (test_engine.py shows the counter-check):
    # in place, the weights stay mapped from the file and the KV comes from the worker's copy.
    chosen = in_place(tiny_model, host_copy=False)
    try:
        chosen.load()
        chosen.release(KvPolicy.HOST)
        drop_page_cache(tiny_model)
        before = engine_backend.disk_read_bytes()
        assert chosen.restore().disk_read_bytes == 0
        assert engine_backend.disk_read_bytes() == before
    finally:
        chosen.close()


# -- misuse ----------------------------------------------------------------------------------


def test_releasing_twice_is_refused_and_the_model_stays_cold(backend: InPlaceBackend) -> None:
    backend.release(KvPolicy.HOST)
    with pytest.raises(RequestError, match="m is already cold"):
        backend.release(KvPolicy.HOST)
    assert backend.resident_bytes() == 0
    backend.restore()
    assert backend.generate(request_for("completion", greedy()), None).completion_tokens > 0


def test_restoring_a_warm_model_is_refused_and_it_keeps_serving(backend: InPlaceBackend) -> None:
    first = backend.generate(request_for("completion", greedy()), None)
    with pytest.raises(RestoreError, match="m is already warm"):
        backend.restore()
    again = backend.generate(request_for("completion", greedy()), None)
    assert text_of(again) == text_of(first)
    assert again.prompt_tokens_evaluated == 1  # nothing was released or cleared


@pytest.mark.parametrize("kv", list(KvPolicy))
def test_a_released_model_does_not_generate(backend: InPlaceBackend, kv: KvPolicy) -> None:
    backend.release(kv)
    with pytest.raises(RequestError, match="m is not warm"):
        backend.generate(request_for("completion", greedy()), None)
    backend.restore()
    assert backend.generate(request_for("completion", greedy()), None).completion_tokens > 0


# -- select_backend honours `residency` ------------------------------------------------------

MISS = ProbeMiss(Path("/opt/stock/libllama.so"), "test: a stock build: using the reload backend")


def test_reload_is_chosen_without_probing(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def probe() -> ProbeMiss:
        raise AssertionError("residency = reload must not probe the engine")

    monkeypatch.setattr(engine, "probe_residency_api", probe)
    chosen = select_backend(ModelSpec(name="m", path=tiny_model, residency=Residency.RELOAD))
    assert type(chosen) is ReloadBackend
    assert (chosen.kind, chosen.fallback_reason) == ("reload", "")


def test_in_place_without_the_api_is_a_load_error(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine, "probe_residency_api", lambda: MISS)
    with pytest.raises(ModelLoadError) as raised:
        select_backend(ModelSpec(name="m", path=tiny_model, residency=Residency.IN_PLACE))
    assert str(raised.value) == f'm asks for residency = "in-place": {MISS.reason}'


def test_auto_without_the_api_reloads_and_says_why(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="arbiterd.worker.engine")
    monkeypatch.setattr(engine, "probe_residency_api", lambda: MISS)
    chosen = select_backend(ModelSpec(name="m", path=tiny_model, residency=Residency.AUTO))
    assert type(chosen) is ReloadBackend
    assert (chosen.kind, chosen.fallback_reason) == ("reload", MISS.reason)
    assert f"m: {MISS.reason}" in caplog.text


def test_auto_with_the_arbiterd_build_is_in_place(tiny_model: Path) -> None:
    chosen = select_backend(ModelSpec(name="m", path=tiny_model, residency=Residency.AUTO))
    assert type(chosen) is InPlaceBackend, SETUP_HINT
    assert (chosen.kind, chosen.fallback_reason, chosen.keeps_kv_on_device) == (
        "in-place",
        "",
        True,
    )


# -- the demo's model ------------------------------------------------------------------------


@pytest.mark.slow
def test_gemma_round_trip_in_place_keeps_its_weights_in_the_host_copy_and_its_kv(
    gemma_model: Path,
) -> None:
    # One thread: llama.cpp's threads spin while they wait for each other, which costs more
    # than it gains on a 2-core machine shared with builds (20 s with 2 threads, 8 s with 1).
    chosen = in_place(gemma_model, n_threads=1)
    try:
        chosen.load()
        first = chosen.generate(
            request_for("completion", greedy("The capital of France is", 6)), None
        )
        released = chosen.release(KvPolicy.HOST)
        # Q4_K/Q6_K: mapped from the host copy but for the few tensors the CPU repacks.
        assert released.weights_bytes < gemma_model.stat().st_size / 4
        assert chosen.host_weights_bytes() == released.weights_bytes
        assert chosen.restore().disk_read_bytes == 0
        again = chosen.generate(
            request_for("completion", greedy("The capital of France is", 6)), None
        )
        assert text_of(again) == text_of(first)
        assert again.prompt_tokens_evaluated == 1
    finally:
        chosen.close()
