"""`moectl bench --suite rebalance`: the seeds' story as a benchmark.

A workload whose routing the model itself concentrates on a few experts (prompts from one
domain: blocks of Python imports) runs on the naive contiguous placement; the engine's own
preview then plans a rebalance, which is applied live, between steps.

The plan is made on warm-up requests and measured on other requests drawn from the same
workload (another seed): what a rebalance planned on recent traffic does to the traffic that
follows. Every measured phase runs those same requests in the same order, closed loop, with the
prefix cache off, so the engine schedules the same batches step for step whatever the placement
(routing does not depend on placement): `same_batches` compares every step's batch (prefill
tokens, decode tokens, sequences) between phases. Phases run in rounds of one naive and one
planned phase, the order alternating (A B, B A, ...), so a drift of the machine's speed falls on
both sides; each round's gain is its planned over its naive throughput, and `gain_ci95` is the
95% interval of their mean (Student's t over the rounds).

One unmeasured pass of a third draw of the workload runs before everything, so the plan's window
does not measure the machine settling.

* distributed: the ranks really run at once; a phase's throughput is tokens (prefill + decode)
  over its measured wall time: `gain_is` "measured", and the gain is also `measured_gain`.
* local (emulated devices): the devices run one after another, so wall time cannot change with
  balance; a phase's throughput is over the *modeled* parallel step time of its steps (from
  each device's measured expert time): `gain_is` "modeled", and the gain is also
  `modeled_gain`, never called measured. The serial (measured) throughputs are reported beside.

`predicted_gain` is what the preview predicted before the apply (the calibrated cost model over
the warm-up's recent steps); `predicted_gain_phase` is the same model over all the warm-up's
steps. The model's error is reported against what was then measured (or modeled).
"""

from __future__ import annotations

import time

import numpy as np

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.parallel.backends import Engines
from moectl.placement.decision import predict_from_records
from moectl.placement.topology import Topology
from moectl.wire.actions import Action

MODULES = ["os", "sys", "re", "json", "time", "math", "collections", "itertools", "functools", "typing",
           "pathlib", "logging", "subprocess", "threading", "socket", "struct", "random", "string", "shutil",
           "tempfile", "argparse", "dataclasses", "contextlib", "operator", "heapq", "bisect", "copy", "enum"]


REGIMES = ("decode", "prefill", "mixed")
# prefill: prompts of about 1-2K tokens (an import line is 4-7 tokens) with a few output tokens,
# chunked at the suite's step budget, where rows per active expert run into the hundreds
PREFILL_LINES = (200, 330)
PREFILL_OUTPUT = (2, 5)


def domain_prompts(count: int, seed: int = 0, lines: tuple[int, int] = (8, 25)) -> list[str]:
    """Import blocks of 8-24 lines (or `lines`): one domain, real text, routed by the model as it likes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        picks = rng.choice(MODULES, size=int(rng.integers(*lines)))
        out.append("\n".join(f"import {m}" if rng.random() < 0.6 else f"from {m} import {m}_{int(rng.integers(9))}"
                             for m in picks) + "\n")
    return out


def measure_phase(engine, requests: list[tuple[str, SamplingParams]], concurrency: int) -> dict:
    """The requests, closed loop with `concurrency` in flight, to the end."""
    first_step = engine.step_count
    pending = list(requests)
    in_flight = 0
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            engine.add_request(*pending.pop(0))
            in_flight += 1
        in_flight -= sum(1 for out in engine.step() if out.finished)
    wall = time.perf_counter() - t0
    records = [s.as_record() for s in engine.step_log if s.step > first_step]
    return _summary(wall, records)


def _summary(wall: float, records: list[dict]) -> dict:
    devices = [r["devices"] for r in records]
    step_s = np.array([d["step_time"]["step_s"] for d in devices])
    tokens = sum(r["batch"]["prefill_tokens"] + r["batch"]["decode_tokens"] for r in records)
    busy = np.array([d["busy_s"] for d in devices])
    modeled = bool(devices[0]["step_time"]["modeled"])
    telemetry = [d["telemetry_s"] for d in devices if d.get("telemetry_s")]
    return {"steps": len(records), "tokens": tokens, "wall_s": wall,
            "throughput_measured": tokens / wall,
            # emulated devices: the same tokens over the modeled parallel time of the same steps
            "throughput_parallel": tokens / step_s.sum(),
            "step_s_mean": float(step_s.mean()), "step_time_modeled": modeled,
            "utilisation": (busy.sum(0) / step_s.sum()).tolist(),
            # distributed: rank 0's time in the per-step gather of every rank's figures
            "telemetry_share": float(np.sum(telemetry) / step_s.sum()) if telemetry else None,
            "records": records}


def suite_config(model_dir, devices: int, redundant: int, concurrency: int, dtype=None,
                 threads: int | None = None, overlap: str = "none") -> EngineConfig:
    """The suite's engine: `concurrency` sequences at most, the prefix cache off (so every phase
    schedules the same batches). overlap: the distributed backend's (none | two-batch)."""
    return EngineConfig(model=str(model_dir), dtype=dtype, topology=Topology(num_devices=devices),
                        redundant_slots=redundant, num_threads=threads, enable_prefix_caching=False,
                        knobs=SchedulerKnobs(max_num_seqs=concurrency, max_num_batched_tokens=1024), overlap=overlap)


