"""Where a step's time goes on parallel devices, and what evening out the expert time could win.

    python bench/step_breakdown.py [--model sample-dsv3] [--backend distributed --nproc 2 | --devices 4]
                                   [--requests 48] [--concurrency 16] [--json]

Runs the rebalance suite's workload (`moectl bench --suite rebalance`: one-domain prompts, the
same settling pass, the prefix cache off) once on the naive contiguous placement and sums the
spans of the engine's timeline (rank 0's own lanes on the distributed backend: its engine lane,
its experts and its collectives, all measured) over the phase's steps, as shares of the
measured step wall time.

The estimate: in every MoE layer the ranks wait for the busiest one's experts, so a placement
that evened the expert time out perfectly would save, per step, the critical expert time minus
the mean rank's: sum(expert_critical_s - mean(busy_s)) over the steps, as a share of their step
time, for a gain of saved / (1 - saved). It is an estimate, not a bound: it counts the expert
compute only (not the waits that follow it elsewhere in the step), and it is measured on one
phase. The suite's target (+15%) needs an estimate well above it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moectl.wire.link_spans import with_link_spans  # noqa: E402


def breakdown(records: list[dict]) -> dict:
    """Span seconds by (lane, name) and the rebalance ceiling, over these step records."""
    spans: dict[str, float] = defaultdict(float)
    for record in records:
        table = with_link_spans(record)["spans"]  # the emulated backend's modeled link spans too
        for lane, name, dur in zip(table["lane"], table["name"], table["dur_s"]):
            spans[f"{table['lanes'][lane]}: {table['names'][name]}"] += float(dur)
    step_s = sum(r["devices"]["step_time"]["step_s"] for r in records)
    wall_s = sum(r["t_end"] - r["t_start"] for r in records)
    critical = sum(r["devices"]["step_time"]["expert_critical_s"] for r in records)
    mean_busy = sum(float(np.mean(r["devices"]["busy_s"])) for r in records)
    saved = (critical - mean_busy) / step_s
    busy = np.sum([r["devices"]["busy_s"] for r in records], axis=0)
    return {"steps": len(records), "step_s": step_s, "wall_s": wall_s,
            "modeled": bool(records[0]["devices"]["step_time"]["modeled"]),
            "spans": {name: seconds for name, seconds in sorted(spans.items(), key=lambda kv: -kv[1])
                      if seconds >= 1e-4 * wall_s},
            "utilisation": (busy / step_s).tolist(), "expert_critical_share": critical / step_s,
            "balance_saves_share": saved, "gain_estimate": saved / (1 - saved)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sample-dsv3")
    parser.add_argument("--backend", default="distributed", choices=("local", "distributed"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--devices", type=int, default=None, help="local backend: emulated devices (default 4)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from moectl.engine import resolve_model
    from moectl.engine.parallel.backends import Engines
    from moectl.engine.tools.rebalance_bench import measure_phase, settle, suite_config, workload

    devices = args.nproc if args.backend == "distributed" else (args.devices or 4)
    engines = Engines(suite_config(resolve_model(args.model), devices, 0, args.concurrency), args.backend)
    try:
        engine = engines.make_engine()
        try:
            settle(engine, args.requests, args.concurrency)
            phase = measure_phase(engine, workload(args.requests, 1), args.concurrency)
        finally:
            engine.fail_all("abort")
    finally:
        engines.close()
    result = {"model": args.model, "backend": args.backend, "devices": devices,
              "throughput": phase["throughput_measured"], **breakdown(phase["records"])}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    clock = "modeled" if result["modeled"] else "measured"
    print(f"{args.model}, {args.backend}, {devices} devices: {result['steps']} steps, "
          f"{result['throughput']:,.0f} tok/s measured; spans as shares of the measured step wall time:")
    for name, seconds in result["spans"].items():
        print(f"  {name:32s} {seconds * 1e3:9.1f} ms  {seconds / result['wall_s']:6.1%}")
    if result["modeled"]:
        print(f"the devices' parallel step (modeled: emulated devices run one after another) is "
              f"{result['step_s'] / result['wall_s']:.0%} of the measured wall time; the figures below are of it")
    print(f"devices busy with experts: {', '.join(f'{u:.0%}' for u in result['utilisation'])} of the {clock} "
          f"step; the busiest device's experts (per layer) {result['expert_critical_share']:.1%} of it")
    print(f"evening the expert time out would save {result['balance_saves_share']:.1%} of the step: a gain of "
          f"about {result['gain_estimate']:+.1%} from the experts' side")


if __name__ == "__main__":
    main()
