"""KV-cache storage: one [layers, blocks, block_size, kv_heads, width] tensor each for K and V.

K and V may differ in width: MLA caches its RoPE key (qk_rope_head_dim) as K and its latent
(kv_lora_rank) as V, with one "head" shared by all query heads.

A model with sliding-window layers keeps them in a second cache, `window`, with blocks of its
own (released as they slide out: window_blocks.py); `local_layer` maps a model layer to its
index in whichever cache holds it.

With kv_dtype="int8" the values are stored as int8 with one fp32 scale per (block, head):
symmetric absmax quantisation. When a write raises a block's absmax, the block is re-quantised
with the new scale; each such rise can add up to half a step of rounding error to the tokens
already in the block, so the error grows with the number of rises while a block fills (at most
block_size - 1). The measured cost is what `moectl bench --suite kv-int8` reports.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, quantized: bool = False, device="cpu", v_head_dim: int | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.quantized = quantized
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        store = torch.int8 if quantized else dtype
        # zeros, then written: a zeroed allocation is mapped lazily, so without the fill the
        # process would grow as blocks are first used and look like a leak in the memory curves
        self.window: KVCache | None = None
        self.sliding: frozenset[int] = frozenset()
        self.local_layer: list[int] | None = None
        self.k = torch.zeros(shape, dtype=store, device=device).fill_(0)
        self.v = torch.zeros((*shape[:-1], v_head_dim or head_dim), dtype=store, device=device).fill_(0)
        if quantized:
            self.k_scale = torch.ones(num_layers, num_blocks, num_kv_heads, dtype=torch.float32, device=device)
            self.v_scale = torch.ones_like(self.k_scale)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, quantized: bool, v_head_dim: int | None = None) -> int:
        elem = 1 if quantized else torch.empty((), dtype=dtype).element_size()
        data = num_layers * block_size * num_kv_heads * (head_dim + (v_head_dim or head_dim)) * elem
        scales = 2 * num_layers * num_kv_heads * 4 if quantized else 0
        return data + scales

    @classmethod
    def for_model(cls, cfg, num_blocks: int, block_size: int, quantized: bool, device="cpu",
                  kv_heads: int | None = None, window_blocks: int = 0) -> KVCache:
        """The cache a ModelConfig's layers write (`ModelConfig.kv_entry`); kv_heads: this process's
        share; window_blocks: blocks of the sliding layers' cache (when the model has any)."""
        heads, k_width, v_width = cfg.kv_entry(kv_heads)
        sliding = [i for i, w in enumerate(cfg.layer_windows) if w]
        full = cfg.num_layers - len(sliding)
        cache = cls(full, num_blocks, block_size, heads, k_width, cfg.dtype, quantized, device, v_width)
        if sliding:
            cache.window = cls(len(sliding), window_blocks, block_size, heads, k_width, cfg.dtype, quantized, device,
                               v_width)
            cache.sliding = frozenset(sliding)
            counters = {True: 0, False: 0}
            cache.local_layer = []
            for w in cfg.layer_windows:
                cache.local_layer.append(counters[bool(w)])
                counters[bool(w)] += 1
        return cache

    @staticmethod
    def block_bytes_for(cfg, block_size: int, quantized: bool, kv_heads: int | None = None,
                        dtype: torch.dtype | None = None, layers: int | None = None) -> int:
        """One block of all layers (or of `layers` of them)."""
        heads, k_width, v_width = cfg.kv_entry(kv_heads)
        return KVCache.bytes_per_block(cfg.num_layers if layers is None else layers, block_size, heads, k_width,
                                       dtype or cfg.dtype, quantized, v_width)

    @staticmethod
    def pool_sizes_for(cfg, block_size: int, quantized: bool, memory: int, num_blocks: int | None, knobs,
                       kv_heads: int | None = None) -> tuple[int, int]:
        """(blocks of the full-attention pool, blocks of the sliding-window pool) for a memory budget
        (or a given block count). The window pool holds what max_num_seqs sequences can need at once:
        each reads back at most window - 1 positions and writes at most one chunk of
        max_num_batched_tokens, so it stays that size however long the contexts grow."""
        windows = [w for w in cfg.layer_windows if w]
        full = KVCache.block_bytes_for(cfg, block_size, quantized, kv_heads, layers=cfg.num_layers - len(windows))
        if not windows:
            return num_blocks or max(1, memory // full), 0
        win = KVCache.block_bytes_for(cfg, block_size, quantized, kv_heads, layers=len(windows))
        cap = knobs.max_num_seqs * KVCache.window_blocks_per_sequence(max(windows), block_size,
                                                                      knobs.max_num_batched_tokens)
        if num_blocks:
            return num_blocks, min(num_blocks, cap)
        if not full:  # every layer slides: the main pool only tracks positions and costs nothing
            window_blocks = min(max(1, memory // win), cap)
            return min(1 << 20, knobs.max_num_seqs * -(-cfg.max_position_embeddings // block_size)), window_blocks
        even = max(1, memory // (full + win))
        if even <= cap:  # the window pool as large as the main one: whatever the main pool admits fits
            return even, even
        return max(1, (memory - cap * win) // full), cap

    @staticmethod
    def window_blocks_per_sequence(window: int, block_size: int, chunk: int) -> int:
        """The most sliding-window blocks one sequence holds: the window - 1 positions before its
        chunk, and one chunk of at most `chunk` tokens (max_num_batched_tokens), over block boundaries."""
        return -(-(window - 1 + chunk) // block_size) + 1

    def nbytes(self, with_window: bool = True) -> int:
        n = self.k.nbytes + self.v.nbytes
        if self.quantized:
            n += self.k_scale.nbytes + self.v_scale.nbytes
        if with_window and self.window is not None:
            n += self.window.nbytes()
        return n

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim] for the cache slots `slots` ([N])."""
        if not self.quantized:
            self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
            self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)
            return
        self._write_quantized(self.k[layer], self.k_scale[layer], slots, k)
        self._write_quantized(self.v[layer], self.v_scale[layer], slots, v)

    def _write_quantized(self, data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, new: torch.Tensor):
        bs = self.block_size
        blocks = slots // bs
        touched, local = torch.unique(blocks, return_inverse=True)
        current = data[touched].float() * scale[touched][:, None, :, None]  # [T, bs, H, D]
        # a write at offset 0 starts the block afresh: stale values from a previous owner must
        # not inflate the new scale
        restart = torch.zeros(len(touched), dtype=torch.bool, device=slots.device)
        restart[local[slots % bs == 0]] = True
        current[restart] = 0
        current[local, slots % bs] = new.float()
        new_scale = current.abs().amax(dim=(1, 3)).clamp_min(1e-8) / 127.0  # [T, H]
        data[touched] = torch.round(current / new_scale[:, None, :, None]).clamp_(-127, 127).to(torch.int8)
        scale[touched] = new_scale

    def gather(self, layer: int, block_tables: torch.Tensor, dtype: torch.dtype):
        """K and V for block tables [B, M] as [B, M * block_size, kv_heads, head_dim]."""
        b, m = block_tables.shape
        k, v = self.k[layer][block_tables], self.v[layer][block_tables]
        if self.quantized:
            k = (k.float() * self.k_scale[layer][block_tables][:, :, None, :, None]).to(dtype)
            v = (v.float() * self.v_scale[layer][block_tables][:, :, None, :, None]).to(dtype)
        return k.reshape(b, m * self.block_size, *k.shape[3:]), v.reshape(b, m * self.block_size, *v.shape[3:])

    def gather_blocks(self, layer: int, blocks: torch.Tensor, rows: int, width: int, dtype: torch.dtype):
        """K and V of flat block ids [rows * width] as [rows, width * block_size, kv_heads, head_dim]:
        whole blocks copied with index_select (a row memcpy), not advanced indexing."""
        if self.quantized:
            return self.gather(layer, blocks.view(rows, width), dtype)
        nb = self.num_blocks
        k = self.k[layer].view(nb, -1).index_select(0, blocks).view(rows, width * self.block_size, *self.k.shape[3:])
        v = self.v[layer].view(nb, -1).index_select(0, blocks).view(rows, width * self.block_size, *self.v.shape[3:])
        return k, v
