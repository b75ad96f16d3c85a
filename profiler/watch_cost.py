"""What the numerics watch costs (`moectl bench --suite profiler` runs it beside the profiler's own
cost), measured two ways in one run.

Directly: the seconds inside the watch's notes and its per-step collection on the engine thread,
timed in place (a note is one native pass over a tensor, microseconds, so a timer around it is a
small part of it), over the run's wall time. As a cross-check, an A/B: two engines on the same
weights, the watch on and off, running the same workloads in interleaved pairs (ABBA), both at
batch 1 (decode steps of one token, where a step is shortest and the watch's share largest) and
batched; the on/off throughput ratio per pair, with a bootstrap 95% interval of the mean.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.tools.workload import WorkloadSpec, run_workload, workload_for_engine

WORKLOADS = {
    "batch-1 decode": WorkloadSpec(num_requests=1, prompt_len=(16, 16), output_len=(96, 96), seed=3),
    "batched": WorkloadSpec(num_requests=8, prompt_len=(32, 128), output_len=(32, 64), seed=5),
}


class _Timed:
    """Wraps an engine's watch: seconds and calls inside note() and collect()."""

    def __init__(self, watch):
        self.seconds, self.notes, self.collects = 0.0, 0, 0
        note, collect = watch.note, watch.collect

        def timed_note(*args):
            t0 = time.perf_counter()
            note(*args)
            self.seconds += time.perf_counter() - t0
            self.notes += 1

        def timed_collect(*args):
            t0 = time.perf_counter()
            out = collect(*args)
            self.seconds += time.perf_counter() - t0
            self.collects += 1
            return out

        watch.note, watch.collect = timed_note, timed_collect


def _run(engine: LLMEngine, items) -> tuple[float, float, int]:
    """(tokens/s, wall seconds, steps) of one workload."""
    steps = engine.step_count
    t0 = time.perf_counter()
    result = run_workload(engine, items, realtime=False)
    wall = time.perf_counter() - t0
    tokens = sum((r.get("output_tokens") or 0) + r["prompt_tokens"] for r in result.requests)
    return tokens / wall, wall, engine.step_count - steps


def numerics_watch_cost(model_dir: str | Path, *, rounds: int = 6, dtype: str | None = None,
                        log: Callable[[str], None] = print) -> dict:
    from moectl.profiler.overhead_bench import bootstrap_ci

    model_dir = str(model_dir)
    engines = {on: LLMEngine(EngineConfig(model=model_dir, dtype=dtype, numerics_watch=on)) for on in (False, True)}
    for engine in engines.values():
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up (and the build)
    timer = _Timed(engines[True].watch)
    out = {}
    for name, spec in WORKLOADS.items():
        ratios, on_wall, on_steps = [], 0.0, 0
        timer.seconds = 0.0
        for r in range(rounds):
            items = workload_for_engine(dataclasses.replace(spec, seed=spec.seed + r), engines[True])
            tps = {}
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                tps[on], wall, steps = _run(engines[on], items)
                if on:
                    on_wall, on_steps = on_wall + wall, on_steps + steps
            ratios.append(tps[True] / tps[False])
        lo, hi = bootstrap_ci(ratios)
        direct = timer.seconds / on_wall
        out[name] = {"rounds": rounds, "ratio_on_off": statistics.fmean(ratios), "ratio_ci95": [lo, hi],
                     "ratios": ratios, "direct_share": direct, "us_per_step": timer.seconds / max(on_steps, 1) * 1e6,
                     "steps": on_steps}
        log(f"numerics watch, {name}: {direct:.2%} of the engine's wall time measured directly "
            f"({out[name]['us_per_step']:.1f} us/step); A/B on/off throughput {out[name]['ratio_on_off']:.4f} "
            f"(95% CI [{lo:.4f}, {hi:.4f}], {rounds} pairs)")
    # per layer two norm inputs, q, k and the MLP's output; the final norm's input once
    out["notes_per_step"] = 5 * engines[True].model_config.num_layers + 1
    return out
