"""`moectl sim calibrate`: this machine as a hardware profile, measured with the engine's own
kernels, in the form of engine/sim/profiles/*.json (every figure with how it was measured).

A "device" is one of `ranks` ranks of the distributed backend on this machine: each runs on its
share of the cores (the backend gives a rank cores // ranks threads, at least one), so kernels
are timed at that thread count, and where the ranks outnumber the cores the peak is scaled by the
share of a core each gets; the memory's bandwidth and size are the machine's over the ranks.
What it measures, at the engine's dtype on this machine (fp32 on a CPU):

* peak: torch.mm FLOP/s, the best of a few sizes (tools/machine_limits.py);
* "HBM": the memory's read bandwidth (machine_limits, all cores) and its size (psutil);
* the grouped expert GEMM by rows per expert: the engine's grouped_swiglu (models/moe.py, the
  kernel every MoE layer runs) on 8 experts of the model's shape, rows 1 to 512 per expert; the
  efficiency is its FLOP/s over the peak; memory-bound: its weight bytes per second at one row
  over a rank's share of the read bandwidth (timed alone a kernel may stream faster: clipped at 1);
* decode attention: the engine's paged decode kernel (core/paged_decode.cpp) on 8 sequences at
  contexts of 256 to 4,096 keys with the model's heads and widths; bytes read and FLOP/s over
  a rank's share of the bandwidth and the peak;
* the link: torch.distributed's gloo all_reduce between `ranks` processes on this machine, the
  transport the distributed backend runs on: bus bandwidth at 4 MiB, latency at 4 bytes per hop;
* the engine's overheads: the distributed backend itself (`ranks` ranks, the model) decoding 1
  and then 16 sequences: each median step's measured time less what the profile's figures above
  price its work at; the batch-1 excess over the model's layers is the per-layer overhead
  (launches, Python, small ops, the ranks' per-step bookkeeping: what no roofline sees), what
  16 sequences add beyond it the per-sequence overhead (scheduler, sampler, block tables); the
  16-sequence decode as two micro-batches (two-batch overlap forced) in 3 pairs alternating with one
  batch: the median of what the split adds beyond the one-batch step's excess, per layer, is the
  micro-batch overhead (the second pass's
  launches and Python), which the step model adds to an overlapped step.
  Both runs decode short prompts at fixed batches, none of the validation cases' workloads.

Each figure is the median of its repeats; the run takes about half a minute.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace

import psutil
import torch

from moectl.engine.tools import machine_limits

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTEXTS = (256, 1024, 4096)
EXPERTS = 8


def _median_time(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def grouped_gemm_curve(hidden: int, intermediate: int, dtype: torch.dtype, peak: float, read_bw: float) -> tuple:
    """[(rows per expert, FLOP/s over the peak)], and the weight-streaming fraction at one row."""
    from moectl.engine.models.moe import grouped_offsets, grouped_swiglu

    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * intermediate, hidden, generator=gen).to(dtype)
    w2 = torch.randn(EXPERTS, hidden, intermediate, generator=gen).to(dtype)
    points, bound = [], None
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows * EXPERTS, hidden, generator=gen).to(dtype)
            counts = [rows] * EXPERTS
            offsets = grouped_offsets(torch.tensor(counts), rows * EXPERTS, w13, w2)
            seconds = _median_time(lambda: grouped_swiglu(x, counts, w13, w2, offsets))
            flops = 2 * 3 * hidden * intermediate * rows * EXPERTS
            points.append([rows, round(min(1.0, flops / seconds / peak), 4)])
            if rows == 1:
                bound = min(1.0, (w13.numel() + w2.numel()) * w13.element_size() / seconds / read_bw)
    return points, round(bound, 4)


def decode_attention(heads: int, kv_heads: int, key_width: int, value_width: int, dtype: torch.dtype, peak: float,
                     read_bw: float) -> tuple[float, float]:
    """(bandwidth fraction, compute fraction): the best of the contexts, each figure on its own."""
    from moectl.engine.core import paged_decode

    if paged_decode.kernel() is None:
        raise RuntimeError(f"the paged decode kernel is not available here ({paged_decode.failure()})")
    block, seqs = 16, 8
    bandwidth, compute = [], []
    gen = torch.Generator().manual_seed(1)
    for context in CONTEXTS:
        blocks = -(-context // block)
        kc = torch.randn(seqs * blocks, block, kv_heads, key_width, generator=gen).to(dtype)
        vc = torch.randn(seqs * blocks, block, kv_heads, value_width, generator=gen).to(dtype)
        q = torch.randn(seqs, heads, key_width, generator=gen).to(dtype)
        tables = torch.arange(seqs * blocks, dtype=torch.int64).view(seqs, blocks)
        lens = torch.full((seqs,), context, dtype=torch.int64)
        lo = torch.zeros(seqs, dtype=torch.int64)
        seconds = _median_time(lambda: paged_decode.decode(q, kc, vc, tables, lens, lo, 0.1))
        nbytes = seqs * context * kv_heads * (key_width + value_width) * kc.element_size()
        flops = 2 * seqs * heads * context * (key_width + value_width)
        bandwidth.append(nbytes / seconds / read_bw)
        compute.append(flops / seconds / peak)
    return round(min(1.0, max(bandwidth)), 4), round(min(1.0, max(compute)), 4)


def _allreduce_worker(rank: int, ranks: int, store_path: str, sizes: list[int], out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=ranks)
    try:
        for size in sizes:
            t = torch.zeros(max(1, size // 4))
            out[(rank, size)] = _median_time(lambda: dist.all_reduce(t), repeats=9)
    finally:
        dist.destroy_process_group()


def link(ranks: int) -> tuple[float, float]:
    """(bus GB/s at 4 MiB, latency per hop in us at 4 bytes) of gloo all_reduce over `ranks` processes."""
    import torch.multiprocessing as mp

    sizes = [4, 4 << 20]
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_allreduce_worker, args=(ranks, os.path.join(tmp, "store"), sizes, out), nprocs=ranks,
                           join=True, start_method="spawn")
        small = max(out[(r, 4)] for r in range(ranks))
        big = max(out[(r, 4 << 20)] for r in range(ranks))
    hops = 2 * (ranks - 1)
    bus_gbps = 2 * (ranks - 1) / ranks * (4 << 20) / big / 1e9
    return round(bus_gbps, 3), round(small / hops * 1e6, 2)


BATCH = 16  # sequences of the second overhead run
PROMPTS, PROMPT_LEN = 4, 128  # the prefill run's prompts
PAIRS = 3  # one-batch / two-micro-batch decode runs, alternating, for the micro-batch overhead
OVERHEAD_FLOOR_US = 1e-3  # what a profile holds for an overhead the ranks did not show (a positive figure)


def engine_overheads(model_dir, dtype: str, ranks: int, profile_for, steps: int = 32, attach=None) -> dict:
    """The engine's costs beyond its kernels, from the distributed backend's `ranks` ranks: the
    median decode step of 1 and of BATCH sequences, and the prefill step of PROMPTS fresh prompts
    of PROMPT_LEN tokens (median of 5), each measured on the ranks less the step model's price of
    it on `profile_for()` (moectl's ranks' layout: every rank holds every token). The batch-1
    excess over the layers is the per-layer overhead; what BATCH sequences add beyond it, per
    sequence, the per-sequence one (the scheduler, sampler and bookkeeping per sequence and step);
    what the prefill step adds beyond both, per prompt token, the per-prompt-token one (the CPU
    prefill path's attention, masks and copies beyond what the kernels above price). attach(engine):
    what runs beside the engine as `moectl record` runs it (its trace writer), returning its close."""
    from moectl.engine.llm_engine import EngineConfig, SamplingParams
    from moectl.engine.parallel.backends import Engines
    from moectl.engine.sim.model_shape import load_sim_model
    from moectl.engine.sim.routing import balanced
    from moectl.engine.sim.step_model import SimSpec, simulate
    from moectl.engine.sim.trace_load import ranks_load
    from moectl.placement.topology import Topology

    sim_model = load_sim_model(model_dir, "fp32" if dtype == "float32" else "bf16")
    shape = sim_model.shape
    spec = SimSpec(sim_model, profile_for(), ranks, balanced(shape.num_sparse, shape.num_experts),
                   tokens_per_device=1, context=1, tp=ranks, exchange="all-reduce")
    gen = torch.Generator().manual_seed(0)
    engines = Engines(EngineConfig(model=str(model_dir), dtype=dtype, topology=Topology(num_devices=ranks)),
                      "distributed")
    try:
        engine = engines.make_engine()
        detach = attach(engine) if attach is not None else None
        vocab = engine.model_config.vocab_size
        runs = {}
        for batch in (1, BATCH):
            engine.step_log.clear()
            prompts = torch.randint(1, vocab, (batch, 4), generator=gen).tolist()
            engine.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
            decode = [s.devices["step_time"]["step_s"] for s in engine.step_log
                      if s.decode_tokens == batch and not s.prefill_tokens and s.devices]
            measured = statistics.median(decode[len(decode) // 4:])  # the first steps warm the ranks up
            load = ranks_load(shape, 0, batch, batch, batch * (4 + steps / 2), 4)
            runs[batch] = (measured, simulate(spec, load)["step_ms"] / 1e3)
        # the same BATCH decode as two micro-batches (two-batch overlap forced on every step), in
        # PAIRS alternating with one batch: the split's cost is the median of the pairs' differences
        load = ranks_load(shape, 0, BATCH, BATCH, BATCH * (4 + steps / 2), 4)
        priced = {mode: simulate(replace(spec, overlap=mode), load)["step_ms"] / 1e3 for mode in ("none", "two-batch")}
        publisher, pairs = engine.runner.model, []
        for _ in range(PAIRS):
            pair = {}
            for mode in ("none", "two-batch"):
                publisher.overlap, publisher.overlap_min_tokens = mode, 2
                engine.step_log.clear()
                prompts = torch.randint(1, vocab, (BATCH, 4), generator=gen).tolist()
                engine.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
                decode = [s.devices["step_time"]["step_s"] for s in engine.step_log
                          if s.decode_tokens == BATCH and not s.prefill_tokens and s.devices]
                pair[mode] = statistics.median(decode[len(decode) // 4:]) - priced[mode]
            pairs.append(pair["two-batch"] - pair["none"])
        publisher.overlap = "none"
        prefill = []
        for _ in range(5):
            engine.step_log.clear()
            prompts = torch.randint(1, vocab, (PROMPTS, PROMPT_LEN), generator=gen).tolist()  # fresh: no prefix hits
            engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            prefill += [s.devices["step_time"]["step_s"] for s in engine.step_log
                        if s.prefill_tokens == PROMPTS * PROMPT_LEN and s.devices]
        load = ranks_load(shape, PROMPTS * PROMPT_LEN, 0, PROMPTS, 0, PROMPT_LEN)
        runs["prefill"] = (statistics.median(prefill), simulate(spec, load)["step_ms"] / 1e3)
        if detach is not None:
            detach()
    finally:
        engines.close()
    excess = {k: m - p for k, (m, p) in runs.items()}
    # as measured, below zero too (the step model already prices more than the ranks spent): the
    # profile floors them and says so
    sequence_s = (excess[BATCH] - excess[1]) / (BATCH - 1)
    layer_s = (excess[1] - max(sequence_s, 0.0)) / shape.num_layers  # the one sequence's share is not the layers'
    prompt_s = (excess["prefill"] - excess[1] - (PROMPTS - 1) * max(sequence_s, 0.0)) / (PROMPTS * PROMPT_LEN)
    # what the split adds beyond the one-batch step's own excess (the step model prices the halves'
    # kernels and the collectives they hide)
    split_s = statistics.median(pairs) / shape.num_layers
    return {"layer_us": layer_s * 1e6, "sequence_us": sequence_s * 1e6, "prompt_token_us": prompt_s * 1e6,
            "micro_batch_us": split_s * 1e6, "micro_batch_pairs_us": [p * 1e6 for p in pairs], "runs": runs}


def calibrate(model_dir, dtype: str = "float32", ranks: int = 2, log=print, attach=None) -> dict:
    """The profile (a dict in profiles/*.json's form); attach: see engine_overheads."""
    from moectl.engine.sim.hardware import _parse
    from moectl.engine.sim.model_shape import load_sim_model

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    key = "fp32" if dtype == "float32" else "bf16"
    when = datetime.date.today().isoformat()
    cores = os.cpu_count() or 1
    threads = max(1, cores // ranks)  # what the distributed backend gives each rank
    share = min(1.0, cores / (ranks * threads))  # of its threads' cores a rank gets when they are oversubscribed
    machine = _machine()
    how = f"measured by `moectl sim calibrate --ranks {ranks}` on {when} ({machine})"
    per_rank = f"per rank: {threads} thread(s) each, {share:.2f} of them while all {ranks} ranks run"
    read_bw = machine_limits.memory_bandwidth()["read_bw"]  # the machine's, all cores
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peak = machine_limits.matmul_throughput(torch_dtype)["matmul_flops"]
        bf16 = peak if key == "bf16" else machine_limits.matmul_throughput("bfloat16")["matmul_flops"]
        log(f"peak {peak / 1e9:.1f} GFLOP/s ({key}) at {threads} thread(s), read bandwidth {read_bw / 1e9:.1f} GB/s")
        shape = load_sim_model(model_dir).shape
        intermediate = shape.expert_intermediate_size
        # bandwidth fractions against a rank's share of the memory's bandwidth (what hbm_gbps holds):
        # timed alone, a kernel may stream faster than its share (clipped at 1)
        points, bound = grouped_gemm_curve(shape.hidden_size, intermediate, torch_dtype, peak, read_bw / ranks)
        log(f"grouped expert GEMM ({shape.hidden_size} x {intermediate}): " +
            ", ".join(f"{r} rows {e:.0%}" for r, e in points) + f"; streaming at 1 row {bound:.0%} of the bandwidth")
        if shape.attention == "mla":
            heads, kv_heads, key_width, value_width = shape.num_heads, 1, shape.kv_latent_dim, shape.kv_lora_rank
        else:
            heads, kv_heads, key_width, value_width = (shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                                       shape.head_dim)
        attention = decode_attention(heads, kv_heads, key_width, value_width, torch_dtype, peak, read_bw / ranks)
        log(f"decode attention: {attention[0]:.0%} of the bandwidth, {attention[1]:.0%} of the peak")
    finally:
        torch.set_num_threads(before)
    bus, latency = link(ranks)
    log(f"gloo all_reduce over {ranks} processes: {bus:.2f} GB/s bus bandwidth, {latency:.1f} us per hop")
    raw = {
        "name": f"this machine ({machine})",
        "notes": f"Calibrated for moectl's distributed backend on this machine: {ranks} ranks share its cores and "
                 f"memory (each rank a 'device', the machine one 'node'). {how}.",
        "peak_tflops": {key: {"value": peak * share / 1e12,
                              "source": f"torch.mm {key}, best of sizes 256-2048, {per_rank}; {how}"},
                        "bf16": {"value": bf16 * share / 1e12,
                                 "source": f"torch.mm bfloat16, best of sizes 256-2048, {per_rank}; {how}"}},
        "hbm_bytes": {"value": int(psutil.virtual_memory().total) // ranks,
                      "source": f"psutil: the machine's memory over the {ranks} ranks; {how}"},
        "hbm_gbps": {"value": read_bw / ranks / 1e9,
                     "source": f"read bandwidth (an fp32 sum of 256 MiB, all cores) over the {ranks} ranks; {how}"},
        "gpus_per_node": {"value": ranks, "source": f"the distributed backend's ranks on this one machine; {how}"},
        "intra_node_gbps": {"value": bus, "source": f"gloo all_reduce bus bandwidth over {ranks} processes at 4 MiB "
                                                    f"(2 (n - 1) / n x bytes / time); {how}"},
        "inter_node_gbps": None,
        "efficiency": {
            "grouped_gemm": {"by": "rows per expert", "points": points,
                             "source": f"the engine's grouped_swiglu on {EXPERTS} experts of {shape.name}'s shape "
                                       f"({shape.hidden_size} x {intermediate}), FLOP/s over the peak; {how}"},
            "memory_bound_gemm": {"value": max(bound, 1e-4),
                                  "source": f"the same at 1 row per expert: weight bytes per second over a rank's "
                                            f"share of the read bandwidth; {how}"},
            "attention_decode": {"bandwidth": max(attention[0], 1e-4), "compute": max(attention[1], 1e-4),
                                 "source": f"the engine's paged decode kernel, 8 sequences at {CONTEXTS} keys, "
                                           f"{heads} heads, widths {key_width}/{value_width}; the best context of "
                                           f"each, over a rank's share of the read bandwidth and the peak; {how}"},
            "all_to_all": {"intra_node": 1.0, "inter_node": 1.0, "latency_us": latency,
                           "source": f"gloo all_reduce: the bandwidth above is already achieved (1.0); latency per "
                                     f"hop at 4 bytes; {how}"},
        },
    }

    def profile_for():
        return _parse("calibrated", raw)

    costs = engine_overheads(model_dir, dtype, ranks, profile_for, attach=attach)
    runs = costs["runs"]
    described = "; ".join(f"{name} {m * 1e3:.2f} ms measured, {p * 1e3:.2f} ms priced" for name, (m, p) in (
        ("1 sequence", runs[1]), (f"{BATCH} sequences", runs[BATCH]),
        (f"{PROMPTS} prompts of {PROMPT_LEN}", runs["prefill"])))
    log(f"the distributed backend on {ranks} ranks: {described}: {costs['layer_us']:.0f} us per layer, "
        f"{costs['sequence_us']:.0f} us per sequence, {costs['prompt_token_us']:.1f} us per prompt token, "
        f"{costs['micro_batch_us']:.0f} us per layer for a second micro-batch (pairs: "
        f"{', '.join(f'{p / shape.num_layers:.0f}' for p in costs['micro_batch_pairs_us'])}), beyond the kernels")
    recorded = ", its steps recorded as `moectl record` does" if attach else ""
    run = (f"the distributed backend ({ranks} ranks, {shape.name}{recorded}) "
           f"decoding 1 and {BATCH} sequences and prefilling {PROMPTS} prompts of {PROMPT_LEN} tokens: {described} by "
           f"the step model on the figures above")
    for field, figure, what in (
            ("layer_overhead_us", costs["layer_us"], f"the batch-1 excess over {shape.num_layers} layers"),
            ("sequence_overhead_us", costs["sequence_us"], f"what {BATCH} sequences add beyond it, per sequence"),
            ("prompt_token_overhead_us", costs["prompt_token_us"],
             "what the prefill adds beyond both, per prompt token"),
            ("micro_batch_overhead_us", costs["micro_batch_us"],
             f"what decoding the {BATCH} sequences as two micro-batches (--overlap two-batch) adds beyond the "
             f"one-batch step's excess, per layer (median of {PAIRS} alternating pairs)")):
        raw[field] = {"value": max(figure, OVERHEAD_FLOOR_US), "source": f"{run}; {what}; {how}"}
        if figure < OVERHEAD_FLOOR_US:
            raw[field]["source"] += (f"; measured {figure:.1f} us: the step model already prices at least what the "
                                     f"ranks spent, so floored at {OVERHEAD_FLOOR_US} us")
            log(f"{field}: measured {figure:.1f} us, floored at {OVERHEAD_FLOOR_US} us")
    _parse("calibrated", raw)  # what it writes, it can read
    return raw


