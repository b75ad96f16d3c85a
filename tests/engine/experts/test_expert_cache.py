"""Tiered expert memory: the expert cache, Belady, the simulation, predictors and the recorder."""

from __future__ import annotations

import random

import pytest
import torch

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.experts.expert_cache import (
    CachePolicy,
    ExpertCache,
    belady,
    belady_hit_rate,
    brute_force_min_misses,
    lru_hit_rate,
    max_working_set,
    moe_host_tier,
    replay,
    simulate,
)
from moectl.engine.experts.prefetch import CachePrefetcher, CoactivationPredictor, RouterPredictor, RoutingRecorder
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.placement.placement import Placement
from tests.checkpoints import TINY_MIXTRAL, tiny_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    m = MoEForCausalLM(ModelConfig.from_hf({**TINY_MIXTRAL, "num_hidden_layers": 3}))
    m.init_weights(std=0.2, seed=1)
    return m.eval()


def random_steps(rng: random.Random, n_keys: int, capacity: int, length: int) -> list[list[int]]:
    return [rng.sample(range(n_keys), rng.randint(0, min(capacity, n_keys, 3))) for _ in range(length)]


# ---- Belady, LRU and the simulation ------------------------------------------------------------

def test_belady_on_hand_made_sequences():
    # the classic LRU worst case: a cycle one longer than the cache
    cycle = [["a"], ["b"], ["c"]] * 2
    assert lru_hit_rate(cycle, 2) == 0.0
    assert belady(cycle, 2)["hits"] == 2  # keeps a, then c
    assert brute_force_min_misses(cycle, 2) == 4
    # working sets are needed together: the current one is never the victim
    seq = [["a", "b"], ["c"], ["a", "b"], ["c"]]
    assert belady(seq, 3)["misses"] == 3 == brute_force_min_misses(seq, 3)
    assert belady(seq, 2)["misses"] == brute_force_min_misses(seq, 2) == 5


def test_belady_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        cap = rng.randint(1, 4)
        steps = random_steps(rng, rng.randint(2, 6), cap, rng.randint(1, 10))
        assert belady(steps, cap)["misses"] == brute_force_min_misses(steps, cap), (steps, cap)


def test_belady_never_worse_than_lru():
    rng = random.Random(1)
    for _ in range(300):
        cap = rng.randint(1, 6)
        steps = random_steps(rng, rng.randint(2, 12), cap, rng.randint(1, 60))
        b, lru = belady(steps, cap), simulate(steps, cap)
        assert b["accesses"] == lru["accesses"]
        assert b["hits"] >= lru["hits"], (steps, cap)
        assert belady_hit_rate(steps, cap) >= lru_hit_rate(steps, cap)


def test_prefetching_the_exact_next_working_set_gives_all_hits():
    rng = random.Random(2)
    for _ in range(50):
        steps = random_steps(rng, 10, 3, 40)
        ws = max(len(s) for s in steps)
        # issued while the previous working set is still pinned: room for both
        res = simulate(steps, 2 * max(ws, 1), predictions=steps)
        assert res["misses"] == 0 and res["hit_rate"] == 1.0
        assert res["prefetch_useful"] == res["prefetch_issued"] and res["prefetch_wasted"] == 0
        # issued once the previous layer is done: one working set of room is enough
        res = simulate(steps, max(ws, 1), predictions=steps, release_before_prefetch=True)
        assert res["misses"] == 0


def test_simulation_counters_add_up():
    rng = random.Random(3)
    for _ in range(50):
        steps = random_steps(rng, 8, 3, 50)
        preds = [rng.sample(range(8), rng.randint(0, 4)) for _ in steps]
        res = simulate(steps, 4, predictions=preds)
        assert res["hits"] + res["misses"] == res["accesses"] == sum(len(set(s)) for s in steps)
        assert res["prefetch_issued"] == res["prefetch_useful"] + res["prefetch_wasted"] + res["prefetch_pending"]
        assert res["copies"] == res["misses"] + res["prefetch_issued"]


def test_policy_never_evicts_the_pinned_working_set():
    rng = random.Random(4)
    policy = CachePolicy(4)
    for _ in range(500):
        keys = rng.sample(range(12), rng.randint(0, 4))
        slots, fills = policy.access(keys)
        assert len(set(slots)) == len(slots) and all(0 <= s < 4 for s in slots)
        before = {k: policy.slot_of(k) for k in keys}
        policy.prefetch(rng.sample(range(12), rng.randint(0, 6)))
        assert {k: policy.slot_of(k) for k in keys} == before  # still resident, same slots
        assert len(policy) <= 4


