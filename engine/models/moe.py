"""The sparse MoE block: a router and the experts stored as stacked tensors.

Experts live in two stacked tensors per layer (gate/up fused, and down), in the gpt-fast
style, so a later placement layer can move or replicate slices of them without touching the
math. Tokens are sorted by expert and each active expert runs one dense matmul on its
contiguous slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moectl.engine.kernels import small_batch
from moectl.engine.kernels.small_batch import linear
from moectl.engine.models.layers import swiglu
from moectl.engine.models.tracing import NULL_TRACER, NullTracer
from moectl.engine.models.yield_points import Stages, run_stages

# The grouped GEMM beats the per-expert loop from 4 rows up: one call per projection instead of two
# matmuls and an activation per expert hit (`python bench/decode_bench.py`, sample model shapes,
# one thread: 0.10 vs 0.09 ms at 2 rows, 0.13 vs 0.17 at 4, 0.28 vs 0.68-0.86 at 16).
GROUPED_MM_MIN_ROWS = 4
_grouped_mm_ok: dict[tuple, bool] = {}
_grouped_mm_fits: dict[tuple, bool] = {}


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm is private: some builds lack a kernel for this device/dtype or want
    aligned strides. Probe it once on a small exact case and fall back to the loop if it fails."""
    key = (device.type, dtype)
    if key not in _grouped_mm_ok:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                x = torch.ones(4, 8, device=device, dtype=dtype)
                w = torch.ones(2, 8, 8, device=device, dtype=dtype)
                out = torch._grouped_mm(x, w, offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
                ok = bool((out == 8).all())
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _grouped_mm_ok[key] = ok
    return _grouped_mm_ok[key]


@dataclass(frozen=True)
class ExpertFFN:
    """What one expert computes: SwiGLU, or gpt-oss's variant (gate clamped above at `limit`, up
    clamped to +-limit, (up + 1) * gate * sigmoid(alpha * gate)), with or without biases.

    Biases live inside the stacked weights as one extra input column (w13 [E, 2I, H + 1],
    w2 [E, H, I + 1], fed a constant 1), so an expert's bias travels with its slot through
    placement, the expert cache and migration between ranks without any of them knowing."""

    biased: bool = False
    limit: float | None = None
    alpha: float = 1.702

    def extra_column(self) -> int:
        return 1 if self.biased else 0

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[.., 2I] gate and up -> [.., I] (+ the constant 1 column that feeds down's bias)."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is None:
            out = F.silu(gate) * up
        else:
            gate = gate.clamp(max=self.limit)
            out = (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)
        return F.pad(out, (0, 1), value=1.0) if self.biased else out

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 1), value=1.0) if self.biased else x
        return linear(self.activate(linear(x, w13)), w2)


SWIGLU = ExpertFFN()


def grouped_swiglu(x_sorted: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor,
                   offsets: torch.Tensor | None = None, ffn: ExpertFFN = SWIGLU) -> torch.Tensor:
    """x_sorted holds tokens grouped by expert in id order; counts[e] tokens go to expert e of the
    stacked weights. offsets (int32 cumulative counts, from grouped_offsets: None where the grouped
    GEMM cannot take these weights) selects one grouped matmul per projection instead of a loop
    over experts, for batches large enough to hit many experts."""
    if not ffn.biased and ffn.limit is None and small_batch.grouped_takes(x_sorted, w13, w2):  # fp32 on a CPU
        hit = [e for e, n in enumerate(counts) if n]
        rows = [counts[e] for e in hit]
        # with no group small enough for the kernel, the grouped GEMM (the same bits per group as
        # the op's torch path for large groups) in one call
        if not rows or offsets is None or min(rows) <= small_batch.GROUP_ROWS:
            return small_batch.grouped_swiglu(x_sorted, hit, rows, w13, w2)
    if offsets is not None:
        gate_up = torch._grouped_mm(x_sorted, w13.transpose(1, 2), offs=offsets)
        return torch._grouped_mm(ffn.activate(gate_up), w2.transpose(1, 2), offs=offsets)
    out = torch.empty_like(x_sorted)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            out[start:start + n] = ffn(x_sorted[start:start + n], w13[expert], w2[expert])
            start += n
    return out


