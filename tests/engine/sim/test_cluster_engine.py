"""The simulated backend (engine/sim/cluster_engine.py, batching.py; tools/sim_workload.py):
continuous batching within the knobs and the KV pool, every request to its length, records that
say simulated and add up, a rebalance that is predicted, applied and stalls the next step, and a
workload on the simulated clock."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moectl.engine.core.config import SchedulerKnobs
from moectl.engine.sim.batching import ClusterBatcher
from moectl.engine.sim.cluster_config import SimClusterConfig
from moectl.engine.sim.cluster_engine import ALL_LINKS_LANE, SimulatedEngine
from moectl.engine.tools.demo_workload import DemoLoad
from moectl.engine.tools.sim_workload import SimWorkload
from moectl.placement.rebalancer import plan_rebalance
from moectl.profiler.recorder import engine_header
from tests.paths import DOCS

DSV3 = DOCS / "configs" / "deepseek-v3.json"


def engine(devices=64, routing="zipf:1.2", **kw) -> SimulatedEngine:
    return SimulatedEngine(SimClusterConfig(model=DSV3, devices=devices, routing=routing, **kw))


def run(e: SimulatedEngine, steps: int) -> list[dict]:
    records: list[dict] = []
    e.add_listener(on_step=lambda s: records.append(s.as_record()))
    while len(records) < steps and e.has_unfinished():
        e.step()
    return records


def test_batches_respect_the_knobs_and_the_kv_pool_and_every_request_gets_its_length():
    knobs = SchedulerKnobs(max_num_seqs=6, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    batcher = ClusterBatcher(groups=3, blocks_per_group=20, block_size=16, knobs=knobs)
    rng = np.random.default_rng(0)
    lengths = {rid: (int(rng.integers(8, 100)), int(rng.integers(1, 40))) for rid in range(60)}
    for rid, (prompt, out) in lengths.items():
        batcher.add(rid, prompt, out, 0.0)
    finished, now = {}, 0.0
    for _ in range(2000):
        if not batcher.has_work():
            break
        batch = batcher.schedule(now)
        r = batcher.run
        per_group = np.bincount(r["group"], batch.tokens, 3)
        assert per_group.max() <= 64
        assert np.bincount(r["group"], minlength=3).max() <= 6
        prefill = batch.tokens[r["done"] < r["target"]]
        assert prefill.max(initial=0) <= 32  # a chunk never exceeds the threshold
        held = np.bincount(r["group"], -(-(r["done"] + batch.tokens) // 16), 3)
        assert held.max() <= 20  # the step's KV fits every group's pool
        now += 0.01
        batcher.finish_step(batch, now)
        for event in batcher.take_events():
            if event["event"] == "finished":
                finished[event["id"]] = event
    assert len(finished) == 60
    assert batcher.preemptions > 0  # the pool was too small for all at once: some were recomputed
    for rid, (prompt, out) in lengths.items():
        event = finished[f"req-{rid}"]
        assert (event["prompt_tokens"], event["output_tokens"]) == (prompt, out)
        assert event["ttft_s"] > 0


def test_records_say_simulated_and_add_up():
    e = engine()
    header = engine_header(e)
    assert header["clock"] == "simulated" and header["devices"]["backend"] == "simulated"
    assert "KV pool per device (simulated)" in header["memory_plan"]["table"]
    for _ in range(40):
        e.add_lengths(600, 20)
    records = run(e, 30)
    top_k = e.sim_model.shape.top_k
    for a, b in zip(records, records[1:]):
        assert b["t_start"] == pytest.approx(a["t_end"])  # the simulated clock runs step to step
    for rec in records:
        devices = rec["devices"]
        assert rec["simulated"] and devices["simulated"] and devices["step_time"]["simulated"]
        tokens = rec["batch"]["prefill_tokens"] + rec["batch"]["decode_tokens"]
        routing = rec["routing"]
        assert routing[e.moe_layers].sum(1).tolist() == [tokens * top_k] * len(e.moe_layers)
        dense = [i for i in range(e.model_config.num_layers) if i not in e.moe_layers]
        assert routing[dense].sum() == 0
        spans = rec["spans"]
        assert spans["modeled"].all() and spans["lanes"][-1] == ALL_LINKS_LANE
        step_s = rec["t_end"] - rec["t_start"]
        assert (spans["start_s"] + spans["dur_s"]).max() == pytest.approx(step_s, rel=1e-6)
        assert sum(devices["breakdown_ms"].values()) == pytest.approx(step_s * 1e3, rel=1e-6)
        assert len(devices["busy_s"]) == 64 and max(devices["step_time"]["utilisation"]) <= 1 + 1e-9
        assert rec["cache"]["kv_blocks_used"] <= rec["cache"]["kv_blocks_total"]


def test_a_skewed_cluster_rebalances_predicted_applied_and_stalled():
    e = engine(devices=64, routing="zipf:1.2")
    for _ in range(64 * 32):
        e.add_lengths(200, 400)
    run(e, 40)
    plan = e.experts.preview()
    assert plan.prediction["simulated"] and plan.prediction["gain"] > 0.1
    assert plan.balancedness_after.overall > plan.balancedness_before.overall
    actions: list[dict] = []
    e.add_listener(on_action=actions.append)
    future = e.experts.apply(plan.placement, kind="rebalance_apply")
    records = run(e, 1)  # the apply runs before this step, whose time holds the stall
    result = future.result(timeout=0)
    assert result["simulated"] and result["migration"]["simulated"] and result["seconds"] > 0
    stall = records[-1]["devices"]["step_time"]["migration_stall_s"]
    assert stall == pytest.approx(result["seconds"])
    assert records[-1]["spans"]["start_s"].min() == pytest.approx(stall)
    assert e.experts.placement == plan.placement
    assert engine_header(e)["devices"]["placement"] == plan.placement.to_dict()
    assert [a["kind"] for a in actions] == ["rebalance_apply"]
    after = run(e, 5)[-1]
    assert after["devices"]["step_time"]["migration_stall_s"] == 0


def test_knobs_change_the_next_batch_and_bad_ones_are_refused():
    e = engine()
    for _ in range(200):
        e.add_lengths(600, 30)
    e.update_knobs(max_num_batched_tokens=256, long_prefill_token_threshold=128)
    rec = run(e, 1)[0]
    assert rec["knobs"]["max_num_batched_tokens"] == 256
    assert rec["batch"]["prefill_tokens"] <= 256 * 64
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        e.update_knobs(long_prefill_token_threshold=1024)
    with pytest.raises(ValueError, match="capture"):
        e.capture(2)
    with pytest.raises(ValueError, match="exceed the context"):
        e.add_lengths(10**6, 1)


def test_the_workload_runs_on_the_simulated_clock_and_an_auto_rate_keeps_the_queue_short():
    e = engine(devices=64, routing="balanced")
    workload = SimWorkload(DemoLoad(rate="auto", prompt_len="256-1024", output_len="32-128"), seed=1)
    steps = 0
    while steps < 400:
        workload.feed(e)
        if e.has_unfinished():
            e.step()
            steps += 1
    assert isinstance(workload.load.rate, float) and workload.load.rate > 0
    assert e.batcher.finished > 0 and len(e.batcher.waiting) <= e.groups  # it keeps up
    idle = engine(devices=64, routing="balanced")
    slow = SimWorkload(DemoLoad(rate=0.01, prompt_len="16", output_len="4"), seed=2)
    slow.feed(idle)  # idle: the clock jumps to the first arrival (about 100 simulated seconds)
    assert idle.now > 1 and slow.added == 1
    with pytest.raises(ValueError, match="rate"):
        slow.update(replace(slow.load, rate=-1))


def test_drift_moves_which_experts_are_hot_but_keeps_the_skew():
    e = engine(routing="zipf:1.0", drift=0.05)
    before = e.shares.copy()
    for _ in range(100):
        e.add_lengths(64, 8)
    run(e, 50)
    assert not np.allclose(before, e.shares)
    np.testing.assert_allclose(np.sort(before, 1), np.sort(e.shares, 1))


def test_planning_does_not_mutate_the_engine_placement_and_devices_beyond_the_engine_limit_are_refused():
    e = engine()
    placement = e.experts.placement
    plan_rebalance(np.ones((e.model_config.num_layers, e.model_config.num_experts)), e.experts.topology, 1,
                   current=placement)
    assert e.experts.placement is placement
    with pytest.raises(ValueError, match="--devices"):
        SimClusterConfig(model=DSV3, devices=1000)
    with pytest.raises(ValueError, match="--drift"):
        SimClusterConfig(model=DSV3, drift=5)


def test_edits_auto_mode_and_custom_ids_on_a_simulated_cluster():
    import threading

    e = engine(routing="zipf:1.2")
    for _ in range(64 * 8):
        e.add_lengths(200, 50)
    run(e, 10)
    done = threading.Event()
    layer, expert = e.moe_layers[0], 0
    src = next(d for d in range(64) if expert in e.experts.placement.experts_on(layer, d))

    def edit():  # held its lock across apply(): a plain Lock deadlocked here
        e.experts.edit("replicate", layer=layer, expert=expert, device=(src + 1) % 64)
        done.set()
    threading.Thread(target=edit, daemon=True).start()
    assert done.wait(5), "edit() did not return"
    run(e, 1)
    assert len(e.experts.placement.replicas(layer, expert)) == 2
    actions: list[dict] = []
    e.add_listener(on_action=actions.append)
    from moectl.engine.core.config import AutoRebalancePolicy
    # a gate no plan clears: auto mode applies nothing and says why (the real cluster's rule)
    e.experts.auto = AutoRebalancePolicy(mode="auto", every_k_steps=1, min_gain=0.99)
    run(e, 5)
    assert not [a for a in actions if a["kind"] in ("auto_rebalance_plan", "rebalance_apply")]
    held = [a["result"] for a in actions if a["kind"] == "auto_rebalance_held"]
    assert held and "below the 99% gate" in held[0]["reason"] and held[0]["gain_low"] < 0.99
    named = engine()
    named.add_lengths(64, 4, request_id="job-1")
    named.add_lengths(64, 4, request_id="req-foo")  # looks like the engine's own names: kept as given
    records = run(named, 10)
    ids = {ev["id"] for r in records for ev in r["requests"]}
    assert ids == {"job-1", "req-foo"}
    with pytest.raises(ValueError, match="stream"):
        named.add_request([1, 2, 3], stream=True)


def test_two_batch_overlap_spans_fit_the_overlapped_step():
    e = engine(overlap="two-batch")
    for _ in range(64 * 16):
        e.add_lengths(300, 30)
    for rec in run(e, 15):
        step_s = rec["t_end"] - rec["t_start"]
        ends = rec["spans"]["start_s"] + rec["spans"]["dur_s"]
        assert ends.max() <= step_s * (1 + 1e-9)


def test_a_simulated_preview_is_planned_and_gated_by_the_cost_model_and_agrees_with_the_simulator():
    # the cost model is fitted on the simulated steps' per (device, layer) expert seconds; its
    # prediction on the window must match the step model re-run on the same steps under both placements
    e = engine(routing="zipf:1.2")
    for _ in range(64 * 8):
        e.add_lengths(200, 50)
    records = run(e, 40)
    assert records[-1]["devices"]["step_time"]["cost_model"]["samples"] > 0
    plan = e.experts.preview()
    p = plan.prediction
    assert p["simulated"] and p["model"].startswith("cost model fitted on the simulated steps")
    assert {"gain_low", "gain_high", "acts", "reason", "parts"} <= set(p)
    assert p["gain"] > 0.3 and p["parts"]["link_s"][1] < p["parts"]["link_s"][0]  # skewed: balance pays
    assert abs(p["gain"] - p["step_model_gain"]) <= max(0.01, 0.2 * abs(p["step_model_gain"]))


def test_a_simulated_cluster_with_no_spare_slot_plans_by_swaps():
    # no spare slot: the planner only swaps experts, priced and gated as with spare slots
    e = engine(routing="zipf:1.2", redundant_slots=0)
    for _ in range(64 * 4):
        e.add_lengths(200, 20)
    run(e, 12)
    p = e.experts.preview().prediction
    assert p["model"].startswith("cost model fitted on the simulated steps") and "acts" in p
    assert p["parts"]["routing_s"] == [0.0, 0.0]  # no slot for a replica, so no replica to route


def test_the_seeds_card_and_the_five_stage_schedule_run_as_a_simulated_cluster():
    for kw, hardware in (({"hardware": "mtt-s5000"}, "Moore Threads MTT S5000"), ({"overlap": "five-stage"},
                                                                                  "NVIDIA H800 SXM5")):
        e = engine(devices=16, routing="balanced", **kw)
        workload = SimWorkload(DemoLoad(rate="auto", prompt_len="64-256", output_len="8-16"), seed=1)
        records: list[dict] = []
        e.add_listener(on_step=lambda s: records.append(s.as_record()))
        while len(records) < 20:
            workload.feed(e)
            if e.has_unfinished():
                e.step()
        assert engine_header(e)["simulated"]["hardware"] == hardware
        for rec in records:
            assert rec["simulated"] and rec["t_end"] > rec["t_start"]
            ends = rec["spans"]["start_s"] + rec["spans"]["dur_s"]
            assert ends.max() == pytest.approx(rec["t_end"] - rec["t_start"], rel=1e-6)
