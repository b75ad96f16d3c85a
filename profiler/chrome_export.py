"""Step records -> Chrome Trace Event JSON (opens in Perfetto and chrome://tracing).

Layout: one process for the engine and one per device ("device d"). The engine process has a
thread for the engine lane and one per kernel lane of a deep capture; each device process has a
"compute" thread (its expert work, measured) and a "link (modeled)" thread (its all-to-all).
Spans are complete events ("X") on the engine clock shifted so the first record starts at 0;
memory, KV blocks and process rss are counters ("C"); operator actions are global instants ("i").

Thread ids are unique across processes (pid * 1000 + n): some importers key threads by tid alone.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from moectl.wire.link_spans import with_link_spans
from moectl.wire.records import ENGINE_LANE

ENGINE_PID = 1
_TIDS_PER_PID = 1000
_COMPUTE, _LINK = 0, 1  # thread numbers inside a device process
_KERNEL_BASE = 100  # kernel lane threads inside the engine process start here
_LANE_RE = re.compile(r"(device|link) (\d+)")


def device_pid(d: int) -> int:
    return ENGINE_PID + 1 + d


def _tid(pid: int, n: int) -> int:
    return pid * _TIDS_PER_PID + n


def _plain(x):
    """JSON-safe copy: numpy scalars and arrays to Python, tuples to lists, keys to str, and
    NaN/inf to None (Perfetto's JSON parser refuses them)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class _Threads:
    """Hands out (pid, tid) per lane and remembers the names for the metadata events."""

    def __init__(self):
        self.processes: dict[int, str] = {ENGINE_PID: "engine"}
        self.threads: dict[tuple[int, int], str] = {(ENGINE_PID, _tid(ENGINE_PID, 0)): ENGINE_LANE}
        self._kernel: dict[str, int] = {}
        self._other: dict[str, int] = {}

    def device(self, d: int) -> int:
        pid = device_pid(d)
        self.processes.setdefault(pid, f"device {d}")
        return pid

    def span_lane(self, lane: str) -> tuple[int, int]:
        m = _LANE_RE.fullmatch(lane)
        if m:
            pid = self.device(int(m.group(2)))
            n, name = (_COMPUTE, "compute") if m.group(1) == "device" else (_LINK, "link (modeled)")
            return self._thread(pid, n, name)
        if lane == ENGINE_LANE:
            return ENGINE_PID, _tid(ENGINE_PID, 0)
        # a lane the contract does not name yet: its own engine thread rather than a lost span
        n = self._other.setdefault(lane, 1 + len(self._other))
        return self._thread(ENGINE_PID, n, lane)

    def kernel_lane(self, lane: str) -> tuple[int, int]:
        n = self._kernel.setdefault(lane, _KERNEL_BASE + len(self._kernel))
        return self._thread(ENGINE_PID, n, lane)

    def _thread(self, pid: int, n: int, name: str) -> tuple[int, int]:
        tid = _tid(pid, n)
        self.threads.setdefault((pid, tid), name)
        return pid, tid

    def metadata(self) -> list[dict]:
        out = []
        for pid, name in sorted(self.processes.items()):
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for (pid, tid), name in sorted(self.threads.items()):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        return out


def _us(seconds: float) -> float:
    return float(seconds) * 1e6


def _span_events(table: dict, step: int, origin: float, threads: _Threads, kernels: bool) -> list[dict]:
    """X events of one step's spans (or kernels) table; origin = the step's start on the trace clock."""
    lanes, names = table["lanes"], table["names"]
    start = np.asarray(table["start_s"], dtype=np.float64)
    dur = np.maximum(np.asarray(table["dur_s"], dtype=np.float64), 0.0)
    lane = np.asarray(table["lane"], dtype=np.int64)
    name = np.asarray(table["name"], dtype=np.int64)
    modeled = np.zeros(lane.size, bool) if kernels else np.asarray(table["modeled"], dtype=bool)
    layer = np.full(lane.size, -1) if kernels or "layer" not in table else np.asarray(table["layer"], dtype=np.int64)
    out = []
    for i in range(lane.size):
        pid, tid = (threads.kernel_lane if kernels else threads.span_lane)(str(lanes[lane[i]]))
        is_modeled = bool(modeled[i])
        args = {"step": step, "modeled": is_modeled}
        if layer[i] >= 0:
            args["layer"] = int(layer[i])
        out.append({"ph": "X", "name": str(names[name[i]]), "pid": pid, "tid": tid,
                    "ts": _us(origin + start[i]), "dur": _us(dur[i]),
                    "cat": "kernel" if kernels else ("modeled" if is_modeled else "measured"), "args": args})
    return out


def _counter(name: str, pid: int, ts: float, values: dict) -> dict:
    return {"ph": "C", "name": name, "pid": pid, "tid": _tid(pid, 0), "ts": ts, "args": _plain(values)}


def _step_counters(rec: dict, ts: float, threads: _Threads, last_rss_sample) -> tuple[list[dict], object]:
    out = []
    cache = rec.get("cache") or {}
    if cache.get("kv_blocks_used") is not None:
        out.append(_counter("kv_blocks_used", ENGINE_PID, ts, {"kv_blocks_used": cache["kv_blocks_used"]}))
    proc = rec.get("process") or {}
    # the process block is re-sent until the next sample: one counter event per new sample
    sample = proc.get("sampled_at")
    if proc.get("rss_bytes") is not None and (sample is None or sample != last_rss_sample):
        out.append(_counter("rss_bytes", ENGINE_PID, ts, {"rss_bytes": proc["rss_bytes"]}))
        if proc.get("cuda"):
            out.append(_counter("cuda_bytes", ENGINE_PID, ts, proc["cuda"]))
        last_rss_sample = sample
    devices = rec.get("devices") or {}
    for d, categories in enumerate(devices.get("memory") or ()):
        out.append(_counter("memory (HBM)", threads.device(d), ts, categories))
    return out, last_rss_sample


def _in_range(action: dict, first_step: int, last_step: int, t0: float, t1: float) -> bool:
    """An action belongs to the range when the step it followed is in it (step = the last
    finished step); without a step, when its time is."""
    if action.get("step") is not None:
        return first_step <= int(action["step"]) <= last_step
    return t0 <= float(action["time"]) <= t1


def to_chrome_trace(records: Iterable[dict], header: dict | None = None, actions: Iterable[dict] = ()) -> dict:
    """Chrome Trace Event JSON for a range of step records and the actions taken during it."""
    records = list(records)
    actions = list(actions)
    threads = _Threads()
    events: list[dict] = []
    if records:
        t0 = min(float(r["t_start"]) for r in records)
        t1 = max(float(r["t_end"]) for r in records)
        steps = [int(r["step"]) for r in records]
        actions = [a for a in actions if _in_range(a, min(steps), max(steps), t0, t1)]
    else:
        t0 = min((float(a["time"]) for a in actions), default=0.0)
    last_rss = object()
    for rec in records:
        origin = float(rec["t_start"]) - t0
        step = int(rec["step"])
        for d in range(len((rec.get("devices") or {}).get("busy_s") or ())):
            threads.device(d)  # every device gets its process even on a step without spans
        if rec.get("spans"):  # a live record's modeled link spans are derived here (a trace's: by its reader)
            events += _span_events(with_link_spans(rec)["spans"], step, origin, threads, kernels=False)
        if rec.get("kernels"):
            events += _span_events(rec["kernels"], step, origin, threads, kernels=True)
        counters, last_rss = _step_counters(rec, _us(origin), threads, last_rss)
        events += counters
    for a in actions:
        events.append({"ph": "i", "s": "g", "name": str(a.get("kind", "action")), "pid": ENGINE_PID,
                       "tid": _tid(ENGINE_PID, 0), "ts": _us(float(a["time"]) - t0),
                       "args": _plain({"step": a.get("step"), "args": a.get("args", {}),
                                       "result": a.get("result", {})})})
    trace = {"traceEvents": threads.metadata() + events, "displayTimeUnit": "ms"}
    if header:
        model = header.get("model")
        if isinstance(model, dict):
            model = model.get("name", model.get("path"))
        trace["otherData"] = _plain({"model": model, "format_version": header.get("format_version")})
    return trace


def write_chrome_trace(records: Iterable[dict], path: str | Path, header: dict | None = None,
                       actions: Iterable[dict] = ()) -> Path:
    """to_chrome_trace() written as JSON to `path` (returned)."""
    path = Path(path)
    trace = to_chrome_trace(records, header, actions)
    path.write_text(json.dumps(trace, separators=(",", ":"), allow_nan=False))
    return path
