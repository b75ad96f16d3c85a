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

from moectl.engine.kernels.small_batch import Linear
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.layers import RMSNorm, RotaryEmbedding
from moectl.engine.models.numerics import KEY, NULL_WATCH, QUERY


class Attention(nn.Module):
    def __init__(self, layer_idx: int, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
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
        self.window = cfg.layer_windows[layer_idx]
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None
        self.watch = NULL_WATCH  # the numerics watch (MoEForCausalLM.set_watch)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        qkv = self.qkv(x)
        n = x.shape[0]
        if self.qk_norm == "none" and self.clip_qkv is None:
            # q and k as one [N, Hq + Hk, D] view of the projection: RoPE rotates both in one pass
            qk = self.rope.rotate(positions, qkv[:, :self.q_size + self.kv_size].view(n, -1, self.head_dim))
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
            if self.watch.enabled:
                self.watch.note(self.layer_idx, QUERY, q)
                self.watch.note(self.layer_idx, KEY, k)
            out = ctx.attend(self.layer_idx, q, k, v, self.scale, window=self.window, sinks=self.sinks)
            return self.o_proj(out.reshape(n, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:  # OLMoE clips after its norms
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        if self.watch.enabled:
            self.watch.note(self.layer_idx, QUERY, q)
            self.watch.note(self.layer_idx, KEY, k)
        out = ctx.attend(self.layer_idx, q, k, v, self.scale, window=self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(n, self.q_size))


def sdpa(q, k, v, scale, mask=None, causal=False, sinks=None):
    """q: [..., L, Hq, D] token-major; returns the same layout. mask: bool, True = attend.
    sinks: [Hq] logits that join every row's softmax without a value (gpt-oss), as one extra key
    every query sees: q gains a last value sink/scale, every key a last 0, and the sink key is
    (0, ..., 0, 1) with value 0, so its logit is the sink and it adds nothing to the output."""
    if sinks is not None:
        q, k, v, mask = _with_sink_key(q, k, v, scale, mask, causal, sinks)
        causal = False
    o = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                       attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o.transpose(-3, -2)


def _with_sink_key(q, k, v, scale, mask, causal, sinks):
    length, keys = q.shape[-3], k.shape[-3]
    if causal:  # top-left aligned, as SDPA's is_causal
        mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril()
    column = (sinks.to(q.dtype) / scale).expand(*q.shape[:-1]).unsqueeze(-1)
    q = torch.cat([q, column], dim=-1)
    sink_key = k.new_zeros(*k.shape[:-3], 1, k.shape[-2], k.shape[-1] + 1)
    sink_key[..., -1] = 1
    k = torch.cat([sink_key, F.pad(k, (0, 1))], dim=-3)
    v = torch.cat([v.new_zeros(*v.shape[:-3], 1, *v.shape[-2:]), v], dim=-3)
    if mask is not None:
        mask = F.pad(mask, (1, 0), value=True)
    return q, k, v, mask


def window_mask(query_positions: torch.Tensor, keys: int, window: int, key_start=None) -> torch.Tensor:
    """[L, keys] bool: query at absolute position p sees key positions j <= p (and j > p - window
    when window > 0), the rule of transformers' sliding_window_overlay. key_start: the absolute
    position of key 0 (a number, or one per query), when the keys begin later than position 0."""
    cols = torch.arange(keys, device=query_positions.device)[None, :]
    if key_start is not None:
        cols = cols + (key_start[:, None] if torch.is_tensor(key_start) else key_start)
    rows = query_positions[:, None]
    mask = cols <= rows
    return mask & (cols > rows - window) if window else mask


@dataclass
class DenseContext:
    """A padded-free [B, T] batch attended causally, with no cache (training)."""
    batch: int
    seq_len: int

    def attend(self, layer, q, k, v, scale, latent_keys: bool = False, window: int = 0, sinks=None):
        shape = (self.batch, self.seq_len)
        k = torch.cat([v, k], dim=-1) if latent_keys else k  # MLA: see moectl.engine.models.mla
        mask = window_mask(torch.arange(self.seq_len, device=q.device), self.seq_len, window) if window else None
        o = sdpa(q.view(*shape, *q.shape[1:]), k.view(*shape, *k.shape[1:]),
                 v.view(*shape, *v.shape[1:]), scale, mask=mask, causal=mask is None, sinks=sinks)
        return o.reshape(*q.shape[:-1], v.shape[-1])
