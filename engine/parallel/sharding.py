"""Tensor parallelism added to a loaded model by small hooks (gpt-fast style).

`apply_tensor_parallel` shards every Attention by heads: the fused qkv projection is split by
rows (column parallel), o_proj by columns (row parallel), and the decoder layer all-reduces
the partial output over the tensor-parallel group (`output_collective`, a yield point). Latent attention (MLA) splits
its per-head projections the same way (q_b_proj or q_proj and kv_b_proj by rows, o_proj by
columns); the latent itself (q_a_proj, kv_a_proj and their norms) is computed whole on every
rank, so every rank caches the same latent, as MLA serving does. Expert parallelism (any
placement over the ranks) is rank_experts.py's `install`.

Everything else (embeddings, norms, router, LM head, dense MLP layers and Qwen2-MoE's shared
expert) stays replicated: every rank computes it on the same tokens, so every rank holds the
same hidden states at every layer boundary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moectl.engine.models.attention import Attention
from moectl.engine.models.mla import MLAttention
from moectl.engine.models.yield_points import Collective

MAX_TP = 8


class ParallelError(ValueError):
    """A tensor/expert-parallel layout this model cannot take; the message says why."""


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


def _output_collective(group):
    """The attention output's all_reduce over the tensor-parallel group, started asynchronously:
    the decoder layer yields it (models.yield_points), so two micro-batches can overlap it."""
    def start(output: torch.Tensor) -> Collective:
        return Collective(dist.all_reduce(output, group=group, async_op=True))
    return start


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
    if attn.sinks is not None:  # one sink per query head
        attn.sinks = nn.Parameter(attn.sinks[q_heads.start:q_heads.stop].clone(), requires_grad=False)
    attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
    attn.q_size, attn.kv_size = len(q_heads) * d, len(kv_heads) * d
    attn.output_collective = _output_collective(group)


def _rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.index_select(0, rows).contiguous(), requires_grad=False)
    linear.out_features = rows.numel()


def _shard_mla(attn: MLAttention, tp_rank: int, tp_size: int, group) -> None:
    per = attn.num_heads // tp_size
    heads = range(tp_rank * per, (tp_rank + 1) * per)
    dev = attn.kv_b_proj.weight.device

    def head_rows(width: int) -> torch.Tensor:
        return torch.arange(heads.start * width, heads.stop * width, device=dev)

    q = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
    _rows(q, head_rows(attn.nope + attn.rope_dim))
    _rows(attn.kv_b_proj, head_rows(attn.nope + attn.v_dim))
    o = attn.o_proj
    o.weight = nn.Parameter(o.weight[:, heads.start * attn.v_dim:heads.stop * attn.v_dim].contiguous(),
                            requires_grad=False)
    o.in_features = per * attn.v_dim
    if o.bias is not None and tp_rank != 0:
        o.bias = None
    attn.num_heads = per
    attn.output_collective = _output_collective(group)


def apply_tensor_parallel(model: nn.Module, tp_rank: int, tp_size: int, group=None) -> nn.Module:
    """Shards every Attention of `model` in place for rank `tp_rank` of a `tp_size` group.
    tp_size 1 leaves the model untouched. Each rank's KV cache then holds only its kv heads
    (`local_kv_heads`; MLA: the whole latent)."""
    cfg = model.cfg
    check_tp_size(cfg.num_heads, cfg.num_kv_heads, tp_size)
    if tp_size == 1:
        return model
    if not 0 <= tp_rank < tp_size:
        raise ParallelError(f"tp: rank {tp_rank} is outside a group of {tp_size}")
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _shard_attention(module, tp_rank, tp_size, group)
        elif isinstance(module, MLAttention):
            _shard_mla(module, tp_rank, tp_size, group)
    return model


__all__ = ["MAX_TP", "ParallelError", "apply_tensor_parallel",
           "check_tp_size", "local_kv_heads", "tp_head_layout"]
