"""`moectl trace report` and `trace import` on a large PyTorch-profiler trace: their peak memory
against the trace's size (issue 24's target: a 1 GB trace within 2 GB of memory), their speed,
and the import's report against the source's.

    python bench/kineto_bench.py               # writes a ~1 GB trace in a temp folder, then reports it
    python bench/kineto_bench.py --mb 200      # a smaller one

The trace is Kineto-shaped (one rank, distributedInfo, kernel events on two streams with the
names vLLM and SGLang GPU traces carry, args as torch.profiler writes them, each kernel's
cudaLaunchKernel and the decoder layers' ranges), written uncompressed. Each command runs as a
user runs it, in its own process; its peak RSS comes from the kernel (resource.getrusage of the
children: the largest of the command's processes, the import's trace writer included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

NAMES = ["flash_fwd_splitkv_kernel", "fused_moe_kernel", "ncclDevKernel_AllToAll_RING_LL",
         "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
         "sm90_xmma_gemm_bf16bf16_bf16f32", "Memcpy DtoD (Device -> Device)"]


def write_trace(path: str, target_bytes: int) -> int:
    """Kernel events until the file holds target_bytes; returns the kernel count. As a GPU trace
    of vLLM or SGLang holds them: each kernel with its cudaLaunchKernel on the CPU (the same
    correlation id), and every six kernels inside a decoder layer's range (with_stack)."""
    n = 0
    with open(path, "w") as f:
        f.write('{"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},\n'
                '"traceEvents": [\n')
        ts = 1.733e15  # an epoch clock, in microseconds
        while f.tell() < target_bytes:
            chunk = []
            for _ in range(10_000):
                name = NAMES[n % len(NAMES)]
                if n % len(NAMES) == 0:
                    chunk.append(json.dumps({"ph": "X", "cat": "python_function", "pid": 1, "tid": 1, "ts": ts - 30,
                                             "dur": 20, "name": f"nn.Module: DeepseekV2DecoderLayer_{n // 6 % 61}",
                                             "args": {"Python id": n, "Python parent id": 1}}))
                chunk.append(json.dumps({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                                         "tid": 1, "ts": ts - 29 + n % len(NAMES), "dur": 0.5,
                                         "args": {"correlation": n, "cbid": 211}}))
                chunk.append(json.dumps({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7 + (n % 2) * 13,
                                         "ts": ts, "dur": 3.5, "args": {"device": 0, "stream": 7, "correlation": n,
                                                                        "registers per thread": 128,
                                                                        "grid": [132, 1, 1], "block": [128, 1, 1]}}))
                ts += 4.0
                n += 1
            f.write(",\n".join(chunk) + ",\n")
        f.write('{"ph": "M", "name": "end"}\n]}\n')
    return n


def peak_of(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run cmd in a process of its own that reports the largest peak RSS of cmd and whatever it
    starts (a trace writer): (result, seconds, bytes)."""
    probe = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
             "out = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "print(json.dumps([out.returncode, out.stdout, out.stderr, time.perf_counter() - t, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024]))")
    raw = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, check=True)
    code, stdout, stderr, seconds, peak = json.loads(raw.stdout)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr), seconds, peak


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
        cli = [sys.executable, "-m", "moectl.cli", "trace"]
        out, seconds, peak = peak_of([*cli, "report", path, "--json"])
        imported, import_s, import_peak = peak_of([*cli, "import", path, "-o", os.path.join(tmp, "gpu.trace"),
                                                   "--json"])
        # the trace and its -wal (a closed trace may keep its last commits there)
        trace_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith("gpu.trace"))
        if not imported.returncode:
            again, again_s, again_peak = peak_of([*cli, "report", os.path.join(tmp, "gpu.trace"), "--json"])
    for run in (out, imported, *([again] if not imported.returncode else [])):
        if run.returncode:
            print(run.stderr.strip().splitlines()[-1], file=sys.stderr)
            return 1
    report, from_import = json.loads(out.stdout), json.loads(again.stdout)
    same = all(report[k] == from_import[k] for k in ("breakdown", "idle_s", "overlap", "layers"))
    result = {"trace_bytes": size, "kernels": events, "report_s": round(seconds, 1), "write_s": round(written_s, 1),
              "peak_rss_bytes": peak, "peak_over_trace": round(peak / size, 2), "target_peak_bytes": 2 << 30,
              "machine_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
              "kernels_per_s": round(events / seconds), "classes": sorted(report["breakdown"]),
              "layers": len(report["layers"]["by_layer"]),
              "import_s": round(import_s, 1), "import_peak_rss_bytes": import_peak, "imported_trace_bytes": trace_bytes,
              "report_of_import_s": round(again_s, 1), "report_of_import_peak_rss_bytes": again_peak,
              "import_reports_the_same": same}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{size / 2**20:,.0f} MiB trace, {events:,} kernels (and their launches and layer ranges): report in "
              f"{seconds:.1f} s ({events / seconds:,.0f} kernels/s), peak RSS {peak / 2**20:,.0f} MiB "
              f"({peak / size:.2f} of the trace; target: a 1 GB trace within 2 GB)")
        print(f"trace import: {import_s:.1f} s, peak RSS {import_peak / 2**20:,.0f} MiB (the largest of its "
              f"processes), a {trace_bytes / 2**20:,.1f} MiB moectl trace (a synthetic trace compresses far better "
              f"than a real one); its report: {again_s:.1f} s, peak RSS "
              f"{again_peak / 2**20:,.0f} MiB; figures {'equal to' if same else 'DIFFERENT from'} the source's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
