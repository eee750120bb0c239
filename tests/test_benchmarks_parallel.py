"""benchmarks/parallel: its pure parts (reading an event stream, the single-client and the
concurrent figures, the ratios and issue 42's goals, what the JSON says of `parallel`) and the
probe of a checkout's `parallel` key; no server is started (a run takes minutes, and the
llama-server sides need the binary benchmarks/llama_server.py builds)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiterd.config import ModelConfig
from benchmarks.parallel import (
    ARBITERD,
    BATCHED,
    MAX_TOKENS,
    NP1,
    Answer,
    client_counts,
    clients_figures,
    goals,
    parallel_in,
    parallel_setting,
    ratios,
    read_stream,
    single_figures,
)

ROOT = Path(__file__).resolve().parent.parent


def chunk(text: str = "", usage: dict[str, int] | None = None) -> str:
    choices = [{"index": 0, "text": text}] if usage is None else []
    return "data: " + json.dumps({"choices": choices, "usage": usage})


def ticking() -> Iterator[float]:
    """A clock that reads 1.0, 2.0, ... (a stream reads it only at its first text)."""
    reading = 0.0
    while True:
        reading += 1.0
        yield reading


def test_the_first_text_is_timed_and_the_last_usage_counts() -> None:
    lines = [
        ": waiting",
        "",
        chunk(""),  # a chunk without text is not the first token
        chunk("Hello"),
        chunk(" world"),
        chunk(usage={"prompt_tokens": 60, "completion_tokens": 2}),
        "data: [DONE]",
    ]
    clock = ticking()
    streamed = read_stream(lines, lambda: next(clock))
    assert streamed.error == ""
    assert streamed.first_text_s == 1.0  # read once, at "Hello"
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (60, 2)


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ([chunk("a")], "bad stream: it ended without [DONE]"),
        ([chunk("a"), "data: [DONE]"], "bad stream: usage None before [DONE]"),
        (["data: {not json"], "bad stream: {not json"),
        (['data: {"error": {"message": "boom"}}'], 'stream error: {"message": "boom"}'),
    ],
)
def test_a_stream_that_does_not_end_whole_is_an_error(lines: list[str], error: str) -> None:
    streamed = read_stream(lines, lambda: 0.0)
    assert streamed.error == error
    assert streamed.completion_tokens == 0


def test_decode_rate_counts_the_time_after_the_first_token() -> None:
    answer = Answer(0.0, latency_s=2.5, ttft_s=0.5, status="200", completion_tokens=48)
    assert answer.decode_tokens_per_s == 24.0
    assert dataclasses.replace(answer, error="HTTP 400: no").decode_tokens_per_s is None
    assert dataclasses.replace(answer, ttft_s=None).decode_tokens_per_s is None


def test_single_client_figures_leave_errors_out_of_the_medians() -> None:
    decode = [
        Answer(0.0, 2.0, 0.5, "200", prompt_tokens=60, completion_tokens=MAX_TOKENS),
        Answer(2.0, 4.0, 1.0, "200", prompt_tokens=62, completion_tokens=MAX_TOKENS),
        Answer(6.0, 0.1, None, "400", "HTTP 400: bad field"),
    ]
    cached = [Answer(0.0, 0.04, 0.03, "200", prompt_tokens=60, completion_tokens=1)]
    prefill = [
        Answer(0.0, 2.0, 2.0, "200", prompt_tokens=1000, completion_tokens=1),
        Answer(2.0, 4.0, 4.0, "200", prompt_tokens=1000, completion_tokens=1),
    ]
    figures = single_figures(decode, cached, prefill)
    assert figures["decode"]["requests"] == 3
    assert figures["decode"]["errors_by_kind"] == {"HTTP 400": 1}
    assert figures["decode"]["prompt_tokens_mean"] == 61.0
    assert figures["decode"]["tokens_per_s"] == {"median": 24.0, "values": [32.0, 16.0]}
    assert figures["decode"]["whole_s"]["median"] == 3.0
    assert figures["cached_short"]["latency_s"] == {"median": 0.04, "values": [0.04]}
    assert figures["prefill"]["tokens_per_s"] == {"median": 375.0, "values": [500.0, 250.0]}


def test_concurrent_tokens_count_answers_and_latency_every_request() -> None:
    answers = [
        Answer(0.0, 1.0, 0.2, "200", prompt_tokens=60, completion_tokens=MAX_TOKENS),
        Answer(0.5, 3.0, 0.4, "200", prompt_tokens=64, completion_tokens=MAX_TOKENS - 8),
        Answer(1.0, 9.0, None, "exception", "ReadTimeout: timed out"),
    ]
    figures = clients_figures(answers, run_s=8.0)
    assert (figures["requests"], figures["errors"], figures["short_answers"]) == (3, 1, 1)
    assert figures["generated_tokens"] == 2 * MAX_TOKENS - 8
    assert figures["generated_tokens_per_s"] == (2 * MAX_TOKENS - 8) / 8.0
    assert figures["prompt_tokens_mean"] == 62.0
    assert figures["ttft_s"] == {"p50": 0.2, "p99": 0.4, "max": 0.4}
    assert figures["latency_s"] == {"p50": 3.0, "p99": 9.0, "max": 9.0}  # nearest rank
    assert clients_figures([], run_s=1.0)["latency_s"] == {"p50": None, "p99": None, "max": None}


def side(decode: float, cached: float, prefill: float, **clients: float) -> dict[str, Any]:
    return {
        "single": {
            "decode": {"tokens_per_s": {"median": decode}},
            "cached_short": {"latency_s": {"median": cached}},
            "prefill": {"tokens_per_s": {"median": prefill}},
        },
        "clients": {n.removeprefix("c"): {"generated_tokens_per_s": t} for n, t in clients.items()},
    }


def test_single_figures_compare_with_np1_and_clients_with_np_n() -> None:
    sides = {
        ARBITERD: side(38.0, 0.09, 190.0, c4=60.0, c8=70.0),
        NP1: side(40.0, 0.06, 200.0, c4=20.0, c8=20.0),
        BATCHED: {"clients": {"4": {"generated_tokens_per_s": 50.0}}},
    }
    found = ratios(sides, (4, 8))
    assert found["single_decode_tokens_per_s"] == 0.95
    assert found["cached_short_latency_s"] == 1.5
    assert found["prefill_tokens_per_s"] == 0.95
    assert found["clients_4_tokens_per_s"] == 1.2
    assert found["clients_4_tokens_per_s_vs_np1"] == 3.0
    assert found["peer_batching_gain_4"] == 2.5
    assert found["clients_8_tokens_per_s"] is None  # -np 8 not measured
    assert found["peer_batching_gain_8"] is None
    checked = goals(found)
    for name in ("single_decode", "cached_short_latency", "prefill", "clients_4"):
        assert checked[name]["pass"], name  # each on its bound passes
    assert checked["clients_8"] == {"measured": None, "at_least": 0.95, "pass": False}
    assert not checked["pass"]
    json.dumps(checked)  # the JSON takes it as it is


def test_a_ratio_past_its_bound_fails_its_goal() -> None:
    sides = {
        ARBITERD: side(30.0, 0.1, 100.0, c4=40.0, c8=40.0),
        NP1: side(40.0, 0.06, 200.0),
        BATCHED: side(0.0, 0.0, 0.0, c4=50.0, c8=40.0),
    }
    checked = goals(ratios(sides, (4, 8)))
    assert {n: g["pass"] for n, g in checked.items() if n != "pass"} == {
        "single_decode": False,
        "cached_short_latency": False,
        "prefill": False,
        "clients_4": False,
        "clients_8": True,
    }
    assert not checked["pass"]


def test_parallel_is_named_as_the_key_or_the_checkouts_default_says() -> None:
    with_key = {"has_key": True, "default": 4}
    assert parallel_setting(with_key, 2)["in_effect"] == 2
    assert parallel_setting(with_key, None)["in_effect"] == 4
    without = parallel_setting({"has_key": False, "default": None}, None)
    assert (without["config_key"], without["source_has_key"], without["in_effect"]) == (
        None,
        False,
        1,
    )


def test_the_probe_reads_the_checkouts_config_default() -> None:
    field = {f.name: f for f in dataclasses.fields(ModelConfig)}.get("parallel")
    expected = {
        "has_key": field is not None,
        "default": None if field is None else field.default,
    }
    assert parallel_in(ROOT) == expected


def test_client_counts_are_positive_integers() -> None:
    assert client_counts("4,8") == (4, 8)
    with pytest.raises(ValueError, match="4,0"):
        client_counts("4,0")
    with pytest.raises(ValueError, match="invalid literal"):
        client_counts("four")
