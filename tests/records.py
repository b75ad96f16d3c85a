"""Synthetic step records and span tables, following moectl/wire/records.py, whose
numbers can be worked out by hand."""

from __future__ import annotations

import numpy as np

from moectl.placement.placement import Placement

# L=2 layers, E=4 experts. Under the contiguous placement on 2 devices (E0,E1 | E2,E3):
#   layer 0 -> device loads 8 | 4 (balancedness 6/8), layer 1 -> 6 | 2 (4/6); overall 10/14.
ROUTING = np.array([[6, 2, 4, 0], [3, 3, 1, 1]], np.int32)
CONTIGUOUS = Placement.contiguous(2, 4, 2)
# E0,E3 | E1,E2 in layer 0 and E0,E2 | E1,E3 in layer 1 put 6 | 6 and 4 | 4 on the devices
BALANCED = Placement([[[0, 3], [1, 2]], [[0, 2], [1, 3]]], 4)


def make_spans(rows) -> dict:
    """rows of (lane, name, start_s, dur_s, modeled, layer) -> the contract's column table."""
    lanes, names = [], []
    cols = {"lane": [], "name": [], "layer": [], "start_s": [], "dur_s": [], "modeled": []}
    for lane, name, start, dur, modeled, layer in rows:
        for table, value, col in ((lanes, lane, "lane"), (names, name, "name")):
            if value not in table:
                table.append(value)
            cols[col].append(table.index(value))
        cols["layer"].append(layer)
        cols["start_s"].append(start)
        cols["dur_s"].append(dur)
        cols["modeled"].append(modeled)
    return {"lanes": lanes, "names": names, "lane": np.array(cols["lane"], np.int16),
            "name": np.array(cols["name"], np.int16), "layer": np.array(cols["layer"], np.int16),
            "start_s": np.array(cols["start_s"], np.float64), "dur_s": np.array(cols["dur_s"], np.float64),
            "modeled": np.array(cols["modeled"], bool)}


def make_record(step: int, routing=ROUTING, t_start: float | None = None, wall: float = 0.1, busy_s=None,
                tokens=None, spans=(), requests=(), decode_tokens: int = 0, preempted=(), kv=(10, 100),
                rss: float = 1e9, sampled_at: float | None = None, memory=None, expert_cache=None,
                kernels=None) -> dict:
    """A step record following profiler/records.py; devices only when busy_s is given."""
    t_start = 100.0 + step * wall if t_start is None else t_start
    routing = np.asarray(routing, np.int32)
    rec = {
        "step": step, "t_start": t_start, "t_end": t_start + wall,
        "batch": {"prefill_tokens": 0, "decode_tokens": decode_tokens, "num_seqs": 1,
                  "request_ids": [], "preempted": list(preempted)},
        "routing": routing,
        "knobs": {"max_num_seqs": 8},
        "cache": {"kv_blocks_used": kv[0], "kv_blocks_total": kv[1], "prefix_queries": 0, "prefix_hits": 0,
                  "preemptions": 0},
        "process": {"rss_bytes": rss, "sys_used_bytes": 0, "sys_total_bytes": 1 << 34,
                    "sampled_at": t_start if sampled_at is None else sampled_at, "cuda": None},
        "requests": list(requests),
        "spans": make_spans(spans) if spans else make_spans([]),
        "devices": None,
    }
    if busy_s is not None:
        D = len(busy_s)
        rec["devices"] = {
            "backend": "emulated", "tokens": list(tokens if tokens is not None else [0] * D),
            "busy_s": list(busy_s), "util": [b / wall for b in busy_s], "link_s": [0.001] * D,
            "link_s_modeled": True, "traffic_bytes": np.zeros((D, D), np.int64),
            "memory": memory if memory is not None else [{"expert_weights": 1000 * (d + 1), "kv_blocks": 500}
                                                         for d in range(D)],
            "memory_capacity": {"hbm": 1 << 30, "kv_blocks": [100] * D}, "tiers": {"host": {"expert_weights": 0}},
            "tiered_experts": "on" if expert_cache else "off",
        }
        if expert_cache:
            rec["devices"]["expert_cache"] = expert_cache
    if kernels is not None:
        rec["kernels"] = kernels
    return rec
