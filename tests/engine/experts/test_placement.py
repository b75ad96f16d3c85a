"""Placement: construction, queries, operator edits, load analysis, replica routing, traffic."""

from __future__ import annotations

import json

import pytest
import torch

from moectl.engine.experts.replica_routing import RoutingState, assign_replicas, device_token_load, traffic_matrix
from moectl.placement.placement import (
    Move,
    Placement,
    PlacementError,
    balancedness,
    expert_nbytes,
)


def small() -> Placement:
    """1 layer, 4 experts, 2 devices x 3 slots; expert 0 on both devices, one empty slot."""
    return Placement([[[0, 1, -1], [2, 3, 0]]], 4)


# ---- construction ---------------------------------------------------------------------


def test_contiguous_layout_and_invariants():
    p = Placement.contiguous(3, 16, 4, redundant_slots_per_device=1)
    assert p.slots.shape == (3, 4, 5)
    assert (p.num_layers, p.num_experts, p.num_devices, p.slots_per_device, p.slot_count) == (3, 16, 4, 5, 20)
    assert p.experts_on(0, 1) == [4, 5, 6, 7]
    assert p.free_slots(2, 3) == 1
    assert (p.replica_counts() == 1).all()
    assert p.replicas(1, 9) == [(2, 1)]


def test_contiguous_uneven_split_leaves_the_tail_empty():
    p = Placement.contiguous(1, 10, 4)
    assert p.slots_per_device == 3
    assert p.experts_on(0, 3) == [9]
    assert (p.replica_counts() == 1).all()


@pytest.mark.parametrize("kwargs, word", [
    (dict(num_layers=1, num_experts=8, num_devices=0), "devices"),
    (dict(num_layers=0, num_experts=8, num_devices=2), "layers"),
    (dict(num_layers=1, num_experts=8, num_devices=2, redundant_slots_per_device=-1), "redundant"),
])
def test_contiguous_refuses_bad_sizes(kwargs, word):
    with pytest.raises(PlacementError, match=word):
        Placement.contiguous(**kwargs)


def test_every_expert_needs_a_replica():
    with pytest.raises(PlacementError, match="expert 3 of layer 0 has no replica"):
        Placement([[[0, 1], [2, -1]]], 4)
    with pytest.raises(PlacementError, match="expert 7 out of range"):
        Placement([[[0, 1], [2, 7]]], 4)


def test_more_experts_than_slots_is_refused():
    with pytest.raises(PlacementError, match=r"no replica \(5 experts, 4 slots\)"):
        Placement([[[0, 1], [2, 3]]], 5)


def test_dict_round_trip_is_json_serialisable():
    p = small().pin(0, 2)
    raw = json.loads(json.dumps(p.to_dict()))
    assert Placement.from_dict(raw) == p
    with pytest.raises(PlacementError, match="missing key 'layers'"):
        Placement.from_dict({"num_experts": 4})
    with pytest.raises(PlacementError, match="num_devices 3 does not match"):
        Placement.from_dict({**raw, "num_devices": 3})


# ---- operator edits ---------------------------------------------------------------------


def test_edits_return_new_placements_and_leave_the_old_one_alone():
    p = small()
    before = p.slots.copy()
    q = p.move(0, 2, 1, 0)
    assert q is not p and (p.slots == before).all()
    assert q.replicas(0, 2) == [(0, 2)]
    with pytest.raises(ValueError):
        p.slots[0, 0, 0] = 3  # read-only


def test_move_validation_names_the_bad_value():
    p = small()
    with pytest.raises(PlacementError, match="expert 9 out of range"):
        p.move(0, 9, 0, 1)
    with pytest.raises(PlacementError, match="device 5 out of range"):
        p.move(0, 2, 1, 5)
    with pytest.raises(PlacementError, match="layer 1 out of range"):
        p.move(1, 2, 1, 0)
    with pytest.raises(PlacementError, match="expert 2 of layer 0 is not on device 0"):
        p.move(0, 2, 0, 1)
    with pytest.raises(PlacementError, match="expert 0 of layer 0 is already on device 1"):
        p.move(0, 0, 0, 1)
    with pytest.raises(PlacementError, match="device 1 has no free slot"):
        p.move(0, 1, 0, 1)
    with pytest.raises(PlacementError, match="is not an integer"):
        p.move(0, 1.0, 0, 1)


