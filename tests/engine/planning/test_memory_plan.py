"""The memory planner: parameter counts, the engine's real weight and KV accounting, the 3T config."""

from __future__ import annotations

import json

import pytest
import torch

from moectl.engine.core.kv_cache import KVCache
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.planning.memory_plan import CATEGORIES, fit_suggestions, load_plan_model, plan_memory
from moectl.placement.topology import Topology
from tests.checkpoints import SPECS
from tests.paths import DOCS

CONFIG_3T = DOCS / "configs" / "k3-3t-1m.json"
GIB = 1 << 30


def tiny_raw(name: str) -> dict:
    _, model_cls, kwargs, _ = SPECS[name]
    return dict(kwargs, architectures=[model_cls])


def engine_category(name: str) -> str:
    """The planner's category of one of the engine's parameters, by its name."""
    if name.startswith(("embed.", "lm_head.")):
        return "embeddings"
    if ".attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.shared_" in name:  # shared_w13, shared_w2 and the shared expert's sigmoid gate
        return "shared_experts"
    if name.endswith((".mlp.gate", ".mlp.gate_bias", ".e_score_correction_bias")) or "norm" in name:
        return "norms_routers"
    if ".mlp.w13" in name or ".mlp.w2" in name:
        return "dense_mlp"
    raise AssertionError(f"uncategorised parameter {name}")


def one_device(**kw) -> Topology:
    return Topology(num_devices=1, hbm_bytes=kw.pop("hbm", GIB))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_param_counts_and_weight_bytes_match_the_engine(name):
    raw = tiny_raw(name)
    cfg = ModelConfig.from_hf(raw)
    model = load_plan_model(raw)
    assert model.param_counts() == cfg.param_counts()
    # the real tensors of the engine's model, summed by category, in fp32 and bf16
    engine = MoEForCausalLM(cfg)
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        real = dict.fromkeys(CATEGORIES, 0)
        engine.to(torch_dtype)
        routing_bias = [(n, b) for n, b in engine.named_buffers() if n.endswith("e_score_correction_bias")]
        for pname, p in [*engine.named_parameters(), *routing_bias]:  # tied weights listed once
            real[engine_category(pname)] += p.numel() * p.element_size()
        plan = plan_memory(raw, one_device(), tp=1, ep=1, context=64, batch=2, dtype=dtype)
        assert plan.devices[0].weights == real, dtype
        assert sum(real.values()) == cfg.param_counts()["params_total"] * torch_dtype.itemsize


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("context, batch, block_size", [(100, 3, 16), (64, 1, 16), (1, 5, 8), (500, 2, 32)])
def test_kv_bytes_are_the_engine_cache(context, batch, block_size, kv_dtype):
    raw = tiny_raw("mixtral")
    cfg = ModelConfig.from_hf(raw)
    plan = plan_memory(raw, one_device(), tp=1, ep=1, context=context, batch=batch, dtype="fp32",
                       kv_dtype=kv_dtype, block_size=block_size)
    quantized = kv_dtype == "int8"
    blocks = batch * -(-context // block_size)
    per_block = KVCache.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                                        quantized)
    dev = plan.devices[0]
    assert dev.kv_blocks == blocks
    assert dev.kv_cache == per_block * blocks
    # and what the engine really allocates for that many blocks
    cache = KVCache(cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, quantized)
    assert dev.kv_cache == cache.nbytes()


def test_int8_kv_is_smaller_than_auto():
    for raw in (tiny_raw("qwen3_moe"), str(CONFIG_3T)):
        kw = dict(tp=1, ep=1, context=500, batch=2) if isinstance(raw, dict) else dict(tp=8, ep=8, context=1 << 20)
        topo = one_device() if isinstance(raw, dict) else Topology(num_devices=8, hbm_bytes=141 * GIB)
        auto = plan_memory(raw, topo, kv_dtype="auto", **kw).devices[0].kv_cache
        int8 = plan_memory(raw, topo, kv_dtype="int8", **kw).devices[0].kv_cache
        assert 0 < int8 < auto
        assert int8 > auto // 2  # int8 values plus the fp32 scales