def grouped_mm_fits(w13: torch.Tensor, w2: torch.Tensor, ffn: ExpertFFN = SWIGLU) -> bool:
    """Whether torch._grouped_mm takes these stacked weights, decided once per device, dtype and
    widths (a dict lookup per step after that). It wants every operand's rows on 16-byte strides
    ("strides should be multiple of 16 bytes"): the hidden and expert widths, the two GEMMs'
    inner dimensions, must be multiples of 8 values in bf16/fp16, of 4 in fp32. Biased experts
    never fit: their bias column leaves rows of H + 1 values, and the grouped path has no place to
    feed it its constant 1. The rest take the per-expert loop: it keeps the weights as stored
    (a padded copy would change every expert's bytes for placement, the expert cache and
    migration) and computes exactly what transformers' eager experts do."""
    key = (w13.device.type, w13.dtype, w13.shape[-1], w2.shape[-1], ffn.biased)
    fits = _grouped_mm_fits.get(key)
    if fits is None:
        row_bytes = (w13.shape[-1] * w13.element_size(), w2.shape[-1] * w2.element_size())
        fits = (not ffn.biased and all(b % 16 == 0 for b in row_bytes)
                and _grouped_mm_works(w13.device, w13.dtype))
        _grouped_mm_fits[key] = fits
    return fits


