"""`moectl bench --suite rebalance`: the seeds' story as a benchmark.

A workload whose routing the model itself concentrates on a few experts (prompts from one
domain: blocks of Python imports, which the sample model routes mostly to the experts the naive
contiguous placement puts on device 0) runs on the naive placement; then the console's own
preview plans a rebalance, which is applied live. Phases alternate A B A B (naive, planned,
naive, planned) with the same load, so a drift of the machine's speed falls on both sides.

* distributed: the ranks really run at once; throughput is measured wall-clock output tok/s.
* local (emulated devices): the devices run one after another, so wall-clock throughput cannot
  change with balance; the gain is that of the *modeled* parallel step time (from each device's
  measured expert time), reported as modeled, beside the measured serial figure.

`predicted_gain` is what the preview predicted before the first apply (the calibrated cost
model); the model's error is reported against what was then measured (or modeled).
"""

from __future__ import annotations

import time

import numpy as np

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.core.topology import Topology
from moectl.engine.experts.placement import Placement

MODULES = ["os", "sys", "re", "json", "time", "math", "collections", "itertools", "functools", "typing",
           "pathlib", "logging", "subprocess", "threading", "socket", "struct", "random", "string", "shutil",
           "tempfile", "argparse", "dataclasses", "contextlib", "operator", "heapq", "bisect", "copy", "enum"]