def test_kv_split_over_tp_by_heads_or_replicated():
    raw = tiny_raw("mixtral")  # 4 query heads, 2 KV heads

    def topo(n):
        return Topology(num_devices=n, hbm_bytes=GIB)

    full = plan_memory(raw, topo(1), tp=1, ep=1, context=256, batch=1).devices[0].kv_cache
    tp2 = plan_memory(raw, topo(2), tp=2, ep=1, context=256, batch=1)
    tp4 = plan_memory(raw, topo(4), tp=4, ep=1, context=256, batch=1)
    assert all(d.kv_cache == full // 2 for d in tp2.devices)
    assert all(d.kv_cache == full // 2 for d in tp4.devices)  # 2 KV heads < TP 4: one head each, replicated
    assert any("replicated" in n for n in tp4.notes)


def test_uneven_experts_and_replicated_expert_groups():
    raw = tiny_raw("mixtral")  # 6 experts, 3 MoE layers
    model = load_plan_model(raw)
    plan = plan_memory(raw, Topology(num_devices=4, hbm_bytes=GIB), tp=1, ep=4, context=32, batch=4, dtype="fp32")
    assert [d.experts_local for d in plan.devices] == [2, 2, 1, 1]
    assert sum(d.weights["experts"] for d in plan.devices) == 3 * 6 * model.expert_params() * 4
    rep = plan_memory(raw, Topology(num_devices=4, hbm_bytes=GIB), tp=1, ep=2, context=32, batch=4, dtype="fp32")
    assert [d.experts_local for d in rep.devices] == [3, 3, 3, 3]  # two replicas of the 2-way split
    assert any("replicas" in n for n in rep.notes)


def test_3t_config_plans_at_1m_context(capsys):
    model = load_plan_model(CONFIG_3T)
    counts = model.param_counts()
    with capsys.disabled():
        print(f"\nk3-3t-1m: {counts['params_total']:,} params ({counts['params_total'] / 1e12:.3f}e12), "
              f"{counts['params_active']:,} active")
    assert 2.9e12 < counts["params_total"] < 3.1e12
    assert counts["params_active"] < counts["params_total"] / 20
    assert model.attention == "mla" and model.num_experts >= 384 and model.max_position_embeddings == 1 << 20

    topo = Topology(num_devices=256, hbm_bytes=141 * GIB)
    plan = plan_memory(CONFIG_3T, topo, tp=8, ep=256, context=1 << 20, batch=1, kv_dtype="int8")
    out = plan.as_dict()
    json.dumps(out)
    assert out["params_total"] == counts["params_total"]
    assert out["fits"] is True and out["short_by_bytes"] == 0 and out["headroom_bytes"] > 0
    # coherent: each device's categories add up; the single sequence's KV lives on DP group 0 only
    for d in plan.devices:
        assert d.total == sum(d.categories().values()) and d.headroom == topo.hbm_bytes - d.total
        assert (d.kv_cache > 0) == (d.dp_group == 0)
        assert d.experts_local == 2
    # the cluster holds each routed expert once and every other weight once per DP group
    full = model.weight_params()
    assert sum(d.weights["experts"] for d in plan.devices) == 2 * full["experts"]
    for cat in ("embeddings", "shared_experts", "dense_mlp"):
        assert sum(d.weights[cat] for d in plan.devices) == 2 * full[cat] * plan.dp
    # MLA: the compressed latent (kv_lora_rank + rope dim), not split over TP
    latent = model.kv_lora_rank + model.qk_rope_head_dim
    kv0 = plan.devices[0].kv_cache
    # INT8: one byte a value, plus one fp32 scale per block and layer for each of the latent and the RoPE key
    assert kv0 == model.num_layers * (1 << 20) * latent + model.num_layers * (1 << 20) // 16 * 2 * 4
    table = plan.format_table()
    assert "devices 0-7" in table and "devices 8-255" in table and "fits: yes" in table
    assert any("MLA" in n for n in out["notes"]) and any("num_nextn_predict_layers" in n for n in out["notes"])
    assert {r["category"] for r in plan.rows()} >= set(CATEGORIES) | {"kv_cache", "activations", "comm_buffers",
                                                                        "headroom"}


def test_not_fitting_reports_the_shortfall():
    topo = Topology(num_devices=64, hbm_bytes=141 * GIB)
    plan = plan_memory(CONFIG_3T, topo, tp=8, ep=64, context=1 << 20, batch=1)
    out = plan.as_dict()
    worst = max(d.total for d in plan.devices)
    assert out["fits"] is False
    assert out["short_by_bytes"] == worst - topo.hbm_bytes > 0
    assert out["headroom_bytes"] == -out["short_by_bytes"]
    assert "short by" in plan.format_table()
    changes = [s["change"] for s in fit_suggestions(CONFIG_3T, topo, tp=8, ep=64, context=1 << 20, batch=1)]
    assert any(c.startswith("--devices") for c in changes) and any(c.startswith("--context") for c in changes)
    for s in fit_suggestions(CONFIG_3T, topo, tp=8, ep=64, context=1 << 20, batch=1):
        assert s["fits"] and s["headroom_bytes"] >= 0


def test_activations_eager_exceed_flash_and_comm_buffers_follow_the_layout():
    raw = tiny_raw("qwen2_moe")
    topo = Topology(num_devices=4, hbm_bytes=GIB)
    flash = plan_memory(raw, topo, tp=2, ep=4, context=256, batch=8)
    eager = plan_memory(raw, topo, tp=2, ep=4, context=256, batch=8, attn_impl="eager")
    assert eager.devices[0].activations > flash.devices[0].activations > 0
    assert set(flash.devices[0].comm_detail) == {"ep_dispatch", "ep_combine", "tp_all_reduce"}
    single = plan_memory(raw, one_device(), tp=1, ep=1, context=256, batch=8)
    assert single.devices[0].comm_buffers == 0


def test_deepseek_v3_shapes_give_its_published_size():
    raw = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
               intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
               n_shared_experts=1, n_routed_experts=256, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
               v_head_dim=128, qk_nope_head_dim=128, num_experts_per_tok=8, first_k_dense_replace=3,
               n_group=8, topk_group=4, routed_scaling_factor=2.5, max_position_embeddings=163840)
    counts = load_plan_model(raw).param_counts()
    assert round(counts["params_total"] / 1e9) == 671 and 37e9 < counts["params_active"] < 38e9


def test_runtime_only_fields_are_planned_with_a_note():
    raw = dict(tiny_raw("mixtral"), sliding_window=4096, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError):
        ModelConfig.from_hf(raw)
    plan = plan_memory(raw, one_device(), tp=1, ep=1, context=64)
    assert plan.params == ModelConfig.from_hf(tiny_raw("mixtral")).param_counts()
    assert any("cannot run" in n for n in plan.notes)


@pytest.mark.parametrize("kw, option", [
    (dict(tp=16), "--tp"),
    (dict(tp=3), "--tp"),
    (dict(tp=0), "--tp"),
    (dict(ep=3), "--ep"),
    (dict(ep=0), "--ep"),
    (dict(context=0), "--context"),
    (dict(context=1 << 21), "--context"),
    (dict(batch=0), "--batch"),
    (dict(batch=1.5), "--batch"),
    (dict(kv_dtype="fp4"), "--kv-dtype"),
    (dict(dtype="int3"), "--dtype"),
    (dict(block_size=0), "--block-size"),
    (dict(max_batched_tokens=0), "--max-batched-tokens"),
    (dict(attn_impl="paged"), "--attn-impl"),
])
def test_bad_options_are_one_line_errors_naming_the_option(kw, option):
    topo = Topology(num_devices=8, hbm_bytes=141 * GIB)
    args = dict(tp=8, ep=8, context=1 << 20, batch=1) | kw
    with pytest.raises(ValueError) as exc:
        plan_memory(CONFIG_3T, topo, **args)
    msg = str(exc.value)
    assert msg.startswith(option + ":") and "\n" not in msg


def test_tp_must_divide_heads_and_ep_not_exceed_experts():
    raw = tiny_raw("mixtral")  # 4 heads, 6 experts
    with pytest.raises(ValueError, match="^--tp: 8 does not divide the model's 4 attention heads"):
        plan_memory(raw, Topology(num_devices=8, hbm_bytes=GIB), tp=8, ep=1, context=8)
    with pytest.raises(ValueError, match="^--ep: 8 exceeds the model's 6 routed experts"):
        plan_memory(raw, Topology(num_devices=8, hbm_bytes=GIB), tp=1, ep=8, context=8)


def test_unknown_architecture_names_architectures(tmp_path):
    with pytest.raises(ValueError, match="^architectures: 'LlamaForCausalLM'") as exc:
        load_plan_model({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})
    assert "\n" not in str(exc.value)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="^config.json:"):
        load_plan_model(tmp_path)
    with pytest.raises(ValueError, match="^hidden_size: missing"):
        load_plan_model({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4})
