"""Tensor and expert parallelism added to a loaded model by small hooks (gpt-fast style).

`apply_tensor_parallel` shards every Attention by heads: the fused qkv projection is split by
rows (column parallel), o_proj by columns (row parallel), and a forward hook on o_proj
all-reduces its partial output over the tensor-parallel group. `apply_expert_parallel` keeps a
contiguous slice of every MoE layer's experts on each rank and swaps `layer.mlp.experts` for an
`ExpertParallelExperts`, whose `dispatch` moves (token, choice) rows to the ranks owning their
experts with all_to_all and brings the results back.

Everything else (embeddings, norms, router, LM head, dense MLP layers and Qwen2-MoE's shared
expert) stays replicated: every rank computes it on the same tokens, so every rank holds the
same hidden states at every layer boundary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moectl.engine.models.attention import Attention
from moectl.engine.models.moe import MoEBlock, StackedExperts, combine, grouped_offsets

MAX_TP = 8


class ParallelError(ValueError):
    """A tensor/expert-parallel layout this model cannot take; the message says why."""


def _split_bounds(total: int, parts: int) -> list[int]:
    """Contiguous split of `total` items into `parts` nearly equal ranges: parts + 1 bounds."""
    return [total * i // parts for i in range(parts + 1)]


# ---------------------------------------------------------------- tensor parallelism (attention)

def tp_head_layout(num_heads: int, num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[range, range]:
    """(q heads, kv heads) rank `tp_rank` keeps. With fewer kv heads than ranks each kv head is
    replicated on the tp_size / num_kv_heads ranks whose q heads use it."""
    check_tp_size(num_heads, num_kv_heads, tp_size)
    q_per = num_heads // tp_size
    q = range(tp_rank * q_per, (tp_rank + 1) * q_per)
    if num_kv_heads >= tp_size:
        kv_per = num_kv_heads // tp_size
        return q, range(tp_rank * kv_per, (tp_rank + 1) * kv_per)
    head = tp_rank // (tp_size // num_kv_heads)
    return q, range(head, head + 1)


def check_tp_size(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or not 1 <= tp_size <= MAX_TP:
        raise ParallelError(f"tp: tensor-parallel size must be an integer in [1, {MAX_TP}], got {tp_size!r}")
    if num_heads % tp_size:
        raise ParallelError(f"tp: {tp_size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ParallelError(f"tp: {tp_size} and the model's {num_kv_heads} kv heads must divide one another")


def local_kv_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """kv heads each rank's KV cache holds."""
    return len(tp_head_layout(num_heads, num_kv_heads, 0, tp_size)[1])


