"""The in-place backend, driven through a gcc-built libllama double around a real llama context.

The double only records its calls (it frees nothing), so the model keeps working and the test
can check that the real context pointer and the KV policy cross the C ABI, and that a failing
restore leaves the model cold.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from arbiterd.engine import InPlaceBackend, ReloadBackend, select_backend
from arbiterd.errors import RequestError, RestoreError
from arbiterd.native.libllama import ResidencyApi, probe_residency_api
from arbiterd.spec import KvPolicy, ModelSpec
from tests.support.fake_libllama import Fake, compile_fake

PROMPT = " ".join(["the quick brown fox is not a dog"] * 10)


@pytest.fixture
def fake(tmp_path: Path) -> Fake:
    return Fake(compile_fake(tmp_path, "libfake"))


@pytest.fixture
def backend(fake: Fake, tiny_model: Path) -> InPlaceBackend:
    api = probe_residency_api(fake.path)
    assert isinstance(api, ResidencyApi)
    engine = InPlaceBackend(ModelSpec(name="t", path=tiny_model, n_ctx=512, n_gpu_layers=0), api)
    engine.load()
    return engine


def context_pointer(engine: InPlaceBackend) -> int | None:
    return ctypes.cast(engine._require_llm().ctx, ctypes.c_void_p).value


@pytest.mark.parametrize(("kv", "keep"), [(KvPolicy.DEVICE, 1), (KvPolicy.HOST, 0)])
def test_release_and_restore_act_on_the_live_context(
    backend: InPlaceBackend, fake: Fake, kv: KvPolicy, keep: int
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    first = backend.generate("completion", body, None)
    backend.release(kv)
    assert (fake.release_calls, fake.last_keep_kv) == (1, keep)
    assert fake.last_ctx == context_pointer(backend)
    assert backend.resident_bytes() == 0
    with pytest.raises(RequestError, match="not warm"):
        backend.generate("completion", body, None)
    backend.restore()
    assert fake.restore_calls == 1
    again = backend.generate("completion", body, None)
    assert again.response["choices"][0]["text"] == first.response["choices"][0]["text"]
    assert again.prompt_tokens_evaluated == 1  # the context kept its KV: no re-prefill


def test_a_failing_restore_stays_cold(backend: InPlaceBackend, fake: Fake) -> None:
    backend.release(KvPolicy.HOST)
    fake.set_result(12)
    with pytest.raises(RestoreError, match="failed with code 12"):
        backend.restore()
    assert backend.resident_bytes() == 0
    fake.set_result(0)
    backend.restore()
    assert backend.resident_bytes() > 0


def test_dropping_the_kv_clears_the_context(backend: InPlaceBackend) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    first = backend.generate("completion", body, None)
    assert backend.release(KvPolicy.DROP).kv_bytes == 0
    backend.restore()
    assert backend.generate("completion", body, None).prompt_tokens_evaluated == (
        first.prompt_tokens
    )


def test_stock_libllama_selects_the_reload_backend(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="arbiterd.engine")
    chosen = select_backend(ModelSpec(name="t", path=tiny_model))
    assert type(chosen) is ReloadBackend
    assert "does not export llama_context_release_device" in caplog.text
