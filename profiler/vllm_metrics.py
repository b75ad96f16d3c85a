"""A running vLLM server's Prometheus metrics (its /metrics page), read: a scrape becomes a
`VllmScrape` (gauges, counters and histograms, each summed over the server's engines), and two
scrapes the figures of the interval between them (`interval_figures`). Every figure is vLLM's own,
as its server counts it; nothing here is measured by moectl.

Names are vLLM V1's (0.8 and later: `vllm:kv_cache_usage_perc`, `vllm:inter_token_latency_seconds`,
`vllm:request_time_per_output_token_seconds`), with V0's older names read where the newer are
absent. Percentiles come from the histograms' buckets as Prometheus's histogram_quantile takes
them (linear within a bucket), over the interval's observations only. vLLM 0.32 logs its expert-
parallel load balancer's balancedness but exports none of it as a metric: nothing of EPLB is here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

GAUGES = {  # ours -> vLLM's, newest first
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # a fraction, despite "perc"
}
COUNTERS = {  # prometheus_client names a counter's family without its _total
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "preemptions": ("vllm:num_preemptions",),
    "prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "finished": ("vllm:request_success",),
}
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "tpot": ("vllm:request_time_per_output_token_seconds",),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "queue": ("vllm:request_queue_time_seconds",),
}
QUANTILES = (0.5, 0.9, 0.99)


class VllmMetricsError(ValueError):
    """A page that is not a vLLM /metrics page; the message says why."""


@dataclass(frozen=True)
class Histogram:
    bounds: np.ndarray  # upper bounds, ascending, the last +inf
    cumulative: np.ndarray  # observations at or under each bound
    total: float  # the observations' sum

    @property
    def count(self) -> float:
        return float(self.cumulative[-1]) if len(self.cumulative) else 0.0

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations made after `earlier` (this one whole where the buckets differ or the
        server restarted in between)."""
        if earlier is None or not np.array_equal(earlier.bounds, self.bounds) \
                or (self.cumulative < earlier.cumulative).any():
            return self
        return Histogram(self.bounds, self.cumulative - earlier.cumulative, self.total - earlier.total)

    def quantile(self, q: float) -> float | None:
        """Prometheus's histogram_quantile: linear within the bucket the q-th observation falls
        in, from the bucket below's bound (0 for the first); in the +Inf bucket, the last finite
        bound. None without observations."""
        n = self.count
        if n <= 0:
            return None
        rank = q * n
        i = int(np.searchsorted(self.cumulative, rank, side="left"))
        i = min(i, len(self.bounds) - 1)
        if math.isinf(self.bounds[i]):
            return float(self.bounds[i - 1]) if i else None
        below = float(self.bounds[i - 1]) if i else 0.0
        count_below = float(self.cumulative[i - 1]) if i else 0.0
        in_bucket = float(self.cumulative[i]) - count_below
        if in_bucket <= 0:
            return float(self.bounds[i])
        return below + (float(self.bounds[i]) - below) * (rank - count_below) / in_bucket

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None


@dataclass(frozen=True)
class VllmScrape:
    at: float  # when it was taken, seconds on the caller's clock
    models: tuple[str, ...]
    engines: int
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)


def parse_scrape(text: str, at: float) -> VllmScrape:
    """A /metrics page's text, read; VllmMetricsError where it holds no vLLM metric or is not
    Prometheus's text format. Samples are taken by their own names (a counter's `_total`, a
    histogram's `_bucket` and `_sum`), whatever family a page's TYPE lines put them in."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("vllm:"):
                    samples.setdefault(sample.name, []).append(sample)
    except (ValueError, IndexError, TypeError) as exc:
        raise VllmMetricsError(f"not Prometheus's text format ({str(exc).splitlines()[0][:120]})") from None
    if not samples:
        raise VllmMetricsError("no vllm: metric on the page: not a vLLM server's /metrics")
    models, engines = set(), set()

    def first(names: tuple[str, ...], suffix: str) -> list | None:
        return next((samples[n + suffix] for n in names if n + suffix in samples), None)

    def summed(found: list) -> float:
        for sample in found:
            models.add(sample.labels.get("model_name", ""))
            engines.add(sample.labels.get("engine", "0"))
        return float(sum(sample.value for sample in found))

    gauges = {ours: summed(found) for ours, names in GAUGES.items() if (found := first(names, "")) is not None}
    counters = {ours: summed(found) for ours, names in COUNTERS.items()
                if (found := first(names, "_total")) is not None}
    if "kv_usage" in gauges:  # a fraction per engine: their mean, not their sum
        gauges["kv_usage"] /= max(1, len(first(GAUGES["kv_usage"], "")))
    histograms = {}
    for ours, names in HISTOGRAMS.items():
        name = next((n for n in names if n + "_bucket" in samples), None)
        if name is None:
            continue
        buckets: dict[float, float] = {}
        for sample in samples[name + "_bucket"]:
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + float(sample.value)
        bounds = np.array(sorted(buckets))
        histograms[ours] = Histogram(bounds, np.array([buckets[b] for b in bounds]),
                                     float(sum(x.value for x in samples.get(name + "_sum", ()))))
    return VllmScrape(at, tuple(sorted(m for m in models if m)), max(1, len(engines)), gauges, counters, histograms)


def interval_figures(earlier: VllmScrape | None, later: VllmScrape) -> dict:
    """What the console shows of a vLLM server between two scrapes: its requests running and
    waiting and KV usage (now), tokens per second in and out, finished requests, preemptions and
    the prefix cache's hit rate over the interval, and the TTFT, inter-token latency, TPOT, end-to-
    end and queue-time percentiles of the requests observed in it (seconds; None without any). A
    server restarted in between (its counters fell) is read from its start."""
    seconds = later.at - earlier.at if earlier is not None else 0.0
    restarted = earlier is not None and any(later.counters.get(k, 0.0) < v for k, v in earlier.counters.items())
    base = None if restarted else earlier

    def delta(name: str) -> float | None:
        if name not in later.counters:
            return None
        return later.counters[name] - (base.counters.get(name, 0.0) if base is not None else 0.0)

    out = {"source": "vllm", "models": list(later.models), "engines": later.engines,
           "interval_s": seconds if base is not None else None,
           **{k: later.gauges.get(k) for k in GAUGES}}
    for name in ("prompt_tokens", "generation_tokens", "preemptions", "finished"):
        out[name] = delta(name)
    rate_ok = base is not None and seconds > 0
    out["prompt_tok_s"] = out["prompt_tokens"] / seconds if rate_ok and out["prompt_tokens"] is not None else None
    out["output_tok_s"] = out["generation_tokens"] / seconds if rate_ok and out["generation_tokens"] is not None \
        else None
    queries, hits = delta("prefix_queries"), delta("prefix_hits")
    out["prefix_hit_rate"] = hits / queries if queries and hits is not None else None
    for name, hist in later.histograms.items():
        window = hist.since(base.histograms.get(name) if base is not None else None)
        out[name] = {"count": window.count, "mean": window.mean,
                     **{f"p{round(q * 100)}": window.quantile(q) for q in QUANTILES}}
    return out
