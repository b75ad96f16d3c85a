"""Benchmarks: this engine against Hugging Face transformers on one workload, and engine-only
serving runs of a workload.

    moectl bench --compare hf [--model DIR] [--json]
    moectl bench --suite serve --workload rate=4,requests=64

`run_compare_hf` runs one workload (by default 64 requests, prompts of 32-512 tokens, outputs
of 16-256 tokens, all arriving at once) through the engine and through transformers'
`generate` on the same checkpoint in the same process, then one request alone through both for
the batch-1 time per output token. It reports throughput, TTFT and TPOT for both, the ratios
against the targets (engine throughput >= 5x transformers', batch-1 TPOT at most half), the
machine's measured limits and the share of them each side reached, and whether the greedy
outputs are identical. Timings on a machine shared with other work are noisy: the result
records the load average before and after.
"""

from __future__ import annotations

import copy
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moectl.engine import sample_model_dir
from moectl.engine.core import paged_decode
from moectl.engine.core.config import SchedulerKnobs
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import EngineConfig, LLMEngine
from moectl.engine.models.config import ModelConfig, parse_dtype
from moectl.engine.models.tokenizer import Tokenizer
from moectl.engine.tools import machine_limits
from moectl.engine.tools.roofline import run_flops
from moectl.engine.tools.workload import WorkloadItem, WorkloadSpec, make_workload, run_workload, summarize

TARGET_THROUGHPUT_RATIO = 5.0  # engine output tokens/s over transformers', at least
TARGET_TPOT_BS1_RATIO = 0.5  # engine batch-1 TPOT over transformers', at most
TARGET_ROOFLINE_SHARE = 0.25  # the run's FLOPs (engine/tools/roofline.py) per second over measured matmul FLOP/s
# Workloads are generated up front (the comparison needs every prompt for transformers' batches):
# up to ~20 KB of token ids per request, so a bound keeps a typo from filling the memory.
MAX_BENCH_REQUESTS = 10_000


def check_bench_requests(count: int | float, option: str = "num_requests") -> None:
    """ValueError naming `option` unless 1 <= count <= MAX_BENCH_REQUESTS."""
    if not 1 <= count <= MAX_BENCH_REQUESTS:
        raise ValueError(f"{option}: must be in 1-{MAX_BENCH_REQUESTS} requests, got {count:g}")


def expected_requests(spec: WorkloadSpec) -> float:
    """How many requests a spec generates at most: its count, or its rate over its duration (on
    average), whichever ends it first."""
    limits = [spec.num_requests] if spec.num_requests is not None else []
    if spec.duration_s is not None:
        limits.append(spec.rate * spec.duration_s)
    return min(limits, default=1)  # neither: one per line of a JSONL file, counted when read


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _pcts(values, prefix: str) -> dict:
    s = summarize(values)
    return {f"{prefix}_mean": s["mean"], f"{prefix}_p50": s["p50"], f"{prefix}_p90": s["p90"],
            f"{prefix}_p99": s["p99"]}


# -- transformers, used as a user would

class _TokenClock:
    """A transformers streamer that timestamps every generation step. generate() first puts the
    prompt, then the batch's new tokens once per step, right after they are chosen."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def _hf_generation_config(model, max_new_tokens: int, pad_id: int):
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample = False  # greedy, as the engine's temperature 0
    gc.num_beams = 1
    gc.max_new_tokens = max_new_tokens
    gc.min_new_tokens = None
    # No EOS at all: the equivalent of the engine's ignore_eos. (min_new_tokens would instead
    # forbid the EOS token, changing the greedy choice whenever EOS is the argmax.)
    gc.eos_token_id = None
    gc.pad_token_id = pad_id
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(gc, name):
            setattr(gc, name, None)
    return gc


def _hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int):
    """One left-padded greedy batch. Returns (new tokens [B, max_new_tokens], step timestamps)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    clock = _TokenClock()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=_hf_generation_config(model, max_new_tokens,
                                                                                               pad_id),
                             streamer=clock)
    return out[:, width:], clock.times