class _TPFullRMSNorm(nn.Module):
    """OLMoE's q/k RMSNorm over the whole projection, computed on a head shard: the shard's sum
    of squares is all-reduced so the scale is the full projection's. `contributes` is False on
    ranks holding a replicated copy of kv heads another rank already counts."""

    def __init__(self, weight: torch.Tensor, eps: float, full_dim: int, contributes: bool, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.full_dim, self.contributes, self.group = eps, full_dim, contributes, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        ss = x32.pow(2).sum(-1, keepdim=True)
        if not self.contributes:
            ss = torch.zeros_like(ss)
        dist.all_reduce(ss, group=self.group)
        x32 = x32 * torch.rsqrt(ss / self.full_dim + self.eps)
        return self.weight * x32.to(dtype)


def _all_reduce_hook(group):
    def hook(module, inputs, output):
        dist.all_reduce(output, group=group)
        return output
    return hook


def _shard_attention(attn: Attention, tp_rank: int, tp_size: int, group) -> None:
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_heads, kv_heads = tp_head_layout(hq, hkv, tp_rank, tp_size)
    q_size, kv_size = attn.q_size, attn.kv_size
    dev = attn.qkv.weight.device
    q_rows = torch.arange(q_heads.start * d, q_heads.stop * d, device=dev)
    kv_rows = torch.arange(kv_heads.start * d, kv_heads.stop * d, device=dev)
    rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    qkv = attn.qkv
    qkv.weight = nn.Parameter(qkv.weight.index_select(0, rows).contiguous(), requires_grad=False)
    if qkv.bias is not None:
        qkv.bias = nn.Parameter(qkv.bias.index_select(0, rows).contiguous(), requires_grad=False)
    qkv.out_features = rows.numel()
    o = attn.o_proj
    o.weight = nn.Parameter(o.weight[:, q_heads.start * d:q_heads.stop * d].contiguous(), requires_grad=False)
    o.in_features = len(q_heads) * d
    if o.bias is not None and tp_rank != 0:
        o.bias = None  # the bias is added once: by rank 0's partial sum
    if attn.qk_norm == "full":
        replicas = max(1, tp_size // hkv)
        attn.q_norm = _TPFullRMSNorm(attn.q_norm.weight[q_rows].clone(), attn.q_norm.eps, q_size, True, group)
        attn.k_norm = _TPFullRMSNorm(attn.k_norm.weight[kv_rows].clone(), attn.k_norm.eps, kv_size,
                                     tp_rank % replicas == 0, group)
    attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
    attn.q_size, attn.kv_size = len(q_heads) * d, len(kv_heads) * d
    o.register_forward_hook(_all_reduce_hook(group))


def apply_tensor_parallel(model: nn.Module, tp_rank: int, tp_size: int, group=None) -> nn.Module:
    """Shards every Attention of `model` in place for rank `tp_rank` of a `tp_size` group.
    tp_size 1 leaves the model untouched. Each rank's KV cache then holds only its kv heads
    (`local_kv_heads`)."""
    cfg = model.cfg
    check_tp_size(cfg.num_heads, cfg.num_kv_heads, tp_size)
    if tp_size == 1:
        return model
    if not 0 <= tp_rank < tp_size:
        raise ParallelError(f"tp: rank {tp_rank} is outside a group of {tp_size}")
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _shard_attention(module, tp_rank, tp_size, group)
    return model


# ---------------------------------------------------------------- expert parallelism (MoE)

class ExpertParallelExperts(StackedExperts):
    """This rank's contiguous slice of a layer's experts, and the all_to_all dispatch/combine.

    Every rank of the EP group calls `dispatch` with the same N tokens (hidden states are
    replicated between layers). Rank r takes token shard r, sends each (token, choice) row to
    the rank owning its expert, runs its own experts on what it receives, sends the results
    back, combines them exactly as `engine.moe.combine` does, and finally all-gathers the token
    shards so every rank has the full [N, H] output again."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, expert_bounds: list[int], ep_rank: int,
                 ep_size: int, group=None):
        nn.Module.__init__(self)
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.expert_bounds = list(expert_bounds)  # rank d owns experts [bounds[d], bounds[d + 1])
        self.num_experts = expert_bounds[-1]
        self.experts_per_rank = [b - a for a, b in zip(expert_bounds, expert_bounds[1:])]
        self.ep_rank, self.ep_size, self.group = ep_rank, ep_size, group
        self.first_expert = expert_bounds[ep_rank]
        self.num_local = self.experts_per_rank[ep_rank]

    def extra_repr(self) -> str:
        return (f"experts [{self.first_expert}, {self.first_expert + self.num_local}) of {self.num_experts}, "
                f"ep rank {self.ep_rank}/{self.ep_size}")

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts_t: torch.Tensor):
        n, hidden = x.shape
        size, rank, group = self.ep_size, self.ep_rank, self.group
        tb = _split_bounds(n, size)
        a, b = tb[rank], tb[rank + 1]
        xs, ws, ids_s = x[a:b], weights[a:b], ids[a:b]
        top_k = ids.shape[1]
        # (1) this shard's rows sorted by expert id: contiguous per destination rank
        flat = ids_s.flatten()
        order = torch.argsort(flat, stable=True)
        send = xs.index_select(0, order // top_k)
        counts = torch.bincount(flat, minlength=self.num_experts)
        # (2) per-expert counts to each expert's owner: rank d receives [size, its experts]
        recv_counts = counts.new_empty(size * self.num_local)
        dist.all_to_all_single(recv_counts, counts, [self.num_local] * size, self.experts_per_rank, group=group)
        ends = torch.tensor(self.expert_bounds[1:], device=counts.device) - 1
        send_rows = counts.cumsum(0)[ends].diff(prepend=counts.new_zeros(1)).tolist()
        recv_counts = recv_counts.view(size, self.num_local)
        recv_rows = recv_counts.sum(1).tolist()
        recv = send.new_empty((sum(recv_rows), hidden))
        dist.all_to_all_single(recv, send, recv_rows, send_rows, group=group)
        # (3) the local experts on rows grouped by local expert (StackedExperts' math)
        local_ids = torch.repeat_interleave(
            torch.arange(self.num_local, device=x.device).repeat(size), recv_counts.flatten())
        local_order = torch.argsort(local_ids, stable=True)
        local_counts = recv_counts.sum(0)
        offsets = grouped_offsets(local_counts, local_order.numel(), self.training, x.dtype)
        out_sorted = self(recv.index_select(0, local_order), local_counts.tolist(), offsets)
        out_recv = torch.empty_like(out_sorted).index_copy_(0, local_order, out_sorted)
        # (4) results back to the ranks that sent the rows
        back = send.new_empty((sum(send_rows), hidden))
        dist.all_to_all_single(back, out_recv, send_rows, recv_rows, group=group)
        # (5) the weighted sum, in engine.moe.combine's order of operations
        # (6) every rank gets every shard again (padded: all_gather wants equal sizes)
        width = max(tb[i + 1] - tb[i] for i in range(size))
        padded = x.new_zeros((width, hidden))
        if b > a:
            padded[:b - a] = combine(back, order, ws, x.dtype)
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:tb[i + 1] - tb[i]] for i, p in enumerate(parts)])


def apply_expert_parallel(model: nn.Module, ep_rank: int, ep_size: int, group=None) -> nn.Module:
    """Keeps experts [E * r / ep, E * (r + 1) / ep) of every MoE layer on rank r (the rest are
    freed) and swaps in ExpertParallelExperts. ep_size 1 leaves the model untouched."""
    cfg = model.cfg
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ParallelError(f"ep: expert-parallel size must be a positive integer, got {ep_size!r}")
    if ep_size > cfg.num_experts:
        raise ParallelError(f"ep: {ep_size} ranks exceed the model's {cfg.num_experts} experts "
                            f"(every rank must own at least one)")
    if ep_size == 1:
        return model
    bounds = _split_bounds(cfg.num_experts, ep_size)
    a, b = bounds[ep_rank], bounds[ep_rank + 1]
    for module in list(model.modules()):
        if isinstance(module, MoEBlock):
            old = module.experts
            w13 = old.w13[a:b].clone()
            w2 = old.w2[a:b].clone()
            module.experts = ExpertParallelExperts(w13, w2, bounds, ep_rank, ep_size, group)
            del old
    return model


__all__ = ["MAX_TP", "ParallelError", "ExpertParallelExperts", "apply_expert_parallel", "apply_tensor_parallel",
           "check_tp_size", "local_kv_heads", "tp_head_layout"]
