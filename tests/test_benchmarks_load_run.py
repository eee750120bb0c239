"""benchmarks/load_run: its pure parts (windows, growth, errors, the metrics it reads, the
goals) and one short run (4 clients, ~5 s) through a real daemon on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common import nearest_rank
from benchmarks.load_run import (
    RSS_GROWTH_RATIO_MAX,
    Outcome,
    goals,
    handoff_figures,
    latency_figures,
    main,
    request_figures,
    rss_figures,
    scrape,
)

METRICS_BEFORE = """\
# TYPE arbiterd_handoffs counter
arbiterd_handoffs_total 2.0
# TYPE arbiterd_handoff_seconds histogram
arbiterd_handoff_seconds_sum 0.5
arbiterd_handoff_seconds_count 2.0
# TYPE arbiterd_requests counter
arbiterd_requests_total{model="a",status="ok"} 3.0
"""
METRICS_AFTER = """\
# TYPE arbiterd_handoffs counter
arbiterd_handoffs_total 6.0
# TYPE arbiterd_handoff_seconds histogram
arbiterd_handoff_seconds_sum 1.5
arbiterd_handoff_seconds_count 6.0
# TYPE arbiterd_requests counter
arbiterd_requests_total{model="a",status="ok"} 5.0
arbiterd_requests_total{status="error",model="b"} 1.0
"""


def test_p95_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 21)]
    assert nearest_rank(values, 0.95) == 19.0
    assert nearest_rank(values, 0.5) == 10.0
    assert nearest_rank([7.0], 0.95) == 7.0


def test_growth_is_the_last_windows_median_over_the_first() -> None:
    # 60 s at 1 Hz: 100 bytes for the first 10 s, 105 for the last 10 s, a spike between.
    samples = [(float(t), 100 if t < 10 else 105 if t >= 50 else 500) for t in range(60)]
    figures = rss_figures(samples, run_s=60.0)
    assert figures["first_window_median_bytes"] == 100
    assert figures["last_window_median_bytes"] == 105
    assert figures["growth_ratio"] == 1.05
    assert figures["max_bytes"] == 500
    assert figures["samples"] == 60


def test_a_short_run_splits_into_two_halves() -> None:
    figures = rss_figures([(0.0, 100), (1.0, 100), (2.0, 300), (3.0, 300)], run_s=4.0)
    assert (figures["first_window_median_bytes"], figures["growth_ratio"]) == (100, 3.0)
    assert figures["slope_bytes_per_min"] > 0


def test_a_process_without_samples_has_no_growth_and_fails_the_goal() -> None:
    empty = rss_figures([], run_s=60.0)
    assert (empty["growth_ratio"], empty["slope_bytes_per_min"]) == (None, None)
    flat = rss_figures([(float(t), 100) for t in range(60)], run_s=60.0)
    no_errors = request_figures([], 60.0)
    assert goals(no_errors, {"daemon": flat})["pass"]
    assert not goals(no_errors, {"daemon": flat, "worker a": empty})["pass"]


def test_growth_at_the_threshold_is_not_flat() -> None:
    grown = [(float(t), 100 if t < 30 else round(100 * RSS_GROWTH_RATIO_MAX)) for t in range(60)]
    verdict = goals(request_figures([], 60.0), {"daemon": rss_figures(grown, 60.0)})
    assert verdict["rss_flat"]["measured"] == {"daemon": RSS_GROWTH_RATIO_MAX}
    assert not verdict["rss_flat"]["pass"]
    assert verdict["errors"]["pass"]
    assert not verdict["pass"]


def test_every_error_is_counted_and_the_first_ones_kept_in_the_order_sent() -> None:
    outcomes = [
        Outcome("a", 3.0, 0.1, "200"),
        Outcome("b", 2.0, 0.2, "503", "HTTP 503: restarting"),
        Outcome("a", 1.0, 5.0, "exception", "ReadTimeout: timed out"),
        Outcome("b", 4.0, 0.1, "200"),
    ]
    figures = request_figures(outcomes, run_s=2.0)
    assert figures["by_status"] == {"200": 2, "503": 1, "exception": 1}
    assert figures["by_model"] == {"a": 2, "b": 2}
    assert (figures["total"], figures["per_s"], figures["errors"]) == (4, 2.0, 2)
    assert figures["errors_by_kind"] == {"HTTP 503": 1, "ReadTimeout": 1}
    assert [e["sent_s"] for e in figures["first_errors"]] == [1.0, 2.0]
    assert not goals(figures, {})["errors"]["pass"]
    latency = latency_figures(outcomes, run_s=4.0)
    assert (latency["count"], latency["max_s"]) == (4, 5.0)


def test_handoffs_and_the_daemons_requests_are_the_metrics_between_the_scrapes() -> None:
    before, after = scrape(METRICS_BEFORE), scrape(METRICS_AFTER)
    assert after['arbiterd_requests_total{model="b",status="error"}'] == 1.0
    figures = handoff_figures(before, after, run_s=2.0)
    assert (figures["count"], figures["per_s"], figures["mean_s"]) == (4, 2.0, 0.25)
    assert figures["daemon_requests"] == {
        'arbiterd_requests_total{model="a",status="ok"}': 2,
        'arbiterd_requests_total{model="b",status="error"}': 1,
    }
    assert figures["worker_restarts"] == 0
    assert handoff_figures(before, before, run_s=2.0)["mean_s"] is None


def test_a_short_run_of_four_clients_has_no_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "load_run.json"
    code = main(["--seconds", "5", "--clients", "4", "--out", str(out)])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    requests = result["requests"]
    assert requests["errors"] == 0, requests["first_errors"]
    assert result["goals"]["errors"] == {"measured": 0, "at_most": 0, "pass": True}
    assert requests["by_status"] == {"200": requests["total"]}
    assert set(requests["by_model"]) == {"a", "b"}
    assert requests["total"] >= 8  # every client answered at least once per model
    assert result["handoffs"]["count"] >= 1
    assert result["handoffs"]["worker_restarts"] == 0
    assert result["latency"]["count"] == requests["total"]
    assert result["latency"]["p95_s"] <= result["latency"]["max_s"]
    rss = result["rss"]
    assert set(rss["pids"]) == {"daemon", "worker a", "worker b"}
    assert (rss["gone_during_run"], rss["workers_replaced"]) == ([], [])
    for name in rss["pids"]:
        assert rss[name]["samples"] >= 5
        assert rss[name]["first_window_median_bytes"] > 0
        assert rss[name]["growth_ratio"] is not None
    assert set(result["goals"]["rss_flat"]["measured"]) == set(rss["pids"])
    # The RSS of a 5 s run says little; its verdict is reported, and sets the exit status.
    assert code == (0 if result["goals"]["pass"] else 1)
