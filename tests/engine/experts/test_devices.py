"""The local backend: emulated devices, placed experts, live rebalancing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.placement.placement import Placement, PlacementError
from moectl.placement.rebalancer import plan_rebalance
from moectl.placement.topology import Topology
from tests.checkpoints import prompts, tiny_checkpoint

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("devices"))


def engine(ckpt, devices=None, **kw) -> LLMEngine:
    topo = None if devices is None else Topology(num_devices=devices, devices_per_node=kw.pop("per_node", 8),
                                                 hbm_bytes=kw.pop("hbm", 1 << 30))
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128, topology=topo, **kw))


@pytest.fixture(scope="module")
def single_device_outputs(ckpt):
    return [o.token_ids for o in engine(ckpt).generate(prompts(6), GREEDY)]


@pytest.mark.parametrize("policy", ["locality", "least_loaded", "round_robin"])
def test_emulated_devices_give_the_same_tokens(ckpt, single_device_outputs, policy):
    eng = engine(ckpt, devices=4, per_node=2, routing_policy=policy, redundant_slots=1)
    assert [o.token_ids for o in eng.generate(prompts(6), GREEDY)] == single_device_outputs


def test_step_device_stats_are_consistent(ckpt):
    eng = engine(ckpt, devices=4)
    eng.generate(prompts(4), GREEDY)
    cfg = eng.model_config
    for step in eng.step_log:
        dev = step.devices
        rows = (step.prefill_tokens + step.decode_tokens) * cfg.top_k * cfg.num_layers
        assert sum(dev["tokens"]) == rows  # every (token, choice) computed once, on one device
        traffic = np.array(dev["traffic_bytes"])
        assert traffic.sum() == rows * cfg.hidden_size * 4  # fp32 hidden state per (token, choice)
        assert dev["link_s_modeled"] is True
        busy = np.array(dev["busy_s"])
        assert ((busy > 0) == (np.array(dev["tokens"]) > 0)).all()
        # routing counts (the heat map) agree with the device loads
        assert int(step.routing.sum()) == rows
        memory = dev["memory"]
        slot_tensors = sum(layer.slot_w13.nbytes + layer.slot_w2.nbytes for layer in eng.experts.cluster.layers)
        assert sum(m["expert_weights"] for m in memory) == slot_tensors  # matches the real tensors
        # every block in use belongs to exactly one device
        assert step.kv_blocks_used * eng.kv_cache.nbytes() // eng.blocks.num_blocks == \
            sum(m["kv_blocks"] for m in memory)


def test_live_rebalance_keeps_outputs_identical(ckpt, single_device_outputs):
    eng = engine(ckpt, devices=4, redundant_slots=1)
    ids = [eng.add_request(p, GREEDY) for p in prompts(6)]
    done, steps = {}, 0
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        steps += 1
        if steps == 3:
            loads = sum(s.routing for s in eng.step_log).numpy()
            plan = plan_rebalance(loads, eng.config.topology, 1, current=eng.experts.placement)
            applied = eng.experts.apply(plan.placement)
    assert [done[i] for i in ids] == single_device_outputs
    assert eng.experts.placement == plan.placement and applied.result()["bytes_moved"] > 0


def test_bad_placements_are_refused_and_nothing_changes(ckpt):
    eng = engine(ckpt, devices=4)
    before = eng.experts.placement
    cfg = eng.model_config
    with pytest.raises(PlacementError, match="devices"):
        eng.experts.apply(Placement.contiguous(cfg.num_layers, cfg.num_experts, 2))
    with pytest.raises(PlacementError, match="slots per device"):
        eng.experts.apply(Placement.contiguous(cfg.num_layers, cfg.num_experts, 4, 3))
    with pytest.raises(PlacementError):
        before.move(0, 99, 0, 1)
    eng.step()
    assert eng.experts.placement == before


def test_hbm_too_small_for_the_experts_is_refused(ckpt):
    with pytest.raises(PlacementError, match="hbm"):
        engine(ckpt, devices=2, hbm=1000)


def test_manual_preview_then_apply_keeps_the_outputs(ckpt, single_device_outputs):
    eng = engine(ckpt, devices=4, redundant_slots=1)
    ids = [eng.add_request(p, GREEDY) for p in prompts(6)]
    for _ in range(3):
        eng.step()
    before = eng.experts.balancedness()
    placement = eng.experts.placement
    plan = eng.experts.preview()
    assert eng.experts.placement is placement  # preview changes nothing
    predicted = plan.summary()["predicted"]  # the plan minimises the predicted step: never slower
    assert predicted["step_s_after"] <= predicted["step_s_before"]
    assert predicted["gain_low"] <= predicted["gain"] <= predicted["gain_high"]
    assert abs(plan.balancedness_before.overall - before) < 1e-9
    eng.experts.apply(plan.placement, kind="rebalance_apply")
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert [done[i] for i in ids] == single_device_outputs
    kinds = [a["kind"] for a in eng.actions]
    assert kinds == ["rebalance_preview", "rebalance_apply"]
    assert eng.actions[1]["result"]["bytes_moved"] == plan.bytes_moved


def test_auto_rebalance_every_k_steps(ckpt, single_device_outputs):
    from moectl.engine.core.config import AutoRebalancePolicy

    eng = engine(ckpt, devices=4, redundant_slots=1, auto_rebalance=AutoRebalancePolicy("auto", every_k_steps=2))
    outs = eng.generate(prompts(6), GREEDY)
    assert [o.token_ids for o in outs] == single_device_outputs
    # every second step auto mode prices the best plan: applied where the gate lets it, else held with why
    looked = [a for a in eng.actions if a["kind"] in ("auto_rebalance_plan", "auto_rebalance_held")]
    assert len(looked) >= 3 and all(a["step"] % 2 == 0 for a in looked)
    applied = [a for a in eng.actions if a["kind"] == "rebalance_apply"]
    assert len(applied) == sum(a["kind"] == "auto_rebalance_plan" for a in looked)
    for held in (a["result"] for a in looked if a["kind"] == "auto_rebalance_held"):
        assert held["gain_low"] <= held["gain"] <= held["gain_high"] and held["reason"]


def test_auto_mode_applies_nothing_the_gate_holds_back(ckpt, single_device_outputs):
    from moectl.engine.core.config import AutoRebalancePolicy

    policy = AutoRebalancePolicy("auto", every_k_steps=2, min_gain=0.99)  # no plan promises +99%
    eng = engine(ckpt, devices=4, redundant_slots=1, auto_rebalance=policy)
    outs = eng.generate(prompts(6), GREEDY)
    assert [o.token_ids for o in outs] == single_device_outputs
    kinds = [a["kind"] for a in eng.actions]
    assert "rebalance_apply" not in kinds and "auto_rebalance_held" in kinds
    held = next(a["result"] for a in eng.actions if a["kind"] == "auto_rebalance_held")
    assert "below the 99% gate" in held["reason"] or "no placement is predicted faster" in held["reason"]


def test_operator_edits_one_expert(ckpt, single_device_outputs):
    eng = engine(ckpt, devices=4, redundant_slots=1)
    new = eng.experts.edit("replicate", layer=0, expert=0, device=3)
    assert (3, ) in {(d,) for d, _ in new.replicas(0, 0)}
    eng.experts.edit("pin", layer=0, expert=1)
    with pytest.raises(PlacementError):
        eng.experts.edit("move", layer=0, expert=1, src_device=0, dst_device=2)  # pinned
    with pytest.raises(ValueError, match="edit"):
        eng.experts.edit("teleport", layer=0, expert=1)
    with pytest.raises(PlacementError):
        eng.experts.edit("replicate", layer=0, expert=99, device=0)
    outs = eng.generate(prompts(6), GREEDY)
    assert [o.token_ids for o in outs] == single_device_outputs
    assert len(eng.experts.placement.replicas(0, 0)) == 2 and eng.experts.placement.is_pinned(0, 1)
    assert [a["kind"] for a in eng.actions] == ["replicate", "pin"]


def test_planner_agrees_with_the_local_backend_accounting(ckpt):
    """`plan memory` from config.json alone gives each device the expert bytes and KV bytes that
    the local backend really holds for the same layout (EP over all devices, block-rounded KV)."""
    from moectl.engine.planning.memory_plan import plan_memory

    devices, context = 4, 40
    eng = engine(ckpt, devices=devices)
    plan = plan_memory(ckpt, Topology(num_devices=devices), tp=1, ep=devices, context=context,
                       batch=devices, dtype="fp32", block_size=4).as_dict()["bytes"]
    # one sequence per device (round-robin homes), each holding `context` tokens of KV
    for p in prompts(devices, seed=11, lo=context - 1, hi=context - 1):
        eng.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    while eng.step_log[-1].prefill_tokens:  # then one decode: each sequence holds `context` tokens
        eng.step()
    memory = eng.step_log[-1].devices["memory"]
    assert all(m["expert_weights"] == plan["experts"] for m in memory)
    assert [m["kv_blocks"] for m in memory] == [plan["kv_cache"]] * devices


def test_tiered_expert_memory_gives_the_same_tokens(ckpt, single_device_outputs):
    """Experts in the host tier, a 2-slot cache per device (half of what each device serves
    across both layers): real misses, real copies, the same greedy tokens."""
    eng = engine(ckpt, devices=4, expert_cache_slots=2)
    assert [o.token_ids for o in eng.generate(prompts(6), GREEDY)] == single_device_outputs
    caches = [step.devices["expert_cache"] for step in eng.step_log]
    misses = sum(c["misses"] for step in caches for c in step)
    hits = sum(c["hits"] for step in caches for c in step)
    assert misses > 0 and hits > 0
    expert_bytes = eng.experts.cluster.expert_bytes
    copies = misses + sum(c["prefetched"] for step in caches for c in step)
    assert sum(c["bytes_copied"] for step in caches for c in step) == copies * expert_bytes
    memory = eng.step_log[-1].devices["memory"]
    assert all(m["expert_cache"] == 2 * expert_bytes and "expert_weights" not in m for m in memory)
    assert all(layer.slot_w13.numel() == 0 for layer in eng.experts.cluster.layers)  # no HBM copies of every expert


def test_tiered_cache_too_small_or_too_big_is_refused(ckpt):
    with pytest.raises(ValueError, match="cannot hold one layer's working set"):
        engine(ckpt, devices=4, expert_cache_slots=1)
    with pytest.raises(PlacementError, match="expert cache"):
        engine(ckpt, devices=4, expert_cache_slots=4, hbm=1000)


def test_router_prefetch_raises_the_hit_rate(ckpt, single_device_outputs):
    rates = {}
    for prefetch in ("none", "router"):
        eng = engine(ckpt, devices=4, expert_cache_slots=2, expert_prefetch=prefetch)
        assert [o.token_ids for o in eng.generate(prompts(6), GREEDY)] == single_device_outputs
        caches = [c for step in eng.step_log for c in step.devices["expert_cache"]]
        rates[prefetch] = sum(c["hits"] for c in caches) / sum(c["hits"] + c["misses"] for c in caches)
    assert rates["router"] > rates["none"]


def test_coactivation_prefetch_runs_live(ckpt, single_device_outputs):
    eng = engine(ckpt, devices=4, expert_cache_slots=2, expert_prefetch="coact")
    assert [o.token_ids for o in eng.generate(prompts(6), GREEDY)] == single_device_outputs
    assert sum(c["prefetched"] for s in eng.step_log for c in s.devices["expert_cache"]) > 0


def test_experts_on_separate_torch_devices_give_the_same_tokens(ckpt, single_device_outputs):
    """The multi-GPU-in-one-process path (each device's slots its own tensor on its own torch
    device, rows copied there and back), run here with CPU devices; same greedy tokens."""
    eng = engine(ckpt, devices=2, expert_devices=("cpu", "cpu"), redundant_slots=1)
    layer = eng.experts.cluster.layers[0]
    assert layer.slot_w13.numel() == 0 and layer.device_w13[0].data_ptr() != layer.device_w13[1].data_ptr()
    assert [o.token_ids for o in eng.generate(prompts(6), GREEDY)] == single_device_outputs
    record = eng.step_log[-1].devices
    assert record["backend"] == "multi-gpu" and all(b > 0 for b, t in zip(record["busy_s"], record["tokens"]) if t)


def test_missing_cuda_devices_are_refused(ckpt):
    from moectl.engine.core.config import KnobError

    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(KnobError, match=f"{missing} does not exist here"):
        engine(ckpt, devices=2, expert_devices=("cpu", missing))
    with pytest.raises(KnobError, match="one device per entry"):
        engine(ckpt, devices=2, expert_devices=("cpu",))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_real_gpus_in_one_process_give_the_same_tokens(ckpt, single_device_outputs):
    eng = LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128, device="cuda:0",
                                 topology=Topology(num_devices=2), expert_devices=("cuda:0", "cuda:1")))
    assert eng.experts.cluster.layers[0].device_w13[1].device == torch.device("cuda:1")
    assert [o.token_ids for o in eng.generate(prompts(6), GREEDY)] == single_device_outputs
    busy = [b for step in eng.step_log for b in step.devices["busy_s"]]
    assert sum(busy) > 0


def test_a_placement_the_tiered_cache_cannot_run_is_refused_before_anything_changes(ckpt):
    eng = engine(ckpt, devices=4, expert_cache_slots=2, redundant_slots=1)
    before = eng.experts.placement
    layer = eng.experts.cluster.layers[0].layer_idx
    expert = next(e for e in range(eng.model_config.num_experts) if e not in before.experts_on(layer, 0))
    with pytest.raises(PlacementError, match="cannot hold one layer's working set"):
        eng.experts.edit("replicate", layer=layer, expert=expert, device=0)
    eng.step()
    assert eng.experts.placement == before and not [a for a in eng.actions if a["kind"].endswith("_failed")]


def test_the_balance_objective_previews_the_token_plan_priced_the_same_way(ckpt):
    from moectl.engine.core.config import AutoRebalancePolicy, KnobError
    from moectl.placement.rebalancer import preview_plan

    eng = engine(ckpt, devices=4, redundant_slots=1)
    eng.generate(prompts(6), GREEDY)
    cluster = eng.experts.cluster
    cluster.auto = AutoRebalancePolicy(objective="balance")
    plan = cluster.preview()
    tokens = preview_plan(cluster.window.loads(), cluster.topology, cluster.placement)
    assert (plan.placement.slots == tokens.placement.slots).all()
    predicted = plan.summary()["predicted"]  # priced and gated like the step-time planner's
    assert predicted["gain_low"] <= predicted["gain"] <= predicted["gain_high"] and predicted["reason"]
    with pytest.raises(KnobError, match="objective"):
        AutoRebalancePolicy(objective="tokens")
    with pytest.raises(KnobError, match="min_gain"):
        AutoRebalancePolicy(min_gain=1.5)
