"""KV blocks of the sliding-window layers: a second pool whose blocks are released as they slide
out of the window, so a sequence holds at most about (window + chunk) / block_size of them
however long it grows.

The sliding layers' K/V live in their own cache (KVCache.window) with their own block ids, one
table per sequence (`Sequence.window_table`, indexed like `block_table` by position // block
size, -1 where a block was released). A query at position p reads positions > p - window, so a
block whose last position is <= p - window is never read again once p has been computed.

Prefix reuse follows the main pool's hash chain: a released block keeps its hash until the pool
hands it out again, and a prefix hit is cut back to where the window's own blocks are still
cached (the first token run after the hit needs the window before it).
"""

from __future__ import annotations

from moectl.engine.core.sequence import Sequence


class WindowBlocks:
    def __init__(self, store, window: int):
        """store: a BlockManager over the window pool (its free lists, ref counts and hashes)."""
        self.store, self.window = store, window
        self.block_size = store.block_size

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` reads."""
        return max(0, position - self.window + 1) // self.block_size

    def held(self, seq: Sequence) -> list[int]:
        return seq.window_table[seq.window_first:]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.window_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int, pool: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.store.free_in_pool(pool)

    def grow(self, seq: Sequence, num_new_tokens: int, pool: int) -> None:
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.window_table.append(self.store._take_free_block(pool))

    def usable_prefix(self, seq: Sequence, hashes: list[int]) -> tuple[int, list[int]]:
        """Of a prefix hit of len(hashes) blocks (their chain hashes), the longest part whose window
        blocks are cached too: (blocks usable, the window blocks it needs, from first_needed on)."""
        bs = self.block_size
        for n in range(len(hashes), 0, -1):
            first = self.first_needed(n * bs)
            blocks = []
            for i in range(first, n):
                block = self.store.hash_to_block.get(hashes[i])
                if block is None or self.store.block_tokens[block] != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                    break
                blocks.append(block)
            else:
                return n, blocks
        return 0, []

    def admit(self, seq: Sequence, num_cached_blocks: int, blocks: list[int], pool: int) -> None:
        first = self.first_needed(num_cached_blocks * self.block_size) if num_cached_blocks else 0
        for block in blocks:
            self.store._acquire(block, pool)
        seq.window_table = [-1] * first + list(blocks)
        seq.window_first = first
        seq.window_committed = num_cached_blocks

    def commit_and_release(self, seq: Sequence, pool: int) -> None:
        """Register the window blocks that became full (hashes from the main pool's chain), then
        release those that slid out of reach of the next query (at position num_computed)."""
        store, bs = self.store, self.block_size
        if store.enable_prefix_caching:
            for i in range(seq.window_committed, min(seq.num_computed // bs, len(seq.block_hashes))):
                block, key = seq.window_table[i], seq.block_hashes[i]
                if block >= 0 and key not in store.hash_to_block:
                    store.hash_to_block[key] = block
                    store.block_hash[block], store.block_tokens[block] = key, tuple(seq.token_ids[i * bs:(i + 1) * bs])
                seq.window_committed = i + 1
        for i in range(seq.window_first, min(self.first_needed(seq.num_computed), len(seq.window_table))):
            store._release(seq.window_table[i], pool)
            seq.window_table[i] = -1
            seq.window_first = i + 1

    def free(self, seq: Sequence, pool: int) -> None:
        for block in reversed(self.held(seq)):
            store = self.store
            store._release(block, pool)
        seq.window_table, seq.window_first, seq.window_committed = [], 0, 0
