"""The step model against this machine: simulated against measured step times of moectl's
distributed backend, 2 and 4 ranks, both sample models, naive and rebalanced placements
(issue 23's target: median absolute error at most 10%).

    python bench/sim_machine_validation.py            # records, calibrates and compares (~5 min)
    python bench/sim_machine_validation.py --json

Per case (model x ranks):
1. measured: `moectl record --backend distributed --nproc R --model M --steps 160 --rebalance-at 80`,
   the record's default workload; each step's step_time.step_s is measured on the ranks;
2. the profile: `moectl sim calibrate --ranks R --model M` (this machine, the engine's kernels,
   gloo's all_reduce between R processes, the engine's own per-layer overhead);
3. simulated: each recorded step priced by the step model on that profile with moectl's ranks'
   layout (attention tensor parallel over the R ranks, experts' outputs all-reduced) and the
   placement in force, its load from the record (engine/sim/trace_load.py: tokens, KV held, the
   step's own routing);
4. the error of each step, |simulated / measured - 1|; the case's median and its 10th-90th
   percentiles, per placement (the first 20 steps and the migration step left out).
Nothing is fitted per case: the profile's figures are measured by calibrate, which sees no trace.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

WARMUP_STEPS = 20
STEPS, REBALANCE_AT = 160, 80


def moectl(*args) -> str:
    out = subprocess.run([sys.executable, "-m", "moectl.cli", *map(str, args)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"moectl {' '.join(map(str, args[:2]))}: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout


def price(trace: Path, profile: Path) -> list[dict]:
    from moectl.engine.sim.hardware import load_profile
    from moectl.engine.sim.model_shape import load_sim_model
    from moectl.engine.sim.routing import balanced
    from moectl.engine.sim.step_model import SimSpec, simulate
    from moectl.engine.sim.trace_load import load_from_record, mean_prompt
    from moectl.placement.placement import Placement
    from moectl.profiler.trace_queries import placement_timeline
    from moectl.profiler.trace_store import TraceReader

    with TraceReader(trace) as reader:
        header = reader.header
        model = load_sim_model(header["model"]["path"], "fp32")
        shape = model.shape
        moe = [i for i, s in enumerate(shape.sparse_layers) if s]
        ranks = int(header["devices"]["topology"]["num_devices"])
        block = int(header["engine_config"].get("block_size", 16))
        timeline = placement_timeline(reader)
        records = list(reader.steps())
    prompt = mean_prompt(e for r in records for e in r.get("requests") or ())
    spec = SimSpec(model, load_profile(profile), ranks, balanced(shape.num_sparse, shape.num_experts),
                   tokens_per_device=1, context=1, tp=ranks, exchange="all-reduce",
                   placement=Placement(timeline[0][1].slots[moe], shape.num_experts))
    changes = [s for s, _ in timeline[1:]]
    rows = []
    for record in records:
        step = record["step"]
        step_time = (record.get("devices") or {}).get("step_time") or {}
        if step <= WARMUP_STEPS or any(step == c + 1 for c in changes) or not step_time.get("step_s"):
            continue  # warm-up, and a migration's step: neither is a placement's steady step
        placed = [p for s, p in timeline if s < step][-1]
        spec = replace(spec, placement=Placement(placed.slots[moe], shape.num_experts))
        simulated = simulate(spec, load_from_record(record, shape, moe, block, prompt))["step_ms"] / 1e3
        batch = record["batch"]
        rows.append({"step": step, "placement": "naive" if placed == timeline[0][1] else "rebalanced",
                     "measured_s": float(step_time["step_s"]), "simulated_s": simulated,
                     "shape": (batch["prefill_tokens"], batch["decode_tokens"])})
    return rows


def run_case(model: str, ranks: int, tmp: Path, log) -> list[dict]:
    trace, profile = tmp / f"{model}-{ranks}.trace", tmp / f"{model}-{ranks}.json"
    log(f"{model}, {ranks} ranks: recording {STEPS} steps ...")
    moectl("record", trace, "--backend", "distributed", "--nproc", ranks, "--model", model, "--steps", STEPS,
           "--rebalance-at", REBALANCE_AT)
    log(f"{model}, {ranks} ranks: calibrating ...")
    moectl("sim", "calibrate", "--out", profile, "--ranks", ranks, "--model", model)
    rows = price(trace, profile)
    cases = []
    for placement in ("naive", "rebalanced"):
        picked = [r for r in rows if r["placement"] == placement]
        if not picked:
            continue
        errors = np.array([abs(r["simulated_s"] / r["measured_s"] - 1) for r in picked])
        signed = np.array([r["simulated_s"] / r["measured_s"] - 1 for r in picked])
        # the machine's own noise: how far a measured step strays from the median of the steps
        # of its batch shape (shapes seen at least 3 times)
        by_shape: dict = {}
        for r in picked:
            by_shape.setdefault(r["shape"], []).append(r["measured_s"])
        noise = [abs(x / np.median(xs) - 1) for xs in by_shape.values() if len(xs) >= 3 for x in xs]
        cases.append({"model": model, "ranks": ranks, "placement": placement, "steps": len(picked),
                      "measured_ms_median": float(np.median([r["measured_s"] for r in picked]) * 1e3),
                      "simulated_ms_median": float(np.median([r["simulated_s"] for r in picked]) * 1e3),
                      "error_median": float(np.median(errors)), "error_p10": float(np.percentile(errors, 10)),
                      "error_p90": float(np.percentile(errors, 90)), "bias_median": float(np.median(signed)),
                      "noise_floor": float(np.median(noise)) if noise else None})
        c = cases[-1]
        c["error_of_medians"] = abs(c["simulated_ms_median"] / c["measured_ms_median"] - 1)
        log(f"  {placement:10s} {c['steps']:3d} steps: measured {c['measured_ms_median']:.2f} ms, simulated "
            f"{c['simulated_ms_median']:.2f} ms (medians; {c['error_of_medians']:.1%} apart); per step |error| median "
            f"{c['error_median']:.1%} (p10-p90 {c['error_p10']:.1%}-{c['error_p90']:.1%}), signed "
            f"{c['bias_median']:+.1%}; the measured steps' own spread within a batch shape: "
            + (f"{c['noise_floor']:.1%}" if c["noise_floor"] is not None else "-"))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["sample", "sample-dsv3"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for ranks in args.ranks:
                cases += run_case(model, ranks, Path(tmp), log)
    errors = [c["error_median"] for c in cases]
    result = {"cases": cases, "median_of_case_errors": float(np.median(errors)), "target": 0.10,
              "within_target": sum(e <= 0.10 for e in errors),
              "median_error_of_medians": float(np.median([c["error_of_medians"] for c in cases])),
              "median_noise_floor": float(np.median([c["noise_floor"] for c in cases if c["noise_floor"] is not None]))}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"median of the {len(cases)} cases' per-step median |error|: {result['median_of_case_errors']:.1%} "
              f"(target <= 10%); {result['within_target']} of {len(cases)} cases within it; the cases' medians "
              f"{result['median_error_of_medians']:.1%} apart (median); the measured steps' own spread "
              f"{result['median_noise_floor']:.1%} (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
