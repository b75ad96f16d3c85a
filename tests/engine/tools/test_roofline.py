"""The roofline's FLOP count (engine/tools/roofline.py), worked by hand on the sample model, and
its matmul weights checked against the parameter count less what no matmul multiplies."""

from __future__ import annotations

import pytest

from moectl.engine import sample_model_dir
from moectl.engine.models.config import ModelConfig
from moectl.engine.tools.roofline import layer_matmul_weights, run_flops


def test_the_sample_models_run_by_hand():
    cfg = ModelConfig.from_dir(sample_model_dir())  # Mixtral-shaped: h 256, 4 heads of 64, 2 KV heads
    attention = 256 * (256 + 2 * 128) + 256 * 256  # q, k, v, o
    moe = 256 * 16 + 2 * 3 * 256 * 96  # the router, two of sixteen SwiGLU experts
    assert layer_matmul_weights(cfg) == [attention + moe] * 4
    # a 3-token prompt and 2 outputs: 4 tokens run (the last output is never fed back), 2 rows sampled
    flops = run_flops(cfg, [3], [2])
    assert flops["layers_matmul"] == 2 * 4 * (attention + moe) * 4
    assert flops["lm_head"] == 2 * 256 * 4096 * 2  # sampled rows only: no LM head on the prompt
    assert flops["attention"] == 4 * 4 * 64 * (1 + 2 + 3 + 4) * 4  # QK and AV per key, 4 layers
    assert flops["total"] == flops["layers_matmul"] + flops["lm_head"] + flops["attention"]
    # two prompt tokens from the prefix cache: their queries are not run, their keys are read
    cached = run_flops(cfg, [3], [2], cached=[2])
    assert cached["tokens_run"] == 2 and cached["attention"] == 4 * 4 * 64 * (3 + 4) * 4


@pytest.mark.parametrize("model", ["engine/sample_model", "engine/sample_model_dsv3"])
def test_matmul_weights_are_the_active_parameters_less_what_no_matmul_multiplies(model):
    cfg = ModelConfig.from_dir(model)
    h = cfg.hidden_size
    not_matmul = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h  # embedding, LM head, final norm
    for sparse in cfg.sparse_layers:
        not_matmul += 2 * h  # the layer's two norms
        if cfg.attention == "mla":
            not_matmul += (cfg.q_lora_rank or 0) + cfg.kv_lora_rank  # its latent norms
        if sparse and (cfg.router == "grouped_sigmoid" or cfg.router_bias):
            not_matmul += cfg.num_experts  # the router's bias
    # the LM head is counted apart, per sampled row
    assert sum(layer_matmul_weights(cfg)) == cfg.param_counts()["params_active"] - not_matmul
