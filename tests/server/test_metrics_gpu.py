"""The moectl:gpu_* gauges: the driver's figures from the engine's newest NVML sample (or the newest
record's); no series without one, and none for a figure the driver did not give."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moectl.server.metrics import GPU_GAUGES, ServerMetrics  # noqa: E402

FULL = {"index": 0, "nvml_index": 0, "name": "NVIDIA H200", "memory_used_bytes": 3 << 30, "memory_total_bytes": 141 << 30,
        "util_gpu_pct": 87, "util_memory_pct": 40, "power_w": 400.5, "power_limit_w": 700.0, "temperature_c": 61,
        "sm_clock_mhz": 1980, "memory_clock_mhz": 3201}
NO_POWER = {"index": 1, "nvml_index": 1, "name": "NVIDIA H200", "memory_used_bytes": 1 << 30,
            "memory_total_bytes": 141 << 30, "temperature_c": 50}


def gpu_series(metrics: ServerMetrics, engine_stats=None) -> dict[tuple[str, str], float]:
    """(metric, gpu label) -> value of every moectl:gpu_* sample a scrape shows."""
    text = metrics.render(engine_stats).decode()
    return {(s.name, s.labels["gpu"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("moectl:gpu_")}


def record(gpu=None) -> dict:
    rec = {"step": 1, "t_start": 0.9, "t_end": 1.0, "batch": {"request_ids": [], "preempted": []}, "requests": []}
    if gpu is not None:
        rec["gpu"] = gpu
    return rec


def test_no_gpu_sample_no_gpu_series():
    m = ServerMetrics({})
    m.observe_step(record())
    assert gpu_series(m) == {}
    assert gpu_series(m, {"running": 0, "waiting": 0, "kv_usage": 0.0, "gpu": None}) == {}


def test_gpu_gauges_follow_the_engines_newest_sample_and_leave_out_what_the_driver_did_not_give():
    m = ServerMetrics({})
    m.observe_step(record({"source": "nvml", "sampled_at": 0.95, "devices": [FULL, NO_POWER]}))
    series = gpu_series(m)  # no engine stats: the newest record's sample
    for key, name, _ in GPU_GAUGES:
        assert series[(f"moectl:{name}", "0")] == FULL[key]
        assert series.get((f"moectl:{name}", "1")) == NO_POWER.get(key)  # absent stays absent
    assert ("moectl:gpu_power_watts", "1") not in series
    # the engine's own newest sample wins at a scrape (records stop while the engine is idle)
    idle = dict(FULL, util_gpu_pct=0)
    stats = {"running": 0, "waiting": 0, "kv_usage": 0.0, "gpu": {"source": "nvml", "sampled_at": 5.0, "devices": [idle]}}
    series = gpu_series(m, stats)
    assert series[("moectl:gpu_utilization_percent", "0")] == 0
    assert not any(label == "1" for _, label in series)  # a GPU no longer sampled has no series left
