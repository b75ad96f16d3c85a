"""The local backend's memory ledger: every category per device, agreement with the planner,
per-device KV pools, HBM enforcement, and tiered expert memory chosen when HBM is short."""

from __future__ import annotations

import pytest

from moectl.engine.core.config import EngineConfig, KnobError
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.experts.memory_ledger import WEIGHT_CATEGORIES
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.planning.memory_plan import plan_memory
from moectl.placement.placement import PlacementError
from moectl.placement.topology import Topology
from tests.checkpoints import prompts, tiny_checkpoint

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ledger"))


def engine(ckpt, devices, hbm=1 << 30, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, topology=Topology(num_devices=devices, hbm_bytes=hbm),
                                  **kw))


def first_prefill_memory(eng, context: int, n: int, seed: int = 3) -> list[dict]:
    vocab = eng.model_config.vocab_size
    for p in prompts(n, seed=seed, lo=context, hi=context):
        eng.add_request([t % vocab for t in p], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    return eng.step_log[-1].devices["memory"]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_every_weight_category_agrees_with_the_planner(tmp_path, arch):
    """Real tensor bytes per device (each device a DP-attention replica plus its expert slots)
    equal what `plan memory` computes from config.json alone; qwen2_moe adds shared experts and
    a dense layer."""
    ckpt = tiny_checkpoint(tmp_path, "engine" if arch == "mixtral" else arch)
    devices = 2
    eng = engine(ckpt, devices, num_kv_blocks=64)
    plan = plan_memory(ckpt, Topology(num_devices=devices), tp=1, ep=devices, context=8, batch=devices,
                       dtype="fp32", block_size=4).as_dict()["bytes"]
    memory = first_prefill_memory(eng, context=8, n=devices)
    for m in memory:
        for planner_name, ledger_name in WEIGHT_CATEGORIES.items():
            assert m.get(ledger_name, 0) == plan[planner_name], ledger_name
        assert m["expert_weights"] == plan["experts"]
    if arch == "qwen2_moe":
        assert memory[0]["shared_expert_weights"] > 0 and memory[0]["dense_mlp_weights"] > 0


def test_step_activations_agree_with_the_planner(ckpt):
    """One device, one prompt of `context` tokens prefilled in one step: the step's real shapes
    are exactly the planner's worst step for (context, batch 1), so activations agree."""
    context = 24
    eng = engine(ckpt, 1)
    memory = first_prefill_memory(eng, context=context, n=1)
    plan = plan_memory(ckpt, Topology(num_devices=1), tp=1, ep=1, context=context, batch=1, dtype="fp32",
                       block_size=4, attn_impl="eager").as_dict()["bytes"]
    assert memory[0]["activations"] == plan["activations"] > 0
    assert memory[0]["comm_buffers"] == plan["comm_buffers"] == 0
    assert memory[0]["kv_blocks"] == plan["kv_cache"]


def test_activations_and_buffers_follow_each_devices_work(ckpt):
    eng = engine(ckpt, 4)
    memory = first_prefill_memory(eng, context=16, n=2)  # homes 0 and 1 hold the sequences
    assert all(m["activations"] > 0 for m in memory[:2])
    for m in memory:  # every device computes expert rows (routing spreads), so all hold dispatch buffers
        assert m["comm_buffers"] >= 0
    idle = [d for d, m in enumerate(memory) if m["activations"] == 0]
    assert all(memory[d]["comm_buffers"] == 0 for d in idle)
    record = eng.step_log[-1].devices
    assert record["memory_capacity"]["kv_blocks"] == [32 * eng.kv_cache.nbytes() // 128] * 4
    assert record["tiers"]["host"]["expert_weights"] == eng.experts.cluster.host_expert_bytes > 0


def test_each_device_has_its_own_kv_pool(ckpt):
    """Two devices with 12 blocks each: sequences homed on a full device are preempted by that
    device's sequences only; no pool ever holds more than its capacity."""
    eng = engine(ckpt, 2, num_kv_blocks=24)
    long_params = SamplingParams(max_tokens=20, ignore_eos=True)
    for p in prompts(6, seed=5, lo=14, hi=18):
        eng.add_request(p, long_params)
    while eng.has_unfinished():
        eng.step()
        used = eng.blocks.used_per_pool()
        assert all(u <= size for u, size in zip(used, eng.blocks.pool_sizes))
        assert [m["kv_blocks"] for m in eng.step_log[-1].devices["memory"]] == \
            [u * eng.kv_cache.nbytes() // 24 for u in used]
        eng.blocks.check_invariants()
    assert eng.scheduler.num_preemptions > 0
    with pytest.raises(ValueError, match="a device's KV pool has 12"):
        eng.add_request(list(range(1, 40)), SamplingParams(max_tokens=20))


def test_prefix_reuse_stays_within_a_device(ckpt):
    eng = engine(ckpt, 2)
    prompt = prompts(1, seed=9, lo=20, hi=20)[0]
    params = SamplingParams(max_tokens=1)
    for _ in range(3):  # homes 0, 1, 0: only the third finds the first's blocks
        eng.generate([prompt], params)
    assert eng.blocks.prefix_hits == 16  # 4 full blocks, once


def test_hbm_too_small_is_refused_with_the_breakdown(ckpt):
    with pytest.raises(PlacementError, match=r"hbm: .*device 0 needs .*weights .*KV pool .*activations"):
        engine(ckpt, 2, hbm=200 << 10)


@pytest.mark.parametrize("which", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_tiered_memory_is_chosen_when_experts_do_not_fit(ckpt, tiny_hf_checkpoint, which):
    """An HBM that holds everything but the placed experts: the engine puts the experts in the
    host tier with the largest cache that fits, and greedy tokens are unchanged."""
    ckpt = ckpt if which == "mixtral" else tiny_hf_checkpoint("deepseek_v3")
    reference = engine(ckpt, 2)
    vocab = reference.model_config.vocab_size
    batch = [[t % vocab for t in p] for p in prompts(4)]
    want = [o.token_ids for o in reference.generate(batch, GREEDY)]
    ledger = reference.experts.cluster.ledger
    cluster = reference.experts.cluster
    slot_bytes = cluster.expert_slot_bytes(cluster.placement.slots_per_device)
    fixed = ledger.fixed_bytes(0, reference.knobs)
    eng = engine(ckpt, 2, hbm=fixed + slot_bytes - 1)  # one byte short: the cache holds one expert less
    assert eng.experts.cluster.tiered_auto and eng.experts.cluster.caches[0].capacity == slot_bytes // cluster.expert_bytes - 1
    assert [o.token_ids for o in eng.generate(batch, GREEDY)] == want
    record = eng.step_log[-1].devices
    assert record["tiered_experts"] == "auto"
    assert all(m["expert_cache"] <= slot_bytes - 1 and "expert_weights" not in m for m in record["memory"])
    assert sum(c["misses"] for step in eng.step_log for c in step.devices["expert_cache"]) > 0


def test_a_knob_that_would_overflow_hbm_is_refused(ckpt):
    reference = engine(ckpt, 2)
    ledger, knobs = reference.experts.cluster.ledger, reference.knobs
    hbm = ledger.fixed_bytes(0, knobs) + ledger.expert_bytes  # exactly full at the current knobs
    eng = engine(ckpt, 2, hbm=hbm)
    with pytest.raises(KnobError, match="max_num_batched_tokens 4096"):
        eng.update_knobs(max_num_batched_tokens=4096)
    assert eng.knobs == knobs
    eng.update_knobs(max_num_batched_tokens=512)  # smaller steps always fit


def test_a_full_device_pool_does_not_hold_back_other_devices(ckpt):
    """FCFS within each device's KV pool: a waiting sequence whose pool is full does not stop a
    later one whose pool has room."""
    eng = engine(ckpt, 2, num_kv_blocks=8)  # 4 blocks (16 tokens) per device
    vocab = eng.model_config.vocab_size
    big = [t % vocab for t in prompts(1, seed=1, lo=13, hi=13)[0]]
    small = [t % vocab for t in prompts(1, seed=2, lo=3, hi=3)[0]]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in (big, small, big, small)]  # homes 0, 1, 0, 1
    eng.step()
    running = {s.request_id for s in eng.scheduler.running}
    assert ids[0] in running and ids[3] in running and ids[2] not in running
    eng.generate([], params)
    while eng.has_unfinished():
        eng.step()
    assert eng.blocks.num_used == 0
