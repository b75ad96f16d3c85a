"""The one record stream: what the engine emits per step, and per operator action.

The engine builds a StepStats per step (engine/core/telemetry.py) and `as_record()` turns it into the
step record below. Every consumer reads these plain dicts: the live console, the trace file
(moectl.profiler.trace_store), replay, the server's telemetry stream, benchmarks and analyses
(moectl.profiler.analysis). Leaves are JSON values or numpy arrays, so the codec can store arrays
compactly and a websocket can send them as lists.

Step record (format 1):

  step            int, 1-based engine step number
  t_start, t_end  float, engine clock seconds (time.monotonic, as are request event
                  and action times); the trace header pairs the clock with wall time
                  ("clock_origin": {"monotonic": x, "unix": y})
  batch           {"prefill_tokens", "decode_tokens", "num_seqs": int,
                   "request_ids": [str], "preempted": [str]}
  routing         int32 [layers, experts]: tokens routed to each logical expert (dense layers: 0)
  knobs           the batching knobs in force (SchedulerKnobs.as_dict())
  cache           {"kv_blocks_used", "kv_blocks_total", "prefix_queries", "prefix_hits" (cumulative),
                   "preemptions" (cumulative),
                   "kv_retention": {"policy": "full"|"streaming"|"snapkv"|"h2o", "budget_tokens": int
                                    (0: none), "budget_fraction": float (1: none), "token_bytes": int
                                    (one token's K/V over the full-attention layers), and per KV
                                    pool (device): "held_tokens" and "context_tokens" (of the
                                    running sequences: what they keep, what full retention would
                                    keep), "evicted_tokens" (cumulative)} (absent in older traces
                                    and on the simulated backend)}
  process         {"rss_bytes", "sys_used_bytes", "sys_total_bytes", "sampled_at": float,
                   "cuda": {"allocated", "reserved", "max_allocated"} or None}
                  (psutil / torch.cuda, sampled at most every PROCESS_SAMPLE_S)
  gpu             only with CUDA and NVML (absent otherwise, and in older traces): the driver's
                  measured figures, the newest sample of core/gpu_stats.py's thread:
                  {"source": "nvml", "sampled_at": float (engine clock), "period_s": float,
                   "devices": [{"index" (torch cuda index), "nvml_index", "name", and those of
                   "memory_used_bytes", "memory_total_bytes", "util_gpu_pct", "util_memory_pct",
                   "power_w", "power_limit_w", "temperature_c", "sm_clock_mhz", "memory_clock_mhz"
                   the driver supports}]}
  numerics        the activation watch, absent in older traces, on the simulated backend and with
                  the watch off: {"dtype": the activations' dtype ("float32", "bfloat16",
                  "float16"), "limit": float (its largest finite value), "fp16_limit": 65504.0,
                  "residual_dtype": the residual stream's dtype (float32 on the mixed-precision
                  path), "points": ["residual", "norm_sumsq", "attn_logits", "expert_out"],
                  "limits": [float] per point, the largest value it can hold: the residual
                  stream's dtype for residual and norm_sumsq (an accumulation in the stream's
                  dtype), the activations' dtype for attn_logits and expert_out,
                  "max": float32 [layers, 4], this step's largest value at each point of each layer:
                    residual: max |x| of the residual stream entering the layer's two norms;
                    norm_sumsq: max over tokens of the sum of x^2 over the hidden size at a norm's
                      input: what an accumulation of the norm's mean square in the stream's dtype
                      holds (moectl's norms accumulate in fp32; a pure-fp16 kernel overflows here
                      first);
                    attn_logits: the largest |q.k| * scale, as the bound max|q| * max|k| * scale
                      (row norms; Cauchy-Schwarz) over this step's queries and every key the
                      layer has cached (a running maximum);
                    expert_out: max |y| of the layer's MoE block (or dense MLP) output;
                  "bound": [bool] per point (attn_logits is an upper bound, the rest exact),
                  "nonfinite": [[bool] * 4] per layer (an inf or NaN was seen there; its "max" is
                  then fp32's largest, 3.4e38, past every limit)}
  requests        [{"id": str, "event": "arrived"|"scheduled"|"first_token"|"preempted"|"finished",
                    "t": float, ...}]; "finished" adds "reason", "prompt_tokens", "output_tokens",
                    "ttft_s", "tpot_s" (None when undefined)
  spans           {"lanes": [str], "names": [str], "lane": int16[n], "name": int16[n],
                   "layer": int16[n] (-1: not a layer's), "start_s": float64[n] (from t_start),
                   "dur_s": float64[n], "modeled": bool[n]}
                  lanes: "engine" (attention, router, combine, sampler, ...), "device d" (that
                  device's expert work, measured), "link d" (its collectives: the all-to-all,
                  modeled on the local backend (modeled[i] is True); on ranks the measured wait
                  and the outputs' all_reduce)
                  On the local backend the engine writes no modeled link spans itself: spans has
                  "links" instead, the traffic they are derived from ({"layer", "dispatch_s",
                  "combine_s", "traffic", "s_per_byte"}, moectl.wire.link_spans), and readers
                  (the trace reader, the console, the server) call with_link_spans(record) to get
                  the spans as above; records recorded before carry the spans themselves
  kernels         only in steps of a deep capture: torch.profiler events on the same clock,
                  {"lanes": [str], "names": [str], "lane", "name", "start_s", "dur_s"} like spans
  devices         None without devices, else the cluster's record:
                  {"backend": "emulated"|"multi-gpu"|"distributed",
                   "pp": int (simulated backend: pipeline stages; 1 without a pipeline),
                   "stage": [int] (simulated backend: each device's pipeline stage, device d in
                            stage d // (devices / pp); all 0 without a pipeline. The placement
                            is one stage's EP group: device d is its column d % (devices / pp)),
                   "pipeline": (simulated backend, pp > 1) {"micro_batches": int,
                               "stage_layers": [[first, last]] per stage, "bubble": float (the
                               stages' idle share of the step), "stage_s": [float] (a
                               micro-batch's mean seconds on each stage), "transfer_s": [float]
                               (a micro-batch's send across each stage boundary),
                               "transfer_links": ["intra-node"|"inter-node"|"intra- and
                               inter-node"] per boundary, "modeled": true},
                   "tokens": [int] (expert rows each device computed),
                   "busy_s": [float] (measured),
                   "link_s": [float] (modeled from bytes on emulated devices; measured on ranks:
                             the outputs' all_reduce), "link_s_modeled": bool,
                   "link_wait_s": [float] (distributed: measured time in the tiny collectives, i.e.
                                  waiting for the other ranks),
                   "step_time": {"step_s": the devices' parallel step, "modeled": bool (emulated:
                                 other + per-layer slowest device + link; distributed: the measured
                                 step), "other_s", "expert_critical_s", "link_s",
                                 "utilisation": [busy_s / step_s], "wait_s": [per device, waiting
                                 for the slowest device at the layers' synchronisation points],
                                 "cost_model": {"per_call_s", "per_expert_s", "per_row_s" (grouped
                                 GEMM, rows up to 64 a call), "per_row_large_s" (its rows beyond),
                                 "per_call_loop_s", "per_expert_loop_s", "per_row_loop_s" (the
                                 per-expert loop, under "switch_rows" rows a call), "switch_rows",
                                 "route_call_s", "route_entry_s" (replica routing, measured at
                                 the first plan; 0 before), "samples", "relative_error",
                                 "residuals": [21 quantiles of (measured - predicted) /
                                 predicted]} (calibrated from the measured
                                 busy times, or on a simulated cluster from its simulated ones;
                                 older traces lack the later terms: a missing _loop or _large term
                                 is its grouped one's)},
                   "telemetry_s": float (distributed: rank 0's time in the per-step gather),
                   "micro_batches": [int] (distributed: the step's tokens per micro-batch: one
                                    entry, or two under --overlap two-batch),
                   "link_hidden_s": [float] (distributed, measured: per rank, the time its
                                    collectives were in flight while the other micro-batch
                                    computed, to their completion or their micro-batch's
                                    return to wait, whichever came first (a GPU: the latter,
                                    an upper bound); link_s and link_wait_s then count only
                                    the time a micro-batch was blocked on them),
                   "process": [{"rss_bytes", "cuda"}] (distributed: each rank's, measured),
                   "traffic_bytes": int64 [D, D] (emulated: the modeled all-to-all's dispatch bytes src x dst,
                                    its combine the transpose; distributed: the expert output
                                    bytes src computed that the combine delivers to dst),
                   "memory": [{category: bytes}] per device, HBM tier (categories: *_weights,
                             expert_weights | expert_cache, kv_blocks, activations, comm_buffers),
                   "memory_capacity": {"hbm": int, "kv_blocks": [int]},
                   "tiers": {"host": {"expert_weights": int}}; with the disk tier (--host-mem) instead
                            {"host": {"expert_weights", "capacity", "hits", "misses"}, "disk":
                             {"expert_weights", "reads", "prefetch_reads", "bytes_read", "wait_s",
                              "prefetch_s"}} (this step's, measured),
                   "tiered_experts": "off"|"on"|"auto"|"disk",
                   "expert_cache": [{"hits", "misses", "prefetched", "prefetch_useful",
                                     "bytes_copied", "miss_wait_s"}] (tiered only),
                   "window": the engine's load window (the last LOAD_WINDOW_STEPS steps, this
                             one included), what clients draw instead of recomputing:
                             {"steps": int, "balancedness": float and "balancedness_per_layer":
                              [float] (mean / max device load of the window's routing over the
                              placement in force), "device_steps": int, "device_tokens": [float]
                              and "device_busy_s": [float] (measured, summed over the last
                              device_steps steps: those since the placement last changed, at most
                              the window), "utilisation": [float] (busy over the devices' parallel
                              step time: modeled on emulated devices, measured on ranks),
                              "age_steps": int (how many steps ago these figures were computed:
                              every WINDOW_FIGURES_EVERY steps of experts/cluster.py, and at once
                              after a placement change; absent in older traces and on the
                              simulated backend)} (absent in traces recorded before it)}

Action record: {"time": float (engine clock), "step": int (the last finished step),
"kind": str, "args": dict, "result": dict}. An applied placement's result has "bytes_moved",
"seconds", "placement", "predicted" (step time and throughput before/after, the gain with its 90%
interval "gain_low"/"gain_high", the gate's "acts" and "reason", "parts" by part before/after: the
preview's own when a previewed plan was applied; or None) and, on
ranks, "migration": {"per_rank": [{"bytes_sent", "bytes_received", "bytes_local", "seconds"}],
"bytes_transferred", "seconds_max", "measured": true}. Kinds: knobs, rebalance_preview, rebalance_apply,
placement, move, swap, replicate, drop_replica, pin, unpin, auto_rebalance_plan, auto_rebalance_held
(auto mode looked and the gate held the plan back: {"gain", "gain_low", "gain_high", "reason",
"step_s_before", "step_s_after", "moves"}), capture,
record_start, record_stop, and "<kind>_failed" with {"error": str}.

The simulated backend (engine/sim/cluster_engine.py) writes the same records, every figure the
step model's: the header has "clock": "simulated" and "simulated" (where the figures came
from), each step "simulated": true with t_start/t_end in simulated seconds, devices
{"backend": "simulated", "simulated": true, ..., "step_time": {..., "simulated": true,
"migration_stall_s"}, "breakdown_ms"} and no "traffic_bytes"; its spans are all modeled, on
lanes "engine", "device d" and one "links (all devices)". An applied placement's result has
"simulated": true and "migration" {"experts_moved", "bytes_transferred", "seconds_max",
"measured": false, "simulated": true}; 32 steps later a "rebalance_outcome" action gives
{"throughput_before", "throughput_after", "gain", "predicted_gain", "steps", "same_batches",
"migration_stall_s", "simulated": true}: the same batches under the old and the new placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the record format itself is torch-free: consoles and traces read it without torch
    import torch

FORMAT_VERSION = 1
RECORD_BUFFER = 4096  # records kept for a consumer that falls behind (the oldest are dropped)
PROCESS_SAMPLE_S = 0.25

ENGINE_LANE = "engine"


def device_lane(d: int) -> str:
    return f"device {d}"


def link_lane(d: int) -> str:
    return f"link {d}"


def lanes_for(num_devices: int) -> list[str]:
    """Span lanes of an engine with `num_devices` devices (0: no devices, the engine lane only)."""
    return [ENGINE_LANE] + [device_lane(d) for d in range(num_devices)] + [link_lane(d) for d in range(num_devices)]


@dataclass
class StepStats:
    """One step as the engine saw it; `as_record()` is its step record."""
    step: int
    t_start: float
    t_end: float
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    request_ids: list[str]
    preempted: list[str]
    kv_blocks_used: int
    routing: torch.Tensor  # [layers, experts] token counts this step
    devices: dict | None = None  # the expert layer's record (see "devices" above)
    spans: dict | None = None
    kernels: dict | None = None  # deep capture only
    requests: list = field(default_factory=list)
    cache: dict = field(default_factory=dict)
    process: dict = field(default_factory=dict)
    knobs: dict = field(default_factory=dict)
    gpu: dict | None = None  # NVML's sample; None without a GPU, and then the record has no "gpu"
    numerics: dict | None = None  # the activation watch; None with it off (no "numerics" then)

    def as_record(self) -> dict:
        devices = self.devices
        record = {
            "step": self.step, "t_start": self.t_start, "t_end": self.t_end,
            "batch": {"prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                      "num_seqs": self.num_seqs, "request_ids": self.request_ids, "preempted": self.preempted},
            "routing": self.routing.numpy().astype(np.int32), "knobs": self.knobs, "cache": self.cache,
            "process": self.process, "requests": self.requests, "spans": self.spans, "devices": devices,
        }
        if self.kernels is not None:
            record["kernels"] = self.kernels
        if self.gpu is not None:
            record["gpu"] = self.gpu
        if self.numerics is not None:
            record["numerics"] = self.numerics
        return record
