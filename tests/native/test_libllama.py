"""The libllama probe against the engine llama_cpp loaded and against fakes built with gcc.

The fakes speak residency ABI 3 and record every call in globals, read back through exported
getters, so the tests see exactly what crossed the C ABI. Each test compiles its own copy into
tmp_path: a fresh file is a fresh dlopen, so no state leaks between tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from arbiterd.errors import EngineError, ResidencyCallError
from arbiterd.native import libllama
from arbiterd.native.libllama import (
    ABI,
    ABI_SYMBOL,
    HOST_BUFFERS,
    KEEP_KV,
    RELEASE_SYMBOL,
    RESIDENCY_SYMBOLS,
    RESTORE_SYMBOL,
    STATS_SYMBOL,
    STATUS_TEXT,
    ProbeMiss,
    ResidencyApi,
    ResidencyStats,
    Status,
    loaded_libllama,
    probe_residency_api,
)
from tests.support.fake_libllama import CTX, Calls, Fake, compile_fake

# Which -D switch of the fake leaves out which symbol.
OMIT = {
    ABI_SYMBOL: "NO_ABI",
    RELEASE_SYMBOL: "NO_RELEASE",
    RESTORE_SYMBOL: "NO_RESTORE",
    STATS_SYMBOL: "NO_STATS",
}


def mapped_paths() -> set[Path]:
    """Every file mapped into this process (the pathname is the sixth field of a maps line)."""
    fields = (line.split(maxsplit=5) for line in Path("/proc/self/maps").read_text().splitlines())
    return {Path(parts[5]) for parts in fields if len(parts) == 6}


@pytest.fixture
def fake_path(tmp_path: Path) -> Path:
    return compile_fake(tmp_path, "libfake")


@pytest.fixture
def fake(fake_path: Path) -> Fake:
    return Fake(fake_path)


@pytest.fixture
def api(fake: Fake) -> ResidencyApi:
    probed = probe_residency_api(fake.path)
    assert isinstance(probed, ResidencyApi), probed
    return probed


# -- the engine llama_cpp loaded -------------------------------------------------------------


def test_loaded_libllama_is_found_and_is_the_arbiterd_build() -> None:
    path = loaded_libllama()
    assert path.is_file()
    assert "llama" in path.name
    probed = probe_residency_api()
    assert isinstance(probed, ResidencyApi), f"{probed}: run bash scripts/setup.sh"
    assert probed.library == path


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


# -- fakes built with gcc: the calls ---------------------------------------------------------


def test_probe_finds_the_api(fake_path: Path) -> None:
    probed = probe_residency_api(fake_path)
    assert isinstance(probed, ResidencyApi)
    assert probed.library == fake_path


def test_release_passes_pointer_and_flags_through(fake: Fake, api: ResidencyApi) -> None:
    assert fake.last_flags == -1
    api.release_device(CTX, KEEP_KV | HOST_BUFFERS)
    assert (fake.last_ctx, fake.last_flags) == (CTX, 3)
    api.release_device(CTX + 16, 0)
    assert (fake.last_ctx, fake.last_flags) == (CTX + 16, 0)
    # uint32_t: the top bit arrives as a flag, not as a sign.
    api.release_device(CTX, 0x8000_0000 | HOST_BUFFERS)
    assert fake.last_flags == 0x8000_0002
    assert fake.calls == Calls(release=3, restore=0, stats=0)


def test_restore_passes_pointer_through(fake: Fake, api: ResidencyApi) -> None:
    api.restore_device(CTX)
    assert fake.last_ctx == CTX
    assert fake.calls == Calls(release=0, restore=1, stats=0)


def test_stats_round_trip_through_the_struct_with_64_bit_values(
    fake: Fake, api: ResidencyApi
) -> None:
    # Values above 32 bits in every field, the last one with its top bit set: a field that is
    # too narrow, misaligned or signed would show.
    fake.set_stats(
        released=1,
        weights=(1 << 40) + 1,
        kv=(1 << 33) + 2,
        compute=(1 << 32) + 3,
        host=(1 << 34) + 4,
        file=(1 << 39) + 5,
        copied=(1 << 63) + 6,
    )
    stats = api.stats(CTX, KEEP_KV)
    assert stats == ResidencyStats(
        released=True,
        weights_bytes=(1 << 40) + 1,
        kv_bytes=(1 << 33) + 2,
        compute_bytes=(1 << 32) + 3,
        host_bytes=(1 << 34) + 4,
        file_bytes=(1 << 39) + 5,
        copied_bytes=(1 << 63) + 6,
    )
    assert stats.device_bytes == (1 << 40) + (1 << 33) + (1 << 32) + 6
    assert (fake.last_ctx, fake.last_stats_flags) == (CTX, KEEP_KV)
    fake.set_stats(released=0, weights=5, kv=0, compute=0, host=0)
    assert api.stats(CTX, 0) == ResidencyStats(False, 5, 0, 0, 0, 0, 0)
    assert fake.calls == Calls(release=0, restore=0, stats=2)


def calls_of(api: ResidencyApi, ctx: int = CTX) -> dict[str, Callable[[], object]]:
    """Each residency call of `api` on ctx, by the symbol it calls."""
    return {
        RELEASE_SYMBOL: lambda: api.release_device(ctx, KEEP_KV),
        RESTORE_SYMBOL: lambda: api.restore_device(ctx),
        STATS_SYMBOL: lambda: api.stats(ctx, 0),
    }


@pytest.mark.parametrize("symbol", [RELEASE_SYMBOL, RESTORE_SYMBOL, STATS_SYMBOL])
@pytest.mark.parametrize("status", [s for s in Status if s is not Status.OK])
def test_a_status_raises_with_its_text(
    fake: Fake, api: ResidencyApi, symbol: str, status: Status
) -> None:
    fake.set_result(status)
    with pytest.raises(ResidencyCallError) as raised:
        calls_of(api)[symbol]()
    assert raised.value.status is status
    assert isinstance(raised.value, EngineError)  # the engine's own errors map it
    assert str(raised.value) == f"{symbol} failed: {STATUS_TEXT[status]} (libllama at {fake.path})"


@pytest.mark.parametrize("code", [7, 1000, -1])
def test_an_unknown_status_raises_with_its_number(fake: Fake, api: ResidencyApi, code: int) -> None:
    fake.set_result(code)
    for symbol, call in calls_of(api).items():
        with pytest.raises(ResidencyCallError) as raised:
            call()
        assert raised.value.status == code
        assert not isinstance(raised.value.status, Status)
        assert f"{symbol} failed: status {code} (libllama at {fake.path})" == str(raised.value)
    assert fake.calls == Calls(release=1, restore=1, stats=1)


def test_null_context_is_refused_before_the_call(fake: Fake, api: ResidencyApi) -> None:
    for symbol, call in calls_of(api, ctx=0).items():
        with pytest.raises(EngineError, match=f"{symbol} needs a llama_context pointer, got NULL"):
            call()
    assert fake.calls == Calls(release=0, restore=0, stats=0)


# -- fakes built with gcc: the probe's misses ------------------------------------------------


@pytest.mark.parametrize("version", [0, 2, 4, -1])
def test_another_abi_version_is_a_miss_naming_both(fake: Fake, version: int) -> None:
    fake.set_abi(version)
    probed = probe_residency_api(fake.path)
    assert isinstance(probed, ProbeMiss)
    assert probed.library == fake.path
    assert f"has residency ABI {version}, arbiterd speaks {ABI}" in probed.reason
    assert "reload backend" in probed.reason


@pytest.mark.parametrize("missing", RESIDENCY_SYMBOLS)
def test_one_symbol_missing_is_a_miss(tmp_path: Path, missing: str) -> None:
    path = compile_fake(tmp_path, "libpartial", OMIT[missing])
    probed = probe_residency_api(path)
    assert isinstance(probed, ProbeMiss)
    assert probed.library == path
    assert f"does not export {missing}:" in probed.reason
    assert all(other not in probed.reason for other in RESIDENCY_SYMBOLS if other != missing)
    assert "stock build" not in probed.reason


def test_a_library_without_any_symbol_is_a_stock_build(tmp_path: Path) -> None:
    path = compile_fake(tmp_path, "libstock", *OMIT.values())
    probed = probe_residency_api(path)
    assert isinstance(probed, ProbeMiss)
    assert all(symbol in probed.reason for symbol in RESIDENCY_SYMBOLS)
    assert "(a stock build): using the reload backend" in probed.reason


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
