"""Quick measurements of what this machine can do, for benchmarks to report shares against.

`measure()` takes about 2-3 s and returns (JSON-serialisable):

* memory bandwidth, bytes/s: `read_bw` from summing a buffer much larger than the caches
  (what streaming weights through the cores costs; the figure decode at batch 1 is held
  against), and `copy_bw` from a tensor copy (read + write bytes counted);
* matmul throughput, FLOP/s: torch.mm of square matrices at a few sizes in the model dtype,
  best of a few repeats each; `matmul_flops` is the best size.

Each figure is the best of its repeats (the least disturbed by other processes), at the
current torch thread count, which the result records.
"""

from __future__ import annotations

import time

import torch

from moectl.engine.models.config import parse_dtype

_BW_BYTES = 256 << 20  # well above any L3 of a 2-16 core machine
_MATMUL_SIZES = (256, 512, 1024, 2048)


def _best_time(fn, repeats: int, budget_s: float) -> float:
    fn()  # warm-up: first-touch page faults, thread pool start
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    return best


def memory_bandwidth(nbytes: int = _BW_BYTES, repeats: int = 5, budget_s: float = 1.0) -> dict:
    """Read bandwidth (sum of an fp32 buffer) and copy bandwidth (read + write), bytes/s."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = _best_time(lambda: src.sum(), repeats, budget_s / 2)
    copy = _best_time(lambda: dst.copy_(src), repeats, budget_s / 2)
    return {"read_bw": nbytes / read, "copy_bw": 2 * nbytes / copy, "bw_buffer_bytes": nbytes}


def matmul_throughput(dtype: str | torch.dtype = "float32", sizes=_MATMUL_SIZES, repeats: int = 8,
                      budget_s: float = 1.6) -> dict:
    """torch.mm FLOP/s (2*n^3 per product) at each size, and the best."""
    dt = parse_dtype(dtype)
    per_size = {}
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=gen).to(dt)
        b = torch.randn(n, n, generator=gen).to(dt)
        t = _best_time(lambda: torch.mm(a, b), repeats, budget_s / len(sizes))
        per_size[str(n)] = 2 * n ** 3 / t
    return {"matmul_flops": max(per_size.values()), "matmul_flops_by_size": per_size,
            "matmul_dtype": str(dt).replace("torch.", "")}


def measure(dtype: str | torch.dtype = "float32") -> dict:
    """Memory bandwidth and matmul FLOP/s of this machine, in about 2-3 seconds."""
    t = time.perf_counter()
    with torch.inference_mode():
        out = {**memory_bandwidth(), **matmul_throughput(dtype)}
    out["threads"] = torch.get_num_threads()
    out["measure_s"] = time.perf_counter() - t
    return out


def format_limits(limits: dict) -> str:
    return (f"memory bandwidth {limits['read_bw'] / 1e9:.1f} GB/s read, {limits['copy_bw'] / 1e9:.1f} GB/s copy; "
            f"matmul {limits['matmul_flops'] / 1e9:.1f} GFLOP/s {limits['matmul_dtype']} "
            f"({limits['threads']} threads)")


if __name__ == "__main__":
    import json
    import sys

    result = measure(sys.argv[1] if len(sys.argv) > 1 else "float32")
    print(format_limits(result))
    print(json.dumps(result, indent=1))
