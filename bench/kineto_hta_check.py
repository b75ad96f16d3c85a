"""moectl's Kineto figures against Holistic Trace Analysis' on the same traces: each rank's GPU
idle time and its communication-computation overlap (issue 24 asks to check them there).

    pip install holistictraceanalysis      # not a moectl dependency: it pulls in Jupyter
    python bench/kineto_hta_check.py [--ranks 4] [--kernels 4000] [--seed 0]

The traces: one per rank, Kineto-shaped as vLLM and SGLang write them on GPUs (distributedInfo,
kernel events on a compute stream and a communication stream, names those engines' kernels
carry), random whole-microsecond kernel lengths and gaps (HTA rounds fractional microseconds
down, which alone would make its idle time larger), a NCCL kernel on its own stream after every
fifth compute kernel, starting inside it. moectl's `trace report` (profiler/kineto.py) and HTA's
TraceAnalysis read the same folder: HTA's get_temporal_breakdown idle time and its
get_comm_comp_overlap percentage beside moectl's idle_s and overlap fraction, per rank.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path


def write_folder(folder: Path, ranks: int, kernels: int, seed: int, fractional: bool = False) -> None:
    rng = random.Random(seed)
    # whole microseconds unless fractional: HTA rounds fractional ones down
    draw = rng.uniform if fractional else (lambda lo, hi: float(rng.randint(int(lo), int(hi))))
    names = ["flash_fwd_splitkv_kernel", "fused_moe_kernel", "sm90_xmma_gemm_bf16bf16_bf16f32",
             "void at::native::vectorized_elementwise_kernel<4>"]
    for rank in range(ranks):
        events, ts, corr = [], 0.0, 0
        for i in range(kernels):
            dur = draw(5, 50)
            events.append({"ph": "X", "cat": "kernel", "name": rng.choice(names), "pid": rank, "tid": 7, "ts": ts,
                           "dur": dur, "args": {"device": rank, "stream": 7, "correlation": corr, "External id": corr}})
            corr += 1
            if i % 5 == 4:  # a collective on its own stream, starting inside the last kernel
                start = ts + draw(0, dur)
                events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllToAll_RING_LL", "pid": rank,
                               "tid": 20, "ts": start, "dur": draw(10, 80),
                               "args": {"device": rank, "stream": 20, "correlation": corr, "External id": corr}})
                corr += 1
            ts += dur + draw(0, 10)  # a gap: idle unless a collective covers it
        doc = {"schemaVersion": 1, "deviceProperties": [{"id": rank, "name": "NVIDIA H100 80GB HBM3"}],
               "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": ranks}, "traceEvents": events}
        (folder / f"rank-{rank}.json").write_text(json.dumps(doc))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kernels", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fractional", action="store_true", help="fractional microseconds (HTA rounds them down)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout (the lines go to stderr)")
    args = ap.parse_args(argv)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        print("needs Holistic Trace Analysis: pip install holistictraceanalysis", file=sys.stderr)
        return 2
    from moectl.profiler.kineto import report

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_folder(folder, args.ranks, args.kernels, args.seed, args.fractional)
        ours = report(folder)
        hta = TraceAnalysis(trace_dir=str(folder))
        breakdown = hta.get_temporal_breakdown(visualize=False)
        overlap = hta.get_comm_comp_overlap(visualize=False)
    say(f"{args.ranks} ranks x {args.kernels:,} kernels (seed {args.seed}"
          f"{', fractional microseconds' if args.fractional else ''}):")
    hta_overlap = {int(r["rank"]): float(r["comp_comm_overlap_pctg"]) / 100 for _, r in overlap.iterrows()}
    hta_idle = {int(r["rank"]): float(r["idle_time(us)"]) * 1e-6 for _, r in breakdown.iterrows()}
    worst_overlap = worst_idle = 0.0
    for r in sorted(ours["ranks"], key=lambda r: r["rank"]):
        rank = r["rank"]
        o, h = r["overlap"]["fraction"], hta_overlap.get(rank)
        i, hi = r["idle_s"], hta_idle.get(rank)
        worst_overlap = max(worst_overlap, abs(o - h)) if h is not None else worst_overlap
        worst_idle = max(worst_idle, abs(i - hi) / hi) if hi else worst_idle
        say(f"  rank {rank}: overlap moectl {o:.2%}, HTA {h:.2%}; idle moectl {i * 1e3:.3f} ms, HTA {hi * 1e3:.3f} ms")
    say(f"largest difference: overlap {worst_overlap:.2%} (points), idle {worst_idle:.1%}")
    if args.json:
        import importlib.metadata

        print(json.dumps({"ranks": args.ranks, "kernels": args.kernels, "fractional": args.fractional,
                          "hta_version": importlib.metadata.version("holistictraceanalysis"),
                          "overlap_max_diff_points": worst_overlap, "idle_max_diff_ratio": worst_idle}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
