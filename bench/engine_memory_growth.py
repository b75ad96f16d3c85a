"""Does the engine's process memory grow while it serves, and is it Python's or native?

Runs the sample model on 4 emulated devices through a Poisson workload of varied prompt and
output lengths, and after a warm-up of --warmup steps compares, up to --steps steps, the growth
of the process RSS (psutil) with the growth of Python's own allocations and with glibc's view
of the C heap (mallinfo2: bytes in use, and free bytes the arenas keep). A large gap between RSS
and both in-use figures is free memory the allocator holds (fragmentation); the RSS after a
final malloc_trim says how much of it could go back. Python's allocations are counted with gc
and pymalloc blocks, or with tracemalloc (--tracemalloc: exact bytes, but every allocation is
then several times slower).

    python bench/engine_memory_growth.py [--warmup 200] [--steps 700] [--tracemalloc] [--json]
    MOECTL_NATIVE_MEMORY=off python bench/engine_memory_growth.py   # glibc's defaults, for comparison
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moectl.engine.core import native_memory  # noqa: E402
from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.engine.tools.workload import WorkloadSpec, run_workload, workload_for_engine  # noqa: E402
from moectl.placement.topology import Topology  # noqa: E402


class _Enough(Exception):
    pass


def _figures(process: psutil.Process) -> dict:
    gc.collect()
    info = native_memory.mallinfo() or {}
    return {"rss": process.memory_info().rss, "gc_objects": len(gc.get_objects()),
            "pymalloc_blocks": sys.getallocatedblocks(), "malloc_in_use": info.get("in_use"),
            "malloc_free": info.get("free")}


def measure(warmup: int, steps: int, threads: int, use_tracemalloc: bool) -> dict:
    process = psutil.Process()
    engine = LLMEngine(EngineConfig(model="engine/sample_model", topology=Topology(num_devices=4),
                                    num_threads=threads))
    items = workload_for_engine(WorkloadSpec(num_requests=400, rate=8, prompt_len=(32, 256), output_len=(32, 128),
                                             seed=1), engine)
    start: dict = {}

    def on_step(_outputs) -> None:
        if engine.step_count == warmup:
            start.update(_figures(process), t=time.monotonic())
            if use_tracemalloc:
                tracemalloc.start()
                start["python"] = tracemalloc.take_snapshot()
        if engine.step_count >= steps:
            raise _Enough

    try:
        run_workload(engine, items, realtime=False, on_step=on_step)
    except _Enough:
        pass
    end = _figures(process)
    wall = time.monotonic() - start["t"]
    python = None
    if use_tracemalloc:
        python = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(start["python"], "filename")) / 2**20
        tracemalloc.stop()
    native_memory.trim()
    mib = 2**20

    def grown(key: str) -> float | None:
        return None if end[key] is None else (end[key] - start[key]) / mib

    return {"steps": [warmup, engine.step_count], "seconds": wall,
            "steps_per_s": (engine.step_count - warmup) / wall, "allocator": native_memory.setup(),
            "rss_start_mib": start["rss"] / mib, "rss_growth_mib": grown("rss"),
            "malloc_in_use_growth_mib": grown("malloc_in_use"), "malloc_free_start_mib": (start["malloc_free"] or 0) / mib,
            "malloc_free_end_mib": (end["malloc_free"] or 0) / mib,
            "rss_after_trim_growth_mib": (process.memory_info().rss - start["rss"]) / mib,
            "gc_objects_growth": end["gc_objects"] - start["gc_objects"],
            "pymalloc_blocks_growth": end["pymalloc_blocks"] - start["pymalloc_blocks"],
            "python_growth_mib": python}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: repeatable on a shared box)")
    parser.add_argument("--tracemalloc", action="store_true", help="exact Python bytes, at a large cost in speed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.warmup < args.steps or args.threads < 1:
        parser.error("need 1 <= --warmup < --steps and --threads >= 1")
    r = measure(args.warmup, args.steps, args.threads, args.tracemalloc)
    if args.json:
        print(json.dumps(r))
        return
    print(f"steps {r['steps'][0]}-{r['steps'][1]} ({r['steps_per_s']:.2f} steps/s): RSS +{r['rss_growth_mib']:.1f} MiB "
          f"from {r['rss_start_mib']:.0f} MiB; malloc in use {r['malloc_in_use_growth_mib'] or 0:+.1f} MiB, "
          f"free in its arenas {r['malloc_free_start_mib']:.0f} -> {r['malloc_free_end_mib']:.0f} MiB; after "
          f"malloc_trim RSS {r['rss_after_trim_growth_mib']:+.1f} MiB; gc objects {r['gc_objects_growth']:+d}, "
          f"pymalloc blocks {r['pymalloc_blocks_growth']:+d}"
          + (f", Python allocations {r['python_growth_mib']:+.1f} MiB (tracemalloc)" if r["python_growth_mib"]
             is not None else ""))
    print(f"allocator settings: {r['allocator']}")


if __name__ == "__main__":
    main()