def settle(engine, requests: list, concurrency: int) -> None:
    """One unmeasured pass of a third draw of the workload: on the ranks the first pass ran 20-30%
    slower than later ones (allocators and caches settling), which would fall on the next
    measured phase alone."""
    measure_phase(engine, requests, concurrency)


def run_rebalance_bench(model_dir, backend: str = "local", devices: int = 2, requests: int = 48, rounds: int = 10,
                        concurrency: int = 16, redundant: int = 0, dtype=None, threads: int | None = None,
                        regime: str = "decode", spec=None, log=print, overlap: str = "none") -> dict:
    """redundant: spare expert slots per device for replicas of hot experts; 0 re-hashes the
    experts over the devices (the seeds' move), without replicas to choose between. regime: the
    built-in workload's (workload()); spec: a WorkloadSpec (a JSONL file of {"prompt",
    "max_tokens"} lines, or a synthetic spec) instead, its requests split into planning and
    measured ones (split_workload)."""
    if spec is None:
        draws = (workload(requests, 0, regime), workload(requests, 1, regime), workload(requests, 2, regime))
    config = suite_config(model_dir, devices, redundant, concurrency, dtype, threads, overlap)
    if backend not in ("local", "distributed"):
        raise ValueError(f"--backend: the rebalance suite runs on local or distributed, got {backend!r}")
    engines = Engines(config, backend)
    try:
        engine = engines.make_engine()
        if spec is not None:
            from moectl.engine.tools.workload import workload_for_engine

            draws = split_workload([(item.prompt_ids, item.params) for item in workload_for_engine(spec, engine)],
                                   requests)
            regime = "given workload"
        try:
            return {"redundant_slots": redundant, "regime": regime,
                    **_run(engine, backend, devices, draws, rounds, concurrency, log)}
        finally:
            engine.fail_all("abort")
    finally:
        engines.close()


def _apply(engine, placement) -> dict:
    result = engine.experts.apply(placement, kind=Action.REBALANCE_APPLY)
    engine.run_commands()  # between steps, as the engine thread would
    return result.result(timeout=60)


def workload(num_requests: int, seed: int, regime: str = "decode") -> list[tuple[str, SamplingParams]]:
    """One draw of the bench's workload.

    decode: short import blocks, outputs of staggered lengths (8-40 tokens, so requests do not
      finish in waves): the console's demo, a few rows per active expert.
    prefill: import blocks of about 1-2K tokens with 2-4 output tokens: rows per active expert in
      the hundreds.
    mixed: the two interleaved, one of each in turn."""
    if regime not in REGIMES:
        raise ValueError(f"--regime: must be one of {', '.join(REGIMES)}, got {regime!r}")
    rng = np.random.default_rng(seed + 1)
    short = [(p, SamplingParams(max_tokens=int(rng.integers(8, 41)), ignore_eos=True))
             for p in domain_prompts(num_requests, seed)]
    long = [(p, SamplingParams(max_tokens=int(rng.integers(*PREFILL_OUTPUT)), ignore_eos=True))
            for p in domain_prompts(num_requests, seed + 1000, PREFILL_LINES)]
    if regime == "decode":
        return short
    if regime == "prefill":
        return long
    return [(short if i % 2 == 0 else long)[i] for i in range(num_requests)]


