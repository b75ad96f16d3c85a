"""Attention over the paged KV cache: the context the engine hands the model for one step.

The model's Attention calls `ctx.attend(layer, q, k, v, scale)`; this context writes the step's
K/V into their cache slots and attends each row to its sequence's whole context: decodes in
groups of similar length (one padded batch each), prefill chunks one by one (causal within the
chunk, over everything cached before it). With latent_keys (MLA), K is the RoPE key and V the
latent, and the key attended is [V; K] (see moectl.engine.models.mla).

KV retention (core/retention.py) hands the context each sequence's held blocks only: a table
without the evicted ones, whose first_position is the tokens evicted, so a row's key count is its
context less what was evicted and the causal rule holds in held order. A scored policy asks for
attention mass: a prefill chunk's `observe` last queries and every decode row add, per held
block, the probability its keys drew (summed over layers and heads) into `mass`.

Sliding-window layers attend through `window`, a context of the same form over the window cache,
whose tables start at each sequence's first block still held (first_position(s) say where).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moectl.engine.core import paged_decode
from moectl.engine.models.attention import sdpa, window_mask

OBSERVE_KEYS = 1 << 15  # keys scored at once by a prefill chunk's observation window


@dataclass
class PrefillSlice:
    start: int  # token range of this sequence in the flat batch
    end: int
    cached_len: int  # tokens of this sequence already in the KV cache before this step
    block_table: torch.Tensor  # [num_blocks] int64
    first_position: int = 0  # absolute position of block_table[0]'s first slot (retention: tokens evicted)
    observe: int = 0  # KV retention: the last `observe` queries score the held blocks into `mass`
    mass: torch.Tensor | None = None  # [len(block_table)] fp32


@dataclass
class DecodeGroup:
    """Decode rows [start, end) whose contexts have similar lengths, attended as one padded batch
    (or, with `lens`, read in place by the paged decode kernel: then `blocks` is [rows, width])."""
    start: int
    end: int
    blocks: torch.Tensor  # [rows * width] int64: each row's block table, padded to `width` blocks
    width: int
    mask: torch.Tensor | None  # [rows, 1, 1, width * block_size] bool, None when no row is padded
    first_positions: torch.Tensor | None = None  # [rows]: absolute position of each row's first block
    lens: torch.Tensor | None = None  # [rows] int64: keys of each row from its table's first slot (kernel only)
    # the kernel's per-window first keys, and its checks of the rows against the cache's shape:
    # done by the step's first layer, shared by the rest (kernel only)
    lo: dict = field(default_factory=dict)
    checked_for: set = field(default_factory=set)
    mass: torch.Tensor | None = None  # KV retention: [rows, kv_heads, width] fp32 attention per table block


@dataclass
class PagedContext:
    """One engine step: decodes first (one token each), then prefill chunks."""
    cache: object  # a moectl.engine.core.kv_cache.KVCache
    slot_mapping: torch.Tensor  # [N] cache slot of every token in the batch
    num_decodes: int = 0
    decode_context_lens: torch.Tensor | None = None  # [B], including the new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # length-bucketed decodes
    prefills: list[PrefillSlice] = field(default_factory=list)
    window: PagedContext | None = None  # the sliding layers' cache and addressing, when the model has them

    def attend(self, layer, q, k, v, scale, latent_keys: bool = False, window: int = 0, sinks=None):
        """window > 0: each query sees only its last `window` positions; sinks: gpt-oss's per-head
        sink logits (see models.attention.sdpa)."""
        cache = self.cache
        if cache.local_layer is not None:
            if layer in cache.sliding:
                return self.window._attend(cache.local_layer[layer], q, k, v, scale, latent_keys, window, sinks)
            layer = cache.local_layer[layer]
        return self._attend(layer, q, k, v, scale, latent_keys, window, sinks)

    def _attend(self, layer, q, k, v, scale, latent_keys, window, sinks):
        self.cache.write(layer, self.slot_mapping, k, v)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        for g in self.decode_groups:
            if g.lens is not None:
                lo = g.lo.get(window)
                if lo is None:  # a decode at relative position n - 1 sees keys [n - window, n) of its table
                    lo = g.lo[window] = (g.lens - window).clamp_(min=0) if window else torch.zeros_like(g.lens)
                k_cache = self.cache.k[layer]
                shape = (window, k_cache.shape[:2])
                out[g.start:g.end] = paged_decode.decode(q[g.start:g.end], k_cache, self.cache.v[layer], g.blocks,
                                                         g.lens, lo, scale, sinks, latent_keys,
                                                         checked=shape in g.checked_for, mass=g.mass)
                g.checked_for.add(shape)  # the call returned: its checks passed
                continue
            keys, values = self.cache.gather_blocks(layer, g.blocks, g.end - g.start, g.width, q.dtype)
            keys = torch.cat([values, keys], dim=-1) if latent_keys else keys
            mask = g.mask
            if window:  # a decode's query sits at position len - 1
                lens = self.decode_context_lens[g.start:g.end]
                mask = window_mask(lens - 1, keys.shape[1], window, g.first_positions)[:, None, None, :]
            out[g.start:g.end] = sdpa(q[g.start:g.end, None], keys, values, scale, mask=mask, sinks=sinks)[:, 0]
            if g.mass is not None:
                weights = attention_weights(q[g.start:g.end, None], keys, scale, mask)  # [rows, 1, keys]
                g.mass[:, 0] += weights[:, 0].view(g.end - g.start, g.width, -1).sum(-1)
        bs = self.cache.block_size
        for p in self.prefills:
            # 4-D [1, L, H, D] inputs: the CPU flash kernel takes them; 3-D ones fall back to the math path
            qs = q[None, p.start:p.end]
            n = p.end - p.start
            if p.cached_len == 0:
                ks, vs = k[None, p.start:p.end], v[None, p.start:p.end]
                ks = torch.cat([vs, ks], dim=-1) if latent_keys else ks
                mask = window_mask(torch.arange(n, device=q.device), n, window)[None, None] if window else None
                out[p.start:p.end] = sdpa(qs, ks, vs, scale, mask=mask, causal=mask is None, sinks=sinks)[0]
                if p.observe:
                    self._observe(p, qs[0], ks[0], scale, n)
                continue
            # this chunk's K/V are already written: read the context back from the cache (from the
            # first block still held, in the window cache)
            total = p.cached_len + n - p.first_position
            nblocks = -(-total // bs)
            ks, vs = self.cache.gather_blocks(layer, p.block_table[:nblocks], 1, nblocks, q.dtype)
            ks = torch.cat([vs, ks], dim=-1) if latent_keys else ks
            mask = window_mask(torch.arange(n, device=q.device) + p.cached_len, total, window, p.first_position)
            out[p.start:p.end] = sdpa(qs, ks[:, :total], vs[:, :total], scale, mask=mask[None, None], sinks=sinks)[0]
            if p.observe:
                self._observe(p, qs[0], ks[0, :total], scale, total)
        return out

    def _observe(self, p: PrefillSlice, q: torch.Tensor, keys: torch.Tensor, scale: float, total: int) -> None:
        """Add the attention mass the chunk's last p.observe queries give each held block (the
        queries are the last rows of q, at held positions total - observe .. total - 1). Keys are
        taken OBSERVE_KEYS at a time, the softmax's normaliser first, so a million-token context
        never holds [heads, rows, keys] logits at once."""
        rows = min(p.observe, q.shape[0])
        dev = q.device
        query_pos = torch.arange(total - rows, total, device=dev)[:, None]
        qo = q[None, -rows:]

        def logits(a: int, b: int) -> torch.Tensor:  # [heads, rows, b - a], masked
            out = attention_logits(qo, keys[None, a:b], scale)[0]
            return out.masked_fill_(torch.arange(a, b, device=dev)[None, :] > query_pos, float("-inf"))

        spans = [(a, min(a + OBSERVE_KEYS, total)) for a in range(0, total, OBSERVE_KEYS)]
        norm = torch.stack([logits(a, b).logsumexp(-1) for a, b in spans]).logsumexp(0)  # [heads, rows]
        per_key = torch.cat([(logits(a, b) - norm[..., None]).exp_().sum((0, 1)) for a, b in spans])
        bs = self.cache.block_size
        nblocks = -(-total // bs)
        p.mass[:nblocks] += torch.nn.functional.pad(per_key, (0, nblocks * bs - total)).view(nblocks, bs).sum(-1)


def attention_logits(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, L, Hq, D], keys [B, T, Hk, D] (Hq a multiple of Hk) -> scaled logits [B, Hq, L, T] fp32."""
    b, length, hq, d = q.shape
    hk = keys.shape[2]
    logits = torch.einsum("blhgd,bthd->bhglt", q.float().view(b, length, hk, hq // hk, d), keys.float())
    return logits.mul_(scale).view(b, hq, length, -1)


def attention_weights(q: torch.Tensor, keys: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention probabilities summed over query heads; mask broadcastable to [B, 1, L, T]
    (True: seen) -> [B, L, T] fp32."""
    logits = attention_logits(q, keys, scale)
    if mask is not None:
        logits = logits.masked_fill(~mask.view(mask.shape[0], 1, *mask.shape[-2:]), float("-inf"))
    return logits.softmax(-1).nan_to_num_(0.0).sum(1)


def split_context(ctx: PagedContext, at: int) -> tuple[PagedContext, PagedContext]:
    """The step's tokens [0, at) and [at, N) as two contexts over the same cache (two micro-batches).
    A decode group or a prefill chunk that straddles `at` is split too: the second part of a chunk
    reads the first part's K/V from the cache, so its micro-batch must run each layer's attention
    after the first's (yield_points.interleave keeps the first one stage ahead)."""
    n = ctx.slot_mapping.numel()
    if not 0 < at < n:
        raise ValueError(f"split_context: {at} must be inside the step's {n} tokens")
    first, second = _split_view(ctx, at)
    if ctx.window is not None:
        first.window, second.window = _split_view(ctx.window, at)
    return first, second


def _split_view(ctx: PagedContext, at: int) -> tuple[PagedContext, PagedContext]:
    b = ctx.num_decodes
    head_rows = min(at, b)
    lens = ctx.decode_context_lens
    first = PagedContext(ctx.cache, ctx.slot_mapping[:at], head_rows,
                         lens[:head_rows] if lens is not None and head_rows else None)
    second = PagedContext(ctx.cache, ctx.slot_mapping[at:], b - head_rows,
                          lens[head_rows:] if lens is not None and b > head_rows else None)
    for g in ctx.decode_groups:
        if g.end <= at:
            first.decode_groups.append(_rows_of(g, g.start, g.end, 0))
        elif g.start >= at:
            second.decode_groups.append(_rows_of(g, g.start, g.end, at))
        else:
            first.decode_groups.append(_rows_of(g, g.start, at, 0))
            second.decode_groups.append(_rows_of(g, at, g.end, at))
    for p in ctx.prefills:
        if p.end <= at:
            first.prefills.append(p)
        elif p.start >= at:
            second.prefills.append(PrefillSlice(p.start - at, p.end - at, p.cached_len, p.block_table, p.first_position,
                                                p.observe, p.mass))
        else:  # the chunk's last queries are in the second part: retention observes those there
            first.prefills.append(PrefillSlice(p.start, at, p.cached_len, p.block_table, p.first_position))
            second.prefills.append(PrefillSlice(0, p.end - at, p.cached_len + at - p.start, p.block_table,
                                                p.first_position, p.observe, p.mass))
    return first, second


def _rows_of(g: DecodeGroup, start: int, end: int, shift: int) -> DecodeGroup:
    """Rows [start, end) of decode group g, renumbered from `shift`."""
    lo, hi = start - g.start, end - g.start
    rows = g.end - g.start

    def cut(t):
        return None if t is None else t[lo:hi]

    blocks = g.blocks[lo:hi] if g.blocks.dim() == 2 else g.blocks.view(rows, g.width)[lo:hi].reshape(-1)
    return DecodeGroup(start - shift, end - shift, blocks, g.width, cut(g.mask), cut(g.first_positions), cut(g.lens),
                       mass=cut(g.mass))