def run_hf(model, items: list[WorkloadItem], batch_size: int | None, pad_id: int, log: Callable = print) -> dict:
    """The workload through transformers the way a user would run it: requests in arrival order,
    in batches of `batch_size` (None: all in one batch), each batch left-padded and generated
    greedily with max_new_tokens = the largest request in the batch, then every row truncated to
    its own request's length. generate() cannot give each row its own max_new_tokens, so the
    shorter requests of a batch ride along (their extra tokens are computed and thrown away) and
    are only delivered when the batch returns. Only the requested tokens count as output.

    Per request: TTFT = time from the start (every request arrives at 0 s) to its batch's first
    generated token; TPOT = mean gap between its own first and last requested tokens; E2E = the
    end of its batch's generate() call."""
    bs = batch_size or len(items)
    t0 = time.monotonic()
    records, outputs = [], []
    generated = padded_prompt = 0
    for b in range(0, len(items), bs):
        batch = items[b:b + bs]
        want = [it.params.max_tokens for it in batch]
        new, times = _hf_generate(model, [it.prompt_ids for it in batch], max(want), pad_id)
        t_end = time.monotonic()
        generated += new.numel()
        padded_prompt += len(batch) * max(len(it.prompt_ids) for it in batch)
        for row, (it, n) in enumerate(zip(batch, want)):
            outputs.append(new[row, :n].tolist())
            gaps = [bt - at for at, bt in zip(times[:n], times[1:n])]
            records.append({"ttft": times[0] - t0, "tpot": (sum(gaps) / len(gaps)) if gaps else None,
                            "e2e": t_end - t0, "output_tokens": n, "prompt_tokens": len(it.prompt_ids)})
        log(f"  transformers batch {b // bs + 1}/{math.ceil(len(items) / bs)}: {len(batch)} requests, "
            f"{max(want)} steps, {t_end - t0:.1f}s")
    wall = time.monotonic() - t0
    out_tokens = sum(r["output_tokens"] for r in records)
    return {
        "records": records, "outputs": outputs,
        "summary": {
            "duration_s": wall, "output_tokens": out_tokens,
            "output_throughput": out_tokens / wall,
            "total_throughput": (out_tokens + sum(r["prompt_tokens"] for r in records)) / wall,
            "request_throughput": len(records) / wall,
            **_pcts([r["ttft"] for r in records], "ttft"), **_pcts([r["tpot"] for r in records], "tpot"),
            **_pcts([r["e2e"] for r in records], "e2e"),
            "batch_size": bs, "num_batches": math.ceil(len(items) / bs),
            "generated_tokens": generated,  # including the discarded ones
            "wasted_tokens": generated - out_tokens,
            "padded_prompt_tokens": padded_prompt,
        },
    }


def _hf_tpot_bs1(model, prompt: list[int], n: int, pad_id: int) -> float:
    _, times = _hf_generate(model, [prompt], n, pad_id)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return sum(gaps) / len(gaps)


def _engine_tpot_bs1(engine: LLMEngine, prompt: list[int], n: int) -> float:
    res = run_workload(engine, [WorkloadItem(0.0, prompt, SamplingParams(max_tokens=n, ignore_eos=True))])
    return res.requests[0]["tpot"]


# -- the comparison

def _engine_summary(res) -> dict:
    s = res.summary
    return {
        "duration_s": s["duration_s"], "output_tokens": s["output_tokens"],
        "output_throughput": s["output_throughput"], "total_throughput": s["total_throughput"],
        "request_throughput": s["request_throughput"],
        **{f"ttft_{k}": s["ttft"][k] for k in ("mean", "p50", "p90", "p99")},
        **{f"tpot_{k}": s["tpot"][k] for k in ("mean", "p50", "p90", "p99")},
        **{f"e2e_{k}": s["e2e"][k] for k in ("mean", "p50", "p90", "p99")},
        "steps": s["steps"], "mean_batch_size": s["mean_batch_size"],
        "mean_decode_batch_size": s["mean_decode_batch_size"], "mean_step_ms": s["mean_step_ms"],
        "preemptions": s["preemptions"],
        "cached_prompt_tokens": sum(r.get("cached_prompt_tokens") or 0 for r in res.requests),
    }


