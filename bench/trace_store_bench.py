"""Benchmark the trace store on records shaped like a big MoE model (61 layers x 384 experts,
64 devices): bytes per step and one hour's projected size, writer throughput, seek latency.

    python bench/trace_store_bench.py                    # 3000 steps
    python bench/trace_store_bench.py --hour             # 36,000 steps: a real one-hour file
    python bench/trace_store_bench.py --steps 500 --json

Targets: one hour at 10 steps/s under 1 GB (decimal), a writer that keeps up with 10 steps/s
without drops, and seek_step / seek_time under 50 ms (decode included) on an hour-long trace.

Each step record holds: routing, int32 [61, 384] token counts of top-8 routing for a batch of
256-2048 tokens (a log-uniform draw; expert popularity skewed per layer and drifting slowly);
per-device lists (tokens, busy_s, memory used/capacity) and a 64 x 64 int64 matrix of dispatch
bytes; 50 spans as columns (device, layer, kind, t_start, t_end); a few request events; the
scalar counters of engine.llm_engine.StepStats. Step times are a simulated 10 steps/s clock, so the
trace covers N / 10 seconds of "engine time" whatever the wall clock.

The producer stands for the engine: it writes as fast as it can but backs off while the writer's
local backlog is over half full, so the figure is what the writer process sustains, not how fast records are
dropped. Synthetic records are generated up front (a pool reused with new step numbers and
times) so that generating them does not compete with the writer for the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moectl.profiler.codec import decode, encode  # noqa: E402
from moectl.profiler.trace_store import TraceReader, TraceWriter  # noqa: E402

LAYERS, EXPERTS, TOP_K, DEVICES = 61, 384, 8, 64
HIDDEN_BYTES = 7168 * 2  # one bf16 token row of a 7168-wide model: the unit of dispatch traffic
STEPS_PER_S = 10.0
HOUR_STEPS = 36_000
TARGET_BYTES_PER_HOUR = 1e9
TARGET_SEEK_S = 0.050
SPAN_KINDS = ["attn", "moe_dispatch", "moe_expert", "moe_combine", "lm_head"]


def make_records(n: int, seed: int = 0) -> list[dict]:
    """n distinct synthetic step records (step/time fields are filled in when written)."""
    rng = np.random.default_rng(seed)
    # Zipf-like popularity per layer: expert of rank r gets weight 1 / (r + 10); a few hot experts
    weights = 1.0 / (np.arange(EXPERTS) + 10.0)
    perms = np.argsort(rng.random((LAYERS, EXPERTS)), axis=1)
    home = np.repeat(np.arange(DEVICES), EXPERTS // DEVICES)  # expert -> device (6 per device)
    capacity = [141 * 2**30] * DEVICES
    records = []
    for k in range(n):
        if k % 20 == 0:  # popularity drifts: swap a few experts' ranks now and then
            for layer in rng.integers(0, LAYERS, 8):
                i, j = rng.integers(0, EXPERTS, 2)
                perms[layer, [i, j]] = perms[layer, [j, i]]
        p = weights[perms]
        p /= p.sum(axis=1, keepdims=True)
        tokens = int(np.exp(rng.uniform(np.log(256), np.log(2048))))
        routing = rng.multinomial(tokens * TOP_K, p).astype(np.int32)  # [layers, experts]

        per_device = np.zeros((LAYERS, DEVICES), np.int64)
        np.add.at(per_device, (slice(None), home), routing)
        dev_tokens = per_device.sum(axis=0)
        src_share = rng.dirichlet(np.ones(DEVICES) * 20)  # where the tokens came from
        traffic = np.floor(np.outer(src_share, dev_tokens)).astype(np.int64) * HIDDEN_BYTES
        busy = dev_tokens * 2.1e-6 * rng.uniform(0.9, 1.1, DEVICES)
        used = [int(x) for x in 96 * 2**30 + rng.integers(0, 2**28, DEVICES) * 64]

        n_spans = 50
        span_dev = rng.integers(0, DEVICES, n_spans).astype(np.int16)
        span_start = np.sort(rng.uniform(0, 0.09, n_spans))
        spans = {"device": span_dev, "layer": rng.integers(0, LAYERS, n_spans).astype(np.int16),
                 "kind": rng.integers(0, len(SPAN_KINDS), n_spans).astype(np.uint8),
                 "t_start": span_start, "t_end": span_start + rng.uniform(1e-4, 5e-3, n_spans)}
        events = [{"request_id": f"req-{k * 3 + j}", "event": ["arrive", "first_token", "finish"][j],
                   "t": float(rng.uniform(0, 0.1))} for j in range(int(rng.integers(0, 4)))]
        decode_tokens = int(min(tokens, rng.integers(64, 512)))
        records.append({
            "step": 0, "t_start": 0.0, "t_end": 0.0,
            "prefill_tokens": tokens - decode_tokens, "decode_tokens": decode_tokens,
            "num_seqs": decode_tokens + 1, "kv_blocks_used": int(rng.integers(10_000, 60_000)),
            "preempted": [],
            "routing": routing,
            "devices": {"tokens": dev_tokens.tolist(), "busy_s": busy.tolist(),
                        "memory": {"used_bytes": used, "capacity_bytes": capacity},
                        "traffic_bytes": traffic},
            "spans": {**spans, "kinds": SPAN_KINDS},
            "requests": events,
        })
    return records


def stamp(record: dict, i: int, t0: float) -> dict:
    t = t0 + i / STEPS_PER_S
    return {**record, "step": i, "t_start": t, "t_end": t + 0.8 / STEPS_PER_S}


def run(steps: int, path: Path, pool: int, seed: int) -> dict:
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"generating {pool} synthetic records ...")
    records = make_records(pool, seed)

    # codec alone, on this thread: what one record costs the writer process
    sample = [stamp(r, i, 0.0) for i, r in enumerate(records[:50])]
    t = time.perf_counter()
    payloads = [encode(r) for r in sample]
    encode_s = (time.perf_counter() - t) / len(sample)
    t = time.perf_counter()
    for p in payloads:
        decode(p)
    decode_s = (time.perf_counter() - t) / len(sample)
    routing_bytes = np.mean([len(encode({"routing": r["routing"]})) for r in sample])

    log(f"writing {steps} steps to {path} ...")
    t0 = 1000.0
    queue_size = 1024
    backoffs = 0
    t_write = time.perf_counter()
    with TraceWriter(path, {"model": "synthetic-61x384", "devices": DEVICES, "bench": "trace_store_bench"},
                     queue_size=queue_size) as w:
        for i in range(steps):
            while w.pending > queue_size // 2:
                backoffs += 1
                time.sleep(0.002)
            w.write_step(stamp(records[i % pool], i, t0))
            if i % 100 == 0:
                w.write_action({"time": t0 + i / STEPS_PER_S + 0.01, "step": i, "kind": "mark",
                                "args": {"label": f"m{i}"}, "result": {}})
            if i and i % 5000 == 0:
                log(f"  {i} steps handed over, {w.pending} waiting for room in the pipe")
    write_s = time.perf_counter() - t_write
    dropped, written = w.dropped, w.written

    file_bytes = os.path.getsize(path)
    with TraceReader(path) as r:
        assert r.num_steps == steps - dropped, (r.num_steps, steps, dropped)
        rng = np.random.default_rng(seed + 1)
        seek_step_s, seek_time_s = [], []
        for n in rng.integers(0, steps, 200):
            t = time.perf_counter()
            rec = r.seek_step(int(n))
            seek_step_s.append(time.perf_counter() - t)
            assert rec["step"] >= n
        for x in rng.uniform(0, steps / STEPS_PER_S, 200):
            t = time.perf_counter()
            r.seek_time(float(x), relative=True)
            seek_time_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        r.step_times()
        step_times_s = time.perf_counter() - t
        t = time.perf_counter()
        scanned = sum(1 for _ in r.steps(0, min(steps, 1000)))
        scan_s = (time.perf_counter() - t) / max(scanned, 1)
        payload_bytes = r._one("SELECT sum(length(payload)) FROM steps")

    bytes_per_step = file_bytes / steps
    hour_bytes = bytes_per_step * HOUR_STEPS
    throughput = steps / write_s
    return {
        "steps": steps, "file_bytes": file_bytes,
        "bytes_per_step": round(bytes_per_step), "payload_bytes_per_step": round(payload_bytes / steps),
        "routing_bytes_per_step": round(float(routing_bytes)),
        "hour_bytes_projected": round(hour_bytes), "hour_vs_1GB": round(hour_bytes / TARGET_BYTES_PER_HOUR, 3),
        "write_steps_per_s": round(throughput, 1), "write_vs_10_per_s": round(throughput / STEPS_PER_S, 1),
        "encode_ms": round(encode_s * 1e3, 3), "decode_ms": round(decode_s * 1e3, 3),
        "dropped": dropped, "written_rows": written, "producer_backoffs": backoffs,
        "seek_step_ms": {"median": round(float(np.median(seek_step_s)) * 1e3, 3), "max": round(max(seek_step_s) * 1e3, 3)},
        "seek_time_ms": {"median": round(float(np.median(seek_time_s)) * 1e3, 3), "max": round(max(seek_time_s) * 1e3, 3)},
        "seek_max_vs_50ms": round(max(seek_step_s + seek_time_s) / TARGET_SEEK_S, 3),
        "step_times_ms": round(step_times_s * 1e3, 2), "scan_ms_per_step": round(scan_s * 1e3, 3),
        "load_avg": os.getloadavg(),
    }


def report(res: dict) -> None:
    mb = 1e6
    print(f"steps written        {res['steps']}  ({res['steps'] / STEPS_PER_S:.0f} s of engine time at 10 steps/s)")
    print(f"file size            {res['file_bytes'] / mb:.1f} MB")
    print(f"bytes per step       {res['bytes_per_step']:,}  (payload {res['payload_bytes_per_step']:,}, "
          f"of which routing {res['routing_bytes_per_step']:,})")
    print(f"one hour projected   {res['hour_bytes_projected'] / mb:,.0f} MB  = {res['hour_vs_1GB']:.2f} x the 1 GB target")
    print(f"writer throughput    {res['write_steps_per_s']:,.0f} steps/s  "
          f"= {res['write_vs_10_per_s']:.0f} x the 10 steps/s needed"
          f"  (encode {res['encode_ms']:.2f} ms, decode {res['decode_ms']:.2f} ms per record)")
    print(f"dropped              {res['dropped']}  (producer backed off {res['producer_backoffs']} times)")
    for name in ("seek_step_ms", "seek_time_ms"):
        s = res[name]
        print(f"{name[:-3]:<20} median {s['median']:.2f} ms, max {s['max']:.2f} ms  (200 random, decode included)")
    print(f"seek max vs target   {res['seek_max_vs_50ms']:.3f} x 50 ms")
    print(f"step_times()         {res['step_times_ms']:.1f} ms for all steps; range scan {res['scan_ms_per_step']:.2f} ms/step")
    print(f"load average         {' '.join(f'{x:.2f}' for x in res['load_avg'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--hour", action="store_true", help=f"write {HOUR_STEPS} steps (one hour at 10 steps/s)")
    ap.add_argument("--pool", type=int, default=200, help="distinct synthetic records, reused round robin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="trace file to write (default: a temporary file, deleted after)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    steps = HOUR_STEPS if args.hour else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.out) if args.out else Path(tmp) / "bench.trace"
        res = run(steps, path, args.pool, args.seed)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
