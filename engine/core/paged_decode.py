"""The paged decode-attention kernel (paged_decode.cpp): built once per machine with torch's
C++ extension loader, then loaded from its cache; the torch path stays as the fallback.

On a CPU the padded-gather path spends most of a batched decode step copying every row's blocks
into a padded buffer and expanding K/V for GQA before SDPA reads them again; the kernel reads
each cached entry once where it lies. `MOECTL_DECODE_KERNEL=0` forces the torch path (for A/B
benchmarks); a build failure (no compiler) logs one line and falls back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from importlib import resources

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_module = None
_failed: str | None = None
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _build():
    from torch.utils.cpp_extension import load

    source = resources.files("moectl.engine.core").joinpath("paged_decode.cpp")
    text = source.read_bytes()
    # the name carries the source's hash: an edited kernel builds afresh instead of loading a stale one
    name = "moectl_paged_decode_" + hashlib.sha256(text).hexdigest()[:12]
    with resources.as_file(source) as path:
        # -march=native: the library is built on the machine that runs it
        load(name=name, sources=[str(path)], extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return torch.ops.moectl


def kernel():
    """The built module, or None (disabled, or it could not be built: `failure()` says why)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            if os.environ.get("MOECTL_DECODE_KERNEL", "1") == "0":
                _failed = "disabled by MOECTL_DECODE_KERNEL=0"
            else:
                try:
                    _module = _build()
                except Exception as exc:  # noqa: BLE001 - any build error means: use the torch path
                    _failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                    log.warning("paged decode kernel unavailable, using the torch path (%s)", _failed)
    return _module


def failure() -> str | None:
    return _failed


def describe() -> str:
    """Which decode attention a CPU engine gets: what benchmark results record."""
    return "in-place kernel" if kernel() is not None else f"torch padded gather ({_failed})"


def serves(cache) -> bool:
    """Whether the kernel reads this KV cache (and its window cache): CPU storage of a float dtype.
    INT8 blocks take the torch path, which dequantises them."""
    return cache.k.device.type == "cpu" and cache.k.dtype in KERNEL_DTYPES and kernel() is not None


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
           lo: torch.Tensor, scale: float, sinks: torch.Tensor | None = None, latent: bool = False) -> torch.Tensor:
    """q [B, Hq, Dq] -> [B, Hq, Dv]; see paged_decode.cpp for the arguments."""
    empty = q.new_empty(0, dtype=torch.float32)
    return kernel().paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, lo,
                                 empty if sinks is None else sinks.float().contiguous(), float(scale), latent)