def split_workload(items: list[tuple], num_requests: int) -> tuple[list, list, list]:
    """A given workload (a file or spec) as the suite's three draws: every other request plans
    (warm-up), the rest are measured; the settling pass runs the measured ones once."""
    plan, measured = items[0::2][:num_requests], items[1::2][:num_requests]
    if not plan or not measured:
        raise ValueError("--workload: needs at least 2 requests (one to plan on, one to measure)")
    return plan, measured, measured


def _run(engine, backend, devices, draws, rounds, concurrency, log) -> dict:
    warm, work, settling = draws
    naive = engine.experts.placement
    log(f"rebalance bench: {backend}, {devices} devices, {len(work)} requests ({concurrency} in flight) per "
        f"phase; the plan from warm-up requests, the phases on others from the same workload")
    settle(engine, settling, concurrency)  # so that the plan's window does not measure it
    warmup = measure_phase(engine, warm, concurrency)  # calibrates the cost model on the naive placement
    plan = engine.experts.preview()
    predicted = plan.prediction or {}
    phase_prediction = predict_from_records(warmup["records"], naive, plan.placement) or {}
    phases: dict[str, list[dict]] = {"before": [], "after": []}
    migrations = []
    for r in range(rounds):
        order = (("before", naive), ("after", plan.placement))
        for name, placement in order if r % 2 == 0 else order[::-1]:
            if engine.experts.placement != placement:
                migrations.append(_apply(engine, placement))
            s = measure_phase(engine, work, concurrency)
            phases[name].append(s)
            log(f"  round {r + 1} {name:6s}: {s['steps']} steps, {s['throughput_measured']:7.1f} tok/s measured, "
                f"{s['throughput_parallel']:7.1f} tok/s {'modeled parallel' if s['step_time_modeled'] else 'measured'}, "
                f"utilisation {', '.join(f'{u:.0%}' for u in s['utilisation'])}")
    return _result(backend, devices, plan, predicted, phase_prediction, phases, migrations, log)


# two-sided 95% Student's t for 1..30 degrees of freedom
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def interval95(values: list[float]) -> tuple[float, float] | None:
    """The 95% interval of the mean of `values` (Student's t); None for fewer than 2."""
    n = len(values)
    if n < 2:
        return None
    mean, sd = float(np.mean(values)), float(np.std(values, ddof=1))
    half = _T95[min(n - 1, len(_T95)) - 1] * sd / np.sqrt(n)
    return mean - half, mean + half


def batch_shapes(records: list[dict]) -> list[tuple[int, int, int]]:
    """Each step's batch: (prefill tokens, decode tokens, sequences)."""
    return [(r["batch"]["prefill_tokens"], r["batch"]["decode_tokens"], r["batch"]["num_seqs"]) for r in records]


def _mean(phases: list[dict], key: str) -> float:
    return float(np.mean([p[key] for p in phases]))


