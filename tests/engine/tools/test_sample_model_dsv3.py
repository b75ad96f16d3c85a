"""The second shipped model, sample-dsv3 (engine/sample_model_dsv3: the seeds' DeepSeek-V3 class),
and the recipe's DeepSeek-V3 path: MLA, grouped sigmoid routing, a shared expert, a dense first
layer, and the auxiliary-loss-free balancing that trains each layer's correction bias."""

from __future__ import annotations

import json

import pytest
import torch

from moectl.engine import resolve_model, sample_model_dir
from moectl.engine.models.attention import DenseContext
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.loader import load_model
from moectl.engine.tools.train import train_sample_model, update_correction_bias

DSV3_DIR = sample_model_dir("sample-dsv3")
SIZE_LIMIT = 48_000_000
CODE = 'import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n'


@pytest.fixture(scope="module")
def dsv3():
    if not (DSV3_DIR / "model.safetensors").is_file():
        pytest.fail(f"sample-dsv3 is missing from {DSV3_DIR}")
    return load_model(DSV3_DIR, dtype="float32")


def test_sample_dsv3_is_the_seeds_class_within_48_mb():
    assert resolve_model("sample-dsv3") == DSV3_DIR
    files = [p for p in DSV3_DIR.iterdir() if p.is_file()]
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "training_stats.json"} <= \
        {p.name for p in files}
    assert sum(p.stat().st_size for p in files) <= SIZE_LIMIT
    raw = json.loads((DSV3_DIR / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"] and raw["q_lora_rank"]  # MLA with a q LoRA
    cfg = ModelConfig.from_hf(raw)
    assert cfg.router == "grouped_sigmoid" and cfg.n_group > 1 and cfg.shared_expert_intermediate_size > 0
    assert not cfg.sparse_layers[0] and all(cfg.sparse_layers[1:])  # a dense first layer
    assert 32 <= cfg.num_experts <= 64 and 4 <= cfg.top_k <= 8


def test_its_correction_bias_was_trained_not_left_at_zero(dsv3):
    stats = json.loads((DSV3_DIR / "training_stats.json").read_text())
    speed = stats["recipe"]["bias_update_speed"]
    for layer in dsv3.layers[1:]:
        bias = layer.mlp.e_score_correction_bias
        assert bias.abs().max() > 10 * speed and bias.std() > 0  # many steps' updates, not one value
    assert {"val_loss", "routing"} <= set(stats) and len(stats["routing"]["layers"]) == 3


def test_transformers_loads_it_and_agrees(dsv3):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(DSV3_DIR, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(DSV3_DIR)
    ids = torch.tensor([tok.bos_token_id] + tok(CODE)["input_ids"])
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
        got = dsv3.logits(dsv3(ids, torch.arange(len(ids)), DenseContext(1, len(ids))))
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-3


TINY_DSV3 = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=32, moe_intermediate_size=16,
                 n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, num_attention_heads=2,
                 num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=8, max_position_embeddings=64)


def test_the_deepseek_recipe_trains_the_bias_toward_balance(tmp_path):
    stats = train_sample_model(tmp_path / "m", arch="deepseek_v3", steps=4, seq_len=32, batch_size=2, warmup_steps=1,
                               vocab_size=300, model_overrides=TINY_DSV3, max_corpus_chars=50_000,
                               routing_prompts=2, sample_prompt="def f(", log=lambda line: None)
    assert stats["config"]["architectures"] == ["DeepseekV3ForCausalLM"] and stats["steps_done"] == 4
    model = load_model(tmp_path / "m", dtype="float32")
    bias = model.layers[1].mlp.e_score_correction_bias
    # four updates of +-1e-3 each (0 for an expert exactly at the mean): moved, by at most 4e-3
    assert 0 < bias.abs().max().item() <= 4e-3 + 1e-9
    # the rule itself: experts above the mean load go down, those below go up
    mlp = model.layers[1].mlp
    before = mlp.e_score_correction_bias.clone()
    mlp.last_counts = torch.tensor([10, 0, 0, 0, 0, 0, 0, 6])
    update_correction_bias(model, 0.5)
    moved = mlp.e_score_correction_bias - before
    assert moved[0] == -0.5 and moved[7] == -0.5 and (moved[1:7] == 0.5).all()
