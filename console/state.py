"""What the console knows: one state object filled from step and action records.

Live, replay and attach sources all feed the same records into `ConsoleState.apply`, so every
panel works the same in every mode (the way dolphie's replay fills the state its live mode
fills). Panels only read this object; nothing here touches the engine.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from moectl.placement.placement import Placement
from moectl.placement.rebalancer import LOAD_WINDOW_STEPS, LoadWindow
from moectl.profiler.analysis import numerics_headroom, numerics_peak, step_numerics
from moectl.profiler.analysis import utilisation as device_utilisation
from moectl.profiler.outcome import StepTiming, matched_outcome, step_timing
from moectl.wire.actions import Action
from moectl.wire.link_spans import with_link_spans

WINDOW_STEPS = LOAD_WINDOW_STEPS  # the moving window behind the heat map, loads, balancedness and throughput
HISTORY_STEPS = 600  # curves over time
OUTCOME_STEPS = 1024  # steps on either side of an apply that its outcome may compare
KEEP_FINISHED = 200  # finished requests kept for the table
KEEP_LATENCIES = 2000


def _retention(cache: dict) -> dict | None:
    """A step record's cache.kv_retention, checked and summed (None where the record has none:
    older traces, the simulated backend): the policy and budget in force, one token's K/V bytes,
    and per KV pool (device) the tokens held, the tokens of the running sequences' contexts (what
    full retention would hold) and the tokens evicted so far."""
    found = cache.get("kv_retention")
    if not isinstance(found, dict):
        return None
    held, context, evicted = (list(found.get(k) or ()) for k in ("held_tokens", "context_tokens", "evicted_tokens"))
    pools = max(len(held), len(context), len(evicted))
    held, context, evicted = ([int(v) for v in values] + [0] * (pools - len(values))
                              for values in (held, context, evicted))
    token_bytes = int(found.get("token_bytes") or 0)
    return {"policy": str(found.get("policy") or "full"), "budget_tokens": int(found.get("budget_tokens") or 0),
            "budget_fraction": float(found.get("budget_fraction", 1.0) or 1.0), "token_bytes": token_bytes,
            "held_tokens": held, "context_tokens": context, "evicted_tokens": evicted,
            "held_bytes": sum(held) * token_bytes, "context_bytes": sum(context) * token_bytes}


def _sum_categories(memory) -> dict[str, int]:
    """HBM bytes per category summed over devices (one curve per category)."""
    out: dict[str, int] = {}
    for device in memory:
        for category, n in device.items():
            out[category] = out.get(category, 0) + n
    return out


class ConsoleState:
    def __init__(self, header: dict, mode: str):
        self.header = header
        self.mode = mode  # live | replay | attach
        model = header.get("model") or {}
        self.model_name = model.get("name", "?")
        self.num_layers = int(model.get("num_layers", 0))
        self.num_experts = int(model.get("num_experts", 0))
        devices = header.get("devices") or {}
        topology = devices.get("topology") or {}
        self.num_devices = int(topology.get("num_devices", 0))
        self.hbm_bytes = int(topology.get("hbm_bytes", 0))
        self.backend = devices.get("backend", "single device")
        # a simulated cluster (engine/sim): every figure is the step model's, on a simulated clock
        self.simulated = header.get("clock") == "simulated" or self.backend == "simulated"
        self.hardware = (header.get("simulated") or {}).get("hardware")
        self.sim_pricing = (header.get("simulated") or {}).get("pricing")  # "kernel tables" or "roofline only"
        self.expert_bytes = devices.get("expert_bytes")
        self.redundant_slots = devices.get("redundant_slots") or 0
        self.recorded_placement = Placement.from_dict(devices["placement"]) if devices.get("placement") else None
        self.counterfactual: Placement | None = None  # replay: the placement a rebalance would have used
        self.knobs: dict = dict(header.get("knobs") or {})
        # a trace made by `trace import` from another engine's expert-load records: only the
        # routing was measured there, so serving figures are absent rather than zero
        self.imported: dict | None = header.get("imported") if isinstance(header.get("imported"), dict) else None
        # another engine's live server (a vLLM server's /metrics: console/vllm_source.py): its own
        # figures, no step records
        self.external: dict | None = header.get("external") if isinstance(header.get("external"), dict) else None
        self.external_figures: dict | None = None
        self.error: str | None = None
        self.alerts: list[dict] = []
        self.preview: dict | None = None  # the last rebalance preview's summary
        self.reset()

    def reset(self) -> None:
        """Forget every record (a replay seek refills the window from the new position)."""
        self.latest: dict | None = None
        self.window: deque[dict] = deque(maxlen=WINDOW_STEPS)
        self.history: deque[dict] = deque(maxlen=HISTORY_STEPS)
        self.requests: OrderedDict[str, dict] = OrderedDict()
        # kept as requests change state, so that no refresh or record walks every request (a
        # simulated cluster has 10^5 in flight): counts by state, the finished in finishing
        # order (the oldest trimmed), the running ones that have their first token
        self.counts = {"waiting": 0, "running": 0, "finished": 0}
        self._finished_order: deque[str] = deque()
        self._generating: set[str] = set()
        self.ttft: deque[float] = deque(maxlen=KEEP_LATENCIES)
        self.tpot: deque[float] = deque(maxlen=KEEP_LATENCIES)
        self.actions: list[dict] = []
        self.placement = self.recorded_placement
        self.last_apply: dict | None = None  # the last applied placement's prediction and the step times around it
        self.sim_outcome: dict | None = None  # a simulated cluster's outcome of its last apply (its engine's)
        # step_timing() of the recent steps, for the next apply's outcome
        self.step_times: deque[StepTiming] = deque(maxlen=OUTCOME_STEPS)
        self._placed_at = float("-inf")  # when the placement in force was applied
        self._outcome_cache: tuple = (None, None)
        self.steps_seen = 0
        self._routing_cache = self._top_cache = (None, None)
        self.loads: LoadWindow | None = None  # the window's routing: the engine's window class, fed per record
        # the window's activation watch: each record's step_numerics() (None where it has none), read once
        self._numerics: deque[dict | None] = deque(maxlen=WINDOW_STEPS)
        self._numerics_cache: tuple = (None, None)
        # never back to 0: the caches are keyed on the version, and a reset must not revive them
        self.version = getattr(self, "version", 0) + 1

    # -- feeding
    def apply(self, records: list[dict], actions: list[dict] = ()) -> None:
        events = sorted([("a", a["time"], a) for a in actions] + [("s", r["t_start"], r) for r in records],
                        key=lambda e: e[1])
        for kind, _, item in events:
            if kind == "a":
                self._apply_action(item)
            else:
                self._apply_step(item)
        if records or actions:
            self.version += 1

    def _apply_action(self, action: dict) -> None:
        self.actions.append(action)
        result = action.get("result") or {}
        if result.get("placement") is not None:
            self.placement = Placement.from_dict(result["placement"])
            self.counterfactual = None
        if action["kind"] == Action.KNOBS:
            self.knobs = dict(result)
        if action["kind"] == Action.REBALANCE_PREVIEW:
            self.preview = dict(result)
        if action["kind"] == "rebalance_outcome":  # a simulated cluster's: the same batches under both placements
            self.sim_outcome = dict(result)
        if result.get("placement") is not None and "bytes_moved" in result:  # an applied placement
            # the measured outcome is compared with its prediction once steps arrive after it
            # "before": the steps under the placement this apply replaced, started before it (a
            # step that started after the apply but arrived first belongs to "after")
            at = action["time"]
            before = [t for t in self.step_times if self._placed_at <= t.t_start < at]
            after = [t for t in self.step_times if t.t_start >= at]
            self.last_apply = ({"time": at, "predicted": result["predicted"], "before": before, "after": after}
                               if result.get("predicted") else None)
            self.sim_outcome = None
            self._placed_at = at

    def _apply_step(self, record: dict) -> None:
        record = with_link_spans(record)  # the engine sends what modeled link spans are made of
        self.latest = record
        self.window.append(record)
        timing = step_timing(record)
        if timing is not None:
            self.step_times.append(timing)
            last = self.last_apply
            if last is not None and record["t_start"] >= last["time"] and len(last["after"]) < OUTCOME_STEPS:
                last["after"].append(timing)
        self._route(record)
        self._numerics.append(step_numerics(record))
        self.steps_seen += 1
        if record.get("knobs"):
            self.knobs = record["knobs"]
        # a decode step adds one token to a started request (a set's intersection: C speed)
        for rid in self._generating.intersection(record["batch"]["request_ids"]):
            self.requests[rid]["output_tokens"] += 1
        for event in record.get("requests") or ():
            self._request_event(event)
        cache = record.get("cache") or {}
        devices = record.get("devices") or {}
        retention = _retention(cache)
        self.history.append({
            "step": record["step"], "t": record["t_end"], "tok_s": self.throughput(),
            "balancedness": self.balancedness()["overall"],
            "kv_usage": cache.get("kv_blocks_used", 0) / max(cache.get("kv_blocks_total", 1), 1),
            "rss": (record.get("process") or {}).get("rss_bytes"),
            "memory": [sum(m.values()) for m in devices.get("memory") or ()],
            "categories": _sum_categories(devices.get("memory") or ()),
            # KV of the full-attention layers: held, and what full retention would hold (None: not recorded)
            "kv_policy": retention["policy"] if retention else None,
            "kv_held_bytes": retention["held_bytes"] if retention else None,
            "kv_full_bytes": retention["context_bytes"] if retention else None,
        })

    def _request_event(self, e: dict) -> None:
        rid, kind = e["id"], e["event"]
        req = self.requests.get(rid)
        if req is None:
            req = self.requests[rid] = {"id": rid, "state": "waiting", "prompt_tokens": e.get("prompt_tokens"),
                                        "output_tokens": 0, "arrived": e["t"], "ttft": None, "tpot": None,
                                        "reason": None, "preemptions": 0}
            self.counts["waiting"] += 1
        if req["state"] == "finished":
            return  # a late event of a request already counted finished
        if kind == "scheduled":
            self._move(req, "running")
            if req["output_tokens"]:  # back after a preemption: its tokens count on
                self._generating.add(rid)
        elif kind == "first_token":
            self._move(req, "running")
            req["output_tokens"] = 1
            self._generating.add(rid)
        elif kind == "preempted":  # its tokens are recomputed; the ones already sent stay counted
            self._move(req, "waiting")
            self._generating.discard(rid)
            req["preemptions"] += 1
        elif kind == "finished":
            self._move(req, "finished")
            self._generating.discard(rid)
            req.update(reason=e.get("reason"), output_tokens=e.get("output_tokens"),
                       prompt_tokens=e.get("prompt_tokens", req["prompt_tokens"]), ttft=e.get("ttft_s"),
                       tpot=e.get("tpot_s"))
            if e.get("ttft_s") is not None:
                self.ttft.append(e["ttft_s"])
            if e.get("tpot_s") is not None:
                self.tpot.append(e["tpot_s"])
            self._finished_order.append(rid)
            while len(self._finished_order) > KEEP_FINISHED:
                del self.requests[self._finished_order.popleft()]
                self.counts["finished"] -= 1

    def _move(self, req: dict, state: str) -> None:
        self.counts[req["state"]] -= 1
        self.counts[state] += 1
        req["state"] = state

    # -- what the panels show
    @property
    def placement_shown(self) -> Placement | None:
        """The counterfactual placement in replay after a rebalance, else the one in force."""
        return self.counterfactual or self.placement

    def _route(self, record: dict) -> None:
        """The record's routing into the window (LoadWindow: one add and one subtract a step); a
        routing of another shape (another engine) starts the window afresh from the records held."""
        routing = record["routing"]
        if self.loads is None or self.loads.shape != np.shape(routing):
            self.loads = LoadWindow.like(routing, WINDOW_STEPS)
            for held in list(self.window)[:-1]:
                if np.shape(held["routing"]) == self.loads.shape:
                    self.loads.add(held["routing"])
        self.loads.add(routing)

    def routing_window(self) -> np.ndarray:
        """Tokens per (layer, expert) over the window; one array per state version."""
        if getattr(self, "_routing_cache", (None,))[0] != (self.version, len(self.window)):
            if not self.window or self.loads is None:
                total = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
            else:
                total = self.loads.totals()
            self._routing_cache = ((self.version, len(self.window)), total)
        return self._routing_cache[1]

    def apply_outcome(self, min_steps: int = 8) -> dict | None:
        """The last apply's prediction (the preview's own) beside what the steps on either side of
        it ran, on the population both sides ran (profiler/outcome.py: batch shape and context),
        so a change of traffic across the apply is not read as the placement's doing. "outcome"
        stays None until `min_steps` steps match and the gain's interval resolves the prediction
        (or OUTCOME_STEPS steps have run after the apply: then shown as unresolved); meanwhile
        "so_far" holds the estimate. None without an apply, or when no step before it is in view
        (a replay seeked past it)."""
        last = self.last_apply
        if last is None or not last["before"]:
            return None
        key = (id(last), len(last["after"]), min_steps)
        if self._outcome_cache[0] == key:
            return self._outcome_cache[1]
        matched = matched_outcome(last["before"], last["after"], last["predicted"])
        steps = matched["steps"] if matched else 0
        result = {"predicted": last["predicted"], "steps_after": len(last["after"]), "matched": steps,
                  "min_steps": min_steps, "outcome": None, "so_far": matched}
        if matched is not None and steps >= min_steps and (matched["resolved"] or len(last["after"]) >= OUTCOME_STEPS):
            result["outcome"] = matched
        self._outcome_cache = (key, result)
        return result

    def throughput(self) -> float:
        """Tokens (prefill + decode) per second over the window."""
        if not self.window:
            return 0.0
        first, last = self.window[0], self.window[-1]
        span = last["t_end"] - first["t_start"]
        tokens = sum(r["batch"]["prefill_tokens"] + r["batch"]["decode_tokens"] for r in self.window)
        return tokens / span if span > 0 else 0.0

    def engine_window(self) -> dict | None:
        """The engine's own load-window figures in the newest record (its devices' "window"), for
        the placement in force; None for a counterfactual (a replay's what-if, the console's to
        estimate) or a trace recorded before the engine sent them."""
        if self.counterfactual is not None or self.latest is None:
            return None
        return (self.latest.get("devices") or {}).get("window")

    def device_stages(self) -> list[int] | None:
        """Each device's pipeline stage (the simulated backend's --pp), or None without a pipeline."""
        devices = (self.latest or {}).get("devices") or {}
        stages = devices.get("stage")
        return [int(s) for s in stages] if stages and int(devices.get("pp") or 1) > 1 else None

    def device_loads(self, placement: Placement | None = None) -> np.ndarray:
        """Expert rows per device over the window. Measured (the engine's window figures, else the
        devices' recorded rows) unless a placement is given or a counterfactual is shown; then
        estimated: the routing mapped through the placement, replicas sharing their expert's
        load evenly (`loads_estimated`)."""
        window = self.engine_window() if placement is None else None
        if window is not None:
            return np.asarray(window["device_tokens"], dtype=np.float64)
        if placement is None and self.counterfactual is None:
            measured = [r["devices"]["tokens"] for r in self.window if r.get("devices")]
            if measured:
                return np.sum(measured, axis=0).astype(np.float64)
        placement = placement or self.placement_shown
        if placement is not None and self.window:
            return placement.device_loads(self.routing_window()).sum(axis=0)
        return np.zeros(self.num_devices)

    @property
    def loads_estimated(self) -> bool:
        return self.counterfactual is not None or not any(r.get("devices") for r in self.window)

    def balancedness(self, placement: Placement | None = None) -> dict:
        """mean / max device load over the window, overall and per layer (1.0 when idle)."""
        window = self.engine_window() if placement is None else None
        if window is not None:
            return {"overall": float(window["balancedness"]), "per_layer": list(window["balancedness_per_layer"])}
        placement = placement or self.placement_shown
        if placement is None or not self.window:
            return {"overall": 1.0, "per_layer": [1.0] * self.num_layers}
        per_layer, overall = placement.balancedness(self.routing_window())
        return {"overall": float(overall), "per_layer": [float(x) for x in per_layer]}

    def top_experts_per_device(self, top: int = 8) -> list[list[tuple[int, int, float]]]:
        """For every device at once (one vectorised pass, cached per version): its `top` experts
        by the window tokens they bring it, replicas sharing their expert's tokens evenly."""
        placement = self.placement_shown
        key = (self.version, len(self.window), id(placement), top)
        if getattr(self, "_top_cache", (None,))[0] == key:
            return self._top_cache[1]
        slots = placement.slots  # [layers, devices, slots_per_device], -1 = empty
        share = placement.slot_loads(self.routing_window())  # the one replica rule
        per_device = share.transpose(1, 0, 2).reshape(slots.shape[1], -1)  # [devices, layers * slots]
        order = np.argsort(-per_device, axis=1)[:, :top]
        s = slots.shape[2]
        out = []
        for d, picks in enumerate(order):
            row = [(int(i // s), int(slots[i // s, d, i % s]), float(per_device[d, i])) for i in picks
                   if per_device[d, i] > 0]
            out.append(row)
        self._top_cache = (key, out)
        return out

    def utilisation(self) -> list[float]:
        """Each device's measured busy time over the devices' parallel step time (modeled on
        emulated devices, measured on ranks), over the window."""
        window = self.engine_window()
        if window is not None:
            return list(window["utilisation"])
        per_device = device_utilisation(self.window)["per_device"]
        return per_device or [0.0] * self.num_devices

    def latency(self) -> dict:
        return {name: {f"p{q}": float(np.percentile(values, q)) if values else None for q in (50, 99)}
                for name, values in (("ttft", self.ttft), ("tpot", self.tpot))}

    def request_counts(self) -> dict:
        return dict(self.counts)

    def cache(self) -> dict:
        cache = (self.latest or {}).get("cache") or {}
        total = cache.get("kv_blocks_total", 0)
        queries = cache.get("prefix_queries", 0)
        return {"kv_used": cache.get("kv_blocks_used", 0), "kv_total": total,
                "kv_usage": cache.get("kv_blocks_used", 0) / total if total else 0.0,
                "prefix_hit_rate": cache.get("prefix_hits", 0) / queries if queries else 0.0,
                "preemptions": cache.get("preemptions", 0)}

    def kv_retention(self) -> dict | None:
        """The newest record's KV retention (`_retention`: policy, budget, token_bytes, per pool
        held_tokens, context_tokens and evicted_tokens, and the bytes held and that full retention
        would hold); None where it is not recorded (older traces, the simulated backend)."""
        return _retention((self.latest or {}).get("cache") or {})

    def kv_retention_history(self) -> list[dict]:
        """The history's steps that recorded KV retention, or [] unless a policy other than full
        was in force in one of them (under full retention the two curves are one)."""
        recorded = [h for h in self.history if h["kv_policy"] is not None]
        return recorded if any(h["kv_policy"] != "full" for h in recorded) else []

    def numerics(self) -> dict | None:
        """The activation watch over the window (profiler/analysis.py numerics_headroom of
        numerics_peak): per layer and point the largest value the window's steps saw, its headroom to
        the point's dtype limit and to fp16's, the tightest pairs and where an inf or NaN was seen,
        with "steps" (the window's steps that carried it) and "window" (the window's steps); None
        where no step in the window carries it (older traces, the simulated backend, the watch off).
        One computation per state version."""
        key = (self.version, len(self._numerics))
        if self._numerics_cache[0] != key:
            peak = numerics_peak(self._numerics)
            found = None if peak is None else {**numerics_headroom(peak), "window": len(self._numerics)}
            self._numerics_cache = (key, found)
        return self._numerics_cache[1]

    def expert_cache_hit_rate(self) -> list[float] | None:
        recs = [r["devices"]["expert_cache"] for r in self.window if (r.get("devices") or {}).get("expert_cache")]
        if not recs:
            return None
        hits = np.sum([[c["hits"] for c in step] for step in recs], axis=0)
        misses = np.sum([[c["misses"] for c in step] for step in recs], axis=0)
        total = hits + misses
        return [float(h / t) if t else 0.0 for h, t in zip(hits, total)]

    def micro_batches(self) -> dict | None:
        """Two-batch overlap on the ranks over the window (None when no step there was split):
        the steps split of those recorded, and per split step the busiest rank's collective time
        in flight under the other micro-batch's compute and the time a micro-batch was blocked on
        them (all measured)."""
        recs = [r.get("devices") or {} for r in self.window]
        recs = [d for d in recs if "micro_batches" in d]
        split = [d for d in recs if len(d["micro_batches"]) == 2]
        if not split:
            return None
        hidden = [max(d["link_hidden_s"]) for d in split]
        blocked = [max(np.add(d["link_s"], d["link_wait_s"])) for d in split]
        return {"steps": len(recs), "split": len(split), "hidden_s": float(np.mean(hidden)),
                "blocked_s": float(np.mean(blocked)), "last": split[-1]["micro_batches"]}

    def tier_traffic(self) -> dict | None:
        """The host and disk tiers over the window (disk tier only): host hits and misses, and the
        reads from disk, their bytes and the compute path's wait on them."""
        recs = [((r.get("devices") or {}).get("tiers") or {}) for r in self.window]
        recs = [t for t in recs if "disk" in t]
        if not recs:
            return None
        host = {k: sum(t["host"].get(k, 0) for t in recs) for k in ("hits", "misses")}
        disk = {k: sum(t["disk"].get(k, 0) for t in recs) for k in ("reads", "bytes_read", "wait_s")}
        return {"host": host, "disk": disk, "steps": len(recs)}

    def memory(self) -> list[dict]:
        """The newest record's HBM bytes per device by category."""
        return list(((self.latest or {}).get("devices") or {}).get("memory") or [])


