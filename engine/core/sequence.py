"""One request as the scheduler sees it: tokens, progress through the KV cache, and its times."""

from __future__ import annotations

import time
from enum import Enum

import numpy as np
import torch

from moectl.engine.core.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 priority: int = 0, arrival: float | None = None, generator: torch.Generator | None = None):
        self.request_id = request_id
        self.token_ids = list(prompt_ids)  # prompt then output, one list
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.priority = priority
        self.generator = generator
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of this sequence's full blocks
        # the sliding-window layers' blocks (window_blocks.py): -1 before window_first (released)
        self.window_table: list[int] = []
        self.window_first = 0
        self.window_committed = 0
        # KV retention (retention.py): block_table entries of evicted blocks are -1; kv_exact_blocks:
        # the full blocks computed before the first eviction (later ones saw a pruned context, so
        # they never enter the prefix cache); kv_scores: attention mass per block (scored policies)
        self.reset_retention()
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.num_cached_prompt = 0  # prompt tokens served from the prefix cache at admission
        self.num_preemptions = 0
        self.home_device = 0  # emulated device that owns this sequence's tokens
        self.output_text: str | None = None  # set when finished (or cut at a stop string)
        # log-probabilities, when the request asked: one (logprob, top) per output token, and per
        # prompt token (None for the first, which nothing predicts) until the prompt is scored
        self.output_logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = ([None] * len(prompt_ids) if params.prompt_logprobs is not None
                                             else None)
        self.prompt_scored = 1  # prompt positions whose log-probabilities are known (position 0 has none)
        self.penalty_history = None  # sampling.PenaltyHistory, made at its first penalised sample
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_scheduled: float | None = None
        self.token_times: list[float] = []
        self.finished_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_held_tokens(self) -> int:
        """Tokens of the full-attention layers' cache this sequence still reads."""
        return self.num_computed - self.kv_evicted_tokens

    def reset_retention(self) -> None:
        """No block evicted (a new sequence, or one whose blocks were all freed)."""
        self.kv_evicted_tokens = 0  # tokens of the evicted blocks (whole blocks)
        self.kv_exact_blocks: int | None = None
        self.kv_scores = None
        # held_blocks' and held_positions' cache, for (table length, tokens evicted) = _held_key
        self._held: list[int] = []
        self._held_positions = np.zeros(0, dtype=np.int64)
        self._held_key = (0, 0)

    @property
    def held_blocks(self) -> list[int]:
        """The full-attention blocks this sequence still reads, in position order. Rebuilt only when
        the table grew or lost a block (a million-token table is 62,500 entries: not every step)."""
        if not self.kv_evicted_tokens:
            return self.block_table
        self._refresh_held()
        return self._held

    @property
    def held_positions(self) -> np.ndarray:
        """The table positions (index = position // block size) of held_blocks."""
        if not self.kv_evicted_tokens:
            return np.arange(len(self.block_table))
        self._refresh_held()
        return self._held_positions

    def _refresh_held(self) -> None:
        key = (len(self.block_table), self.kv_evicted_tokens)
        if self._held_key != key:
            table = np.asarray(self.block_table)
            self._held_positions = np.flatnonzero(table >= 0)
            self._held, self._held_key = table[self._held_positions].tolist(), key

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prompt still has positions to score: the runner returns logits for its prefill rows."""
        return self.prompt_logprobs is not None and self.prompt_scored < self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self, policy: str):
        return (self.priority, self.arrival) if policy == "priority" else (self.arrival,)

    def metrics(self) -> dict:
        """Per-request latencies in seconds (None until they exist)."""
        first = self.token_times[0] if self.token_times else None
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return {
            "queue_time": None if self.first_scheduled is None else self.first_scheduled - self.arrival,
            "ttft": None if first is None else first - self.arrival,
            "tpot": (sum(gaps) / len(gaps)) if gaps else None,
            "itl": gaps,
            "e2e": None if self.finished_at is None else self.finished_at - self.arrival,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "cached_prompt_tokens": self.num_cached_prompt,
            "preemptions": self.num_preemptions,
        }