def grouped_offsets(counts_t: torch.Tensor, rows: int, w13: torch.Tensor, w2: torch.Tensor,
                    ffn: ExpertFFN = SWIGLU, training: bool = False) -> torch.Tensor | None:
    """grouped_swiglu's offsets for `rows` tokens on these weights, or None for the per-expert
    loop: in training (autograd), under GROUPED_MM_MIN_ROWS rows, or where the kernel cannot take
    the weights (grouped_mm_fits)."""
    if training or rows < GROUPED_MM_MIN_ROWS or not grouped_mm_fits(w13, w2, ffn):
        return None
    return torch.cumsum(counts_t, 0, dtype=torch.int32)


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, ffn: ExpertFFN = SWIGLU):
        super().__init__()
        extra = ffn.extra_column()
        self.ffn = ffn
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden + extra))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate + extra))

    def forward(self, x_sorted: torch.Tensor, counts: list[int], offsets: torch.Tensor | None = None) -> torch.Tensor:
        return grouped_swiglu(x_sorted, counts, self.w13, self.w2, offsets, self.ffn)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts_t: torch.Tensor):
        """The seam where placement and parallelism plug in: tokens x [N, H] with their top-k
        weights and expert ids [N, k] in, the weighted sum of their experts' outputs out.
        This version runs every expert here; emulated devices and expert parallelism replace it."""
        plain = not self.ffn.biased and self.ffn.limit is None  # SwiGLU as Mixtral and DeepSeek have it
        if plain and small_batch.experts_take(x, self.w13, self.w2):  # a few decode tokens, in one call
            return small_batch.experts(x, weights, ids, self.w13, self.w2)
        top_k = ids.shape[1]
        order = torch.argsort(ids.flatten(), stable=True)
        offsets = grouped_offsets(counts_t, order.numel(), self.w13, self.w2, self.ffn, self.training)
        expert_out = self(x.index_select(0, order // top_k), counts_t.tolist(), offsets)
        return combine(expert_out, order, weights, x.dtype)


def combine(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype) -> torch.Tensor:
    """Expert outputs sorted by `order` back to [token, k] order, then their weighted sum.
    A gather plus sum, not index_add_ (slow on CPU for small batches); index_copy_, not
    x[idx] = y (index_put, several times slower on CPU)."""
    top_k = weights.shape[1]
    unsorted = torch.empty_like(expert_out).index_copy_(0, order, expert_out)
    return (unsorted.view(-1, top_k, expert_out.shape[-1]) * weights.unsqueeze(-1)).sum(1).to(dtype)


@dataclass(frozen=True)
class GroupedSigmoidRouter:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter): sigmoid scores in fp32; a
    per-expert correction bias that steers the *selection* only; experts in n_group groups of
    which the topk_group with the best top-2 sums stay eligible; the chosen experts' unbiased
    scores as weights (normalised when norm_topk_prob), times routed_scaling_factor."""

    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


class MoEBlock(nn.Module):
    def __init__(self, layer_idx: int, hidden: int, num_experts: int, top_k: int, intermediate: int,
                 norm_topk_prob: bool, shared_intermediate: int = 0, *, shared_gated: bool = True,
                 grouped_sigmoid: GroupedSigmoidRouter | None = None, softmax_after_topk: bool = False,
                 router_bias: bool = False, ffn: ExpertFFN = SWIGLU):
        """shared_gated: Qwen2-MoE's sigmoid gate on the shared expert (DeepSeek adds it ungated).
        grouped_sigmoid: DeepSeek-V3's router instead of a softmax over all experts.
        softmax_after_topk, router_bias: gpt-oss's router (a biased linear, the softmax over the
        chosen logits only, in the model dtype); ffn: what each expert computes."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.softmax_after_topk = softmax_after_topk
        self.gate = nn.Parameter(torch.empty(num_experts, hidden))
        self.gate_bias = nn.Parameter(torch.empty(num_experts)) if router_bias else None
        self.grouped_sigmoid = grouped_sigmoid
        if grouped_sigmoid is not None:
            if num_experts % grouped_sigmoid.n_group or not 1 <= grouped_sigmoid.topk_group <= grouped_sigmoid.n_group:
                raise ValueError(f"router: {num_experts} experts cannot form {grouped_sigmoid.n_group} groups with "
                                 f"topk_group {grouped_sigmoid.topk_group}")
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.experts = StackedExperts(num_experts, hidden, intermediate, ffn)
        self.shared_gate = None
        if shared_intermediate:
            self.shared_w13 = nn.Parameter(torch.empty(2 * shared_intermediate, hidden))
            self.shared_w2 = nn.Parameter(torch.empty(hidden, shared_intermediate))
            if shared_gated:
                self.shared_gate = nn.Parameter(torch.empty(1, hidden))
        else:
            self.shared_w13 = None

    def _grouped_choice(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, sigmoid scores, selection scores: biased, -inf outside the kept groups)."""
        cfg = self.grouped_sigmoid
        logits = F.linear(x.float(), self.gate.float())
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias
        if cfg.n_group > 1:
            per_group = self.num_experts // cfg.n_group
            group_scores = choice.view(-1, cfg.n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))
        return logits, scores, choice

    def selection_scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, E] preference, [N, E] weight), fp32: what a prefetcher ranks experts by. Softmax
        routers: the probabilities twice. DeepSeek: the biased scores (-inf outside the kept groups)
        and the unbiased sigmoid scores."""
        if self.grouped_sigmoid is not None:
            _, scores, choice = self._grouped_choice(x)
            return choice, scores
        probs = torch.softmax(F.linear(x, self.gate, self.gate_bias), dim=-1, dtype=torch.float32)
        return probs, probs

    def _route_grouped_sigmoid(self, x: torch.Tensor):
        cfg = self.grouped_sigmoid
        logits, scores, choice = self._grouped_choice(x)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * cfg.routed_scaling_factor, ids

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (router logits, fp32 top-k weights, top-k expert ids)."""
        if self.grouped_sigmoid is not None:
            return self._route_grouped_sigmoid(x)
        logits = linear(x, self.gate, self.gate_bias)
        if self.softmax_after_topk:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return logits, torch.softmax(top, dim=-1).float(), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, ids

    def forward(self, x: torch.Tensor, probe=None, tracer: NullTracer = NULL_TRACER) -> torch.Tensor:
        """x: [N, H] flat tokens. tracer: spans for the router and the expert work."""
        return run_stages(self.stages(x, probe, tracer))

    def stages(self, x: torch.Tensor, probe=None, tracer: NullTracer = NULL_TRACER) -> Stages:
        """forward, yielding at the expert layer's collectives where it has them (the ranks')."""
        mark = tracer.mark()
        logits, weights, ids = self.route(x)
        counts_t = torch.bincount(ids.flatten(), minlength=self.num_experts)
        if self.training:
            self.last_aux_loss = self.aux_loss(logits, ids)
            self.last_counts = counts_t.detach()  # the correction bias's update (engine/tools/train.py)
        tracer.close(mark, "router", 0, self.layer_idx)
        if probe is not None:
            probe.on_routing(self.layer_idx, counts_t, ids)
        mark = tracer.mark()
        staged = getattr(self.experts, "dispatch_stages", None)
        out = ((yield from staged(x, weights, ids, counts_t)) if staged is not None
               else self.experts.dispatch(x, weights, ids, counts_t))
        tracer.close(mark, "experts", 0, self.layer_idx)
        if self.shared_w13 is not None:  # its own span: the routed experts' share of a step is measured apart
            mark = tracer.mark()
            shared = swiglu(x, self.shared_w13, self.shared_w2)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(F.linear(x, self.shared_gate)) * shared)
            tracer.close(mark, "shared expert", 0, self.layer_idx)
        return out

    def aux_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Switch/Mixtral load-balancing loss: E * sum_e(fraction routed to e * mean prob of e).
        DeepSeek-V3's router: its complementary balance loss over the batch, E/K * sum_e(f_e * P_e)
        with P_e the mean of the sigmoid scores normalised per token (its bias does the balancing;
        this term only keeps any one batch from collapsing, with a tiny weight)."""
        routed = F.one_hot(ids, self.num_experts).float().sum(1).mean(0)
        if self.grouped_sigmoid is not None:
            scores = torch.sigmoid(logits.float())
            affinity = scores / scores.sum(dim=-1, keepdim=True)
            return self.num_experts / self.top_k * torch.sum(routed * affinity.mean(0))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        return self.num_experts * torch.sum(routed * probs.mean(0))