def domain_prompts(count: int, seed: int = 0) -> list[str]:
    """Import blocks of 8-24 lines: one domain, real text, routed by the model as it likes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        picks = rng.choice(MODULES, size=int(rng.integers(8, 25)))
        out.append("\n".join(f"import {m}" if rng.random() < 0.6 else f"from {m} import {m}_{int(rng.integers(9))}"
                             for m in picks) + "\n")
    return out


def _phase(engine, prompts: list[str], seconds: float, concurrency: int, params: SamplingParams, cursor: list[int]):
    """Closed loop for `seconds`: `concurrency` requests in flight (cursor: prompts used, in flight). Returns (output tokens, wall
    seconds, the step records of the phase)."""
    first_step = engine.step_count
    tokens = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        while cursor[1] < concurrency:
            engine.add_request(prompts[cursor[0] % len(prompts)], params)
            cursor[0] += 1
            cursor[1] += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            cursor[1] -= out.finished
    wall = time.perf_counter() - t0
    records = [s.as_record() for s in engine.step_log if s.step > first_step]
    return tokens, wall, records


def _summary(tokens: int, wall: float, records: list[dict]) -> dict:
    steps = [r["devices"]["step_time"] for r in records if r.get("devices")]
    step_s = np.array([s["step_s"] for s in steps])
    busy = np.array([r["devices"]["busy_s"] for r in records if r.get("devices")])
    util = busy.sum(0) / step_s.sum() if step_s.size else np.zeros(0)
    modeled = bool(steps and steps[0]["modeled"])
    # distributed: rank 0's time in the per-step gather of every rank's figures (the telemetry's cost)
    telemetry = [r["devices"]["telemetry_s"] for r in records if (r.get("devices") or {}).get("telemetry_s")]
    return {"telemetry_s_mean": float(np.mean(telemetry)) if telemetry else None,
            "telemetry_share": float(np.sum(telemetry) / step_s.sum()) if telemetry and step_s.sum() else None,
            "output_tokens": tokens, "wall_s": wall, "steps": len(records),
            "throughput_measured": tokens / wall if wall > 0 else 0.0,
            # emulated devices: tokens over the modeled parallel time of the same steps
            "throughput_parallel": tokens / step_s.sum() if step_s.sum() > 0 else 0.0,
            "step_s_mean": float(step_s.mean()) if step_s.size else 0.0, "step_time_modeled": modeled,
            "utilisation": util.tolist()}


def run_rebalance_bench(model_dir, backend: str = "local", devices: int = 2, phase_s: float = 6.0, rounds: int = 2,
                        concurrency: int = 16, max_tokens: int = 24, warmup_s: float = 3.0, dtype=None,
                        threads: int | None = None, log=print) -> dict:
    config = EngineConfig(model=str(model_dir), dtype=dtype, topology=Topology(num_devices=devices),
                          redundant_slots=1, num_threads=threads,
                          knobs=SchedulerKnobs(max_num_seqs=concurrency, max_num_batched_tokens=1024))
    group = None
    if backend == "distributed":
        from moectl.engine.parallel.group import RankGroup

        group = RankGroup(config, devices)
        engine = group.make_engine()
    elif backend == "local":
        from moectl.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    else:
        raise ValueError(f"--backend: the rebalance suite runs on local or distributed, got {backend!r}")
    try:
        return _run(engine, backend, devices, phase_s, rounds, concurrency, max_tokens, warmup_s, log)
    finally:
        engine.fail_all("abort")
        if group is not None:
            group.close()


def _run(engine, backend, devices, phase_s, rounds, concurrency, max_tokens, warmup_s, log) -> dict:
    prompts = domain_prompts(256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    cursor = [0, 0]  # prompts used, requests in flight
    naive = engine.experts.placement
    log(f"rebalance bench: {backend}, {devices} devices, {concurrency} requests in flight, phases of {phase_s:.0f} s")
    _phase(engine, prompts, warmup_s, concurrency, params, cursor)  # fills the routing window, calibrates
    plan = engine.experts.preview()
    predicted = plan.prediction or {}
    planned = plan.placement
    phases = {"before": [], "after": []}
    for r in range(rounds):
        for name, placement in (("before", naive), ("after", planned)):
            if engine.experts.placement != placement:
                engine.experts.apply(placement, kind="rebalance_apply")
                engine.run_commands()
            phases[name].append(_summary(*_phase(engine, prompts, phase_s, concurrency, params, cursor)))
            s = phases[name][-1]
            log(f"  round {r + 1} {name:6s}: {s['throughput_measured']:7.1f} tok/s measured, "
                f"{s['throughput_parallel']:7.1f} tok/s {'modeled parallel' if s['step_time_modeled'] else 'measured'}"
                f", utilisation {', '.join(f'{u:.0%}' for u in s['utilisation'])}")
    modeled = phases["before"][0]["step_time_modeled"]
    key = "throughput_parallel" if modeled else "throughput_measured"
    before = float(np.mean([p[key] for p in phases["before"]]))
    after = float(np.mean([p[key] for p in phases["after"]]))
    measured_gain = after / before - 1 if before > 0 else 0.0
    predicted_gain = predicted.get("gain")
    step_before = float(np.mean([p["step_s_mean"] for p in phases["before"]]))
    step_after = float(np.mean([p["step_s_mean"] for p in phases["after"]]))
    result = {
        "backend": backend, "devices": devices, "gain_is": "modeled" if modeled else "measured",
        "throughput_before": before, "throughput_after": after, "measured_gain": measured_gain,
        "predicted_gain": predicted_gain,
        "prediction_error": (abs(predicted_gain - measured_gain) / abs(measured_gain)
                             if predicted_gain is not None and measured_gain else None),
        "min_util_before": float(np.mean([min(p["utilisation"]) for p in phases["before"]])),
        "min_util_after": float(np.mean([min(p["utilisation"]) for p in phases["after"]])),
        "step_s_before": step_before, "step_s_after": step_after,
        "predicted_step_s_before": predicted.get("step_s_before"), "predicted_step_s_after": predicted.get("step_s_after"),
        # the cost model against the step times this run then measured (or modeled) on each placement
        "step_model_error_before": (abs(predicted["step_s_before"] - step_before) / step_before
                                    if predicted and step_before else None),
        "step_model_error_after": (abs(predicted["step_s_after"] - step_after) / step_after
                                   if predicted and step_after else None),
        "balancedness_before": plan.balancedness_before.overall, "balancedness_after": plan.balancedness_after.overall,
        "serial_throughput_before": float(np.mean([p["throughput_measured"] for p in phases["before"]])),
        "serial_throughput_after": float(np.mean([p["throughput_measured"] for p in phases["after"]])),
        "calibration": predicted.get("calibration"), "phases": phases,
        "telemetry_share": (float(np.mean([p["telemetry_share"] for p in phases["before"] + phases["after"]]))
                            if phases["before"][0]["telemetry_share"] is not None else None),
        "placement_after": Placement.to_dict(planned),
    }
    log(f"throughput {before:.1f} -> {after:.1f} tok/s ({result['gain_is']}): gain {measured_gain:+.1%}, "
        f"predicted {predicted_gain:+.1%}" if predicted_gain is not None else "no prediction")
    log(f"min utilisation before {result['min_util_before']:.0%} (target < 60%); step model error "
        f"{(result['step_model_error_before'] or 0):.1%} before / {(result['step_model_error_after'] or 0):.1%} after")
    return result
