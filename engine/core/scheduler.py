"""Iteration-level scheduling with chunked prefill, a token budget, and recompute preemption.

Each step: running sequences first (decodes, then continuing prefill chunks, each in policy order);
when the KV pool runs dry the lowest-ranked running sequence of that pool is preempted (its blocks freed,
its tokens recomputed later). Waiting sequences are admitted only when nobody was preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from moectl.engine.core.block_manager import BlockManager
from moectl.engine.core.config import SchedulerKnobs
from moectl.engine.core.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.items

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, knobs: SchedulerKnobs):
        self.blocks = block_manager
        self.knobs = knobs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = seq.remaining
        if n > 1:
            n = min(n, self.knobs.long_prefill_token_threshold)
        return min(n, budget)

    def schedule(self) -> ScheduledBatch:
        knobs = self.knobs
        batch = ScheduledBatch()
        budget = knobs.max_num_batched_tokens
        self.running.sort(key=lambda s: s.sort_key(knobs.policy))
        # decodes before continuing prefill chunks, so long prompts cannot starve generation;
        # victims are still chosen by rank (the end of `running`). Sequences beyond a lowered
        # max_num_seqs wait their turn (not preempted).
        order = [s for s in self.running if s.remaining == 1] + [s for s in self.running if s.remaining > 1]
        for seq in order:
            if budget <= 0 or len(batch.items) >= knobs.max_num_seqs:
                break
            if seq not in self.running:  # preempted as a victim earlier in this loop
                continue
            n = self._chunk(seq, budget)
            while not self.blocks.can_grow(seq, n):
                victim = self._lowest_ranked_sharing_pool(seq)
                self._preempt(victim, batch)
                for i, (scheduled, tokens) in enumerate(batch.items):
                    if scheduled is victim:  # already in this step: take it out, give its tokens back
                        del batch.items[i]
                        budget += tokens
                        break
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.grow(seq, n)
            batch.items.append((seq, n))
            budget -= n
        if batch.preempted:
            return batch
        if knobs.policy == "priority" and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=lambda s: s.sort_key("priority")))
        full_pools: set[int] = set()  # a device whose pool cannot take its head-of-line sequence
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= knobs.max_num_seqs or len(batch.items) >= knobs.max_num_seqs:
                break
            pool = self.blocks.pool_of(seq)
            if pool in full_pools:
                continue  # first come, first served within each device's pool
            if not self.blocks.admit(seq, self._chunk_for_admission(seq, budget)):
                full_pools.add(pool)
                if len(full_pools) == self.blocks.num_pools:
                    break
                continue
            self.waiting.remove(seq)
            n = self._chunk(seq, budget)
            seq.status = Status.RUNNING
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def _lowest_ranked_sharing_pool(self, seq: Sequence) -> Sequence:
        # only a sequence whose blocks come from seq's pool (its device's KV) can make room for it
        pool = self.blocks.pool_of(seq)
        return next(s for s in reversed(self.running) if self.blocks.pool_of(s) == pool)

    def _chunk_for_admission(self, seq: Sequence, budget: int) -> int:
        # before the prefix lookup we do not know the cached part; ask for the largest chunk the
        # budget allows and let the block manager trim it to what is really uncached
        return min(seq.num_tokens, self.knobs.long_prefill_token_threshold, budget)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finished_at = time.monotonic()
