"""Multi-head latent attention (DeepSeek-V3, Kimi-K2), in the absorbed form.

Each token's keys and values are compressed into one latent c (kv_lora_rank) plus one RoPE key k_pe
(qk_rope_head_dim) shared by every head; the KV cache holds only those two. Instead of expanding
c into per-head K/V through kv_b_proj, the per-head key projection W_UK is folded into the query
(q_nope . W_UK c = (W_UK^T q_nope) . c) and the value projection W_UV applied after attention, so
attention reads the cached latent directly: key [c; k_pe] (r + dr wide, one head), value c.
"""

from __future__ import annotations

import torch
from torch import nn

from moectl.engine.kernels.small_batch import Linear
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.layers import RMSNorm, RotaryEmbedding
from moectl.engine.models.numerics import KEY, NULL_WATCH, QUERY

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps


class MLAttention(nn.Module):
    def __init__(self, layer_idx: int, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        h, qk = cfg.hidden_size, cfg.head_dim
        bias = cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, cfg.num_heads * qk, bias=False)
        else:
            self.q_proj = Linear(h, cfg.num_heads * qk, bias=False)
        self.kv_a_proj = Linear(h, self.latent + self.rope_dim, bias=bias)
        self.kv_a_norm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.latent, cfg.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(cfg.num_heads * self.v_dim, h, bias=bias)
        self.rope = rope
        self.scale = cfg.attention_scale
        self.watch = NULL_WATCH  # the numerics watch (MoEForCausalLM.set_watch)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        n, heads = x.shape[0], self.num_heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(n, heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj(x).split([self.latent, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent)
        q_pe, k_pe = self.rope(positions, q_pe, k_pe[:, None])
        w_uk, w_uv = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.latent).split(
            [self.nope, self.v_dim], dim=1)
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        # the context caches k_pe as K and the latent as V, and attends with key [latent; k_pe], value latent
        q = torch.cat([q_latent, q_pe], dim=-1)
        if self.watch.enabled:
            self.watch.note(self.layer_idx, QUERY, q)
            self.watch.note(self.layer_idx, KEY, torch.cat([latent, k_pe[:, 0]], dim=-1))
        out_latent = ctx.attend(self.layer_idx, q, k_pe, latent[:, None], self.scale, latent_keys=True)
        out = torch.einsum("nhr,hvr->nhv", out_latent, w_uv)
        return self.o_proj(out.reshape(n, heads * self.v_dim))
