"""The FLOPs a generation run needs, counted as the engine runs them: the roofline the benchmark
holds the engine's speed against.

Counted per token the engine computes (a prompt token, or an output token fed back; the last
output token is sampled, never fed back; prompt tokens the prefix cache served are not run):
every matmul of every layer it passes through, 2 FLOPs per weight element: the attention
projections (multi-head latent attention in the absorbed form: the key and value up-projections
applied per token, as many elements as kv_b_proj), the router, the top_k routed experts and the
shared expert, or the dense MLP. Per sampled row (one per output token): the LM head. Per
layer, the attention itself: each query against its keys (min(position + 1, window) of them on
a sliding-window layer), 2 FLOPs per element of the key and of the value read, per head.
Not counted: the embedding lookup (a gather, no matmul), norms, biases, activations, RoPE and
the sampler: elementwise work, no matmul.
"""

from __future__ import annotations

from collections.abc import Sequence


def layer_matmul_weights(cfg) -> list[int]:
    """Per layer, the weight elements one token's matmuls multiply."""
    h = cfg.hidden_size
    shared = 3 * h * cfg.shared_expert_intermediate_size
    shared += h if cfg.shared_expert_intermediate_size and cfg.shared_expert_gated else 0  # its gate
    out = []
    for sparse in cfg.sparse_layers:
        mlp = (h * cfg.num_experts + cfg.top_k * 3 * h * cfg.expert_intermediate_size + shared if sparse
               else 3 * h * cfg.dense_intermediate_size)
        out.append(cfg.attention_matmul_weights() + mlp)
    return out


def attention_flops_per_key(cfg) -> int:
    """FLOPs of one query against one key and its value, all heads."""
    if cfg.attention == "mla":  # absorbed: key [latent; rope key], value the latent
        return 2 * cfg.num_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * cfg.num_heads * cfg.kv_lora_rank
    return 4 * cfg.num_heads * cfg.head_dim


def _keys_read(tokens: int, window: int) -> int:
    """Keys the queries at positions 0..tokens-1 read: sum of min(i + 1, window) (0: no window)."""
    if not window or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def run_flops(cfg, prompt_lens: Sequence[int], output_lens: Sequence[int],
              cached: Sequence[int] | None = None) -> dict:
    """The FLOPs of generating output_lens[i] tokens after prompt_lens[i] (every output produced:
    EOS ignored), by part; cached[i]: request i's prompt tokens the prefix cache served (a prefix:
    their queries are not run, their keys are still read)."""
    cached = list(cached) if cached is not None else [0] * len(prompt_lens)
    runs = [(p + o - 1, c) for p, o, c in zip(prompt_lens, output_lens, cached, strict=True)]
    fed = sum(n - c for n, c in runs)
    windows = cfg.layer_windows or (0,) * cfg.num_layers
    attention = attention_flops_per_key(cfg) * sum(_keys_read(n, w) - _keys_read(c, w) for n, c in runs
                                                   for w in windows)
    rows = sum(output_lens)
    parts = {"layers_matmul": 2 * sum(layer_matmul_weights(cfg)) * fed,
             "lm_head": 2 * cfg.hidden_size * cfg.vocab_size * rows, "attention": attention}
    return {**parts, "total": sum(parts.values()), "tokens_run": fed, "sampled_rows": rows}
