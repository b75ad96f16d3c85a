"""Benchmark the expert rebalancer: planning time and balancedness at DeepSeek-V3 scale.

    python bench/rebalance_bench.py                      # 61 layers x 384 experts x 64 devices
    python bench/rebalance_bench.py --loads loads.npy    # recorded [layers, experts] loads (.npy/.json)
    python bench/rebalance_bench.py --skew 0.8 --json

Times plan_rebalance (median wall time of --repeat runs after one warm-up, and the CPU time,
which a busy machine inflates less) against the 100 ms target,
reports balancedness before (contiguous placement) and after, and the bytes moved; then
re-plans after a load drift (each expert's load times 1 +- --drift), from the plan itself (for
the best balance, and aiming at --target while moving as little as it can) and from scratch,
to show what migration awareness saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moectl.placement.rebalancer import (  # noqa: E402
    DEFAULT_EXPERT_BYTES,
    load_loads_file,
    plan_rebalance,
    run_plan_rebalance,
    synthetic_loads,
)
from moectl.placement.topology import Topology, format_size  # noqa: E402

TARGET_MS = 100.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", help="[layers, experts] loads file (.npy or .json); default: synthetic Zipf")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--devices-per-node", type=int, default=8)
    ap.add_argument("--redundant", type=int, default=1, help="redundant slots per device")
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the synthetic loads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-bytes", type=int, default=DEFAULT_EXPERT_BYTES,
                    help="bytes per expert (default: a DeepSeek-V3 expert in FP8)")
    ap.add_argument("--drift", type=float, default=0.1, help="relative load noise for the re-plan check")
    ap.add_argument("--target", type=float, default=0.99,
                    help="balancedness the migration-aware re-plan aims for (moving as little as it can)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    try:
        if args.loads:
            loads = load_loads_file(args.loads)
            source = f"loads from {args.loads}"
        else:
            loads = synthetic_loads(args.layers, args.experts, args.seed, args.skew)
            source = f"synthetic Zipf skew {args.skew}, seed {args.seed}"
        topo = Topology(num_devices=args.devices, devices_per_node=args.devices_per_node)
        result = run_plan_rebalance(loads, args.devices, args.redundant, args.devices_per_node, args.expert_bytes)
    except ValueError as exc:
        print(f"rebalance_bench: error: {exc}", file=sys.stderr)
        return 2

    times, cpu = [], []
    for i in range(max(args.repeat, 1) + 1):  # the first run is a warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_rebalance(loads, topo, args.redundant, expert_bytes=args.expert_bytes)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    median_ms = statistics.median(times)

    # migration awareness: the same workload a little later, re-planned from the plan in force
    rng = np.random.default_rng(args.seed + 1)
    drifted = loads * rng.uniform(1 - args.drift, 1 + args.drift, loads.shape)
    replan = plan_rebalance(drifted, topo, args.redundant, current=plan.placement, expert_bytes=args.expert_bytes)
    t0 = time.perf_counter()
    aimed = plan_rebalance(drifted, topo, args.redundant, current=plan.placement, expert_bytes=args.expert_bytes,
                           target=args.target)
    aimed_ms = (time.perf_counter() - t0) * 1e3
    scratch = plan_rebalance(drifted, topo, args.redundant, expert_bytes=args.expert_bytes)
    total_slots = plan.placement.slots.size

    result.update({
        "source": source, "ms_median": median_ms, "ms_min": min(times), "ms_max": max(times),
        "cpu_ms_median": statistics.median(cpu),
        "runs": len(times), "target_ms": TARGET_MS, "ratio_to_target": median_ms / TARGET_MS,
        "drift": {"noise": args.drift, "balancedness_before": replan.balancedness_before.overall,
                  "balancedness_after": replan.balancedness_after.overall,
                  "bytes_moved": replan.bytes_moved, "moves": len(replan.move_array),
                  "from_scratch_bytes_moved": scratch.bytes_moved,
                  "from_scratch_balancedness_after": scratch.balancedness_after.overall,
                  "slots_moved_share": len(replan.move_array) / total_slots,
                  "target": args.target, "target_balancedness_after": aimed.balancedness_after.overall,
                  "target_moves": len(aimed.move_array), "target_slots_moved_share": len(aimed.move_array) / total_slots,
                  "target_bytes_moved": aimed.bytes_moved, "target_ms": aimed_ms},
    })
    if args.json:
        print(json.dumps(result))
        return 0

    L, E, D = result["layers"], result["experts"], result["devices"]
    slots = L * D * result["slots_per_device"]
    after_min = min(result["balancedness_after_per_layer"])
    print(f"plan_rebalance: {L} layers x {E} experts x {D} devices ({result['nodes']} node"
          f"{'s' if result['nodes'] != 1 else ''}), {args.redundant} redundant slot(s)/device; {source}")
    print(f"  time          median {median_ms:.1f} ms over {len(times)} runs (min {min(times):.1f}, "
          f"max {max(times):.1f}) = {median_ms / TARGET_MS:.2f}x the {TARGET_MS:.0f} ms target; "
          f"CPU time {statistics.median(cpu):.1f} ms")
    print(f"  balancedness  {result['balancedness_before']:.4f} (contiguous) -> {result['balancedness_after']:.4f} "
          f"(worst layer {after_min:.4f}); max replicas of one expert {result['max_replicas']}")
    print(f"  moved         {result['moves']} of {slots} slots, {format_size(result['bytes_moved'])} "
          f"at {format_size(args.expert_bytes)} per expert")
    d = result["drift"]
    print(f"  re-plan after +-{args.drift:.0%} drift: {d['moves']} slots ({d['slots_moved_share']:.1%}), "
          f"{format_size(d['bytes_moved'])} (from scratch: {format_size(d['from_scratch_bytes_moved'])}); "
          f"balancedness {d['balancedness_before']:.4f} -> {d['balancedness_after']:.4f} "
          f"(from scratch {d['from_scratch_balancedness_after']:.4f})")
    print(f"  aiming at {d['target']}: {d['target_moves']} slots ({d['target_slots_moved_share']:.1%}), "
          f"{format_size(d['target_bytes_moved'])}; balancedness {d['balancedness_before']:.4f} -> "
          f"{d['target_balancedness_after']:.4f}; planned in {d['target_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
