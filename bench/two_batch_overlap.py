"""Two-batch overlap on the ranks, measured: one batch against two micro-batches on the same ranks.

    python bench/two_batch_overlap.py [--model sample-dsv3] [--nproc 2] [--rounds 5] [--requests 48]
                                      [--concurrency 16] [--json]

One launch of `--nproc` ranks (the distributed backend, gloo on this CPU) serves the rebalance
suite's workload (`moectl bench --suite rebalance`: the prefix cache off, `concurrency` requests in
flight) in its prefill and decode regimes. Each round runs the regime's requests once per mode, in
an order that rotates from round to round: `none` (one batch), `two-batch` with the engine's
fallback (steps under 512 tokens run as one batch), `two-batch` forced on every step of at least 2
tokens, and the control `split, no overlap`: the same forced split with the two micro-batches run
one after the other, every collective waited for at once (what splitting alone costs or saves; the
overlap's own gain is forced over it). Rank 0 publishes each step's split, so the mode changes
between runs without restarting the ranks. Printed per regime: tokens per second of each mode,
the gain over one batch (median and range over the rounds), whether the greedy tokens were
identical, from the step records the collectives' time a micro-batch was blocked on (link_s +
link_wait_s) against the time they were in flight under the other micro-batch's compute
(link_hidden_s), and the step model's prediction on this machine's profile (`moectl sim calibrate`,
measured first: its micro-batch overhead is the cost of a second pass it measured) for the one-batch
steps as recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("none", "two-batch", "two-batch forced", "split, no overlap")


def set_mode(engine, mode: str, min_tokens: int) -> None:
    """Rank 0's publisher decides each step's split; the mode changes between runs."""
    publisher = engine.runner.model
    publisher.overlap = "none" if mode == "none" else "two-batch"
    publisher.overlap_min_tokens = min_tokens if mode == "two-batch" else 2
    publisher.interleaved = mode != "split, no overlap"


def run_mode(engine, requests: list, concurrency: int, mode: str, min_tokens: int) -> dict:
    from moectl.engine.tools.rebalance_bench import measure_phase

    set_mode(engine, mode, min_tokens)
    phase = measure_phase(engine, requests, concurrency)
    records = phase.pop("records")
    devices = [r["devices"] for r in records]
    split = [d for d in devices if len(d["micro_batches"]) == 2]
    return {"records": records, "throughput": phase["throughput_measured"], "steps": phase["steps"], "wall_s": phase["wall_s"],
            "split_steps": len(split),
            "blocked_s": float(sum(np.sum(d["link_s"]) + np.sum(d["link_wait_s"]) for d in devices) / len(devices[0]["busy_s"])),
            "hidden_s": float(sum(np.sum(d["link_hidden_s"]) for d in devices) / len(devices[0]["busy_s"])),
            "step_s": float(sum(d["step_time"]["step_s"] for d in devices))}


def calibrate(model: str, nproc: int, out: Path) -> Path:
    """This machine's profile for `nproc` ranks (`moectl sim calibrate`: the engine's kernels, gloo's
    all_reduce, the per-layer overhead), measured before the ranks start."""
    done = subprocess.run([sys.executable, "-m", "moectl.cli", "sim", "calibrate", "--out", str(out), "--ranks",
                           str(nproc), "--model", model], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"sim calibrate failed: {done.stderr.strip()}")
    return out


def predict(records: list[dict], model_dir: str, profile: Path, placement, ranks: int, block: int,
            min_tokens: int) -> dict:
    """The step model's time for these (one-batch) steps, as recorded, without overlap and with
    two-batch overlap (forced on every step, and with the engine's fallback): the predicted gains."""
    from moectl.engine.sim.hardware import load_profile
    from moectl.engine.sim.model_shape import load_sim_model
    from moectl.engine.sim.routing import balanced
    from moectl.engine.sim.step_model import SimSpec, simulate
    from moectl.engine.sim.trace_load import load_from_record, mean_prompt
    from moectl.placement.placement import Placement

    model = load_sim_model(model_dir, "fp32")
    shape = model.shape
    moe = [i for i, sparse in enumerate(shape.sparse_layers) if sparse]
    prompt = mean_prompt(e for r in records for e in r.get("requests") or ())
    spec = SimSpec(model, load_profile(profile), ranks, balanced(shape.num_sparse, shape.num_experts),
                   tokens_per_device=1, context=1, tp=ranks, exchange="all-reduce",
                   placement=Placement(placement.slots[moe], shape.num_experts))
    two = replace(spec, overlap="two-batch")
    none_s = forced_s = auto_s = measured_s = 0.0
    for record in records:
        load = load_from_record(record, shape, moe, block, prompt)
        t_none = simulate(spec, load)["step_ms"]
        t_two = simulate(two, load)["step_ms"]
        tokens = record["batch"]["prefill_tokens"] + record["batch"]["decode_tokens"]
        none_s += t_none
        forced_s += t_two
        auto_s += t_two if tokens >= min_tokens else t_none
        measured_s += record["devices"]["step_time"]["step_s"] * 1e3
    return {"simulated_ms": none_s, "measured_ms": measured_s, "gain_forced": none_s / forced_s - 1,
            "gain_auto": none_s / auto_s - 1}


def outputs_of(engine, requests: list, mode: str, min_tokens: int) -> list[list[int]]:
    """Greedy tokens of the requests run together under `mode`."""
    set_mode(engine, mode, min_tokens)
    return [o.token_ids for o in engine.generate([p for p, _ in requests], [s for _, s in requests])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sample-dsv3")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--regimes", default="prefill,decode")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from moectl.engine import resolve_model
    from moectl.engine.parallel.backends import Engines
    from moectl.engine.parallel.two_batch import DEFAULT_MIN_TOKENS
    from moectl.engine.tools.rebalance_bench import settle, suite_config, workload

    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    model_dir = str(resolve_model(args.model))
    profile = calibrate(args.model, args.nproc, Path(tempfile.mkdtemp()) / "profile.json")
    config = suite_config(model_dir, args.nproc, 0, args.concurrency)
    engines = Engines(config, "distributed")
    result = {"model": args.model, "nproc": args.nproc, "rounds": args.rounds, "requests": args.requests,
              "concurrency": args.concurrency, "min_tokens": DEFAULT_MIN_TOKENS, "date": time.strftime("%Y-%m-%d"),
              "regimes": {}}
    try:
        engine = engines.make_engine()
        try:
            for regime in args.regimes.split(","):
                requests = workload(args.requests, 1, regime)
                settle(engine, workload(args.requests, 2, regime), args.concurrency)
                same = {m: outputs_of(engine, requests[:16], m, DEFAULT_MIN_TOKENS) for m in MODES}
                runs: dict[str, list[dict]] = {m: [] for m in MODES}
                for r in range(args.rounds):
                    order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                    for mode in order:
                        runs[mode].append(run_mode(engine, requests, args.concurrency, mode, DEFAULT_MIN_TOKENS))
                    log(f"{regime} round {r + 1}: " + ", ".join(
                        f"{m} {runs[m][-1]['throughput']:,.0f} tok/s" for m in MODES))
                summary = {}
                for mode in MODES:
                    ratios = [run["throughput"] / base["throughput"] for run, base in zip(runs[mode], runs["none"])]
                    summary[mode] = {
                        "throughput": [run["throughput"] for run in runs[mode]],
                        "gain_median": statistics.median(ratios) - 1, "gain_min": min(ratios) - 1,
                        "gain_max": max(ratios) - 1,
                        "split_steps": runs[mode][-1]["split_steps"], "steps": runs[mode][-1]["steps"],
                        "blocked_s": statistics.median(run["blocked_s"] for run in runs[mode]),
                        "hidden_s": statistics.median(run["hidden_s"] for run in runs[mode]),
                        "wall_s": statistics.median(run["wall_s"] for run in runs[mode]),
                        "identical": same[mode] == same["none"]}
                none_records = [rec for run in runs["none"] for rec in run["records"]]
                summary["predicted"] = predict(none_records, model_dir, profile, engine.experts.placement,
                                               args.nproc, config.block_size, DEFAULT_MIN_TOKENS)
                for mode in MODES:
                    for run in runs[mode]:
                        run.pop("records")
                result["regimes"][regime] = summary
        finally:
            engine.fail_all("abort")
    finally:
        engines.close()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.model} on {args.nproc} ranks (gloo, CPU), {args.requests} requests, {args.concurrency} in flight, "
          f"{args.rounds} rounds; gains over one batch, median [range]:")
    for regime, summary in result["regimes"].items():
        predicted = summary.pop("predicted")
        for mode, s in summary.items():
            gain = "" if mode == "none" else (f", gain {s['gain_median']:+.1%} [{s['gain_min']:+.1%}, "
                                              f"{s['gain_max']:+.1%}]")
            print(f"  {regime:8s} {mode:17s} {statistics.median(s['throughput']):8,.0f} tok/s{gain}; "
                  f"{s['split_steps']}/{s['steps']} steps split; collectives blocked {s['blocked_s'] * 1e3:.0f} ms, "
                  f"in flight under compute {s['hidden_s'] * 1e3:.0f} ms (per rank, per run of "
                  f"{s['wall_s']:.2f} s); tokens {'identical' if s['identical'] else 'DIFFER'}")
        forced, auto = summary["two-batch forced"]["gain_median"], summary["two-batch"]["gain_median"]
        print(f"  {regime:8s} simulated (this machine's calibrated profile, the one-batch steps as recorded): gain "
              f"{predicted['gain_auto']:+.1%} with the fallback (measured {auto:+.1%}), {predicted['gain_forced']:+.1%} "
              f"forced (measured {forced:+.1%}); its one-batch time {predicted['simulated_ms'] / 1e3:.2f} s against "
              f"{predicted['measured_ms'] / 1e3:.2f} s measured")
        summary["predicted"] = predicted


if __name__ == "__main__":
    main()