def _compare_outputs(engine_out: list[list[int]], hf_out: list[list[int]]) -> dict:
    mismatches = []
    for i, (a, b) in enumerate(zip(engine_out, hf_out)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({"request": i, "first_diff_at": pos, "tokens": len(b)})
    return {"requests": len(hf_out), "identical": len(hf_out) - len(mismatches), "mismatches": mismatches[:16]}


def run_compare_hf(model_dir: str | Path | None = None, *, num_requests: int = 64, prompt_len=(32, 512),
                   output_len=(16, 256), seed: int = 0, dtype: str = "float32", hf_batch_size: int | None = None,
                   bs1_output_len: int = 64, bs1_repeats: int = 3, threads: int | None = None,
                   measure_machine: bool = True, keep_outputs: bool = False, engine_knobs: dict | None = None,
                   engine_threads: int | str | None = None, engine_only: bool = False,
                   log: Callable[[str], None] = print) -> dict:
    """The engine and transformers on one workload, in one process. Returns JSON-serialisable figures.

    Both sides get the same requests (same token ids, same output lengths, greedy, EOS ignored).
    Threads: with `threads` both sides use that many; otherwise the engine runs its default
    policy (num_threads="auto") and transformers torch's default, each as a user gets it.
    Only requested output tokens count toward throughput.
    `throughput_ratio` = engine / transformers output tokens/s (target >= 5);
    `tpot_bs1_ratio` = engine / transformers time per output token of one request alone, after
    its prompt (target <= 0.5), median of bs1_repeats runs each; the engine's share of the
    matmul roofline on the batched run: the run's FLOPs as the engine runs them
    (engine/tools/roofline.py) over its duration, against the measured matmul peak (target >= 25%).
    With keep_outputs the result carries both sides' output token ids ("outputs"). engine_knobs
    overrides the engine's batching knobs (SchedulerKnobs fields); the defaults are what a user gets.
    engine_threads overrides the engine's thread policy; engine_only stops after the engine's run
    (the result then has its "engine" figures only).
    """
    import transformers
    from transformers import AutoModelForCausalLM  # optional dependency: only this benchmark needs it

    if isinstance(bs1_output_len, bool) or not isinstance(bs1_output_len, int) or bs1_output_len < 2:
        raise ValueError(f"bs1_output_len: must be an integer >= 2 (TPOT needs two tokens), got {bs1_output_len!r}")
    if isinstance(bs1_repeats, bool) or not isinstance(bs1_repeats, int) or bs1_repeats < 1:
        raise ValueError(f"bs1_repeats: must be an integer >= 1, got {bs1_repeats!r}")
    if hf_batch_size is not None and (isinstance(hf_batch_size, bool) or not isinstance(hf_batch_size, int)
                                      or hf_batch_size < 1):
        raise ValueError(f"hf_batch_size: must be an integer >= 1 or None (one batch), got {hf_batch_size!r}")
    check_bench_requests(num_requests)
    started = time.monotonic()
    model_dir = Path(model_dir or sample_model_dir())
    prev_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    side_threads = torch.get_num_threads()  # transformers' (and, with --threads N, the engine's too)
    engine_threads = engine_threads or threads or "auto"
    load_before = _load_avg()
    if load_before and os.cpu_count() and load_before[0] >= os.cpu_count():
        log(f"warning: load average {load_before[0]} on {os.cpu_count()} CPUs: other work is running and the "
            f"timings will be noisy (with more than one torch thread, badly so; try threads=1)")
    try:
        limits = machine_limits.measure(dtype) if measure_machine else None
        if limits:
            log(f"machine: {machine_limits.format_limits(limits)}")

        spec = WorkloadSpec(num_requests=num_requests, rate=math.inf, prompt_len=prompt_len,
                            output_len=output_len, seed=seed, source="auto", ignore_eos=True)
        mcfg = ModelConfig.from_dir(model_dir, dtype=dtype)
        items = make_workload(spec, Tokenizer.from_dir(model_dir, mcfg.bos_token_id), mcfg.vocab_size)
        # enough KV blocks for every request at once: transformers holds the whole batch's cache too
        block_size = 16
        need = sum(-(-(len(it.prompt_ids) + it.params.max_tokens) // block_size) for it in items)
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, block_size=block_size,
                                        num_kv_blocks=need + 64, seed=seed, num_threads=engine_threads,
                                        **({"knobs": SchedulerKnobs(**engine_knobs)} if engine_knobs else {})))
        total_prompt = sum(len(it.prompt_ids) for it in items)
        total_out = sum(it.params.max_tokens for it in items)
        log(f"workload: {len(items)} requests at once, prompts {spec.prompt_dist.describe()} "
            f"({total_prompt} tokens), outputs {spec.output_dist.describe()} ({total_out} tokens), "
            f"prompt source {'corpus' if engine.tokenizer is not None else 'random ids'}")

        # -- engine
        engine.generate([items[0].prompt_ids[:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        log("engine: running ...")
        eng_res = run_workload(engine, items, realtime=True, keep_outputs=True)
        if engine.blocks.num_used:
            raise RuntimeError(f"engine: {engine.blocks.num_used} KV blocks still in use after the run")
        eng = _engine_summary(eng_res)
        eng["threads"] = engine.threads.describe() if engine.threads is not None else {
            "policy": "fixed", "threads": torch.get_num_threads()}
        torch.set_num_threads(side_threads)  # transformers as a user runs it, whatever the engine chose
        if engine_only:
            return {"engine": eng, "elapsed_s": time.monotonic() - started}
        log(f"engine: {eng['output_throughput']:.1f} output tok/s, {eng['duration_s']:.1f}s, "
            f"TTFT p50 {_f(eng['ttft_p50'])}s, TPOT p50 {_f(eng['tpot_p50'], 1e3, 1)}ms, "
            f"mean batch {eng['mean_batch_size']:.1f}")

        # -- transformers
        hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=parse_dtype(dtype)).eval()
        pad_id = mcfg.eos_token_ids[0] if mcfg.eos_token_ids else 0  # masked out; the value is irrelevant
        _hf_generate(hf_model, [items[0].prompt_ids[:8]], 4, pad_id)  # warm-up
        log(f"transformers {transformers.__version__}: running ...")
        hf_res = run_hf(hf_model, items, hf_batch_size, pad_id, log)
        hf = hf_res["summary"]
        log(f"transformers: {hf['output_throughput']:.1f} output tok/s, {hf['duration_s']:.1f}s, "
            f"TTFT p50 {_f(hf['ttft_p50'])}s, TPOT p50 {_f(hf['tpot_p50'], 1e3, 1)}ms")

        # -- batch 1: the workload's first prompt alone, bs1_output_len tokens, alternating sides
        prompt1 = items[0].prompt_ids
        eng_t, hf_t = [], []
        for _ in range(bs1_repeats):
            eng_t.append(_engine_tpot_bs1(engine, prompt1, bs1_output_len))
            torch.set_num_threads(side_threads)
            hf_t.append(_hf_tpot_bs1(hf_model, prompt1, bs1_output_len, pad_id))
        bs1 = {"prompt_tokens": len(prompt1), "output_tokens": bs1_output_len, "repeats": bs1_repeats,
               "engine_tpot": statistics.median(eng_t), "hf_tpot": statistics.median(hf_t),
               "engine_tpot_all": eng_t, "hf_tpot_all": hf_t}
        log(f"batch 1: TPOT engine {bs1['engine_tpot'] * 1e3:.2f}ms, transformers {bs1['hf_tpot'] * 1e3:.2f}ms")

        match = _compare_outputs([r["output_ids"] for r in eng_res.requests], hf_res["outputs"])
        load_after = _load_avg()

        # -- ratios and shares of the machine's limits
        counts = mcfg.param_counts()
        elem = torch.empty((), dtype=parse_dtype(dtype)).element_size()
        bytes_per_token = counts["params_active"] * elem
        # the FLOPs the run needs, as the engine runs them (engine/tools/roofline.py); transformers
        # does the same useful work and more (the LM head on every prompt row, padding)
        flops = run_flops(mcfg, [len(it.prompt_ids) for it in items],
                          [len(r["output_ids"]) for r in eng_res.requests],
                          [r.get("cached_prompt_tokens") or 0 for r in eng_res.requests])
        result = {
            "model": str(model_dir), "architecture": mcfg.architecture, "dtype": str(parse_dtype(dtype))[6:],
            "params_total": counts["params_total"], "params_active": counts["params_active"],
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "decode_attention": paged_decode.describe(),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "load_avg_before": load_before, "load_avg_after": load_after, "cpu_count": os.cpu_count(),
            "workload": {**spec.describe(), "prompt_tokens": total_prompt, "output_tokens": total_out},
            "engine": eng, "hf": hf, "bs1": bs1,
            "throughput_ratio": eng["output_throughput"] / hf["output_throughput"],
            "tpot_bs1_ratio": bs1["engine_tpot"] / bs1["hf_tpot"],
            "targets": {"throughput_ratio_min": TARGET_THROUGHPUT_RATIO, "tpot_bs1_ratio_max": TARGET_TPOT_BS1_RATIO},
            "machine": limits,
            "outputs_match": match,
        }
        result["targets"]["throughput_met"] = result["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO
        result["targets"]["tpot_bs1_met"] = result["tpot_bs1_ratio"] <= TARGET_TPOT_BS1_RATIO
        shares = {"active_bytes_per_token": bytes_per_token, "run_flops": flops}
        for side, tpot, thr in (("engine", bs1["engine_tpot"], eng), ("hf", bs1["hf_tpot"], hf)):
            shares[f"{side}_bs1_bytes_per_s"] = bytes_per_token / tpot
            shares[f"{side}_flops_per_s"] = flops["total"] / thr["duration_s"]
            if limits:
                shares[f"{side}_bs1_bandwidth_share"] = shares[f"{side}_bs1_bytes_per_s"] / limits["read_bw"]
                shares[f"{side}_flops_share"] = shares[f"{side}_flops_per_s"] / limits["matmul_flops"]
        result["shares"] = shares
        if limits:
            result["targets"]["roofline_share_min"] = TARGET_ROOFLINE_SHARE
            result["targets"]["roofline_met"] = shares["engine_flops_share"] >= TARGET_ROOFLINE_SHARE
        result["elapsed_s"] = time.monotonic() - started
        if keep_outputs:
            result["outputs"] = {"engine": [r["output_ids"] for r in eng_res.requests], "hf": hf_res["outputs"]}
        _log_report(result, log)
        return result
    finally:
        torch.set_num_threads(prev_threads)


def _f(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _log_report(r: dict, log: Callable[[str], None]) -> None:
    e, h, b, s, m = r["engine"], r["hf"], r["bs1"], r["shares"], r["machine"]
    log("")
    log(f"{'':24}{'engine':>16}{'transformers':>16}")
    log(f"{'output tok/s':24}{_f(e['output_throughput'], 1, 1):>16}{_f(h['output_throughput'], 1, 1):>16}")
    for name, key, scale, unit in (("TTFT", "ttft", 1, "s"), ("TPOT", "tpot", 1e3, "ms")):
        log(f"{name + ' p50 / p99 (' + unit + ')':24}"
            f"{_f(e[key + '_p50'], scale) + ' / ' + _f(e[key + '_p99'], scale):>16}"
            f"{_f(h[key + '_p50'], scale) + ' / ' + _f(h[key + '_p99'], scale):>16}")
    log(f"{'TPOT batch 1 (ms)':24}{_f(b['engine_tpot'], 1e3):>16}{_f(b['hf_tpot'], 1e3):>16}")
    t = r["targets"]
    log(f"throughput ratio {r['throughput_ratio']:.2f}x (target >= {t['throughput_ratio_min']:g}: "
        f"{'met' if t['throughput_met'] else 'NOT met'}); batch-1 TPOT ratio {r['tpot_bs1_ratio']:.2f} "
        f"(target <= {t['tpot_bs1_ratio_max']:g}: {'met' if t['tpot_bs1_met'] else 'NOT met'})")
    if m:
        log(f"machine: {machine_limits.format_limits(m)}")
        log(f"batch-1 decode streams {s['active_bytes_per_token'] / 1e6:.1f} MB of active weights per token: "
            f"engine {s['engine_bs1_bytes_per_s'] / 1e9:.2f} GB/s = {s['engine_bs1_bandwidth_share']:.1%} of "
            f"read bandwidth, transformers {s['hf_bs1_bandwidth_share']:.1%}")
        f = s["run_flops"]
        log(f"the run's FLOPs as the engine runs them ({f['total'] / 1e9:.2f} G: layers' matmuls "
            f"{f['layers_matmul'] / f['total']:.0%}, LM head on sampled rows {f['lm_head'] / f['total']:.0%}, "
            f"attention {f['attention'] / f['total']:.0%}): engine {s['engine_flops_per_s'] / 1e9:.2f} GFLOP/s = "
            f"{s['engine_flops_share']:.1%} of matmul peak (target >= {TARGET_ROOFLINE_SHARE:.0%}), transformers "
            f"{s['hf_flops_share']:.1%}")
    om = r["outputs_match"]
    log(f"greedy outputs identical for {om['identical']}/{om['requests']} requests; "
        f"load average {r['load_avg_before']} -> {r['load_avg_after']} on {r['cpu_count']} CPUs; "
        f"{r['elapsed_s']:.0f}s in all")


# -- the same comparison on a shared machine

TARGET_CONTENDED_KEEP = 0.5  # engine throughput with a busy neighbour / without, at least


def _spin(parent: int) -> None:
    # one core's worth of pure-Python work: the neighbour a shared machine has. It stops when
    # the benchmark's process is gone, even one killed before it could terminate its neighbour.
    while os.getppid() == parent:
        for _ in range(1_000_000):
            pass


class BusyNeighbour:
    """A process that keeps one core busy while the block runs (and is gone after it)."""

    def __enter__(self):
        import multiprocessing

        self.proc = multiprocessing.get_context("spawn").Process(target=_spin, args=(os.getpid(),), daemon=True)
        self.proc.start()
        time.sleep(1.0)  # spawn has started the interpreter and the loop is spinning
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.join(5)


def run_contended(model_dir: str | Path | None = None, *, log: Callable[[str], None] = print, **options) -> dict:
    """compare-hf twice, on the quiet machine and with a BusyNeighbour holding one core; under
    contention the engine runs twice, with its default thread policy and with torch's default of
    a thread per core, so the result shows what the policy buys. `engine_kept`: contended /
    quiet engine throughput (target >= TARGET_CONTENDED_KEEP)."""
    if options.get("threads"):
        raise ValueError("threads: --contended compares thread policies itself; leave --threads out")
    log("== quiet machine")
    quiet = run_compare_hf(model_dir, log=log, **options)
    log("== one core held by a busy process")
    with BusyNeighbour():
        contended = run_compare_hf(model_dir, log=log, **{**options, "measure_machine": False})
        log("engine with torch's default threads (a thread per core), same neighbour:")
        fixed = run_compare_hf(model_dir, log=log, **{**options, "measure_machine": False,
                                                       "engine_threads": torch.get_num_threads(), "engine_only": True})
    q, c, f = (r["engine"]["output_throughput"] for r in (quiet, contended, fixed))
    result = {
        "quiet": quiet, "contended": contended, "contended_torch_default_threads": fixed["engine"],
        "engine_kept": c / q, "engine_kept_torch_default_threads": f / q,
        "hf_kept": contended["hf"]["output_throughput"] / quiet["hf"]["output_throughput"],
        "thread_policy": {"quiet": quiet["engine"]["threads"], "contended": contended["engine"]["threads"]},
        "target_engine_kept": TARGET_CONTENDED_KEEP, "met": c / q >= TARGET_CONTENDED_KEEP,
    }
    log(f"engine kept {result['engine_kept']:.0%} of its quiet throughput with one core taken (target >= "
        f"{TARGET_CONTENDED_KEEP:.0%}: {'met' if result['met'] else 'NOT met'}) on its default policy, "
        f"{result['engine_kept_torch_default_threads']:.0%} with a thread per core; transformers kept "
        f"{result['hf_kept']:.0%}. Thread policy chose {quiet['engine']['threads']['threads']} thread(s) quiet, "
        f"{contended['engine']['threads']['threads']} contended (others kept "
        f"{contended['engine']['threads'].get('others_busy_cores', '-')} cores busy)")
    return result


# -- engine-only serving runs

def run_serve(model_dir: str | Path | None = None, *, spec: WorkloadSpec, dtype: str | None = None,
              realtime: bool = True, knobs: dict | None = None, log: Callable[[str], None] = print,
              host_mem: int | None = None) -> dict:
    """One workload through the engine alone; returns the run summary (and the spec).
    host_mem: the disk tier's host memory (experts beyond it stay in the checkpoint's files)."""
    check_bench_requests(expected_requests(spec))
    model_dir = Path(model_dir or sample_model_dir())
    cfg = EngineConfig(model=str(model_dir), dtype=dtype, host_mem=host_mem, num_threads="auto",
                       **({"knobs": knobs} if knobs else {}))
    engine = LLMEngine(cfg)
    items = make_workload(spec, engine.tokenizer, engine.model_config.vocab_size)
    engine.generate([items[0].prompt_ids[:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    res = run_workload(engine, items, realtime=realtime)
    s = res.summary
    ttft, tpot = s["ttft"], s["tpot"]
    log(f"{s['completed']}/{s['requests']} requests in {_f(s['duration_s'], digits=1)}s: "
        f"{_f(s['output_throughput'], digits=1)} output tok/s, {_f(s['request_throughput'])} req/s, TTFT p50/p90/p99 "
        f"{_f(ttft['p50'], digits=3)}/{_f(ttft['p90'], digits=3)}/{_f(ttft['p99'], digits=3)}s, TPOT p50/p90/p99 "
        f"{_f(tpot['p50'], 1e3, 1)}/{_f(tpot['p90'], 1e3, 1)}/{_f(tpot['p99'], 1e3, 1)}ms, "
        f"mean batch {_f(s['mean_batch_size'], digits=1)}")
    return {"workload": spec.describe(), "summary": s}

