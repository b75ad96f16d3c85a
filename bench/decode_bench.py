"""The decode-path levers of issue 13, each against the path it replaced, in one run.

    python bench/decode_bench.py [--json] [--rounds 2]

1. Paged decode attention: the in-place kernel (engine/core/paged_decode.cpp) against the torch
   path (gather each row's blocks into a padded buffer, then SDPA with a mask), on a random
   cache, rows x keys of 1 x 512, 16 x 384 and 64 x 512 (GQA 4 query / 2 KV heads, head 64,
   fp32). Thread CPU time per call, one torch thread, so another process on the machine moves
   it less than wall time. The kernel's K/V bytes read per call over its time, against this
   machine's read bandwidth on that one thread (machine_limits, measured in the same run): how
   far the memory-bound kernel is from its limit.
2. Expert FFN: torch._grouped_mm against the per-expert loop at 2-128 rows (the sample model's
   16 experts, hidden 256, intermediate 96).
3. The engine on the compare-hf workload (64 requests at once, prompts 32-512, outputs 16-256),
   with the kernel and with the torch path, alternating --rounds times: output tok/s and
   process CPU time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from moectl.engine import sample_model_dir  # noqa: E402
from moectl.engine.core import paged_decode  # noqa: E402
from moectl.engine.core.kv_cache import KVCache  # noqa: E402
from moectl.engine.core.paged_attention import DecodeGroup, PagedContext  # noqa: E402
from moectl.engine.core.sampling import SamplingParams  # noqa: E402
from moectl.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from moectl.engine.models.moe import grouped_swiglu  # noqa: E402
from moectl.engine.tools.machine_limits import memory_bandwidth  # noqa: E402
from moectl.engine.tools.workload import WorkloadSpec, run_workload, workload_for_engine  # noqa: E402


def _cpu_ms(fn, repeats: int) -> float:
    fn()
    t0 = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - t0) / repeats * 1e3


def attention(rows: int, keys: int, repeats: int = 30) -> dict:
    gen = torch.Generator().manual_seed(0)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    width = keys // block
    cache = KVCache(1, 4096, block, kv_heads, dim, torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    table = (torch.randperm(4095, generator=gen)[:rows * width] + 1).view(rows, width)  # block 0 takes the writes
    lens = torch.randint(keys // 2, keys + 1, (rows,), generator=gen)
    mask = (torch.arange(keys)[None, :] < lens[:, None])[:, None, None, :]
    q = torch.randn(rows, heads, dim, generator=gen)
    k_new, v_new = torch.zeros(rows, kv_heads, dim), torch.zeros(rows, kv_heads, dim)  # into slot 0, read by no row

    def ctx(group):
        return PagedContext(cache=cache, slot_mapping=torch.zeros(rows, dtype=torch.int64), num_decodes=rows,
                            decode_context_lens=lens, decode_groups=[group])

    in_place = ctx(DecodeGroup(0, rows, table, width, None, lens=lens))
    gathered = ctx(DecodeGroup(0, rows, table.reshape(-1), width, mask))
    out = {"rows": rows, "keys": keys,
           "torch_ms": _cpu_ms(lambda: gathered._attend(0, q, k_new, v_new, 0.125, False, 0, None), repeats)}
    if paged_decode.kernel() is not None:
        out["kernel_ms"] = _cpu_ms(lambda: in_place._attend(0, q, k_new, v_new, 0.125, False, 0, None), repeats)
        out["speedup"] = out["torch_ms"] / out["kernel_ms"]
        out["kv_bytes"] = int(lens.sum()) * kv_heads * dim * cache.k.element_size() * 2  # each K and V entry once
        out["kernel_read_bw"] = out["kv_bytes"] / (out["kernel_ms"] / 1e3)
    return out


def experts(rows: int, repeats: int = 200) -> dict:
    gen = torch.Generator().manual_seed(rows)
    num, hidden, inter = 16, 256, 96
    w13, w2 = torch.randn(num, 2 * inter, hidden, generator=gen), torch.randn(num, hidden, inter, generator=gen)
    counts = torch.bincount(torch.randint(0, num, (rows,), generator=gen), minlength=num)
    x = torch.randn(rows, hidden, generator=gen)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    listed = counts.tolist()
    loop = _cpu_ms(lambda: grouped_swiglu(x, listed, w13, w2), repeats)
    grouped = _cpu_ms(lambda: grouped_swiglu(x, listed, w13, w2, offsets), repeats)
    return {"rows": rows, "experts_hit": int((counts > 0).sum()), "loop_ms": loop, "grouped_ms": grouped}


def engine_ab(rounds: int) -> dict:
    spec = WorkloadSpec(num_requests=64, rate=math.inf, prompt_len=(32, 512), output_len=(16, 256), seed=0,
                        source="auto", ignore_eos=True)
    runs = {"kernel": [], "torch": []}
    for r in range(rounds):
        for side in (("kernel", "torch") if r % 2 == 0 else ("torch", "kernel")):
            engine = LLMEngine(EngineConfig(model=str(sample_model_dir()), dtype="float32", num_kv_blocks=2048,
                                            num_threads="auto"))
            engine.runner.decode_kernel = side == "kernel" and paged_decode.kernel() is not None
            engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))
            items = workload_for_engine(spec, engine)
            c0, t0 = time.process_time(), time.perf_counter()
            res = run_workload(engine, items, realtime=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            runs[side].append({"tok_s": res.summary["output_tokens"] / wall, "cpu_s": cpu})
    out = {side: {"tok_s": statistics.median(r["tok_s"] for r in v), "cpu_s": statistics.median(r["cpu_s"] for r in v),
                  "runs": v} for side, v in runs.items()}
    out["throughput_ratio"] = out["kernel"]["tok_s"] / out["torch"]["tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="engine runs per side (1-10)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not 1 <= args.rounds <= 10:
        sys.exit("decode_bench: --rounds must be in 1-10")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    result = {"decode_attention": paged_decode.describe(),
              "read_bw_one_thread": memory_bandwidth()["read_bw"],
              "attention": [attention(r, k) for r, k in ((1, 512), (16, 384), (64, 512))],
              "experts": [experts(r) for r in (2, 4, 8, 16, 64, 128)]}
    torch.set_num_threads(threads)
    result["engine"] = engine_ab(args.rounds)
    if args.json:
        print(json.dumps(result))
        return
    print(f"decode attention: {result['decode_attention']}")
    for a in result["attention"]:
        kernel = (f"{a['kernel_ms']:.3f} ms, {a['speedup']:.1f}x, reads {a['kernel_read_bw'] / 1e9:.1f} GB/s "
                  f"({a['kernel_read_bw'] / result['read_bw_one_thread']:.0%} of one thread's "
                  f"{result['read_bw_one_thread'] / 1e9:.1f} GB/s)" if "kernel_ms" in a else "-")
        print(f"  {a['rows']:>3} rows x {a['keys']} keys: torch path {a['torch_ms']:.3f} ms, kernel {kernel}")
    for e in result["experts"]:
        print(f"  experts, {e['rows']:>3} rows ({e['experts_hit']} hit): loop {e['loop_ms']:.3f} ms, "
              f"grouped {e['grouped_ms']:.3f} ms")
    g = result["engine"]
    print(f"  engine, compare-hf workload: kernel {g['kernel']['tok_s']:.0f} tok/s ({g['kernel']['cpu_s']:.1f} s CPU), "
          f"torch path {g['torch']['tok_s']:.0f} tok/s ({g['torch']['cpu_s']:.1f} s CPU): "
          f"{g['throughput_ratio']:.2f}x")


if __name__ == "__main__":
    main()
