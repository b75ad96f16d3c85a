"""moectl against vLLM's CPU build on this machine, side by side: the workload of `moectl bench
--compare hf` (64 requests at once, prompts of 32-512 tokens and outputs of 16-256 from its
corpus, greedy, EOS ignored), the same token ids to both, in alternating rounds, two threads each.

    bash bench/peers/setup.sh                      # vLLM's CPU build in .peers/vllm
    python bench/peers/compare_vllm.py [--dtype float32|bfloat16] [--rounds 3] [--eager] [--json]

vLLM runs in its own venv, in a worker process that loads the model once (its default mode
compiles the model with torch.compile; --eager does not) and runs the workload when told; moectl's
engine runs in this process. Round k runs moectl then vLLM, round k+1 vLLM then moectl. Printed:
each side's output tokens per second per round, the ratio moectl / vLLM (median and range over the
rounds), the dtype and threads each used, and whether the greedy outputs agree token for token
(in fp32 they should). vLLM's processes are stopped (SIGSTOP) while moectl runs: its engine core
polls while idle and would take a core. The load average before each run is kept. Nothing here
is on CI's path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VLLM_PYTHON = Path(os.environ.get("MOECTL_VLLM_PYTHON", ROOT / ".peers" / "vllm" / "bin" / "python"))
THREADS = 2

# the worker vLLM's venv runs: loads once, then per line on stdin runs the workload and answers a
# JSON line marked "@@moectl " (vLLM logs to stdout too; a main guard: vLLM spawns processes)
WORKER = r'''
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    cfg = json.loads(sys.argv[1])
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=cfg["eager"], seed=0,
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"])
    work = json.load(open(cfg["workload"]))
    prompts = [TokensPrompt(prompt_token_ids=w["prompt_ids"]) for w in work]
    params = [SamplingParams(max_tokens=w["max_tokens"], temperature=0.0, ignore_eos=True) for w in work]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    print("@@moectl " + json.dumps({"ready": True, "vllm": __import__("vllm").__version__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.monotonic()
        out = llm.generate(prompts, params, use_tqdm=False)
        took = time.monotonic() - t0
        print("@@moectl " + json.dumps({"seconds": took, "outputs": [list(o.outputs[0].token_ids) for o in out]}),
              flush=True)
if __name__ == "__main__":
    main()
'''


def workload(num_requests: int, seed: int):
    from moectl.engine import sample_model_dir
    from moectl.engine.models.config import ModelConfig
    from moectl.engine.models.tokenizer import Tokenizer
    from moectl.engine.tools.workload import WorkloadSpec, make_workload

    model_dir = sample_model_dir()
    spec = WorkloadSpec(num_requests=num_requests, rate=float("inf"), prompt_len=(32, 512), output_len=(16, 256),
                        seed=seed, source="auto", ignore_eos=True)
    mcfg = ModelConfig.from_dir(model_dir, dtype="float32")
    return model_dir, make_workload(spec, Tokenizer.from_dir(model_dir, mcfg.bos_token_id), mcfg.vocab_size)


def load_avg() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def moectl_engine(model_dir, items, dtype: str, prefix_caching: bool = True):
    """moectl's engine for the workload: KV blocks for every request at once, warmed up."""
    from moectl.engine.core.config import EngineConfig
    from moectl.engine.core.sampling import SamplingParams
    from moectl.engine.llm_engine import LLMEngine

    block_size = 16
    need = sum(-(-(len(it.prompt_ids) + it.params.max_tokens) // block_size) for it in items)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, block_size=block_size, num_kv_blocks=need + 64,
                                    seed=0, num_threads=THREADS, enable_prefix_caching=prefix_caching))
    engine.generate([items[0].prompt_ids[:8]], SamplingParams(max_tokens=4, ignore_eos=True))
    return engine


