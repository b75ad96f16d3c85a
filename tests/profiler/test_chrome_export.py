"""profiler.chrome_export: structure of the Chrome Trace Event JSON, and range exports."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moectl.profiler import chrome_export
from moectl.wire.records import ENGINE_LANE, device_lane, link_lane
from tests.records import make_record, make_spans

SPANS = [
    (ENGINE_LANE, "attention", 0.0, 0.02, False, 0),
    (ENGINE_LANE, "experts", 0.02, 0.05, False, 0),
    (device_lane(0), "experts", 0.03, 0.03, False, 0),
    (device_lane(1), "experts", 0.03, 0.04, False, 0),
    (link_lane(0), "dispatch", 0.02, 0.01, True, 0),
    (link_lane(1), "dispatch", 0.02, 0.01, True, 0),
    (ENGINE_LANE, "sampler", 0.08, 0.01, False, -1),
]
KERNELS = make_spans([("cpu", "aten::mm", 0.0, 0.01, False, -1), ("cuda stream 7", "gemm", 0.01, 0.02, False, -1)])


def records(n: int = 4) -> list[dict]:
    out = []
    for s in range(1, n + 1):
        rec = make_record(s, busy_s=[0.03, 0.04], tokens=[10, 12], spans=SPANS, kv=(s, 100),
                          rss=np.int64(10**9 + s), sampled_at=100.0 + (s // 2) * 0.2,
                          kernels=KERNELS if s == 2 else None)
        out.append(rec)
    return out


ACTIONS = [{"time": 100.15, "step": 1, "kind": "knobs", "args": {"max_num_seqs": np.int64(4)}, "result": {"ok": True}},
           {"time": 100.35, "step": 3, "kind": "rebalance_apply", "args": {}, "result": {"moves": 3}}]


def by_phase(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def names_of(trace: dict, kind: str) -> dict:
    return {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]: e["args"]["name"]
            for e in by_phase(trace, "M") if e["name"] == kind}


def test_structure_processes_threads_spans_counters_and_actions():
    recs = records()
    trace = chrome_export.to_chrome_trace(recs, header={"model": "tiny-mixtral", "format_version": 1},
                                          actions=ACTIONS)
    json.dumps(trace, allow_nan=False)  # plain JSON: numpy scalars converted
    assert trace["displayTimeUnit"] == "ms"
    assert trace["otherData"] == {"model": "tiny-mixtral", "format_version": 1}

    processes = names_of(trace, "process_name")
    assert sorted(processes.values()) == ["device 0", "device 1", "engine"]
    threads = names_of(trace, "thread_name")
    pid = {name: p for p, name in processes.items()}
    engine_threads = {name for (p, _), name in threads.items() if p == pid["engine"]}
    assert engine_threads == {"engine", "cpu", "cuda stream 7"}
    for d in (0, 1):
        assert {name for (p, _), name in threads.items() if p == pid[f"device {d}"]} == {"compute", "link (modeled)"}
    assert len(set(tid for _, tid in threads)) == len(threads)  # tids unique across processes

    spans = by_phase(trace, "X")
    assert len(spans) == 4 * len(SPANS) + 2
    for e in spans:
        assert {"pid", "tid", "ts", "dur", "name", "cat", "args"} <= e.keys()
        assert e["ts"] >= 0 and e["dur"] >= 0
        assert (e["pid"], e["tid"]) in threads
    modeled = [e for e in spans if e["args"]["modeled"]]
    assert len(modeled) == 8 and all(e["cat"] == "modeled" for e in modeled)
    assert all(threads[(e["pid"], e["tid"])] == "link (modeled)" for e in modeled)
    assert {e["cat"] for e in spans} == {"measured", "modeled", "kernel"}
    # step 2's device 1 span: ts from the first record's start, microseconds
    (d1,) = [e for e in spans if e["args"]["step"] == 2 and e["pid"] == pid["device 1"] and e["cat"] == "measured"]
    assert d1["ts"] == pytest.approx((recs[1]["t_start"] + 0.03 - recs[0]["t_start"]) * 1e6)
    assert d1["dur"] == pytest.approx(0.04e6) and d1["args"]["layer"] == 0
    kernels = [e for e in spans if e["cat"] == "kernel"]
    assert {e["name"] for e in kernels} == {"aten::mm", "gemm"} and all(e["pid"] == pid["engine"] for e in kernels)

    counters = by_phase(trace, "C")
    memory = [e for e in counters if e["name"] == "memory (HBM)"]
    assert len(memory) == 4 * 2  # one per step per device
    assert {e["pid"] for e in memory} == {pid["device 0"], pid["device 1"]}
    assert memory[1]["args"] == {"expert_weights": 2000, "kv_blocks": 500}
    kv = [e["args"]["kv_blocks_used"] for e in counters if e["name"] == "kv_blocks_used"]
    assert kv == [1, 2, 3, 4]
    rss = [e for e in counters if e["name"] == "rss_bytes"]
    assert len(rss) == 3  # samples at steps 1, 2 (new sampled_at), 4; step 3 repeats step 2's
    assert all(e["pid"] == pid["engine"] for e in rss + [c for c in counters if c["name"] == "kv_blocks_used"])

    instants = by_phase(trace, "i")
    assert [e["name"] for e in instants] == ["knobs", "rebalance_apply"]
    assert all(e["s"] == "g" for e in instants)
    assert instants[0]["args"] == {"step": 1, "args": {"max_num_seqs": 4}, "result": {"ok": True}}
    assert instants[0]["ts"] == pytest.approx(0.05e6)


def test_range_export_keeps_only_that_range(tmp_path):
    recs = records(6)
    path = chrome_export.write_chrome_trace(recs[2:4], tmp_path / "range.json", actions=ACTIONS)
    trace = json.loads(path.read_text())
    spans = by_phase(trace, "X")
    assert {e["args"]["step"] for e in spans} == {3, 4}
    assert min(e["ts"] for e in spans) == 0.0  # the range's first step starts at 0
    assert max(e["ts"] + e["dur"] for e in spans) <= (recs[3]["t_end"] - recs[2]["t_start"]) * 1e6 + 1e-6
    assert [e["args"]["kv_blocks_used"] for e in by_phase(trace, "C") if e["name"] == "kv_blocks_used"] == [3, 4]
    assert [e["name"] for e in by_phase(trace, "i")] == ["rebalance_apply"]  # the step-1 action is outside
    assert "otherData" not in trace


def test_records_without_devices_or_spans_and_empty_input():
    trace = chrome_export.to_chrome_trace([make_record(1)])
    assert list(names_of(trace, "process_name").values()) == ["engine"]
    assert by_phase(trace, "X") == []
    empty = chrome_export.to_chrome_trace([], actions=[{"time": 5.0, "step": 0, "kind": "record_start",
                                                        "args": {}, "result": {}}])
    assert [e["ts"] for e in by_phase(empty, "i")] == [0.0]
    json.dumps(empty, allow_nan=False)


def test_nan_and_numpy_values_become_plain_json():
    rec = make_record(1, busy_s=[0.01], tokens=[1], memory=[{"expert_weights": np.int64(7), "odd": float("nan")}])
    trace = chrome_export.to_chrome_trace([rec], header={"model": {"name": "m"}, "format_version": np.int32(1)})
    text = json.dumps(trace, allow_nan=False)
    assert '"odd":null' in text.replace(" ", "")
    assert trace["otherData"] == {"model": "m", "format_version": 1}
