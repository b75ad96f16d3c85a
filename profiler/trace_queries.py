"""Whole-trace questions the CLI and the console ask: summed routing, the placement in force at
a step, the figures `trace diff` compares, and cache hit rates over a range."""

from __future__ import annotations

import numpy as np

from moectl.placement.placement import Placement
from moectl.profiler import analysis


def trace_routing(reader):
    """(summed routing [layers, experts], the placement recorded in the header or None,
    its device count or None, bytes of one expert or None) of a trace."""
    loads = None
    for record in reader.steps():
        loads = record["routing"].astype(np.int64) if loads is None else loads + record["routing"]
    devices = reader.header.get("devices") or {}
    if loads is None:
        raise ValueError(f"{reader.path}: the trace has no steps")
    placement = Placement.from_dict(devices["placement"]) if devices.get("placement") else None
    num_devices = (devices.get("topology") or {}).get("num_devices")
    return loads, placement, num_devices, devices.get("expert_bytes")


def placement_timeline(reader) -> list[tuple[int, Placement]]:
    """The trace's placements in the order they took force: [(from_step, placement)], the
    header's from step -1, then each placement-changing action's from its step. Empty when the
    trace has no devices."""
    devices = reader.header.get("devices") or {}
    if not devices.get("placement"):
        return []
    timeline = [(-1, Placement.from_dict(devices["placement"]))]
    for action in reader.actions():
        raw = (action.get("result") or {}).get("placement")
        if raw is not None:
            timeline.append((int(action["step"]), Placement.from_dict(raw)))
    return timeline


def placement_in_force(reader, step: int | None):
    """The placement of the trace at `step`: the header's, replaced by each placement-changing
    action before it. Returns (placement or None, steps at which it changed later in the trace)."""
    timeline = placement_timeline(reader)
    if not timeline:
        return None, []
    before = [p for s, p in timeline if step is None or s < step]
    later = [s for s, _ in timeline[1:] if step is not None and s >= step]
    return before[-1], later


def trace_summary(reader) -> dict:
    """The figures `trace diff` compares, computed from a trace's records."""
    records = list(reader.steps())
    if not records:
        raise ValueError(f"{reader.path}: the trace has no steps")
    wall = records[-1]["t_end"] - records[0]["t_start"]
    tokens = sum(r["batch"]["decode_tokens"] + r["batch"]["prefill_tokens"] for r in records)
    latency = analysis.latency_percentiles(records)
    balance = analysis.balancedness(records)
    breakdown = analysis.step_breakdown(records)
    return {"steps": len(records), "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "latency": latency, "balancedness": balance.get("overall"), "breakdown": breakdown}


def cache_summary(records: list[dict]) -> dict:
    """KV preemptions, prefix-cache hits and expert-cache hits over the range."""
    # counters are cumulative: a range from the first step counts from zero, a later one from its start
    first = (records[0].get("cache") or {}) if records[0]["step"] > 1 else {}
    last = records[-1].get("cache") or {}
    expert = [c for r in records for c in ((r.get("devices") or {}).get("expert_cache") or ())]
    hits, misses = sum(c["hits"] for c in expert), sum(c["misses"] for c in expert)
    queries = last.get("prefix_queries", 0) - first.get("prefix_queries", 0)
    return {"preemptions": sum(len(r["batch"]["preempted"]) for r in records),
            "prefix_hit_tokens": last.get("prefix_hits", 0) - first.get("prefix_hits", 0),
            "prefix_query_tokens": queries,
            "expert_cache_hit_rate": hits / (hits + misses) if expert and hits + misses else None,
            "expert_prefetches": sum(c["prefetched"] for c in expert)}
