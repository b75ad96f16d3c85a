"""What the engine tells the rest of the world each step: spans, request events, cache and
process memory, deep captures, and the listeners that receive step and action records.

The step loop runs its model, sampler and postprocess inside `telemetry.step(...)`: spans (and
a deep capture) open at its start; at its end the step's record is built from the engine's
state and published. Everything per token or per layer goes through the SpanRecorder. Listeners
run on the engine thread and must be cheap (a trace writer pickling into its pipe, a console's "newest
record" slot): they never block the step loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import psutil
import torch

from moectl.engine.core.gpu_stats import GpuSampler
from moectl.engine.core.spans import SpanRecorder
from moectl.engine.models.tracing import NULL_TRACER
from moectl.wire.records import PROCESS_SAMPLE_S, StepStats

log = logging.getLogger(__name__)

MAX_KERNEL_EVENTS = 20000  # per captured step; a deep capture of a huge step keeps the first ones
_clock = time.perf_counter


class RecordingCost:
    """Seconds the engine thread spent in its own recording code, by component, timed with
    perf_counter around each piece (a few clock reads per step, not per span). The per-span
    calls inside the forward pass are counted instead (`spans`, `modeled_spans`): timing each
    one would cost as much as the span itself.

    Which components run in which mode (profiler/overhead_cost.py counts by this):
      only with spans on (profile_spans=True): span_begin (tracer.begin_step), span_collect
        (tracer.collect), and the span calls themselves;
      only with listeners (a recorder, a console): listeners;
      in every mode, spans off and no listeners included: step_setup (the batch's contexts and
        decode count, a deep capture's start), request_events, devices_record (the expert layer's
        step record), step_record (StepStats and the rest of its build, a deep capture's end),
        process_memory (sampled for every StepStats)."""

    COMPONENTS = ("step_setup", "span_begin", "span_collect", "request_events", "devices_record", "step_record",
                  "process_memory", "listeners")
    PROFILING_ONLY = ("span_begin", "span_collect", "listeners")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.COMPONENTS, 0.0)
        self.steps = self.spans = self.modeled_spans = 0

    def as_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "steps": self.steps, "spans": self.spans,
                "modeled_spans": self.modeled_spans}


class DeepCapture:
    """torch.profiler over the next N steps, one profiler session per step, its events put on the
    engine clock so they line up with the spans (kineto gives wall-clock start + microseconds)."""

    def __init__(self, steps: int):
        self.remaining = steps
        self._prof = None

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def abandon(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.__exit__(None, None, None)

    def end(self) -> dict:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.remaining -= 1
        wall_minus_clock = time.time() - time.monotonic()
        base = prof.profiler.kineto_results.trace_start_ns() / 1e9 - wall_minus_clock
        lanes: dict[str, int] = {}
        names: dict[str, int] = {}
        rows = []
        for event in list(prof.events())[:MAX_KERNEL_EVENTS]:
            on_gpu = str(event.device_type).endswith("CUDA")
            lane = f"cuda kernels (device {event.device_index})" if on_gpu else f"cpu ops (thread {event.thread})"
            lane_id = lanes.setdefault(lane, len(lanes))
            name_id = names.setdefault(event.name, len(names))
            rows.append((lane_id, name_id, base + event.time_range.start / 1e6,
                         (event.time_range.end - event.time_range.start) / 1e6))
        lane, name, start, dur = zip(*rows) if rows else ((), (), (), ())
        return {"lanes": list(lanes), "names": list(names), "lane": np.asarray(lane, dtype=np.int16),
                "name": np.asarray(name, dtype=np.int32), "start_abs": np.asarray(start, dtype=np.float64),
                "dur_s": np.asarray(dur, dtype=np.float64)}


class Telemetry:
    def __init__(self, num_devices: int, cuda: bool, spans: bool = True):
        self._num_devices = num_devices
        self.tracer = SpanRecorder(num_devices, cuda) if spans else NULL_TRACER
        self.request_events: list[dict] = []
        self.step_listeners: list[Callable] = []
        self.action_listeners: list[Callable] = []
        self.capture: DeepCapture | None = None
        self.listener_errors = 0
        self._process = psutil.Process()
        self._process_sample: dict | None = None
        self._cuda = cuda
        # the driver's view of the GPUs, on its own thread; an engine without CUDA asks NVML nothing
        self.gpu: GpuSampler | None = GpuSampler() if cuda else None
        self.cost = RecordingCost()

    @property
    def tracer_mode(self) -> dict:
        """SpanRecorder's arguments as this engine builds it (spans on): a calibration of the span
        calls' cost uses the same mode (on CUDA the spans record CUDA events)."""
        return {"num_devices": self._num_devices, "cuda": self._cuda}

    # -- request events (engine thread)
    def request(self, request_id: str, event: str, t: float | None = None, **extra) -> None:
        t0 = _clock()
        self.request_events.append({"id": request_id, "event": event,
                                    "t": time.monotonic() if t is None else t, **extra})
        self.cost.seconds["request_events"] += _clock() - t0

    def take_request_events(self) -> list[dict]:
        events, self.request_events = self.request_events, []
        return events

    # -- per step
    @contextmanager
    def step(self, engine, batch, t_start: float):
        """Around one step's model run, sampling and postprocess: spans and any deep capture
        run inside; after it the step record (StepStats) joins engine.step_log and goes to the
        listeners."""
        cost = self.cost.seconds
        t0 = _clock()
        # each sequence's context this step, read before postprocess can finish (and reset) it
        contexts = [seq.num_computed + n for seq, n in batch.items]
        # a decode runs a generated token; a 1-token prompt remainder (after a prefix hit) is prefill
        decodes = sum(1 for s, n in batch.items if n == 1 and s.num_computed >= s.num_prompt_tokens)
        if self.capture is not None:
            self.capture.begin()
        t1 = _clock()
        cost["step_setup"] += t1 - t0
        if self.tracer.enabled:
            self.tracer.begin_step(t_start)
            cost["span_begin"] += _clock() - t1
        engine.runner.probe.reset()
        try:
            yield
        except BaseException:
            if self.capture is not None:  # a failed step ends its profiler session too
                self.capture.abandon()
            raise
        t1 = _clock()
        inner = cost["span_collect"] + cost["request_events"] + cost["devices_record"] + cost["process_memory"]
        spans, kernels = self._end_step(t_start)
        stats = self._step_stats(engine, batch, t_start, decodes, contexts, spans, kernels)
        engine.step_log.append(stats)
        # the rest of the build: what was booked under its own parts meanwhile is not counted twice
        inner = cost["span_collect"] + cost["request_events"] + cost["devices_record"] + cost["process_memory"] - inner
        cost["step_record"] += _clock() - t1 - inner
        self.cost.steps += 1
        if spans is not None:
            self.cost.spans += len(spans["dur_s"])
            self.cost.modeled_spans += int(spans["modeled"].sum())
        self.publish_step(stats)

    def _end_step(self, t_start: float) -> tuple[dict | None, dict | None]:
        """(spans, kernels) of the step; kernels only while a deep capture runs."""
        kernels = None
        if self.capture is not None:
            kernels = self.capture.end()
            kernels["start_s"] = kernels.pop("start_abs") - t_start
            if self.capture.remaining <= 0:
                self.capture = None
        spans = None
        if self.tracer.enabled:
            t0 = _clock()
            spans = self.tracer.collect()
            self.cost.seconds["span_collect"] += _clock() - t0
        return spans, kernels

    def _step_stats(self, engine, batch, t_start, decodes, contexts, spans, kernels) -> StepStats:
        for seq in batch.preempted:
            self.request(seq.request_id, "preempted")
        for seq, _ in batch.items:
            if seq.first_scheduled is not None and seq.first_scheduled >= t_start and seq.num_preemptions == 0:
                self.request(seq.request_id, "scheduled", seq.first_scheduled)
        devices = None
        cost, t0 = self.cost.seconds, _clock()
        routing = engine.runner.probe.counts.clone()
        if engine.experts is not None:
            devices = engine.experts.step_record(batch.items, contexts, engine.kv_bytes_per_pool(used=True), t_start,
                                                 routing)
        cost["devices_record"] += _clock() - t0
        b = engine.blocks
        return StepStats(
            step=engine.step_count, t_start=t_start, t_end=time.monotonic(),
            prefill_tokens=batch.num_tokens - decodes, decode_tokens=decodes, num_seqs=len(batch.items),
            request_ids=[s.request_id for s, _ in batch.items], preempted=[s.request_id for s in batch.preempted],
            kv_blocks_used=b.num_used, routing=routing, devices=devices,
            spans=spans, kernels=kernels, requests=self.take_request_events(),
            cache={"kv_blocks_used": b.num_used, "kv_blocks_total": b.num_blocks, "prefix_queries": b.prefix_queries,
                   "prefix_hits": b.prefix_hits, "preemptions": engine.scheduler.num_preemptions,
                   "kv_retention": engine.retention_record()},
            process=self.process_memory(), knobs=engine.scheduler.knobs.as_dict(), gpu=self.gpu_sample(),
            numerics=engine.numerics_record())

    def process_memory(self) -> dict:
        """RSS, system memory and CUDA allocator figures, sampled at most every PROCESS_SAMPLE_S."""
        t0 = _clock()
        now = time.monotonic()
        sample = self._process_sample
        if sample is None or now - sample["sampled_at"] >= PROCESS_SAMPLE_S:
            system = psutil.virtual_memory()
            cuda = None
            if self._cuda:
                cuda = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                        "max_allocated": torch.cuda.max_memory_allocated()}
            sample = self._process_sample = {
                "rss_bytes": self._process.memory_info().rss, "sys_used_bytes": system.total - system.available,
                "sys_total_bytes": system.total, "sampled_at": now, "cuda": cuda}
        self.cost.seconds["process_memory"] += _clock() - t0
        return sample

    def gpu_sample(self) -> dict | None:
        """The newest NVML sample (gpu_stats), None without a GPU or NVML: an attribute read."""
        return self.gpu.latest() if self.gpu is not None else None

    # -- listeners
    def publish_step(self, stats) -> None:
        if not self.step_listeners:
            return
        t0 = _clock()
        for listener in list(self.step_listeners):
            self._call(listener, stats)
        self.cost.seconds["listeners"] += _clock() - t0

    def publish_action(self, action: dict) -> None:
        if not self.action_listeners:
            return
        t0 = _clock()
        for listener in list(self.action_listeners):
            self._call(listener, action)
        self.cost.seconds["listeners"] += _clock() - t0

    def _call(self, listener, item) -> None:
        """A listener's failure (a recorder closing under it, a bug) is counted and logged once;
        it never fails the engine's step."""
        try:
            listener(item)
        except Exception as exc:  # noqa: BLE001
            self.listener_errors += 1
            if self.listener_errors == 1:
                log.warning("a record listener failed: %s", exc)