def test_replicate_drop_and_swap():
    p = small()
    q = p.replicate(0, 3, 0)
    assert sorted(q.replicas(0, 3)) == [(0, 2), (1, 1)]
    with pytest.raises(PlacementError, match="device 0 has no free slot"):
        q.replicate(0, 2, 0)
    with pytest.raises(PlacementError, match="already on device 1"):
        p.replicate(0, 3, 1)
    r = q.drop_replica(0, 3, 1)
    assert r.replicas(0, 3) == [(0, 2)]
    with pytest.raises(PlacementError, match="holds its last replica"):
        r.drop_replica(0, 3, 0)
    s = p.swap(0, 1, 0, 2, 1)
    assert s.replicas(0, 1) == [(1, 0)] and s.replicas(0, 2) == [(0, 1)]
    with pytest.raises(PlacementError, match="expert 0 of layer 0 is already on device 1"):
        p.swap(0, 0, 0, 3, 1)


def test_replicate_checks_the_hbm_budget():
    p = small()
    with pytest.raises(PlacementError, match="device 0: experts need 300 bytes, over the HBM budget of 250"):
        p.replicate(0, 3, 0, expert_bytes=100, hbm_budget_bytes=250)
    assert p.replicate(0, 3, 0, expert_bytes=100, hbm_budget_bytes=300).free_slots(0, 0) == 0


def test_pinned_experts_refuse_operator_moves():
    p = small().pin(0, 1)
    assert p.is_pinned(0, 1) and p.pinned == {(0, 1)}
    with pytest.raises(PlacementError, match="expert 1 of layer 0 is pinned"):
        p.move(0, 1, 0, 1)
    with pytest.raises(PlacementError, match="expert 5 out of range"):
        p.pin(0, 5)
    assert not p.unpin(0, 1).pinned


# ---- analysis -------------------------------------------------------------------------


def test_device_loads_split_replicas_evenly():
    # expert 0 (load 8) has replicas on both devices: 4 each
    dl = small().device_loads([[8, 2, 3, 1]])
    assert dl.tolist() == [[6.0, 8.0]]
    per_layer, overall = balancedness(dl)
    assert per_layer.tolist() == [7 / 8] and overall == 7 / 8
    with pytest.raises(PlacementError, match="loads: shape"):
        small().device_loads([[1, 2, 3]])
    with pytest.raises(PlacementError, match="non-negative"):
        small().device_loads([[1, -2, 3, 4]])


def test_balancedness_overall_is_time_weighted():
    # layer 0: mean 2, max 3; layer 1: mean 2, max 2; an idle layer counts as balanced
    per_layer, overall = balancedness([[1, 3], [2, 2], [0, 0]])
    assert per_layer.tolist() == [2 / 3, 1.0, 1.0]
    assert overall == pytest.approx(4 / 5)
    assert balancedness([[0, 0]])[1] == 1.0


def test_moves_to_counts_arrivals_only():
    a = Placement([[[0, 1, -1], [2, 3, -1]]], 4)
    b = Placement([[[1, 0, 2], [3, 2, -1]]], 4)  # device 0 gains 2 (slot changes are free)
    moves, nbytes = a.moves_to(b, expert_bytes=10)
    assert moves == [Move(layer=0, expert=2, src_device=1, dst_device=0, dst_slot=2)]
    assert nbytes == 10 and a.bytes_to(b, 10) == 10
    assert a.moves_to(a, 10) == ([], 0)


def test_moves_prefer_a_source_on_the_destination_node():
    a = Placement([[[0, -1], [1, -1], [2, -1], [0, -1]]], 3)  # expert 0 on devices 0 and 3
    b = a.replicate(0, 0, 2)
    (move,), _ = a.moves_to(b, 1, devices_per_node=2)
    assert move.src_device == 3  # the copy on device 2's node, not device 0


def test_expert_nbytes_of_stacked_experts():
    from moectl.engine.models.moe import StackedExperts

    assert expert_nbytes(StackedExperts(4, hidden=8, intermediate=16)) == (2 * 16 * 8 + 8 * 16) * 4


