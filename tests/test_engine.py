"""The reload backend on real llama.cpp (CPU): residency round trips keep the prompt cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiterd.engine import ReloadBackend, disk_read_bytes
from arbiterd.errors import ContextOverflowError, ModelLoadError, RequestError
from arbiterd.spec import KvPolicy, ModelSpec

PREFIX = " ".join(f"the fox {w} is not a dog" for w in ("one", "two", "three", "four") * 8)
SUFFIX = " and the cat is quick"


def greedy(prompt: str, max_tokens: int = 12) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def text_of(generation: object) -> str:
    response = generation.response  # type: ignore[attr-defined]
    return str(response["choices"][0]["text"])


@pytest.fixture
def backend(tiny_model: Path) -> Iterator[ReloadBackend]:
    engine = ReloadBackend(ModelSpec(name="tiny", path=tiny_model, n_ctx=1024, n_gpu_layers=0))
    engine.load()
    yield engine
    engine.close()


def test_round_trip_reuses_the_prompt_cache(backend: ReloadBackend) -> None:
    first = backend.generate("completion", greedy(PREFIX), None)
    assert first.prompt_tokens >= 200
    assert first.prompt_tokens_evaluated == first.prompt_tokens
    released = backend.release(KvPolicy.HOST)
    assert released.kv_bytes > 0
    assert backend.resident_bytes() == 0
    restored = backend.restore()
    assert restored.kv_bytes == released.kv_bytes
    follow_up = backend.generate("completion", greedy(PREFIX + SUFFIX), None)
    suffix_tokens = follow_up.prompt_tokens - first.prompt_tokens
    assert 0 < suffix_tokens < 10
    assert follow_up.prompt_tokens_evaluated <= suffix_tokens + 1


def test_greedy_output_is_identical_after_a_round_trip(backend: ReloadBackend) -> None:
    before = text_of(backend.generate("completion", greedy(PREFIX), None))
    backend.release(KvPolicy.HOST)
    backend.restore()
    after = backend.generate("completion", greedy(PREFIX), None)
    assert text_of(after) == before
    assert after.prompt_tokens_evaluated == 1  # only the last token is decoded again


def test_greedy_output_matches_a_fresh_process(backend: ReloadBackend, tiny_model: Path) -> None:
    backend.generate("completion", greedy(PREFIX), None)
    backend.release(KvPolicy.HOST)
    backend.restore()
    warm_text = text_of(backend.generate("completion", greedy(PREFIX + SUFFIX), None))
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from arbiterd.engine import ReloadBackend
        from arbiterd.spec import ModelSpec
        spec = ModelSpec(name="t", path=Path(sys.argv[1]), n_ctx=1024, n_gpu_layers=0)
        backend = ReloadBackend(spec)
        backend.load()
        body = {"prompt": sys.argv[2], "max_tokens": 12, "temperature": 0}
        result = backend.generate("completion", body, None)
        sys.stdout.write(result.response["choices"][0]["text"])
        """
    )
    fresh = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model), PREFIX + SUFFIX],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert fresh.stdout == warm_text


def test_dropping_the_kv_means_a_full_prefill(backend: ReloadBackend) -> None:
    first = backend.generate("completion", greedy(PREFIX), None)
    assert backend.release(KvPolicy.DROP).kv_bytes == 0
    assert backend.restore().kv_bytes == 0
    again = backend.generate("completion", greedy(PREFIX), None)
    assert again.prompt_tokens_evaluated == first.prompt_tokens


def test_restore_reads_nothing_from_disk_with_the_host_copy(backend: ReloadBackend) -> None:
    backend.generate("completion", greedy(PREFIX), None)
    backend.release(KvPolicy.HOST)
    _drop_page_cache(backend.spec.path)
    before = disk_read_bytes()
    moved = backend.restore()
    assert moved.disk_read_bytes == 0
    assert disk_read_bytes() - before == 0


