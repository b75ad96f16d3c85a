"""Prometheus metrics, vLLM-style names with a `moectl:` prefix, on the server's own registry;
beside them vLLM's and SGLang's expert-load-balance metrics under their own names (eplb_metrics).

Everything that happens (a token, a finished request, a cache hit, a rebalance) is read from the
record stream (profiler/records.py), which the server's one consumer task hands to observe_step
and observe_action. What *is* (requests running and waiting, KV cache usage) is read from the
engine when scraped instead: no step record comes while the engine is idle, so a gauge fed only
by records would keep showing the last busy step (an abort while idle frees blocks silently).

No label names a request or an expert, so the series count is fixed: the only labels are
finished_reason (stop, length, abort, error), the balancedness quantile (0, 0.5, 1), the GPU
(torch's cuda index) of the moectl:gpu_* gauges, the device (KV pool) and retention policy
(full, streaming, snapkv, h2o) of the moectl:kv_retention_* series, and the layer and point of
the moectl:activation_* gauges (4 points a layer). The GPU figures are the driver's (NVML, see
engine/core/gpu_stats.py), read at the scrape from the engine's newest sample (from the newest
record when the engine's stats carry none); without a GPU they have no series at all, and a figure
the driver does not give has none for that GPU.

KV retention (engine/core/retention.py) comes from the step record's cache.kv_retention: the
tokens the running sequences hold and their contexts' tokens (what full retention would hold),
gauges of the policy in force only (a policy changed live leaves no series behind), both 0 at a
scrape that finds no request running (the engine's own figure then); and the tokens evicted, a
counter fed from the engine's cumulative figure per device as prefix_hits is, counted under the
policy in force when a record shows them.

The activation watch (the step record's numerics, absent in older traces, on the simulated backend
and with the watch off) gives two gauges per layer and point (residual, norm_sumsq, attn_logits,
expert_out): moectl:activation_max, the largest |value| over the last NUMERICS_WINDOW_STEPS step
records, and moectl:activation_headroom, the point's dtype limit over it (limit / max: at 2 or
below the alerts warn, below 1 it is past the limit). An inf or NaN seen there reads max +Inf and headroom
0; a max of 0 reads headroom +Inf. Only records carry it, so it is set at the scrape from the window
of records; once the window holds none with the watch, the series are gone (not frozen).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.process_collector import ProcessCollector

from moectl.placement.rebalancer import LOAD_WINDOW_STEPS
from moectl.profiler.analysis import numerics_headroom, numerics_peak, step_numerics
from moectl.server.eplb_metrics import EplbMetrics
from moectl.wire.actions import PLACEMENT_RECORDS, Action, PlacementEdit

log = logging.getLogger(__name__)

PREFIX = "moectl:"
BALANCE_WINDOW_STEPS = LOAD_WINDOW_STEPS  # the engine's load window, whose per-layer balancedness records carry
BALANCE_QUANTILES = (0.0, 0.5, 1.0)
NUMERICS_WINDOW_STEPS = LOAD_WINDOW_STEPS  # the activation gauges' peak: over this many step records, the console's window
MAX_TRACKED_REQUESTS = 65536  # arrival times kept for e2e; the oldest are forgotten beyond this
FINISH_REASONS = ("stop", "length", "abort", "error")
PINNING = frozenset({PlacementEdit.PIN.value, PlacementEdit.UNPIN.value})  # placement records that move no expert

# vLLM's buckets, with finer ones at the bottom for small models on a CPU
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# (field of a gpu sample's device, metric name, help): measured by the driver
GPU_GAUGES = (
    ("memory_used_bytes", "gpu_memory_used_bytes", "GPU memory in use, all processes"),
    ("memory_total_bytes", "gpu_memory_total_bytes", "GPU memory in all"),
    ("util_gpu_pct", "gpu_utilization_percent", "Percent of the last sample period a kernel ran"),
    ("util_memory_pct", "gpu_memory_utilization_percent", "Percent of the last sample period memory was read or written"),
    ("power_w", "gpu_power_watts", "Power draw"),
    ("power_limit_w", "gpu_power_limit_watts", "Enforced power limit"),
    ("temperature_c", "gpu_temperature_celsius", "GPU core temperature"),
    ("sm_clock_mhz", "gpu_sm_clock_mhz", "SM clock"),
    ("memory_clock_mhz", "gpu_memory_clock_mhz", "Memory clock"),
)
REBALANCE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, header: dict, model_name: str = "moectl"):
        self.registry = CollectorRegistry()  # never the global one: tests and embedders get their own
        r = self.registry
        self.eplb = EplbMetrics(r, header, model_name)  # vLLM's and SGLang's names, for their dashboards

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token: arrival to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a request "
                        "(step end to step end).", TOKEN_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "Mean time per output token after the first, "
                         "per finished request.", TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish, per request that finished with "
                        "stop or length.", E2E_BUCKETS)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "KV cache usage (1 = all blocks in use).", registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests scheduled on the engine.", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache.", registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                   registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Requests preempted (KV cache full).", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens of finished requests.",
                                         registry=r)
        self.finished = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.balancedness = Gauge(PREFIX + "expert_balancedness", "Per-layer expert balancedness (mean device load "
                                  f"/ busiest device's) over the last {BALANCE_WINDOW_STEPS} steps: quantiles over "
                                  "the MoE layers (0 = the worst layer, 1 = the best).", ["quantile"], registry=r)
        self.cache_hits = Counter(PREFIX + "expert_cache_hits", "Expert cache hits, all devices (tiered experts).",
                                  registry=r)
        self.cache_misses = Counter(PREFIX + "expert_cache_misses", "Expert cache misses, all devices (tiered "
                                    "experts).", registry=r)
        self.rebalances = Counter(PREFIX + "rebalances", "Rebalances applied (operator and automatic).", registry=r)
        self.rebalance_seconds = hist("rebalance_seconds", "Wall seconds to apply a rebalance between steps: the "
                                      "engine's own figure when its record has one, else from the end of the "
                                      "step (or the request) before it to its record.", REBALANCE_BUCKETS)
        self.kv_held = Gauge(PREFIX + "kv_retention_held_tokens", "KV tokens of the full-attention layers the "
                             "running sequences hold on the device, under the retention policy.", ["device", "policy"],
                             registry=r)
        self.kv_context = Gauge(PREFIX + "kv_retention_context_tokens", "Context tokens of the running sequences "
                                "on the device: what full retention would hold.", ["device", "policy"], registry=r)
        self.kv_evicted = Counter(PREFIX + "kv_retention_evicted_tokens", "KV tokens of the full-attention layers "
                                  "evicted from the device's sequences by the retention policy.", ["device", "policy"],
                                  registry=r)
        self._kv_series: list[tuple[str, str]] = []  # (device, policy) of the held and context gauges
        self.activation_max = Gauge(PREFIX + "activation_max", "Largest |value| at the layer's point (residual, "
                                    "norm_sumsq, attn_logits: an upper bound, expert_out) over the last "
                                    f"{NUMERICS_WINDOW_STEPS} steps (+Inf: an inf or NaN was seen).", ["layer", "point"],
                                    registry=r)
        self.activation_headroom = Gauge(PREFIX + "activation_headroom", "The point's dtype limit (its largest finite "
                                         "value) over activation_max: how many times larger it may grow (below 1: "
                                         "past it; 0: an inf or NaN was seen).", ["layer", "point"], registry=r)
        self._numerics: deque[dict | None] = deque(maxlen=NUMERICS_WINDOW_STEPS)  # step_numerics() per record
        self._numerics_stale = False
        self._numerics_children: tuple = (None, [])  # (layers, points) -> the gauges' children, in C order
        self.telemetry_dropped = Counter(PREFIX + "telemetry_dropped_messages", "Telemetry messages dropped for "
                                         "websocket clients that fell behind.", registry=r)
        self.gpu = {f: Gauge(PREFIX + name, f"{doc} (NVML, measured by the driver).", ["gpu"], registry=r)
                    for f, name, doc in GPU_GAUGES}
        self._gpu_sample: dict | None = None  # the newest record's, for stats without one
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends: leaks show here
        for reason in FINISH_REASONS:  # every series exists from the start
            self.finished.labels(finished_reason=reason)

        self._per_layer: np.ndarray | None = None  # the newest record's per-layer balancedness (engine's window)
        self._balance_stale = False
        self._arrivals: OrderedDict[str, float] = OrderedDict()  # request id -> arrival (engine clock)
        self._last_token: dict[str, float] = {}  # request id -> end of the step of its last token
        self._cumulative: dict[str, float] = {}  # last seen cumulative cache counters
        self._placement_start = float("-inf")  # when the newest placement change could start

    # -- the record stream (the event loop, from the consumer task)
    def observe_step(self, rec: dict) -> None:
        t_end = rec["t_end"]
        # a token per request in the batch that already had one (a decode step); before the
        # events, so a request's first-token step does not count as a gap
        for rid in rec["batch"]["request_ids"]:
            last = self._last_token.get(rid)
            if last is not None:
                self.itl.observe(t_end - last)
                self._last_token[rid] = t_end
        for event in rec.get("requests") or ():
            self._request_event(event, t_end)
        cache = rec.get("cache") or {}
        self._count_cumulative("prefix_queries", cache.get("prefix_queries"), self.prefix_queries)
        self._count_cumulative("prefix_hits", cache.get("prefix_hits"), self.prefix_hits)
        self._count_cumulative("preemptions", cache.get("preemptions"), self.preemptions)
        if cache.get("kv_retention"):  # absent in older traces and on the simulated backend
            self._retention(cache["kv_retention"])
        devices = rec.get("devices") or {}
        for per_device in devices.get("expert_cache") or ():  # per step, not cumulative
            self.cache_hits.inc(per_device.get("hits", 0))
            self.cache_misses.inc(per_device.get("misses", 0))
        window = devices.get("window")
        if window is not None:  # the engine's own load-window figures: drawn, never recomputed here
            self._per_layer = np.asarray(window["balancedness_per_layer"], dtype=np.float64)
            self._balance_stale = True
        self._placement_start = max(self._placement_start, t_end)
        self._gpu_sample = rec.get("gpu")
        self._numerics.append(step_numerics(rec))  # None without the watch: the window ages it out
        self._numerics_stale = True
        self.eplb.observe_step(rec)

    def _request_event(self, event: dict, t_end: float) -> None:
        rid, kind = event["id"], event["event"]
        if kind == "arrived":
            self._arrivals[rid] = event["t"]
            if len(self._arrivals) > MAX_TRACKED_REQUESTS:
                self._arrivals.popitem(last=False)
        elif kind == "first_token":
            arrival = self._arrivals.get(rid)
            if arrival is not None:
                self.ttft.observe(event["t"] - arrival)
            self._last_token[rid] = t_end
        elif kind == "preempted":
            # its recompute runs prefill steps without tokens: stop measuring its gaps
            self._last_token.pop(rid, None)
        elif kind == "finished":
            reason = event.get("reason")
            self._last_token.pop(rid, None)
            arrival = self._arrivals.pop(rid, None)
            self.finished.labels(finished_reason=reason if reason in FINISH_REASONS else "error").inc()
            self.prompt_tokens.inc(event.get("prompt_tokens") or 0)
            self.generation_tokens.inc(event.get("output_tokens") or 0)
            if reason in ("stop", "length"):  # an aborted request's latency is not a serving latency
                if arrival is not None:
                    self.e2e.observe(event["t"] - arrival)
                if event.get("tpot_s") is not None:
                    self.tpot.observe(event["tpot_s"])

    def _retention(self, kv: dict) -> None:
        policy = str(kv.get("policy"))
        held, context = kv.get("held_tokens") or [], kv.get("context_tokens") or []
        self.kv_held.clear()  # only the policy in force has held and context series
        self.kv_context.clear()
        for d, (h, c) in enumerate(zip(held, context)):
            self.kv_held.labels(device=str(d), policy=policy).set(h)
            self.kv_context.labels(device=str(d), policy=policy).set(c)
        for d, evicted in enumerate(kv.get("evicted_tokens") or []):
            self._count_cumulative(f"kv_evicted:{d}", evicted, self.kv_evicted.labels(device=str(d), policy=policy))
        self._kv_series = [(str(d), policy) for d in range(min(len(held), len(context)))]

    def _count_cumulative(self, key: str, value, counter: Counter) -> None:
        if value is None:
            return
        last = self._cumulative.get(key, 0)
        counter.inc(value - last if value >= last else value)  # a restarted engine counts from 0
        self._cumulative[key] = value

    def observe_action(self, action: dict) -> None:
        kind, result = action.get("kind"), action.get("result") or {}
        if kind == "auto_rebalance_plan":  # the automatic apply starts at the next step
            self._placement_start = max(self._placement_start, action["time"])
        seconds = result.get("seconds")
        if kind == Action.REBALANCE_APPLY:
            self.rebalances.inc()
            if seconds is None and self._placement_start > float("-inf"):
                seconds = action["time"] - self._placement_start
            if seconds is not None and seconds >= 0:
                self.rebalance_seconds.observe(seconds)
        if kind in PLACEMENT_RECORDS and result.get("placement") is not None:
            if kind not in PINNING:  # vLLM counts every move of experts; a pin moves none
                self.eplb.rearranged(seconds if isinstance(seconds, (int, float)) and seconds >= 0 else None)
            self.eplb.placement_changed(result["placement"])  # the placement in force from here on

    def placement_requested(self, t: float) -> None:
        """The server asked for a placement change at engine-clock time t (time.monotonic())."""
        self._placement_start = max(self._placement_start, t)

    def dropped_telemetry(self, n: int) -> None:
        self.telemetry_dropped.inc(n)

    # -- a scrape
    def render(self, engine_stats: dict | None) -> bytes:
        if engine_stats is not None:
            self.running.set(engine_stats["running"])
            self.waiting.set(engine_stats["waiting"])
            self.kv_usage.set(engine_stats["kv_usage"])
            if engine_stats["running"] == 0:  # nothing runs, so nothing is held (no record comes while idle)
                for labels in self._kv_series:
                    self.kv_held.labels(*labels).set(0)
                    self.kv_context.labels(*labels).set(0)
        if self._balance_stale:
            self._update_balancedness()
        self._update_gpu((engine_stats or {}).get("gpu", self._gpu_sample))
        if self._numerics_stale:
            self._update_numerics()
        return generate_latest(self.registry)

    def _update_numerics(self) -> None:
        """The activation gauges from the window's records (profiler/analysis.py: the same peak and
        headroom the console and the alerts compute)."""
        self._numerics_stale = False
        peak = numerics_peak(self._numerics)
        if peak is None:
            if self._numerics_children[0] is not None:
                self.activation_max.clear()
                self.activation_headroom.clear()
                self._numerics_children = (None, [])
            return
        found = numerics_headroom(peak)
        layers = found["max"].shape[0]
        shape = (layers, tuple(found["points"]))
        if self._numerics_children[0] != shape:  # another model, or the first record with the watch
            self.activation_max.clear()
            self.activation_headroom.clear()
            self._numerics_children = (shape, [
                (self.activation_max.labels(layer=str(layer), point=point),
                 self.activation_headroom.labels(layer=str(layer), point=point))
                for layer in range(layers) for point in found["points"]])
        values = np.where(found["nonfinite"], np.inf, found["max"]).ravel().tolist()
        rooms = found["headroom"].ravel().tolist()
        for (max_gauge, room_gauge), value, room in zip(self._numerics_children[1], values, rooms):
            max_gauge.set(value)
            room_gauge.set(room)

    def _update_gpu(self, sample: dict | None) -> None:
        for gauge in self.gpu.values():
            gauge.clear()  # a GPU or a figure that is gone has no series, not its last value
        for device in (sample or {}).get("devices") or ():
            for f, gauge in self.gpu.items():
                if f in device:
                    gauge.labels(gpu=str(device.get("index"))).set(device[f])

    def _update_balancedness(self) -> None:
        self._balance_stale = False
        per_layer = self._per_layer
        if per_layer is None or not per_layer.size:
            return
        per_layer = self.eplb.moe_layers(per_layer)  # dense layers have no experts to balance
        for q, value in zip(BALANCE_QUANTILES, np.quantile(per_layer, BALANCE_QUANTILES)):
            self.balancedness.labels(quantile=f"{q:g}").set(float(value))
        self.eplb.set_window(per_layer)
