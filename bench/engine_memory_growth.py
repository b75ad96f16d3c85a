"""Does the engine's process memory grow while it serves, and is it Python's or native?

Runs the sample model on 4 emulated devices through a Poisson workload of varied prompt and
output lengths, and after a warm-up of --warmup steps compares, up to --steps steps, the growth
of the process RSS (psutil) with the growth of Python's own allocations (tracemalloc). A large
gap points at native memory (torch / the C allocator), not at objects the engine keeps.

    python bench/engine_memory_growth.py [--warmup 200] [--steps 700] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.topology import Topology  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.engine.tools.workload import WorkloadSpec, run_workload, workload_for_engine  # noqa: E402


class _Enough(Exception):
    pass


def measure(warmup: int, steps: int) -> dict:
    process = psutil.Process()
    engine = LLMEngine(EngineConfig(model="engine/sample_model", topology=Topology(num_devices=4)))
    items = workload_for_engine(WorkloadSpec(num_requests=400, rate=8, prompt_len=(32, 256), output_len=(32, 128),
                                             seed=1), engine)
    start: dict = {}

    def on_step(_outputs) -> None:
        if engine.step_count == warmup:
            gc.collect()
            tracemalloc.start()
            start.update(rss=process.memory_info().rss, python=tracemalloc.take_snapshot())
        if engine.step_count >= steps:
            raise _Enough

    try:
        run_workload(engine, items, realtime=False, on_step=on_step)
    except _Enough:
        pass
    gc.collect()
    python = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(start["python"], "filename"))
    return {"steps": [warmup, engine.step_count], "rss_growth_mib": (process.memory_info().rss - start["rss"]) / 2**20,
            "python_growth_mib": python / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.warmup, args.steps)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"steps {result['steps'][0]}-{result['steps'][1]}: RSS +{result['rss_growth_mib']:.1f} MiB, "
              f"Python allocations +{result['python_growth_mib']:.1f} MiB (tracemalloc)")


if __name__ == "__main__":
    main()
