"""The libllama probe against the stock build llama_cpp loaded and against fakes built with gcc.

The fakes export the residency symbols and record every call in globals, read back through
exported getters, so the tests see exactly what crossed the C ABI. Each test compiles its own
copy into tmp_path: a fresh file is a fresh dlopen, so no state leaks between tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from arbiterd.errors import EngineError
from arbiterd.native import libllama
from arbiterd.native.libllama import (
    RELEASE_SYMBOL,
    RESTORE_SYMBOL,
    ProbeMiss,
    ResidencyApi,
    loaded_libllama,
    probe_residency_api,
)
from tests.support.fake_libllama import CTX, Fake, compile_fake


def mapped_paths() -> set[Path]:
    """Every file mapped into this process (the pathname is the sixth field of a maps line)."""
    fields = (line.split(maxsplit=5) for line in Path("/proc/self/maps").read_text().splitlines())
    return {Path(parts[5]) for parts in fields if len(parts) == 6}


@pytest.fixture
def fake_path(tmp_path: Path) -> Path:
    return compile_fake(tmp_path, "libfake")


@pytest.fixture
def api(fake_path: Path) -> ResidencyApi:
    probed = probe_residency_api(fake_path)
    assert isinstance(probed, ResidencyApi), probed
    return probed


# -- the stock libllama llama_cpp loaded -----------------------------------------------------


def test_loaded_libllama_is_found() -> None:
    path = loaded_libllama()
    assert path.is_file()
    assert "llama" in path.name
    probed = probe_residency_api()
    assert isinstance(probed, ProbeMiss)
    assert probed.library == path
    assert RELEASE_SYMBOL in probed.reason
    assert RESTORE_SYMBOL in probed.reason
    assert "stock build" in probed.reason


def test_loaded_libllama_falls_back_to_proc_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_cpp import llama_cpp as bindings  # noqa: PLC0415

    loaded = loaded_libllama()
    monkeypatch.delattr(bindings, "_lib")
    mapped = loaded_libllama()
    assert mapped.samefile(loaded)


def test_loaded_libllama_not_found_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from llama_cpp import llama_cpp as bindings  # noqa: PLC0415

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r--p 00000000 00:00 0 /usr/lib/libllama-common.so\n")
    monkeypatch.delattr(bindings, "_lib")
    monkeypatch.setattr(libllama, "PROC_MAPS", maps)
    with pytest.raises(EngineError, match="cannot find the libllama"):
        loaded_libllama()


# -- fakes built with gcc --------------------------------------------------------------------


def test_probe_finds_the_api(fake_path: Path) -> None:
    probed = probe_residency_api(fake_path)
    assert isinstance(probed, ResidencyApi)
    assert probed.library == fake_path


def test_release_passes_pointer_and_flag_through(fake_path: Path, api: ResidencyApi) -> None:
    fake = Fake(fake_path)
    api.release_device(CTX, keep_kv=True)
    assert (fake.last_ctx, fake.last_keep_kv, fake.release_calls) == (CTX, 1, 1)
    api.release_device(CTX + 16, keep_kv=False)
    assert (fake.last_ctx, fake.last_keep_kv, fake.release_calls) == (CTX + 16, 0, 2)
    assert fake.restore_calls == 0


def test_restore_passes_pointer_through(fake_path: Path, api: ResidencyApi) -> None:
    fake = Fake(fake_path)
    api.restore_device(CTX)
    assert (fake.last_ctx, fake.restore_calls, fake.release_calls) == (CTX, 1, 0)


@pytest.mark.parametrize(("symbol", "code"), [(RELEASE_SYMBOL, 7), (RESTORE_SYMBOL, -3)])
def test_nonzero_code_raises(fake_path: Path, api: ResidencyApi, symbol: str, code: int) -> None:
    fake = Fake(fake_path)
    fake.set_result(code)
    calls = {
        RELEASE_SYMBOL: lambda: api.release_device(CTX, keep_kv=False),
        RESTORE_SYMBOL: lambda: api.restore_device(CTX),
    }
    with pytest.raises(EngineError) as raised:
        calls[symbol]()
    assert symbol in str(raised.value)
    assert f"code {code}" in str(raised.value)
    assert fake.release_calls + fake.restore_calls == 1


def test_null_context_is_refused_before_the_call(fake_path: Path, api: ResidencyApi) -> None:
    fake = Fake(fake_path)
    with pytest.raises(EngineError, match="NULL"):
        api.release_device(0, keep_kv=True)
    with pytest.raises(EngineError, match="NULL"):
        api.restore_device(0)
    assert fake.release_calls + fake.restore_calls == 0


@pytest.mark.parametrize(
    ("define", "missing", "present"),
    [
        ("NO_RELEASE", RELEASE_SYMBOL, RESTORE_SYMBOL),
        ("NO_RESTORE", RESTORE_SYMBOL, RELEASE_SYMBOL),
    ],
)
def test_one_symbol_missing_is_a_miss(
    tmp_path: Path, define: str, missing: str, present: str
) -> None:
    path = compile_fake(tmp_path, "libhalf", define)
    probed = probe_residency_api(path)
    assert isinstance(probed, ProbeMiss)
    assert probed.library == path
    assert f"does not export {missing}:" in probed.reason
    assert present not in probed.reason
    assert "stock build" not in probed.reason


def test_missing_file_is_a_miss(tmp_path: Path) -> None:
    path = tmp_path / "absent" / "libllama.so"
    probed = probe_residency_api(path)
    assert isinstance(probed, ProbeMiss)
    assert probed.library == path
    assert str(path) in probed.reason
    assert "reload backend" in probed.reason


def test_probing_the_loaded_library_never_loads_it(
    fake_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pretend llama_cpp loaded the fake: with RTLD_NOLOAD the probe must not load it itself.
    monkeypatch.setattr(libllama, "loaded_libllama", lambda: fake_path)
    probed = probe_residency_api()
    assert isinstance(probed, ProbeMiss)
    assert "not loaded in this process" in probed.reason
    assert fake_path not in mapped_paths()
    Fake(fake_path)  # now loaded: the same probe finds the API in that very instance
    assert isinstance(probe_residency_api(), ResidencyApi)
