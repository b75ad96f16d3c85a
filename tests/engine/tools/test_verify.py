"""engine.verify against transformers on tiny random checkpoints of every architecture."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.tools.verify import THRESHOLDS, _same_generation, mean_nll, rel_error, run_verify

pytestmark = pytest.mark.usefixtures("single_thread")

# small prefill chunks and token budget, so the greedy run mixes chunked prefills with decodes
CHUNKY = SchedulerKnobs(long_prefill_token_threshold=8, max_num_batched_tokens=24)
ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "olmoe_norm_topk", "deepseek_v3", "deepseek_v3_plain", "kimi_k2",
         "gpt_oss", "gpt_oss_full", "mixtral_sliding", "qwen3_moe_sliding"]
FAMILY = {"olmoe_norm_topk": "olmoe", "deepseek_v3_plain": "deepseek_v3", "kimi_k2": "deepseek_v3",
          "gpt_oss_full": "gpt_oss", "mixtral_sliding": "mixtral", "qwen3_moe_sliding": "qwen3_moe"}


def test_tiny_checkpoints_cover_the_variants(tiny_hf_checkpoint):
    """The fixtures really contain what the verify tests claim to cover."""
    cfg = {name: json.loads((tiny_hf_checkpoint(name) / "config.json").read_text()) for name in ARCHS}
    assert (tiny_hf_checkpoint("mixtral") / "tokenizer.json").is_file()
    assert (tiny_hf_checkpoint("qwen3_moe") / "model.safetensors.index.json").is_file()
    assert len(list(tiny_hf_checkpoint("qwen3_moe").glob("model-*.safetensors"))) > 1
    assert cfg["qwen3_moe"]["head_dim"] != cfg["qwen3_moe"]["hidden_size"] // cfg["qwen3_moe"]["num_attention_heads"]
    assert cfg["qwen3_moe"]["norm_topk_prob"] and not cfg["olmoe"]["norm_topk_prob"]
    assert cfg["qwen2_moe"]["shared_expert_intermediate_size"] and cfg["qwen2_moe"]["mlp_only_layers"]
    assert cfg["olmoe"]["clip_qkv"] and cfg["olmoe_norm_topk"]["clip_qkv"] is None
    assert cfg["qwen2_moe"]["tie_word_embeddings"] and not cfg["mixtral"]["tie_word_embeddings"]
    ds, plain, kimi = cfg["deepseek_v3"], cfg["deepseek_v3_plain"], cfg["kimi_k2"]
    assert ds["q_lora_rank"] and plain["q_lora_rank"] is None
    assert ds["rope_interleave"] and not plain["rope_interleave"]
    assert ds["v_head_dim"] != ds["qk_nope_head_dim"] and ds["first_k_dense_replace"] == 1
    assert ds["n_group"] > ds["topk_group"] > 1 and plain["n_group"] == 1 and not plain["norm_topk_prob"]
    assert ds["rope_parameters"]["rope_type"] == "yarn" and ds["rope_parameters"]["mscale"] != 1.0
    assert plain["attention_bias"] and plain["tie_word_embeddings"] and plain["first_k_dense_replace"] == 0
    assert kimi["model_type"] == "kimi_k2" and kimi["architectures"] == ["DeepseekV3ForCausalLM"]
    from safetensors import safe_open
    with safe_open(str(tiny_hf_checkpoint("deepseek_v3") / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.abs().max() > 0.1  # drawn, so the selection-only bias path is exercised
    oss, full = cfg["gpt_oss"], cfg["gpt_oss_full"]
    assert oss["layer_types"][:2] == ["sliding_attention", "full_attention"] and oss["sliding_window"] < 9
    assert full["layer_types"] == ["full_attention", "full_attention", "sliding_attention"]
    assert oss["head_dim"] != oss["hidden_size"] // oss["num_attention_heads"] and oss["swiglu_limit"] < 1
    assert oss["rope_parameters"]["rope_type"] == "yarn" and oss["rope_parameters"]["truncate"] is False
    assert cfg["mixtral_sliding"]["sliding_window"] and cfg["qwen3_moe_sliding"]["use_sliding_window"]


@pytest.mark.parametrize("name", ARCHS)
def test_verify_passes(tiny_hf_checkpoint, name):
    r = run_verify(tiny_hf_checkpoint(name), knobs=CHUNKY)
    assert r["architecture"] == FAMILY.get(name, name)
    assert len(r["layer_rel_errors"]) == r["num_layers"] + 1
    assert r["max_rel_error"] <= THRESHOLDS["max_rel_error"], r["layer_rel_errors"]
    assert r["loglik_rel_diff"] <= THRESHOLDS["loglik_rel_diff"], (r["loglik_engine"], r["loglik_reference"])
    assert r["greedy_match"], r["greedy"]
    assert r["greedy_matched"] == f"{len(r['greedy'])}/{len(r['greedy'])}"
    assert all(len(g["engine"]) == 16 for g in r["greedy"])  # no eos generated: every token compared
    assert r["passed"]


def test_verify_with_text_prompts(tiny_hf_checkpoint):
    r = run_verify(tiny_hf_checkpoint("mixtral"), prompts=["def wrap(self, text):", "import os\n"],
                   reference_text="class Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 8,
                   max_new_tokens=8)
    assert r["passed"], r
    assert r["greedy_matched"] == "2/2"


def test_verify_detects_a_swapped_expert(tiny_hf_checkpoint, monkeypatch):
    """A loader bug on the engine side (experts 0 and 1 of layer 1 swapped) must fail verify, and
    the per-layer errors must point at the layer. (Perturbing the checkpoint itself would change
    both sides alike, so the fault is injected into the engine's loading only.)"""
    import moectl.engine.models.loader as loader

    real = loader.read_state_dict

    def swapped(cfg, model_dir, **kw):
        sd = real(cfg, model_dir, **kw)
        order = [1, 0, *range(2, cfg.num_experts)]
        for key in ("layers.1.mlp.experts.w13", "layers.1.mlp.experts.w2"):
            sd[key] = sd[key][order]
        return sd

    monkeypatch.setattr(loader, "read_state_dict", swapped)
    r = run_verify(tiny_hf_checkpoint("mixtral"), max_new_tokens=4)
    done, total = map(int, r["expert_coverage"].split("/"))
    assert done == total  # the swapped experts did get tokens
    assert not r["passed"] and not r["checks"]["numerics"]
    assert r["max_rel_error"] > 100 * THRESHOLDS["max_rel_error"]
    errors = r["layer_rel_errors"]
    assert max(errors[:2]) <= THRESHOLDS["max_rel_error"] < errors[2]


@pytest.mark.parametrize("name", ["qwen3_moe_attn_bias", "olmoe_attn_bias"])
def test_verify_attention_bias(tiny_hf_checkpoint, name):
    r = run_verify(tiny_hf_checkpoint(name), max_new_tokens=4)
    assert r["max_rel_error"] <= THRESHOLDS["max_rel_error"], r["layer_rel_errors"]


@pytest.mark.parametrize("name", ARCHS)
def test_low_precision_close_to_fp32(tiny_hf_checkpoint, name):
    """bf16 and fp16 engines give finite logits close to the fp32 engine. The max error is not the
    measure here: one top-k routing near-tie flipped by rounding changes that token's output
    outright (transformers does the same), so per-token median error and the NLL are compared."""
    ids = torch.randint(0, 256, (160,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = {}
    for dtype in ("float32", "bfloat16", "float16"):
        engine = LLMEngine(EngineConfig(model=str(tiny_hf_checkpoint(name)), dtype=dtype, num_kv_blocks=12))
        logits[dtype] = engine.score(ids)
    ref = logits["float32"]
    for dtype in ("bfloat16", "float16"):
        out = logits[dtype]
        assert out.dtype == torch.float32 and out.isfinite().all(), dtype
        per_token = [rel_error(o, r) for o, r in zip(out, ref)]
        # measured medians: <= 0.035 (bf16), <= 0.03 (fp16, after an early flip); broken casts give O(1)
        assert torch.tensor(per_token).median() <= 0.1, (dtype, per_token)
        assert abs(mean_nll(out, ids) - mean_nll(ref, ids)) <= 0.01 * mean_nll(ref, ids), dtype


def test_same_generation_rule():
    assert _same_generation([5, 6, 7], [5, 6, 7], [], None)
    assert not _same_generation([5, 6, 7], [5, 6, 8], [], None)
    assert not _same_generation([5, 6], [5, 6, 7], [], None)  # shorter without an eos: a real mismatch
    assert _same_generation([5, 2], [5, 2, 9], [], [2])  # the reference also stops on a generation_config eos
    assert _same_generation([5, 2], [5, 2, 9], [2], None)
    assert not _same_generation([5, 2], [5, 3, 9], [2], None)


def test_missing_transformers_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(RuntimeError, match=r"verify needs transformers: pip install 'moectl\[reference\]'"):
        run_verify(tmp_path)
