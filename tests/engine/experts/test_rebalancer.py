"""The rebalancer: balance, hierarchy, pins, migration awareness, refusals, policy and window."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moectl.engine.core.config import AutoRebalancePolicy, KnobError
from moectl.placement.placement import Placement, PlacementError
from moectl.placement.rebalancer import (
    LoadWindow,
    RebalanceError,
    load_loads_file,
    plan_rebalance,
    preview_plan,
    run_plan_rebalance,
    synthetic_loads,
)
from moectl.placement.topology import Topology

L, E, D = 4, 64, 8


@pytest.fixture(scope="module")
def zipf():
    return synthetic_loads(L, E, seed=0, skew=1.0)


def assert_valid(plan, redundant, num_devices=D, num_experts=E):
    p = plan.placement
    assert p.slots_per_device == -(-num_experts // num_devices) + redundant
    assert (p.replica_counts() >= 1).all()
    for layer in range(p.num_layers):
        for device in range(p.num_devices):
            held = p.experts_on(layer, device)
            assert len(held) == len(set(held)), "two replicas of an expert on one device"


def test_reaches_095_with_one_redundant_slot_per_device(zipf):
    plan = plan_rebalance(zipf, D, 1)
    assert_valid(plan, 1)
    assert plan.balancedness_before.overall < 0.6
    assert plan.balancedness_after.overall >= 0.95
    assert (plan.balancedness_after.per_layer >= 0.9).all()
    assert plan.placement.balancedness(zipf)[1] == pytest.approx(plan.balancedness_after.overall)
    assert plan.seconds > 0


def test_improves_balance_without_redundant_slots(zipf):
    plan = plan_rebalance(zipf, D, 0)
    assert_valid(plan, 0)
    assert (plan.placement.replica_counts() == 1).all()
    # without replicas the hottest expert bounds its device: balance <= mean / max(mean, hottest)
    mean = zipf.sum(1) / D
    bound = mean.sum() / np.maximum(mean, zipf.max(1)).sum()
    assert plan.balancedness_before.overall < plan.balancedness_after.overall <= bound
    assert plan.balancedness_after.overall >= 0.85 * bound


def test_hierarchical_over_nodes(zipf):
    topo = Topology(num_devices=16, devices_per_node=4)
    plan = plan_rebalance(zipf, topo, 1, expert_bytes=1)
    assert_valid(plan, 1, num_devices=16)
    assert plan.balancedness_after.overall >= 0.95
    node_loads = plan.placement.device_loads(zipf).reshape(L, 4, 4).sum(2)
    assert (node_loads.min(1) / node_loads.max(1) > 0.9).all()
    # a copy comes from the destination's node whenever the expert was already on that node
    current = Placement.contiguous(L, E, 16)
    for move in plan.moves:
        node = move.dst_device // 4
        if any(d // 4 == node for d, _ in current.replicas(move.layer, move.expert)):
            assert move.src_device // 4 == node


def test_pinned_experts_stay_in_their_slots(zipf):
    hot = [(layer, int(zipf[layer].argmax())) for layer in range(L)]
    current = Placement.contiguous(L, E, D, 1).pin(*hot[0])
    plan = plan_rebalance(zipf, D, 1, current=current, pinned=hot[1:])
    assert plan.placement.pinned == set(hot)
    for layer, expert in hot:
        assert plan.placement.replicas(layer, expert) == current.replicas(layer, expert)
    assert all((m.layer, m.expert) not in set(hot) for m in plan.moves)
    assert plan.balancedness_after.overall > plan.balancedness_before.overall


def test_replanning_the_same_loads_moves_nothing(zipf):
    first = plan_rebalance(zipf, D, 1, expert_bytes=1000)
    again = plan_rebalance(zipf, D, 1, current=first.placement, expert_bytes=1000)
    assert again.bytes_moved == 0 and again.moves == []
    assert again.placement == first.placement
    assert again.layers_kept == L


def test_small_drift_moves_less_than_planning_from_scratch(zipf):
    first = plan_rebalance(zipf, D, 1, expert_bytes=1000)
    drifted = zipf * np.random.default_rng(1).uniform(0.9, 1.1, zipf.shape)
    incremental = plan_rebalance(drifted, D, 1, current=first.placement, expert_bytes=1000)
    scratch = plan_rebalance(drifted, D, 1, expert_bytes=1000)
    assert incremental.bytes_moved < scratch.bytes_moved
    assert incremental.bytes_moved == len(incremental.moves) * 1000
    assert incremental.balancedness_after.overall >= scratch.balancedness_after.overall - 0.01


def test_aiming_at_a_target_moves_less_and_reaches_it():
    """After a 10% drift, re-planning for a balancedness of 0.99 from the placement in force reaches
    it with fewer moves than re-planning for the best balance; pinned experts stay; a target the
    swaps cannot reach falls back to the usual plan."""
    loads = synthetic_loads(12, 96, seed=2, skew=0.8)
    topo = Topology(num_devices=16, devices_per_node=4)
    first = plan_rebalance(loads, topo, 1)
    drifted = loads * np.random.default_rng(3).uniform(0.9, 1.1, loads.shape)
    pinned = [(0, int(first.placement.slots[0, 0, 0]))]
    best = plan_rebalance(drifted, topo, 1, current=first.placement, pinned=pinned)
    aimed = plan_rebalance(drifted, topo, 1, current=first.placement, pinned=pinned, target=0.99)
    assert aimed.balancedness_before.overall < 0.99 <= aimed.balancedness_after.overall
    assert 0 < len(aimed.move_array) < len(best.move_array)
    assert aimed.placement.slots[0, 0, 0] == first.placement.slots[0, 0, 0]
    assert_valid(aimed, 1, 16, 96)
    # replicas are kept as they are: the counts do not change
    assert (aimed.placement.replica_counts() == first.placement.replica_counts()).all()
    impossible = plan_rebalance(drifted, topo, 1, current=first.placement, target=1.0)
    assert len(impossible.move_array) == len(plan_rebalance(drifted, topo, 1, current=first.placement).move_array)
    with pytest.raises(RebalanceError, match="^target:"):
        plan_rebalance(drifted, topo, 1, current=first.placement, target=1.5)


def test_hbm_budget_is_refused_with_the_device_named(zipf):
    slots = L * (E // D + 1)
    with pytest.raises(RebalanceError, match=r"device \d+: experts need .* over the HBM budget"):
        plan_rebalance(zipf, D, 1, expert_bytes=100, hbm_budget_bytes=slots * 100 - 1)
    assert plan_rebalance(zipf, D, 1, expert_bytes=100, hbm_budget_bytes=slots * 100).placement


@pytest.mark.parametrize("call, word", [
    (lambda W: plan_rebalance(W, 0, 1), "devices"),
    (lambda W: plan_rebalance(W, D, -1), "redundant_per_device"),
    (lambda W: plan_rebalance(-W, D, 1), "non-negative"),
    (lambda W: plan_rebalance(W[0], D, 1), r"shape \[layers, experts\]"),
    (lambda W: plan_rebalance(W, D, 1, current=Placement.contiguous(L, E, 4)), "current: placement"),
    (lambda W: plan_rebalance(W, D, 1, pinned=[(0, E)]), f"expert {E} out of range"),
    (lambda W: plan_rebalance(W, D, 1, tolerance=-1), "tolerance"),
])
def test_bad_input_is_refused(zipf, call, word):
    with pytest.raises(ValueError, match=word):
        call(zipf)


def test_pinned_replicas_that_cannot_fit_are_refused():
    # expert 0 pinned on both devices: 2 pinned replicas + 3 other experts > 2 devices x 2 slots
    current = Placement([[[0, 1, 2], [0, 3, -1]]], 4).pin(0, 0)
    with pytest.raises(RebalanceError, match="layer 0: 3 unpinned experts \\+ 2 pinned replicas need 5 slots"):
        plan_rebalance([[5, 1, 1, 1]], 2, 0, current=current)
    before = current.slots.copy()
    assert (current.slots == before).all()


def test_run_plan_rebalance_reports_the_cli_fields(zipf):
    out = run_plan_rebalance(zipf, devices=D, redundant=1, devices_per_node=4, expert_bytes=10)
    json.dumps(out)
    for key in ("balancedness_before", "balancedness_after", "bytes_moved", "seconds",
                "balancedness_before_per_layer", "balancedness_after_per_layer"):
        assert key in out
    assert len(out["balancedness_after_per_layer"]) == L
    assert out["bytes_moved"] == out["moves"] * 10


def test_synthetic_loads_are_seeded_and_skewed():
    a = synthetic_loads(3, 32, seed=5, skew=1.0, tokens_per_layer=1000)
    assert a.shape == (3, 32) and (a.sum(1) == 1000).all()
    assert (a == synthetic_loads(3, 32, seed=5, skew=1.0, tokens_per_layer=1000)).all()
    assert a.max() > 5 * a.mean()
    assert synthetic_loads(2, 8, skew=0, tokens_per_layer=80000).max() < 12000  # no skew: near-uniform


def test_loads_files(tmp_path):
    W = synthetic_loads(2, 8, seed=1)
    np.save(tmp_path / "w.npy", W)
    (tmp_path / "w.json").write_text(json.dumps({"loads": W.tolist()}))
    (tmp_path / "bad.json").write_text("[1, 2")
    assert (load_loads_file(tmp_path / "w.npy") == W).all()
    assert (load_loads_file(tmp_path / "w.json") == W).all()
    with pytest.raises(RebalanceError, match="bad.json: not valid json"):
        load_loads_file(tmp_path / "bad.json")
    with pytest.raises(RebalanceError, match="cannot read"):
        load_loads_file(tmp_path / "missing.npy")
    with pytest.raises(RebalanceError, match="expected .npy or .json"):
        load_loads_file(tmp_path / "w.csv")


def test_auto_rebalance_policy():
    assert not AutoRebalancePolicy().should_rebalance(100, 0.1)
    every = AutoRebalancePolicy("auto", every_k_steps=10)
    assert [s for s in range(31) if every.should_rebalance(s, 1.0)] == [10, 20, 30]
    below = AutoRebalancePolicy("auto", threshold=0.9)
    assert below.should_rebalance(3, 0.89) and not below.should_rebalance(3, 0.9)
    with pytest.raises(KnobError, match="mode"):
        AutoRebalancePolicy("sometimes")
    with pytest.raises(KnobError, match="threshold"):
        AutoRebalancePolicy("auto", threshold=1.5)
    with pytest.raises(KnobError, match="^target"):
        AutoRebalancePolicy("auto", target=0)


def test_the_token_plan_aims_at_the_policys_target(zipf):
    """The token-balancing preview (what an engine shows before it has timed a step) moves only as
    much as reaching the policy's target takes: nothing when the placement in force meets it."""
    current = Placement.contiguous(L, E, D, redundant_slots_per_device=1)
    topology = Topology(num_devices=D)
    best = preview_plan(zipf, topology, current)
    now = current.balancedness(zipf)[1]
    assert len(best.move_array) > 0 and now < best.balancedness_after.overall
    assert len(preview_plan(zipf, topology, current, target=now * 0.99).move_array) == 0
    aimed = preview_plan(zipf, topology, current, target=min(1.0, (now + best.balancedness_after.overall) / 2))
    assert 0 < len(aimed.move_array) <= len(best.move_array)


