"""The profiler's own cost, measured directly: seconds inside recording code over the run's wall.

The rule of what counts. The profiler's cost is the work that runs only because profiling is
on: what a profiled engine (profile_spans=True, a TraceRecorder listening) does and the same
engine with profile_spans=False and no listeners does not (engine/core/telemetry.py,
RecordingCost, says which piece runs in which mode). That is what the A/B cross-check's "off"
engine skips, so the two measures price the same thing. Counted:
  * span_calls: the per-span calls inside the forward pass (spans on only), counted per step and
    priced by a calibration against the NullTracer the model calls when spans are off, with the
    engine's own tracer mode (CUDA events on CUDA; timing each call in place would cost as much
    as the call);
  * span_link_model: the modeled link spans, built once a step (placed experts build them only
    while spans are on), timed;
  * span_begin, span_collect: the SpanRecorder's per-step start and collection, timed;
  * record_dict, handoff, listeners_other: the listeners (there are none with profiling off):
    the recorder's as_record, the TraceWriter's pack-and-pipe hand-off, and the rest of the
    listeners' time, timed (the three add up to the listeners' total: nothing is counted twice);
  * writer_process_cpu: the writer process's CPU seconds (user + system): off the engine's GIL
    but on the same machine.
Not counted, reported apart as engine bookkeeping: what runs in both modes (the step record the
engine keeps in step_log either way: step_setup, request_events, devices_record, step_record,
process_memory), timed the same way.
"""

from __future__ import annotations

import statistics
import time

COUNTED_TIMED = ("span_begin", "span_collect")  # RecordingCost components counted as they are
BOOKKEEPING = ("step_setup", "request_events", "devices_record", "step_record", "process_memory")


def span_call_costs(num_devices: int, calls: int = 20000, repeats: int = 7, *, cuda: bool = False) -> dict:
    """Seconds one span call adds over NullTracer's: a mark + close pair (an upper bound for the
    measured add_measured spans, which skip the mark). The modeled spans are not priced here: the
    link spans add them as arrays, twice a step, inside the span_link_model that is timed. cuda: the tracer
    records CUDA events as the engine's does on CUDA (Telemetry.tracer_mode); each timed run then
    ends with a synchronize, so the events' device-side work is inside the figure."""
    from moectl.engine.core.spans import SpanRecorder
    from moectl.engine.models.tracing import NULL_TRACER

    sync = _cuda_sync if cuda else _no_sync

    def pairs(tracer):
        t0 = time.perf_counter()
        for _ in range(calls):
            tracer.close(tracer.mark(), "attention", 0, 1)
        sync()
        return time.perf_counter() - t0

    out = {}
    for name, fn in (("pair_s", pairs),):
        on, off = [], []
        for _ in range(repeats):
            recorder = SpanRecorder(num_devices, cuda)
            recorder.begin_step()
            sync()
            on.append(fn(recorder))
            off.append(fn(NULL_TRACER))
        out[name] = max(0.0, (statistics.median(on) - statistics.median(off)) / calls)
    out["cuda"] = cuda
    return out


def span_call_costs_for(engine, **kw) -> dict:
    """span_call_costs in the engine's own tracer mode."""
    return span_call_costs(**engine.telemetry.tracer_mode, **kw)


def _no_sync() -> None:
    pass


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


class LinkSpanTimer:
    """Times the local cluster's modeled link spans: the placed experts' stats.link_spans, which
    runs only while spans are on (the step record's own link time calls the cluster's
    link_seconds directly). Each layer's append to the step's pending list is left out: one list
    append (~0.1 us)."""

    def __init__(self, engine):
        self.seconds = 0.0
        self.calls = 0
        stats = getattr(getattr(engine.experts, "cluster", None), "stats", None)
        inner = getattr(stats, "link_spans", None)
        if inner is None:
            return

        def timed():
            t0 = time.perf_counter()
            inner()
            self.seconds += time.perf_counter() - t0
            self.calls += 1

        stats.link_spans = timed


def direct_overhead(cost: dict, wall_s: float, *, record_s: float, handoff_s: float, link: LinkSpanTimer,
                    span_costs: dict, writer_cpu_s: float | None) -> dict:
    """The counted components' seconds and share of wall_s, and their sum over wall_s
    (`direct_overhead`); the engine bookkeeping apart, with its own sum (see the module's rule)."""
    s = cost["seconds"]
    closed = cost["spans"] - cost["modeled_spans"]
    parts = {
        # the span hot path: counted calls x calibrated increment
        # the modeled spans' own calls are inside span_link_model's timed build: not priced again
        "span_calls": (closed * span_costs["pair_s"],
                       "counted x calibrated"),
        "span_link_model": (link.seconds, "timed"),
        **{name: (s[name], "timed") for name in COUNTED_TIMED},
        # the listeners' time holds the recorder's as_record and hand-off: shown apart, counted once
        "record_dict": (record_s, "timed"),
        "handoff": (handoff_s, "timed"),
        "listeners_other": (max(0.0, s["listeners"] - record_s - handoff_s), "timed"),
    }
    if writer_cpu_s is not None:
        parts["writer_process_cpu"] = (writer_cpu_s, "process cpu time")

    def table(items):
        return {name: {"seconds": sec, "share": sec / wall_s, "measured": how} for name, (sec, how) in items}

    components = table(parts.items())
    bookkeeping = table((name, (s[name], "timed")) for name in BOOKKEEPING)
    total = sum(c["seconds"] for c in components.values())
    bookkeeping_s = sum(c["seconds"] for c in bookkeeping.values())
    engine_thread = total - (writer_cpu_s or 0.0)
    return {"components": components, "engine_bookkeeping": bookkeeping, "counted_s": total,
            "direct_overhead": total / wall_s, "engine_bookkeeping_s": bookkeeping_s,
            "engine_bookkeeping_share": bookkeeping_s / wall_s, "engine_thread_share": engine_thread / wall_s,
            "wall_s": wall_s, "steps": cost["steps"], "spans_per_step": cost["spans"] / max(cost["steps"], 1),
            "span_call_costs": span_costs, "link_span_builds": link.calls}
