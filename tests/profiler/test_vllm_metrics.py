"""A vLLM server's /metrics read (profiler/vllm_metrics.py): real scrapes of vLLM's CPU build
serving the sample model (tests/profiler/data/vllm_metrics/README.md) give back what the
server was doing, percentiles follow Prometheus's histogram_quantile, and a page that is not
vLLM's is one error."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from moectl.profiler.vllm_metrics import Histogram, VllmMetricsError, interval_figures, parse_scrape

DATA = Path(__file__).parent / "data" / "vllm_metrics"


def scrape(name: str, at: float):
    return parse_scrape(gzip.open(DATA / f"{name}.prom.gz", "rt").read(), at)


def test_a_busy_server_reads_as_it_ran():
    a, b = scrape("busy_a", 0.0), scrape("busy_b", 1.0)
    assert a.models == ("sample",) and a.engines == 1
    got = interval_figures(a, b)
    # 300 requests at once: vLLM's default max_num_seqs (128) run, the rest wait
    assert (got["running"], got["waiting"]) == (128, 172) and 0 < got["kv_usage"] < 1
    assert got["generation_tokens"] == 5120 and got["output_tok_s"] == pytest.approx(5120)
    assert got["finished"] == 0 and got["preemptions"] == 0 and got["ttft"]["count"] == 0
    itl = got["itl"]  # one inter-token gap per output token of the running ones
    assert itl["count"] == 5120 and 0 < itl["p50"] <= itl["p90"] <= itl["p99"] < 0.1
    assert itl["mean"] == pytest.approx(itl["mean"]) and 0.005 < itl["mean"] < 0.1
    assert got["prefix_hit_rate"] is None  # no prompt entered in that second


def test_the_whole_run_from_idle_to_drained():
    got = interval_figures(scrape("idle", 0.0), scrape("drained", 100.0))
    assert got["finished"] == 16 + 64 + 300 and got["generation_tokens"] == 16 * 48 + 64 * 160 + 300 * 600
    assert got["running"] == 0 and got["waiting"] == 0
    assert got["ttft"]["count"] == 380 and got["e2e"]["count"] == 380
    assert got["ttft"]["p50"] <= got["ttft"]["p99"] <= got["e2e"]["p99"]
    assert got["prefix_hit_rate"] == 0.0  # distinct prompts: queried, never hit


def test_percentiles_are_prometheus_histogram_quantile():
    import numpy as np

    h = Histogram(np.array([0.1, 0.2, 0.4, np.inf]), np.array([10.0, 30.0, 40.0, 40.0]), 7.0)
    assert h.quantile(0.25) == pytest.approx(0.1)  # the 10th of 40: the first bucket's top
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.1 * (20 - 10) / 20)  # linear in (0.1, 0.2]
    assert h.quantile(0.9) == pytest.approx(0.2 + 0.2 * (36 - 30) / 10)
    tail = Histogram(np.array([0.1, np.inf]), np.array([1.0, 10.0]), 9.0)
    assert tail.quantile(0.99) == 0.1  # in +Inf: the last finite bound
    assert Histogram(np.array([0.1, np.inf]), np.array([0.0, 0.0]), 0.0).quantile(0.5) is None
    later = Histogram(h.bounds, h.cumulative + np.array([0, 5, 5, 5]), 8.0)
    assert later.since(h).count == 5 and later.since(h).quantile(0.5) == pytest.approx(0.15)


PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.4
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} %d
vllm:generation_tokens_total{engine="1",model_name="m"} 100.0
"""


def test_engines_sum_older_names_read_and_a_restart_restarts_the_count():
    early, late = parse_scrape(PAGE % 500, 0.0), parse_scrape(PAGE % 900, 2.0)
    assert early.engines == 2 and early.gauges["running"] == 8
    assert early.gauges["kv_usage"] == pytest.approx(0.3)  # V0's name; the engines' mean
    assert interval_figures(early, late)["output_tok_s"] == pytest.approx(200)
    restarted = parse_scrape(PAGE % 10, 4.0)
    got = interval_figures(late, restarted)
    assert got["generation_tokens"] == 110 and got["output_tok_s"] is None and got["interval_s"] is None


@pytest.mark.parametrize("text, message", [
    ("# TYPE http_requests counter\nhttp_requests_total 3\n", "no vllm: metric"),
    ("<html>not found</html>", "not Prometheus's text format"),
])
def test_a_page_that_is_not_vllms_is_one_error(text, message):
    with pytest.raises(VllmMetricsError, match=message) as info:
        parse_scrape(text, 0.0)
    assert "\n" not in str(info.value)
