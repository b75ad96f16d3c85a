"""Two-batch overlap on the ranks: a step's batch as two micro-batches, one's collectives in flight
while the other computes (SGLang's TBO; the seeds' "two-stage pipeline overlap").

Rank 0 decides where each step splits (`choose_split`: half the tokens, or no split when the batch
is too small to gain: SGLang measured a loss for small decode batches) and publishes it with the
step, so every rank runs the same schedule and issues its collectives in the same order. `forward`
runs the model's stages (models.yield_points: the layers are written once, with yield points at
their collectives) for the two halves with `interleave`. Each micro-batch has its own span names
("attention (mb 1)", ...); a span that waited across the other micro-batch's work keeps only its
own running time (on the CPU; on a GPU, events cannot be clipped and spans keep their whole length).
A prefill chunk written to an INT8 cache is never cut (`choose_split` moves the cut to a chunk's
edge): its second part would read the first part's K/V back quantized, where one batch uses them
exact.
"""

from __future__ import annotations

import time

import torch

from moectl.engine.core.config import OVERLAP_MIN_TOKENS, OVERLAP_MODES
from moectl.engine.core.paged_attention import PagedContext, split_context
from moectl.engine.models.yield_points import interleave, run_stages

MODES = OVERLAP_MODES
DEFAULT_MIN_TOKENS = OVERLAP_MIN_TOKENS  # below this many tokens in a step, one batch: see choose_split


def choose_split(mode: str, num_tokens: int, min_tokens: int = DEFAULT_MIN_TOKENS, ctx: PagedContext | None = None) -> int:
    """Where the step's tokens split: 0 (one batch) unless two-batch and at least min_tokens; half
    the tokens, or over an INT8 cache (ctx) the nearest edge of a fresh prefill chunk the half cuts."""
    if mode == "none" or num_tokens < max(min_tokens, 2):
        return 0
    at = num_tokens // 2
    if ctx is None or not getattr(ctx.cache, "quantized", False):
        return at
    for p in ctx.prefills:
        if p.cached_len == 0 and p.start < at < p.end:
            edges = [e for e in (p.start, p.end) if 0 < e < num_tokens]
            return min(edges, key=lambda e: abs(e - at)) if edges else 0
    return at


class MicroBatchTracer:
    """One micro-batch's view of the step's tracer: its spans named "name (mb i)", and (clip: on
    the CPU, where a span's ends are clock reads) a span opened before a yield closes with only the
    time this micro-batch was running. On a GPU a span is a pair of events on the stream and keeps
    its whole length."""

    def __init__(self, inner, index: int, clip: bool = True):
        self.inner, self.index, self.clip = inner, index, clip
        self.enabled = inner.enabled
        self.running: list[list[float]] = []  # [start, end] of each stretch this micro-batch ran

    def resume(self) -> None:
        if not self.running or self.running[-1][1] != float("inf"):  # not already running
            self.running.append([time.monotonic(), float("inf")])

    def suspend(self) -> None:
        if self.running and self.running[-1][1] == float("inf"):
            self.running[-1][1] = time.monotonic()

    def _name(self, name: str) -> str:
        return f"{name} (mb {self.index})"

    def mark(self):
        if not self.clip:
            return self.inner.mark()
        return time.monotonic() if self.enabled else None

    def close(self, mark, name: str, lane: int = 0, layer: int = -1) -> None:
        if not self.enabled:
            return
        if not self.clip:
            self.inner.close(mark, self._name(name), lane, layer)
            return
        now = time.monotonic()
        for start, end in self.running:
            lo, hi = max(start, mark), min(end, now)
            if hi > lo:
                self.inner.add_measured(self._name(name), lane, layer, lo, hi)

    def add_measured(self, name: str, lane: int, layer: int, start: float, end: float) -> None:
        self.inner.add_measured(self._name(name), lane, layer, start, end)

    def add_modeled(self, name: str, lanes, layers, starts, seconds) -> None:
        self.inner.add_modeled(self._name(name), lanes, layers, starts, seconds)


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedContext, split: int,
            stats=None, probe=None, interleaved: bool = True) -> torch.Tensor:
    """The model's forward over the step; split > 0: as two micro-batches [0, split) and
    [split, N), interleaved. stats: this rank's RankStepStats (its tracer follows the running
    micro-batch); probe: sees both micro-batches (one whose figures add up: `splittable`).
    interleaved False: the two micro-batches one after the other, every collective waited for at
    once (what splitting costs or saves without any overlap: the bench's control)."""
    if split <= 0:
        return model(input_ids, positions, ctx, probe)
    first, second = split_context(ctx, split)
    inner = model.tracer
    clip = not getattr(inner, "cuda", False)
    tracers = [MicroBatchTracer(inner, i, clip) for i in (0, 1)]
    expert_tracer = stats.tracer if stats is not None else None
    expert_views = [MicroBatchTracer(expert_tracer, i, clip) for i in (0, 1)] if stats is not None else None

    def switch(i: int) -> None:
        tracers[1 - i].suspend()
        tracers[i].resume()
        if stats is not None:
            stats.tracer = expert_views[i]

    try:
        stages = (model.stages(input_ids[:split], positions[:split], first, probe, tracers[0]),
                  model.stages(input_ids[split:], positions[split:], second, probe, tracers[1]))
        if interleaved:
            a, b = interleave(*stages, switch)
        else:
            switch(0)
            a = run_stages(stages[0])
            switch(1)
            b = run_stages(stages[1])
    finally:
        tracers[0].suspend()
        tracers[1].suspend()
        if stats is not None:
            stats.tracer = expert_tracer
    return torch.cat([a, b])
