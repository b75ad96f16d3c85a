"""Sampling parameters (validated once), the sampler that turns logits into tokens, and the
log-probabilities a request asked for.

Log-probabilities are those of the model's own distribution (log-softmax of the raw logits, as
vLLM's default "raw_logprobs"): temperature, top-k/top-p and penalties change which token is
drawn, not the figures reported, so they can be compared with a reference implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top alternatives reported per output token (0: the chosen one only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM/transformers': divides (or multiplies) prompt and output tokens

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        # max_tokens 0 only scores the prompt (echo with prompt log-probabilities)
        lowest = 0 if self.prompt_logprobs is not None else 1
        if not _is_int(self.max_tokens) or self.max_tokens < lowest:
            extra = "" if lowest == 0 else " (0 only with prompt_logprobs)"
            raise ValueError(f"max_tokens: must be an integer >= {lowest}{extra}, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}: must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty: must be a number in (0, 2], got {self.repetition_penalty!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature: must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: must be an integer >= 0, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: must be non-negative integers")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed: must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


MAX_LOGPROBS = 20  # as vLLM's default max_logprobs


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class PenaltyHistory:
    """What a penalised request has seen, kept up to date one token at a time (rebuilding it
    from the whole history every step would cost O(length) per token): which tokens occurred in
    the prompt or output (repetition) and how often each occurred in the output (presence, frequency)."""

    def __init__(self, prompt_ids: list[int], vocab: int):
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        self.seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32)
        self.synced = 0  # output tokens counted

    def update(self, output_ids: list[int]) -> PenaltyHistory:
        if len(output_ids) > self.synced:
            new = torch.tensor(output_ids[self.synced:], dtype=torch.long)
            self.seen[new] = True
            self.counts.index_add_(0, new, torch.ones(len(new)))
            self.synced = len(output_ids)
        return self


def apply_penalties(row: torch.Tensor, p: SamplingParams, history: PenaltyHistory) -> torch.Tensor:
    """One row of logits with the request's penalties applied (a new tensor). Repetition counts
    prompt and output tokens (vLLM, transformers); presence and frequency count the output only (OpenAI)."""
    row = row.float().cpu()
    vocab = min(row.numel(), history.seen.numel())
    if p.repetition_penalty != 1.0:
        head = row[:vocab]
        penalised = torch.where(head > 0, head / p.repetition_penalty, head * p.repetition_penalty)
        row = torch.cat([torch.where(history.seen[:vocab], penalised, head), row[vocab:]])
    if history.synced and (p.presence_penalty or p.frequency_penalty):
        counts = history.counts[:vocab]
        row = row.clone()
        row[:vocab] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return row


TokenLogprob = tuple[float, list[tuple[int, float]]]  # (the token's log-probability, top [(id, logprob)])


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """Per row of fp32 logits: the log-probability of tokens[row] and the `top[row]` most likely tokens.
    The log-softmax runs in float64: in float32 a token of probability 0.9994 gets its log (-6e-4)
    with a relative error of 3e-3, all of it round-off; a few rows at a time bounds the copy."""
    out: list[TokenLogprob] = []
    for lo in range(0, logits.shape[0], LOGPROB_ROWS):
        hi = lo + LOGPROB_ROWS
        logp = torch.log_softmax(logits[lo:hi].double(), dim=-1)
        chosen = logp.gather(1, torch.tensor(tokens[lo:hi], device=logp.device).unsqueeze(1)).squeeze(1).tolist()
        k = max(top[lo:hi], default=0)
        if k == 0:
            out += [(lp, []) for lp in chosen]
            continue
        values, ids = logp.topk(k, dim=-1)
        out += [(lp, list(zip(i[:n], v[:n]))) for lp, i, v, n in zip(chosen, ids.tolist(), values.tolist(), top[lo:hi])]
    return out


LOGPROB_ROWS = 64  # rows per float64 log-softmax: 64 x a 150k vocabulary is 77 MB


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[PenaltyHistory | None] | None = None) -> list[int]:
    """logits: fp32 [B, V]; histories: each penalised row's PenaltyHistory (up to date).
    Greedy rows share one argmax; sampled rows draw with their own generator, so a seeded request
    gives the same tokens whatever else is in the batch."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy and not p.penalised:  # the common case: the shared argmax stands
            continue
        scores = logits[row]
        if p.penalised:
            scores = apply_penalties(scores, p, histories[row])
            if p.greedy:
                tokens[row] = int(scores.argmax())
        if p.greedy:
            continue
        scores = scores.float().cpu() / p.temperature  # CPU generators: same draws on any device
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen))
    return tokens


@dataclass
class _GeneratorFactory:
    """Seeded requests get their own generator; unseeded ones share one engine generator."""
    shared: torch.Generator = field(default_factory=torch.Generator)

    def for_params(self, p: SamplingParams) -> torch.Generator | None:
        if p.greedy:
            return None
        if p.seed is None:
            return self.shared
        return torch.Generator().manual_seed(p.seed)
