"""`moectl bench --suite profiler`: the cost of profiling, measured in one run.

The same workload runs with the profiler off (no spans, no listeners) and with everything on
(spans, request events, process memory, and a TraceRecorder writing every record to a trace
file), alternating so that drift of a noisy machine hits both alike. Each round is a fresh
engine on the same weights; the figure is the median over rounds of on/off throughput.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.core.topology import Topology
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.tools.workload import WorkloadSpec, run_workload, workload_for_engine

TARGET_OVERHEAD = 0.03


def _one_run(model_dir: str, dtype, profiled: bool, devices: int, spec: WorkloadSpec, trace_dir: Path,
             round_no: int) -> dict:
    from moectl.profiler.recorder import TraceRecorder

    # a fresh model per run: placing experts on devices wraps the model's MoE layers
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, profile_spans=profiled,
                                    topology=Topology(num_devices=devices)))
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    items = workload_for_engine(spec, engine)
    recorder = TraceRecorder(engine, trace_dir / f"round{round_no}.trace") if profiled else None
    t0 = time.perf_counter()
    result = run_workload(engine, items, realtime=False)
    wall = time.perf_counter() - t0
    dropped = 0
    if recorder is not None:
        recorder.close()
        dropped = recorder.dropped
    tokens = sum((r.get("output_tokens") or 0) + r["prompt_tokens"] for r in result.requests)
    return {"tokens_per_s": tokens / wall, "steps": engine.step_count, "wall_s": wall, "dropped": dropped}


def run_profiler_overhead(model_dir: str | Path, *, rounds: int = 7, devices: int = 4, requests: int = 64,
                          dtype: str | None = None, log: Callable[[str], None] = print) -> dict:
    model_dir = str(model_dir)
    spec = WorkloadSpec(num_requests=requests, prompt_len=(32, 128), output_len=(32, 64), seed=7)
    off, on, dropped = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for profiled in ((False, True) if r % 2 == 0 else (True, False)):
                run = _one_run(model_dir, dtype, profiled, devices, spec, Path(tmp), r)
                (on if profiled else off).append(run["tokens_per_s"])
                dropped += run["dropped"]
            log(f"round {r + 1}/{rounds}: off {off[-1]:.0f} tok/s, on {on[-1]:.0f} tok/s")
        encode = _encode_cost(Path(tmp) / f"round{rounds - 1}.trace")
    log(f"encoding one recorded step (the writer thread's work): {encode['general_us']:.0f} us with the general "
        f"walk, {encode['str_keys_us']:.0f} us on the str-keys path the recorder uses")
    ratios = [b / a for a, b in zip(off, on)]
    ratio = statistics.median(ratios)
    overhead = 1.0 - ratio
    log(f"profiler on/off throughput: {ratio:.4f} (median of {rounds} rounds; overhead {overhead:+.2%}, "
        f"target <= {TARGET_OVERHEAD:.0%}: {'met' if overhead <= TARGET_OVERHEAD else 'NOT met'}); "
        f"{dropped} records dropped")
    return {"rounds": rounds, "devices": devices, "requests": requests, "off_tokens_per_s": off,
            "on_tokens_per_s": on, "ratio_on_off": ratio, "overhead": overhead, "target_overhead": TARGET_OVERHEAD,
            "met": overhead <= TARGET_OVERHEAD, "dropped": dropped, "ratios": ratios, "encode": encode}


def _encode_cost(trace: Path, limit: int = 300) -> dict:
    """Mean microseconds to encode a recorded step record, both codec paths, same records."""
    from moectl.profiler import codec
    from moectl.profiler.trace_store import TraceReader

    with TraceReader(trace) as reader:
        records = [r for _, r in zip(range(limit), reader.steps())]
    out = {}
    for name, fast in (("general_us", False), ("str_keys_us", True)):
        t0 = time.perf_counter()
        for record in records:
            codec.encode(record, str_keys=fast)
        out[name] = (time.perf_counter() - t0) / max(len(records), 1) * 1e6
    return out


def rank_telemetry_cost(model_dir: str | Path, *, nproc: int = 2, requests: int = 64, dtype: str | None = None,
                        log: Callable[[str], None] = print) -> dict:
    """The distributed backend's per-rank telemetry: rank 0's time in the one fixed-size gather
    of every rank's figures per step, against the measured step time, on the same workload."""
    import numpy as np

    from moectl.engine.parallel.backends import Engines

    spec = WorkloadSpec(num_requests=requests, prompt_len=(32, 128), output_len=(32, 64), seed=7)
    config = EngineConfig(model=str(model_dir), dtype=dtype, topology=Topology(num_devices=nproc))
    engines = Engines(config, "distributed")
    try:
        engine = engines.make_engine()
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        run_workload(engine, workload_for_engine(spec, engine), realtime=False)
        records = [s.as_record()["devices"] for s in engine.step_log]
    finally:
        engines.close()
    gather = np.array([r["telemetry_s"] for r in records])
    step = np.array([r["step_time"]["step_s"] for r in records])
    out = {"ranks": nproc, "steps": len(records), "gather_us_mean": float(gather.mean() * 1e6),
           "gather_us_p99": float(np.percentile(gather, 99) * 1e6), "share_of_step": float(gather.sum() / step.sum()),
           "measured": True}
    log(f"per-rank telemetry on {nproc} ranks: {out['gather_us_mean']:.0f} us per step in the gather "
        f"(p99 {out['gather_us_p99']:.0f} us), {out['share_of_step']:.2%} of the measured step time")
    return out
