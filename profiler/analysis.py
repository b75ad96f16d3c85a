"""Analyses over a range of step records (profiler/records.py): pure functions of plain dicts.

The console, the CLI and the tests call the same functions. Each takes a list (or any iterable)
of step records and returns plain Python values (dicts, lists, floats), ready for JSON.

Replica rule. Where a Placement maps routing to devices, an expert's tokens are split evenly over
its replicas: that is what the engine's replica policies achieve on average and what the
rebalancer plans with (Placement.device_loads). One step's real split may differ by a few tokens;
the records' devices.tokens hold what each device really computed.

Measured and modeled figures are kept apart: busy_s and spans with modeled=False are measured;
link_s and modeled spans come from bytes and bandwidth (local backend) and are never added to a
measured total.

Balancedness is mean device load / max device load (1.0 when there is no load). Over several
layers or steps it is sum of means / sum of maxes: each layer of each step waits for its busiest
device, so that is the fraction of the MoE time spent on useful work (engine.placement).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from moectl.placement.decision import MIN_GAIN, basis_from_records, decide
from moectl.placement.placement import Placement
from moectl.placement.placement import balancedness as _balance
from moectl.placement.rebalancer import plan_rebalance
from moectl.placement.replica_policy import POLICIES
from moectl.placement.step_planner import StepCost
from moectl.placement.topology import Topology
from moectl.wire.link_spans import with_link_spans
from moectl.wire.records import ENGINE_LANE

# ---- alert thresholds ------------------------------------------------------------------------
BALANCEDNESS_WARN = 0.8  # window balancedness below this: imbalance alert
BALANCEDNESS_CRITICAL = 0.5
ALERT_TOP_EXPERTS = 2  # experts named in an imbalance alert
KV_USAGE_WARN = 0.9  # peak kv_blocks_used / kv_blocks_total, alerted only with preemptions
CACHE_HIT_RATE_WARN = 0.5  # tiered expert cache hits / (hits + misses) over the window
TTFT_TAIL_RATIO = 10.0  # p99 TTFT over p50 TTFT
TTFT_TAIL_MIN_REQUESTS = 10  # fewer finished requests say nothing about a p99
LEAK_MIN_R2 = 0.8  # memory_growth: how straight the rss line must be ...
LEAK_MIN_GROWTH = 0.05  # ... and how much it must grow over the range, as a fraction of the first sample
# ... over at least this long: allocator pools and first-touched buffers grow for the first
# seconds of any run, and a short window cannot tell that warm-up from a leak
LEAK_MIN_SECONDS = 60.0
# a slope from fewer samples, or a shorter span, is the sampling's noise (two samples 0.5 s
# apart once read as +100 MiB/s): below these the slope is absent, not invented
SLOPE_MIN_SAMPLES = 3
SLOPE_MIN_SECONDS = 5.0

# span name keywords -> wall-clock category (engine lane); first match wins
_CATEGORY_KEYWORDS = (("attention", "attention"), ("router", "moe"), ("dispatch", "moe"),
                      ("combine", "moe"), ("experts", "moe"), ("shared expert", "moe"), ("moe", "moe"),
                      ("sampler", "sampler"))
CATEGORIES = ("attention", "moe", "sampler", "other")


class AnalysisError(ValueError):
    """Records that do not fit the analysis (e.g. routing of another shape than the placement)."""


# ---- small accessors ---------------------------------------------------------------------------

def _wall(rec: dict) -> float:
    return float(rec["t_end"]) - float(rec["t_start"])


def _routing(rec: dict) -> np.ndarray | None:
    r = rec.get("routing")
    return None if r is None else np.asarray(r, dtype=np.float64)


def _summed_routing(records: list[dict]) -> np.ndarray | None:
    """[L, E] tokens over the range (None when no record has routing)."""
    total = None
    for rec in records:
        r = _routing(rec)
        if r is not None:
            total = r.copy() if total is None else total + r
    return total


def _check_shape(routing: np.ndarray, placement: Placement) -> None:
    if routing.shape[-2:] != (placement.num_layers, placement.num_experts):
        raise AnalysisError(f"routing is [{routing.shape[-2]} layers, {routing.shape[-1]} experts], the placement "
                            f"[{placement.num_layers}, {placement.num_experts}]")


def _device_loads(placement: Placement, routing: np.ndarray) -> np.ndarray:
    """[..., L, E] tokens -> [..., L, D] device loads under the replica rule (Placement.slot_loads)."""
    _check_shape(routing, placement)
    return placement.slot_loads(routing).sum(-1)


def _stage_view(dev: dict, d: int, routing: np.ndarray, placement: Placement) -> tuple[int, np.ndarray]:
    """Device d's placement column and the routing its stage serves. Pipeline stages (the simulated
    backend's "pp"): the placement is one stage's EP group, device d its column d % (devices per
    stage), and the stage holds only its own layers (the record's pipeline.stage_layers)."""
    pp = int(dev.get("pp") or 1)
    if pp <= 1:
        return d, routing
    stage = int((dev.get("stage") or [0] * (d + 1))[d])
    layers = ((dev.get("pipeline") or {}).get("stage_layers") or [])
    if stage < len(layers):
        first, last = layers[stage]
        keep = np.zeros(routing.shape[0], dtype=bool)
        keep[first:last + 1] = True
        routing = np.where(keep[:, None], routing, 0)
    return d % placement.num_devices, routing


def _expert_shares_on(placement: Placement, routing: np.ndarray, device: int, top: int) -> list[dict]:
    """The (layer, expert) pairs that bring `device` most of its tokens under `routing` [L, E]."""
    carried = routing * placement.replica_shares()[:, :, device]
    total = carried.sum()
    flat = carried.ravel()
    order = np.lexsort((np.arange(flat.size), -flat))[:top]  # heaviest first, ties by (layer, expert)
    E = placement.num_experts
    return [{"layer": int(i // E), "expert": int(i % E), "tokens": float(flat[i]),
             "share": float(flat[i] / total) if total > 0 else 0.0}
            for i in order if flat[i] > 0]


def _percentiles(values: list[float], q) -> dict:
    if not values:
        return {f"p{p:g}": None for p in q}
    return {f"p{p:g}": float(np.percentile(values, p)) for p in q}


def _fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of y over x and the fit's R^2 (1.0 for a flat y: nothing unexplained)."""
    xc, yc = x - x.mean(), y - y.mean()
    sxx = float((xc * xc).sum())
    slope = float((xc * yc).sum() / sxx) if sxx > 0 else 0.0
    ss_tot = float((yc * yc).sum())
    ss_res = float(((yc - slope * xc) ** 2).sum())
    return slope, (1.0 - ss_res / ss_tot) if ss_tot > 0 else 1.0


# ---- balance ---------------------------------------------------------------------------------

def balancedness(records: Iterable[dict], placement: Placement | None = None) -> dict:
    """Balancedness of the range, overall, per layer and per step.

    With a placement: each record's routing mapped to devices through it (replica rule); per layer
    and overall over the window's summed routing (the figure plan_rebalance reports as "before"
    for the same loads and placement); None for a layer that routed nothing (a dense layer).
    Without one: each step's devices.tokens (all layers together, so per_layer is None).
    source is "placement", "devices" or None (nothing to measure).
    """
    records = list(records)
    if placement is not None:
        steps = [(rec["step"], _routing(rec)) for rec in records if rec.get("routing") is not None]
        if not steps:
            return {"source": "placement", "overall": 1.0, "per_layer": [1.0] * placement.num_layers,
                    "per_step": [], "steps": []}
        stack = np.stack([r for _, r in steps])
        per_step = [_balance(dl)[1] for dl in _device_loads(placement, stack)]
        summed = stack.sum(0)
        per_layer, overall = _balance(_device_loads(placement, summed))
        routed = summed.sum(-1) > 0  # a dense layer (no experts) routes nothing: no balance to report
        per_layer = [float(b) if r else None for b, r in zip(per_layer.tolist(), routed)]
        return {"source": "placement", "overall": overall, "per_layer": per_layer,
                "per_step": per_step, "steps": [int(s) for s, _ in steps]}
    with_devices = [rec for rec in records if rec.get("devices")]
    if not with_devices:
        return {"source": None, "overall": None, "per_layer": None, "per_step": [], "steps": []}
    tokens = [np.asarray(rec["devices"]["tokens"], dtype=np.float64) for rec in with_devices]
    per_step = [_balance(t)[1] for t in tokens]
    means = sum(t.mean() for t in tokens)
    peaks = sum(t.max() for t in tokens)
    return {"source": "devices", "overall": float(means / peaks) if peaks > 0 else 1.0, "per_layer": None,
            "per_step": per_step, "steps": [int(rec["step"]) for rec in with_devices]}


def counterfactual(records: Iterable[dict], placement: Placement) -> dict:
    """What the recorded routing would have put on each device under another placement.

    Routing (which experts each token picks) does not depend on where experts sit, so this is
    exact up to the replica rule (module doc): device_loads [L][D] and device_totals [D] in tokens
    over the range, with balancedness per layer, overall and per step.
    """
    records = list(records)
    bal = balancedness(records, placement)
    total = _summed_routing(records)
    if total is None:
        loads = np.zeros((placement.num_layers, placement.num_devices))
    else:
        loads = _device_loads(placement, total)
    return {"device_loads": loads.tolist(), "device_totals": loads.sum(0).tolist(),
            "per_layer": bal["per_layer"], "overall": bal["overall"], "per_step": bal["per_step"]}


def _step_time(rec: dict) -> tuple[float, bool]:
    """(the step's parallel time, whether it is modeled): the devices' parallel step where the
    record has one (modeled on emulated devices, measured on ranks), else the wall time."""
    st = (rec.get("devices") or {}).get("step_time")
    if st:
        return float(st["step_s"]), bool(st.get("modeled"))
    return _wall(rec), False


def utilisation(records: Iterable[dict]) -> dict:
    """Per device sum(busy_s) / sum(parallel step time) over the steps that have devices: busy
    is measured; the step time is the devices' parallel step (modeled on emulated devices, which
    run one after another, measured on distributed ranks), or the wall time in older traces.
    `wait_s`: each device's mean time per step waiting for the slowest device at the layers'
    synchronisation points. A device missing from a record counts neither its busy nor its time there."""
    busy, wall, wait = np.zeros(0), np.zeros(0), np.zeros(0)
    steps = 0
    modeled = False
    for rec in records:
        dev = rec.get("devices")
        if not dev:
            continue
        b = np.asarray(dev["busy_s"], dtype=np.float64)
        if b.size > busy.size:
            grow = (0, b.size - busy.size)
            busy, wall, wait = np.pad(busy, grow), np.pad(wall, grow), np.pad(wait, grow)
        step_s, is_modeled = _step_time(rec)
        modeled |= is_modeled
        busy[:b.size] += b
        wall[:b.size] += step_s
        w = (dev.get("step_time") or {}).get("wait_s")
        if w:
            wait[:len(w)] += np.asarray(w, dtype=np.float64)
        steps += 1
    util = np.divide(busy, wall, out=np.zeros_like(busy), where=wall > 0)
    return {"per_device": util.tolist(), "busy_s": busy.tolist(), "wall_s": wall.tolist(), "steps": steps,
            "wait_s_per_step": (wait / steps).tolist() if steps else [], "step_time_modeled": modeled}


def stragglers(records: Iterable[dict], placement: Placement | None = None, top: int = 3) -> list[dict]:
    """For each step with devices, the busiest device (largest measured busy_s): its margin over
    the median device, the rows it computed, and (with a placement) the `top` (layer, expert)
    pairs that brought it most of its tokens that step, each with its share of the device's
    tokens under the replica rule."""
    out = []
    for rec in records:
        dev = rec.get("devices")
        if not dev:
            continue
        busy = np.asarray(dev["busy_s"], dtype=np.float64)
        if busy.size == 0:
            continue
        d = int(busy.argmax())
        median = float(np.median(busy))
        item = {"step": int(rec["step"]), "device": d, "busy_s": float(busy[d]), "median_busy_s": median,
                "margin_s": float(busy[d] - median), "tokens": int(dev["tokens"][d])}
        routing = _routing(rec)
        if placement is not None and routing is not None:
            column, routing = _stage_view(dev, d, routing, placement)
            item["experts"] = _expert_shares_on(placement, routing, column, top)
        out.append(item)
    return out


def hottest_experts(records: Iterable[dict], top: int = 10) -> list[dict]:
    """The `top` (layer, expert) pairs by tokens over the range, with their share of their layer's tokens."""
    total = _summed_routing(list(records))
    if total is None:
        return []
    per_layer = total.sum(1)
    flat = total.ravel()
    E = total.shape[1]
    order = np.lexsort((np.arange(flat.size), -flat))[:top]
    return [{"layer": int(i // E), "expert": int(i % E), "tokens": float(flat[i]),
             "share": float(flat[i] / per_layer[i // E])}
            for i in order if flat[i] > 0]


# ---- time --------------------------------------------------------------------------------------

def _category(name: str) -> str | None:
    low = name.lower()
    for keyword, category in _CATEGORY_KEYWORDS:
        if keyword in low:
            return category
    return None


def _union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union of intervals (overlaps counted once)."""
    if starts.size == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    # a new merged interval begins where a start lies past every earlier end
    begins = np.ones(s.size, dtype=bool)
    begins[1:] = s[1:] > np.maximum.accumulate(e)[:-1]
    first = np.flatnonzero(begins)
    return float((np.maximum.reduceat(e, first) - s[first]).sum())


def _union_length_by_group(group: np.ndarray, starts: np.ndarray, ends: np.ndarray, span: float) -> dict[int, float]:
    """_union_length for each group at once: {group: length}, for intervals within [0, span].
    Each group is shifted past the previous one's span so one sorted pass merges them all."""
    if starts.size == 0:
        return {}
    groups, index = np.unique(group, return_inverse=True)
    shift = index * (span + 1.0)
    s, e = starts + shift, ends + shift
    order = np.argsort(s, kind="stable")
    s, e, index = s[order], e[order], index[order]
    begins = np.ones(s.size, dtype=bool)
    begins[1:] = s[1:] > np.maximum.accumulate(e)[:-1]
    first = np.flatnonzero(begins)
    lengths = np.maximum.reduceat(e, first) - s[first]
    totals = np.bincount(index[first], weights=lengths, minlength=len(groups))
    return {int(g): float(t) for g, t in zip(groups.tolist(), totals)}


def _step_categories(rec: dict) -> tuple[dict, float, dict]:
    """One step's measured seconds by category, modeled seconds, and measured busy seconds per
    device lane.

    Every instant of the step goes to one category: the innermost categorised measured span of
    the engine lane covering it (spans nest, e.g. "router" inside "moe layer 3"); where no engine
    span covers it, a measured device-lane span makes it moe (device work the engine lane did not
    wrap); otherwise it is other. Device work nested inside an engine "dispatch"/"experts" span is
    so never counted twice. Spans are clipped to the step."""
    wall = max(_wall(rec), 0.0)
    spans = with_link_spans(rec).get("spans")  # a live record's modeled link spans too
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    if not spans or len(spans.get("lane", ())) == 0:
        seconds["other"] = wall
        return seconds, 0.0, {}
    lanes, names = spans["lanes"], spans["names"]
    lane = np.asarray(spans["lane"], dtype=np.int64)
    name = np.asarray(spans["name"], dtype=np.int64)
    start = np.clip(np.asarray(spans["start_s"], dtype=np.float64), 0.0, wall)
    end = np.clip(np.asarray(spans["start_s"], dtype=np.float64) + np.asarray(spans["dur_s"], dtype=np.float64),
                  0.0, wall)
    modeled = np.asarray(spans["modeled"], dtype=bool)
    # per lane and per name once (a few hundred), then index: never a Python loop over spans
    lane_is_engine = np.array([ln == ENGINE_LANE for ln in lanes], dtype=bool)
    lane_device = np.array([int(ln.split()[1]) if str(ln).startswith("device ") else -1 for ln in lanes])
    on_engine = lane_is_engine[lane] & ~modeled
    device_of = lane_device[lane]
    on_device = (device_of >= 0) & ~modeled

    device_busy = _union_length_by_group(device_of[on_device], start[on_device], end[on_device], wall)
    modeled_s = _union_length(start[modeled], end[modeled])

    name_code = np.array([-1 if _category(n) is None else CATEGORIES.index(_category(n)) for n in names] or [-1])
    code = np.where(on_engine, name_code[name], np.where(on_device, CATEGORIES.index("moe"), -1))
    use = (code >= 0) & (end > start)
    if use.any():
        s, e, c = start[use], end[use], code[use]
        bounds = np.unique(np.concatenate([s, e]))
        lo, hi = np.searchsorted(bounds, s), np.searchsorted(bounds, e)
        # paint the elementary pieces between span boundaries, outer spans first so the inner
        # ones win; device spans rank past any engine span (clipped to the step) and go first
        piece = np.full(bounds.size - 1, -1, dtype=np.int64)
        # device spans first (all moe), as a coverage count, then the engine spans outer to
        # inner so the inner ones win; engine spans are few (a handful per layer)
        device = ~on_engine[use]
        cover = np.zeros(bounds.size, dtype=np.int64)
        np.add.at(cover, lo[device], 1)
        np.add.at(cover, hi[device], -1)
        piece[np.cumsum(cover)[:-1] > 0] = CATEGORIES.index("moe")
        engine = np.flatnonzero(~device)
        for k in engine[np.argsort(-(e - s)[engine], kind="stable")]:
            piece[lo[k]:hi[k]] = c[k]
        painted = piece >= 0
        by_code = np.bincount(piece[painted], weights=np.diff(bounds)[painted], minlength=len(CATEGORIES))
        for i, category in enumerate(CATEGORIES[:-1]):
            seconds[category] = float(by_code[i])
    seconds["other"] = max(wall - seconds["attention"] - seconds["moe"] - seconds["sampler"], 0.0)
    return seconds, modeled_s, device_busy


def step_breakdown(records: Iterable[dict]) -> dict:
    """Seconds by category over the range, totals and per-step means.

    measured_s: attention, moe (router, dispatch, expert work, combine), sampler, and other = wall
    time minus those (see _step_categories for how nested spans count once). Modeled spans (the
    link lanes on the local backend) go to communication_modeled_s only, the wall-clock union of
    the step's modeled spans: a modeled figure is never added to a measured one. device_busy_s:
    measured expert-work seconds per device (device lanes), beside the wall-clock categories.
    """
    totals = dict.fromkeys(CATEGORIES, 0.0)
    modeled = 0.0
    device_busy: dict[int, float] = {}
    wall = 0.0
    n = 0
    for rec in records:
        seconds, modeled_s, busy = _step_categories(rec)
        for k in CATEGORIES:
            totals[k] += seconds[k]
        for d, b in busy.items():
            device_busy[d] = device_busy.get(d, 0.0) + b
        modeled += modeled_s
        wall += max(_wall(rec), 0.0)
        n += 1
    devices = [device_busy.get(d, 0.0) for d in range(max(device_busy, default=-1) + 1)]
    mean = (lambda x: x / n) if n else (lambda x: 0.0)
    return {"steps": n, "wall_s": wall, "wall_mean_s": mean(wall),
            "measured_s": totals, "measured_mean_s": {k: mean(v) for k, v in totals.items()},
            "communication_modeled_s": modeled, "communication_modeled_mean_s": mean(modeled),
            "device_busy_s": devices, "device_busy_mean_s": [mean(b) for b in devices]}


def latency_percentiles(records: Iterable[dict], q=(50, 90, 99)) -> dict:
    """TTFT, TPOT and end-to-end percentiles of the requests that finished in the range, and the
    output throughput.

    ttft_s/tpot_s come from "finished" events (None skipped); e2e is finished.t - arrived.t for
    requests whose arrival is in the range too. Output tokens = batch.decode_tokens summed plus
    one per "first_token" event (the token a prefill samples), over max(t_end) - min(t_start).
    """
    records = list(records)
    ttft, tpot, e2e = [], [], []
    arrived = {}
    out_tokens = 0
    for rec in records:
        out_tokens += int((rec.get("batch") or {}).get("decode_tokens", 0))
        for ev in rec.get("requests") or ():
            kind = ev.get("event")
            if kind == "arrived":
                arrived[ev["id"]] = float(ev["t"])
            elif kind == "first_token":
                out_tokens += 1
            elif kind == "finished":
                if ev.get("ttft_s") is not None:
                    ttft.append(float(ev["ttft_s"]))
                if ev.get("tpot_s") is not None:
                    tpot.append(float(ev["tpot_s"]))
                if ev["id"] in arrived:
                    e2e.append(float(ev["t"]) - arrived[ev["id"]])
    span = (max(float(r["t_end"]) for r in records) - min(float(r["t_start"]) for r in records)) if records else 0.0
    return {"ttft_s": _percentiles(ttft, q), "tpot_s": _percentiles(tpot, q), "e2e_s": _percentiles(e2e, q),
            "counts": {"ttft": len(ttft), "tpot": len(tpot), "e2e": len(e2e)},
            "output_tokens": out_tokens, "wall_s": span,
            "throughput_tok_s": out_tokens / span if span > 0 else None}


# ---- memory --------------------------------------------------------------------------------------

def memory_growth(records: Iterable[dict]) -> dict:
    """Least-squares slope of process.rss_bytes over time (bytes/s, against sampled_at) and over
    steps (bytes/step), with the number of distinct samples and the time fit's R^2.

    The process block is sampled at most every PROCESS_SAMPLE_S, so records repeat a sample: each
    sampled_at counts once, at the first step that carries it. leak_suspected: the time slope is
    positive, its R^2 > LEAK_MIN_R2 (steady growth, not noise) and the fitted growth over the
    range exceeds LEAK_MIN_GROWTH of the first sample (not a few pages). Needs 3 samples spanning
    at least LEAK_MIN_SECONDS. With fewer than SLOPE_MIN_SAMPLES samples or a span under
    SLOPE_MIN_SECONDS the fit says nothing: the slopes are None and `absent` says why.
    """
    seen, t, step, rss = set(), [], [], []
    for rec in records:
        proc = rec.get("process")
        if not proc or proc.get("rss_bytes") is None:
            continue
        at = float(proc.get("sampled_at", rec["t_end"]))
        if at in seen:
            continue
        seen.add(at)
        t.append(at)
        step.append(float(rec["step"]))
        rss.append(float(proc["rss_bytes"]))
    n = len(rss)
    result = {"samples": n, "slope_bytes_per_s": None, "slope_bytes_per_step": None, "r2": None,
              "r2_steps": None, "growth_bytes": None, "first_bytes": rss[0] if n else None, "leak_suspected": False,
              "span_s": float(max(t) - min(t)) if n else 0.0, "absent": None}
    if n < SLOPE_MIN_SAMPLES or result["span_s"] < SLOPE_MIN_SECONDS:
        result["absent"] = (f"{n} memory sample{'s' if n != 1 else ''} over {result['span_s']:.1f} s; a slope needs "
                            f"{SLOPE_MIN_SAMPLES} over {SLOPE_MIN_SECONDS:g} s")
        return result
    t, step, rss = np.array(t), np.array(step), np.array(rss)
    slope_t, r2 = _fit_line(t, rss)
    slope_s, r2_s = _fit_line(step, rss)
    growth = slope_t * float(t.max() - t.min())
    result.update(slope_bytes_per_s=slope_t, slope_bytes_per_step=slope_s, r2=r2, r2_steps=r2_s,
                  growth_bytes=growth)
    result["leak_suspected"] = bool(n >= 3 and slope_t > 0 and r2 > LEAK_MIN_R2
                                    and growth > LEAK_MIN_GROWTH * rss[0] and t[-1] - t[0] >= LEAK_MIN_SECONDS)
    return result


# ---- numerics: the activation watch ----------------------------------------------------------------

NUMERIC_POINTS = ("residual", "norm_sumsq", "attn_logits", "expert_out")  # the record's order (wire/records.py)
FP16_LIMIT = 65504.0
# the largest finite value of each dtype a record may name (numpy's finfo; bfloat16's by its format)
DTYPE_LIMITS = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
                "float64": 1.7976931348623157e308}
HEADROOM_WARN = 2.0  # limit / max at or below this (a point at half its dtype's limit or more): the headroom alert
NONFINITE_NAMED = 3  # (layer, point) pairs an alert names before "and N more"


def _dtype_name(value) -> str:
    """"torch.bfloat16" / "bf16" / "bfloat16" -> "bfloat16" (records say the latter; be lenient)."""
    name = str(value or "").removeprefix("torch.").lower()
    return {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32",
            "fp64": "float64", "double": "float64"}.get(name, name)


def step_numerics(rec: dict) -> dict | None:
    """A step record's activation watch ("numerics", wire/records.py), checked and in arrays; None
    where the record has none (older traces, the simulated backend, the watch off) or its "max"
    is not a [layers, points] table. Lists (a websocket's JSON, where an inf or NaN arrives as
    null) read as arrays do: a null is a NaN.

    {"dtype", "limit" (the activations' largest finite value), "fp16_limit", "residual_dtype",
     "points": [str], "bound": bool [P], "limits": float64 [P] (each point's limit: the record's,
     else the residual stream's dtype's for residual and norm_sumsq, the activations' for the
     rest), "point_dtypes": [str] (whose limit that is), "max": float64 [L, P], "nonfinite": bool
     [L, P] (the record's flags, or a max that is not finite)}"""
    found = rec.get("numerics")
    if not isinstance(found, dict) or found.get("max") is None:
        return None
    try:
        return _checked_numerics(found)
    except (TypeError, ValueError):  # a field this reader cannot make sense of: as if absent
        return None


STREAM_POINTS = ("residual", "norm_sumsq")  # held (or accumulated) in the residual stream's dtype


def _checked_numerics(found: dict) -> dict | None:
    peak = np.abs(np.asarray(found["max"], dtype=np.float64))
    if peak.ndim != 2 or peak.size == 0:
        return None
    layers, width = peak.shape
    points = [str(p) for p in (found.get("points") or NUMERIC_POINTS)][:width]
    points += [f"point {i}" for i in range(len(points), width)]
    dtype = _dtype_name(found.get("dtype"))
    limit = float(found.get("limit") or DTYPE_LIMITS.get(dtype, FP16_LIMIT))
    residual_dtype = _dtype_name(found.get("residual_dtype")) or dtype
    residual_limit = DTYPE_LIMITS.get(residual_dtype, limit) if residual_dtype != dtype else limit
    point_dtypes = [residual_dtype if p in STREAM_POINTS else dtype for p in points]
    limits = found.get("limits")
    if limits is not None and len(limits) == width:
        limits = np.array([float(v) for v in limits])
    else:  # a record written before the engine sent them
        limits = np.array([residual_limit if p in STREAM_POINTS else limit for p in points])
    bound = list(found.get("bound") or [p == "attn_logits" for p in points])
    bound = [bool(b) for b in bound[:width]] + [False] * (width - len(bound))
    nonfinite = ~np.isfinite(peak)
    flags = found.get("nonfinite")
    if flags is not None:
        flags = np.asarray(flags, dtype=bool)
        if flags.shape == peak.shape:
            nonfinite |= flags
    return {"dtype": dtype or "?", "limit": limit, "fp16_limit": float(found.get("fp16_limit") or FP16_LIMIT),
            "residual_dtype": residual_dtype or "?", "points": points, "bound": bound, "limits": limits,
            "point_dtypes": [d or "?" for d in point_dtypes], "max": peak, "nonfinite": nonfinite}


def numerics_peak(steps: Iterable[dict | None]) -> dict | None:
    """The largest value at each (layer, point) over a range of step_numerics() results (None
    ones skipped): the newest step's dtype and shape, the range's steps of that kind folded in
    (an inf or NaN anywhere in the range stays flagged), with "steps" how many. None without any."""
    steps = [s for s in steps if s is not None]
    if not steps:
        return None
    newest = steps[-1]
    same = [s for s in steps if s["max"].shape == newest["max"].shape and s["dtype"] == newest["dtype"]]
    stack = np.stack([s["max"] for s in same])
    flags = np.stack([s["nonfinite"] for s in same]).any(axis=0)
    with np.errstate(invalid="ignore"):
        peak = np.where(np.isfinite(stack), stack, -np.inf).max(axis=0)
    peak = np.where(np.isfinite(peak), peak, np.where(flags, np.inf, 0.0))
    return {**newest, "max": peak, "nonfinite": flags, "steps": len(same)}


def headroom(peak: np.ndarray, limit, nonfinite: np.ndarray | None = None) -> np.ndarray:
    """limit / max per cell: how many times larger a value may grow before it is its dtype's
    largest finite value (below 1: past it). inf where the max is 0; 0 where an inf or NaN was seen."""
    peak = np.asarray(peak, dtype=np.float64)
    limit = np.broadcast_to(np.asarray(limit, dtype=np.float64), peak.shape)
    out = np.divide(limit, peak, out=np.full(peak.shape, np.inf), where=peak > 0)
    bad = ~np.isfinite(peak) if nonfinite is None else (nonfinite | ~np.isfinite(peak))
    out[bad] = 0.0
    return out


def numerics_headroom(found: dict) -> dict:
    """step_numerics() or numerics_peak()'s figures with their headroom: "headroom" [L, P] to each
    point's limit, "fp16_headroom" [L, P] to fp16's 65504 (what serving in fp16 would leave), the
    tightest (layer, point) of each ("tightest", "tightest_fp16"; headroom ties go to the lower
    layer, then the earlier point) and "nonfinite_at": the (layer, point) pairs that saw an inf or
    NaN, in forward order (the first is where it started)."""
    room = headroom(found["max"], found["limits"], found["nonfinite"])
    room16 = headroom(found["max"], found["fp16_limit"], found["nonfinite"])

    def tightest(h: np.ndarray) -> tuple[int, int]:
        i = int(np.argmin(h))  # the first minimum in C order: the lowest layer, then the earliest point
        return i // h.shape[1], i % h.shape[1]

    return {**found, "headroom": room, "fp16_headroom": room16, "tightest": tightest(room),
            "tightest_fp16": tightest(room16),
            "nonfinite_at": [(int(layer), int(p)) for layer, p in np.argwhere(found["nonfinite"])]}


def fmt_magnitude(v: float) -> str:
    """65504, 123.5, 0.0123, 3.39e+38: six significant digits at most, an exponent only far from 1."""
    return f"{v:.6g}" if 1e-3 <= abs(v) < 1e6 or v == 0 or not np.isfinite(v) else f"{v:.3g}"


def point_label(found: dict, p: int) -> str:
    """A point's name for people: "attn_logits (a bound)" where the record says it is one."""
    return found["points"][p] + (" (a bound)" if found["bound"][p] else "")


def _numerics_alerts(records) -> list[dict]:
    peak = numerics_peak(step_numerics(rec) for rec in records)
    if peak is None:
        return []
    found = numerics_headroom(peak)
    out = []
    where = found["nonfinite_at"]
    if where:
        named = ", ".join(f"L{layer} {point_label(found, p)}" for layer, p in where[:NONFINITE_NAMED])
        more = f" and {len(where) - NONFINITE_NAMED} more" if len(where) > NONFINITE_NAMED else ""
        first_layer, first_point = where[0]
        out.append(_alert(
            "numerics_nonfinite", "critical",
            f"inf/NaN in the activations ({found['dtype']}) within the last {found['steps']} steps: {named}{more}; "
            f"it first appears at layer {first_layer}, {found['points'][first_point]}.",
            ("keep the residual stream in fp32 (--mixed-precision; `moectl verify --dtype fp16 --mixed-precision` "
             "shows whether that repairs it), serve in bfloat16 (float32's range), or find the requests that drive it"
             if found["dtype"] == "float16"
             else "find the requests and the layer's weights that produce it (a float16 limit is not the cause here)"),
            {"layer": first_layer, "point": found["points"][first_point], "dtype": found["dtype"],
             "cells": [[layer, found["points"][p]] for layer, p in where]}))
    room = found["headroom"]
    tight = room <= HEADROOM_WARN
    tight[found["nonfinite"]] = False  # said above
    if tight.any():
        layer, p = np.unravel_index(int(np.argmin(np.where(tight, room, np.inf))), room.shape)
        layer, p = int(layer), int(p)
        value, limit, h = float(found["max"][layer, p]), float(found["limits"][p]), float(room[layer, p])
        dtype = found["point_dtypes"][p]
        others = int(tight.sum()) - 1
        bound = (" (an upper bound, max|q| * max|k| * scale: the logits themselves may be smaller)"
                 if found["bound"][p] else
                 " (the sum of squares an accumulation of the norm's mean square in the stream's dtype holds)"
                 if found["points"][p] == "norm_sumsq" else "")
        out.append(_alert(
            "numerics_headroom", "warning",
            f"layer {layer} {found['points'][p]} reached {fmt_magnitude(value)}{bound}: headroom {h:.2f}x to "
            f"{dtype}'s largest value {fmt_magnitude(limit)} ({HEADROOM_WARN:g}x or less)"
            + (f"; {others} more (layer, point) pair{'s' if others != 1 else ''} at {HEADROOM_WARN:g}x or less" if others else "")
            + f", over the last {found['steps']} steps.",
            ("serve in bfloat16 (float32's range), or find the requests that drive it" if dtype == "float16"
             else "find the requests that drive it"),
            {"layer": layer, "point": found["points"][p], "max": value, "limit": limit, "headroom": h,
             "dtype": dtype, "bound": bool(found["bound"][p]), "pairs_under": others + 1}))
    return out


# ---- alerts ----------------------------------------------------------------------------------

def _alert(kind: str, severity: str, message: str, action: str, predicted: dict) -> dict:
    return {"kind": kind, "severity": severity, "message": message, "action": action, "predicted": predicted}


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _spare_slots(placement: Placement) -> int:
    return max(placement.slots_per_device - -(-placement.num_experts // placement.num_devices), 0)


def _imbalance_alert(records, placement, topology, expert_bytes, redundant, policy="locality") -> dict | None:
    bal = balancedness(records, placement)
    overall = bal["overall"]
    if overall is None or overall >= BALANCEDNESS_WARN:
        return None
    used = utilisation(records)
    util = used["per_device"]
    routing = _summed_routing(records)
    waiting = ""
    if util:
        device = int(np.argmax(util))
        head = f"device {device} at {util[device]:.0%} utilisation (balancedness {overall:.2f})"
        waits = used["wait_s_per_step"]
        if waits and max(waits) > 0:
            idle = int(np.argmin(util))
            how = "modeled" if used["step_time_modeled"] else "measured"
            waiting = (f"; device {idle} at {util[idle]:.0%} waits {waits[idle] * 1e3:.1f} ms a step for device "
                       f"{device} ({how} parallel step)")
    else:  # placement but no device records: the busiest device by modeled load
        totals = _device_loads(placement, routing).sum(0)
        device = int(totals.argmax())
        head = f"device {device} carries {totals[device] / totals.sum():.0%} of the routed tokens " \
               f"(balancedness {overall:.2f})"
    predicted = {"device": device, "balancedness": overall}
    parts = [head]
    if placement is not None and routing is not None:
        column, stage_routing = _stage_view(records[-1].get("devices") or {}, device, routing, placement)
        hot = _expert_shares_on(placement, stage_routing, column, ALERT_TOP_EXPERTS)
        if hot:
            share = sum(h["share"] for h in hot)
            names = [f"L{h['layer']}/E{h['expert']}" for h in hot]
            parts.append(f": {_join(names)} {'carry' if len(hot) > 1 else 'carries'} {share:.0%} of its tokens")
            predicted["experts"] = [[h["layer"], h["expert"]] for h in hot]
            predicted["experts_share"] = share
    parts.append(waiting)
    timed = basis_from_records(records) if placement is not None and topology is not None else None
    if timed is not None:
        return _decided_alert(timed, records, placement, topology, expert_bytes, overall, parts, predicted, policy)
    action = "preview a rebalance"
    if topology is not None and routing is not None:
        slots = redundant if redundant is not None else (_spare_slots(placement) if placement is not None else 0)
        try:
            plan = plan_rebalance(routing, topology, slots, current=placement, expert_bytes=expert_bytes or 0)
        except ValueError as exc:  # PlacementError/RebalanceError: a mismatched topology or budget
            predicted["error"] = str(exc)
        else:
            s = plan.summary()
            predicted.update(balancedness_before=s["balancedness_before"], balancedness_after=s["balancedness_after"],
                             bytes_moved=s["bytes_moved"], moves=s["moves"], redundant_per_device=slots)
            parts.append(f"; rebalancing with {slots} redundant slot{'s' if slots != 1 else ''} per device is "
                         f"predicted to raise balancedness from {s['balancedness_before']:.2f} to "
                         f"{s['balancedness_after']:.2f} (token balance only: these records carry no step times)")
            action = f"rebalance ({s['moves']} expert moves)"
    severity = "critical" if overall < BALANCEDNESS_CRITICAL else "warning"
    return _alert("imbalance", severity, "".join(parts) + ".", action, predicted)


ALERT_PLAN_DEADLINE_S = 0.05  # the alert's plan: its search stops so that the whole plan takes about this
ALERT_BOOTSTRAP_ROUNDS = 100


def _decided_alert(timed, records, placement, topology, expert_bytes, overall, parts, predicted, policy) -> dict:
    """The imbalance alert where the records carry step times: it proposes a rebalance only when
    the planner's best plan clears the gate (decision.py), and otherwise says that nothing pays
    and why. The copies are priced at the topology's link bandwidth (modeled), over the window."""
    basis, model, _ = timed
    policy = policy if policy in POLICIES else "round_robin"  # a simulated engine's "even": the even split
    t = topology
    link_bytes_per_s = 1e9 * (t.inter_node_gbps if t.num_nodes > 1 else t.intra_node_gbps)
    cost = StepCost(model, policy, copy_s=(expert_bytes or 0) / link_bytes_per_s, horizon_steps=len(basis.other_s))
    try:
        # the engine process runs this every few seconds beside the engine: a bounded search, fewer rounds
        decision = decide(basis, placement, topology, cost, expert_bytes=expert_bytes or 0,
                          residuals=model.residuals(), min_gain=MIN_GAIN, rounds=ALERT_BOOTSTRAP_ROUNDS,
                          deadline_s=ALERT_PLAN_DEADLINE_S)
    except ValueError as exc:  # a mismatched topology or placement: say so, as the token path does
        predicted["error"] = str(exc)
        return _alert("imbalance", "warning", "".join(parts) + ".", "preview a rebalance", predicted)
    predicted.update(decision.prediction(), moves=len(decision.plan.move_array),
                     bytes_moved=decision.plan.bytes_moved,
                     balancedness_before=decision.plan.balancedness_before.overall,
                     balancedness_after=decision.plan.balancedness_after.overall)
    if not decision.acts:
        return _alert("imbalance", "info", f"balancedness {overall:.2f}, but {decision.reason}.",
                      "none: keep the placement", predicted)
    parts.append(f"; {decision.reason}")
    severity = "critical" if overall < BALANCEDNESS_CRITICAL else "warning"
    return _alert("imbalance", severity, "".join(parts) + ".", f"rebalance ({len(decision.plan.move_array)} expert copies)",
                  predicted)


def _kv_alert(records) -> dict | None:
    peak, preempted = 0.0, 0
    for rec in records:
        cache = rec.get("cache") or {}
        total = cache.get("kv_blocks_total") or 0
        if total:
            peak = max(peak, cache.get("kv_blocks_used", 0) / total)
        preempted += len((rec.get("batch") or {}).get("preempted") or ())
    if peak <= KV_USAGE_WARN or preempted == 0:
        return None
    return _alert("kv_pressure", "warning",
                  f"KV cache at {peak:.0%} of its blocks with {preempted} preemption{'s' if preempted != 1 else ''} "
                  f"in the window: preempted requests recompute their prefill.",
                  "lower max_num_seqs or max_num_batched_tokens, or give the KV cache more memory",
                  {"kv_usage_peak": peak, "preemptions": preempted})


def _cache_alert(records) -> dict | None:
    hits = misses = None
    for rec in records:
        caches = (rec.get("devices") or {}).get("expert_cache")
        if not caches:
            continue
        h = np.array([c["hits"] for c in caches], dtype=np.float64)
        m = np.array([c["misses"] for c in caches], dtype=np.float64)
        hits, misses = (h, m) if hits is None else (hits + h, misses + m)
    if hits is None or hits.sum() + misses.sum() == 0:
        return None
    rate = float(hits.sum() / (hits.sum() + misses.sum()))
    if rate >= CACHE_HIT_RATE_WARN:
        return None
    per = np.divide(hits, hits + misses, out=np.ones_like(hits), where=hits + misses > 0)
    worst = int(per.argmin())
    return _alert("expert_cache", "warning",
                  f"expert cache hit rate {rate:.0%} (device {worst}: {per[worst]:.0%}): most expert calls "
                  f"wait for weights from the host tier.",
                  "give the expert cache more slots, or rebalance so each device's working set fits",
                  {"hit_rate": rate, "worst_device": worst, "worst_hit_rate": float(per[worst])})


def _leak_alert(records) -> dict | None:
    g = memory_growth(records)
    if not g["leak_suspected"]:
        return None
    return _alert("memory_leak", "warning",
                  f"process memory grows steadily: {g['slope_bytes_per_s'] / 2**20:.1f} MiB/s "
                  f"(R^2 {g['r2']:.2f}, +{g['growth_bytes'] / g['first_bytes']:.0%} over the window).",
                  "record a longer trace and look for state kept per request or per step",
                  {"slope_bytes_per_s": g["slope_bytes_per_s"], "r2": g["r2"], "growth_bytes": g["growth_bytes"]})


def _ttft_alert(records) -> dict | None:
    lat = latency_percentiles(records, q=(50, 99))
    p50, p99 = lat["ttft_s"]["p50"], lat["ttft_s"]["p99"]
    if lat["counts"]["ttft"] < TTFT_TAIL_MIN_REQUESTS or not p50 or p99 <= TTFT_TAIL_RATIO * p50:
        return None
    return _alert("ttft_tail", "warning",
                  f"p99 TTFT {p99 * 1e3:.0f} ms is {p99 / p50:.0f}x the p50 ({p50 * 1e3:.0f} ms): some requests "
                  f"wait long for their first token.",
                  "lower long_prefill_token_threshold so long prefills are chunked, or lower max_num_seqs",
                  {"ttft_p50_s": p50, "ttft_p99_s": p99, "ratio": p99 / p50})


def alerts(records: Iterable[dict], placement: Placement | None = None, topology: Topology | None = None,
           expert_bytes: int | None = None, redundant: int | None = None, policy: str = "locality") -> list[dict]:
    """Plain-language alerts over the range: [{"kind", "severity", "message", "action", "predicted"}].

    imbalance: balancedness (see balancedness()) below BALANCEDNESS_WARN; names the busiest device,
      and with a placement the experts that load it. Where the records carry step times (and a
      placement and topology are given) the planner's best plan for the window is priced and
      gated (placement/decision.py): a warning proposes it when it pays, an "info" alert says
      why nothing does. Otherwise the prediction is plan_rebalance's token balance on the window's
      summed routing from `placement` with `redundant` slots per device (default: the
      placement's spare slots, else 0), and says so.
    kv_pressure: peak KV usage above KV_USAGE_WARN with preemptions in the window.
    expert_cache: tiered expert cache hit rate below CACHE_HIT_RATE_WARN.
    memory_leak: memory_growth()'s leak rule.
    ttft_tail: p99 TTFT above TTFT_TAIL_RATIO x p50 (at least TTFT_TAIL_MIN_REQUESTS requests).
    numerics_nonfinite (critical): the activation watch saw an inf or NaN in the range; names the
      (layer, point) pairs, the first in forward order being where it started.
    numerics_headroom: a point's largest value over the range at 1 / HEADROOM_WARN of its dtype's
      largest finite value or more (limit / max <= HEADROOM_WARN); names the tightest layer and point, its
      value and headroom, and how many other pairs are that close (records without the watch: none).
    """
    records = list(records)
    checks = (lambda: _imbalance_alert(records, placement, topology, expert_bytes, redundant, policy),
              lambda: _kv_alert(records), lambda: _cache_alert(records), lambda: _leak_alert(records),
              lambda: _ttft_alert(records))
    return [a for a in (check() for check in checks) if a is not None] + _numerics_alerts(records)
