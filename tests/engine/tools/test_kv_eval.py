"""`moectl bench --suite kv-int8` (engine/tools/kv_eval.py): INT8 KV's bytes and its accuracy
cost, measured against the model-dtype cache on the same model and tokens."""

from __future__ import annotations

import pytest

from moectl.engine.core.kv_cache import KVCache
from moectl.engine.models.config import ModelConfig
from moectl.engine.tools.kv_eval import default_eval_inputs, run_kv_int8_eval

TEXT_TOKENS, PROMPTS, PROMPT_TOKENS, MAX_TOKENS = 48, 2, 8, 4


@pytest.fixture(scope="module")
def evaluation(tiny_engine_checkpoint, single_thread):
    text, prompts = default_eval_inputs(tiny_engine_checkpoint, text_tokens=TEXT_TOKENS, num_prompts=PROMPTS,
                                        prompt_tokens=PROMPT_TOKENS)
    lines = []
    result = run_kv_int8_eval(str(tiny_engine_checkpoint), text, prompts, max_tokens=MAX_TOKENS, dtype="float32",
                              log=lines.append)
    return result, lines, text, prompts


def test_without_a_tokenizer_the_inputs_are_seeded_ids_in_the_vocabulary(tiny_engine_checkpoint, evaluation):
    _, _, text, prompts = evaluation
    vocab = ModelConfig.from_dir(tiny_engine_checkpoint).vocab_size
    assert len(text) == TEXT_TOKENS and [len(p) for p in prompts] == [PROMPT_TOKENS] * PROMPTS
    assert all(0 <= t < vocab for t in text + sum(prompts, []))
    again = default_eval_inputs(tiny_engine_checkpoint, text_tokens=TEXT_TOKENS, num_prompts=PROMPTS,
                                prompt_tokens=PROMPT_TOKENS)
    assert again == (text, prompts)  # the same inputs every run: results compare across runs


def test_int8_blocks_are_priced_against_the_model_dtype_and_bf16(tiny_engine_checkpoint, evaluation):
    result, lines, _, _ = evaluation
    cfg = ModelConfig.from_dir(tiny_engine_checkpoint)
    assert result["model_dtype"] == "float32"
    assert result["bytes_per_block_int8"] == KVCache.block_bytes_for(cfg, 16, True)
    assert result["bytes_per_block_model_dtype"] == KVCache.block_bytes_for(cfg, 16, False)
    assert result["memory_ratio"] == result["bytes_per_block_int8"] / result["bytes_per_block_model_dtype"] < 0.5
    assert result["memory_ratio"] < result["memory_ratio_vs_bf16"] < 1
    assert lines[0].startswith(f"INT8 KV: {result['memory_ratio']:.2f}x the bytes of float32 KV")


def test_the_accuracy_cost_is_measured_on_a_really_quantised_cache(evaluation):
    result, lines, _, _ = evaluation
    assert result["tokens_scored"] == TEXT_TOKENS
    # a cache left in float32 would score identically: the error is the quantisation's, bounded but there
    assert 0 < result["logits_max_rel_error"] < 0.5
    assert result["nll_rel_diff"] == pytest.approx(abs(result["nll_int8"] - result["nll_model_dtype"])
                                                   / result["nll_model_dtype"])
    assert 0.5 <= result["top1_agreement"] <= 1 and 0 <= result["greedy_prefix_agreement"] <= 1
    assert "top-1 agreement" in lines[1]
