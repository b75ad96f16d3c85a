"""`moectl trace report` on a large PyTorch-profiler trace: its peak memory against the trace's
size (issue 24's target: a 1 GB trace within 2 GB of memory) and its parse rate.

    python bench/kineto_bench.py               # writes a ~1 GB trace in a temp folder, then reports it
    python bench/kineto_bench.py --mb 200      # a smaller one

The trace is Kineto-shaped (one rank, distributedInfo, kernel events on two streams with the
names vLLM and SGLang GPU traces carry, args as torch.profiler writes them), written
uncompressed. The report runs as a user runs it, in its own process; its peak RSS comes from
the kernel (resource.getrusage of the child), beside this machine's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

NAMES = ["flash_fwd_splitkv_kernel", "fused_moe_kernel", "ncclDevKernel_AllToAll_RING_LL",
         "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
         "sm90_xmma_gemm_bf16bf16_bf16f32", "Memcpy DtoD (Device -> Device)"]


def write_trace(path: str, target_bytes: int) -> int:
    """Kernel events until the file holds target_bytes; returns the event count."""
    n = 0
    with open(path, "w") as f:
        f.write('{"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},\n'
                '"traceEvents": [\n')
        ts = 0.0
        while f.tell() < target_bytes:
            chunk = []
            for _ in range(10_000):
                name = NAMES[n % len(NAMES)]
                chunk.append(json.dumps({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7 + (n % 2) * 13,
                                         "ts": ts, "dur": 3.5, "args": {"device": 0, "stream": 7, "correlation": n,
                                                                        "registers per thread": 128,
                                                                        "grid": [132, 1, 1], "block": [128, 1, 1]}}))
                ts += 4.0
                n += 1
            f.write(",\n".join(chunk) + ",\n")
        f.write('{"ph": "M", "name": "end"}\n]}\n')
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024, help="trace size in MB (default 1024)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.trace.json")
        t0 = time.perf_counter()
        events = write_trace(path, args.mb << 20)
        size = os.path.getsize(path)
        written_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "moectl.cli", "trace", "report", path, "--json"],
                             capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if out.returncode:
        print(out.stderr.strip().splitlines()[-1], file=sys.stderr)
        return 1
    report = json.loads(out.stdout)
    result = {"trace_bytes": size, "events": events, "report_s": round(seconds, 1), "write_s": round(written_s, 1),
              "peak_rss_bytes": peak, "peak_over_trace": round(peak / size, 2), "target_peak_bytes": 2 << 30,
              "machine_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
              "events_per_s": round(events / seconds), "classes": sorted(report["breakdown"])}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{size / 2**20:,.0f} MiB trace, {events:,} kernel events: report in {seconds:.1f} s "
              f"({events / seconds:,.0f} events/s), peak RSS {peak / 2**20:,.0f} MiB ({peak / size:.2f} of the trace; "
              f"target: a 1 GB trace within 2 GB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
