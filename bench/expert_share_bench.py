"""How much of a decode step the routed experts are: by matmul FLOPs, and by measured time.

    python bench/expert_share_bench.py [--model sample-dsv3|sample|DIR] [--batch 32] [--context 128]
                                       [--steps 24] [--threads 1] [--json]

The seeds' rebalance pays where routed experts dominate a step (DeepSeek-V3: about 55% of the
active parameters). Two measures, for one decode step of --batch sequences at --context tokens:

1. FLOPs (multiply-accumulates, from config.json): per token, the attention projections (MLA's
   LoRA and latent matmuls, or q/k/v/o), attention over the context (scores and values), the
   router, the routed experts (top-k x 3 matmuls of hidden x expert width), the shared experts,
   the dense layers' MLPs and the LM head (every decode row is sampled). No embedding lookup: it
   is not a matmul.
2. Time, measured: the engine in one process (no devices: the experts run in the model's MoE
   block), --batch requests with --context-token prompts decoding together; in every step that
   decodes exactly --batch rows and prefills nothing, the routed experts' spans (the "experts"
   span of each MoE layer: dispatch, grouped GEMM, combine) over the step's wall time, and the
   other spans beside them. Median over the steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def decode_macs(cfg, context: int) -> dict[str, float]:
    """Multiply-accumulates per decoded token, by part of the model (ModelConfig `cfg`)."""
    h, layers = cfg.hidden_size, cfg.num_layers
    sparse = sum(cfg.sparse_layers)
    dense = layers - sparse
    heads = cfg.num_heads
    if cfg.kv_lora_rank:  # MLA
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk) if cfg.q_lora_rank else h * heads * qk
        kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (
            cfg.qk_nope_head_dim + cfg.v_head_dim)
        proj = q + kv + heads * cfg.v_head_dim * h
        scores = heads * context * (qk + cfg.v_head_dim)
    else:
        hd = cfg.head_dim
        proj = h * heads * hd + 2 * h * cfg.num_kv_heads * hd + heads * hd * h
        scores = heads * context * 2 * hd
    shared = cfg.shared_expert_intermediate_size
    return {
        "attention_projections": layers * proj,
        "attention_scores": layers * scores,
        "router": sparse * cfg.num_experts * h,
        "routed_experts": sparse * cfg.top_k * 3 * h * cfg.expert_intermediate_size,
        "shared_experts": sparse * 3 * h * shared,
        "dense_mlp": dense * 3 * h * cfg.dense_intermediate_size,
        "lm_head": h * cfg.vocab_size,
    }


def measured_shares(model: Path, batch: int, context: int, steps: int, threads: int) -> dict:
    import torch

    from moectl.engine.core.sampling import SamplingParams
    from moectl.engine.llm_engine import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(model=str(model), num_threads=threads, dtype="float32"))
    records: list[dict] = []
    engine.add_listener(on_step=lambda stats: records.append(stats.as_record()))
    vocab = engine.model_config.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(context)] for i in range(batch)]
    engine.generate(prompts, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    decode = [r for r in records if r["batch"]["decode_tokens"] == batch and r["batch"]["prefill_tokens"] == 0]
    if not decode:
        raise SystemExit("expert_share_bench: no step decoded the whole batch at once")
    per_name: dict[str, list[float]] = {}
    walls = []
    for r in decode:
        spans, wall = r["spans"], r["t_end"] - r["t_start"]
        walls.append(wall)
        names = spans["names"]
        sums: dict[str, float] = {}
        for lane, name, dur in zip(spans["lane"].tolist(), spans["name"].tolist(), spans["dur_s"].tolist()):
            if spans["lanes"][lane] == "engine":
                sums[names[name]] = sums.get(names[name], 0.0) + dur
        for name, total in sums.items():
            per_name.setdefault(name, []).append(total / wall)
    shares = {name: round(statistics.median(values), 4) for name, values in sorted(per_name.items())}
    return {"steps": len(decode), "step_ms_median": round(statistics.median(walls) * 1e3, 2),
            "share_of_step": shares, "routed_experts_share": shares.get("experts", 0.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sample-dsv3", help="a model name (moectl model list) or a checkpoint dir")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from moectl.engine import resolve_model
    from moectl.engine.models.config import ModelConfig

    model = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model)
    macs = decode_macs(cfg, args.context)
    total = sum(macs.values())
    out = {"model": str(model), "batch": args.batch, "context": args.context,
           "macs_per_token": macs, "routed_experts_flop_share": round(macs["routed_experts"] / total, 4),
           "measured": measured_shares(model, args.batch, args.context, args.steps, args.threads)}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{model} ({cfg.architecture}): decode, batch {args.batch}, context {args.context}")
    print("matmul MACs per token:")
    for name, value in macs.items():
        print(f"  {name:<22} {value:>12,.0f}  {value / total:6.1%}")
    m = out["measured"]
    print(f"routed experts: {out['routed_experts_flop_share']:.1%} of the FLOPs; "
          f"{m['routed_experts_share']:.1%} of the measured step (median of {m['steps']} decode steps, "
          f"{m['step_ms_median']} ms each, {args.threads} thread(s))")
    print("spans, share of the step: " + ", ".join(f"{k} {v:.1%}" for k, v in m["share_of_step"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
