"""Attention: projections, q/k norms and RoPE, then a context that knows where K/V live.

Two contexts share the same module: `DenseContext` (a [B, T] batch with no cache, used for
training) and `PagedContext` (the engine's flat token batch over a paged KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding


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
        self.scale = cfg.head_dim ** -0.5

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


def _sdpa(q, k, v, scale, mask=None, causal=False):
    """q: [..., L, Hq, D] token-major; returns the same layout."""
    o = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                       attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o.transpose(-3, -2)


@dataclass
class DenseContext:
    """A padded-free [B, T] batch attended causally, with no cache (training)."""
    batch: int
    seq_len: int

    def attend(self, layer, q, k, v, scale):
        shape = (self.batch, self.seq_len)
        o = _sdpa(q.view(*shape, *q.shape[1:]), k.view(*shape, *k.shape[1:]),
                  v.view(*shape, *v.shape[1:]), scale, causal=True)
        return o.reshape(q.shape)


@dataclass
class PrefillSlice:
    start: int  # token range of this sequence in the flat batch
    end: int
    cached_len: int  # tokens of this sequence already in the KV cache before this step
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass
class DecodeGroup:
    """Decode rows [start, end) whose contexts have similar lengths, attended as one padded batch."""
    start: int
    end: int
    blocks: torch.Tensor  # [rows * width] int64: each row's block table, padded to `width` blocks
    width: int
    mask: torch.Tensor | None  # [rows, 1, 1, width * block_size] bool, None when no row is padded


@dataclass
class PagedContext:
    """One engine step: decodes first (one token each), then prefill chunks."""
    cache: "object"  # engine.kv_cache.KVCache
    slot_mapping: torch.Tensor  # [N] cache slot of every token in the batch
    num_decodes: int = 0
    decode_context_lens: torch.Tensor | None = None  # [B], including the new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # length-bucketed decodes
    prefills: list[PrefillSlice] = field(default_factory=list)

    def attend(self, layer, q, k, v, scale):
        self.cache.write(layer, self.slot_mapping, k, v)
        out = torch.empty_like(q)
        for g in self.decode_groups:
            keys, values = self.cache.gather_blocks(layer, g.blocks, g.end - g.start, g.width, q.dtype)
            out[g.start:g.end] = _sdpa(q[g.start:g.end, None], keys, values, scale, mask=g.mask)[:, 0]
        bs = self.cache.block_size
        for p in self.prefills:
            # 4-D [1, L, H, D] inputs: the CPU flash kernel takes them; 3-D ones fall back to the math path
            qs = q[None, p.start:p.end]
            if p.cached_len == 0:
                out[p.start:p.end] = _sdpa(qs, k[None, p.start:p.end], v[None, p.start:p.end], scale, causal=True)[0]
                continue
            # this chunk's K/V are already written: read the whole context back from the cache
            n = p.end - p.start
            total = p.cached_len + n
            nblocks = -(-total // bs)
            ks, vs = self.cache.gather_blocks(layer, p.block_table[:nblocks], 1, nblocks, q.dtype)
            rows = torch.arange(n, device=q.device)[:, None] + p.cached_len
            mask = torch.arange(total, device=q.device)[None, :] <= rows
            out[p.start:p.end] = _sdpa(qs, ks[:, :total], vs[:, :total], scale, mask=mask[None, None])[0]
        return out