def test_impossible_capacities_are_refused(model):
    host = moe_host_tier(model)
    with pytest.raises(ValueError, match="expert cache of 7 slots cannot hold one layer's working set"):
        ExpertCache(host, 7)  # a layer may use all 8 experts at once
    with pytest.raises(ValueError, match="capacity"):
        ExpertCache(host, 0)
    placement = Placement.contiguous(3, 8, 2)  # 4 experts per device and layer
    with pytest.raises(ValueError, match="cannot hold"):
        ExpertCache.for_device(model, placement, 0, capacity=3)
    # decode of one sequence needs only top_k = 2 at once
    assert max_working_set(4, top_k=2, max_tokens=1) == 2
    cache = ExpertCache.for_device(model, placement, 0, capacity=2, max_tokens=1)
    with pytest.raises(ValueError, match="not served"):
        cache.lookup(0, [5])
    with pytest.raises(ValueError, match="cannot hold"):
        cache.lookup(0, [0, 1, 2])
    with pytest.raises(ValueError, match="cannot hold"):
        simulate([[1, 2, 3]], 2)
    with pytest.raises(ValueError, match="cannot hold"):
        belady([[1], [1, 2, 3]], 2)


# ---- the real cache --------------------------------------------------------------------------------

def test_cached_weights_compute_like_the_host_tier(model):
    torch.manual_seed(0)
    host = moe_host_tier(model)
    cache = ExpertCache(host, 8)
    block = model.layers[1].mlp
    for layer in (1, 0, 2, 1):
        block = model.layers[layer].mlp
        x = torch.randn(6, model.cfg.hidden_size)
        with torch.no_grad():
            _, weights, ids = block.route(x)
            counts = torch.bincount(ids.flatten(), minlength=block.num_experts).tolist()
            order = torch.argsort(ids.flatten(), stable=True)
            x_sorted = x.index_select(0, order // ids.shape[1])
            want = block.experts(x_sorted, counts)
            got = cache.run_experts(layer, x_sorted, counts)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    st = cache.stats()
    assert st["bytes_copied"] == st["copies"] * cache.expert_bytes > 0


def test_cache_contents_always_match_the_host_tier(model):
    rng = random.Random(5)
    host = moe_host_tier(model)
    cache = ExpertCache(host, 5, max_working_set=3)
    total = 0
    for _ in range(200):
        layer = rng.choice(list(host))
        experts = rng.sample(range(8), rng.randint(0, 3))
        slots, misses = cache.lookup(layer, experts)
        total += len(experts)
        assert set(misses) <= set(experts)
        for e, s in zip(experts, slots):  # the working set is resident in the slots returned
            assert torch.equal(cache.w13_cache[s], host[layer][0][e])
            assert torch.equal(cache.w2_cache[s], host[layer][1][e])
        nxt = rng.choice(list(host))
        cache.prefetch(nxt, rng.sample(range(8), rng.randint(0, 4)))
        for e, s in zip(experts, slots):  # a prefetch never evicts the current working set
            assert cache.policy.slot_of((layer, e)) == s
        for (l, e), s in cache.policy.resident().items():
            assert torch.equal(cache.w13_cache[s], host[l][0][e]) and torch.equal(cache.w2_cache[s], host[l][1][e])
    st = cache.stats()
    assert st["hits"] + st["misses"] == st["accesses"] == total
    assert st["prefetch_issued"] == st["prefetch_useful"] + st["prefetch_wasted"] + st["prefetch_pending"]
    assert st["bytes_copied"] == (st["misses"] + st["prefetch_issued"]) * cache.expert_bytes
    assert st["miss_wait_seconds"] > 0 and st["prefetch_copy_seconds"] >= 0


def test_replay_through_the_real_cache_matches_the_simulation(model):
    rng = random.Random(6)
    host = moe_host_tier(model)
    steps = [[(l, e) for e in rng.sample(range(8), rng.randint(0, 3))] for l in [0, 1, 2] * 30]
    preds = [[(l, e) for e in rng.sample(range(8), 3)] for l in [0, 1, 2] * 30]
    for release in (False, True):
        sim = simulate(steps, 6, preds, release_before_prefetch=release)
        real = replay(ExpertCache(host, 6, max_working_set=3), steps, preds, release_before_prefetch=release)
        for key in ("hits", "misses", "prefetch_issued", "prefetch_useful", "prefetch_wasted", "evictions"):
            assert real[key] == sim[key], key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_copies_on_a_side_stream(model):
    host = moe_host_tier(model)
    cache = ExpertCache(host, 4, "cuda", max_working_set=2)
    for _ in range(3):
        for layer in host:
            cache.prefetch(layer, [3, 4])
            slots, _ = cache.lookup(layer, [3, 5])
            for e, s in zip([3, 5], slots):
                assert torch.equal(cache.w13_cache[s].cpu(), host[layer][0][e])
    assert cache.stats()["miss_wait_seconds"] >= 0


# ---- predictors and the recorder -----------------------------------------------------------------

@pytest.fixture(scope="module")
def deepseek_model(tiny_hf_checkpoint):
    from moectl.engine.models.loader import load_model

    return load_model(tiny_hf_checkpoint("deepseek_v3"))


@pytest.mark.parametrize("which", ["mixtral", "deepseek_v3"])
def test_router_predictor_on_the_routers_own_input_is_exact(model, deepseek_model, which):
    """DeepSeek's router: the prediction follows its biased, group-masked selection."""
    model = model if which == "mixtral" else deepseek_model
    torch.manual_seed(1)
    pred = RouterPredictor(model)
    block = model.layers[2]
    h = torch.randn(5, model.cfg.hidden_size)  # the residual entering the MoE block
    with torch.no_grad():
        _, _, ids = block.mlp.route(block.post_norm(h))
    assert set(pred.predict(2, h)) == set(ids.flatten().tolist())
    wider = RouterPredictor(model, extra=2).predict(2, h)
    assert set(ids.flatten().tolist()) <= set(wider)


def test_coactivation_predictor_learns_transitions(model):
    pred = CoactivationPredictor(model)
    x = torch.zeros(2, model.cfg.hidden_size)
    for _ in range(3):
        pred.start_step()
        pred.on_hidden(0, x)
        for layer, ids in ((0, [[0, 1], [0, 1]]), (1, [[2, 3], [2, 3]]), (2, [[6, 7], [6, 7]])):
            ids = torch.tensor(ids)
            out = pred.on_routing(layer, torch.bincount(ids.flatten(), minlength=8), ids)
    pred.start_step()
    assert pred.on_hidden(0, x) == {0: [0, 1]}  # temporal: the previous step's first layer
    out = pred.on_routing(0, torch.bincount(torch.tensor([0, 1, 0, 1]), minlength=8), torch.tensor([[0, 1], [0, 1]]))
    assert sorted(out[1]) == [2, 3]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("tiny_cache"), num_hidden_layers=3, num_local_experts=8)
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=64,
                                  knobs=SchedulerKnobs(max_num_seqs=4)))