def test_load_window_mean_and_ema():
    window = LoadWindow(1, 2, size=2)
    assert window.loads().tolist() == [[0, 0]]
    for step in ([[1, 0]], [[3, 2]], [[5, 4]]):
        window.add(np.array(step))
    assert len(window) == 2 and window.loads().tolist() == [[4, 3]]
    ema = LoadWindow(1, 2, ema=0.5)
    ema.add([[4, 0]])
    ema.add([[0, 4]])
    assert ema.loads().tolist() == [[2, 2]]
    with pytest.raises(RebalanceError, match="window expects"):
        window.add([[1, 2, 3]])


def test_bench_runs_small(capsys):
    from bench.rebalance_bench import main

    assert main(["--layers", "2", "--experts", "16", "--devices", "4", "--devices-per-node", "2",
                 "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["balancedness_after"] >= out["balancedness_before"] and out["ratio_to_target"] > 0


def test_the_one_preview_keeps_the_slot_count_and_prices_the_plan_it_made(zipf):
    current = Placement.contiguous(L, E, D, redundant_slots_per_device=1)
    seen = []

    def predict(placement):
        seen.append(placement)
        return {"gain": 0.5}

    plan = preview_plan(zipf, Topology(num_devices=D), current, expert_bytes=10, predict=predict)
    assert plan.placement.slots_per_device == current.slots_per_device
    assert seen == [plan.placement] and plan.summary()["predicted"] == {"gain": 0.5}
    same = plan_rebalance(zipf, Topology(num_devices=D), 1, current=current, expert_bytes=10)
    assert (plan.placement.slots == same.placement.slots).all() and plan.bytes_moved == same.bytes_moved
    # spare slots asked for; no model to price with
    wider = preview_plan(zipf, Topology(num_devices=D), current, redundant=2)
    assert wider.placement.slots_per_device == E // D + 2 and wider.prediction is None


def test_the_one_preview_refuses_a_window_without_routing():
    with pytest.raises(PlacementError, match="no routing observed yet"):
        preview_plan(np.zeros((L, E)), Topology(num_devices=D), Placement.contiguous(L, E, D))