def test_without_the_host_copy_a_restore_reads_the_file_again(tiny_model: Path) -> None:
    # The counter-check: the same measurement does see a disk read when there is one.
    engine = ReloadBackend(
        ModelSpec(name="t", path=tiny_model, n_ctx=256, n_gpu_layers=0, host_copy=False)
    )
    engine.load()
    try:
        engine.release(KvPolicy.HOST)
        _drop_page_cache(tiny_model)
        assert engine.restore().disk_read_bytes > 0
    finally:
        engine.close()


def test_streaming_sink_can_cancel(backend: ReloadBackend) -> None:
    chunks: list[dict[str, object]] = []

    def sink(chunk: dict[str, object]) -> bool:
        chunks.append(chunk)
        return len(chunks) < 3

    result = backend.generate("completion", greedy(PREFIX, max_tokens=50), sink)
    assert result.cancelled
    assert len(chunks) == 3


def test_chat_requests_use_the_models_template(backend: ReloadBackend) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    result = backend.generate("chat", body, None)
    message = result.response["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert result.completion_tokens >= 1


def test_prompt_longer_than_the_context_is_a_request_error(tiny_model: Path) -> None:
    engine = ReloadBackend(ModelSpec(name="t", path=tiny_model, n_ctx=64, n_gpu_layers=0))
    engine.load()
    try:
        with pytest.raises(ContextOverflowError, match="context window"):
            engine.generate("completion", greedy(PREFIX), None)
        assert text_of(engine.generate("completion", greedy("the fox", 2), None)) is not None
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": 3}, "'prompt' must be a string"),
        ({"prompt": "x", "max_tokens": "many"}, "'max_tokens' must be int"),
        ({"prompt": "x", "max_tokens": 0}, "at least 1"),
        ({"prompt": "x", "temperature": True}, "'temperature' must be"),
    ],
)
def test_bad_parameters_are_request_errors(
    backend: ReloadBackend, body: dict[str, object], message: str
) -> None:
    with pytest.raises(RequestError, match=message):
        backend.generate("completion", body, None)


def test_missing_and_corrupt_models_fail_to_load(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot open model file"):
        ReloadBackend(ModelSpec(name="m", path=tmp_path / "missing.gguf")).load()
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ModelLoadError, match="cannot load"):
        ReloadBackend(ModelSpec(name="m", path=corrupt, n_gpu_layers=0)).load()


def test_a_context_too_large_fails_to_load_with_a_clear_error(tiny_model: Path) -> None:
    for n_ctx, message in ((1 << 32, "n_ctx must be between"), (0, "n_ctx must be between")):
        spec = ModelSpec(name="m", path=tiny_model, n_ctx=n_ctx, n_gpu_layers=0)
        with pytest.raises(ModelLoadError, match=message):
            ReloadBackend(spec).load()


@pytest.mark.slow
def test_gemma_round_trip_keeps_the_prompt_cache_and_the_output(gemma_model: Path) -> None:
    engine = ReloadBackend(
        ModelSpec(name="gemma", path=gemma_model, n_ctx=1024, n_gpu_layers=0, n_threads=2)
    )
    engine.load()
    try:
        first = engine.generate("completion", greedy(PREFIX, 8), None)
        assert first.prompt_tokens >= 200
        engine.release(KvPolicy.HOST)
        _drop_page_cache(gemma_model)
        restored = engine.restore()
        assert restored.disk_read_bytes == 0
        again = engine.generate("completion", greedy(PREFIX, 8), None)
        assert text_of(again) == text_of(first)
        assert again.prompt_tokens_evaluated == 1
        follow_up = engine.generate("completion", greedy(PREFIX + SUFFIX, 8), None)
        suffix_tokens = follow_up.prompt_tokens - first.prompt_tokens
        assert follow_up.prompt_tokens_evaluated <= suffix_tokens + 1
    finally:
        engine.close()


def _drop_page_cache(path: Path) -> None:
    """Evict the file from the page cache, so that reading it would have to hit the disk."""
    os.sync()  # dirty pages are not dropped
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
