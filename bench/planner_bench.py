"""What the step-time planner costs and what it finds, against the token balancer, by regime.

    python bench/planner_bench.py [--layers 61] [--experts 384] [--devices 64] [--steps 16]
                                  [--rounds 3] [--json]

Synthetic windows (a Zipf popularity per layer, each step a multinomial draw) priced by two
cost models of fixed coefficients, so the answer is the planner's alone: "per-expert" (this
CPU's shape: a non-empty expert costs as much as ~60 rows) and "per-row" (a GPU-like shape).
For each regime (decode: 16 rows per step per layer and device; prefill: 512) it times
plan_step_time (placement/step_planner.py, with the target as its deadline: the search stops with
a fifth of it left for pricing the plan's migration, so the figure says whether the whole plan
fits, and the predicted gain what the search found in that time) and
plan_rebalance (the token balancer, the baseline) on the same window, median of `rounds`, and
prices both plans and the placement in force by the same model (the migration not counted).
The target (issue 35): at most 100 ms at 61 layers x 384 experts x 64 devices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moectl.placement.placement import Placement  # noqa: E402
from moectl.placement.rebalancer import plan_rebalance, synthetic_loads  # noqa: E402
from moectl.placement.step_planner import StepCost, plan_step_time  # noqa: E402
from moectl.placement.step_time import ExpertCostModel, predict_step_times  # noqa: E402
from moectl.placement.topology import Topology  # noqa: E402

TARGET_S = 0.100
MODELS = {"per-expert": ExpertCostModel.fixed(90e-6, 1.5e-6, 20e-6, 3e-5, 4),
          "per-row": ExpertCostModel.fixed(1e-6, 2e-5, 0.0, 2e-5, 4)}
REGIMES = {"decode": 16, "prefill": 512}  # rows per step, per layer and device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=TARGET_S)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    L, E, D = args.layers, args.experts, args.devices
    topology = Topology(num_devices=D, devices_per_node=min(8, D))
    current = Placement.contiguous(L, E, D, 1)
    layers = list(range(L))
    rows = []
    for regime, per_device in REGIMES.items():
        loads = synthetic_loads(L, E, tokens_per_layer=per_device * D, steps=args.steps)
        for name, model in MODELS.items():
            ours, theirs = [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                plan = plan_step_time(loads, current, topology, StepCost(model), layers, deadline_s=args.deadline)
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                tokens = plan_rebalance(loads.sum(0), topology, 1, current=current)
                theirs.append(time.perf_counter() - t0)
            price = lambda p: predict_step_times(model, p, loads, layers, 0.0, 0.0, 1.0)["step_s"]  # noqa: E731
            now, planned, balanced = price(current), price(plan.placement), price(tokens.placement)
            rows.append({"regime": regime, "model": name, "planner_s": statistics.median(ours),
                         "token_balancer_s": statistics.median(theirs),
                         "expert_time_now_s": now, "expert_time_planned_s": planned,
                         "expert_time_token_balanced_s": balanced,
                         "planned_gain": now / planned - 1, "token_balanced_gain": now / balanced - 1,
                         "planned_copies": len(plan.move_array), "token_balanced_copies": len(tokens.move_array)})
    result = {"layers": L, "experts": E, "devices": D, "steps": args.steps, "deadline_s": args.deadline,
              "target_s": TARGET_S, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{L} layers x {E} experts x {D} devices, {args.steps}-step window, deadline {args.deadline * 1e3:.0f} ms")
    for r in rows:
        print(f"  {r['regime']:7s} {r['model']:10s} planner {r['planner_s'] * 1e3:6.0f} ms "
              f"({r['planner_s'] / TARGET_S:4.1f}x the target, {r['planner_s'] / r['token_balancer_s']:4.1f}x the "
              f"token balancer's {r['token_balancer_s'] * 1e3:.0f} ms); predicted expert time {r['planned_gain']:+.1%} "
              f"with {r['planned_copies']} copies, the token balancer's {r['token_balanced_gain']:+.1%} with "
              f"{r['token_balanced_copies']}")


if __name__ == "__main__":
    main()
