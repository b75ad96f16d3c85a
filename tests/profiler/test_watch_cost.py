"""The numerics watch's cost (profiler/watch_cost.py, part of `moectl bench --suite profiler`) end to
end on a tiny model: both workloads in A/B pairs, the notes timed in place, one line each."""

from __future__ import annotations

from moectl.engine.models.config import ModelConfig
from moectl.profiler.watch_cost import WORKLOADS, numerics_watch_cost


def test_the_watch_cost_is_measured_both_ways_for_both_workloads(tiny_engine_checkpoint, single_thread):
    lines = []
    result = numerics_watch_cost(tiny_engine_checkpoint, rounds=2, dtype="float32", log=lines.append)
    layers = ModelConfig.from_dir(tiny_engine_checkpoint).num_layers
    assert result["notes_per_step"] == 5 * layers + 1
    for name in WORKLOADS:
        w = result[name]
        assert len(w["ratios"]) == 2 and all(r > 0 for r in w["ratios"])
        lo, hi = w["ratio_ci95"]
        assert lo <= w["ratio_on_off"] <= hi
        assert 0 < w["direct_share"] < 1 and w["us_per_step"] > 0 and w["steps"] > 0
    assert len(lines) == len(WORKLOADS) and all("numerics watch" in line for line in lines)
