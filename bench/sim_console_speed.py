"""Simulated steps a second at the seeds' scale, against the issue's target (>= 10 at 256 devices x
61 layers x 384 experts), where a user sees them: in `moectl record` and in the live console.

    python bench/sim_console_speed.py                 # Kimi-K2's config on 256 simulated H800s
    python bench/sim_console_speed.py --seconds 20 --json

1. engine alone (the baselines): the simulated engine (engine/sim/cluster_engine.py) stepped in
   this process on its demo workload (rate auto), no listener: schedule, step model, record;
   its first N steps from an empty cluster (what record's N steps are), and the N after them
   (a fuller cluster, what the console sees after its warm-up).
2. record: `moectl record --backend simulated --steps N` as a user runs it (its own process, the
   trace written by the writer process); steps over the run's wall seconds, as record reports.
3. console: `moectl run --backend simulated`'s engine process with the console attached headless
   (MoectlApp.run_test at 160 x 50, Overview tab); app.tick is wrapped to count the step records
   that reach the console's state per second, and the ticks that brought at least one
   ("updates"), after a warm-up.

Each prints steps/s and its ratio to the engine alone. Every figure the steps carry is simulated;
the rates here are measured wall-clock rates of this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "docs" / "configs" / "kimi-k2.json")
SIM = ["--backend", "simulated", "--model", MODEL, "--devices", "256"]


def engine_alone(steps: int) -> dict:
    from moectl.engine.sim.cluster_config import SimClusterConfig
    from moectl.engine.sim.cluster_engine import SimulatedEngine
    from moectl.engine.tools.demo_workload import DemoLoad
    from moectl.engine.tools.sim_workload import SimWorkload

    engine = SimulatedEngine(SimClusterConfig(model=Path(MODEL), devices=256, routing="sample"))
    workload = SimWorkload(DemoLoad(rate="auto", prompt_len="1024-4096", output_len="256-1024"))

    def run() -> float:
        t0, done = time.perf_counter(), 0
        while done < steps:
            workload.feed(engine)
            if engine.has_unfinished():
                engine.step()
                done += 1
        return time.perf_counter() - t0

    empty, steady = run(), run()
    return {"steps": steps, "from_empty_steps_per_s": round(steps / empty, 1),
            "steady_steps_per_s": round(steps / steady, 1), "running": engine.batcher.running}


def record(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-m", "moectl.cli", "record", f"{tmp}/sim.trace", *SIM, "--steps",
                              str(steps), "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"steps": result["steps"], "seconds": result["seconds"], "steps_per_s": result["steps_per_s"],
            "trace_bytes_per_step": round(result["bytes"] / result["steps"])}


async def console(seconds: float, warmup_s: float) -> dict:
    from console_bench import measure_ticks  # the console bench's measurement (bench/ is on the path)

    from moectl.cli.engine_process import EngineProcess
    from moectl.console.engine_client import EngineSource

    process = EngineProcess(SIM)
    process.wait_ready()
    source = EngineSource(process.dir, owner=True)
    try:
        ticks = await measure_ticks(source, seconds, warmup_s, (160, 50))
    finally:
        source.close()
        process.stop()
    return {"seconds": ticks["seconds"], "steps_per_s": ticks["records_per_s"], "updates_per_s": ticks["updates_per_s"],
            "tick_ms_median": ticks["tick"]["median_ms"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps for the engine alone and for record")
    ap.add_argument("--seconds", type=float, default=15.0, help="console: measured seconds")
    ap.add_argument("--warmup", type=float, default=10.0, help="console: seconds before measuring")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    alone = engine_alone(args.steps)
    rec = record(args.steps)
    live = asyncio.run(console(args.seconds, args.warmup))
    result = {"model": "kimi-k2 (61 layers x 384 experts)", "devices": 256, "target_steps_per_s": 10,
              "engine_alone": alone, "record": rec, "console": live}
    if args.json:
        print(json.dumps(result))
        return 0
    empty, steady = alone["from_empty_steps_per_s"], alone["steady_steps_per_s"]
    print("256 simulated H800s x kimi-k2 (61 layers x 384 experts), simulated steps per wall second (target >= 10):")
    print(f"  engine alone (baselines): {empty:6.1f}/s its first {args.steps} steps, {steady:6.1f}/s the next "
          f"{args.steps} ({alone['running']} sequences running then)")
    print(f"  record:                   {rec['steps_per_s']:6.1f}/s  ({rec['steps_per_s'] / empty:.2f} of the engine "
          f"alone over the same first steps; {rec['trace_bytes_per_step']:,} trace bytes per step)")
    print(f"  console:                  {live['steps_per_s']:6.1f}/s  ({live['steps_per_s'] / steady:.2f} of the engine "
          f"alone on a fuller cluster; {live['updates_per_s']} screen updates/s, tick median "
          f"{live['tick_ms_median']} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
