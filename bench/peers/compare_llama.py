"""moectl against llama.cpp (llama-cpp-python, a GGUF in f32) on this machine, side by side: the
workload of `moectl bench --compare hf` (64 requests at once, prompts of 32-512 tokens and outputs of
16-256 from its corpus, greedy, EOS ignored), the same token ids to both, in alternating rounds, two
threads each; then one request alone (batch 1, 128 output tokens) for the time per output token.

    bash bench/peers/setup.sh llama                # llama-cpp-python and its GGUF converter in .peers/llama
    python bench/peers/compare_llama.py [--model sample|sample-dsv3] [--rounds 3] [--bs1-tokens 128] [--json]

The model is converted once to a GGUF in f32 with the converter of the same llama.cpp
(.peers/gguf/NAME-f32.gguf, again only when missing or older than the checkpoint): the samples'
byte-level BPE pre-tokenizer is GPT-2's, which the converter does not recognise by its hash, so
the conversion maps that hash to "gpt-2" (token ids go to llama.cpp as they are; its tokenizer is
never used). llama.cpp runs in its own venv, in a worker process that loads the model once and runs
the workload when told, through llama.cpp's C API (llama_batch, llama_decode, argmax of the
logits) as a continuous batch the way llama.cpp batches fast on CPU: one KV stream per sequence
(kv_unified off), flash attention off, f32 KV cache, each prompt prefilled in a llama_decode of its
own, then one token of every running sequence per llama_decode. llama.cpp splits a batch wherever
its sequence ids are not consecutive, so a finished sequence's stream is refilled with the last
running one (llama_memory_seq_cp; nothing uses the known output lengths). moectl's engine runs in
this process, in fp32, without prefix caching (llama.cpp's cache is cleared before each run, so
neither side reuses an earlier round's prompts). Round k runs moectl then llama.cpp, round k+1
llama.cpp then moectl; each side's turn is the workload, then the batch-1 request (the workload's
first prompt). Printed: each side's output tokens per second per round, the ratio moectl /
llama.cpp (median and range over the rounds), batch-1 TPOT of each (time per output token after
the first) and their ratio, the dtype and threads each used, and in how many requests the greedy
outputs agree token for token (in f32 they should). llama.cpp's process is stopped (SIGSTOP) while
moectl runs, as vLLM's is: its OpenMP threads spin briefly after each llama_decode (idle, they
sleep: 0% CPU measured). The load average before each run is kept. Nothing here is on CI's path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.peers.compare_vllm import THREADS, load_avg, moectl_engine, peer_stopped  # noqa: E402  (after the path: run as a script)

LLAMA_PYTHON = Path(os.environ.get("MOECTL_LLAMA_PYTHON", ROOT / ".peers" / "llama" / "bin" / "python"))
CONVERTER = ROOT / ".peers" / "llama" / "src"  # convert_hf_to_gguf.py, conversion/ and gguf-py of llama.cpp
GGUF_CACHE = ROOT / ".peers" / "gguf"
MODELS = ("sample", "sample-dsv3")

# llama.cpp's converter, with the one change the samples need: a BPE pre-tokenizer whose hash it
# does not know is GPT-2's (the samples' tokenizer.json: ByteLevel, GPT-2's regex). argv: the
# converter's folder, then the converter's own arguments.
CONVERT = r'''
import sys
sys.path.insert(0, sys.argv.pop(1))
import convert_hf_to_gguf
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("compare_llama: pre-tokenizer hash not in the converter's table: gpt-2", file=sys.stderr)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
convert_hf_to_gguf.main()
'''

# the worker llama.cpp's venv runs: loads once, then per line on stdin ("go": the workload, "bs1":
# one request alone) runs it and answers a JSON line marked "@@moectl " (llama.cpp logs to stderr)
WORKER = r'''
import json, sys, time
import numpy as np
import llama_cpp as L
def main():
    cfg = json.loads(sys.argv[1])
    work = json.load(open(cfg["workload"]))
    n_seq = len(work)
    per_seq = max(len(w["prompt_ids"]) + w["max_tokens"] for w in work + [cfg["bs1"]])
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(cfg["gguf"].encode(), mp)
    if not model:
        sys.exit("llama_model_load_from_file failed (its log is above)")
    cp = L.llama_context_default_params()
    cp.n_seq_max = n_seq
    cp.n_ctx = n_seq * (-(-per_seq // 256) * 256)  # one stream per sequence: n_ctx / n_seq_max cells each
    cp.n_batch = cp.n_ubatch = max(512, n_seq)
    cp.kv_unified = False
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = cp.type_v = L.GGML_TYPE_F32
    cp.n_threads = cp.n_threads_batch = cfg["threads"]
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("llama_init_from_model failed (its log is above)")
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(cp.n_batch, 0, 1)

    def decode(entries):  # (token, position, sequence id, logits?) each
        for i, (tok, pos, seq, out) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(i):
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

    def prefill(ids, seq):  # a prompt alone, in chunks of n_batch; the next token from its last row
        for s in range(0, len(ids), cp.n_batch):
            chunk = ids[s:s + cp.n_batch]
            decode([(t, s + p, seq, s + p == len(ids) - 1) for p, t in enumerate(chunk)])
        return argmax((len(ids) - 1) % cp.n_batch)

    def generate(items):
        L.llama_memory_clear(mem, True)
        outs = [[prefill(w["prompt_ids"], r)] for r, w in enumerate(items)]  # request r in stream r
        slots = list(range(len(items)))  # stream -> request; streams 0..k-1 run
        while True:
            done = {s for s, r in enumerate(slots) if len(outs[r]) >= items[r]["max_tokens"]}
            if done:  # refill the low streams that finished with the high ones still running
                k = len(slots) - len(done)
                holes = sorted(s for s in done if s < k)
                movers = sorted(s for s in range(k, len(slots)) if s not in done)
                for h, m in zip(holes, movers):
                    L.llama_memory_seq_cp(mem, m, h, -1, -1)  # the whole stream; copied at the next decode
                    slots[h] = slots[m]
                for s in range(k, len(slots)):
                    L.llama_memory_seq_rm(mem, s, -1, -1)
                del slots[k:]
            if not slots:
                return outs
            decode([(outs[r][-1], len(items[r]["prompt_ids"]) + len(outs[r]) - 1, s, True)
                    for s, r in enumerate(slots)])
            for s, r in enumerate(slots):
                outs[r].append(argmax(s))

    def bs1(item):
        L.llama_memory_clear(mem, True)
        ids, out = item["prompt_ids"], [prefill(item["prompt_ids"], 0)]
        times = [time.monotonic()]
        while len(out) < item["max_tokens"]:
            decode([(out[-1], len(ids) + len(out) - 1, 0, True)])
            out.append(argmax(0))
            times.append(time.monotonic())
        return (times[-1] - times[0]) / (len(times) - 1), out

    generate([{"prompt_ids": work[0]["prompt_ids"][:8], "max_tokens": 4}])  # warm-up
    print("@@moectl " + json.dumps({"ready": True, "llama_cpp": L.__version__,
                                    "system_info": L.llama_print_system_info().decode().strip()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "go":
            t0 = time.monotonic()
            outs = generate(work)
            print("@@moectl " + json.dumps({"seconds": time.monotonic() - t0, "outputs": outs}), flush=True)
        elif line.strip() == "bs1":
            tpot, out = bs1(cfg["bs1"])
            print("@@moectl " + json.dumps({"tpot": tpot, "output": out}), flush=True)
        else:
            break
if __name__ == "__main__":
    main()
'''


def workload(model_dir: Path, num_requests: int, seed: int):
    """compare_vllm's workload (the `moectl bench --compare hf` one) on the given model."""
    from moectl.engine.models.config import ModelConfig
    from moectl.engine.models.tokenizer import Tokenizer
    from moectl.engine.tools.workload import WorkloadSpec, make_workload

    spec = WorkloadSpec(num_requests=num_requests, rate=float("inf"), prompt_len=(32, 512), output_len=(16, 256),
                        seed=seed, source="auto", ignore_eos=True)
    mcfg = ModelConfig.from_dir(model_dir, dtype="float32")
    return make_workload(spec, Tokenizer.from_dir(model_dir, mcfg.bos_token_id), mcfg.vocab_size)