def _result(backend, devices, plan, predicted, phase_prediction, phases, migrations, log) -> dict:
    modeled = phases["before"][0]["step_time_modeled"]
    key = "throughput_parallel" if modeled else "throughput_measured"
    before, after = _mean(phases["before"], key), _mean(phases["after"], key)
    round_gains = [a[key] / b[key] - 1 for b, a in zip(phases["before"], phases["after"])]
    gain = float(np.mean(round_gains))
    ci = interval95(round_gains)
    kind = "modeled" if modeled else "measured"
    shapes = [batch_shapes(p["records"]) for p in phases["before"] + phases["after"]]
    step_before, step_after = _mean(phases["before"], "step_s_mean"), _mean(phases["after"], "step_s_mean")

    def error(predicted_value, measured_value):
        return abs(predicted_value - measured_value) / abs(measured_value) if predicted_value is not None else None

    predicted_gain = predicted.get("gain")
    telemetry = [p["telemetry_share"] for p in phases["before"] + phases["after"] if p["telemetry_share"] is not None]
    moved = [m.get("migration") or {"bytes_transferred": m["bytes_moved"], "seconds_max": m["seconds"]}
             for m in migrations]
    result = {
        "backend": backend, "devices": devices, "gain_is": kind, "throughput_is": kind,
        "throughput_before": before, "throughput_after": after, "gain": gain, f"{kind}_gain": gain,
        "rounds": len(round_gains), "gain_rounds": round_gains, "gain_ci95": list(ci) if ci else None,
        "predicted_gain": predicted_gain, "prediction_error": error(predicted_gain, gain) if gain else None,
        # the preview's interval and the gate's verdict on the plan (placement/decision.py)
        "predicted_gain_low": predicted.get("gain_low"), "predicted_gain_high": predicted.get("gain_high"),
        "gate_acts": predicted.get("acts"), "gate_reason": predicted.get("reason"),
        "plan_moves": len(plan.move_array),
        # rounds whose measured (or modeled) gain has the predicted sign (a zero prediction: no sign to get right)
        "sign_right_rounds": (None if not predicted_gain else
                              sum((g > 0) == (predicted_gain > 0) for g in round_gains) / len(round_gains)),
        # |predicted - measured| within max(1 point, 20% of measured): the bar for a prediction
        "prediction_within_bar": (None if predicted_gain is None
                                  else abs(predicted_gain - gain) <= max(0.01, 0.2 * abs(gain))),
        "predicted_gain_phase": phase_prediction.get("gain"),
        "min_util_before": float(np.mean([min(p["utilisation"]) for p in phases["before"]])),
        "min_util_after": float(np.mean([min(p["utilisation"]) for p in phases["after"]])),
        "step_s_before": step_before, "step_s_after": step_after,
        "predicted_step_s_before": phase_prediction.get("step_s_before"),
        "predicted_step_s_after": phase_prediction.get("step_s_after"),
        # the cost model over the warm-up's own steps against the same steps measured (or modeled) later
        "step_model_error_before": error(phase_prediction.get("step_s_before"), step_before),
        "step_model_error_after": error(phase_prediction.get("step_s_after"), step_after),
        "same_steps": len({p["steps"] for p in phases["before"] + phases["after"]}) == 1,
        "same_batches": all(shape == shapes[0] for shape in shapes),
        "balancedness_before": plan.balancedness_before.overall, "balancedness_after": plan.balancedness_after.overall,
        "serial_throughput_before": _mean(phases["before"], "throughput_measured"),
        "serial_throughput_after": _mean(phases["after"], "throughput_measured"),
        "telemetry_share": float(np.mean(telemetry)) if telemetry else None,
        "migrations": [{"bytes": m["bytes_transferred"], "seconds": m["seconds_max"]} for m in moved],
        "calibration": predicted.get("calibration"),
        "phases": {k: [{f: v for f, v in p.items() if f != "records"} for p in ps] for k, ps in phases.items()},
    }
    interval = f" (95% interval {ci[0]:+.1%} to {ci[1]:+.1%}, {len(round_gains)} rounds)" if ci else ""
    log(f"throughput {before:.1f} -> {after:.1f} tok/s ({kind}): {kind} gain {gain:+.1%}{interval}; predicted "
        + (f"{predicted_gain:+.1%} by the preview" if predicted_gain is not None else "(no prediction)")
        + (f", {result['predicted_gain_phase']:+.1%} over the warm-up" if result["predicted_gain_phase"] is not None
           else ""))
    if predicted.get("reason"):
        log(f"the gate ({'acts' if predicted.get('acts') else 'holds'}): {predicted['reason']}"
            + ("" if len(plan.move_array) else "; the planner kept the placement, so both phases ran it"))
    log(f"least-used device's utilisation before {result['min_util_before']:.0%} (target < 60%); step-time model "
        f"error {(result['step_model_error_before'] or 0):.1%} on the naive placement, "
        f"{(result['step_model_error_after'] or 0):.1%} on the planned one; the same batches in every phase: "
        f"{result['same_batches']}")
    if result["telemetry_share"] is not None:
        log(f"per-rank telemetry gather: {result['telemetry_share']:.2%} of the measured step time")
    return result
