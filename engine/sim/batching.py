"""Continuous batching with chunked prefill for a simulated cluster, on arrays.

Every attention group (a data-parallel batch: one device, or `tp` devices sharing its heads)
schedules on its own, as vLLM's and SGLang's DP-attention ranks do, with the engine's knobs:
at most `max_num_seqs` running sequences and `max_num_batched_tokens` tokens a step; decodes
first (one token each), then prompt chunks of at most `long_prefill_token_threshold` tokens in
admission order. A sequence's KV blocks come from its group's pool (the capacity the memory plan
leaves, see cluster_engine.py); a waiting request is admitted when its first chunk's blocks are
free, and when a step's growth does not fit, the group's newest sequences are preempted
(recomputed later, like vLLM's default). Requests are dealt to groups round robin on arrival.

Requests carry lengths, not tokens: a simulated request's output is its length. The arrays are
per running sequence, so a step over 10^4 sequences costs a few numpy calls, not a Python loop.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from moectl.engine.core.config import SchedulerKnobs

FIELDS = ("rid", "group", "prompt", "target", "done", "out", "max_out", "order", "arrival", "first", "scheduled")


@dataclass
class Scheduled:
    """One step's batch: per running sequence its tokens this step, and per group the sums
    the step model prices (keys per window class, see step_model.StepLoad)."""
    tokens: np.ndarray  # [R] tokens each running sequence computes this step (0: not scheduled)
    samples: np.ndarray  # [R] bool: samples a token this step (decodes, and prefills that finish)
    prefill_tokens: int
    decode_tokens: int
    preempted: list[int]  # request numbers


class ClusterBatcher:
    def __init__(self, groups: int, blocks_per_group: int, block_size: int, knobs: SchedulerKnobs):
        self.groups, self.blocks_per_group, self.block_size = groups, blocks_per_group, block_size
        self.knobs = knobs
        self.run = {name: np.zeros(0, dtype=np.float64 if name in ("arrival", "first", "scheduled") else np.int64)
                    for name in FIELDS}
        # (rid, group, prompt, target, out, max_out, arrival, first): target, the tokens to
        # prefill (a preempted sequence recomputes its output too), out, those already sampled
        self.waiting: deque[tuple] = deque()
        self._home = itertools.cycle(range(groups))
        self._order = itertools.count()
        self.preemptions = 0
        self.finished = 0  # requests finished so far
        self.events: list[dict] = []  # this step's request events (taken by the engine)

    # -- requests
    def add(self, rid: int, prompt: int, max_out: int, arrival: float) -> int:
        """A request of `prompt` tokens that generates `max_out`; returns its group."""
        group = next(self._home)
        self.waiting.append((rid, group, prompt, prompt, 0, max_out, arrival, np.nan))
        return group

    @property
    def running(self) -> int:
        return len(self.run["rid"])

    def has_work(self) -> bool:
        return bool(self.waiting) or self.running > 0

    def blocks_used(self) -> np.ndarray:
        """[groups] KV blocks the running sequences hold."""
        held = -(-self.run["done"] // self.block_size)
        return np.bincount(self.run["group"], weights=held, minlength=self.groups).astype(np.int64)

    def kv_blocks_total(self) -> int:
        return self.groups * self.blocks_per_group

    # -- a step
    def schedule(self, now: float) -> Scheduled:
        self._admit(now)
        r, k = self.run, self.knobs
        decoding = r["done"] >= r["target"]
        tokens = decoding.astype(np.int64)
        # decodes beyond the token budget wait (max_num_seqs above max_num_batched_tokens)
        tokens = self._within_budget(tokens, np.full(self.groups, k.max_num_batched_tokens))
        budget = k.max_num_batched_tokens - np.bincount(r["group"], weights=tokens, minlength=self.groups)
        cap = np.where(decoding, 0, np.minimum(r["target"] - r["done"], k.long_prefill_token_threshold))
        tokens = tokens + self._within_budget(cap, budget)
        preempted, kept = self._fit_kv(tokens, now)
        if kept is not None:
            tokens = tokens[kept]
        r = self.run
        decoding = r["done"] >= r["target"]
        samples = (tokens > 0) & (decoding | (r["done"] + tokens >= r["target"]))
        prefill = int(tokens[~decoding].sum())
        return Scheduled(tokens, samples, prefill, int(tokens.sum()) - prefill, preempted)

    def _within_budget(self, want: np.ndarray, budget: np.ndarray) -> np.ndarray:
        """Each sequence's `want` tokens, granted in admission order until its group's budget
        is spent (a grouped cumulative sum)."""
        r = self.run
        if not len(want):
            return want
        order = np.lexsort((r["order"], r["group"]))
        w = want[order]
        g = r["group"][order]
        cum = np.cumsum(w)
        starts = np.searchsorted(g, np.arange(self.groups))
        before = cum - w - np.concatenate([[0], cum])[starts][g]
        granted = np.clip(budget[g] - before, 0, w).astype(np.int64)
        out = np.empty_like(want)
        out[order] = granted
        return out

    def _admit(self, now: float) -> None:
        """Waiting requests in arrival order, each into its group while the group has a free
        sequence slot and blocks for its first chunk; a group that cannot take its next request
        takes none after it (FCFS)."""
        if not self.waiting:
            return
        k, r = self.knobs, self.run
        running = np.bincount(r["group"], minlength=self.groups)
        # the running sequences grow first (a decode token, or their next chunk): what is left is free
        want = np.where(r["done"] >= r["target"], 1, np.minimum(r["target"] - r["done"], k.long_prefill_token_threshold))
        after = np.bincount(r["group"], -(-(r["done"] + want) // self.block_size), self.groups).astype(np.int64)
        free = self.blocks_per_group - after
        blocked: set[int] = set()
        admitted, kept = [], deque()
        for item in self.waiting:
            rid, group, prompt, target, out, max_out, arrival, first = item
            need = -(-min(target, k.long_prefill_token_threshold) // self.block_size)
            if group in blocked or running[group] >= k.max_num_seqs or free[group] < need:
                blocked.add(group)
                kept.append(item)
                continue
            running[group] += 1
            free[group] -= need
            admitted.append((rid, group, prompt, target, 0, out, max_out, next(self._order), arrival, first, now))
            self.events.append({"id": f"req-{rid}", "event": "scheduled", "t": now})
        self.waiting = kept
        if admitted:
            for name, values in zip(FIELDS, zip(*admitted)):
                self.run[name] = np.concatenate([self.run[name], np.asarray(values, dtype=self.run[name].dtype)])

    def _fit_kv(self, tokens: np.ndarray, now: float) -> tuple[list[int], np.ndarray | None]:
        """Preempts each over-full group's newest sequences until the step's blocks fit; returns
        them and the mask of the sequences kept (None: all)."""
        r = self.run
        need = -(-(r["done"] + tokens) // self.block_size)
        per_group = np.bincount(r["group"], weights=need, minlength=self.groups)
        over = np.flatnonzero(per_group > self.blocks_per_group)
        if not len(over):
            return [], None
        drop = np.zeros(len(tokens), dtype=bool)
        for g in over.tolist():
            members = np.flatnonzero(r["group"] == g)
            newest_first = members[np.argsort(-r["order"][members])]
            excess = per_group[g] - self.blocks_per_group
            freed = np.cumsum(need[newest_first])
            drop[newest_first[:int(np.searchsorted(freed, excess)) + 1]] = True
        preempted = []
        for i in np.flatnonzero(drop).tolist():  # back to the front of the queue, to recompute
            rid = int(r["rid"][i])
            preempted.append(rid)
            prompt, out = int(r["prompt"][i]), int(r["out"][i])
            self.waiting.appendleft((rid, int(r["group"][i]), prompt, prompt + out, out, int(r["max_out"][i]),
                                     float(r["arrival"][i]), float(r["first"][i])))
            self.events.append({"id": f"req-{rid}", "event": "preempted", "t": now})
        self.preemptions += len(preempted)
        self.run = {name: col[~drop] for name, col in r.items()}
        return preempted, ~drop

    def finish_step(self, batch: Scheduled, t_end: float) -> list[int]:
        """Advances the scheduled sequences to the step's end; returns the finished requests."""
        r = self.run
        r["done"] += batch.tokens
        first = batch.samples & (r["out"] == 0)
        r["out"] += batch.samples
        r["first"] = np.where(first, t_end, r["first"])
        for i in np.flatnonzero(first).tolist():
            self.events.append({"id": f"req-{int(r['rid'][i])}", "event": "first_token", "t": t_end})
        ended = r["out"] >= r["max_out"]
        if not ended.any():
            return []
        finished = []
        for i in np.flatnonzero(ended).tolist():
            rid, out, first_t, arrival = int(r["rid"][i]), int(r["out"][i]), float(r["first"][i]), float(r["arrival"][i])
            prompt = int(r["prompt"][i])
            finished.append(rid)
            self.events.append({"id": f"req-{rid}", "event": "finished", "t": t_end, "reason": "length",
                                "prompt_tokens": prompt, "output_tokens": out, "ttft_s": first_t - arrival,
                                "tpot_s": (t_end - first_t) / (out - 1) if out > 1 else None})
        self.run = {name: col[~ended] for name, col in r.items()}
        self.finished += len(finished)
        return finished

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events
