"""Tiny random checkpoints for the tests: one builder, `tiny_checkpoint`, two writers.

* tiny_checkpoint(dir): a Mixtral (TINY_MIXTRAL plus any overrides) written by the engine's own
  saver, with a small byte-level BPE tokenizer.json: no transformers needed.
* tiny_checkpoint(dir, "qwen2_moe") (any key of SPECS): written by transformers' own classes,
  so the loader and `verify` meet real Hugging Face files.

Every parameter is re-drawn from a seeded generator, including biases and norm weights (which
transformers initialises to 0 and 1), so a loader that drops or swaps one of them is caught.
Weights are large enough that logits and routing are decisive, not near-tied.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moectl.engine.models.attention import DenseContext

STD = 0.15
COMMON = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=STD)

# name -> (config class name, model class name, config kwargs, save kwargs)
SPECS = {
    # untied, with a trained BPE tokenizer.json; ids 0/1 are the tokenizer's <s> and </s>
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(COMMON, vocab_size=320, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
                     bos_token_id=0, eos_token_id=1, rope_theta=10000.0), {}),
    # shared expert with its sigmoid gate, qkv bias, tied embeddings, one dense (mlp_only) layer
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(COMMON, vocab_size=256, intermediate_size=40, moe_intermediate_size=24,
                       shared_expert_intermediate_size=36, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=None), {}),
    # head_dim 16 != hidden/heads 8, renormalised top-k, saved as a sharded index
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, vocab_size=256, head_dim=16, intermediate_size=40, moe_intermediate_size=24,
                       num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None), dict(max_shard_size="40KB")),
    # q/k full-width norms, clip_qkv active (small enough to bite), plain top-k weights
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(COMMON, vocab_size=256, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                   clip_qkv=1.5, norm_topk_prob=False, pad_token_id=None, bos_token_id=None, eos_token_id=None),
              {}),
    # the other OLMoE variants: no clipping, renormalised top-k, tied embeddings, MHA
    "olmoe_norm_topk": ("OlmoeConfig", "OlmoeForCausalLM",
                        dict(COMMON, num_key_value_heads=4, vocab_size=256, intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, clip_qkv=None, norm_topk_prob=True, tie_word_embeddings=True,
                             pad_token_id=None, bos_token_id=None, eos_token_id=None), {}),
    # MLA with a q LoRA, YaRN with mscale != mscale_all_dim, grouped sigmoid routing (4 groups, 2 kept),
    # two shared experts, one dense first layer; dv != dn and rms_norm_eps != the latent norms' 1e-6
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(COMMON, num_key_value_heads=4, vocab_size=256, intermediate_size=48, moe_intermediate_size=16,
                         n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12,
                         qk_rope_head_dim=8, v_head_dim=10, routed_scaling_factor=2.5, norm_topk_prob=True,
                         rope_theta=10000.0, rope_scaling=dict(type="yarn", factor=4.0,
                                                               original_max_position_embeddings=128, beta_fast=32,
                                                               beta_slow=1, mscale=0.707, mscale_all_dim=1.0),
                         bos_token_id=None, eos_token_id=None), {}),
    # a plain q_proj, default RoPE without interleaving, attention bias, no group step, plain top-k weights
    "deepseek_v3_plain": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                          dict(COMMON, num_key_value_heads=4, vocab_size=256, intermediate_size=40,
                               moe_intermediate_size=16, n_routed_experts=6, num_experts_per_tok=2, n_group=1,
                               topk_group=1, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=12,
                               q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=8,
                               rope_interleave=False, attention_bias=True, routed_scaling_factor=1.5,
                               norm_topk_prob=False, rope_theta=10000.0, tie_word_embeddings=True,
                               bos_token_id=None, eos_token_id=None), {}),
    # alternating sliding (window 3, shorter than the prompts) and full layers, sinks, router and expert
    # biases, a clamp small enough to bite, head_dim 16 != hidden/heads, YaRN without truncation
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(COMMON, vocab_size=256, intermediate_size=24, head_dim=16, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=3, swiglu_limit=0.5,
                     rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                          beta_slow=1.0, truncate=False, original_max_position_embeddings=128),
                     bos_token_id=None, eos_token_id=None, pad_token_id=None), {}),
    # every layer full but the last, MHA, default RoPE, tied embeddings, the default clamp
    "gpt_oss_full": ("GptOssConfig", "GptOssForCausalLM",
                     dict(COMMON, num_key_value_heads=4, vocab_size=256, intermediate_size=16, head_dim=8,
                          num_local_experts=6, num_experts_per_tok=3, sliding_window=5,
                          layer_types=["full_attention", "full_attention", "sliding_attention"],
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0), tie_word_embeddings=True,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None), {}),
    # Mixtral and Qwen3-MoE with sliding_window set: honoured on every layer
    "mixtral_sliding": ("MixtralConfig", "MixtralForCausalLM",
                        dict(COMMON, vocab_size=256, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=6, rope_theta=10000.0, bos_token_id=None, eos_token_id=None), {}),
    "qwen3_moe_sliding": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                          dict(COMMON, vocab_size=256, head_dim=8, intermediate_size=32, moe_intermediate_size=16,
                               num_experts=4, num_experts_per_tok=2, use_sliding_window=True, sliding_window=5,
                               bos_token_id=None, eos_token_id=None), {}),
}
# Kimi-K2: DeepSeek-V3's architecture and tensors under its own model_type (one group, as K2 has)
SPECS["kimi_k2"] = (*SPECS["deepseek_v3"][:2], dict(SPECS["deepseek_v3"][2], n_group=1, topk_group=1,
                                                     routed_scaling_factor=2.827, rope_theta=50000.0), {})
CONFIG_EDITS = {"kimi_k2": {"model_type": "kimi_k2"}}  # written into config.json after saving
# attention_bias on the architectures whose o_proj then has a bias too (see test_verify_attention_bias)
for _name in ("qwen3_moe", "olmoe"):
    _cfg, _model, _kwargs, _ = SPECS[_name]
    SPECS[_name + "_attn_bias"] = (_cfg, _model, dict(_kwargs, attention_bias=True), {})

TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 300, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "sliding_window": None, "dtype": "float32",
}

# a still smaller one: the loader and workload tests' default (tiny_engine_checkpoint)
SMALLER = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
               num_local_experts=4, max_position_embeddings=128)

TOKENIZER_TEXT = [
    "def parse_args(argv):\n    return argv[1:]\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i, end=' ')\n",
    "import os\nimport sys\nif __name__ == '__main__':\n    main()\n",
    "    def wrap(self, text):\n        return self._wrap_chunks(self._split_chunks(text))\n",
]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE (so any text encodes) with <s>=0 and </s>=1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer)
    assert tok.get_vocab_size() <= vocab_size
    return tok


def randomize_(model: torch.nn.Module, seed: int, std: float = STD) -> None:
    """Redraw every parameter: matrices N(0, std), biases N(0, std), norm weights 1 + N(0, 0.1);
    and DeepSeek-V3's routing correction bias N(0, 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are listed once
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(std * noise)
        # gpt-oss's sinks: large enough that the sink column takes a real share of each softmax
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
        # DeepSeek-V3's correction bias is a zero buffer: drawn large enough to change which experts win
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))


