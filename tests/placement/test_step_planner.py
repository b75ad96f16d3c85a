"""The planner that minimises the predicted step time, and the gate that decides whether a plan
acts, on synthetic windows whose cost model is fixed, so each regime's answer can be reasoned out."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moectl.placement.decision import StepBasis, decide
from moectl.placement.placement import Placement
from moectl.placement.rebalancer import pack, plan_rebalance, synthetic_loads
from moectl.placement.step_planner import StepCost, plan_between, plan_step_time, search_steps
from moectl.placement.step_time import ExpertCostModel, predict_step_times
from moectl.placement.topology import Topology

L, E, D, S = 4, 16, 4, 64
TOPOLOGY = Topology(num_devices=D)
# this machine's shape of cost: a non-empty expert costs as much as ~60 rows
PER_EXPERT = ExpertCostModel.fixed(90e-6, 1.5e-6, 20e-6, 3e-5, 4)
# a GPU-like shape: rows dominate
PER_ROW = ExpertCostModel.fixed(1e-6, 2e-5, 0.0, 2e-5, 4)


def window(rows_per_step: int, seed: int = 0) -> np.ndarray:
    """[S, L, E] routing: a fixed Zipf popularity per layer, each step a multinomial draw."""
    return synthetic_loads(L, E, seed, skew=1.2, tokens_per_layer=rows_per_step, steps=S)


def step_s(model, placement, loads) -> float:
    return predict_step_times(model, placement, loads, list(range(L)), 0.01, 0.0, 1.0)["step_s"]


def basis(loads) -> StepBasis:
    return StepBasis(loads, np.full(S, 0.01), np.zeros(S), np.full(S, 64.0), list(range(L)))


@pytest.mark.parametrize("model", [PER_EXPERT, PER_ROW], ids=["per-expert", "per-row"])
@pytest.mark.parametrize("rows", [16, 2048], ids=["decode", "prefill"])
def test_a_plan_is_never_predicted_slower_than_the_placement_in_force(model, rows):
    current = Placement.contiguous(L, E, D, 1)
    loads = window(rows)
    plan = plan_step_time(loads, current, TOPOLOGY, StepCost(model), list(range(L)))
    assert step_s(model, plan.placement, loads) <= step_s(model, current, loads) + 1e-12
    assert plan.placement.slots_per_device == current.slots_per_device


def test_where_fixed_per_expert_costs_dominate_it_keeps_what_the_token_balancer_would_slow():
    current = Placement.contiguous(L, E, D, 1)
    loads = window(16)  # decode: a few rows per active expert
    tokens = plan_rebalance(loads.sum(0), TOPOLOGY, 1, current=current)
    plan = plan_step_time(loads, current, TOPOLOGY, StepCost(PER_EXPERT, copy_s=2e-3), list(range(L)))
    assert step_s(PER_EXPERT, tokens.placement, loads) > step_s(PER_EXPERT, current, loads)  # balancing rows loses
    assert len(plan.move_array) < len(tokens.move_array) / 4


def test_where_rows_dominate_it_balances_as_well_as_the_token_balancer():
    current = Placement.contiguous(L, E, D, 1)
    loads = window(2048)
    tokens = plan_rebalance(loads.sum(0), TOPOLOGY, 1, current=current)
    plan = plan_step_time(loads, current, TOPOLOGY, StepCost(PER_ROW), list(range(L)))
    now, ours, theirs = (step_s(PER_ROW, p, loads) for p in (current, plan.placement, tokens.placement))
    assert ours < 0.75 * now and ours <= theirs * 1.02


def test_a_replica_that_does_not_pay_leaves_its_slot_empty():
    # every expert equally loaded, a few rows each: a replica only adds a second fixed cost
    loads = np.full((S, L, E), 2.0)
    full = Placement.contiguous(L, E, D, 1)
    slots = full.slots.copy()
    for d in range(D):  # every spare slot holds a replica of another device's expert
        slots[:, d, -1] = ((d + 1) % D) * (E // D)
    replicated = Placement(slots, E)
    plan = plan_step_time(loads, replicated, TOPOLOGY, StepCost(PER_EXPERT), list(range(L)))
    assert (plan.placement.slots == -1).sum() > 0
    assert step_s(PER_EXPERT, plan.placement, loads) < step_s(PER_EXPERT, replicated, loads)


def test_pinned_experts_stay_on_their_devices():
    current = Placement.contiguous(L, E, D, 1).pin(0, 0).pin(1, 5)
    plan = plan_step_time(window(2048), current, TOPOLOGY, StepCost(PER_ROW), list(range(L)))
    assert (plan.placement.slots[0, 0] == 0).any() and (plan.placement.slots[1, 1] == 5).any()
    assert plan.placement.pinned == current.pinned


def test_search_steps_span_the_windows_batch_sizes():
    loads = np.zeros((40, 1, 2))
    loads[:, 0, 0] = np.arange(40)
    picked = search_steps(loads, 5)
    assert picked[0] == 0 and picked[-1] == 39 and len(picked) == 5


def test_the_gate_acts_only_when_the_intervals_lower_end_clears_it():
    current = Placement.contiguous(L, E, D, 1)
    loads = window(2048)
    cost = StepCost(PER_ROW)
    residuals = np.random.default_rng(1).normal(0, 0.05, 500)
    go = decide(basis(loads), current, TOPOLOGY, cost, residuals=residuals)
    assert go.acts and go.gain_low >= 0.03 and go.gain_low <= go.gain <= go.gain_high
    assert go.step_s_after < go.step_s_before and "ms a step saved" in go.reason
    json.dumps(go.prediction())  # it travels in action records and over the control API
    held = decide(basis(loads), current, TOPOLOGY, cost, residuals=residuals, min_gain=go.gain_low + 0.01,
                  plan=go.plan)
    assert not held.acts and "below the" in held.reason


def test_when_nothing_pays_it_says_why():
    current = Placement.contiguous(L, E, D, 1)
    quiet = decide(basis(window(16)), current, TOPOLOGY, StepCost(PER_EXPERT, copy_s=2e-3))
    assert not quiet.acts
    assert "expert work is" in quiet.reason and "fixed per-expert costs are" in quiet.reason


def test_the_migration_stall_counts_against_a_plan():
    current = Placement.contiguous(L, E, D, 1)
    loads = window(2048)
    cheap = decide(basis(loads), current, TOPOLOGY, StepCost(PER_ROW, copy_s=0.0))
    costly = decide(basis(loads), current, TOPOLOGY, StepCost(PER_ROW, copy_s=1e-3, horizon_steps=64),
                    plan=cheap.plan)
    stall = len(cheap.plan.move_array) * 1e-3 / 64
    assert costly.step_s_after == pytest.approx(cheap.step_s_after + stall)
    assert costly.parts["migration_s"] == [0.0, pytest.approx(stall)]


def test_a_plan_that_only_drops_replicas_can_act():
    loads = np.full((S, L, E), 2.0)
    slots = Placement.contiguous(L, E, D, 1).slots.copy()
    for d in range(D):
        slots[:, d, -1] = ((d + 1) % D) * (E // D)
    replicated = Placement(slots, E)
    dropped = slots.copy()
    dropped[:, :, -1] = -1
    from moectl.placement.step_planner import plan_between

    plan = plan_between(replicated, Placement(dropped, E), loads.sum(0), TOPOLOGY, "locality")
    assert len(plan.move_array) == 0  # nothing is copied
    cost = StepCost(PER_EXPERT)
    quick = StepBasis(loads, np.full(S, 1e-4), np.zeros(S), np.full(S, 64.0), list(range(L)))  # experts dominate
    decision = decide(quick, replicated, TOPOLOGY, cost, residuals=np.zeros(1), plan=plan)
    assert decision.gain > 0.03 and decision.acts and "0 expert copies" in decision.reason


def with_routing(model: ExpertCostModel, call_s: float, entry_s: float = 0.0) -> ExpertCostModel:
    priced = ExpertCostModel.from_summary(model.summary())
    priced.route_call_s, priced.route_entry_s = call_s, entry_s
    return priced


def replicated_layers(placement: Placement) -> int:
    return sum(int((np.bincount(layer[layer >= 0], minlength=E) > 1).any()) for layer in placement.slots)


def test_replica_routing_cost_counts_against_a_replica():
    # prefill-sized steps where rows dominate: replicas pay, unless routing a replicated layer costs more
    current = Placement.contiguous(L, E, D, 1)
    loads = window(2048)
    free = plan_step_time(loads, current, TOPOLOGY, StepCost(PER_ROW), list(range(L)))
    dear = plan_step_time(loads, current, TOPOLOGY, StepCost(with_routing(PER_ROW, 1.0)), list(range(L)))
    assert replicated_layers(free.placement) == L
    assert replicated_layers(dear.placement) == 0


def test_routing_under_the_placement_in_force_comes_out_of_the_rest():
    # the measured other time holds the routing of the replicas in force: dropping them saves it
    slots = Placement.contiguous(L, E, D, 1).slots.copy()
    for d in range(D):
        slots[:, d, -1] = ((d + 1) % D) * (E // D)
    replicated = Placement(slots, E)
    loads = np.full((S, L, E), 2.0)  # even loads, a few rows each: no replica pays
    cost = StepCost(with_routing(PER_EXPERT, 1e-4, 1e-7))
    routing = L * (1e-4 + 1e-7 * E * 2.0)
    kept = decide(basis(loads), replicated, TOPOLOGY, cost,
                  plan=plan_between(replicated, replicated, loads.sum(0), TOPOLOGY, cost.policy))
    assert kept.parts["routing_s"] == pytest.approx([routing, routing])
    assert kept.parts["other_s"][0] == pytest.approx(0.01 - routing)
    dropped = decide(basis(loads), replicated, TOPOLOGY, cost)
    assert replicated_layers(dropped.plan.placement) == 0
    assert dropped.parts["routing_s"] == pytest.approx([routing, 0.0])
    assert dropped.step_s_before - dropped.step_s_after >= routing - 1e-12


def test_the_routing_cost_travels_with_the_model():
    model = with_routing(PER_ROW, 3e-6, 4e-9)
    for copy in (model.frozen(), ExpertCostModel.from_summary(json.loads(json.dumps(model.summary())))):
        assert (copy.route_call_s, copy.route_entry_s) == (3e-6, 4e-9)
        assert copy.routing_s(np.array([1000.0])) == pytest.approx([7e-6])


def test_the_packing_seed_places_every_expert_in_the_slots_in_force():
    current = Placement.contiguous(L, E, D, 1).pin(2, 3)
    slots = pack(window(2048).sum(0), TOPOLOGY, current)
    assert slots.shape == current.slots.shape
    for layer in slots:
        assert set(layer[layer >= 0].tolist()) == set(range(E))
    assert (slots[2, 0] == 3).any()  # the pinned expert stays on its device


@pytest.mark.parametrize("deadline", [0.0, 0.05])
def test_a_deadline_cuts_the_search_not_the_guarantee(deadline):
    # however little time the search gets, the seeds are priced: rows dominate, the packing wins
    current = Placement.contiguous(L, E, D, 1)
    loads = window(2048)
    plan = plan_step_time(loads, current, TOPOLOGY, StepCost(PER_ROW), list(range(L)), deadline_s=deadline)
    assert step_s(PER_ROW, plan.placement, loads) < 0.8 * step_s(PER_ROW, current, loads)  # the packing seed


def test_a_decision_names_each_window_steps_prediction_by_its_start():
    loads = window(2048)
    named = StepBasis(loads, np.full(S, 0.01), np.zeros(S), np.full(S, 64.0), list(range(L)), np.arange(S) * 0.5)
    d = decide(named, Placement.contiguous(L, E, D, 1), TOPOLOGY, StepCost(PER_ROW))
    per_step = d.prediction()["per_step"]
    assert per_step["t_start"] == (np.arange(S) * 0.5).tolist()
    assert np.mean(per_step["before_s"]) == pytest.approx(d.step_s_before)
    assert np.mean(per_step["after_s"]) == pytest.approx(d.step_s_after)
    assert "per_step" not in decide(basis(loads), Placement.contiguous(L, E, D, 1), TOPOLOGY,
                                    StepCost(PER_ROW)).prediction()
