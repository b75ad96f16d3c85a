"""`plan memory --pp`: the seeds' 3T model (docs/configs/k3-3t-1m.json) per pipeline stage: each
stage its layers' weights by category and their KV, one micro-batch's activations and the
micro-batches it holds in flight; the split balanced by MACs per token; bad pipelines refused."""

from __future__ import annotations

import math

import pytest

from moectl.engine.planning.memory_plan import (
    PlanError,
    _shard,
    load_plan_model,
    plan_memory,
    split_layers,
    stage_ranges,
    weight_format,
)
from moectl.placement.topology import Topology
from tests.paths import DOCS

CONFIG_3T = DOCS / "configs" / "k3-3t-1m.json"
GIB = 1 << 30
M3T = load_plan_model(CONFIG_3T)


def topo(devices: int = 64, hbm_gib: int = 141) -> Topology:
    return Topology(num_devices=devices, hbm_bytes=hbm_gib * GIB)


def plan_3t(**kw):
    options = dict(context=131072, batch=64, pp=4)
    options.update(kw)
    return plan_memory(M3T, topo(kw.pop("devices", 64)), **{k: v for k, v in options.items() if k != "devices"})


def test_the_3t_model_per_stage():
    plan = plan_3t()
    assert plan.pp == 4 and plan.micro_batches == 4
    # balanced by MACs per token: 3 cheap dense layers give the first stage one more layer, the LM head
    # the last one fewer
    assert plan.stage_layers == [(0, 20), (21, 40), (41, 60), (61, 79)]
    assert [g[0] for g in plan.groups()] == [f"stage {s}: devices {16 * s}-{16 * s + 15}" for s in range(4)]
    by_stage = {d.stage: d for d in plan.devices}
    weights = weight_format(None, M3T)
    expert = M3T.part_bytes("expert", weights)
    for s, (first, last) in enumerate(plan.stage_layers):
        d = by_stage[s]
        held = range(first, last + 1)
        moe = sum(M3T.sparse_layers[i] for i in held)
        assert d.weights["attention"] == len(held) * M3T.part_bytes("attention", weights)
        assert d.weights["experts"] == moe * _shard(512, 16, d.ep_rank) * expert  # EP 16 within the stage
        assert d.weights["dense_mlp"] == (3 * M3T.part_bytes("dense", weights) if s == 0 else 0)
    # the embedding on the first stage, the LM head on the last, nothing of them between
    vocab = M3T.vocab_size * M3T.hidden_size * 2
    assert [by_stage[s].weights["embeddings"] for s in range(4)] == [vocab, 0, 0, vocab]
    # the four stages' weights are the whole model's (its experts spread over each stage's 16 devices)
    whole = M3T.weight_bytes(weights, experts_local=32)
    summed = {k: sum(by_stage[s].weights[k] for s in range(4)) for k in whole}
    assert summed == whole
    # KV: each stage its layers' share of a sequence's (MLA: 576 values a token and layer, bf16)
    per_layer_token = 576 * 2
    for s, (first, last) in enumerate(plan.stage_layers):
        d = by_stage[s]
        assert d.sequences == 4  # 64 sequences over the 16 DP groups of a stage
        assert d.kv_cache == d.sequences * math.ceil(131072 / 16) * 16 * (last - first + 1) * per_layer_token
    assert plan.fits


def test_activations_are_one_micro_batchs_and_the_micro_batches_in_flight():
    plan = plan_3t(micro_batches=8, max_batched_tokens=4096)
    d = plan.devices[0]
    t_mb = math.ceil(4096 / 8)
    a = 2  # bf16
    assert d.activation_detail["pp_in_flight"] == 8 * 2 * t_mb * M3T.hidden_size * a
    assert d.activation_detail["residual"] == 2 * t_mb * M3T.hidden_size * a  # sized for one micro-batch
    # a plan without the pipeline, stepping one micro-batch's tokens: the same operators
    flat = plan_memory(M3T, topo(16), context=131072, batch=64, max_batched_tokens=t_mb)
    same = {k: v for k, v in d.activation_detail.items() if k != "pp_in_flight"}
    assert same == flat.devices[0].activation_detail
    table = plan.format_table()
    assert "pipeline: layers 0-20 | 21-40 | 41-60 | 61-79 (balanced by MACs per token); 8 micro-batches of 512 " \
           "tokens" in table
    assert "stage 3: devices 48-63" in table
    out = plan.as_dict()
    assert out["pipeline"] == {"pp": 4, "micro_batches": 8, "devices_per_stage": 16,
                               "stage_layers": [[0, 20], [21, 40], [41, 60], [61, 79]], "layer_split": "balanced",
                               "micro_batch_tokens": 512}
    assert [g["stage"] for g in out["device_groups"]] == [0, 1, 2, 3]