# ---- runtime routing -------------------------------------------------------------------


def routing_placement() -> Placement:
    """4 devices in 2 nodes of 2: expert 0 on devices 0, 1, 3; expert 1 on device 2."""
    return Placement([[[0, -1], [0, -1], [1, -1], [0, -1]]], 2)


def test_locality_picks_the_local_then_the_same_node_replica():
    p = routing_placement()
    token_device = torch.tensor([0, 1, 3, 2, 2])
    ids = torch.tensor([[0], [0], [0], [0], [1]])
    out = assign_replicas(p, 0, ids, token_device, "locality", RoutingState(devices_per_node=2))
    assert out.squeeze(1).tolist() == [0, 1, 3, 3, 2]


def test_locality_without_nodes_spreads_remote_tokens():
    p = routing_placement()
    out = assign_replicas(p, 0, torch.zeros(6, 1, dtype=torch.long), torch.full((6,), 2), "locality")
    assert sorted(torch.bincount(out.flatten(), minlength=4).tolist()) == [0, 2, 2, 2]


def test_round_robin_spreads_and_continues_across_calls():
    p = routing_placement()
    out = assign_replicas(p, 0, torch.zeros(9, 1, dtype=torch.long), torch.zeros(9, dtype=torch.long), "round_robin")
    assert torch.bincount(out.flatten(), minlength=4).tolist() == [3, 3, 0, 3]
    state = RoutingState()
    picks = [assign_replicas(p, 0, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                               "round_robin", state).item() for _ in range(4)]
    assert picks == [0, 1, 3, 0]


def test_least_loaded_evens_out_device_load():
    # expert 0 on devices 0 and 1, expert 1 only on device 0: its 4 tokens load device 0 first
    p = Placement([[[0, 1], [0, -1]]], 2)
    ids = torch.tensor([[1]] * 4 + [[0]] * 6)
    out = assign_replicas(p, 0, ids, torch.zeros(10, dtype=torch.long), "least_loaded")
    assert device_token_load(out, 2).tolist() == [5, 5]


def test_assign_replicas_validates():
    p = routing_placement()
    with pytest.raises(PlacementError, match="policy 'fastest' unknown"):
        assign_replicas(p, 0, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), "fastest")
    with pytest.raises(PlacementError, match="expert 7 out of range"):
        assign_replicas(p, 0, torch.tensor([[7]]), torch.zeros(1, dtype=torch.long))
    with pytest.raises(PlacementError, match="device 4 out of range"):
        assign_replicas(p, 0, torch.tensor([[0]]), torch.tensor([4]))


def test_top_k_routing_keeps_the_shape():
    p = Placement.contiguous(1, 8, 4, 1).replicate(0, 0, 3)
    ids = torch.randint(0, 8, (32, 2), generator=torch.Generator().manual_seed(0))
    tok = torch.arange(32) % 4
    for policy in ("locality", "least_loaded", "round_robin"):
        out = assign_replicas(p, 0, ids, tok, policy, RoutingState(devices_per_node=2))
        assert out.shape == ids.shape
        held = torch.from_numpy(p.held()[0].copy())  # [D, E]: the chosen device must hold the expert
        assert held[out, ids].all()


# ---- traffic --------------------------------------------------------------------------


def test_traffic_matrix_sums_to_routed_bytes_and_diagonal_is_local():
    tok = torch.tensor([0, 0, 1, 2])
    dst = torch.tensor([[0, 1], [1, 1], [1, 2], [0, 0]])
    m = traffic_matrix(tok, dst, bytes_per_token=10, num_devices=3)
    assert m.dtype == torch.int64 and m.sum().item() == 8 * 10
    local = (dst == tok[:, None]).sum().item()
    assert m.diagonal().sum().item() == local * 10
    assert m.tolist() == [[10, 30, 0], [0, 10, 10], [20, 0, 0]]
    deduped = traffic_matrix(tok, dst, 10, 3, dedupe=True)
    assert deduped.tolist() == [[10, 20, 0], [0, 10, 10], [10, 0, 0]]
    with pytest.raises(PlacementError, match="device 3 out of range"):
        traffic_matrix(tok, dst + 1, 10, 3)
