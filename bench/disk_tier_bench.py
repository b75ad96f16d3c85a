"""The disk tier's memory bound and hit rates: a checkpoint whose routed experts are ten times
--host-mem SIZE, served all in memory and then with --host-mem SIZE (experts read from the
safetensors files behind a host cache of SIZE and one device's HBM cache).

    python bench/disk_tier_bench.py [--size 16MiB] [--json]

Each run is a fresh process; its peak RSS is the kernel's ru_maxrss. The bound checked is
    process baseline (torch and moectl imported, nothing loaded) + non-expert weights + SIZE
    + the HBM expert cache and the KV pool (both are process memory when devices are emulated)
    + MARGIN (activations, the allocator, the tokenizer)
and the greedy tokens must equal the all-in-memory run's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 1 << 20
MARGIN = 64 * MIB
CHILD = r"""
import json, resource, sys
import torch
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.placement.topology import Topology
from moectl.engine.llm_engine import LLMEngine
mode, path, host_mem, slots = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = {"baseline_rss": base}
if mode != "baseline":
    kw = dict(host_mem=host_mem, expert_cache_slots=slots) if mode == "disk" else {}
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, block_size=16, topology=Topology(num_devices=1), **kw))
    prompts = [[(7 * i + 3 * j) % 300 for j in range(24)] for i in range(6)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    out["tokens"] = [o.token_ids for o in outs]
    out["kv_bytes"] = engine.kv_cache.nbytes()
    out["non_expert_bytes"] = sum(p.nbytes for n, p in engine.model.named_parameters() if ".mlp.experts." not in n)
    recs = [r.devices for r in engine.step_log]
    cache = [c for r in recs for c in r.get("expert_cache", [])]
    out["hbm"] = {"hits": sum(c["hits"] for c in cache), "misses": sum(c["misses"] for c in cache)}
    if mode == "disk":
        cluster = engine.experts.cluster
        out["hbm_cache_bytes"] = cluster.caches[0].w13_cache.nbytes + cluster.caches[0].w2_cache.nbytes
        tiers = [r["tiers"] for r in recs]
        out["host"] = {k: sum(t["host"][k] for t in tiers) for k in ("hits", "misses")}
        out["disk"] = {k: sum(t["disk"][k] for t in tiers) for k in ("reads", "prefetch_reads", "bytes_read", "wait_s",
                                                                     "prefetch_s")}
        out["disk_bytes"] = tiers[-1]["disk"]["expert_weights"]
out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""


def build_checkpoint(out: Path, size: int) -> Path:
    """A Mixtral whose routed experts are >= 10x size (fp32; 8 experts of 3 MiB per layer)."""
    from moectl.engine.models.config import ModelConfig
    from moectl.engine.models.decoder import MoEForCausalLM
    from moectl.engine.models.loader import save_checkpoint

    hidden, inter, experts = 256, 1024, 8
    per_layer = experts * 3 * hidden * inter * 4
    layers = -(-10 * size // per_layer)
    raw = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 300, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_local_experts": experts, "num_experts_per_tok": 2,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "dtype": "float32"}
    model = MoEForCausalLM(ModelConfig.from_hf(raw))
    model.init_weights(std=0.05, seed=0)
    save_checkpoint(model, out)
    return out


def child(mode: str, path: Path, host_mem: int, slots: int) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(host_mem), str(slots)],
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    from moectl.placement.topology import format_size, parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="16MiB", help="--host-mem of the disk run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    size = parse_size(args.size, "--size")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "ckpt", size)
        slots = 8  # one layer's experts: the largest working set of a prefill step
        base = child("baseline", path, size, slots)
        memory = child("memory", path, size, slots)
        disk = child("disk", path, size, slots)
    bound = (base["peak_rss"] + disk["non_expert_bytes"] + size + disk["hbm_cache_bytes"] + disk["kv_bytes"]
             + MARGIN)
    result = {
        "host_mem": size, "disk_expert_bytes": disk["disk_bytes"], "experts_over_host_mem": disk["disk_bytes"] / size,
        "baseline_peak_rss": base["peak_rss"], "all_in_memory_peak_rss": memory["peak_rss"],
        "disk_peak_rss": disk["peak_rss"], "bound": bound, "within_bound": disk["peak_rss"] <= bound,
        "bound_terms": {"non_expert_weights": disk["non_expert_bytes"], "host_mem": size,
                        "hbm_expert_cache": disk["hbm_cache_bytes"], "kv_pool": disk["kv_bytes"], "margin": MARGIN},
        "tokens_identical": disk["tokens"] == memory["tokens"],
        "hbm_hit_rate": disk["hbm"]["hits"] / max(1, disk["hbm"]["hits"] + disk["hbm"]["misses"]),
        "host_hit_rate": disk["host"]["hits"] / max(1, disk["host"]["hits"] + disk["host"]["misses"]),
        "disk": disk["disk"],
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"experts {format_size(result['disk_expert_bytes'])} on disk = {result['experts_over_host_mem']:.1f}x "
          f"--host-mem {format_size(size)}")
    print(f"peak RSS: baseline {format_size(result['baseline_peak_rss'])}, all in memory "
          f"{format_size(result['all_in_memory_peak_rss'])}, disk tier {format_size(result['disk_peak_rss'])} "
          f"(bound {format_size(bound)}: {'within' if result['within_bound'] else 'EXCEEDED'})")
    print("bound = baseline + " + " + ".join(f"{k} {format_size(v)}" for k, v in result["bound_terms"].items()))
    d = result["disk"]
    print(f"hit rates: HBM cache {result['hbm_hit_rate']:.1%}, host {result['host_hit_rate']:.1%}; disk "
          f"{d['reads']} reads ({d['prefetch_reads']} by prefetch), {format_size(d['bytes_read'])}, demand wait "
          f"{d['wait_s'] * 1e3:.0f} ms, prefetch reads {d['prefetch_s'] * 1e3:.0f} ms")
    print(f"greedy tokens identical to the all-in-memory run: {result['tokens_identical']}")


if __name__ == "__main__":
    main()
