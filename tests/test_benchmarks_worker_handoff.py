"""benchmarks/worker_handoff: its pure parts (prefix sizing, context size, memory and restore
figures), its --help, and one short run per backend on the tiny model."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from arbiterd.errors import ModelLoadError
from arbiterd.native.libllama import ResidencyApi, probe_residency_api
from arbiterd.spec import ModelSpec
from benchmarks import worker_handoff
from benchmarks.common import parse_proc_memory, proc_memory
from benchmarks.worker_handoff import (
    default_n_ctx,
    main,
    make_prefix,
    prefix_for_tokens,
    release_memory,
    restore_vs_copy,
)
from tests.support.benchmark_help import benchmark_help


def words_plus_bos(text: str) -> int:
    return len(text.split()) + 1


def quarter_characters(text: str) -> int:
    return len(text) // 4 + 1


@pytest.mark.parametrize("count", [words_plus_bos, quarter_characters])
@pytest.mark.parametrize("target", [2, 17, 1000, 4000])
def test_prefix_is_the_shortest_that_reaches_the_target(
    count: Callable[[str], int], target: int
) -> None:
    shortest = next(w for w in range(1, 10 * target) if count(make_prefix("harbor", w)) >= target)
    assert prefix_for_tokens("harbor", target, count) == make_prefix("harbor", shortest)


def test_context_grows_in_powers_of_two_to_hold_the_prefix() -> None:
    assert default_n_ctx(1000, 1) == 2048
    assert default_n_ctx(4000, 1) == 4096
    assert default_n_ctx(4050, 1) == 8192


def test_proc_memory_is_read_in_bytes() -> None:
    status = "Name:\tpython\nVmRSS:\t  2048 kB\nRssAnon:\t  1024 kB\nRssFile:\t 1024 kB\n"
    assert parse_proc_memory(status) == {
        "rss_bytes": 2048 * 1024,
        "rss_anon_bytes": 1024 * 1024,
        "rss_file_bytes": 1024 * 1024,
    }
    mine = proc_memory(os.getpid())
    assert (
        mine["rss_bytes"]
        == mine["rss_anon_bytes"] + mine["rss_file_bytes"] + mine["rss_shmem_bytes"]
    )


def sample(rss: int, device: int | None) -> dict[str, int | None]:
    return {
        "rss_bytes": rss,
        "rss_anon_bytes": rss,
        "rss_file_bytes": 0,
        "rss_shmem_bytes": 0,
        "device_used_bytes": device,
    }


def test_memory_freed_is_the_median_of_warm_minus_cold_per_release() -> None:
    releases = [
        {"warm": sample(100, 50), "cold": sample(40, 10)},
        {"warm": sample(100, 50), "cold": sample(90, 20)},
        {"warm": sample(100, 50), "cold": sample(130, 30)},  # grew: a negative freed
    ]
    figures = release_memory(releases)
    assert figures["cycles"] == 3
    assert figures["rss_bytes"] == {"warm_median": 100, "cold_median": 90, "freed_median": 10}
    assert figures["device_used_bytes"]["freed_median"] == 30


def test_device_memory_is_null_when_no_reading_has_it() -> None:
    releases = [{"warm": sample(100, None), "cold": sample(40, None)}]
    figures = release_memory(releases)
    assert figures["device_used_bytes"] is None
    assert figures["rss_bytes"]["freed_median"] == 60


def row(restore_s: float, weights: int, kv: int) -> dict[str, Any]:
    return {"restore_s": restore_s, "restored_weights_bytes": weights, "restored_kv_bytes": kv}


def test_restore_is_compared_with_a_memcpy_of_the_weights_and_kv_it_moved() -> None:
    rows = [row(1.0, 900, 100), row(2.0, 900, 100), row(9.0, 900, 100)]
    figures = restore_vs_copy(rows, copy_bytes_per_s=1000.0)
    assert figures == {
        "restore_median_s": 2.0,
        "bytes_moved_median": 1000,
        "copy_s": 1.0,
        "ratio": 2.0,
    }
    assert restore_vs_copy([row(1.0, 0, 0)], copy_bytes_per_s=1000.0)["ratio"] is None


def test_help_names_every_option() -> None:
    text = benchmark_help("worker_handoff")
    for option in ("--backend", "--model", "--n-gpu-layers", "--n-ctx", "--prefix-tokens", "--kv"):
        assert option in text


def test_a_run_without_the_in_place_engine_stops_before_it_measures(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_residency_api(spec: ModelSpec) -> None:
        raise ModelLoadError(f'{spec.name} asks for residency = "in-place": no API')

    def must_not_run(*_args: object) -> None:
        raise AssertionError("measured although the in-place backend cannot start")

    monkeypatch.setattr(worker_handoff, "select_backend", no_residency_api)
    monkeypatch.setattr(worker_handoff, "measure_handoffs", must_not_run)
    with pytest.raises(SystemExit) as exited:
        main(["--model", str(tiny_model), "--dir", str(tmp_path)])
    assert exited.value.code == 2
    assert "--backend reload" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["in-place", "reload"])
def test_a_short_run_measures_the_backend_it_was_asked_for(
    backend: str, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if backend == "in-place" and not isinstance(probe_residency_api(), ResidencyApi):
        pytest.skip("the loaded libllama is not the arbiterd engine build")
    out = tmp_path / "result.json"
    argv = ["--backend", backend, "--model", str(tiny_model), "--prefix-tokens", "100"]
    argv += ["--handoffs", "2", "--baseline", "1", "--release-cycles", "2"]
    argv += ["--no-warm-cache-baseline", "--dir", str(tmp_path), "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    section = result["backends"][backend]
    assert list(result["backends"]) == [backend]
    assert section["worker_says"]["backend"] == backend
    handoff = section["handoff"]
    assert handoff["count"] == 2
    # The KV came back: only the suffix (and the one token re-decoded) is evaluated.
    assert handoff["prompt_tokens_evaluated_max"] < min(
        result["setup"]["prefix_prompt_tokens"].values()
    )
    assert handoff["restore_disk_read_bytes_total"] == 0
    assert handoff["requests_evaluating_more_than_suffix_plus_1"] == 0
    assert section["ratio_median"]["cold_cache"] > 0
    assert section["restore_vs_copy"]["bytes_moved_median"] > 0
    assert section["release_memory"]["cycles"] == 2
    assert section["release_memory"]["rss_bytes"]["warm_median"] > 0
    assert section["release_memory"]["device_used_bytes"] is None  # on the CPU
    assert result["machine"]["nvml_unavailable"]
