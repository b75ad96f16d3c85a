"""Attention: projections, q/k norms and RoPE, then a context that knows where K/V live.

The module never touches K/V storage itself: `ctx.attend(layer, q, k, v, scale)` does. Two
contexts implement it: `DenseContext` here (a [B, T] batch with no cache, for training) and the
engine's `PagedContext` (moectl.engine.core.paged_attention: a flat token batch over a paged KV
cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moectl.engine.models.config import ModelConfig
from moectl.engine.models.layers import RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, layer_idx: int, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "per_head":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)
        self.clip_qkv = cfg.clip_qkv
        self.rope = rope
        self.scale = cfg.attention_scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:  # OLMoE clips after its norms
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        n = x.shape[0]
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        out = ctx.attend(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


def sdpa(q, k, v, scale, mask=None, causal=False):
    """q: [..., L, Hq, D] token-major; returns the same layout."""
    o = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                       attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o.transpose(-3, -2)


@dataclass
class DenseContext:
    """A padded-free [B, T] batch attended causally, with no cache (training)."""
    batch: int
    seq_len: int

    def attend(self, layer, q, k, v, scale, latent_keys: bool = False):
        shape = (self.batch, self.seq_len)
        k = torch.cat([v, k], dim=-1) if latent_keys else k  # MLA: see moectl.engine.models.mla
        o = sdpa(q.view(*shape, *q.shape[1:]), k.view(*shape, *k.shape[1:]),
                 v.view(*shape, *v.shape[1:]), scale, causal=True)
        return o.reshape(*q.shape[:-1], v.shape[-1])
