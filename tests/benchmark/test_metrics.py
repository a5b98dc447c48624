"""The benchmark's arithmetic: percentiles, per-request TPOT, throughputs and goodput under SLOs."""

from __future__ import annotations

import pytest

from serval.benchmark.client import arrival_offsets
from serval.benchmark.metrics import RequestResult, meets_slos, parse_slos, percentile, summarize


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_tpot_is_the_mean_time_per_token_after_the_first():
    assert RequestResult(ok=True, ttft=0.5, e2e=2.5, output_tokens=5).tpot == pytest.approx(0.5)
    assert RequestResult(ok=True, ttft=0.5, e2e=0.5, output_tokens=1).tpot is None


def test_summary_counts_throughput_over_wall_time_and_latency_over_successes():
    results = [RequestResult(ok=True, ttft=0.1, e2e=1.1, itl=[0.2, 0.3], prompt_tokens=10, output_tokens=11,
                             usage_reported=True),
               RequestResult(ok=True, ttft=0.3, e2e=2.3, itl=[0.4], prompt_tokens=20, output_tokens=21,
                             usage_reported=True),
               RequestResult(ok=False, error="APIConnectionError: Connection error.")]
    s = summarize(results, duration_s=4.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == ["APIConnectionError: Connection error."]
    assert (s["prompt_tokens"], s["output_tokens"], s["token_counts_from"]) == (30, 32, "usage")
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(8.0)
    assert s["total_token_throughput"] == pytest.approx(15.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["p50"] == pytest.approx(300.0)  # the gaps of every request, pooled
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert "goodput" not in s  # no SLOs asked


def test_goodput_counts_requests_meeting_every_slo_among_all_sent():
    fast = RequestResult(ok=True, ttft=0.2, e2e=1.2, output_tokens=11)  # TPOT 100 ms
    slow_start = RequestResult(ok=True, ttft=0.9, e2e=1.9, output_tokens=11)
    slow_tokens = RequestResult(ok=True, ttft=0.2, e2e=3.2, output_tokens=11)  # TPOT 300 ms
    one_token = RequestResult(ok=True, ttft=0.2, e2e=0.2, output_tokens=1)  # no TPOT: cannot miss it
    failed = RequestResult(ok=False, error="x")
    slos = parse_slos("ttft=500, tpot=100")
    assert slos == {"ttft": 500.0, "tpot": 100.0}
    assert [meets_slos(r, slos) for r in (fast, slow_start, slow_tokens, one_token, failed)] == [
        True, False, False, True, False]
    goodput = summarize([fast, slow_start, slow_tokens, one_token, failed], 2.0, slos)["goodput"]
    assert goodput["requests_met"] == 2
    assert goodput["fraction"] == pytest.approx(0.4)
    assert goodput["request_rate"] == pytest.approx(1.0)


def test_a_bad_slo_names_what_is_accepted():
    with pytest.raises(ValueError, match="ttft, tpot, e2e"):
        parse_slos("latency=5")
    with pytest.raises(ValueError, match="not a number"):
        parse_slos("ttft=fast")


def test_poisson_arrivals_are_seeded_and_average_the_rate():
    offsets = arrival_offsets(2000, 10.0, seed=3)
    assert offsets == arrival_offsets(2000, 10.0, seed=3)
    assert offsets != arrival_offsets(2000, 10.0, seed=4)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / len(offsets) == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