def test_the_split_balances_macs_and_can_be_given():
    costs = M3T.layer_macs()
    counts = split_layers(costs, 4)
    sums = [sum(costs[r.start:r.stop]) for r in stage_ranges(counts)]
    assert max(sums) <= max(sum(costs[r.start:r.stop]) for r in stage_ranges([20, 20, 20, 20]))
    given = plan_3t(pp_layers="20,20,20,20")
    assert given.stage_layers == [(0, 19), (20, 39), (40, 59), (60, 79)] and given.layer_split == "given"


def test_kv_retention_per_stage():
    plan = plan_3t(kv_budget_fraction=0.25)
    for d in plan.devices[::16]:
        assert plan.kv_saved(d) == plan.kv_full(d) - d.kv_cache > 0
    full = plan_3t()
    assert [plan.kv_full(d) for d in plan.devices[::16]] == [d.kv_cache for d in full.devices[::16]]


def test_without_a_pipeline_nothing_changes():
    a = plan_memory(M3T, topo(64), context=131072, batch=64)
    b = plan_memory(M3T, topo(64), context=131072, batch=64, pp=1)
    assert a.format_table() == b.format_table() and a.as_dict() == b.as_dict()
    assert a.pipeline() is None and "pp_in_flight" not in a.devices[0].activation_detail


@pytest.mark.parametrize("kw, needle", [
    ({"pp": 0}, "--pp: must be an integer"),
    ({"pp": 3}, "--pp: 3 does not divide --devices 64"),
    ({"pp": 128, "devices": 128}, "--pp: 128 stages exceed the model's 80 layers"),
    ({"pp": 1, "micro_batches": 4}, "--micro-batches: goes with --pp > 1"),
    ({"pp": 1, "pp_layers": "40,40"}, "--pp-layers: goes with --pp > 1"),
    ({"pp_layers": "40,40"}, "--pp-layers: needs 4 counts"),
    ({"pp_layers": "x"}, "--pp-layers: must be comma-separated"),
    ({"tp": 3}, "--tp: 3 does not divide the 16 devices of a pipeline stage"),
    ({"ep": 32}, "--ep: 32 does not divide the 16 devices of a pipeline stage"),
])
def test_bad_pipelines_are_refused(kw, needle):
    with pytest.raises(PlanError, match=needle):
        plan_3t(**kw)


def test_stage_weights_of_every_layer_are_the_models():
    weights = weight_format(None, M3T)
    assert M3T.stage_weight_bytes(weights, range(M3T.num_layers), experts_local=7) == \
        M3T.weight_bytes(weights, experts_local=7)
    tied = load_plan_model(dict(json_config(), tie_word_embeddings=True))
    w = weight_format(None, tied)
    assert tied.stage_weight_bytes(w, range(tied.num_layers))["embeddings"] == \
        tied.weight_bytes(w)["embeddings"]  # one matrix when one stage holds both ends
    first, last = (tied.stage_weight_bytes(w, r)["embeddings"] for r in (range(0, 40), range(40, 80)))
    assert first == last == tied.weight_bytes(w)["embeddings"]  # tied: the last stage keeps its own copy


def json_config() -> dict:
    import json

    return json.loads(CONFIG_3T.read_text())


def test_only_the_last_stage_sizes_the_logits():
    from moectl.engine.planning.memory_plan import step_activations

    kw = dict(tp=1, tokens=64, recv_rows=0, context=64, seqs=64, block_size=16, act_bytes=2, attn_impl="flash")
    # a decode step of 64 sequences: the vocabulary's logits are the largest operator, where they are held
    assert step_activations(M3T, **kw)[1] == "logits"
    assert step_activations(M3T, layers=range(0, 20), logits=False, **kw)[1] != "logits"
    assert "dense_mlp" not in step_activations(M3T, layers=range(40, 60), logits=False, **kw)[0]
