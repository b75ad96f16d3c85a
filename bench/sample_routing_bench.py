"""The sample model's own routing, rebalanced, and its experts served from a per-device cache.

    python bench/sample_routing_bench.py [--json]

1. Routing recorded from a real workload through the engine (32 requests, prompts 32-256 and
   outputs 16-64 tokens, seed 3), then planned as `moectl plan rebalance` plans it, with one
   redundant slot per device, on 4 and on 8 devices: balancedness before and after.
2. Tiered expert memory in the live engine: 4 devices, each serving 16 experts (4 per layer) and
   caching 8, one workload run without prefetch and with the router's prefetch: the cache hit
   rate and each device's wait on misses over the run (measured; CPU copies here, host-to-device
   transfers on a GPU).
"""

from __future__ import annotations

import argparse
import json

from moectl.engine import sample_model_dir
from moectl.engine.llm_engine import EngineConfig, LLMEngine
from moectl.engine.tools.workload import WorkloadSpec, run_workload, workload_for_engine
from moectl.placement.rebalancer import run_plan_rebalance
from moectl.placement.topology import Topology

EXPERT_BYTES = 3 * 256 * 96 * 4  # one fp32 expert of the sample model


def rebalance_of_recorded_routing() -> dict:
    engine = LLMEngine(EngineConfig(model=str(sample_model_dir()), dtype="float32"))
    items = workload_for_engine(WorkloadSpec(num_requests=32, prompt_len=(32, 256), output_len=(16, 64), seed=3), engine)
    run_workload(engine, items, realtime=False)
    loads = sum(s.routing for s in engine.step_log).numpy()
    out = {"steps": len(engine.step_log), "tokens_routed": int(loads.sum())}
    for devices in (4, 8):
        plan = run_plan_rebalance(loads, devices, 1, devices_per_node=devices, expert_bytes=EXPERT_BYTES)
        out[f"devices_{devices}"] = {k: plan[k] for k in ("balancedness_before", "balancedness_after", "bytes_moved",
                                                          "redundant_per_device", "seconds")}
    return out


def tiered_cache() -> dict:
    out = {}
    for prefetch in ("none", "router"):
        engine = LLMEngine(EngineConfig(model=str(sample_model_dir()), dtype="float32", topology=Topology(num_devices=4),
                                        expert_cache_slots=8, expert_prefetch=prefetch))
        items = workload_for_engine(WorkloadSpec(num_requests=4, prompt_len=(32, 64), output_len=(48, 48), seed=1),
                                    engine)
        run_workload(engine, items, realtime=False)
        per_device = list(zip(*(step.devices["expert_cache"] for step in engine.step_log)))
        hits = sum(c["hits"] for dev in per_device for c in dev)
        misses = sum(c["misses"] for dev in per_device for c in dev)
        out[prefetch] = {"hit_rate": hits / max(hits + misses, 1), "hits": hits, "misses": misses,
                         "miss_wait_s_per_device": [sum(c["miss_wait_s"] for c in dev) for dev in per_device],
                         "steps": len(engine.step_log)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)
    result = {"rebalance": rebalance_of_recorded_routing(), "tiered": tiered_cache()}
    if args.json:
        print(json.dumps(result))
        return 0
    r, t = result["rebalance"], result["tiered"]
    for devices in (4, 8):
        p = r[f"devices_{devices}"]
        print(f"recorded routing, {devices} devices, 1 redundant slot: balancedness {p['balancedness_before']:.3f} -> "
              f"{p['balancedness_after']:.3f}")
    for prefetch, c in t.items():
        waits = c["miss_wait_s_per_device"]
        print(f"tiered experts, prefetch {prefetch}: hit rate {c['hit_rate']:.1%}, miss wait per device "
              f"{min(waits) * 1e3:.1f}-{max(waits) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
