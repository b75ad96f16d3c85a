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
  * span_link_model: the link traffic the modeled link spans are derived from (placed experts
    keep it only while spans are on): each MoE layer's note into preallocated arrays, counted and
    priced by a calibration, and the step's copy out of them, timed. The spans themselves are
    derived by the records' readers (moectl.wire.link_spans), off the engine and the writer;
  * span_begin, span_collect: the SpanRecorder's per-step start and collection, timed;
  * record_dict, handoff, listeners_other: the listeners (there are none with profiling off):
    the recorder's as_record, the TraceWriter's pack-and-pipe hand-off, and the rest of the
    listeners' time, timed (the three add up to the listeners' total: nothing is counted twice);
  * handoff_sender: the TraceWriter's sender thread putting a batch of records into the pipe
    when no step filled it first (the engine's process, outside the listeners), timed;
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
    measured add_measured spans, which skip the mark); and link_note_s, one MoE layer's note of
    its link traffic (link_note_cost). cuda: the tracer records CUDA events as the engine's does on
    CUDA (Telemetry.tracer_mode); each timed run then ends with a synchronize, so the events'
    device-side work is inside the figure."""
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
    out["link_note_s"] = link_note_cost(num_devices, calls, repeats)
    out["cuda"] = cuda
    return out


def link_note_cost(num_devices: int, calls: int = 20000, repeats: int = 7) -> float:
    """Seconds one MoE layer's link note adds while spans are on: the combine's clock read and
    StepDeviceStats.note_link (three stores into preallocated arrays), over an empty loop (with
    spans off the layer skips both). The step's hand-over at the last layer is timed apart."""
    import numpy as np
    import torch

    from moectl.engine.experts.placed_experts import StepDeviceStats

    stats = StepDeviceStats(num_devices, torch.device("cpu"), 3)
    stats.set_links([1, 2], np.zeros((num_devices, num_devices)))  # notes of layer 1: no hand-over
    traffic = np.ones((num_devices, num_devices), dtype=np.int64)
    note, now = stats.note_link, time.monotonic
    on, off = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            note(1, 0.0, now(), traffic)
        t1 = time.perf_counter()
        for _ in range(calls):
            pass
        on.append(t1 - t0)
        off.append(time.perf_counter() - t1)
    return max(0.0, (statistics.median(on) - statistics.median(off)) / calls)


def span_call_costs_for(engine, **kw) -> dict:
    """span_call_costs in the engine's own tracer mode."""
    return span_call_costs(**engine.telemetry.tracer_mode, **kw)


def _no_sync() -> None:
    pass


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


class LinkSpanTimer:
    """The local cluster's link traffic for the modeled link spans (spans on only): each MoE
    layer's stats.note_link counted (timing each would cost as much as the note; priced by
    link_note_cost), the step's stats.link_record at the last layer timed (the step record's own
    link time calls the cluster's link_seconds directly, in every mode)."""

    def __init__(self, engine):
        self.seconds = 0.0
        self.calls = 0  # link_record: one a step
        self.notes = 0  # note_link: one per MoE layer and step
        stats = getattr(getattr(engine.experts, "cluster", None), "stats", None)
        note, record = getattr(stats, "note_link", None), getattr(stats, "link_record", None)
        if note is None or record is None:
            return

        def counted(*args):
            self.notes += 1
            note(*args)

        def timed():
            t0 = time.perf_counter()
            out = record()
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            return out

        stats.note_link, stats.link_record = counted, timed


def direct_overhead(cost: dict, wall_s: float, *, record_s: float, handoff_s: float, link: LinkSpanTimer,
                    span_costs: dict, writer_cpu_s: float | None, sender_s: float = 0.0) -> dict:
    """The counted components' seconds and share of wall_s, and their sum over wall_s
    (`direct_overhead`); the engine bookkeeping apart, with its own sum (see the module's rule)."""
    s = cost["seconds"]
    closed = cost["spans"] - cost["modeled_spans"]
    parts = {
        # the span hot path: counted calls x calibrated increment
        "span_calls": (closed * span_costs["pair_s"],
                       "counted x calibrated"),
        # the link traffic: the step's hand-over timed, each layer's note counted x calibrated
        "span_link_model": (link.seconds + link.notes * span_costs.get("link_note_s", 0.0),
                            "timed + counted x calibrated"),
        **{name: (s[name], "timed") for name in COUNTED_TIMED},
        # the listeners' time holds the recorder's as_record and hand-off: shown apart, counted once
        "record_dict": (record_s, "timed"),
        "handoff": (handoff_s, "timed"),
        "listeners_other": (max(0.0, s["listeners"] - record_s - handoff_s), "timed"),
        "handoff_sender": (sender_s, "timed"),
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
            "span_call_costs": span_costs, "link_span_builds": link.calls,
            "link_notes": link.notes}