@contextmanager
def peer_stopped(pid: int):
    """The peer's processes stopped (SIGSTOP) while moectl runs, so each side has the cores (an
    idle peer may poll or spin); yields the load average after a second's settling."""
    import psutil

    parent = psutil.Process(pid)
    stopped = [parent, *parent.children(recursive=True)]
    for proc in stopped:
        proc.suspend()
    time.sleep(1.0)
    try:
        yield load_avg()
    finally:
        for proc in stopped:
            proc.resume()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit(f"compare_vllm: no vLLM venv at {VLLM_PYTHON}: run bash bench/peers/setup.sh first")
    if not 1 <= args.rounds <= 20:
        sys.exit("compare_vllm: --rounds must be in 1-20")

    import tempfile

    import torch

    from moectl.engine.tools.workload import run_workload

    model_dir, items = workload(args.requests, 0)
    total_prompt = sum(len(it.prompt_ids) for it in items)
    total_out = sum(it.params.max_tokens for it in items)
    work_file = Path(tempfile.mkdtemp()) / "workload.json"
    work_file.write_text(json.dumps([{"prompt_ids": it.prompt_ids, "max_tokens": it.params.max_tokens}
                                     for it in items]))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}", "VLLM_CPU_KVCACHE_SPACE": "2",
           "OMP_NUM_THREADS": str(THREADS)}
    cfg = {"model": str(model_dir), "dtype": args.dtype, "eager": args.eager, "workload": str(work_file),
           "max_model_len": 1024, "max_num_seqs": max(256, args.requests)}
    worker = subprocess.Popen([str(VLLM_PYTHON), "-c", WORKER, json.dumps(cfg)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    def answer() -> dict:
        for line in worker.stdout:
            if line.startswith("@@moectl "):
                return json.loads(line[len("@@moectl "):])
        return {}

    ready = answer()
    if not ready.get("ready"):
        sys.exit("compare_vllm: vLLM's worker did not start (run it by hand to see why)")

    engine = moectl_engine(model_dir, items, args.dtype)

    def run_moectl() -> dict:
        with peer_stopped(worker.pid) as before:  # vLLM's engine core polls while idle
            res = run_workload(engine, items, realtime=True, keep_outputs=True)
        seconds = res.summary["duration_s"]
        return {"seconds": seconds, "output_tok_s": total_out / seconds, "load_before": before,
                "outputs": [r["output_ids"] for r in res.requests]}

    def run_vllm() -> dict:
        before = load_avg()
        worker.stdin.write("go\n")
        worker.stdin.flush()
        got = answer()
        return {"seconds": got["seconds"], "output_tok_s": total_out / got["seconds"], "load_before": before,
                "outputs": got["outputs"]}

    rounds = []
    try:
        for k in range(args.rounds):
            order = (("moectl", run_moectl), ("vllm", run_vllm)) if k % 2 == 0 else \
                (("vllm", run_vllm), ("moectl", run_moectl))
            got = {name: fn() for name, fn in order}
            rounds.append(got)
            if not args.json:
                print(f"round {k + 1}: moectl {got['moectl']['output_tok_s']:,.0f} tok/s, vLLM "
                      f"{got['vllm']['output_tok_s']:,.0f} tok/s (load before: {got['moectl']['load_before']:.2f}, "
                      f"{got['vllm']['load_before']:.2f})", flush=True)
    finally:
        worker.stdin.close()
        worker.wait(60)
    ratios = [r["moectl"]["output_tok_s"] / r["vllm"]["output_tok_s"] for r in rounds]
    same = sum(a == b for a, b in zip(rounds[0]["moectl"]["outputs"], rounds[0]["vllm"]["outputs"]))
    result = {
        "workload": {"requests": len(items), "prompt_tokens": total_prompt, "output_tokens": total_out,
                     "greedy": True, "ignore_eos": True},
        "dtype": args.dtype, "threads": THREADS, "torch": torch.__version__, "vllm": ready["vllm"],
        "vllm_mode": "eager" if args.eager else "default (torch.compile)",
        "moectl_tok_s": [r["moectl"]["output_tok_s"] for r in rounds],
        "vllm_tok_s": [r["vllm"]["output_tok_s"] for r in rounds],
        "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
        "greedy_identical": same, "of": len(items),
        "load_before": [[r["moectl"]["load_before"], r["vllm"]["load_before"]] for r in rounds],
        "measured_on": time.strftime("%Y-%m-%d"),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{len(items)} requests ({total_prompt:,} prompt, {total_out:,} output tokens), {args.dtype}, {THREADS} "
          f"threads each; vLLM {ready['vllm']} {result['vllm_mode']}, torch {torch.__version__}")
    print(f"moectl / vLLM output tok/s: median {result['ratio_median']:.2f}x (range {min(ratios):.2f}-"
          f"{max(ratios):.2f}x over {len(rounds)} rounds); greedy outputs identical in {same} of {len(items)}")


if __name__ == "__main__":
    main()
