"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, a free pool, and
prefix caching by a hash chain over full blocks.

With emulated devices the pool is split into one pool per device: a sequence's blocks come from
its home device's pool (the device whose attention serves it), so each device's KV capacity is
enforced on its own, and its prefix cache only serves its own sequences (a real device cannot
read another's KV blocks). One pool is the single-device case.

A freed block keeps its hash and stays reusable until the pool hands it out again (oldest
freed first), so a later request with the same prefix finds it.

KV retention (retention.py) evicts whole blocks of a sequence: its block_table keeps their place
with -1 (positions still map to blocks by position // block_size), `held` lists what it still
reads, and the block is released: back in the pool once no other sequence (a shared prefix)
holds it. Blocks computed after a sequence's first eviction saw a pruned context, so they never
enter the prefix cache under the full context's hash.

A model with sliding-window layers keeps their K/V in a second pool (`window`, see
window_blocks.py) that releases blocks as they slide out of the window; every method here
keeps the two in step, so the scheduler sees one manager.
"""

from __future__ import annotations

from collections import OrderedDict

from moectl.engine.core.sequence import Sequence
from moectl.engine.core.window_blocks import WindowBlocks


def _chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_pools: int = 1,
                 window: int = 0, window_blocks: int = 0):
        """window, window_blocks: the sliding layers' window (tokens) and their pool's blocks (0: no
        sliding layers)."""
        if not 1 <= num_pools <= num_blocks:
            raise ValueError(f"kv cache: {num_blocks} blocks cannot be split over {num_pools} devices")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # pool p owns a contiguous range of block ids (the first num_blocks % num_pools one more)
        base, extra = divmod(num_blocks, num_pools)
        self.pool_sizes = [base + (p < extra) for p in range(num_pools)]
        starts = [sum(self.pool_sizes[:p]) for p in range(num_pools)]
        self.free_pools: list[OrderedDict[int, None]] = [
            OrderedDict((i, None) for i in range(start, start + size)) for start, size in zip(starts, self.pool_sizes)]
        self._roots = [0] + [hash(("kv pool", p)) for p in range(1, num_pools)]  # separate prefix chains
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens served from it
        self.evicted_tokens = [0] * num_pools  # KV retention: tokens evicted from each pool's sequences, ever
        self.window = None
        if window:
            store = BlockManager(window_blocks, block_size, enable_prefix_caching, num_pools)
            self.window = WindowBlocks(store, window)

    # -- accounting
    @property
    def num_pools(self) -> int:
        return len(self.free_pools)

    @property
    def num_free(self) -> int:
        return sum(map(len, self.free_pools))

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def pool_of(self, seq: Sequence) -> int:
        return seq.home_device if self.num_pools > 1 else 0

    def free_in_pool(self, pool: int) -> int:
        return len(self.free_pools[pool])

    def used_per_pool(self) -> list[int]:
        return [size - len(free) for size, free in zip(self.pool_sizes, self.free_pools)]

    @property
    def largest_pool(self) -> int:
        return max(self.pool_sizes)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    # -- allocation
    def _take_free_block(self, pool: int) -> int:
        block, _ = self.free_pools[pool].popitem(last=False)
        old = self.block_hash[block]
        if old is not None:  # evict its cached contents
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.block_hash[block] = self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block

    def _acquire(self, block: int, pool: int) -> None:
        if self.ref_count[block] == 0:
            del self.free_pools[pool][block]
        self.ref_count[block] += 1

    def _release(self, block: int, pool: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            free_pool = self.free_pools[pool]
            free_pool[block] = None
            if self.block_hash[block] is None:  # nothing cached in it: hand it out first
                free_pool.move_to_end(block, last=False)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a prefix of the sequence. The last token is never served from
        cache, because its logits are needed to sample. A sequence scoring its prompt gets none:
        every position's logits are wanted (its blocks are still shared once computed)."""
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        parent = self._roots[self.pool_of(seq)]
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = _chain_hash(parent, tokens)
            block = self.hash_to_block.get(parent)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
        return hits

    def admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give a waiting sequence its cached prefix plus blocks for its first chunk.
        Returns False (changing nothing) if the pool cannot cover it."""
        cached = self.match_prefix(seq)
        window_hit: list[int] = []
        if self.window is not None and cached:
            hashes = [self.block_hash[b] for b in cached]
            usable, window_hit = self.window.usable_prefix(seq, hashes)
            cached = cached[:usable]
        free_hits = sum(1 for b in cached if self.ref_count[b] == 0)
        num_cached_tokens = len(cached) * self.block_size
        new_tokens = min(num_new_tokens, seq.num_tokens - num_cached_tokens)
        total = -(-(num_cached_tokens + new_tokens) // self.block_size)
        pool = self.pool_of(seq)
        if total - len(cached) > self.free_in_pool(pool) - free_hits:
            return False
        if self.window is not None:
            store = self.window.store
            first = self.window.first_needed(num_cached_tokens) if cached else 0
            free_window_hits = sum(1 for b in window_hit if store.ref_count[b] == 0)
            if total - first - len(window_hit) > store.free_in_pool(pool) - free_window_hits:
                return False
            self.window.admit(seq, len(cached), window_hit, pool)
        for block in cached:
            self._acquire(block, pool)
        seq.block_table = list(cached)
        seq.block_hashes = [self.block_hash[b] for b in cached]
        seq.num_computed = num_cached_tokens
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += num_cached_tokens
            seq.num_cached_prompt = num_cached_tokens
        self.grow(seq, new_tokens)
        return True

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        pool = self.pool_of(seq)
        if self.window is not None and not self.window.can_grow(seq, num_new_tokens, pool):
            return False
        return self.blocks_needed(seq, num_new_tokens) <= self.free_in_pool(pool)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        pool = self.pool_of(seq)
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block(pool))
        if self.window is not None:
            self.window.grow(seq, num_new_tokens, pool)

    def release_window(self, seq: Sequence) -> None:
        """Register full window blocks and release those that slid out (after num_computed moved)."""
        if self.window is not None:
            self.window.commit_and_release(seq, self.pool_of(seq))

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full (their K/V now written) in the prefix cache; release
        the window blocks that slid out."""
        if not self.enable_prefix_caching:
            self.release_window(seq)
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else self._roots[self.pool_of(seq)]
        exact = seq.num_computed // bs if seq.kv_exact_blocks is None else seq.kv_exact_blocks
        for i in range(len(seq.block_hashes), min(seq.num_computed // bs, exact)):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = _chain_hash(parent, tokens)
            block = seq.block_table[i]
            seq.block_hashes.append(parent)
            if parent not in self.hash_to_block:
                self.hash_to_block[parent] = block
                self.block_hash[block], self.block_tokens[block] = parent, tokens
        self.release_window(seq)

    def evict(self, seq: Sequence, indices) -> None:
        """Drop the sequence's blocks at table positions `indices` (full blocks it holds)."""
        pool = self.pool_of(seq)
        if seq.kv_exact_blocks is None:
            seq.kv_exact_blocks = seq.num_computed // self.block_size
        for i in indices:
            block = seq.block_table[i]
            if block < 0 or (i + 1) * self.block_size > seq.num_computed:
                raise ValueError(f"evict: block {i} of {seq.request_id} is not a full block it holds")
            self._release(block, pool)
            seq.block_table[i] = -1
            seq.kv_evicted_tokens += self.block_size
            self.evicted_tokens[pool] += self.block_size

    def free(self, seq: Sequence) -> None:
        # tail blocks first, so the shared head of a prefix stays cached longest
        pool = self.pool_of(seq)
        for block in reversed(seq.block_table):
            if block >= 0:
                self._release(block, pool)
        if self.window is not None:
            self.window.free(seq, pool)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0
        seq.reset_retention()

    def check_invariants(self) -> None:
        """Exact accounting: every block is either referenced or in the pool, never both."""
        for b in range(self.num_blocks):
            in_pool = any(b in pool for pool in self.free_pools)
            if in_pool == (self.ref_count[b] > 0) or self.ref_count[b] < 0:
                raise AssertionError(f"block {b}: ref_count {self.ref_count[b]}, in pool {in_pool}")
        if self.window is not None:
            self.window.store.check_invariants()
