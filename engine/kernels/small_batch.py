"""A decode step's weight-bound work at small batch on a CPU (small_batch.cpp): `linear` for
F.linear, `experts` for the routed experts of a few tokens, `grouped_swiglu` for experts over
rows grouped by expert, `rms_norm` for F.rms_norm; fp32.

Only without autograd (the engine runs under inference mode; training keeps the torch path), and
only where the source was built: `MOECTL_SMALL_BATCH=0` forces the torch path, and
`set_enabled(False)` does in one process (A/B benchmarks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moectl.engine.kernels.build import NativeKernel

MAX_ROWS = 4  # linear and rms_norm: small_batch.cpp's kMaxRows, the most input rows they take
MAX_EXPERT_TOKENS = 4  # experts: tokens per call (each chooses top-k experts)
GROUP_ROWS = 16  # grouped_swiglu: small_batch.cpp's kGroupRows, the largest group its kernel runs
# OpenMP: at::parallel_for splits a large layer's rows across torch's threads only when built
# with it. No FMA contraction: a sum of products rounds each product as torch's ops do, so the
# experts' combine in C++ gives the bits of moe.combine (tests/engine/kernels)
_KERNEL = NativeKernel("moectl.engine.kernels", "small_batch.cpp", "moectl_small", "MOECTL_SMALL_BATCH", openmp=True,
                       cflags=("-ffp-contract=off",))
_ops = None  # torch.ops.moectl_small once built, so the hot path is one global read
_off = False  # set_enabled(False)


def kernels():
    """The built ops (torch.ops.moectl_small), or None (`failure()` says why)."""
    global _ops
    if _off:
        return None
    if _ops is None:
        _ops = _KERNEL.ops()
    return _ops


def failure() -> str | None:
    return "switched off" if _off else _KERNEL.failure


def set_enabled(on: bool) -> None:
    """The kernels off (the torch path everywhere) or back on, in this process."""
    global _ops, _off
    _off = not on
    _ops = None


def describe() -> str:
    """What a small decode batch's linears and experts run on: what benchmark results record."""
    return "small-batch kernels" if kernels() is not None else f"torch path ({failure()})"


def _few_rows(x: torch.Tensor):
    """The ops for x when linear and rms_norm take it (a few fp32 rows on a CPU, no autograd), else
    None; they check the rest (contiguity, shapes) and hand anything else to torch's op."""
    if (x.dtype is torch.float32 and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.device.type == "cpu"
            and not torch.is_grad_enabled()):
        return _ops if _ops is not None else kernels()
    return None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    ops = _few_rows(x)
    return F.linear(x, w, b) if ops is None else ops.linear(x, w, b)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension, weight included."""
    ops = _few_rows(x)
    return F.rms_norm(x, w.shape, w, eps) if ops is None else ops.rms_norm(x, w, eps)


def experts_take(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `experts` takes these tokens on these stacked weights (plain SwiGLU experts is the
    caller's to know)."""
    return (x.dtype is torch.float32 and x.shape[0] <= MAX_EXPERT_TOKENS and x.device.type == "cpu"
            and w13.dtype is torch.float32 and w2.dtype is torch.float32 and not torch.is_grad_enabled()
            and w13.is_contiguous() and w2.is_contiguous() and kernels() is not None)


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor) -> torch.Tensor:
    """[N, H] tokens, their top-k fp32 weights and expert ids [N, k] -> the weighted sum of their
    experts' SwiGLU outputs [N, H] (call when experts_take)."""
    return (_ops or kernels()).experts(x.contiguous(), weights.contiguous(), ids.contiguous(), w13, w2)


def grouped_takes(x_grouped: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `grouped_swiglu` takes these rows on these stacked weights: fp32 on a CPU, no
    autograd, contiguous weights."""
    return (x_grouped.dtype is torch.float32 and w13.dtype is torch.float32 and x_grouped.device.type == "cpu"
            and not torch.is_grad_enabled() and w13.is_contiguous() and w2.is_contiguous() and kernels() is not None)


def grouped_swiglu(x_grouped: torch.Tensor, ids: list[int], rows: list[int], w13: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over grouped rows: group g is rows[g] consecutive rows for the expert whose
    weights are w13[ids[g]], w2[ids[g]] (call when grouped_takes). Groups of a decode batch's size
    run in the kernel, larger ones through torch's ops. A group's result depends only on its rows
    and weights (its size picks the path, at GROUP_ROWS), never on the other groups: the same
    rows of an expert give the same bits on one device, on placed devices and from the expert
    cache."""
    ids_t, rows_t = torch.tensor(ids, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)
    return (_ops or kernels()).grouped_swiglu(x_grouped.contiguous(), ids_t, rows_t, w13, w2)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
