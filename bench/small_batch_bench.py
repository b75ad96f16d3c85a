"""The small-batch kernels (engine/kernels/small_batch.cpp) against the torch path, in one run.

    python bench/small_batch_bench.py [--rounds 5] [--tokens 128] [--json]
    python bench/small_batch_bench.py --profile     # where a batch-1 step's time goes, with the kernels

1. Linears: every linear of the sample model's decode step (its own weights, in step order, so
   each comes from wherever the previous ones left the caches, as in a step) at 1, 2 and 4
   rows: the kernel's and F.linear's time per pass, alternating, best of 5 blocks each, and the
   weight bytes read per second. Against this machine's DRAM read bandwidth (machine_limits, all
   threads, in the same run) as a scale only: the sample's weights fit this CPU's L3.
2. Experts over rows grouped by expert: the op (groups of up to 16 rows in the kernel, larger
   ones through torch's ops) against torch._grouped_mm (what the torch path runs from 4 rows) at
   8-1024 rows over the sample's 16 experts, random routing, alternating, best of 3 blocks each.
3. The engine at batch 1, both sample models, fp32: TPOT of one request (a 55-token prompt,
   --tokens outputs) with the kernels and with the torch path, in alternating rounds, the same
   engine switched between them (small_batch.set_enabled); the median ratio with its range, and
   whether the two sides' greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moectl.engine import sample_model_dir  # noqa: E402
from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.sampling import SamplingParams  # noqa: E402
from moectl.engine.kernels import small_batch  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.engine.models.moe import MoEBlock  # noqa: E402
from moectl.engine.tools.machine_limits import memory_bandwidth  # noqa: E402

THREADS = 2


def step_weights(model) -> list[torch.Tensor]:
    """The weights a batch-1 decode step reads, in order: attention, router, two experts, LM head."""
    weights = []
    for layer in model.layers:
        weights += [p for n, p in layer.attn.named_parameters() if n.endswith("weight") and p.dim() == 2
                    and "kv_b_proj" not in n]
        if isinstance(layer.mlp, MoEBlock):
            weights.append(layer.mlp.gate)
            for e in (0, 1):
                weights += [layer.mlp.experts.w13[e], layer.mlp.experts.w2[e]]
        else:
            weights += [layer.mlp.w13, layer.mlp.w2]
    return weights + [model.lm_head.weight]


def layers(model, rows: int, reps: int = 50) -> dict:
    weights = [w.detach().contiguous() for w in step_weights(model)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    op = small_batch.kernels().linear

    def one_pass(fn) -> float:
        t = time.perf_counter()
        for _ in range(reps):
            for w in weights:
                fn(inputs[w.shape[1]], w)
        return (time.perf_counter() - t) / reps

    with torch.inference_mode():
        kernel, blas = [], []
        for _ in range(5):
            kernel.append(one_pass(lambda x, w: op(x, w, None)))
            blas.append(one_pass(F.linear))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {"rows": rows, "linears": len(weights), "weight_bytes": nbytes, "kernel_us": min(kernel) * 1e6,
            "f_linear_us": min(blas) * 1e6, "speedup": min(blas) / min(kernel),
            "kernel_read_bw": nbytes / min(kernel), "f_linear_read_bw": nbytes / min(blas)}


def grouped(rows: int, reps: int = 20) -> dict:
    from moectl.engine.models.moe import grouped_offsets, grouped_swiglu

    gen = torch.Generator().manual_seed(rows)
    num, hidden, inter = 16, 256, 96
    w13, w2 = torch.randn(num, 2 * inter, hidden, generator=gen) / 16, torch.randn(num, hidden, inter, generator=gen) / 10
    counts_t = torch.bincount(torch.randint(0, num, (rows,), generator=gen), minlength=num)
    counts, x = counts_t.tolist(), torch.randn(rows, hidden, generator=gen)

    def timed(kernel: bool) -> float:
        small_batch.set_enabled(kernel)
        offsets = grouped_offsets(counts_t, rows, w13, w2)
        grouped_swiglu(x, counts, w13, w2, offsets)
        t = time.perf_counter()
        for _ in range(reps):
            grouped_swiglu(x, counts, w13, w2, offsets)
        return (time.perf_counter() - t) / reps

    with torch.inference_mode():
        try:
            kernel, gemm = [], []
            for _ in range(3):
                kernel.append(timed(True))
                gemm.append(timed(False))
        finally:
            small_batch.set_enabled(True)
    return {"rows": rows, "kernel_us": min(kernel) * 1e6, "grouped_mm_us": min(gemm) * 1e6,
            "speedup": min(gemm) / min(kernel)}


def engine_ab(name: str, rounds: int, tokens: int) -> dict:
    engine = LLMEngine(EngineConfig(model=str(sample_model_dir(name)), dtype="float32", block_size=16,
                                    num_kv_blocks=256, seed=0, num_threads=THREADS))
    prompt = list(range(5, 60))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    runs = {"kernel": [], "torch": []}
    outputs = {}
    try:
        for r in range(rounds + 1):  # round 0 warms both sides up and is not counted
            for side in (("kernel", "torch") if r % 2 == 0 else ("torch", "kernel")):
                small_batch.set_enabled(side == "kernel")
                engine.add_request(prompt, params)
                times, last = [], None
                while engine.has_unfinished():
                    last = engine.step() or last
                    times.append(time.perf_counter())
                outputs[side] = last[0].token_ids
                if r:
                    runs[side].append((times[-1] - times[0]) / (len(times) - 1))
    finally:
        small_batch.set_enabled(True)
    ratios = [b / a for a, b in zip(runs["kernel"], runs["torch"])]
    return {"model": name, "tokens": tokens, "rounds": rounds,
            "kernel_tpot_ms": statistics.median(runs["kernel"]) * 1e3,
            "torch_tpot_ms": statistics.median(runs["torch"]) * 1e3,
            "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "greedy_identical": outputs["kernel"] == outputs["torch"]}


def step_profile(name: str, tokens: int, top: int = 8) -> dict:
    """Where a batch-1 step's time goes, with the kernels: ms per token (the best of 3 runs), then
    a cProfile of one more run, its native calls by self time per step (what is left to fuse)."""
    import cProfile
    import pstats

    engine = LLMEngine(EngineConfig(model=str(sample_model_dir(name)), dtype="float32", block_size=16,
                                    num_kv_blocks=256, seed=0, num_threads=THREADS))
    prompt, params = list(range(5, 60)), SamplingParams(max_tokens=tokens + 1, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        engine.generate([prompt], params)
        best = min(best, (time.perf_counter() - t) / (tokens + 1))
    profile = cProfile.Profile()
    profile.runcall(engine.generate, [prompt], params)
    stats = pstats.Stats(profile).stats
    native = sorted(((row[2], key[2]) for key, row in stats.items() if key[0] == "~"), reverse=True)[:top]
    total = sum(row[2] for row in stats.values())
    return {"model": name, "ms_per_token": best * 1e3, "profiled_ms_per_step": total / (tokens + 1) * 1e3,
            "native_ms_per_step": {call: seconds / (tokens + 1) * 1e3 for seconds, call in native}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating engine rounds per side (1-20)")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens of the batch-1 request (2-1024)")
    ap.add_argument("--profile", action="store_true",
                    help="instead: where a batch-1 step's time goes with the kernels, both sample models")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not 1 <= args.rounds <= 20:
        sys.exit("small_batch_bench: --rounds must be in 1-20")
    if not 2 <= args.tokens <= 1024:
        sys.exit("small_batch_bench: --tokens must be in 2-1024 (TPOT needs two tokens)")
    torch.set_num_threads(THREADS)
    if small_batch.kernels() is None:
        sys.exit(f"small_batch_bench: the kernels are not available here ({small_batch.failure()})")
    if args.profile:
        profiles = [step_profile(name, args.tokens) for name in ("sample", "sample-dsv3")]
        if args.json:
            print(json.dumps(profiles))
        for p in [] if args.json else profiles:
            print(f"{p['model']}: {p['ms_per_token']:.2f} ms a token (best of 3); profiled "
                  f"{p['profiled_ms_per_step']:.2f} ms a step, its native calls by self time (ms a step):")
            for call, ms in p["native_ms_per_step"].items():
                print(f"  {call[:64]:64s} {ms:.3f}")
        return
    engines = [engine_ab(name, args.rounds, args.tokens) for name in ("sample", "sample-dsv3")]
    model = LLMEngine(EngineConfig(model=str(sample_model_dir()), dtype="float32", num_kv_blocks=16)).model
    result = {"threads": THREADS, "read_bw": memory_bandwidth()["read_bw"],
              "layers": [layers(model, rows) for rows in (1, 2, 4)],
              "grouped": [grouped(rows) for rows in (8, 32, 128, 256, 512, 1024)], "engine": engines}
    if args.json:
        print(json.dumps(result))
        return
    bw = result["read_bw"]
    print(f"DRAM read bandwidth ({THREADS} threads): {bw / 1e9:.1f} GB/s (a scale: the sample's weights fit in L3)")
    for s in result["layers"]:
        print(f"  sample model's {s['linears']} step linears, {s['rows']} row(s), {s['weight_bytes'] / 2**20:.1f} MiB: "
              f"kernel {s['kernel_us']:.0f} us ({s['kernel_read_bw'] / 1e9:.1f} GB/s, {s['kernel_read_bw'] / bw:.1f}x DRAM), "
              f"F.linear {s['f_linear_us']:.0f} us ({s['f_linear_read_bw'] / 1e9:.1f} GB/s): {s['speedup']:.2f}x")
    for g in result["grouped"]:
        print(f"  experts grouped by expert, {g['rows']:>4} rows over 16: op {g['kernel_us']:.0f} us, "
              f"torch._grouped_mm {g['grouped_mm_us']:.0f} us: {g['speedup']:.2f}x")
    for e in engines:
        print(f"  {e['model']}, batch 1, {e['tokens']} tokens: TPOT kernels {e['kernel_tpot_ms']:.2f} ms, torch path "
              f"{e['torch_tpot_ms']:.2f} ms: {e['ratio_median']:.2f}x ({e['ratio_range'][0]:.2f}-"
              f"{e['ratio_range'][1]:.2f}x, {e['rounds']} rounds); greedy tokens identical: {e['greedy_identical']}")


if __name__ == "__main__":
    main()
