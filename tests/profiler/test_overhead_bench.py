"""`moectl bench --suite profiler` (profiler/overhead_bench.py) end to end on a tiny model: the
interleaved A/B pairs, a trace written whole through the writer process, the direct cost by
component, the step codec's costs on the recorded steps, and the verdict drawn from them."""

from __future__ import annotations

import pytest

from moectl.profiler.overhead_bench import TARGET_OVERHEAD, run_profiler_overhead, verdict

ROUNDS = 2


@pytest.fixture(scope="module")
def bench(tiny_engine_checkpoint, single_thread):
    lines = []
    result = run_profiler_overhead(tiny_engine_checkpoint, rounds=ROUNDS, devices=2, requests=2, dtype="float32",
                                   log=lines.append)
    return result, lines


def test_each_round_is_one_pair_of_runs_on_the_same_workload(bench):
    result, lines = bench
    assert len(result["off_tokens_per_s"]) == len(result["on_tokens_per_s"]) == len(result["ratios"]) == ROUNDS
    assert all(tps > 0 for tps in result["off_tokens_per_s"] + result["on_tokens_per_s"])
    assert result["ratios"] == [on / off for off, on in zip(result["off_tokens_per_s"], result["on_tokens_per_s"])]
    lo, hi = result["ratio_ci95"]
    assert lo <= result["ratio_on_off"] <= hi
    assert [line.split(":")[0] for line in lines[:ROUNDS]] == [f"round {r + 1}/{ROUNDS}" for r in range(ROUNDS)]


def test_the_profiled_runs_are_recorded_whole_and_their_steps_priced(bench):
    result, lines = bench
    assert result["dropped"] == 0
    assert result["writer_process"]["cpu_s_measured"] is not None
    encode = result["encode"]
    # the codec timed on the steps the profiled runs recorded: none recorded, nothing to size
    assert encode["sealed_bytes"] > 0 and encode["sealed_zlib_bytes"] > 0
    assert all(encode[key] > 0 for key in ("pack_us", "seal_us", "seal_zlib_us", "general_us", "str_keys_us"))
    direct = result["direct"]
    assert direct["steps"] > 0 and direct["components"]
    assert result["overhead"] == direct["direct_overhead"] > 0
    parts = direct["components"]
    # the link traffic is noted every MoE layer and handed over once a step; the batches' writes
    # outside write_step (the sender thread, each run's flush) are counted as well
    assert direct["link_notes"] > direct["link_span_builds"] == direct["steps"]
    assert parts["span_link_model"]["measured"] == "timed + counted x calibrated"
    assert parts["handoff_sender"]["seconds"] > 0  # at least the flush that ends each profiled run
    assert any(line.startswith("profiler cost, measured directly:") for line in lines)


def test_the_verdict_is_drawn_from_the_measures_it_reports(bench):
    result, lines = bench
    assert result["target_overhead"] == TARGET_OVERHEAD
    met, agrees = verdict(result["overhead"], result["dropped"], tuple(result["ratio_ci95"]))
    assert (result["met"], result["ab_agrees"]) == (met, agrees)
    # a disagreement between the two measures is stated, in the result and in the log
    assert (result["ab_disagreement"] is None) == agrees
    assert any(line.startswith("DISAGREEMENT:") for line in lines) == (not agrees)