def test_recorder_on_a_tiny_engine_run(engine):
    model = engine.model
    placement = Placement.contiguous(3, 8, 2)
    preds = [RouterPredictor(model), RouterPredictor(model, lookahead=1), CoactivationPredictor(model, extra=1)]
    rec = RoutingRecorder(model, placement, preds)
    saved = engine.runner.probe
    engine.runner.probe = rec
    try:
        engine.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13]], SamplingParams(max_tokens=6, ignore_eos=True))
    finally:
        engine.runner.probe = saved
    assert len(rec.steps) >= 6
    assert int(rec.counts.sum()) > 0  # still a RoutingProbe for the engine's step log
    for d in range(2):
        acc = rec.accesses(d)
        assert len(acc) == len(rec.steps) * 3
        assert all(l in (0, 1, 2) and e in placement.experts_on(l, d) for s in acc for l, e in s)
        for p in preds:
            assert len(rec.predictions(p.name, d)) == len(acc)
    assert sum(len(s) for d in range(2) for s in rec.accesses(d)) > 0
    router = rec.prediction_quality("router")
    assert 0 < router["recall"] <= 1 and router["mean_used"] > 0
    cap = max(rec.max_working_set(), 1)
    host = moe_host_tier(model)
    for d in range(2):
        res = rec.compare(d, cap)
        assert res["belady"]["hits"] >= res["lru"]["hits"]
        assert set(res["prefetch"]) == {p.name for p in preds}
        local = {l: placement.experts_on(l, d) for l in host}
        real = replay(ExpertCache(host, cap, local_experts=local, max_working_set=cap), rec.accesses(d),
                      rec.predictions("router", d), release_before_prefetch=True)
        assert real["hits"] == res["prefetch"]["router"]["hits"]


def test_online_prefetcher_feeds_the_caches(engine):
    model = engine.model
    placement = Placement.contiguous(3, 8, 2)
    caches = [ExpertCache.for_device(model, placement, d, capacity=4) for d in range(2)]
    probe = CachePrefetcher(model, caches, RouterPredictor(model))
    saved = engine.runner.probe
    engine.runner.probe = probe
    try:
        engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        engine.runner.probe = saved
    assert sum(c.stats()["prefetch_issued"] for c in caches) > 0
