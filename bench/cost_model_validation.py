"""Held-out prediction: the cost model fitted on one window predicts the steps of the next.

    python bench/cost_model_validation.py [--model sample] [--regime decode|prefill|mixed]
                                          [--devices 4] [--redundant 1] [--windows 4] [--json]

The engine (local backend, emulated devices) runs the rebalance suite's workload of the regime
(engine/tools/rebalance_bench.py); its records are cut into consecutive windows of the load
window's length. For each window after the first, the cost model as the engine had calibrated
it at the end of the window before (the last record's "cost_model") prices each step of this
window from its routing, under the placement in force, by the runtime's replica rule
(placement/decision.py's per-step prediction), and the rest of the step is forecast from its
batch shape by a line fitted on the previous window (rest_forecast) with the previous window's
mean link time ("step, forecast"), or is the step's own measured other time, which no
placement changes and which a preview holds as it ran ("step, placement's part": what the gate
compares). Errors are |predicted - measured| / measured per step ("measured": the expert critical
path is the slowest emulated device's measured expert time per layer; the step is the modeled
parallel step those measurements give, as every emulated figure is). The noise floor is how far
the measured critical path of a step strays from the median of the held-out steps of its own
batch shape: no per-step prediction from the batch can do better.

Targets (issue 35): median critical-path error at most 10%, step at most 5%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET_CRITICAL = 0.10
TARGET_STEP = 0.05


def timed(records: list[dict]) -> list[dict]:
    """The records basis_from_records keeps (a step time with its cost model, and routing), in order."""
    return [r for r in records if ((r.get("devices") or {}).get("step_time") or {}).get("cost_model")
            and r.get("routing") is not None]


def shape_features(records: list[dict]) -> np.ndarray:
    """[S, 5] what the rest of a step (attention, sampler, scheduling) scales with: a step, its
    prompt tokens, its decode tokens, the keys its decode tokens attend to (KV blocks in use x
    decode tokens / sequences) and its sequences."""
    rows = []
    for r in records:
        b = r["batch"]
        seqs = max(b.get("num_seqs") or 1, 1)
        kv = (r.get("cache") or {}).get("kv_blocks_used") or 0
        rows.append([1.0, b["prefill_tokens"], b["decode_tokens"], kv * b["decode_tokens"] / seqs, seqs])
    return np.array(rows, dtype=np.float64)


def rest_forecast(fit: list[dict], other_s: np.ndarray, held: list[dict]) -> np.ndarray:
    """The held-out steps' other time from their batch shape: least squares of the fit window's
    other time on shape_features, the most negative term dropped and the line refitted until no
    term is negative."""
    x, y = shape_features(fit), np.asarray(other_s, dtype=np.float64)
    keep = np.ones(x.shape[1], dtype=bool)
    for _ in range(x.shape[1]):
        coef = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            break
        keep[np.flatnonzero(keep)[np.argmin(coef)]] = False
    full = np.zeros(x.shape[1])
    full[keep] = coef
    return np.maximum(shape_features(held) @ full, 0.0)


def run(model: str, regime: str, devices: int, redundant: int, windows: int, requests: int) -> dict:
    from moectl.engine import sample_model_dir
    from moectl.engine.llm_engine import LLMEngine
    from moectl.engine.tools.rebalance_bench import measure_phase, suite_config, workload
    from moectl.placement.decision import StepBasis, _per_step, basis_from_records
    from moectl.placement.rebalancer import LOAD_WINDOW_STEPS
    from moectl.placement.step_planner import StepCost
    from moectl.placement.step_time import COEFFICIENTS

    path = sample_model_dir(model) if model in ("sample", "sample-dsv3") else Path(model)
    engine = LLMEngine(suite_config(path, devices, redundant, 16))
    records: list[dict] = []
    seed = 0
    while len(records) < (windows + 1) * LOAD_WINDOW_STEPS:
        records += measure_phase(engine, workload(requests, seed, regime), 16)["records"]
        seed += 1
    placement = engine.experts.placement
    policy = engine.experts.cluster.policy
    W = LOAD_WINDOW_STEPS
    critical_err, step_err, own_err, floor = [], [], [], []
    for w in range(1, windows + 1):
        fit, held = records[(w - 1) * W:w * W], records[w * W:(w + 1) * W]
        fitted = basis_from_records(fit)
        target = basis_from_records(held)
        if fitted is None or target is None:
            continue
        basis_fit, model_fit, _ = fitted
        basis_held, _, _ = target
        fit, held = timed(fit), timed(held)  # the steps the two bases are of
        # the held-out steps' routing; their other time forecast from their batch shape by a line
        # fitted on the previous window's steps, the previous window's mean link time
        frozen = StepBasis(basis_held.step_loads, rest_forecast(fit, basis_fit.other_s, held),
                           np.full(len(held), basis_fit.link_s.mean()), basis_held.tokens, basis_held.moe_layers)
        predicted = _per_step(StepCost(model_fit, policy), placement, frozen)
        measured_critical = np.array([r["devices"]["step_time"]["expert_critical_s"] for r in held])
        measured_step = np.array([r["devices"]["step_time"]["step_s"] for r in held])
        step_pred = frozen.other_s + predicted["critical"] + predicted["link"]
        own = basis_held.other_s + predicted["critical"] + basis_held.link_s
        critical_err += list(np.abs(predicted["critical"] - measured_critical) / measured_critical)
        step_err += list(np.abs(step_pred - measured_step) / measured_step)
        own_err += list(np.abs(own - measured_step) / measured_step)
        shapes: dict = {}
        for r, c in zip(held, measured_critical):
            shapes.setdefault((r["batch"]["prefill_tokens"], r["batch"]["decode_tokens"]), []).append(c)
        floor += [abs(c - np.median(cs)) / np.median(cs) for cs in shapes.values() if len(cs) > 2 for c in cs]
    summary = records[-1]["devices"]["step_time"]["cost_model"]
    return {"model": model, "regime": regime, "devices": devices, "redundant": redundant, "windows": windows,
            "steps_predicted": len(step_err), "clock": "modeled parallel step (emulated devices)",
            "median_critical_error": statistics.median(critical_err), "median_step_error": statistics.median(step_err),
            "median_step_error_own_other": statistics.median(own_err),
            "noise_floor_critical": statistics.median(floor) if floor else None,
            "p90_critical_error": float(np.quantile(critical_err, 0.9)), "p90_step_error": float(np.quantile(step_err, 0.9)),
            "target_critical": TARGET_CRITICAL, "target_step": TARGET_STEP,
            "coefficients": {k: summary.get(k) for k in (*COEFFICIENTS, "switch_rows")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="sample")
    ap.add_argument("--regime", default="decode", choices=("decode", "prefill", "mixed"))
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=1)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = run(args.model, args.regime, args.devices, args.redundant, args.windows, args.requests)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']}, {result['regime']}: {result['steps_predicted']} held-out steps "
          f"({result['clock']})")
    for part, target in (("critical", TARGET_CRITICAL), ("step", TARGET_STEP)):
        median = result[f"median_{part}_error"]
        print(f"  median {part} error {median:.1%} (p90 {result[f'p90_{part}_error']:.1%}): "
              f"{'meets' if median <= target else 'misses'} the {target:.0%} target")
    print(f"  step with its own other time (what a preview compares): {result['median_step_error_own_other']:.1%}; "
          f"noise floor of the measured critical path: {result['noise_floor_critical']:.1%}")
    print(f"  coefficients at the end: {result['coefficients']}")


if __name__ == "__main__":
    main()
