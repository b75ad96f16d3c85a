"""DeepSeek-V3 / Kimi-K2 in the engine: the latent KV cache, prefix reuse and INT8 on it, YaRN, and
the config errors. (Numerics against transformers: tests/engine/tools/test_verify.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import ConfigError, ModelConfig, RopeScaling
from moectl.engine.models.layers import rope_inv_freq
from tests.checkpoints import prompts, reference_greedy

pytestmark = pytest.mark.usefixtures("single_thread")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=16, num_kv_blocks=64, **kw))


def _prompts(shared: int = 40) -> list[list[int]]:
    ps = [[t % 256 for t in p] for p in prompts(4, seed=3, lo=20, hi=60)]
    return [ps[0][:shared] + p[:10] for p in ps]  # a shared prefix of more than two blocks


def test_cache_holds_one_latent_per_token(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("deepseek_v3")
    cfg = ModelConfig.from_dir(path)
    engine = _engine(path)
    r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert engine.kv_cache.k.shape[-2:] == (1, dr) and engine.kv_cache.v.shape[-2:] == (1, r)
    per_token = KVCache.block_bytes_for(cfg, 1, False)
    assert per_token == cfg.num_layers * (r + dr) * 4
    expanded = cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim) * 4  # full per-head K and V
    assert per_token < expanded
    assert engine.kv_cache.nbytes() == 64 * KVCache.block_bytes_for(cfg, 16, False)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_plain"])
def test_paged_chunked_and_prefix_reused_decoding_match_the_dense_forward(tiny_hf_checkpoint, name):
    """The paged path (chunked prefill, decodes grouped by length, prefix blocks reused from the
    cache) gives the tokens of recomputing the whole sequence densely every step."""
    path = tiny_hf_checkpoint(name)
    chunky = SchedulerKnobs(long_prefill_token_threshold=8, max_num_batched_tokens=24)
    engine = _engine(path, enable_prefix_caching=True, knobs=chunky)
    batch = _prompts()
    first = [o.token_ids for o in engine.generate(batch, GREEDY)]
    again = [o.token_ids for o in engine.generate(batch, GREEDY)]
    assert engine.blocks.prefix_hits > 0
    expected = [reference_greedy(engine.model, p, GREEDY.max_tokens) for p in batch]
    assert first == expected and again == expected


def test_int8_latent_cache_keeps_the_greedy_tokens(tiny_hf_checkpoint):
    """INT8 quantises the latent (V) and the RoPE key (K) with separate scales per block: their
    magnitudes differ, so one shared scale would cost the smaller one its resolution."""
    path = tiny_hf_checkpoint("deepseek_v3")
    batch = _prompts()
    exact = [o.token_ids for o in _engine(path).generate(batch, GREEDY)]
    engine = _engine(path, kv_cache_dtype="int8")
    quantized = [o.token_ids for o in engine.generate(batch, GREEDY)]
    assert engine.kv_cache.k.dtype == torch.int8 and engine.kv_cache.k_scale.shape[-1] == 1
    agree = sum(a == b for x, y in zip(exact, quantized) for a, b in zip(x, y))
    assert agree >= 0.9 * sum(len(x) for x in exact), (exact, quantized)
    cfg = engine.model_config
    assert KVCache.block_bytes_for(cfg, 16, True) < KVCache.block_bytes_for(cfg, 16, False) / 3


@pytest.mark.parametrize("spec", [
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32, beta_slow=1,
         mscale=0.707, mscale_all_dim=1.0),
    dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False),
    dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=16, beta_slow=2,
         attention_factor=0.9),
])
def test_yarn_frequencies_match_transformers(spec):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.DeepseekV3Config(qk_rope_head_dim=16, max_position_embeddings=int(spec["factor"] * 4096),
                                       rope_parameters=dict(spec, rope_theta=50000.0))
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    raw = {"rope_parameters": dict(spec), "max_position_embeddings": hf.max_position_embeddings}
    from moectl.engine.models.config import _rope_scaling

    ours, our_factor = rope_inv_freq(16, 50000.0, _rope_scaling(raw))
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert math.isclose(our_factor, their_factor, rel_tol=1e-9)


def test_mla_softmax_scale_takes_the_yarn_mscale(tiny_hf_checkpoint):
    cfg = ModelConfig.from_dir(tiny_hf_checkpoint("deepseek_v3"))
    expected = (12 + 8) ** -0.5 * RopeScaling.yarn_mscale(4.0, 1.0) ** 2
    assert math.isclose(cfg.attention_scale, expected)
    assert cfg.rope_scaling.kind == "yarn" and cfg.rope_dim == 8 and cfg.head_dim == 20


def _ds_raw(tiny_hf_checkpoint) -> dict:
    return json.loads((tiny_hf_checkpoint("deepseek_v3") / "config.json").read_text())


@pytest.mark.parametrize("edit, field", [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 5}, "topk_group"),
    ({"topk_group": 1, "num_experts_per_tok": 3}, "topk_group"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"first_k_dense_replace": 3}, "first_k_dense_replace"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"routed_scaling_factor": None}, "routed_scaling_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 64}},
     "rope_parameters.factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": "4",
                          "original_max_position_embeddings": 64}}, "rope_parameters.factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
])
def test_bad_deepseek_configs_name_the_field(tiny_hf_checkpoint, edit, field):
    raw = {**_ds_raw(tiny_hf_checkpoint), **edit}
    raw.pop("rope_scaling", None)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf(raw)
    assert str(err.value).startswith(field + ":"), str(err.value)


def test_mtp_layers_are_skipped_and_other_extra_tensors_refused(tiny_hf_checkpoint, tmp_path):
    """Real V3 files carry the multi-token-prediction layer as model.layers.{num_hidden_layers}:
    the engine loads without it; an unknown tensor inside the model's own layers is still refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moectl.engine.models.loader import CheckpointError, load_model

    src = tiny_hf_checkpoint("deepseek_v3")
    for extra, ok in (("model.layers.3.eh_proj.weight", True), ("model.layers.1.mlp.extra.weight", False)):
        out = tmp_path / extra.replace(".", "_")
        shutil.copytree(src, out)
        tensors = load_file(str(out / "model.safetensors"))
        tensors[extra] = torch.zeros(4, 4)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        if ok:
            assert load_model(out).cfg.num_layers == 3
        else:
            with pytest.raises(CheckpointError, match="model.layers.1.mlp.extra.weight"):
                load_model(out)


def test_router_stays_fp32_in_bf16(tiny_hf_checkpoint):
    from moectl.engine.models.loader import load_model

    model = load_model(tiny_hf_checkpoint("deepseek_v3"), dtype="bfloat16")
    mlp = model.layers[1].mlp
    assert mlp.gate.dtype == torch.float32 and mlp.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].attn.kv_b_proj.weight.dtype == torch.bfloat16


def test_engine_saver_round_trips_the_deepseek_layout(tiny_hf_checkpoint, tmp_path):
    """save_checkpoint writes what read_state_dict reads back, interleaved RoPE rows included."""
    from moectl.engine.models.loader import load_model, save_checkpoint

    model = load_model(tiny_hf_checkpoint("deepseek_v3"))
    save_checkpoint(model, tmp_path / "copy")
    from safetensors import safe_open

    names = lambda p: set(safe_open(str(p / "model.safetensors"), "pt").keys())  # noqa: E731
    assert names(tmp_path / "copy") == names(tiny_hf_checkpoint("deepseek_v3"))
    again = load_model(tmp_path / "copy")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
