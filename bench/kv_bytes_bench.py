"""KV bytes per token: MLA's latent against full per-head K/V, and the sliding window's bound.

    python bench/kv_bytes_bench.py [--json]

Part 1, from config.json alone (the engine's own KVCache layout, bf16): the seeds' 3T config and
DeepSeek-V3's published shape cache one latent of kv_lora_rank + qk_rope_head_dim values per token
and layer, against H x (qk_nope + qk_rope + v_head) if K and V were expanded per head.
Part 2, measured: a random gpt-oss-shaped checkpoint (2 sliding layers of window 32, 1 full)
generates one 2,000-token sequence; the KV bytes in use are sampled every step: the full layer
grows with the sequence, the sliding layers stay at their bound.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.models.loader import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
               "routed_scaling_factor": 2.5, "max_position_embeddings": 163840}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "dtype": "float32",
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def latent_vs_expanded(name: str, raw: dict) -> dict:
    cfg = ModelConfig.from_hf(raw, dtype="bfloat16")
    latent = KVCache.block_bytes_for(cfg, 1, False)
    expanded = cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim) * 2
    return {"model": name, "latent_bytes_per_token": latent, "expanded_bytes_per_token": expanded,
            "values_per_token_per_layer": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            "expanded_values_per_token_per_layer": cfg.num_heads * (cfg.head_dim + cfg.v_head_dim),
            "ratio": expanded / latent}


def window_bound(length: int = 2000) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = MoEForCausalLM(ModelConfig.from_hf(GPT_OSS))
        model.init_weights(std=0.1, seed=0)
        with torch.no_grad():
            for layer in model.layers:
                layer.attn.sinks.normal_()
        save_checkpoint(model, tmp)
        knobs = SchedulerKnobs(long_prefill_token_threshold=64, max_num_batched_tokens=64)
        engine = LLMEngine(EngineConfig(model=tmp, block_size=16, num_kv_blocks=256, knobs=knobs,
                                        enable_prefix_caching=False))
        engine.add_request(list(range(2, 66)), SamplingParams(max_tokens=length - 64, ignore_eos=True))
        main_bytes, window_bytes = engine.kv_block_bytes
        held, full = [], []
        while engine.has_unfinished():
            engine.step()
            for seq in engine.scheduler.running:
                held.append(len(engine.blocks.window.held(seq)))
                full.append(len(seq.block_table))
    window, bs, chunk = 32, 16, 64
    return {"tokens": length, "window": window, "block_size": bs, "chunk": chunk,
            "sliding_blocks_max": max(held), "sliding_blocks_bound": -(-(window - 1 + chunk) // bs) + 1,
            "sliding_blocks_steady": held[-1], "full_blocks_max": max(full),
            "sliding_bytes_max": max(held) * window_bytes, "full_bytes_max": max(full) * main_bytes,
            "sliding_bytes_if_unbounded": max(full) * window_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    k3 = json.loads((ROOT / "docs" / "configs" / "k3-3t-1m.json").read_text())
    result = {"mla": [latent_vs_expanded("k3-3t-1m", k3), latent_vs_expanded("DeepSeek-V3", DEEPSEEK_V3)],
              "window": window_bound()}
    if args.json:
        print(json.dumps(result))
        return
    for r in result["mla"]:
        print(f"{r['model']}: {r['values_per_token_per_layer']} latent values per token per layer vs "
              f"{r['expanded_values_per_token_per_layer']:,} expanded; {r['latent_bytes_per_token']:,} vs "
              f"{r['expanded_bytes_per_token']:,} bytes per token in bf16 ({r['ratio']:.1f}x smaller)")
    w = result["window"]
    print(f"window {w['window']}, {w['tokens']:,} tokens: sliding layers held at most {w['sliding_blocks_max']} blocks "
          f"(bound {w['sliding_blocks_bound']}, steady {w['sliding_blocks_steady']}), the full layer "
          f"{w['full_blocks_max']}; sliding KV {w['sliding_bytes_max']:,} bytes instead of "
          f"{w['sliding_bytes_if_unbounded']:,}")


if __name__ == "__main__":
    main()
