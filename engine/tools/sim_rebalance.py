"""`moectl bench --suite rebalance --backend simulated`: what a rebalance is predicted to win on a
simulated cluster, with the same protocol as the measured suite (tools/rebalance_bench.py) where
a simulation allows it.

Per round (its own seed): a warm-up run on the naive contiguous placement fills the load window
and the planner plans from it (the console's preview, prediction included); then the same closed
workload (every request at t = 0, so the batches do not depend on step times) runs `steps`
steps once under each placement, from fresh engines. Both runs schedule the same batches (checked:
`same_batches`) and draw the same routing, so the gain is the placement's alone: tokens over the
simulated seconds of those steps. Every figure is simulated ("gain_is": "simulated").
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from moectl.engine.sim.cluster_config import SimClusterConfig
from moectl.engine.sim.cluster_engine import SimulatedEngine
from moectl.engine.tools.workload import LengthDist

PROMPT, OUTPUT = "1024-4096", "256-1024"


def _closed_run(config: SimClusterConfig, recorded, requests: int, steps: int, seed: int):
    """(engine, [(prefill, decode) per step], tokens, simulated seconds) of `steps` steps."""
    engine = SimulatedEngine(config, recorded)
    rng = np.random.default_rng(seed)
    prompts = LengthDist.parse(PROMPT).sample(rng, requests)
    outputs = LengthDist.parse(OUTPUT).sample(rng, requests)
    for p, o in zip(prompts, outputs):
        engine.add_lengths(p, o)
    shapes: list[tuple[int, int]] = []
    engine.add_listener(on_step=lambda s: shapes.append((s.record["batch"]["prefill_tokens"],
                                                          s.record["batch"]["decode_tokens"])))
    while len(shapes) < steps and engine.has_unfinished():
        engine.step()
    return engine, shapes, sum(a + b for a, b in shapes), engine.now


def run_sim_rebalance(config: SimClusterConfig, recorded=None, rounds: int = 3, steps: int = 200,
                      requests: int | None = None, log=print) -> dict:
    groups = config.devices // config.tp
    requests = requests or int(groups * config.knobs.max_num_seqs * 1.25)  # the batch stays full
    naive_config = replace(config, placement=None)
    results = []
    for r in range(rounds):
        seed = config.seed + r
        round_config = replace(naive_config, seed=seed)
        warm, _, _, _ = _closed_run(round_config, recorded, requests, 64, seed + 1000)
        plan = warm.experts.preview()
        naive, shapes_n, tokens_n, seconds_n = _closed_run(round_config, recorded, requests, steps, seed)
        planned_config = replace(round_config, placement=plan.placement)
        _, shapes_p, tokens_p, seconds_p = _closed_run(planned_config, recorded, requests, steps, seed)
        gain = (tokens_p / seconds_p) / (tokens_n / seconds_n) - 1
        predicted = plan.prediction or {}
        results.append({"round": r + 1, "seed": seed, "throughput_naive": tokens_n / seconds_n,
                        "throughput_planned": tokens_p / seconds_p, "gain": gain,
                        "predicted_gain": predicted.get("gain"), "step_model_gain": predicted.get("step_model_gain"),
                        "predicted_acts": predicted.get("acts"), "same_batches": shapes_n == shapes_p,
                        "steps": len(shapes_n), "balancedness_before": plan.balancedness_before.overall,
                        "balancedness_after": plan.balancedness_after.overall, "bytes_moved": plan.bytes_moved,
                        "migration_stall_s": predicted.get("migration_stall_s")})
        log(f"round {r + 1}: naive {tokens_n / seconds_n:,.0f} tok/s, planned {tokens_p / seconds_p:,.0f} tok/s "
            f"({gain:+.1%}; predicted {predicted.get('gain', float('nan')):+.1%}), balancedness "
            f"{plan.balancedness_before.overall:.2f} -> {plan.balancedness_after.overall:.2f} (simulated)")
    gains = [x["gain"] for x in results]
    return {"suite": "rebalance", "backend": "simulated", "gain_is": "simulated", "throughput_is": "simulated",
            "model": warm.sim_model.name, "hardware": warm.hardware.name, "devices": config.devices,
            "routing": warm.routing_line, "requests": requests, "steps": steps,
            "gain_median": float(np.median(gains)), "gain_min": float(min(gains)), "gain_max": float(max(gains)),
            "same_batches": all(x["same_batches"] for x in results), "rounds": results}
