"""Pipeline stages in the simulator (engine/sim/pipeline.py, step_model's --pp): the bubble is
exactly (p - 1) / (m + p - 1) for equal stages and free sends, and only grows with unequal stages,
unequal micro-batches or sends; the layers' split is the least bottleneck; a pipelined step's parts
add up to it; sends cross the link the stages sit across; each stage holds its own layers."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

from moectl.engine.planning.memory_plan import split_layers
from moectl.engine.sim.hardware import load_profile
from moectl.engine.sim.model_shape import load_sim_model
from moectl.engine.sim.pipeline import flush, steady, uniform_bubble
from moectl.engine.sim.routing import balanced, zipf
from moectl.engine.sim.step_model import (
    PP_PARTS,
    SimSpec,
    balanced_stages,
    memory_per_device,
    migration_stall,
    simulate,
)
from moectl.placement.rebalancer import plan_rebalance
from tests.paths import DOCS

DSV3 = load_sim_model(DOCS / "configs" / "deepseek-v3.json")
H800 = load_profile("h800")


def spec(routing=None, **kw) -> SimSpec:
    shape = DSV3.shape
    loads = balanced(shape.num_sparse, shape.num_experts) if routing is None else routing
    return SimSpec(DSV3, H800, kw.pop("devices", 64), loads, **kw)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro", [1, 2, 5, 16])
def test_equal_stages_without_sends_give_the_textbook_bubble_exactly(stages, micro):
    t = Fraction(3, 7)
    run = flush([[t] * stages for _ in range(micro)], [0] * (stages - 1))
    assert run.makespan == (micro + stages - 1) * t
    assert run.bubble == Fraction(stages - 1, micro + stages - 1)
    # in floats too: every sum is an exact integer, the bubble the same rational correctly rounded
    assert flush([[1.0] * stages for _ in range(micro)]).bubble == uniform_bubble(stages, micro)


def test_unequal_stages_unequal_micro_batches_and_sends_only_make_it_worse():
    p, m = 4, 6
    even = flush([[1.0] * p for _ in range(m)]).bubble
    assert even == pytest.approx(3 / 9)
    # the same work per micro-batch, one stage slower than the others
    skewed = flush([[0.8, 1.6, 0.8, 0.8] for _ in range(m)])
    assert skewed.busy == pytest.approx(m * p) and skewed.bubble > even
    # micro-batches that grow (a long prompt's later chunks attend more), the same total
    growing = flush([[0.5 + j / (m - 1)] * p for j in range(m)])
    assert growing.busy == pytest.approx(m * p) and growing.bubble > even
    # sends between the stages: worse, and worse the longer they take
    bubbles = [flush([[1.0] * p for _ in range(m)], [c] * (p - 1)).bubble for c in (0.0, 0.1, 0.5, 2.0)]
    assert bubbles[0] == even and all(a < b for a, b in zip(bubbles, bubbles[1:]))
    # a send leaves its stage free: while sends are shorter than a stage they only delay, never serialise
    assert flush([[1.0] * p for _ in range(m)], [0.5] * (p - 1)).makespan == pytest.approx(m + p - 1 + 3 * 0.5)
    # sends longer than a stage: the link is busy, the downstream stage waits for each one
    assert flush([[1.0] * 2 for _ in range(m)], [2.0]).makespan == pytest.approx(1 + m * 2.0 + 1)


def test_kept_in_flight_the_pipeline_never_drains():
    p = 4
    # enough micro-batches: every stage busy all the time
    assert steady([[1.0] * p for _ in range(6)]) == pytest.approx(6.0)
    # fewer micro-batches than stages: each waits for its own round trip
    assert steady([[1.0] * p for _ in range(2)]) == pytest.approx(4.0)
    assert steady([[1.0] * p for _ in range(2)], [0.5] * (p - 1), back=0.5) == pytest.approx(4.0 + 2.0)
    # the slowest stage sets the pace
    assert steady([[1.0, 2.0, 1.0, 1.0] for _ in range(6)]) == pytest.approx(12.0)


def _best_max(costs, stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_the_layer_split_is_the_least_bottleneck_and_puts_ties_on_the_later_stages():
    assert split_layers([1] * 61, 4) == [15, 15, 15, 16]  # SGLang's advice for DeepSeek's 61 layers
    assert split_layers([1, 1, 1] + [3] * 58, 4) == [16, 15, 15, 15]  # cheap dense layers: the first stage takes more
    rng = np.random.default_rng(0)
    for _ in range(60):
        n, p = int(rng.integers(1, 10)), int(rng.integers(1, 5))
        if p > n:
            continue
        costs = [float(x) for x in rng.integers(1, 9, n)]
        counts = split_layers(costs, p)
        assert len(counts) == p and sum(counts) == n and min(counts) >= 1
        edges = np.cumsum([0, *counts])
        assert max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])) == _best_max(costs, p)
    with pytest.raises(ValueError, match="--pp"):
        split_layers([1.0] * 3, 4)


def test_a_pipelined_step_adds_up_and_carries_its_stages():
    out = simulate(spec(pp=4, tokens_per_device=64, context=2048))
    pp = out["pp"]
    parts = out["breakdown_ms"]
    assert set(parts) == set(PP_PARTS)
    assert sum(parts.values()) == pytest.approx(out["step_ms"])  # no overlap: the parts add up
    assert parts["pipeline_bubble"] > 0 and parts["idle"] == pytest.approx(0.0, abs=1e-9)
    assert pp["pp"] == 4 and pp["micro_batches"] == 4 and pp["devices_per_stage"] == 16
    spans = pp["stage_layers"]
    assert spans[0][0] == 0 and spans[-1][1] == DSV3.shape.num_layers - 1
    assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:]))  # contiguous
    assert pp["bubble"] >= pp["bubble_uniform"] == pytest.approx(3 / 7)
    assert out["stage"] == [d // 16 for d in range(64)] and len(out["utilisation"]) == 64
    # every attention group's 64 x 1 tokens, over the step: the stages' groups are the cluster's
    assert out["tokens_per_s"] == pytest.approx(16 * 64 / (out["step_ms"] / 1e3))
    # kept in flight across steps the fill and drain go: a shorter step, a smaller bubble
    assert pp["steady_step_ms"] < out["step_ms"] and pp["steady_bubble"] < pp["bubble"]


def test_more_micro_batches_shrink_the_bubble_and_two_batch_overlap_combines():
    few = simulate(spec(pp=4, micro_batches=2, tokens_per_device=64))["pp"]
    many = simulate(spec(pp=4, micro_batches=16, tokens_per_device=64))["pp"]
    assert many["bubble"] < few["bubble"]
    overlapped = simulate(spec(pp=2, overlap="two-batch", tokens_per_device=128))
    assert overlapped["pp"]["pp"] == 2 and overlapped["step_ms"] > 0


def test_sends_cross_the_link_between_the_stages_nodes():
    # 8 devices a node: stages of 8 sit on different nodes, stages of 4 share one
    across = simulate(spec(devices=16, pp=2, tokens_per_device=64))["pp"]
    within = simulate(spec(devices=8, pp=2, tokens_per_device=64))["pp"]
    assert across["transfer_links"] == ["inter-node"] and within["transfer_links"] == ["intra-node"]
    assert across["transfer_ms"][0] > within["transfer_ms"][0] > 0  # the same bytes a device, NIC slower than NVLink
    mixed = simulate(spec(devices=16, pp=4, tokens_per_device=64))["pp"]  # 4 a stage: boundaries 0 and 2 in a node
    assert mixed["transfer_links"] == ["intra-node", "inter-node", "intra-node"]


def test_a_long_prompt_flows_as_its_chunks_and_later_chunks_cost_more():
    # one prompt per attention group: its chunks are the micro-batches (SGLang's chunked pipeline)
    out = simulate(spec(devices=32, tp=8, ep=8, pp=4, micro_batches=8, phase="prefill", tokens_per_device=4096,
                        context=32768), detail=True)
    pp, times = out["pp"], out["detail"]["times"]
    assert pp["micro_batches_chunked"] and pp["micro_batches"] == 8
    assert all(times[j + 1][1] > times[j][1] for j in range(7))  # later chunks attend more of the prompt
    assert pp["bubble"] > pp["bubble_uniform"]


def test_each_stage_holds_its_layers_weights_and_kv():
    s = spec(pp=4, tokens_per_device=64, context=2048)
    mem = memory_per_device(s)
    whole = memory_per_device(spec(devices=16, tokens_per_device=64, context=2048))  # the same 16-device EP group
    stages = mem["stages"]
    assert [x["layers"] for x in stages] == simulate(s)["pp"]["stage_layers"]
    assert sum(x["kv_bytes"] for x in stages) == pytest.approx(whole["kv_bytes"], rel=1e-9)
    # the stages' weights are the group's, each layer's once (the embedding first, the untied LM head last)
    assert sum(x["weights_bytes"] for x in stages) == whole["weights_bytes"]
    assert mem["total_bytes"] == max(x["total_bytes"] for x in stages) and mem["fits"]


def test_a_rebalance_moves_each_stages_experts_at_once():
    shape = DSV3.shape
    hot = zipf(shape.num_sparse, shape.num_experts, 1.2, seed=3)
    one = spec(hot, devices=16, tokens_per_device=64)
    staged = spec(hot, devices=64, pp=4, tokens_per_device=64)
    planned = plan_rebalance(hot, 16, 1).placement
    stall_one = migration_stall(one, one.placement, planned)
    stall_staged = migration_stall(staged, staged.placement, planned)
    assert stall_one["experts_moved"] == stall_staged["experts_moved"] > 0
    assert stall_staged["stall_ms"] < 0.5 * stall_one["stall_ms"]  # four stages' devices receive at once


@pytest.mark.parametrize("kw, needle", [
    ({"pp": 0}, "--pp: must be a positive integer"),
    ({"pp": 62, "devices": 62 * 2}, "exceed the model's 61 layers"),
    ({"pp": 3}, "--pp: 3 must divide the 64 devices"),
    ({"pp": 2, "overlap": "five-stage"}, "--overlap five-stage: not with --pp > 1"),
    ({"micro_batches": 4}, "--micro-batches: goes with --pp > 1"),
    ({"pp_layers": (30, 31)}, "--pp-layers: goes with --pp > 1"),
    ({"pp": 2, "micro_batches": 0}, "--micro-batches: must be an integer"),
    ({"pp": 2, "tokens_per_device": 4, "micro_batches": 8}, "--micro-batches: 8 exceeds the 4 sequences"),
    ({"pp": 2, "pp_layers": (30, 30)}, "--pp-layers: needs 2 counts"),
    ({"pp": 4, "ep": 32}, "--ep: 32 must divide the 16 devices of a pipeline stage"),
    ({"pp": 2, "exchange": "all-reduce"}, "exchange all-reduce"),
])
def test_bad_pipelines_are_refused_naming_the_option(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        spec(**kw)


def test_given_layers_are_kept():
    s = spec(pp=4, pp_layers=(15, 15, 15, 16), tokens_per_device=64)
    assert balanced_stages(s) == [15, 15, 15, 16]
    assert simulate(s)["pp"]["layers_per_stage"] == [15, 15, 15, 16]
