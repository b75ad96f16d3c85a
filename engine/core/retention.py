"""KV retention of the full-attention layers: which whole blocks a sequence keeps once its context
outgrows the budget (the knobs' kv_retention, kv_budget, kv_budget_fraction, kv_sink_tokens and
kv_recent_tokens).

- full: every block stays (no budget applies).
- streaming: the sink blocks and the most recent blocks (StreamingLLM): the oldest others go first.
- snapkv: the sink blocks, the last kv_recent_tokens, and the blocks that drew the most attention
  from an observation window: a prefill chunk's last kv_recent_tokens queries (SnapKV picks at the
  end of prefill), then, while decoding, the queries since the last eviction.
- h2o: the same, with the attention mass accumulated over every observed query and never reset
  (H2O's heavy hitters).

A block is the unit: K/V are paged, so only a whole block returns memory to the pool, and one
choice holds for all layers and heads (they share a block table). Scores are the attention
probability mass each block's keys received, summed over layers, heads and observed queries
(paged_attention.py computes them; the decode kernel adds them as it attends; a model's attention
sinks join the kernel's softmax, not the torch paths', so gpt-oss's scores differ slightly between
them; on the distributed backend with tensor parallelism only rank 0's KV heads score). An evicted block's
tokens keep their place in positions: the keys kept are read with their own RoPE positions, and
new tokens continue the sequence's positions.

Retention runs after a step's blocks are committed, so a budget holds between steps: a prefill
chunk attends to what the budget kept plus the whole chunk, as a compressing serving engine does.
"""

from __future__ import annotations

import math

import numpy as np

from moectl.engine.core.block_manager import BlockManager
from moectl.engine.core.sequence import Sequence

SCORED = ("snapkv", "h2o")


def budget_tokens(knobs, context: int) -> int | None:
    """The most tokens a sequence of `context` tokens keeps (None: no budget applies)."""
    if knobs.kv_retention == "full":
        return None
    caps = []
    if knobs.kv_budget:
        caps.append(knobs.kv_budget)
    if knobs.kv_budget_fraction < 1:
        caps.append(math.ceil(round(knobs.kv_budget_fraction * context, 6)))  # round: 0.1 * 30 is 3, not 4
    return min(caps) if caps else None


def scored(knobs) -> bool:
    return knobs.kv_retention in SCORED


def observed_rows(knobs, chunk: int) -> int:
    """Query rows of a prefill chunk whose attention scores the blocks (0: the policy scores none)."""
    return min(chunk, max(1, knobs.kv_recent_tokens)) if scored(knobs) else 0


def add_scores(seq: Sequence, positions: np.ndarray, mass: np.ndarray, fresh: bool) -> None:
    """Add attention mass `mass` of the blocks at table positions `positions`; fresh: these scores
    replace what was there (SnapKV's window at a prefill chunk's end)."""
    size = len(seq.block_table)
    if seq.kv_scores is None or fresh:
        seq.kv_scores = np.zeros(size)
    elif len(seq.kv_scores) < size:
        seq.kv_scores = np.pad(seq.kv_scores, (0, size - len(seq.kv_scores)))
    np.add.at(seq.kv_scores, positions, mass)


class Retention:
    def __init__(self, blocks: BlockManager):
        self.blocks = blocks

    def evictable(self, seq: Sequence, knobs) -> list[int]:
        """Table positions of the blocks the policy may evict, in the order it evicts them."""
        bs = self.blocks.block_size
        sinks = -(-knobs.kv_sink_tokens // bs)
        recent = knobs.kv_recent_tokens if scored(knobs) else 0
        # the block holding the newest token always stays (the next token may be written into it)
        protect_from = min((seq.num_computed - 1) // bs, max(0, seq.num_computed - recent) // bs)
        table = seq.block_table
        candidates = [i for i in range(sinks, protect_from) if table[i] >= 0]
        if scored(knobs) and seq.kv_scores is not None:
            scores = seq.kv_scores
            # fewest attention first; unscored blocks (none observed yet) count as 0; ties: oldest first
            candidates.sort(key=lambda i: scores[i] if i < len(scores) else 0.0)
        return candidates

    def apply(self, seq: Sequence, knobs) -> int:
        """Evict blocks until the sequence holds at most its budget (or nothing more can go);
        returns the blocks evicted."""
        budget = budget_tokens(knobs, seq.num_computed)
        if budget is None or seq.kv_held_tokens <= budget:
            return 0
        bs = self.blocks.block_size
        want = -(-(seq.kv_held_tokens - budget) // bs)
        chosen = self.evictable(seq, knobs)[:want]
        self.blocks.evict(seq, chosen)
        if knobs.kv_retention == "snapkv" and seq.kv_scores is not None:
            seq.kv_scores[:] = 0  # the next choice is scored by the queries that come after this one
        return len(chosen)
