"""Soak test: does the engine's memory stay flat over many requests of varied shapes?

    moectl bench --suite soak [--requests 10000] [--devices 2] [--json]

Requests of widely varied prompt and output lengths go through the engine's own step loop
(add_request/step, the path every front end drives) with a concurrency redrawn every
`_WAVE` requests, so the batches vary in both rows and tokens. A prompt is a prefix of one of
a few shared documents (as with system prompts or few-shot examples) ending in a few fresh
tokens: the prefix cache serves the rest, so contexts of up to a thousand tokens, whose
attention buffers are the large, varied allocations, cost little compute and 10,000 requests
stay quick. The harness generates prompts as it goes and keeps only counters, so the memory it
watches is the engine's.

Reported, after `warmup` requests (the allocator's pools and the engine's bounded logs
filling) and at the end: the process RSS and its growth as a ratio of the warm figure (target
<= 5%), a sampled RSS curve, the Python heap apart from native memory (gc-tracked objects and
pymalloc blocks, cheap enough to sample; then tracemalloc over a short tail run of its own,
after the end figures, since it slows every allocation), glibc's view (mallinfo2) and what a
malloc_trim would still give back, and throughput. torch keeps no statistics for its CPU
allocator (CPU tensors go straight to the C allocator), so glibc's figures stand in for them.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil

from moectl.engine import sample_model_dir
from moectl.engine.core import native_memory
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import EngineConfig, LLMEngine
from moectl.engine.tools.workload import LengthDist
from moectl.placement.topology import Topology

TARGET_GROWTH_RATIO = 0.05  # RSS at the end over RSS after warm-up, minus 1, at most
PROMPT_LEN = "lognormal:96,1.2,1,1024"  # median 96 tokens, from 1 to 1024
OUTPUT_LEN = "lognormal:3,1.0,1,48"  # short outputs keep 10,000 requests quick; decode batches still vary
_WAVE = 64  # requests between redraws of the concurrency
_DOCUMENTS = 16  # shared prompt prefixes: their blocks stay within a device's KV pool
_FRESH = 16  # at most this many uncached tokens end each prompt


def check_options(num_requests: int, warmup: int | None, samples: int, devices: int, heap_requests: int) -> int:
    """ValueError naming the option on bad input; returns the warm-up request count."""
    if not 10 <= num_requests <= 1_000_000:
        raise ValueError(f"--requests: the soak needs 10-1000000 requests, got {num_requests}")
    warm = warmup if warmup is not None else max(1, num_requests // 10)
    if not 1 <= warm < num_requests:
        raise ValueError(f"warmup: must be in 1-{num_requests - 1} (fewer than --requests), got {warm}")
    if not 2 <= samples <= 1000:
        raise ValueError(f"samples: must be in 2-1000, got {samples}")
    if not 0 <= devices <= 64:
        raise ValueError(f"--devices: must be in 0-64 (0: no expert layer), got {devices}")
    if not 0 <= heap_requests <= num_requests:
        raise ValueError(f"heap_requests: must be in 0-{num_requests}, got {heap_requests}")
    return warm


class _Probe:
    """RSS and the Python/native split, read between steps."""

    def __init__(self):
        self.process = psutil.Process()

    def read(self, done: int, t0: float) -> dict:
        gc.collect()  # garbage awaiting the cycle collector is not growth
        native = native_memory.mallinfo()
        return {"requests": done, "t_s": time.monotonic() - t0, "rss_bytes": self.process.memory_info().rss,
                "gc_objects": len(gc.get_objects()), "pymalloc_blocks": sys.getallocatedblocks(),
                "malloc_in_use_bytes": None if native is None else native["in_use"],
                "malloc_free_bytes": None if native is None else native["free"]}


def _drive(engine, total: int, rng: np.random.Generator, prompt: LengthDist, output: LengthDist,
           max_inflight: int, on_done: Callable[[int], None]) -> dict:
    """Runs `total` requests to completion; on_done(n) after each step that finished some."""
    vocab = engine.model_config.vocab_size
    documents = [rng.integers(0, vocab, size=prompt.max).tolist() for _ in range(_DOCUMENTS)]
    added = done = inflight = out_tokens = prompt_tokens = 0
    target = max_inflight
    while done < total:
        while added < total and inflight < target:
            plen, olen = prompt.sample(rng, 1)[0], output.sample(rng, 1)[0]
            fresh = min(plen, int(rng.integers(1, _FRESH + 1)))
            ids = documents[int(rng.integers(_DOCUMENTS))][:plen - fresh] + rng.integers(0, vocab, size=fresh).tolist()
            sampled = added % 4 == 3  # a share with temperature, so the per-request generators run too
            params = SamplingParams(max_tokens=olen, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                                    seed=added if sampled else None)
            engine.add_request(ids, params)
            added, inflight, prompt_tokens = added + 1, inflight + 1, prompt_tokens + plen
            if added % _WAVE == 0:  # from a few rows to more than a batch holds (max_num_seqs)
                target = int(rng.integers(min(8, max_inflight), max_inflight + 1))
        finished = 0
        for out in engine.step():
            if out.finished:
                finished += 1
                out_tokens += len(out.token_ids)
        if finished:
            done, inflight = done + finished, inflight - finished
            on_done(done)
    return {"output_tokens": out_tokens, "prompt_tokens": prompt_tokens}


def _computed_tokens(engine, tokens: dict) -> int:
    """Tokens the model ran: outputs, and prompt tokens the prefix cache did not serve."""
    return tokens["output_tokens"] + tokens["prompt_tokens"] - engine.blocks.prefix_hits


def _tracemalloc_tail(engine, n: int, rng, prompt, output, max_inflight: int) -> dict | None:
    """Python bytes still held after n more requests, allocated during them (tracemalloc)."""
    if n == 0:
        return None
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        _drive(engine, n, rng, prompt, output, max_inflight, lambda _done: None)
        gc.collect()
        diff = tracemalloc.take_snapshot().compare_to(before, "filename")
    finally:
        tracemalloc.stop()
    top = sorted(diff, key=lambda s: -s.size_diff)[:3]
    return {"requests": n, "retained_bytes": sum(s.size_diff for s in diff),
            "top": [{"file": s.traceback[0].filename, "bytes": s.size_diff} for s in top]}


def _step_log_share(engine, process: psutil.Process) -> dict:
    """The RSS the engine's bounded step log holds (it fills for its first maxlen steps, which
    a soak shorter than that sees as growth): measured by dropping its records, last of all."""
    native_memory.trim()
    before, records = process.memory_info().rss, len(engine.step_log)
    engine.step_log.clear()
    gc.collect()
    native_memory.trim()
    return {"records_dropped": records, "rss_freed_bytes": before - process.memory_info().rss}


def run_soak(model_dir: str | Path | None = None, *, num_requests: int = 10_000, warmup: int | None = None,
             samples: int = 50, devices: int = 2, prompt_len: str = PROMPT_LEN, output_len: str = OUTPUT_LEN,
             max_inflight: int = 128, heap_requests: int | None = None, dtype: str | None = "float32",
             threads: int | str | None = "auto", seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """The soak (module docstring). heap_requests: the tracemalloc tail's size (default 2% of
    num_requests, at most 200; 0 skips it). threads: torch intra-op threads, the engine's auto
    policy by default (on a shared box a thread per core makes every step several times
    slower; None: torch's own setting). dtype: fp32 by
    default, since CPUs without native bf16 (AVX2) run fp32 matmuls about twice as fast, and the
    allocation pattern is the same (None: the checkpoint's dtype)."""
    heap_requests = min(200, num_requests // 50) if heap_requests is None else heap_requests
    warm_n = check_options(num_requests, warmup, samples, devices, heap_requests)
    prompt, output = LengthDist.parse(prompt_len, "prompt_len"), LengthDist.parse(output_len, "output_len")
    path = str(model_dir or sample_model_dir())
    config = EngineConfig(model=path, dtype=dtype, num_threads=threads, seed=seed,
                          topology=Topology(num_devices=devices) if devices else None)
    engine = LLMEngine(config)
    if prompt.max + output.max > engine.max_model_len:  # a small model's context: the same shape, shorter
        hi = engine.max_model_len - output.max
        if hi < 1:
            raise ValueError(f"output_len: up to {output.max} tokens leave no room for a prompt in the context of "
                             f"{engine.max_model_len}")
        prompt = dataclasses.replace(prompt, lo=min(prompt.lo, hi), hi=hi)
    rng = np.random.default_rng(seed)
    probe = _Probe()
    every = max(1, (num_requests - warm_n) // samples)
    curve: list[dict] = []
    state = {"next": warm_n, "warm": None, "warm_step": 0, "warm_t": 0.0}
    t0 = time.monotonic()

    def on_done(done: int) -> None:
        if done < state["next"] and done < num_requests:
            return
        point = probe.read(done, t0)
        if state["warm"] is None:
            state["warm"], state["warm_step"], state["warm_t"] = point, engine.step_count, time.monotonic()
            log(f"soak: warm after {done} requests, RSS {point['rss_bytes'] / 2**20:.0f} MiB")
        elif done % (every * 10) < every or done >= num_requests:
            log(f"soak: {done}/{num_requests} requests, RSS {point['rss_bytes'] / 2**20:.0f} MiB")
        curve.append(point)
        state["next"] = done + every

    log(f"soak: {num_requests} requests, prompts {prompt.describe()}, outputs {output.describe()}, "
        f"{devices} emulated devices")
    tokens = _drive(engine, num_requests, rng, prompt, output, max_inflight, on_done)
    wall, steps, computed = time.monotonic() - t0, engine.step_count, _computed_tokens(engine, tokens)
    warm_wall = time.monotonic() - state["warm_t"]
    warm, end = state["warm"], curve[-1]
    half = min(curve, key=lambda p: abs(p["requests"] - (warm["requests"] + num_requests) / 2))
    after_trim = None
    if native_memory.available():
        native_memory.trim()
        after_trim = probe.process.memory_info().rss
    heap_tail = _tracemalloc_tail(engine, heap_requests, rng, prompt, output, max_inflight)
    step_log = _step_log_share(engine, probe.process)
    growth = end["rss_bytes"] / warm["rss_bytes"] - 1
    return {
        "requests": num_requests, "warmup_requests": warm["requests"], "devices": devices,
        "prompt_len": prompt.describe(), "output_len": output.describe(), "max_inflight": max_inflight,
        "steps": steps, "wall_s": wall,
        "output_tokens": tokens["output_tokens"], "prompt_tokens": tokens["prompt_tokens"],
        "output_tokens_per_s": tokens["output_tokens"] / wall,
        "cached_prompt_tokens": tokens["prompt_tokens"] - (computed - tokens["output_tokens"]),
        "computed_tokens_per_s": computed / wall,
        "steps_per_s_after_warmup": (steps - state["warm_step"]) / max(1e-9, warm_wall),
        "rss_warm_bytes": warm["rss_bytes"], "rss_end_bytes": end["rss_bytes"],
        "rss_peak_bytes": max(p["rss_bytes"] for p in curve),
        "rss_growth_ratio": growth, "rss_growth_second_half_ratio": end["rss_bytes"] / half["rss_bytes"] - 1,
        "target_growth_ratio": TARGET_GROWTH_RATIO, "meets_target": growth <= TARGET_GROWTH_RATIO,
        "step_log": {"records_warm": min(state["warm_step"], engine.step_log.maxlen),
                     "records_end": min(steps, engine.step_log.maxlen),
                     "maxlen": engine.step_log.maxlen, **step_log},
        "python_heap": {"gc_objects_warm": warm["gc_objects"], "gc_objects_end": end["gc_objects"],
                        "pymalloc_blocks_warm": warm["pymalloc_blocks"], "pymalloc_blocks_end": end["pymalloc_blocks"],
                        "tracemalloc_tail": heap_tail},
        "native": {"allocator_settings": native_memory.setup() if native_memory.available() else None,
                   "malloc_in_use_warm_bytes": warm["malloc_in_use_bytes"],
                   "malloc_in_use_end_bytes": end["malloc_in_use_bytes"],
                   "malloc_free_warm_bytes": warm["malloc_free_bytes"], "malloc_free_end_bytes": end["malloc_free_bytes"],
                   "rss_after_trim_bytes": after_trim,
                   "torch_cpu_allocator": "no statistics: torch's CPU tensors use the C allocator directly"},
        "curve": curve,
    }


def format_soak(r: dict) -> str:
    mib = 2**20
    heap, native = r["python_heap"], r["native"]
    lines = [
        f"soak: {r['requests']} requests ({r['steps']} steps) in {r['wall_s']:.0f} s, "
        f"{r['output_tokens_per_s']:.0f} output tok/s, {r['computed_tokens_per_s']:.0f} tok/s computed (prefix cache "
        f"hits not counted)",
        f"  RSS          {r['rss_warm_bytes'] / mib:.0f} MiB after {r['warmup_requests']} requests -> "
        f"{r['rss_end_bytes'] / mib:.0f} MiB at the end: {r['rss_growth_ratio']:+.1%} "
        f"(target <= {r['target_growth_ratio']:.0%}: {'met' if r['meets_target'] else 'NOT met'}); "
        f"second half {r['rss_growth_second_half_ratio']:+.1%}, peak {r['rss_peak_bytes'] / mib:.0f} MiB",
        f"  Python heap  gc objects {heap['gc_objects_warm']} -> {heap['gc_objects_end']}, pymalloc blocks "
        f"{heap['pymalloc_blocks_warm']} -> {heap['pymalloc_blocks_end']}",
    ]
    sl = r["step_log"]
    lines.append(f"  step log     {sl['records_warm']} -> {sl['records_end']} of {sl['maxlen']} records; dropping them "
                 f"frees {sl['rss_freed_bytes'] / mib:.1f} MiB of RSS")
    tail = heap["tracemalloc_tail"]
    if tail is not None:
        lines.append(f"  tracemalloc  {tail['retained_bytes'] / 1024:+.0f} KiB kept over {tail['requests']} more requests")
    if native["malloc_in_use_end_bytes"] is not None:
        lines.append(f"  malloc       in use {native['malloc_in_use_warm_bytes'] / mib:.0f} -> "
                     f"{native['malloc_in_use_end_bytes'] / mib:.0f} MiB, free in arenas "
                     f"{native['malloc_free_warm_bytes'] / mib:.0f} -> {native['malloc_free_end_bytes'] / mib:.0f} MiB; "
                     f"RSS after malloc_trim {native['rss_after_trim_bytes'] / mib:.0f} MiB")
    return "\n".join(lines)
