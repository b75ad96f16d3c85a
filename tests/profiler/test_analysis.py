"""profiler.analysis on small synthetic step records whose numbers can be worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.placement.placement import Placement
from moectl.placement.rebalancer import plan_rebalance
from moectl.placement.topology import Topology
from moectl.profiler import analysis
from moectl.wire.records import ENGINE_LANE, device_lane, link_lane
from tests.records import BALANCED, CONTIGUOUS, ROUTING, make_record


def two_steps(**kw) -> list[dict]:
    """Two steps of ROUTING on 2 devices: device 0 busy 0.08 s, device 1 0.04 s of 0.1 s."""
    return [make_record(s, busy_s=[0.08, 0.04], tokens=[14, 6], **kw) for s in (1, 2)]


# --- balance ------------------------------------------------------------------------------------

def test_balancedness_through_placement_per_layer_and_overall():
    out = analysis.balancedness(two_steps(), CONTIGUOUS)
    assert out["source"] == "placement"
    assert out["per_layer"] == pytest.approx([6 / 8, 4 / 6])
    assert out["overall"] == pytest.approx(10 / 14)
    assert out["per_step"] == pytest.approx([10 / 14, 10 / 14])
    assert out["steps"] == [1, 2]


def test_balancedness_splits_replica_load_evenly():
    # E0 on both devices: layer 0's 6 tokens of E0 split 3 | 3 -> 3+2 | 4+0+3 = 5 | 7
    replicated = Placement([[[0, 1, -1], [2, 3, 0]]] * 2, 4)
    out = analysis.balancedness(two_steps(), replicated)
    assert out["per_layer"][0] == pytest.approx(6 / 7)
    # layer 1: E0's 3 split 1.5 | 1.5 -> 4.5 | 3.5
    assert out["per_layer"][1] == pytest.approx(4 / 4.5)


def test_balancedness_without_placement_uses_device_tokens():
    records = [make_record(1, busy_s=[0.1, 0.1], tokens=[14, 6]), make_record(2, busy_s=[0.1, 0.1], tokens=[5, 5])]
    out = analysis.balancedness(records)
    assert out["source"] == "devices" and out["per_layer"] is None
    assert out["per_step"] == pytest.approx([10 / 14, 1.0])
    assert out["overall"] == pytest.approx((10 + 5) / (14 + 5))


def test_balancedness_without_devices_or_placement_is_unknown():
    out = analysis.balancedness([make_record(1)])
    assert out["source"] is None and out["overall"] is None


def test_counterfactual_balancing_placement_gives_one():
    records = two_steps()
    now = analysis.counterfactual(records, CONTIGUOUS)
    assert now["overall"] == pytest.approx(10 / 14)
    assert now["device_loads"] == [[16.0, 8.0], [12.0, 4.0]]
    assert now["device_totals"] == [28.0, 12.0]
    better = analysis.counterfactual(records, BALANCED)
    assert better["overall"] == 1.0
    assert better["per_layer"] == [1.0, 1.0]
    assert better["device_loads"] == [[12.0, 12.0], [8.0, 8.0]]
    # the same answer the rebalancer's model gives
    assert better["overall"] == BALANCED.balancedness(ROUTING * 2)[1]


def test_counterfactual_refuses_a_placement_of_another_shape():
    with pytest.raises(analysis.AnalysisError, match="routing is \\[2 layers, 4 experts\\]"):
        analysis.counterfactual(two_steps(), Placement.contiguous(3, 4, 2))


def test_utilisation_is_busy_over_wall_per_device():
    records = two_steps() + [make_record(3, busy_s=[0.02, 0.1], tokens=[1, 1]), make_record(4)]  # 4: no devices
    out = analysis.utilisation(records)
    assert out["steps"] == 3
    assert out["per_device"] == pytest.approx([0.18 / 0.3, 0.18 / 0.3])
    assert analysis.utilisation([make_record(1)])["per_device"] == []


def test_straggler_found_with_its_experts():
    records = [make_record(1, busy_s=[0.02, 0.09, 0.03], tokens=[3, 20, 4])]
    # three devices: E0 | E1,E2 | E3 in both layers; device 1 holds L0/E1, L0/E2, L1/E1, L1/E2
    placement = Placement([[[0, -1], [1, 2], [3, -1]]] * 2, 4)
    (s,) = analysis.stragglers(records, placement, top=2)
    assert (s["step"], s["device"], s["tokens"]) == (1, 1, 20)
    assert s["busy_s"] == 0.09 and s["median_busy_s"] == 0.03
    assert s["margin_s"] == pytest.approx(0.06)
    # device 1 carries 2 + 4 (layer 0) + 3 + 1 (layer 1) = 10 tokens; L0/E2 and L1/E1 are the heaviest
    assert s["experts"] == [{"layer": 0, "expert": 2, "tokens": 4.0, "share": 0.4},
                            {"layer": 1, "expert": 1, "tokens": 3.0, "share": 0.3}]


def test_straggler_without_placement_reports_device_and_tokens():
    (s,) = analysis.stragglers([make_record(5, busy_s=[0.05, 0.01], tokens=[9, 2])])
    assert (s["step"], s["device"], s["tokens"]) == (5, 0, 9) and "experts" not in s
    assert analysis.stragglers([make_record(1)]) == []


def test_hottest_experts_with_layer_share():
    out = analysis.hottest_experts(two_steps(), top=3)
    # summed: layer 0 [12, 4, 8, 0] (24 tokens), layer 1 [6, 6, 2, 2] (16); ties by (layer, expert)
    assert out == [{"layer": 0, "expert": 0, "tokens": 12.0, "share": 0.5},
                   {"layer": 0, "expert": 2, "tokens": 8.0, "share": 8 / 24},
                   {"layer": 1, "expert": 0, "tokens": 6.0, "share": 6 / 16}]
    assert analysis.hottest_experts([], top=3) == []


# --- time -----------------------------------------------------------------------------------------

BREAKDOWN_SPANS = [
    (ENGINE_LANE, "layer 0", 0.0, 0.6, False, 0),  # no category: its inner spans decide
    (ENGINE_LANE, "attention", 0.0, 0.2, False, 0),
    (ENGINE_LANE, "moe", 0.2, 0.4, False, 0),
    (ENGINE_LANE, "router", 0.2, 0.05, False, 0),
    (ENGINE_LANE, "dispatch", 0.25, 0.05, False, 0),
    (ENGINE_LANE, "experts", 0.3, 0.2, False, 0),
    (ENGINE_LANE, "combine", 0.5, 0.1, False, 0),
    (device_lane(0), "experts", 0.3, 0.15, False, 0),  # nested in the engine's "experts": no double count
    (device_lane(1), "experts", 0.32, 0.18, False, 0),
    (device_lane(1), "experts", 0.6, 0.1, False, 0),  # no engine span over it: moe by itself
    (link_lane(0), "dispatch a2a", 0.25, 0.05, True, 0),
    (link_lane(1), "dispatch a2a", 0.26, 0.05, True, 0),
    (ENGINE_LANE, "all_to_all (modeled)", 0.7, 0.1, True, -1),  # modeled on the engine lane: not measured
    (ENGINE_LANE, "sampler", 0.9, 0.05, False, -1),
]


def test_step_breakdown_categories_nesting_and_modeled_comm():
    out = analysis.step_breakdown([make_record(1, wall=1.0, spans=BREAKDOWN_SPANS),
                                   make_record(2, wall=1.0, t_start=200.0)])  # no spans: all other
    m = out["measured_s"]
    assert m["attention"] == pytest.approx(0.2)
    assert m["moe"] == pytest.approx(0.5)
    assert m["sampler"] == pytest.approx(0.05)
    assert m["other"] == pytest.approx(0.25 + 1.0)
    # measured categories add up to the wall time: the modeled 0.16 s is not in them
    assert sum(m.values()) == pytest.approx(out["wall_s"]) and out["wall_s"] == pytest.approx(2.0)
    assert out["communication_modeled_s"] == pytest.approx(0.06 + 0.1)
    assert out["device_busy_s"] == pytest.approx([0.15, 0.28])
    assert out["steps"] == 2
    assert out["measured_mean_s"]["moe"] == pytest.approx(0.25)
    assert out["communication_modeled_mean_s"] == pytest.approx(0.08)


def test_latency_percentiles_and_throughput():
    reqs1 = [{"id": r, "event": "arrived", "t": 100.0} for r in "abc"] + \
            [{"id": r, "event": "first_token", "t": 100.1} for r in "abc"]
    reqs2 = [{"id": "a", "event": "finished", "t": 100.5, "reason": "stop", "prompt_tokens": 4, "output_tokens": 3,
              "ttft_s": 0.1, "tpot_s": 0.02},
             {"id": "b", "event": "finished", "t": 100.6, "reason": "stop", "prompt_tokens": 4, "output_tokens": 1,
              "ttft_s": 0.2, "tpot_s": None},
             {"id": "z", "event": "finished", "t": 100.7, "reason": "length", "prompt_tokens": 4,
              "output_tokens": 3, "ttft_s": 0.3, "tpot_s": 0.04}]  # z arrived before the range: no e2e
    records = [make_record(1, t_start=100.0, wall=0.5, requests=reqs1, decode_tokens=0),
               make_record(2, t_start=100.5, wall=0.5, requests=reqs2, decode_tokens=7)]
    out = analysis.latency_percentiles(records, q=(50, 90))
    assert out["ttft_s"] == pytest.approx({"p50": 0.2, "p90": 0.28})
    assert out["tpot_s"] == pytest.approx({"p50": 0.03, "p90": 0.038})
    assert out["e2e_s"] == pytest.approx({"p50": 0.55, "p90": 0.59})
    assert out["counts"] == {"ttft": 3, "tpot": 2, "e2e": 2}
    assert out["output_tokens"] == 10 and out["wall_s"] == pytest.approx(1.0)
    assert out["throughput_tok_s"] == pytest.approx(10.0)
    assert analysis.latency_percentiles([])["ttft_s"]["p50"] is None


# --- memory ---------------------------------------------------------------------------------------

def test_memory_growth_linear_leak():
    # 1 GB growing 10 MB/s; samples every 10 s (one step each): 90 s of steady growth
    records = [make_record(s, wall=10.0, rss=1e9 + 1e7 * (s * 10.0)) for s in range(1, 11)]
    out = analysis.memory_growth(records)
    assert out["samples"] == 10
    assert out["slope_bytes_per_s"] == pytest.approx(1e7)
    assert out["slope_bytes_per_step"] == pytest.approx(1e8)
    assert out["r2"] == pytest.approx(1.0)
    assert out["growth_bytes"] == pytest.approx(9e8)  # > 5% of the first sample
    assert out["leak_suspected"] is True
    # the same growth within 0.9 s is a warm-up as far as anyone can tell: not a leak
    short = [make_record(s, wall=0.1, rss=1e9 + 1e9 * (s * 0.1)) for s in range(1, 11)]
    assert analysis.memory_growth(short)["leak_suspected"] is False


def test_memory_growth_counts_each_sample_once_and_ignores_small_growth():
    # one sample per two steps (the process block is re-sent): 5 samples over 8 s, +1 MB/s on 1 GB
    records = [make_record(s, wall=1.0, rss=1e9 + 1e6 * (s // 2) * 2.0, sampled_at=(s // 2) * 2.0)
               for s in range(0, 10)]
    out = analysis.memory_growth(records)
    assert out["samples"] == 5 and out["absent"] is None
    assert out["slope_bytes_per_s"] == pytest.approx(1e6)
    assert out["leak_suspected"] is False  # 8 MB over the range: under 5% of 1 GB
    flat = analysis.memory_growth([make_record(s, wall=2.0, rss=5e8) for s in range(1, 5)])
    assert flat["slope_bytes_per_s"] == 0.0 and flat["leak_suspected"] is False


def test_memory_slope_is_absent_from_too_few_samples_or_too_short_a_span():
    # two samples 0.5 s apart once read as +100 MiB/s: noise, not a figure
    two = analysis.memory_growth([make_record(1, rss=1e9), make_record(6, wall=0.1, rss=1.05e9)])
    assert two["samples"] == 2 and two["slope_bytes_per_s"] is None and two["r2"] is None
    assert "2 memory samples" in two["absent"]
    one = analysis.memory_growth([make_record(1, rss=1e9)])
    assert one["slope_bytes_per_s"] is None and "1 memory sample " in one["absent"]
    short = analysis.memory_growth([make_record(s, wall=0.5, rss=1e9 + s * 1e7) for s in range(1, 6)])
    assert short["samples"] == 5 and short["slope_bytes_per_s"] is None and short["leak_suspected"] is False


def test_trace_report_on_one_memory_sample_says_absent(tmp_path):
    from typer.testing import CliRunner

    from moectl.cli.main import app
    from tests.paths import TRACES

    trace = TRACES / "steady_rebalance.trace"
    result = CliRunner().invoke(app, ["trace", "report", str(trace), "--from-step", "300", "--to-step", "305"])
    assert result.exit_code == 0, result.output
    assert "process memory slope absent" in result.output and "TypeError" not in result.output
    as_json = CliRunner().invoke(app, ["trace", "report", str(trace), "--from-step", "300", "--to-step", "305",
                                       "--json"])
    assert as_json.exit_code == 0 and '"slope_bytes_per_s": null' in as_json.output


# --- alerts ---------------------------------------------------------------------------------------

def test_imbalance_alert_names_device_experts_and_plan_prediction():
    topology = Topology(num_devices=2, devices_per_node=2)
    records = two_steps()
    (alert,) = analysis.alerts(records, placement=CONTIGUOUS, topology=topology, expert_bytes=1000, redundant=1)
    plan = plan_rebalance(ROUTING * 2, topology, 1, current=CONTIGUOUS, expert_bytes=1000).summary()
    assert alert["kind"] == "imbalance" and alert["severity"] == "warning"
    p = alert["predicted"]
    assert p["balancedness_before"] == pytest.approx(plan["balancedness_before"]) == pytest.approx(10 / 14)
    assert p["balancedness_after"] == pytest.approx(plan["balancedness_after"])
    assert p["balancedness_after"] > p["balancedness_before"]
    assert p["bytes_moved"] == plan["bytes_moved"]
    # device 0: 80% busy; its 28 tokens: L0/E0 12 and L1/E0 6 (tie with L1/E1 goes to the lower expert)
    assert p["device"] == 0 and p["experts"] == [[0, 0], [1, 0]]
    msg = alert["message"]
    assert msg.startswith("device 0 at 80% utilisation")
    assert "L0/E0 and L1/E0 carry 64% of its tokens" in msg
    assert f"from {plan['balancedness_before']:.2f} to {plan['balancedness_after']:.2f}" in msg
    assert "1 redundant slot per device" in msg


def test_imbalance_alert_on_four_devices_names_the_hot_device():
    # 4 devices x 2 experts; L1/E7 (on device 3) is hot
    routing = np.full((2, 8), 10, np.int32)
    routing[1, 7] = 90
    placement = Placement.contiguous(2, 8, 4)
    records = [make_record(s, routing=routing, busy_s=[0.02, 0.02, 0.02, 0.09], tokens=[40, 40, 40, 120])
               for s in (1, 2, 3)]
    topology = Topology(num_devices=4)
    out = analysis.alerts(records, placement=placement, topology=topology, redundant=2)
    (alert,) = [a for a in out if a["kind"] == "imbalance"]
    plan = plan_rebalance(routing * 3, topology, 2, current=placement).summary()
    assert alert["message"].startswith("device 3 at 90% utilisation")
    assert "L1/E7 and L0/E6 carry" in alert["message"]
    assert f"from {plan['balancedness_before']:.2f} to {plan['balancedness_after']:.2f}" in alert["message"]
    assert alert["predicted"]["redundant_per_device"] == 2


def test_imbalance_alert_without_topology_has_no_prediction():
    (alert,) = analysis.alerts(two_steps(), placement=CONTIGUOUS)
    assert "rebalancing" not in alert["message"] and "balancedness_after" not in alert["predicted"]
    # without a placement: from device tokens, no experts
    (alert,) = analysis.alerts(two_steps())
    assert alert["message"] == "device 0 at 80% utilisation (balancedness 0.71)."


def test_no_alerts_for_a_healthy_window():
    assert analysis.alerts(two_steps(), placement=BALANCED) == []


def test_kv_cache_and_leak_and_ttft_alerts():
    kv = analysis.alerts([make_record(1, kv=(95, 100), preempted=["r1"]), make_record(2, kv=(80, 100))])
    assert [a["kind"] for a in kv] == ["kv_pressure"]
    assert kv[0]["predicted"] == {"kv_usage_peak": 0.95, "preemptions": 1}
    assert analysis.alerts([make_record(1, kv=(95, 100))]) == []  # full but no preemption: fine

    cache = [{"hits": 1, "misses": 3, "prefetched": 0, "prefetch_useful": 0, "bytes_copied": 0, "miss_wait_s": 0.0},
             {"hits": 3, "misses": 1, "prefetched": 0, "prefetch_useful": 0, "bytes_copied": 0, "miss_wait_s": 0.0}]
    recs = [make_record(s, routing=np.zeros((2, 4)), busy_s=[0.05, 0.05], tokens=[1, 1], expert_cache=cache)
            for s in (1, 2)]
    recs[1]["devices"]["expert_cache"] = [dict(cache[0], hits=0), cache[1]]
    (a,) = analysis.alerts(recs)
    assert a["kind"] == "expert_cache" and a["predicted"]["hit_rate"] == pytest.approx(7 / 15)
    assert a["predicted"]["worst_device"] == 0

    leak = analysis.alerts([make_record(s, wall=10.0, rss=1e9 + 1e8 * s) for s in range(1, 11)])
    assert [a["kind"] for a in leak] == ["memory_leak"]

    finished = [{"id": str(i), "event": "finished", "t": 101.0, "reason": "stop", "prompt_tokens": 1,
                 "output_tokens": 1, "ttft_s": 10.0 if i == 0 else 0.01, "tpot_s": None} for i in range(20)]
    (a,) = analysis.alerts([make_record(1, requests=finished)])
    assert a["kind"] == "ttft_tail" and a["predicted"]["ttft_p50_s"] == pytest.approx(0.01)
    assert a["predicted"]["ratio"] > analysis.TTFT_TAIL_RATIO


def test_an_empty_step_range_names_the_flags_and_the_traces_steps():
    from typer.testing import CliRunner

    from moectl.cli.main import app
    from tests.paths import TRACES

    trace = TRACES / "steady_rebalance.trace"
    for command in (["trace", "report", str(trace)], ["trace", "export", str(trace), "-o", "/tmp/unused.json"]):
        result = CliRunner().invoke(app, [*command, "--from-step", "90000"])
        assert result.exit_code == 2
        assert "--from-step 90000: the trace has steps 0-" in result.output or \
            "--from-step 90000: the trace has steps 1-" in result.output, result.output
        assert "None" not in result.output


def test_union_length_by_group_equals_the_union_of_each_group_alone():
    from moectl.profiler.analysis import _union_length, _union_length_by_group

    rng = np.random.default_rng(0)
    for _ in range(100):
        n = int(rng.integers(1, 60))
        group = rng.integers(0, 5, n)
        starts = rng.uniform(0, 1, n)
        ends = np.minimum(starts + rng.uniform(0, 0.3, n), 1.0)
        got = _union_length_by_group(group, starts, ends, 1.0)
        assert set(got) == set(group.tolist())
        for g, length in got.items():
            assert length == pytest.approx(_union_length(starts[group == g], ends[group == g]), abs=1e-12)
