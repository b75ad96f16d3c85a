"""The paged decode-attention kernel (paged_decode.cpp): built once per machine with torch's
C++ extension loader, then loaded from its cache; the torch path stays as the fallback.

On a CPU the padded-gather path spends most of a batched decode step copying every row's blocks
into a padded buffer and expanding K/V for GQA before SDPA reads them again; the kernel reads
each cached entry once where it lies. `MOECTL_DECODE_KERNEL=0` forces the torch path (for A/B
benchmarks); a build failure (no compiler) logs one line and falls back.
"""

from __future__ import annotations

import torch

from moectl.engine.kernels.build import NativeKernel

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL = NativeKernel("moectl.engine.core", "paged_decode.cpp", "moectl", "MOECTL_DECODE_KERNEL", openmp=True)


def kernel():
    """The built module, or None (disabled, or it could not be built: `failure()` says why)."""
    return _KERNEL.ops()


def failure() -> str | None:
    return _KERNEL.failure


def describe() -> str:
    """Which decode attention a CPU engine gets: what benchmark results record."""
    return "in-place kernel" if kernel() is not None else f"torch padded gather ({failure()})"


def serves(cache) -> bool:
    """Whether the kernel reads this KV cache (and its window cache): CPU storage of a float dtype.
    INT8 blocks take the torch path, which dequantises them."""
    return cache.k.device.type == "cpu" and cache.k.dtype in KERNEL_DTYPES and kernel() is not None


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
           lo: torch.Tensor, scale: float, sinks: torch.Tensor | None = None, latent: bool = False,
           checked: bool = False, mass: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, Dq] -> [B, Hq, Dv]; see paged_decode.cpp for the arguments. checked: these same
    tables, lens and lo were checked by an earlier call this step, against a cache of this shape.
    mass: [B, Hk, W] fp32, to which each table block's attention probability is added (KV retention)."""
    empty = q.new_empty(0, dtype=torch.float32)
    return kernel().paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, lo,
                                 empty if sinks is None else sinks.float().contiguous(), float(scale), latent, checked,
                                 empty if mass is None else mass)
