"""The memory planner under a KV retention budget (`plan memory --kv-budget`): the full-attention
layers' blocks per sequence, what the budget saves against full retention, the seeds' 3T config
at a million tokens, and the engine's own peak under the same budget."""

from __future__ import annotations

import json

import pytest
import torch

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import ModelConfig
from moectl.engine.planning.memory_plan import PlanError, kv_budget_blocks, load_plan_model, plan_memory
from moectl.placement.topology import Topology
from tests.checkpoints import SPECS, tiny_checkpoint
from tests.paths import DOCS

CONFIG_3T = DOCS / "configs" / "k3-3t-1m.json"
GIB = 1 << 30
MILLION = 1_000_000


def tiny_raw(name: str) -> dict:
    _, model_cls, kwargs, _ = SPECS[name]
    return dict(kwargs, architectures=[model_cls])


def test_the_million_token_kv_table_of_the_3t_config_at_a_quarter():
    """k3-3t-1m on 256 devices at 1,000,000 tokens with --kv-budget 25%: the one sequence's KV
    (MLA latent + RoPE key, bf16, 80 layers) in whole blocks of 16 tokens: 250,000 tokens kept
    plus one 1,024-token step chunk = 15,689 blocks, against 62,500 under full retention."""
    topo = Topology(num_devices=256, hbm_bytes=141 * GIB)
    full = plan_memory(CONFIG_3T, topo, context=MILLION)
    plan = plan_memory(CONFIG_3T, topo, context=MILLION, kv_budget_fraction=0.25)
    model = load_plan_model(CONFIG_3T)
    per_block = 80 * 16 * (512 + 64) * 2  # layers x tokens x latent elements x bf16
    assert model.kv_bytes_per_block(1, 16, torch.bfloat16, False) == per_block
    assert full.devices[0].kv_blocks == 62_500 and full.devices[0].kv_cache == 62_500 * per_block
    assert plan.kv_held_tokens == 250_000
    assert plan.kv_blocks_per_sequence == -(-(250_000 + 1024) // 16) == 15_689
    kv0 = plan.devices[0]
    assert kv0.kv_blocks == 15_689 and kv0.kv_cache == 15_689 * per_block == 23_134_371_840
    assert 0.25 < kv0.kv_cache / full.devices[0].kv_cache < 0.252  # about a quarter
    # only device 0 (DP group 0) holds the sequence; nothing else changes
    assert all(d.kv_cache == 0 and plan.kv_saved(d) == 0 for d in plan.devices[1:])
    for a, b in zip(full.devices, plan.devices):
        assert (a.weights, a.activations, a.comm_buffers) == (b.weights, b.activations, b.comm_buffers)
    assert full.devices[0].total - kv0.total == (62_500 - 15_689) * per_block

    out = json.loads(json.dumps(plan.as_dict()))
    r = out["kv_retention"]
    assert r == {"budget": "25%", "budget_tokens": 0, "budget_fraction": 0.25, "held_tokens_per_sequence": 250_000,
                 "context_tokens_per_sequence": MILLION, "blocks_per_sequence": 15_689,
                 "full_blocks_per_sequence": 62_500, "bytes_per_sequence": 15_689 * per_block,
                 "full_bytes_per_sequence": 62_500 * per_block, "saved_bytes_per_sequence": 46_811 * per_block,
                 "device": 0, "sequences_on_device": 1, "kv_cache_bytes_per_device": 15_689 * per_block,
                 "full_kv_cache_bytes_per_device": 62_500 * per_block, "saved_bytes_per_device": 46_811 * per_block}
    assert out["bytes"]["kv_cache"] == 15_689 * per_block
    group0 = out["device_groups"][0]
    assert group0["devices"] == [0] and group0["kv_saved_bytes"] == 46_811 * per_block
    assert group0["kv_full_bytes"] == 62_500 * per_block
    assert "15689 blocks" in group0["detail"]["kv_cache"] and "budget 250,000 tokens/seq" in group0["detail"]["kv_cache"]
    assert full.as_dict()["kv_retention"] is None and "kv_saved_bytes" not in full.as_dict()["device_groups"][0]

    table = plan.format_table()
    assert "KV budget 25%: keeps 250,000 of 1,000,000 tokens per sequence" in table
    assert "15,689 blocks, not 62,500" in table and "saves 64.29 GiB per sequence, 64.29 GiB per device" in table
    assert "KV cache 21.55 GiB, not 85.83 GiB" in table
    assert any("ceil((250,000 + a 1024-token chunk) / 16) = 15,689 blocks" in n for n in plan.notes)
    assert "KV budget" not in full.format_table()


@pytest.mark.parametrize("budget, fraction, context, chunk, blocks", [
    (4096, 1.0, 10_000, 1024, 320),     # ceil((4096 + 1024) / 16)
    (4096, 1.0, 10_000, 1, 257),        # a decode step: ceil(4096 / 16) blocks and the one being written
    (4096, 1.0, 10_000, 16, 257),
    (0, 0.25, 1001, 16, 17),            # 25% of 1001 is 250.25: 251 tokens, as the engine rounds
    (4096, 0.25, 1000, 16, 17),         # both caps: the smaller (250)
    (4096, 1.0, 2000, 1024, 125),       # the budget and a chunk exceed the context: all of it
    (50_000, 1.0, 2000, 16, 125),       # a budget above the context saves nothing
])
def test_blocks_per_sequence_under_a_budget(budget, fraction, context, chunk, blocks):
    raw = tiny_raw("mixtral")  # max_position_embeddings 512: widened for the long contexts
    raw = dict(raw, max_position_embeddings=1 << 20)
    topo = Topology(num_devices=1, hbm_bytes=GIB)
    plan = plan_memory(raw, topo, tp=1, ep=1, context=context, batch=3, dtype="fp32", max_batched_tokens=chunk,
                       kv_budget=budget, kv_budget_fraction=fraction)
    full = plan_memory(raw, topo, tp=1, ep=1, context=context, batch=3, dtype="fp32", max_batched_tokens=chunk)
    cfg = ModelConfig.from_hf(raw)
    per_block = KVCache.bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, False)
    assert plan.kv_blocks_per_sequence == blocks
    assert plan.devices[0].kv_blocks == 3 * blocks and plan.devices[0].kv_cache == 3 * blocks * per_block
    assert plan.kv_saved(plan.devices[0]) == full.devices[0].kv_cache - plan.devices[0].kv_cache >= 0
    assert plan.kv_saved_per_sequence == (-(-context // 16) - blocks) * per_block


def test_savings_follow_each_devices_sequences():
    """Sequences dealt to DP groups (2, 2, 1, 1): each device saves its sequences' share; the
    summary names the device holding the most."""
    raw = dict(tiny_raw("mixtral"), max_position_embeddings=1 << 20)
    plan = plan_memory(raw, Topology(num_devices=4, hbm_bytes=GIB), tp=1, ep=2, context=4096, batch=6, dtype="fp32",
                       kv_budget=1000)
    assert [d.sequences for d in plan.devices] == [2, 2, 1, 1]
    per_seq = plan.kv_saved_per_sequence
    assert per_seq > 0 and [plan.kv_saved(d) for d in plan.devices] == [2 * per_seq, 2 * per_seq, per_seq, per_seq]
    r = plan.kv_retention()
    assert (r["device"], r["sequences_on_device"], r["saved_bytes_per_device"]) == (0, 2, 2 * per_seq)
    assert [g["kv_saved_bytes"] for g in plan.as_dict()["device_groups"]] == [2 * per_seq, per_seq]


def test_sliding_window_layers_are_as_without_a_budget():
    """gpt_oss_full: two full layers and one sliding layer; the budget caps the full layers only."""
    raw = dict(tiny_raw("gpt_oss_full"), max_position_embeddings=1 << 20)
    model = load_plan_model(raw)
    topo = Topology(num_devices=1, hbm_bytes=GIB)
    kw = dict(tp=1, ep=1, context=8192, batch=1, dtype="fp32", max_batched_tokens=64)
    full, plan = plan_memory(raw, topo, **kw), plan_memory(raw, topo, **kw, kv_budget=512)
    full_layer = model.kv_bytes_per_block(1, 16, torch.float32, False, layers=2)
    blocks = kv_budget_blocks(512, 16, 64)
    assert blocks == 36 and plan.kv_blocks_per_sequence == blocks
    # the sliding layer's share is the same in both; the full layers' shrinks from 512 blocks to 36
    assert full.devices[0].kv_cache - plan.devices[0].kv_cache == (512 - 36) * full_layer


@pytest.mark.parametrize("kw, words", [
    ({"kv_budget": -1}, "--kv-budget: must be an integer in [0, "),
    ({"kv_budget_fraction": 0.0}, "--kv-budget: a fraction of the context must be in (0, 1], got 0.0"),
    ({"kv_budget_fraction": 1.5}, "--kv-budget: a fraction of the context must be in (0, 1], got 1.5"),
])
def test_a_bad_budget_names_the_option(kw, words):
    with pytest.raises(PlanError) as error:
        plan_memory(tiny_raw("mixtral"), Topology(num_devices=1, hbm_bytes=GIB), tp=1, ep=1, context=64, **kw)
    assert str(error.value).startswith(words)


def test_the_plan_is_the_engines_peak_under_the_same_budget(tmp_path):
    """A real engine (streaming, 16 tokens, blocks of 4, 8-token steps) on a 60-token prompt: the
    most blocks its sequence holds, seen as each step's blocks are committed and before retention
    evicts, is the plan's kv_blocks_per_sequence: ceil((16 + 8) / 4) = 6, not the 18 of full."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    knobs = SchedulerKnobs(kv_retention="streaming", kv_budget=16, max_num_batched_tokens=8,
                           long_prefill_token_threshold=8)
    engine = LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=64, knobs=knobs, num_threads=1,
                                    topology=Topology(num_devices=1)))
    held = []
    apply = engine.retention.apply

    def watched(seq, k):
        held.append(len(seq.held_blocks))
        return apply(seq, k)
    engine.retention.apply = watched
    out = engine.generate([list(range(2, 62))], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and sum(engine.blocks.evicted_tokens) > 0
    context = 60 + 10
    plan = plan_memory(ckpt, Topology(num_devices=1, hbm_bytes=GIB), tp=1, ep=1, context=context, batch=1,
                       block_size=4, max_batched_tokens=8, kv_budget=16)
    assert max(held) == plan.kv_blocks_per_sequence == 6 < -(-context // 4)
    # decode steps write one token: the budget's blocks and the one being written
    assert held[-1] <= kv_budget_blocks(16, 4, 1) == 5
