"""The runtime's replica rule (placement/replica_policy.py): exact splits, the same answer for the
same batch, and an expectation (expected_device_rows) that is what routing then does."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.placement.placement import Placement, PlacementError
from moectl.placement.replica_policy import EXACT_DEAL_ENTRIES, POLICIES, expected_device_rows, layer_work, route

E, D = 16, 4


def replicated() -> Placement:
    """16 experts on 4 devices, one spare slot each holding a replica of the next device's first expert."""
    slots = Placement.contiguous(1, E, D, 1).slots.copy()
    for d in range(D):
        slots[0, d, -1] = ((d + 1) % D) * (E // D)
    return Placement(slots, E)


def skewed_batch(seed: int, entries: int = 2048) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, E + 1) ** 1.2
    return rng.choice(E, size=entries, p=weights / weights.sum())


def test_single_replica_experts_go_to_their_one_device():
    p = Placement.contiguous(1, E, D)
    experts = skewed_batch(0, 64)
    for policy in POLICIES:
        assert (route(p, 0, experts, np.zeros(64, np.int64), policy) == experts // (E // D)).all()


def test_least_loaded_splits_by_headroom_exact_to_one_entry():
    # expert 1 only on device 0 (4 entries); expert 0 on devices 0 and 1 (6 entries): 5 | 5
    p = Placement([[[0, 1], [0, -1]]], 2)
    out = route(p, 0, np.array([1] * 4 + [0] * 6), None, "least_loaded")
    assert np.bincount(out, minlength=2).tolist() == [5, 5]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_entry_goes_to_a_device_holding_its_expert(policy):
    p = replicated()
    experts = skewed_batch(1)
    home = np.arange(experts.size) % D
    out = route(p, 0, experts, home, policy, np.zeros(E, np.int64), devices_per_node=2)
    assert p.held()[0][out, experts].all()
    again = route(p, 0, experts, home, policy, np.zeros(E, np.int64), devices_per_node=2)
    assert (out == again).all()  # every rank routing the same batch agrees


def test_locality_stays_local_then_on_the_node():
    p = Placement([[[0, -1], [0, -1], [1, -1], [0, -1]]], 2)  # expert 0 on devices 0, 1, 3
    out = route(p, 0, np.array([0, 0, 0, 0, 1]), np.array([0, 1, 3, 2, 2]), "locality", devices_per_node=2)
    assert out.tolist() == [0, 1, 3, 3, 2]


def test_round_robin_continues_across_calls():
    p = Placement([[[0, -1], [0, -1], [1, -1], [0, -1]]], 2)
    counters = np.zeros(2, np.int64)
    picks = [int(route(p, 0, np.array([0]), None, "round_robin", counters)[0]) for _ in range(4)]
    assert picks == [0, 1, 3, 0]


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
@pytest.mark.parametrize("entries", [256, 4096], ids=["decode-sized", "prefill-sized"])
def test_the_expectation_is_what_routing_does(policy, entries):
    p = replicated()
    # exact to one entry per replica split, dealt by rank; a large batch is dealt by a Weyl
    # sequence: within a quarter percent of its entries
    tolerance = 1.0 if entries <= EXACT_DEAL_ENTRIES or policy == "round_robin" else 0.0025 * entries
    for seed in range(5):
        experts = skewed_batch(seed, entries)
        routed = np.bincount(route(p, 0, experts, None, policy, np.zeros(E, np.int64)), minlength=D)
        expected = expected_device_rows(p, 0, np.bincount(experts, minlength=E), policy)
        assert np.abs(routed - expected).max() <= tolerance
        assert expected.sum() == pytest.approx(experts.size)


def test_the_locality_expectation_holds_on_average_over_token_homes():
    p = replicated()
    rng = np.random.default_rng(7)
    experts = skewed_batch(3)
    routed = np.mean([np.bincount(route(p, 0, experts, rng.integers(0, D, experts.size), "locality"), minlength=D)
                      for _ in range(50)], axis=0)
    expected = expected_device_rows(p, 0, np.bincount(experts, minlength=E), "locality")
    assert np.abs(routed - expected).max() / experts.size < 0.02


def test_least_loaded_evens_the_devices_out_better_than_an_even_split():
    p = replicated()
    experts = skewed_batch(2)
    even = p.device_loads(np.bincount(experts, minlength=E)[None, :])[0]
    routed = np.bincount(route(p, 0, experts, None, "least_loaded"), minlength=D)
    assert routed.max() < even.max()


def test_the_expectation_reads_the_layer_asked_for():
    slots = replicated().slots.copy()
    two = Placement(np.stack([slots[0], Placement.contiguous(1, E, D, 1).slots[0]]), E)
    counts = np.bincount(skewed_batch(4, 256), minlength=E)
    np.testing.assert_allclose(expected_device_rows(two, 1, counts), np.bincount(np.arange(E) // (E // D),
                                                                                  weights=counts, minlength=D))


def random_case(rng: np.random.Generator, entries: int) -> tuple[Placement, np.ndarray, np.ndarray]:
    """A placement of 8-32 experts on 4 devices with 1-3 spare slots per device, mostly filled with
    random replicas (an expert may sit twice on one device), and a skewed batch."""
    experts, extra = int(rng.choice([8, 16, 32])), int(rng.integers(1, 4))
    slots = Placement.contiguous(1, experts, D, extra).slots.copy()
    spare = rng.random((D, extra)) < 0.8
    slots[0, :, experts // D:][spare] = rng.integers(0, experts, int(spare.sum()))
    weights = 1.0 / np.arange(1, experts + 1) ** 1.2
    batch = rng.choice(experts, size=entries, p=weights / weights.sum())
    return Placement(slots, experts), batch, rng.integers(0, D, entries)


@pytest.mark.parametrize("entries", [1, 37, EXACT_DEAL_ENTRIES, 3 * EXACT_DEAL_ENTRIES])
def test_the_compiled_rule_is_its_python_source(monkeypatch, entries):
    """replica_kernel.route_entries is compiled by numba; its .py_func is the same code run by
    Python: both must give every entry the same device and advance the counters alike."""
    from moectl.placement import replica_kernel, replica_policy

    rng = np.random.default_rng(entries)
    for trial in range(6):
        p, experts, home = random_case(rng, entries)
        policy, node = POLICIES[trial % 3], (None, 2)[trial // 3]
        answers = []
        for kernel in (replica_kernel.route_entries, replica_kernel.route_entries.py_func):
            monkeypatch.setattr(replica_policy, "_kernel", lambda kernel=kernel: kernel)
            counters = np.arange(p.num_experts, dtype=np.int64)
            answers.append((route(p, 0, experts, home, policy, counters, node), counters))
        (compiled, c1), (python, c2) = answers
        assert (compiled == python).all() and (c1 == c2).all()
        assert p.held()[0][compiled, experts].all()


def test_top_k_entries_share_their_tokens_device():
    p = Placement([[[0, -1], [0, -1], [1, -1], [0, -1]]], 2)  # expert 0 on devices 0, 1, 3
    # two tokens, two choices each: token 0 on device 1, token 1 on device 3
    out = route(p, 0, np.array([0, 1, 0, 0]), np.array([1, 3]), "locality", top_k=2)
    assert out.tolist() == [1, 2, 3, 3]
    with pytest.raises(PlacementError, match="token_device: 3 tokens for 4 entries at top_k 2"):
        route(p, 0, np.array([0, 1, 0, 0]), np.array([1, 3, 0]), "locality", top_k=2)


def test_prepare_loads_the_kernel_only_for_a_placement_with_replicas(monkeypatch):
    from moectl.placement import replica_policy

    loads = []
    real = replica_policy._kernel
    monkeypatch.setattr(replica_policy, "_kernel", lambda: loads.append(1) or real())
    replica_policy.prepare(Placement.contiguous(2, E, D, 1))
    assert loads == []
    replica_policy.prepare(replicated())
    assert loads == [1]


def test_link_rows_are_the_busiest_devices_received_and_sent_entries():
    slots = np.array([[0], [1]])  # two devices, one expert each; tokens spread evenly over both
    # expert 0 takes 10 entries: device 0 receives the 5 of device 1's tokens, each device's
    # tokens send 3 (their entries for the other device's expert): the busiest link carries 8
    _, _, link = layer_work(slots, np.array([[10.0, 2.0], [6.0, 6.0]]), "least_loaded")
    assert link.tolist() == [8.0, 6.0]
    # locality keeps a replicated expert's entries on every device holding it
    _, _, link = layer_work(np.array([[0, 1], [0, -1]]), np.array([[10.0, 2.0]]), "locality")
    # device 0 receives expert 1's entry from device 1's tokens; the one remote entry is sent by
    # the devices' tokens alike, half each
    assert link.tolist() == [1.0 + 0.5]


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
@pytest.mark.parametrize("entries", [8, 24, 256])
def test_the_expected_active_experts_are_what_routing_runs(policy, entries):
    # a deterministic deal runs a replica dealt x entries with chance min(1, x), not the Poisson
    # 1 - exp(-x) of random placement: the fixed per-expert costs a replica adds are not under-counted
    p = replicated()
    routed, expected = [], []
    for trial in range(200):
        experts = skewed_batch(trial + 1000 * entries, entries)
        out = route(p, 0, experts, None, policy, np.full(E, trial, np.int64))
        routed.append(sum(len(set(experts[out == d])) for d in range(D)))
        expected.append(layer_work(p.slots[0], np.bincount(experts, minlength=E)[None].astype(float), policy)[1].sum())
    assert np.mean(expected) == pytest.approx(np.mean(routed), rel=0.02)


def test_an_expert_id_out_of_range_in_the_slots_is_refused():
    from moectl.placement.replica_policy import counts_of

    with pytest.raises(PlacementError, match="expert 2 out of range"):
        counts_of(np.array([[2, -1], [0, 1]]), 2)
    with pytest.raises(PlacementError, match="expert 5 out of range"):
        layer_work(np.array([[5], [1]]), np.ones((1, 2)))
