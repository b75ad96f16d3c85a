"""Benchmark tiered expert memory: expert-cache hit rates of LRU, LRU + prefetch and Belady.

    python bench/expert_cache_bench.py                          # sample model, batch 1/4/16, 4 devices
    python bench/expert_cache_bench.py --model DIR --batch-sizes 1,8 --capacity 0.25,0.5 --json

A workload runs through the engine with a RoutingRecorder as the model runner's probe. Each
decode batch keeps B sequences running (B requests at a time, equal output lengths). Every MoE
layer's experts are spread over D devices by the contiguous placement. The recorder keeps, per
device, the working set of every (step, MoE layer) and each predictor's guess for it, made
before the layer ran. On those same sequences it reports, per device cache of C slots (C a
share of the experts the device holds over all layers, raised to the largest single-layer
working set when smaller):

* LRU: the cache alone;
* LRU + prefetch, one figure per predictor (engine/prefetch.py): the next layer's router on the
  hidden state entering that layer ("router"), the same from one layer earlier
  ("router_early"), and co-activation statistics learned online ("coact"); "+m" means each
  token's top (k + m) experts are prefetched;
* Belady: the offline optimum of a demand cache on the same sequence, and the ratio
  prefetch / Belady against the 90% target. A prefetch that guesses right turns a cold miss into
  a hit, so it can pass Belady; the copies it spends (wasted ones too) are reported next to it;
* per device: accesses, misses, and the time spent waiting on misses. It is *modeled* from
  bytes and the topology's host-to-device bandwidth (a demand miss blocks for its whole copy; a
  prefetch is assumed hidden). It is also *measured* by replaying the sequence through a real
  ExpertCache on this machine's CPU (real copies of the model's weights).

By default only decode steps are recorded: a prefill step touches nearly every expert and would
stream its layers through the cache rather than hit it (--include-prefill records them too).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moectl.engine.core.config import EngineConfig, SchedulerKnobs  # noqa: E402
from moectl.engine.experts.expert_cache import ExpertCache, moe_host_tier, replay  # noqa: E402
from moectl.engine.experts.prefetch import CoactivationPredictor, RouterPredictor, RoutingRecorder  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.engine.tools.workload import WorkloadSpec, make_workload, run_workload  # noqa: E402
from moectl.placement.placement import Placement  # noqa: E402
from moectl.placement.topology import Topology  # noqa: E402

TARGET = 0.9
ROOT = Path(__file__).resolve().parent.parent
SAMPLE_MODEL = ROOT / "engine" / "sample_model"
PRIMARY = "router"  # the predictor the 90% target is judged on (the next-layer router)


def has_weights(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))


def default_model_dir(workdir: str | Path | None = None) -> tuple[Path, str]:
    """engine/sample_model when it has weights, else a tiny random Mixtral of the sample model's
    layout (4 layers, 16 experts, top-2) written to workdir (a temporary directory)."""
    if has_weights(SAMPLE_MODEL):
        return SAMPLE_MODEL, "engine/sample_model"
    from tests.checkpoints import tiny_checkpoint

    out = Path(workdir or tempfile.mkdtemp(prefix="expert_cache_bench_"))
    tiny_checkpoint(out, num_hidden_layers=4, num_local_experts=16, num_experts_per_tok=2,
                         hidden_size=64, intermediate_size=48, max_position_embeddings=1024)
    return out, "tiny random Mixtral (4 layers, 16 experts, top-2; engine/sample_model has no weights yet)"


def make_predictors(model, extras=(0, 1)) -> list:
    preds = []
    for m in extras:
        preds.append(RouterPredictor(model, extra=m, lookahead=0))
    for m in extras:
        preds.append(RouterPredictor(model, extra=m, lookahead=1))
    for m in extras:
        preds.append(CoactivationPredictor(model, extra=m))
    return preds


def _record(engine: LLMEngine, batch_size: int, num_devices: int, args: dict) -> RoutingRecorder:
    """Run B-at-a-time decode batches through the engine with a recorder attached."""
    model = engine.model
    cfg = model.cfg
    placement = Placement.contiguous(cfg.num_layers, cfg.num_experts, num_devices)
    recorder = RoutingRecorder(model, placement, make_predictors(model, args["extras"]))
    spec = WorkloadSpec(num_requests=batch_size * args["rounds"], prompt_len=args["prompt_len"],
                        output_len=args["output_len"], seed=args["seed"] + batch_size,
                        temperature=args["temperature"])
    items = make_workload(spec, engine.tokenizer, cfg.vocab_size)
    engine.update_knobs(max_num_seqs=batch_size)
    runner = engine.runner
    saved_probe, saved_run = runner.probe, runner.run
    include_prefill = args["include_prefill"]

    def run(items, all_logits=False, probe=None):
        decode = all(n == 1 for _, n in items)
        recorder.step_kind = "decode" if decode else "prefill"
        recorder.recording = decode or include_prefill
        return saved_run(items, all_logits, probe)

    own_run = "run" in vars(runner)
    runner.probe, runner.run = recorder, run
    try:
        run_workload(engine, items, realtime=False)
    finally:
        runner.probe = saved_probe
        if own_run:
            runner.run = saved_run
        else:
            del runner.run  # back to the class's method
    return recorder


def _rate(hits: int, accesses: int) -> float:
    return hits / accesses if accesses else 1.0


def _evaluate(recorder: RoutingRecorder, capacity_frac: float, topology: Topology,
              measure: bool, host=None) -> dict:
    """All devices at one capacity share: per-device comparisons and the totals."""
    names = [p.name for p in recorder.predictors]
    release = {p.name: p.release_before_prefetch for p in recorder.predictors}
    kinds = None
    placement = recorder.placement
    w13, w2 = next(iter(host.values()))
    expert_bytes = w13[0].nbytes + w2[0].nbytes
    bw = topology.host_to_device_gbps * 1e9
    devices, totals = [], {"lru": [0, 0], "belady": [0, 0], **{n: [0, 0] for n in names}}
    copies = {"lru": 0, **{n: 0 for n in names}}
    wasted = {n: 0 for n in names}
    for d in range(recorder.num_devices):
        held = sum(len(placement.experts_on(layer, d)) for layer in recorder.moe_layers)
        per_layer = max(len(placement.experts_on(layer, d)) for layer in recorder.moe_layers)
        ws = recorder.max_working_set(d, kinds)
        capacity = max(math.ceil(capacity_frac * held), ws, 1)
        cmp = recorder.compare(d, capacity, kinds)
        row = {"device": d, "experts_held": held, "experts_per_layer": per_layer, "capacity": capacity,
               "max_working_set": ws, "accesses": cmp["lru"]["accesses"],
               "lru": cmp["lru"]["hit_rate"], "belady": cmp["belady"]["hit_rate"],
               "prefetch": {n: cmp["prefetch"][n]["hit_rate"] for n in names},
               "misses": {"lru": cmp["lru"]["misses"], "belady": cmp["belady"]["misses"],
                          **{n: cmp["prefetch"][n]["misses"] for n in names}},
               "prefetch_copies": {n: cmp["prefetch"][n]["prefetch_issued"] for n in names},
               "prefetch_wasted": {n: cmp["prefetch"][n]["prefetch_wasted"] for n in names}}
        # modeled: each demand miss blocks for one expert's copy at host-to-device bandwidth
        row["modeled_miss_wait_s"] = {k: v * expert_bytes / bw for k, v in row["misses"].items()}
        if measure:
            acc = recorder.accesses(d, kinds)
            local = {layer: placement.experts_on(layer, d) for layer in host}
            measured = {}
            for name in ["lru", PRIMARY] if PRIMARY in names else ["lru"]:
                cache = ExpertCache(host, capacity, "cpu", local_experts=local, max_working_set=ws or 1,
                                    name=f"device {d}")
                preds = None if name == "lru" else recorder.predictions(name, d, kinds)
                st = replay(cache, acc, preds, release_before_prefetch=release.get(name, False))
                expect = cmp["lru"] if name == "lru" else cmp["prefetch"][name]
                assert st["hits"] == expect["hits"] and st["misses"] == expect["misses"], (st, expect)
                measured[name] = {"miss_wait_s": st["miss_wait_seconds"],
                                  "prefetch_copy_s": st["prefetch_copy_seconds"], "bytes_copied": st["bytes_copied"]}
                del cache
            row["measured_cpu"] = measured
        devices.append(row)
        for key, res in (("lru", cmp["lru"]), ("belady", cmp["belady"]),
                         *((n, cmp["prefetch"][n]) for n in names)):
            totals[key][0] += res["hits"]
            totals[key][1] += res["accesses"]
        copies["lru"] += cmp["lru"]["copies"]
        for n in names:
            copies[n] += cmp["prefetch"][n]["copies"]
            wasted[n] += cmp["prefetch"][n]["prefetch_wasted"]
    rates = {k: _rate(h, a) for k, (h, a) in totals.items()}
    bel = rates["belady"]
    result = {
        "capacity_frac": capacity_frac, "capacity": [r["capacity"] for r in devices],
        "accesses": totals["lru"][1],
        "lru": rates["lru"], "belady": bel,
        "prefetch": {n: rates[n] for n in names},
        "ratio_to_belady": {"lru": rates["lru"] / bel if bel else None,
                            **{n: rates[n] / bel if bel else None for n in names}},
        "copies": copies, "prefetch_wasted": wasted, "devices": devices,
    }
    best = max(names, key=lambda n: rates[n]) if names else None
    result["best_predictor"] = best
    primary = PRIMARY if PRIMARY in names else best
    result["target"] = {"predictor": primary, "ratio": result["ratio_to_belady"].get(primary),
                        "goal": TARGET, "met": (result["ratio_to_belady"].get(primary) or 0) >= TARGET}
    return result


def run_expert_cache_bench(model_dir: str | Path | None = None, *, batch_sizes=(1, 4, 16), num_devices: int = 4,
                           capacity_fracs=(0.25, 0.5), prompt_len=(32, 128), output_len: int = 64,
                           rounds: int = 2, temperature: float = 0.8, extras=(0, 1), seed: int = 0,
                           include_prefill: bool = False, threads: int | None = 1, dtype: str | None = None,
                           topology: Topology | None = None, measure: bool = True, progress=None) -> dict:
    """Record routing at each batch size, then compare LRU / LRU + prefetch / Belady per device
    at each capacity share. Returns a JSON-serialisable dict (see the module docstring)."""
    say = progress or (lambda msg: None)
    note = str(model_dir)
    if model_dir is None:
        model_dir, note = default_model_dir()
    model_dir = Path(model_dir)
    topology = topology or Topology(num_devices=num_devices)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, num_threads=threads, seed=seed,
                                    knobs=SchedulerKnobs(max_num_seqs=max(batch_sizes))))
    model = engine.model
    cfg = model.cfg
    if cfg.num_experts < num_devices:
        raise ValueError(f"devices: {num_devices} devices for {cfg.num_experts} experts per layer")
    host = moe_host_tier(model)
    args = {"prompt_len": prompt_len, "output_len": output_len, "rounds": rounds, "temperature": temperature,
            "extras": tuple(extras), "seed": seed, "include_prefill": include_prefill}
    out = {"model": note, "model_dir": str(model_dir),
           "model_config": {"layers": cfg.num_layers, "experts": cfg.num_experts, "top_k": cfg.top_k,
                            "hidden": cfg.hidden_size, "expert_intermediate": cfg.expert_intermediate_size,
                            "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")},
           "num_devices": num_devices, "placement": "contiguous", "host_to_device_gbps": topology.host_to_device_gbps,
           "workload": {"prompt_len": list(prompt_len) if isinstance(prompt_len, tuple) else prompt_len,
                        "output_len": output_len, "rounds": rounds, "temperature": temperature, "seed": seed,
                        "steps_recorded": "all" if include_prefill else "decode"},
           "target": TARGET, "primary_predictor": PRIMARY, "runs": []}
    for b in batch_sizes:
        t0 = time.perf_counter()
        recorder = _record(engine, b, num_devices, args)
        steps = len(recorder.steps)
        say(f"batch {b}: {steps} steps recorded in {time.perf_counter() - t0:.1f} s")
        out.setdefault("predictors", {p.name: {"copies_overlap": p.lead,
                                               "previous_layer_released": p.release_before_prefetch}
                                      for p in recorder.predictors})
        run = {"batch_size": b, "steps": steps,
               "prediction_quality": {p.name: recorder.prediction_quality(p.name) for p in recorder.predictors},
               "capacities": [_evaluate(recorder, f, topology, measure, host) for f in capacity_fracs]}
        out["runs"].append(run)
    return out


def _pct(x) -> str:
    return "   -  " if x is None else f"{100 * x:5.1f}%"


def format_report(res: dict) -> str:
    lines = [f"expert cache: {res['model']}, {res['num_devices']} devices ({res['placement']} placement), "
             f"{res['workload']['steps_recorded']} steps, temperature {res['workload']['temperature']}, "
             f"{res['workload']['output_len']} output tokens x {res['workload']['rounds']} rounds"]
    for run in res["runs"]:
        for c in run["capacities"]:
            names = list(c["prefetch"])
            lines.append("")
            lines.append(f"batch {run['batch_size']}, capacity {100 * c['capacity_frac']:.0f}% "
                         f"({'/'.join(map(str, sorted(set(c['capacity']))))} slots per device), "
                         f"{c['accesses']} accesses over {run['steps']} steps")
            lines.append(f"  {'policy':<22} {'hit rate':>8} {'/Belady':>8} {'copies':>7} {'wasted':>7} "
                         f"{'recall':>7} {'prec':>6}")
            lines.append(f"  {'LRU':<22} {_pct(c['lru']):>8} {_pct(c['ratio_to_belady']['lru']):>8} "
                         f"{c['copies']['lru']:>7}")
            for n in names:
                q = run["prediction_quality"][n]
                lines.append(f"  {'LRU + ' + n:<22} {_pct(c['prefetch'][n]):>8} {_pct(c['ratio_to_belady'][n]):>8} "
                             f"{c['copies'][n]:>7} {c['prefetch_wasted'][n]:>7} {_pct(q['recall']):>7} "
                             f"{_pct(q['precision']):>6}")
            lines.append(f"  {'Belady (opt.)':<22} {_pct(c['belady']):>8}")
            t = c["target"]
            lines.append(f"  target: LRU + {t['predictor']} >= {100 * t['goal']:.0f}% of Belady: "
                         f"{_pct(t['ratio']).strip()} -> {'met' if t['met'] else 'NOT met'}"
                         f" (best: {c['best_predictor']})")
            p = t["predictor"]
            lines.append(f"  {'device':>6} {'slots':>5} {'acc':>5} {'LRU':>6} {p:>9} {'Belady':>6}  "
                         f"miss wait modeled LRU/{p} (ms)  measured CPU LRU/{p} (ms)")
            for r in c["devices"]:
                m = r.get("measured_cpu", {})
                meas = "/".join(f"{1e3 * m[k]['miss_wait_s']:.2f}" for k in ("lru", p) if k in m) or "-"
                wait = r["modeled_miss_wait_s"]
                lines.append(f"  {r['device']:>6} {r['capacity']:>5} {r['accesses']:>5} {_pct(r['lru']):>6} "
                             f"{_pct(r['prefetch'][p]):>9} {_pct(r['belady']):>6}  "
                             f"{1e3 * wait['lru']:>8.3f} / {1e3 * wait[p]:<8.3f}          {meas}")
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: engine/sample_model, else a tiny random one)")
    ap.add_argument("--batch-sizes", default="1,4,16", help="concurrent sequences per decode batch")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--capacity", default="0.25,0.5", help="cache slots as a share of each device's experts")
    ap.add_argument("--prompt-len", default="32-128")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="batches of B requests, one after another")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--extra", default="0,1", help="prefetch each token's top (k + m) experts, for each m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--include-prefill", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--host-gbps", type=float, default=50.0, help="host-to-device GB/s for the modeled wait")
    ap.add_argument("--no-measure", action="store_true", help="skip the replay through real CPU caches")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    lo, _, hi = args.prompt_len.partition("-")
    prompt_len = (int(lo), int(hi or lo))
    try:
        res = run_expert_cache_bench(
            args.model, batch_sizes=_ints(args.batch_sizes), num_devices=args.devices,
            capacity_fracs=_floats(args.capacity), prompt_len=prompt_len, output_len=args.output_len,
            rounds=args.rounds, temperature=args.temperature, extras=_ints(args.extra), seed=args.seed,
            include_prefill=args.include_prefill, threads=args.threads, dtype=args.dtype,
            topology=Topology(num_devices=args.devices, host_to_device_gbps=args.host_gbps),
            measure=not args.no_measure, progress=lambda m: print(m, file=sys.stderr))
    except ValueError as exc:
        print(f"expert_cache_bench: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1) if args.json else format_report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
