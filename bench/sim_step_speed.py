"""How many simulated steps a second the step model computes at the seeds' scale, against the
console's target of at least 10 (issue 23).

    python bench/sim_step_speed.py [--devices 256] [--steps 20] [--json]

Kimi-K2's config (61 layers, 384 routed experts) on --devices H200s, Zipf-1.0 routing, decode at
128 sequences per device; the median of --steps calls of `simulate` (the whole step model: every
layer's expert GEMMs per device and its all-to-alls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args()
    from moectl.engine.sim.hardware import load_profile
    from moectl.engine.sim.model_shape import load_sim_model
    from moectl.engine.sim.routing import zipf
    from moectl.engine.sim.step_model import SimSpec, simulate

    model = load_sim_model(ROOT / "docs" / "configs" / "kimi-k2.json")
    shape = model.shape
    spec = SimSpec(model, load_profile("h200"), args.devices, zipf(shape.num_sparse, shape.num_experts, 1.0),
                   tokens_per_device=128, context=4096)
    simulate(spec)  # warm-up
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        simulate(spec)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    if args.json:
        print(json.dumps({"devices": args.devices, "layers": shape.num_layers, "experts": shape.num_experts,
                          "steps": args.steps, "median_s": median, "steps_per_s": 1 / median, "target_steps_per_s": 10}))
        return
    print(f"{args.devices} devices x {shape.num_layers} layers x {shape.num_experts} experts: {median * 1e3:.1f} ms "
          f"per simulated step (median of {args.steps}), {1 / median:.0f} steps/s (target >= 10)")


if __name__ == "__main__":
    main()
