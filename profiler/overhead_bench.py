"""`moectl bench --suite profiler`: the cost of profiling, measured two ways in one run.

Directly (the verdict): the seconds spent inside the code that runs only because profiling is
on, over the profiled run's wall time, by component (profiler/overhead_cost.py states the rule):
the engine thread's span, listener and hand-off code, and the writer process's CPU. What runs
with the profiler off too (the engine's own step bookkeeping) is reported apart, not counted.
The target is met only with nothing dropped and the A/B (below) agreeing.

As a cross-check, an A/B: two engines on the same weights, one with the profiler off (no spans,
no listeners) and one with everything on (spans, request events, process memory, and a
TraceRecorder writing every record to a trace file), run short workloads in interleaved pairs
(ABBA order, each pair on its own prompts) so that a noisy machine's drift hits both alike. The
on/off throughput ratio is reported per pair with a bootstrap 95% confidence interval of the mean.
Each profiled run ends with a flush of the trace writer inside its timed window, so the writer's
deferred work is charged to it, not to the unprofiled run that follows. When 1 - direct falls
outside that interval the two measures disagree: the result says so (`ab_agrees`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.tools.workload import WorkloadSpec, run_workload, workload_for_engine
from moectl.placement.topology import Topology
from moectl.profiler import overhead_cost

TARGET_OVERHEAD = 0.01
_BOOTSTRAP = 10000


def _engine(model_dir: str, dtype, profiled: bool, devices: int) -> LLMEngine:
    # one model per engine: placing experts on devices wraps the model's MoE layers
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, profile_spans=profiled,
                                    topology=Topology(num_devices=devices)))
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    return engine


def _timed_run(engine, items, after: Callable[[], None] | None = None) -> tuple[float, float]:
    """(tokens/s, wall seconds) of one workload; `after` runs inside the timed window."""
    t0 = time.perf_counter()
    result = run_workload(engine, items, realtime=False)
    if after is not None:
        after()
    wall = time.perf_counter() - t0
    tokens = sum((r.get("output_tokens") or 0) + r["prompt_tokens"] for r in result.requests)
    return tokens / wall, wall


def bootstrap_ci(values: list[float], seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean."""
    a = np.asarray(values, dtype=np.float64)
    if a.size < 2:
        return float(a.mean()), float(a.mean())
    means = np.random.default_rng(seed).choice(a, (_BOOTSTRAP, a.size)).mean(1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def run_profiler_overhead(model_dir: str | Path, *, rounds: int = 16, devices: int = 4, requests: int = 8,
                          dtype: str | None = None, log: Callable[[str], None] = print) -> dict:
    from moectl.profiler.recorder import TraceRecorder

    model_dir = str(model_dir)
    off_engine = _engine(model_dir, dtype, False, devices)
    on_engine = _engine(model_dir, dtype, True, devices)
    off, on, on_wall = [], [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "profiled.trace"
        recorder = TraceRecorder(on_engine, trace)
        writer = recorder.writer
        if not writer.flush(timeout=120):
            raise RuntimeError("the trace writer process did not answer within 120 s")
        cpu_start = writer.writer_stats.get("cpu_s")  # its start-up (imports) is not the per-step cost
        on_engine.telemetry.cost.reset()
        recorder.record_s = writer.handoff_s = 0.0
        sender_0 = writer.sender_s
        link = overhead_cost.LinkSpanTimer(on_engine)

        def flush_writer() -> None:  # the writer's deferred work belongs to the profiled run
            if not writer.flush(timeout=120):
                raise RuntimeError("the trace writer process did not catch up within 120 s")

        for r in range(rounds):
            spec = WorkloadSpec(num_requests=requests, prompt_len=(32, 128), output_len=(32, 64), seed=7 + r)
            items = workload_for_engine(spec, on_engine)
            for profiled in ((False, True) if r % 2 == 0 else (True, False)):
                tps, wall = (_timed_run(on_engine, items, flush_writer) if profiled
                             else _timed_run(off_engine, items))
                (on if profiled else off).append(tps)
                on_wall += wall if profiled else 0.0
            log(f"round {r + 1}/{rounds}: off {off[-1]:.0f} tok/s, on {on[-1]:.0f} tok/s")
        cost = on_engine.telemetry.cost.as_dict()
        record_s, handoff_s, sender_s = recorder.record_s, writer.handoff_s, writer.sender_s - sender_0
        # as of the last profiled run's flush: closing the file (its checkpoint) is not per-step work
        cpu_end = writer.writer_stats.get("cpu_s")
        recorder.close()
        dropped = recorder.dropped
        writer_stats = writer.writer_stats
        encode = _encode_cost(trace)
    span_costs = overhead_cost.span_call_costs_for(on_engine)
    writer_cpu = None if cpu_start is None or cpu_end is None else cpu_end - cpu_start
    direct = overhead_cost.direct_overhead(cost, on_wall, record_s=record_s, handoff_s=handoff_s, link=link,
                                           span_costs=span_costs, writer_cpu_s=writer_cpu, sender_s=sender_s)
    ratios = [b / a for a, b in zip(off, on)]
    mean_ratio = statistics.fmean(ratios)
    lo, hi = bootstrap_ci(ratios)
    overhead = direct["direct_overhead"]
    met, ab_agrees = verdict(overhead, dropped, (lo, hi))
    steps = max(direct["steps"], 1)
    for name, c in sorted(direct["components"].items(), key=lambda kv: -kv[1]["seconds"]):
        log(f"  {name:20s} {c['seconds'] * 1e6 / steps:9.1f} us/step  {c['share']:7.3%}  ({c['measured']})")
    log(f"  engine bookkeeping, run with the profiler off too (not counted): "
        f"{direct['engine_bookkeeping_s'] * 1e6 / steps:.1f} us/step, {direct['engine_bookkeeping_share']:.3%}")
    for name, c in direct["engine_bookkeeping"].items():
        log(f"    ({name:18s} {c['seconds'] * 1e6 / steps:9.1f} us/step  {c['share']:7.3%})")
    log(f"profiler cost, measured directly: {overhead:.3%} of the profiled run's wall time "
        f"({direct['engine_thread_share']:.3%} on the engine thread, "
        f"{(writer_cpu or 0) / on_wall:.3%} writer-process CPU); target <= {TARGET_OVERHEAD:.0%} with nothing "
        f"dropped and the A/B agreeing: {'met' if met else 'NOT met'}; {dropped} records dropped")
    log(f"A/B cross-check: on/off throughput {mean_ratio:.4f} (mean of {rounds} pairs, 95% CI "
        f"[{lo:.4f}, {hi:.4f}]; median {statistics.median(ratios):.4f})")
    disagreement = None
    if not ab_agrees:
        disagreement = (f"1 - direct = {1.0 - overhead:.4f} is outside the A/B interval [{lo:.4f}, {hi:.4f}]: "
                        f"the A/B sees {'more' if 1.0 - overhead > hi else 'less'} cost than the direct measure")
        log(f"DISAGREEMENT: {disagreement}")
    log(f"one recorded step, timed alone: packed on the engine thread in {encode['pack_us']:.0f} us, sealed by the "
        f"writer process in {encode['seal_us']:.0f} us to {encode['sealed_bytes']:.0f} bytes with zstd (with zlib, "
        f"payload version 2: {encode['seal_zlib_us']:.0f} us, {encode['sealed_zlib_bytes']:.0f} bytes; the first "
        f"layout's JSON encode: {encode['str_keys_us']:.0f} us)")
    return {"rounds": rounds, "devices": devices, "requests_per_round": requests, "off_tokens_per_s": off,
            "on_tokens_per_s": on, "ratios": ratios, "ratio_on_off": mean_ratio,
            "ratio_ci95": [lo, hi], "ratio_median": statistics.median(ratios), "ab_overhead": 1.0 - mean_ratio,
            "ab_overhead_ci95": [1.0 - hi, 1.0 - lo], "overhead": overhead, "direct": direct,
            "target_overhead": TARGET_OVERHEAD, "met": met,
            "verdict_basis": "direct, with nothing dropped and the A/B's interval holding it",
            "dropped": dropped, "ab_agrees": ab_agrees, "ab_disagreement": disagreement,
            "writer_process": {**writer_stats, "cpu_s_measured": writer_cpu}, "encode": encode}


def verdict(direct: float, dropped: int, ab_interval: tuple[float, float]) -> tuple[bool, bool]:
    """(met, the A/B agrees): the direct measure within the target with nothing dropped, and
    1 - direct inside the A/B's on/off interval; a direct figure the A/B contradicts is no result."""
    lo, hi = ab_interval
    agrees = lo <= 1.0 - direct <= hi
    return direct <= TARGET_OVERHEAD and dropped == 0 and agrees, agrees


def _encode_cost(trace: Path, limit: int = 300) -> dict:
    """Mean microseconds per recorded step record, the same records: the packed layout's pack (the
    engine thread) and seal (the writer process; zstd, and the zlib of payload version 2, with
    their mean sizes), and the first layout's encode on both of its paths (the writer's work for
    records that cannot be packed)."""
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
    t0 = time.perf_counter()
    packed = [codec.pack(record) for record in records]
    t1 = time.perf_counter()
    sealed = [codec.seal(p) for p in packed]
    t2 = time.perf_counter()
    sealed_zlib = [codec.seal(p, zlib_level=codec.ZLIB_LEVEL) for p in packed]
    t3 = time.perf_counter()
    n = max(len(records), 1)
    out["pack_us"], out["seal_us"], out["seal_zlib_us"] = ((t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6,
                                                           (t3 - t2) / n * 1e6)
    out["sealed_bytes"] = sum(map(len, sealed)) / n
    out["sealed_zlib_bytes"] = sum(map(len, sealed_zlib)) / n
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