def gguf_for(name: str, model_dir: Path) -> Path:
    """The model as an f32 GGUF, converted when missing or older than the checkpoint; exits with the
    converter's own error when it cannot convert."""
    out = GGUF_CACHE / f"{name}-f32.gguf"
    newest = max(p.stat().st_mtime for p in model_dir.iterdir() if p.is_file())
    if out.exists() and out.stat().st_mtime >= newest:
        return out
    GGUF_CACHE.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    res = subprocess.run([str(LLAMA_PYTHON), "-c", CONVERT, str(CONVERTER), str(model_dir), "--outtype", "f32",
                          "--outfile", str(part)], capture_output=True, text=True)
    if res.returncode != 0 or not part.exists():
        part.unlink(missing_ok=True)
        tail = "\n".join(res.stderr.strip().splitlines()[-12:])
        sys.exit(f"compare_llama: llama.cpp's converter cannot convert {name} ({model_dir}):\n{tail}")
    part.replace(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sample", choices=MODELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--bs1-tokens", type=int, default=128, help="output tokens of the batch-1 request")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not LLAMA_PYTHON.exists() or not (CONVERTER / "convert_hf_to_gguf.py").exists():
        sys.exit(f"compare_llama: no llama.cpp venv at {LLAMA_PYTHON} or no converter in {CONVERTER}: run bash "
                 f"bench/peers/setup.sh llama first")
    if not 1 <= args.rounds <= 20:
        sys.exit("compare_llama: --rounds must be in 1-20")
    if not 1 <= args.requests <= 256:
        sys.exit("compare_llama: --requests must be in 1-256 (llama.cpp's sequences at most)")
    if args.bs1_tokens < 2:
        sys.exit("compare_llama: --bs1-tokens must be >= 2 (TPOT needs two tokens)")

    import torch

    from moectl.engine import sample_model_dir
    from moectl.engine.core.sampling import SamplingParams
    from moectl.engine.tools.workload import WorkloadItem, run_workload

    model_dir = sample_model_dir(args.model)
    gguf = gguf_for(args.model, model_dir)
    items = workload(model_dir, args.requests, 0)
    total_prompt = sum(len(it.prompt_ids) for it in items)
    total_out = sum(it.params.max_tokens for it in items)
    prompt1 = items[0].prompt_ids
    tmp = Path(tempfile.mkdtemp())
    work_file = tmp / "workload.json"
    work_file.write_text(json.dumps([{"prompt_ids": it.prompt_ids, "max_tokens": it.params.max_tokens}
                                     for it in items]))
    cfg = {"gguf": str(gguf), "workload": str(work_file), "threads": THREADS,
           "bs1": {"prompt_ids": prompt1, "max_tokens": args.bs1_tokens}}
    log_file = tmp / "llama-worker.log"
    with open(log_file, "w") as log:
        worker = subprocess.Popen([str(LLAMA_PYTHON), "-c", WORKER, json.dumps(cfg)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=log, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(THREADS)})

    def answer() -> dict:
        for line in worker.stdout:
            if line.startswith("@@moectl "):
                return json.loads(line[len("@@moectl "):])
        return {}

    def worker_failed(what: str) -> None:
        worker.kill()
        worker.wait(60)
        lines = log_file.read_text(errors="replace").strip().splitlines()
        why = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower() or "exit" in ln.lower()]
        tail = "\n".join((why or lines)[-12:])
        sys.exit(f"compare_llama: llama.cpp's worker {what} on {args.model} ({gguf.name}); its log ({log_file}):\n"
                 f"{tail}")

    ready = answer()
    if not ready.get("ready"):
        worker_failed("did not start")

    # no prefix caching: llama.cpp's cache is cleared before each run, so neither side reuses an
    # earlier round's prompts (moectl would: the rounds repeat the same prompts)
    engine = moectl_engine(model_dir, items, "float32", prefix_caching=False)

    def run_moectl() -> dict:
        with peer_stopped(worker.pid) as before:  # llama.cpp's OpenMP threads spin briefly after a decode
            res = run_workload(engine, items, realtime=True, keep_outputs=True)
            one = run_workload(engine, [WorkloadItem(0.0, prompt1, SamplingParams(max_tokens=args.bs1_tokens,
                                                                                  ignore_eos=True))],
                               keep_outputs=True).requests[0]
        seconds = res.summary["duration_s"]
        return {"seconds": seconds, "output_tok_s": total_out / seconds, "load_before": before,
                "outputs": [r["output_ids"] for r in res.requests], "tpot": one["tpot"], "bs1": one["output_ids"]}

    def run_llama() -> dict:
        before = load_avg()
        worker.stdin.write("go\nbs1\n")
        worker.stdin.flush()
        got, one = answer(), answer()
        if not got or not one:
            worker_failed("stopped")
        return {"seconds": got["seconds"], "output_tok_s": total_out / got["seconds"], "load_before": before,
                "outputs": got["outputs"], "tpot": one["tpot"], "bs1": one["output"]}

    rounds = []
    try:
        for k in range(args.rounds):
            order = (("moectl", run_moectl), ("llama", run_llama)) if k % 2 == 0 else \
                (("llama", run_llama), ("moectl", run_moectl))
            got = {name: fn() for name, fn in order}
            rounds.append(got)
            if not args.json:
                print(f"round {k + 1}: moectl {got['moectl']['output_tok_s']:,.0f} tok/s, llama.cpp "
                      f"{got['llama']['output_tok_s']:,.0f} tok/s; batch 1 TPOT moectl "
                      f"{got['moectl']['tpot'] * 1e3:.2f} ms, llama.cpp {got['llama']['tpot'] * 1e3:.2f} ms (load "
                      f"before: {got['moectl']['load_before']:.2f}, {got['llama']['load_before']:.2f})", flush=True)
    finally:
        if worker.poll() is None:
            worker.stdin.close()
            worker.wait(60)
    ratios = [r["moectl"]["output_tok_s"] / r["llama"]["output_tok_s"] for r in rounds]
    tpot_ratios = [r["moectl"]["tpot"] / r["llama"]["tpot"] for r in rounds]
    first = rounds[0]
    same = sum(a == b for a, b in zip(first["moectl"]["outputs"], first["llama"]["outputs"]))
    mismatches = [{"request": i, "first_diff_at": next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                                       min(len(a), len(b))), "tokens": len(b)}
                  for i, (a, b) in enumerate(zip(first["moectl"]["outputs"], first["llama"]["outputs"])) if a != b]
    result = {
        "model": args.model,
        "workload": {"requests": len(items), "prompt_tokens": total_prompt, "output_tokens": total_out,
                     "greedy": True, "ignore_eos": True},
        "dtype": "float32", "gguf": f"f32 ({gguf.name})", "kv_cache": "f32", "threads": THREADS,
        "torch": torch.__version__, "llama_cpp": ready["llama_cpp"], "llama_system_info": ready["system_info"],
        "llama_mode": "C API continuous batch: one KV stream per sequence, flash attention off, each prompt in a "
                      "llama_decode of its own, then one token of every running sequence per llama_decode",
        "moectl_tok_s": [r["moectl"]["output_tok_s"] for r in rounds],
        "llama_tok_s": [r["llama"]["output_tok_s"] for r in rounds],
        "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
        "greedy_identical": same, "of": len(items), "mismatches": mismatches[:16],
        "bs1": {"prompt_tokens": len(prompt1), "output_tokens": args.bs1_tokens,
                "moectl_tpot_s": [r["moectl"]["tpot"] for r in rounds],
                "llama_tpot_s": [r["llama"]["tpot"] for r in rounds],
                "ratio_median": statistics.median(tpot_ratios), "ratio_range": [min(tpot_ratios), max(tpot_ratios)],
                "greedy_identical": first["moectl"]["bs1"] == first["llama"]["bs1"]},
        "load_before": [[r["moectl"]["load_before"], r["llama"]["load_before"]] for r in rounds],
        "measured_on": time.strftime("%Y-%m-%d"),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    bs1 = result["bs1"]
    print(f"{args.model}: {len(items)} requests ({total_prompt:,} prompt, {total_out:,} output tokens), float32 "
          f"(GGUF f32, KV f32), {THREADS} threads each; llama.cpp {ready['llama_cpp']} (llama-cpp-python), torch "
          f"{torch.__version__}")
    print(f"moectl / llama.cpp output tok/s: median {result['ratio_median']:.2f}x (range {min(ratios):.2f}-"
          f"{max(ratios):.2f}x over {len(rounds)} rounds); greedy outputs identical in {same} of {len(items)}")
    print(f"batch 1 ({len(prompt1)}-token prompt, {args.bs1_tokens} output tokens): TPOT moectl "
          f"{statistics.median(bs1['moectl_tpot_s']) * 1e3:.2f} ms, llama.cpp "
          f"{statistics.median(bs1['llama_tpot_s']) * 1e3:.2f} ms, moectl / llama.cpp {bs1['ratio_median']:.2f}x "
          f"(range {min(tpot_ratios):.2f}-{max(tpot_ratios):.2f}x); greedy outputs "
          f"{'identical' if bs1['greedy_identical'] else 'differ'}")


if __name__ == "__main__":
    main()