def tiny_checkpoint(out_dir: Path, name: str = "engine", *, seed: int = 0, std: float | None = None,
                    tokenizer: bool | None = None, **overrides) -> Path:
    """The tiny checkpoint `name` in out_dir: "engine" (TINY_MIXTRAL with `overrides`, saved by the
    engine; std 0.2 by default) or a key of SPECS (saved by transformers; std STD). tokenizer:
    write tokenizer.json (default: the engine's Mixtral and SPECS' "mixtral" have one)."""
    out_dir = Path(out_dir)
    if name == "engine":
        from moectl.engine.models.config import ModelConfig
        from moectl.engine.models.decoder import MoEForCausalLM
        from moectl.engine.models.loader import save_checkpoint

        raw = {**TINY_MIXTRAL, **overrides}
        model = MoEForCausalLM(ModelConfig.from_hf(raw))
        model.init_weights(std=0.2 if std is None else std, seed=seed)
        save_checkpoint(model, out_dir)
        vocab = raw["vocab_size"]
    else:
        import transformers

        config_cls, model_cls, kwargs, save_kwargs = SPECS[name]
        config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
        model = getattr(transformers, model_cls)(config).eval()
        randomize_(model, seed, STD if std is None else std)
        model.save_pretrained(out_dir, **save_kwargs)
        vocab = config.vocab_size
        if name in CONFIG_EDITS:
            path = out_dir / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **CONFIG_EDITS[name]}, indent=2))
    if tokenizer if tokenizer is not None else name in ("engine", "mixtral"):
        build_tokenizer(vocab).save(str(out_dir / "tokenizer.json"))
    return out_dir


def shard_checkpoint(model_dir: Path, num_shards: int = 3) -> list[Path]:
    """Re-save model.safetensors as `num_shards` files plus model.safetensors.index.json."""
    from safetensors.torch import load_file, save_file

    single = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(single))
    names = sorted(tensors)
    shards, weight_map = [], {}
    for i in range(num_shards):
        path = single.with_name(f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors")
        part = names[i::num_shards]
        save_file({n: tensors[n] for n in part}, str(path), metadata={"format": "pt"})
        weight_map.update({n: path.name for n in part})
        shards.append(path)
    (single.parent / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single.unlink()
    return shards


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each step: no cache, no batching."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            t = torch.tensor(ids)
            hidden = model(t, torch.arange(len(ids)), DenseContext(1, len(ids)))
            ids.append(int(model.logits(hidden[-1:]).argmax()))
    return ids[len(prompt):]


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    """n random token-id prompts with lengths in [lo, hi], reproducible from seed."""
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def overflow_checkpoint(out_dir: Path, residual: float = 4.0e4, added: float = 3.0e4) -> Path:
    """The tiny Mixtral (transformers' own classes) with a residual stream that outgrows fp16. Every
    token's embedding holds `residual` in dimension 0, which then dominates the normed input, so
    layer 0's values, and so its attention output, are about the same for every token; layer 0's
    output projection turns that into `added` in dimension 0 (its row 0 carries the attention
    output's signs). Each operator's output stays within fp16's 65,504, but the residual stream's
    sum, residual + added, does not: in pure fp16 it overflows at layer 0's attention, and a
    residual kept in fp32 (mixed precision) repairs it."""
    import json as _json

    from safetensors.torch import load_file, save_file

    out_dir = tiny_checkpoint(Path(out_dir), "mixtral")
    cfg = _json.loads((out_dir / "config.json").read_text())
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    path = out_dir / "model.safetensors"
    t = load_file(str(path))
    t["model.embed_tokens.weight"][:, 0] = residual
    # normed input ~ sqrt(hidden) * norm weight in dimension 0, ~0 elsewhere: v is one column of v_proj
    v = t["model.layers.0.self_attn.v_proj.weight"][:, 0] * hidden ** 0.5 * t["model.layers.0.input_layernorm.weight"][0]
    per_head = v.view(kv_heads, head_dim).repeat_interleave(heads // kv_heads, dim=0).reshape(-1)  # [q heads * D]
    t["model.layers.0.self_attn.o_proj.weight"][0] = per_head.sign() * (added / per_head.abs().sum())
    save_file(t, str(path), metadata={"format": "pt"})
    return out_dir
