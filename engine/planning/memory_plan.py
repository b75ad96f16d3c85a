"""Operator-level memory plan: what each device holds for a model, a parallel layout and a load.

From config.json alone (no weights), for every device of a `Topology`:

* weights by category: attention, routed experts, shared experts, dense MLP layers,
  embeddings + LM head, norms + routers;
* the KV cache for `batch` sequences of `context` tokens, in the engine's real paged layout
  (block-rounded; INT8 with one fp32 scale per (block, head) exactly as
  `KVCache.bytes_per_block` computes it);
* activations at the peak operator of one step of `max_batched_tokens` tokens;
* communication buffers (expert-parallel all-to-all, tensor-parallel all-reduce);
* headroom = HBM - total, whether it fits, and if not by how much.

Parallel layout (DeepSeek-V3-style deployment): attention, dense MLP layers, shared experts and
the vocabulary-parallel embeddings / LM head are split over tensor-parallel groups of `tp`
consecutive devices, and the `devices / tp` groups are data-parallel replicas (DP attention:
each group serves its own sequences and schedules its own steps). Routed experts are spread by
expert parallelism over groups of `ep` devices; when `ep < devices` the `devices / ep` expert
groups each hold all experts (replicated). Every assumption the numbers rest on is listed in
`MemoryPlan.notes`.

The planner reads more architectures than the runtime runs: the four runnable ones (through
`ModelConfig.from_hf`, so their parameter counts are the runtime's) and DeepSeek-V2/V3 /
Kimi-K2-style configs with multi-head latent attention (MLA).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from moectl.engine.core.config import SchedulerKnobs
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.retention import budget_tokens
from moectl.engine.models.config import (
    ARCHITECTURES,
    MODEL_TYPE_ALIASES,
    MODEL_TYPES,
    QUANT_METHODS,
    ConfigError,
    ModelConfig,
    Quantization,
    check_sizes,
    parse_quantization,
    read_config_json,
)
from moectl.placement.topology import Topology, format_size
from moectl.wire.kv_budget import format_kv_budget

# architectures[0] -> planner family, beyond the runtime's four
# plannable, not runnable (DeepSeek-V3 / Kimi-K2 are runnable: ModelConfig reads them)
MLA_ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2"}
MLA_MODEL_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM"}
PLANNABLE = tuple(ARCHITECTURES) + tuple(MLA_ARCHITECTURES)

# weight dtypes the planner accepts: name -> (bytes per element of what is not quantized, torch
# dtype of activations / auto KV). fp8 and mxfp4 (planning only: the engine runs neither) quantize
# some linear layers (WeightFormat) and keep the rest in bf16, as the published checkpoints do
WEIGHT_DTYPES = {
    "fp32": (4, torch.float32), "float32": (4, torch.float32),
    "bf16": (2, torch.bfloat16), "bfloat16": (2, torch.bfloat16),
    "fp16": (2, torch.float16), "float16": (2, torch.float16),
    "fp8": (2, torch.bfloat16), "mxfp4": (2, torch.bfloat16),
}
KV_DTYPES = ("auto", "int8")
ATTN_IMPLS = ("flash", "eager")
MAX_TP = 8
MAX_PP = 256  # pipeline stages (and at most the model's layers)
MAX_MICRO_BATCHES = 4096

CATEGORIES = ("attention", "experts", "shared_experts", "dense_mlp", "embeddings", "norms_routers")
CATEGORY_LABELS = {
    "attention": "weights: attention",
    "experts": "weights: routed experts",
    "shared_experts": "weights: shared experts",
    "dense_mlp": "weights: dense MLP layers",
    "embeddings": "weights: embeddings + LM head",
    "norms_routers": "weights: norms + routers",
    "kv_cache": "KV cache",
    "activations": "activations (peak)",
    "comm_buffers": "communication buffers",
}


class PlanError(ValueError):
    """A planning option out of range; the message names the option (`--tp`, `--ep`, ...)."""


# ---------------------------------------------------------------------------------------------
# how the weights are stored

# a layer's parts (PlanModel.part_tensors)
PARTS = ("attention", "expert", "shared", "dense", "router", "embed", "lm_head", "norms")
# Hugging Face's module names, under model.layers.*, where a family's differ from DeepSeek's and
# Qwen's (mlp.experts.*.gate_proj, mlp.shared_experts.*, mlp.gate): modules_to_not_convert names them
EXPERT_MODULES = {None: ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.experts.*.down_proj"),
                  "mixtral": ("block_sparse_moe.experts.*.w1", "block_sparse_moe.experts.*.w3",
                              "block_sparse_moe.experts.*.w2"),
                  "gpt_oss": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
SHARED_MODULES = {"qwen2_moe": "mlp.shared_expert."}
ROUTER_MODULES = {"mixtral": "block_sparse_moe.gate", "gpt_oss": "mlp.router"}
# routers that are an nn.Linear, which FineGrainedFP8 converts (DeepSeek's and gpt-oss's are their own modules)
LINEAR_ROUTERS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@dataclass(frozen=True)
class WeightFormat:
    """How a plan stores the weights: every tensor in `plain_bytes` per element, except the
    linear layers `quantization` converts, in its values and scales (models/config.py
    Quantization: transformers' FineGrainedFP8 and Mxfp4 formats)."""
    name: str  # fp32 | bf16 | fp16 | fp8 | mxfp4
    plain_bytes: int
    quantization: Quantization | None = None

    def converts(self, part: str, module: str, model: PlanModel) -> bool:
        """Whether the quantization converts this linear layer (`module` under model.layers.*):
        fp8 every nn.Linear, mxfp4 the routed experts; neither lm_head or what the config's
        modules_to_not_convert names (a name with a layer's or an expert's index stands for all)."""
        q = self.quantization
        if q is None:
            return False
        if q.method == "fp8":
            kind = part != "router" or model.family in LINEAR_ROUTERS
        else:
            kind = part == "expert"
        name = "model.layers.*." + module
        return kind and not any(re.search(rf"(^|\.){re.escape(re.sub(r'[0-9]+', '*', skip))}(\.|$)", name)
                                for skip in q.not_converted)

    def quantized_bytes(self, rows: int, cols: int) -> int:
        """A converted [rows, cols] weight: fp8 one byte per value and an fp32 scale per block
        (FP8Linear's weight_scale_inv, [ceil(rows / b0), ceil(cols / b1)]); mxfp4 16 bytes of
        values and one e8m0 scale byte per 32 values along the input (Mxfp4GptOssExperts'
        *_blocks [.., cols / 32, 16] and *_scales [.., cols / 32])."""
        q = self.quantization
        if q.method == "fp8":
            return rows * cols + _cdiv(rows, q.block[0]) * _cdiv(cols, q.block[1]) * 4
        return rows * _cdiv(cols, 32) * (16 + 1)

    def describe(self) -> str:
        return self.quantization.describe() if self.quantization else self.name


# counts elements: a format of one byte per element, nothing quantized
PARAMS = WeightFormat("params", 1)


def weight_format(dtype: str | None, model: PlanModel) -> WeightFormat:
    """--dtype's weights. None: the config's (its quantization_config, else bf16); fp8 or mxfp4:
    the config's quantization when it is that one, else transformers' defaults for it (fp8:
    128 x 128 blocks, every linear layer but lm_head); a plain dtype: every tensor in it."""
    quant = model.quantization
    if dtype is None:
        dtype = quant.method if quant is not None else "bf16"
    if dtype not in WEIGHT_DTYPES:
        raise PlanError(f"--dtype: {dtype!r} is not supported (use fp32, bf16, fp16, fp8 or mxfp4)")
    plain = WEIGHT_DTYPES[dtype][0]
    if dtype not in QUANT_METHODS:
        return WeightFormat(dtype, plain)
    return WeightFormat(dtype, plain, quant if quant is not None and quant.method == dtype else Quantization(dtype))


def _shard(n: int, parts: int, rank: int) -> int:
    """Rows of an n-row dimension on `rank` of `parts` (the first n % parts ranks take one more)."""
    return n // parts + (1 if rank < n % parts else 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# the model, as far as memory is concerned


@dataclass
class PlanModel:
    """Shapes that decide memory, for every plannable architecture."""
    name: str
    hf_architecture: str
    family: str  # mixtral | qwen2_moe | qwen3_moe | olmoe | deepseek_v2 | deepseek_v3
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    sparse_layers: tuple[bool, ...]
    dense_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # all shared experts of a layer together
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate [1, H] on the shared expert
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias [E], gpt-oss's router bias [E]
    expert_bias: bool = False  # gpt-oss: biases on each expert's gate/up [2I] and down [H]
    attention_sinks: bool = False  # gpt-oss: one sink logit per head
    layer_windows: tuple[int, ...] = ()  # per layer: 0 full attention, else its sliding window
    tie_word_embeddings: bool = False
    attention: str = "gqa"  # gqa | mla
    # GQA
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: str = "none"
    # MLA
    q_lora_rank: int = 0  # 0: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    quantization: Quantization | None = None  # the config's quantization_config
    notes: list[str] = field(default_factory=list)

    # -- per-device parameter counts (tp, rank); with tp=1 these are the whole model's
    @property
    def kv_latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_heads_per_device(self, tp: int) -> int:
        """GQA: KV heads split over TP where there are enough, else one (replicated) per device."""
        return self.num_kv_heads // tp if self.num_kv_heads >= tp else 1

    def part_tensors(self, part: str, tp: int = 1, rank: int = 0) -> tuple[list[tuple[str, int, int]], int]:
        """One layer's `part` (PARTS) on TP rank `rank` of `tp`: its linear layers (the module, as
        Hugging Face names it under model.layers.*, and its [out, in] weight: what a quantization
        converts), and the elements of its other tensors (norms, biases, sinks; the embedding and
        LM head, which no quantization converts)."""
        h = self.hidden_size
        if part == "attention":
            return self._attention_tensors(tp)
        if part == "expert":  # gate, up [I, H] and down [H, I] (and their biases)
            i, names = self.expert_intermediate_size, EXPERT_MODULES.get(self.family, EXPERT_MODULES[None])
            shapes = [(2 * i, h), (h, i)] if len(names) == 2 else [(i, h), (i, h), (h, i)]  # gpt-oss: gate_up fused
            return [(n, r, c) for n, (r, c) in zip(names, shapes)], (2 * i + h if self.expert_bias else 0)
        if part in ("shared", "dense"):  # split over TP by intermediate rows
            size = self.shared_intermediate_size if part == "shared" else self.dense_intermediate_size
            if not size:
                return [], 0
            i = _shard(size, tp, rank)
            prefix = "mlp." if part == "dense" else SHARED_MODULES.get(self.family, "mlp.shared_experts.")
            gate = [("mlp.shared_expert_gate", 1, h)] if part == "shared" and self.shared_gate else []  # Qwen2-MoE
            return [(prefix + "gate_proj", i, h), (prefix + "up_proj", i, h), (prefix + "down_proj", h, i), *gate], 0
        if part == "router":
            return [(ROUTER_MODULES.get(self.family, "mlp.gate"), self.num_experts, h)], \
                (self.num_experts if self.router_bias else 0)
        if part in ("embed", "lm_head"):  # vocabulary-parallel; a tied LM head is the embedding
            rows = 0 if part == "lm_head" and self.tie_word_embeddings else _shard(self.vocab_size, tp, rank)
            return [], rows * h
        if part == "norms":  # every layer's two
            return [], 2 * h
        raise ValueError(f"part: {part!r} is not one of {', '.join(PARTS)}")

    def _attention_tensors(self, tp: int) -> tuple[list[tuple[str, int, int]], int]:
        h, hd = self.hidden_size, self.num_heads // tp
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            r, latent, bias = self.kv_lora_rank, self.kv_latent_dim, self.attention_bias
            ql = self.q_lora_rank
            # q_a_proj (+ bias, q_a_layernorm) replicated, q_b_proj split by heads; or one q_proj
            q = [("q_a_proj", ql, h), ("q_b_proj", hd * qk, ql)] if ql else [("q_proj", hd * qk, h)]
            other = (ql + (ql if bias else 0)) if ql else 0
            # kv_a_proj_with_mqa (+ bias) and kv_a_layernorm replicated, kv_b_proj split by heads;
            # o_proj (its bias replicated)
            kv = [("kv_a_proj_with_mqa", latent, h), ("kv_b_proj", hd * (self.qk_nope_head_dim + self.v_head_dim), r),
                  ("o_proj", h, hd * self.v_head_dim)]
            other += (latent if bias else 0) + r + (h if bias else 0)
            return [("self_attn." + n, rows, cols) for n, rows, cols in q + kv], other
        q, kv = hd * self.head_dim, self.kv_heads_per_device(tp) * self.head_dim
        other = q + 2 * kv + (h if self.o_proj_bias else 0) if self.attention_bias else 0
        if self.qk_norm == "per_head":
            other += 2 * self.head_dim
        elif self.qk_norm == "full":
            other += q + kv
        projections = [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)]
        return [("self_attn." + n, r, c) for n, r, c in projections], other + (hd if self.attention_sinks else 0)

    def part_params(self, part: str, tp: int = 1, rank: int = 0) -> int:
        matrices, other = self.part_tensors(part, tp, rank)
        return sum(r * c for _, r, c in matrices) + other

    def part_bytes(self, part: str, weights: WeightFormat, tp: int = 1, rank: int = 0) -> int:
        """One layer's `part` as `weights` stores it: each linear layer its quantization converts
        in its values and scales, everything else in the plain dtype."""
        matrices, other = self.part_tensors(part, tp, rank)
        return sum(weights.quantized_bytes(r, c) if weights.converts(part, module, self) else r * c * weights.plain_bytes
                   for module, r, c in matrices) + other * weights.plain_bytes

    def attention_params(self, tp: int = 1) -> int:
        return self.part_params("attention", tp)

    def expert_params(self) -> int:
        """One routed expert: gate/up [2I, H] and down [H, I] (and their biases)."""
        return self.part_params("expert")

    def shared_params(self, tp: int = 1, rank: int = 0) -> int:
        return self.part_params("shared", tp, rank)

    def dense_params(self, tp: int = 1, rank: int = 0) -> int:
        return self.part_params("dense", tp, rank)

    def router_params(self) -> int:
        return self.part_params("router")

    def embedding_params(self, tp: int = 1, rank: int = 0) -> int:
        return self.part_params("embed", tp, rank) + self.part_params("lm_head", tp, rank)

    @property
    def num_sparse(self) -> int:
        return sum(self.sparse_layers)

    @property
    def num_dense(self) -> int:
        return self.num_layers - self.num_sparse

    def weight_bytes(self, weights: WeightFormat, tp: int = 1, rank: int = 0,
                     experts_local: int | None = None) -> dict[str, int]:
        """Bytes by category on one device holding `experts_local` routed experts per MoE layer
        (default: all of them): the one count of the weights the planner and the simulator use."""
        e = self.num_experts if experts_local is None else experts_local

        def part(name: str) -> int:
            return self.part_bytes(name, weights, tp, rank)

        return {
            "attention": self.num_layers * part("attention"),
            "experts": self.num_sparse * e * part("expert"),
            "shared_experts": self.num_sparse * part("shared"),
            "dense_mlp": self.num_dense * part("dense"),
            "embeddings": part("embed") + part("lm_head"),
            "norms_routers": self.num_layers * part("norms") + self.hidden_size * weights.plain_bytes
            + self.num_sparse * part("router"),
        }

    def stage_weight_bytes(self, weights: WeightFormat, layers: range, tp: int = 1, rank: int = 0,
                           experts_local: int | None = None) -> dict[str, int]:
        """`weight_bytes` for a pipeline stage holding the contiguous `layers`: their attention,
        experts, shared experts, dense MLPs, norms and routers; the embedding on the stage holding
        layer 0 and the final norm and LM head (a tied one: the embedding again, as vLLM's and
        SGLang's last stage keeps its own copy) on the stage holding the last layer. With every
        layer it is `weight_bytes`."""
        e = self.num_experts if experts_local is None else experts_local
        held = list(layers)
        moe = sum(self.sparse_layers[i] for i in held)
        first, last = 0 in held, self.num_layers - 1 in held

        def part(name: str) -> int:
            return self.part_bytes(name, weights, tp, rank)

        head = part("lm_head") if not self.tie_word_embeddings else part("embed")
        if first and last:  # the whole model: one embedding, and a tied head is that matrix
            head = part("lm_head")
        return {
            "attention": len(held) * part("attention"),
            "experts": moe * e * part("expert"),
            "shared_experts": moe * part("shared"),
            "dense_mlp": (len(held) - moe) * part("dense"),
            "embeddings": (part("embed") if first else 0) + (head if last else 0),
            "norms_routers": len(held) * part("norms") + (self.hidden_size * weights.plain_bytes if last else 0)
            + moe * part("router"),
        }

    def layer_macs(self) -> list[int]:
        """Per layer, one token's multiply-accumulates outside attention's core: the attention
        projections, and the router, shared expert and top-k routed experts (an MoE layer) or the
        dense MLP; the LM head's counted on the last layer. The planner's layer cost for a
        pipeline split (it has no hardware to price time on; the simulator splits by priced time)."""
        moe = self.router_params() + self.shared_params() + self.top_k * self.expert_params()
        out = [self.attention_params() + (moe if sparse else self.dense_params()) for sparse in self.sparse_layers]
        out[-1] += self.vocab_size * self.hidden_size
        return out

    def weight_params(self, tp: int = 1, rank: int = 0, experts_local: int | None = None) -> dict[str, int]:
        """Parameters by category on one device holding `experts_local` routed experts per MoE layer."""
        return self.weight_bytes(PARAMS, tp, rank, experts_local)

    def param_counts(self) -> dict[str, int]:
        full = self.weight_params()
        total = sum(full.values())
        active = total - full["experts"] + self.num_sparse * self.top_k * self.expert_params()
        return {"params_total": total, "params_active": active}

    def kv_bytes_per_block(self, tp: int, block_size: int, dtype: torch.dtype, quantized: bool,
                           layers: int | None = None) -> int:
        """One KV block of all layers on one device, in the engine's layout (`KVCache.bytes_per_block`).

        MLA stores one compressed latent (kv_lora_rank) and one shared RoPE key (qk_rope_head_dim)
        per token and layer instead of per-head K and V: the engine keeps them as V and K of one
        'head' (INT8: one fp32 scale per block and layer for each)."""
        layers = self.num_layers if layers is None else layers
        if self.attention == "mla":
            return KVCache.bytes_per_block(layers, block_size, 1, self.qk_rope_head_dim, dtype, quantized,
                                           v_head_dim=self.kv_lora_rank)
        return KVCache.bytes_per_block(layers, block_size, self.kv_heads_per_device(tp), self.head_dim,
                                       dtype, quantized)

    def kv_bytes_per_sequence(self, tp: int, block_size: int, dtype: torch.dtype, quantized: bool, context: int,
                              chunk: int, budget: int | None = None, layers: range | None = None) -> tuple[int, int]:
        """(KV bytes of one sequence of `context` tokens, its blocks in the full layers' pool). Sliding
        layers hold at most (window - 1 + chunk) / block_size + 1 blocks (the engine's window pool).
        budget: the tokens KV retention keeps of the full layers (None: all), which hold at most
        kv_budget_blocks of them. layers: a pipeline stage's (default: every layer)."""
        blocks = _cdiv(context, block_size)
        if budget is not None:
            blocks = min(blocks, kv_budget_blocks(budget, block_size, chunk))
        held = range(self.num_layers) if layers is None else layers
        windows = [self.layer_windows[i] for i in held if self.layer_windows and self.layer_windows[i]]
        full = self.kv_bytes_per_block(tp, block_size, dtype, quantized, len(held) - len(windows)) * blocks
        if not windows:
            return full, blocks
        held = min(blocks, KVCache.window_blocks_per_sequence(max(windows), block_size, chunk))
        return full + held * self.kv_bytes_per_block(tp, block_size, dtype, quantized, len(windows)), blocks


def split_layers(costs, stages: int) -> list[int]:
    """Layers per pipeline stage: `costs` (one per layer, in order) cut into `stages` contiguous
    runs of at least one layer. The cut is the one whose largest stage (the pipeline's slowest)
    is least; among those, the one whose stages are most even (least sum of squares); among
    those, the one whose later stages hold more layers (SGLang's advice for uneven splits: the
    larger partition on the higher PP rank, e.g. 15,15,15,16 for 61 layers). Exact: a dynamic
    program over (stage, last layer), stage sums exactly rounded (math.fsum), ties within 1e-9."""
    costs = [float(c) for c in costs]
    n = len(costs)
    if not 1 <= stages <= n:
        raise PlanError(f"--pp: {stages} stages for {n} layers (a stage needs at least one layer)")
    run = [[0.0] * (n + 1) for _ in range(n + 1)]
    for i in range(n):
        for j in range(i + 1, n + 1):
            run[i][j] = math.fsum(costs[i:j])

    def better(x, y) -> bool:  # (max, sum of squares): is x better than y, beyond rounding
        if x[0] < y[0] * (1 - 1e-9):
            return True
        return abs(x[0] - y[0]) <= 1e-9 * max(abs(y[0]), 1e-300) and x[1] < y[1] * (1 - 1e-9)

    # best[s][e]: the best cut of layers [0, e) into s + 1 stages, and where its last stage starts
    best = [[None] * (n + 1) for _ in range(stages)]
    for e in range(1, n + 1):
        best[0][e] = ((run[0][e], run[0][e] ** 2), 0)
    for k in range(1, stages):
        for e in range(k + 1, n + 1):
            for start in range(k, e):  # ascending: among equals the last stage keeps the most layers
                (mx, sq), _ = best[k - 1][start]
                cand = (max(mx, run[start][e]), sq + run[start][e] ** 2)
                if best[k][e] is None or better(cand, best[k][e][0]):
                    best[k][e] = (cand, start)
    counts, e = [], n
    for k in range(stages - 1, -1, -1):
        start = best[k][e][1]
        counts.append(e - start)
        e = start
    return counts[::-1]


def parse_pp_layers(value, stages: int, num_layers: int) -> list[int] | None:
    """--pp-layers: the layers of each stage, "15,15,15,16" or a sequence (SGLang's
    SGLANG_PP_LAYER_PARTITION); None when not given."""
    if value is None:
        return None
    try:
        counts = [int(x) for x in (value.split(",") if isinstance(value, str) else value)]
    except (TypeError, ValueError):
        raise PlanError(f"--pp-layers: must be comma-separated layer counts, one per stage, got {value!r}") from None
    if len(counts) != stages or any(c < 1 for c in counts) or sum(counts) != num_layers:
        raise PlanError(f"--pp-layers: needs {stages} counts of at least 1 (one per --pp stage) summing to the "
                        f"model's {num_layers} layers, got {','.join(map(str, counts))}")
    return counts


def stage_ranges(counts: list[int]) -> list[range]:
    """Each stage's layers from the layers per stage."""
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def kv_budget_blocks(budget: int, block_size: int, chunk: int) -> int:
    """The most full-attention blocks a sequence holds under a KV retention budget of `budget`
    tokens (engine/core/retention.py): between steps at most `budget` tokens, kept in whole blocks
    (the evicted blocks are whole, so the kept ones fill ceil(budget / block_size) blocks at most),
    and during a step the tokens of one chunk of at most `chunk` tokens on top, evicted once the
    step's blocks are committed: ceil((budget + chunk) / block_size) (a decode step's one token:
    ceil(budget / block_size) blocks plus the one being written)."""
    return _cdiv(budget + chunk, block_size)


def kv_budget_tokens(kv_budget: int, kv_budget_fraction: float, context: int) -> int | None:
    """The tokens a sequence of `context` tokens keeps under a budget of kv_budget tokens (0: no
    cap in tokens) and kv_budget_fraction of its context (1: none), as the engine's retention
    reckons it (any policy but full); None when neither caps it."""
    if not kv_budget and kv_budget_fraction >= 1:
        return None
    return budget_tokens(SchedulerKnobs(kv_retention="streaming", kv_budget=kv_budget,
                                        kv_budget_fraction=kv_budget_fraction), context)


def plan_model_of(cfg: ModelConfig, name: str, notes: list[str]) -> PlanModel:
    return PlanModel(
        name=name, hf_architecture=cfg.hf_architecture, family=cfg.architecture, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings, num_experts=cfg.num_experts, top_k=cfg.top_k,
        expert_intermediate_size=cfg.expert_intermediate_size, sparse_layers=tuple(cfg.sparse_layers),
        dense_intermediate_size=cfg.dense_intermediate_size,
        shared_intermediate_size=cfg.shared_expert_intermediate_size,
        shared_gate=bool(cfg.shared_expert_intermediate_size) and cfg.shared_expert_gated,
        router_bias=cfg.router == "grouped_sigmoid" or cfg.router_bias, expert_bias=cfg.expert_bias,
        attention_sinks=cfg.attention_sinks, tie_word_embeddings=cfg.tie_word_embeddings,
        attention=cfg.attention, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        attention_bias=cfg.attention_bias, o_proj_bias=cfg.o_proj_bias, qk_norm=cfg.qk_norm,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, layer_windows=tuple(cfg.layer_windows),
        quantization=cfg.quantization, notes=notes)


# keys the runtime refuses but that do not change any tensor's size
_RUNTIME_ONLY = ("rope_scaling", "rope_parameters", "hidden_act", "use_sliding_window", "sliding_window")


def _parse_runnable(raw: dict, name: str) -> PlanModel:
    notes: list[str] = []
    try:
        cfg = ModelConfig.from_hf(raw, dtype="float32", sizes_only=True)
    except ConfigError as exc:
        field_name = str(exc).split(":", 1)[0].split(".", 1)[0]
        if field_name not in _RUNTIME_ONLY:
            raise
        stripped = {k: v for k, v in raw.items() if k not in _RUNTIME_ONLY}
        if field_name == "rope_parameters" and "rope_theta" in (raw.get("rope_parameters") or {}):
            stripped["rope_theta"] = raw["rope_parameters"]["rope_theta"]
        cfg = ModelConfig.from_hf(stripped, dtype="float32", sizes_only=True)
        used = ", ".join(k for k in _RUNTIME_ONLY if raw.get(k))
        notes.append(f"config uses {used}, which the engine cannot run; sizes do not depend on it, "
                     "so it is planned as if absent")
    if raw.get("num_nextn_predict_layers"):
        notes.append(f"num_nextn_predict_layers={raw['num_nextn_predict_layers']}: the multi-token-prediction "
                     "module is not counted (inference without speculative MTP does not load it)")
    return plan_model_of(cfg, name, notes)


def _parse_mla(raw: dict, arch: str, name: str) -> PlanModel:
    def need(key: str, positive: bool = True) -> int:
        value = raw.get(key)
        if value is None:
            raise ConfigError(f"{key}: missing from config.json")
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
            raise ConfigError(f"{key}: must be a {'positive' if positive else 'non-negative'} integer, got {value!r}")
        return value

    family = MLA_ARCHITECTURES[arch]
    notes: list[str] = []
    check_sizes(raw)
    layers = need("num_hidden_layers")
    experts = need("n_routed_experts")
    top_k = need("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok: {top_k} exceeds the {experts} routed experts")
    first_dense = need("first_k_dense_replace", positive=False) if "first_k_dense_replace" in raw else 0
    freq = need("moe_layer_freq") if "moe_layer_freq" in raw else 1
    sparse = tuple(i >= first_dense and i % freq == 0 for i in range(layers))
    dense_size = need("intermediate_size") if not all(sparse) else int(raw.get("intermediate_size") or 0)
    n_shared = need("n_shared_experts", positive=False) if raw.get("n_shared_experts") is not None else 0
    expert_size = need("moe_intermediate_size")
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None:
        q_lora = need("q_lora_rank")
    topk_method = raw.get("topk_method", "greedy")  # DeepSeek-V2's default
    if raw.get("num_nextn_predict_layers"):
        notes.append(f"num_nextn_predict_layers={raw['num_nextn_predict_layers']}: the multi-token-prediction "
                     "module is not counted (inference without speculative MTP does not load it)")
    if raw.get("rope_scaling"):
        kind = raw["rope_scaling"].get("type", raw["rope_scaling"].get("rope_type"))
        notes.append(f"rope_scaling ({kind}) changes no tensor size; ignored")
    return PlanModel(
        name=name, hf_architecture=arch, family=family, vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"), num_layers=layers, num_heads=need("num_attention_heads"),
        max_position_embeddings=need("max_position_embeddings"), num_experts=experts, top_k=top_k,
        expert_intermediate_size=expert_size, sparse_layers=sparse, dense_intermediate_size=dense_size,
        shared_intermediate_size=n_shared * expert_size, router_bias=topk_method == "noaux_tc",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), attention="mla",
        attention_bias=bool(raw.get("attention_bias", False)), q_lora_rank=q_lora or 0,
        kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
        quantization=parse_quantization(raw), notes=notes)


def load_plan_model(config: str | Path | dict) -> PlanModel:
    """A config.json (file, directory holding one, or its parsed dict) -> PlanModel.

    ConfigError (a ValueError) names the offending field; an unknown architecture names
    `architectures`."""
    if isinstance(config, dict):
        raw, name = config, str(config.get("_name_or_path") or "")
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        raw = read_config_json(path)
        name = path.parent.name if path.name == "config.json" else path.stem
    if not isinstance(raw, dict):
        raise ConfigError("config.json: top level must be an object")
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None:
        model_type = raw.get("model_type", "")
        runnable = MODEL_TYPES.get(MODEL_TYPE_ALIASES.get(model_type, model_type))
        arch = runnable or MLA_MODEL_TYPES.get(model_type)
    if arch in ARCHITECTURES:
        model = _parse_runnable(raw, name)
    elif arch in MLA_ARCHITECTURES:
        model = _parse_mla(raw, arch, name)
    else:
        raise ConfigError(f"architectures: {arch or raw.get('model_type')!r} cannot be planned "
                          f"(plannable: {', '.join(PLANNABLE)})")
    if not model.name:
        model.name = model.family
    return model


# ---------------------------------------------------------------------------------------------
# the plan


@dataclass
class DevicePlan:
    device: int
    node: int
    tp_rank: int
    dp_group: int
    ep_rank: int
    experts_local: int  # routed experts held per MoE layer
    sequences: int  # sequences whose KV cache lives here
    kv_blocks: int
    weights: dict[str, int]  # bytes by category
    kv_cache: int
    activations: int
    comm_buffers: int
    hbm_bytes: int
    activation_detail: dict[str, int] = field(default_factory=dict)
    comm_detail: dict[str, int] = field(default_factory=dict)
    stage: int = 0  # its pipeline stage (0 without one)

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def total(self) -> int:
        return self.weights_total + self.kv_cache + self.activations + self.comm_buffers

    @property
    def headroom(self) -> int:
        return self.hbm_bytes - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def categories(self) -> dict[str, int]:
        return {**self.weights, "kv_cache": self.kv_cache, "activations": self.activations,
                "comm_buffers": self.comm_buffers}

    def signature(self) -> tuple:
        return (self.stage, self.experts_local, self.sequences, self.kv_blocks, tuple(self.categories().items()))


def _count(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3f}{unit}"
    return str(n)


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, d in enumerate(ids):
        if start is None:
            start = d
        if i + 1 == len(ids) or ids[i + 1] != d + 1:
            out.append(str(start) if start == d else f"{start}-{d}")
            start = None
    return ",".join(out)


@dataclass
class MemoryPlan:
    model: PlanModel
    topology: Topology
    tp: int
    dp: int
    ep: int
    context: int
    batch: int
    dtype: str
    kv_dtype: str
    block_size: int
    tokens_per_step: int
    attn_impl: str
    devices: list[DevicePlan]
    notes: list[str]
    weights: WeightFormat = PARAMS  # how `dtype` stores them
    # KV retention (plan_memory's kv_budget, kv_budget_fraction): the tokens a sequence keeps of its
    # context in the full-attention layers (None: no budget, all of them), and one sequence's KV
    # blocks (full-attention pool) and bytes with the budget and under full retention
    kv_budget: int = 0
    kv_budget_fraction: float = 1.0
    kv_held_tokens: int | None = None
    kv_blocks_per_sequence: int = 0
    kv_bytes_per_sequence: int = 0
    kv_full_blocks_per_sequence: int = 0
    kv_full_bytes_per_sequence: int = 0
    # pipeline parallel: stages, micro-batches, each stage's (first, last) layer, how they were cut
    # ("balanced" by layer MACs or "given"), and each stage's one sequence's KV bytes (with the
    # budget, under full retention); a sequence's figures above are all its layers'
    pp: int = 1
    micro_batches: int = 1
    stage_layers: list[tuple[int, int]] = field(default_factory=list)
    layer_split: str = "balanced"
    stage_kv_bytes_per_sequence: list[tuple[int, int]] = field(default_factory=list)

    # -- KV retention
    @property
    def kv_budgeted(self) -> bool:
        return self.kv_held_tokens is not None

    @property
    def kv_saved_per_sequence(self) -> int:
        """Bytes one sequence's KV budget saves against full retention (0 without a budget)."""
        return self.kv_full_bytes_per_sequence - self.kv_bytes_per_sequence

    def kv_full(self, d: DevicePlan) -> int:
        """Device d's KV cache under full retention."""
        if self.pp > 1:
            return d.sequences * self.stage_kv_bytes_per_sequence[d.stage][1]
        return d.sequences * self.kv_full_bytes_per_sequence

    def kv_saved(self, d: DevicePlan) -> int:
        """Bytes of device d's KV cache the budget saves against full retention."""
        return self.kv_full(d) - d.kv_cache

    def held_layers(self, d: DevicePlan) -> tuple[int, int, int]:
        """(layers, MoE layers, dense layers) device d holds: its stage's, or all of them."""
        if self.pp == 1:
            return self.model.num_layers, self.model.num_sparse, self.model.num_dense
        first, last = self.stage_layers[d.stage]
        moe = sum(self.model.sparse_layers[first:last + 1])
        return last - first + 1, moe, last - first + 1 - moe

    def kv_retention(self) -> dict | None:
        """The budget and what it saves (None without one): per sequence, and on the device that
        holds the most sequences (the others hold fewer, or none)."""
        if not self.kv_budgeted:
            return None
        most = max(self.devices, key=lambda d: (d.sequences, -d.device))
        return {"budget": format_kv_budget(self.kv_budget, self.kv_budget_fraction),
                "budget_tokens": self.kv_budget, "budget_fraction": self.kv_budget_fraction,
                "held_tokens_per_sequence": self.kv_held_tokens, "context_tokens_per_sequence": self.context,
                "blocks_per_sequence": self.kv_blocks_per_sequence,
                "full_blocks_per_sequence": self.kv_full_blocks_per_sequence,
                "bytes_per_sequence": self.kv_bytes_per_sequence,
                "full_bytes_per_sequence": self.kv_full_bytes_per_sequence,
                "saved_bytes_per_sequence": self.kv_saved_per_sequence,
                "device": most.device, "sequences_on_device": most.sequences, "kv_cache_bytes_per_device": most.kv_cache,
                "full_kv_cache_bytes_per_device": self.kv_full(most), "saved_bytes_per_device": self.kv_saved(most)}

    @property
    def stage_devices(self) -> int:
        """Devices of one pipeline stage (all of them without a pipeline)."""
        return self.topology.num_devices // self.pp

    def _pipeline_line(self) -> str:
        spans = " | ".join(f"{a}-{b}" for a, b in self.stage_layers)
        t_mb = _cdiv(self.tokens_per_step, self.micro_batches)
        return (f"pipeline: layers {spans} ({self.layer_split}{' by MACs per token' if self.layer_split == 'balanced' else ''}); "
                f"{self.micro_batches} micro-batches of {t_mb} tokens, up to {self.micro_batches} in flight at a stage "
                f"(activations: pp_in_flight)")

    def pipeline(self) -> dict | None:
        """The pipeline's layout (None without one)."""
        if self.pp == 1:
            return None
        return {"pp": self.pp, "micro_batches": self.micro_batches, "devices_per_stage": self.stage_devices,
                "stage_layers": [list(r) for r in self.stage_layers], "layer_split": self.layer_split,
                "micro_batch_tokens": _cdiv(self.tokens_per_step, self.micro_batches)}

    def _kv_budget_line(self) -> str:
        r = self.kv_retention()
        return (f"KV budget {r['budget']}: keeps {r['held_tokens_per_sequence']:,} of {self.context:,} tokens per "
                f"sequence in the full-attention layers ({r['blocks_per_sequence']:,} "
                f"blocks, not {r['full_blocks_per_sequence']:,}): saves {format_size(r['saved_bytes_per_sequence'])} "
                f"per sequence, {format_size(r['saved_bytes_per_device'])} per device (KV cache "
                f"{format_size(r['kv_cache_bytes_per_device'])}, not {format_size(r['full_kv_cache_bytes_per_device'])}"
                f", on device {r['device']}: {r['sequences_on_device']} seq)")

    # -- summary
    @property
    def params(self) -> dict[str, int]:
        return self.model.param_counts()

    @property
    def worst(self) -> DevicePlan:
        return min(self.devices, key=lambda d: (d.headroom, d.device))

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def headroom_bytes(self) -> int:
        return self.worst.headroom

    @property
    def short_by_bytes(self) -> int:
        return max(0, -self.worst.headroom)

    def groups(self) -> list[tuple[str, DevicePlan, list[int]]]:
        """Devices with identical accounting collapsed: (label, representative, device ids)."""
        by_sig: dict[tuple, list[DevicePlan]] = {}
        for d in self.devices:
            by_sig.setdefault(d.signature(), []).append(d)
        out = []
        for members in sorted(by_sig.values(), key=lambda m: m[0].device):
            ids = [d.device for d in members]
            label = f"device {ids[0]}" if len(ids) == 1 else f"devices {_ranges(ids)}"
            if self.pp > 1:
                label = f"stage {members[0].stage}: {label}"
            out.append((label, members[0], ids))
        return out

    def _details(self, d: DevicePlan) -> dict[str, str]:
        m, tp = self.model, self.tp
        layers, sparse, dense = self.held_layers(d)
        attn = (f"MLA, {m.num_heads // tp}/{m.num_heads} heads (TP {tp}) x {layers} layers"
                if m.attention == "mla" else
                f"{m.num_heads // tp}/{m.num_heads} q heads, {m.kv_heads_per_device(tp)}/{m.num_kv_heads} kv heads "
                f"x {layers} layers")
        if self.pp > 1:
            first, last = self.stage_layers[d.stage]
            held = [name for name, yes in (("embed", first == 0), ("lm_head", last == m.num_layers - 1)) if yes]
            embeddings = (f"vocab rows {_shard(m.vocab_size, tp, d.tp_rank)}/{m.vocab_size} (vocab-parallel), "
                          + (" + ".join(held) if held else "none (a middle stage)"))
        else:
            embeddings = (f"vocab rows {_shard(m.vocab_size, tp, d.tp_rank)}/{m.vocab_size} (vocab-parallel), "
                          + ("tied" if m.tie_word_embeddings else "embed + lm_head"))
        det = {
            "attention": attn + (f" (stage {d.stage}: layers {self.stage_layers[d.stage][0]}-"
                                 f"{self.stage_layers[d.stage][1]})" if self.pp > 1 else ""),
            "experts": f"{d.experts_local}/{m.num_experts} experts x {sparse} MoE layers",
            "shared_experts": (f"intermediate {_shard(m.shared_intermediate_size, tp, d.tp_rank)}/"
                               f"{m.shared_intermediate_size} (TP) x {sparse} layers"
                               if m.shared_intermediate_size and sparse else "none"),
            "dense_mlp": (f"intermediate {_shard(m.dense_intermediate_size, tp, d.tp_rank)}/{m.dense_intermediate_size}"
                          f" (TP) x {dense} layers" if dense else "none"),
            "embeddings": embeddings,
            "norms_routers": f"replicated; routers {m.num_experts} x {m.hidden_size} x {sparse} layers",
            "kv_cache": (f"{d.sequences} seq x {self.kv_blocks_per_sequence or _cdiv(self.context, self.block_size)} "
                         f"blocks of {self.block_size} = {d.kv_blocks} blocks, {self.kv_dtype}"
                         + (f"; budget {self.kv_held_tokens:,} tokens/seq, saves {format_size(self.kv_saved(d))} "
                            f"against full ({format_size(self.kv_full(d))})" if self.kv_budgeted else "")),
            "activations": ", ".join(f"{k} {format_size(v)}" for k, v in d.activation_detail.items() if v),
            "comm_buffers": ", ".join(f"{k} {format_size(v)}" for k, v in d.comm_detail.items() if v) or "none",
        }
        return det

    def rows(self) -> list[dict]:
        """One row per (device group, category), then its total, HBM and headroom rows."""
        out = []
        for label, d, ids in self.groups():
            det = self._details(d)
            for cat, n in d.categories().items():
                out.append({"devices": label, "device_ids": ids, "category": cat, "label": CATEGORY_LABELS[cat],
                            "bytes": n, "size": format_size(n), "detail": det[cat]})
            for cat, n, text in (("total", d.total, ""), ("hbm", d.hbm_bytes, ""),
                                 ("headroom", d.headroom, "fits" if d.fits else f"short by {format_size(-d.headroom)}")):
                out.append({"devices": label, "device_ids": ids, "category": cat, "label": cat, "bytes": n,
                            "size": format_size(n), "detail": text})
        return out

    def format_table(self) -> str:
        """The table as text: one column per group of identical devices."""
        groups = self.groups()
        cats = list(CATEGORIES) + ["kv_cache", "activations", "comm_buffers"]
        header = ["category"] + [label for label, _, _ in groups]
        body = []
        for cat in cats:
            body.append([CATEGORY_LABELS[cat]] + [format_size(d.categories()[cat]) for _, d, _ in groups])
        body.append(["total"] + [format_size(d.total) for _, d, _ in groups])
        body.append(["HBM"] + [format_size(d.hbm_bytes) for _, d, _ in groups])
        body.append(["headroom"] + [format_size(d.headroom) for _, d, _ in groups])
        widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]

        def line(r):
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

        m, p = self.model, self.params
        kvd = self.kv_dtype if self.kv_dtype == "int8" else f"auto ({_kv_torch_dtype(self.dtype)})".replace("torch.", "")
        lines = [
            f"model: {m.name} ({m.hf_architecture}, {m.attention.upper()}): {p['params_total']:,} params "
            f"({_count(p['params_total'])}), {p['params_active']:,} ({_count(p['params_active'])}) active per token",
            f"deployment: {self.topology.num_devices} devices x {format_size(self.topology.hbm_bytes)} HBM "
            f"({self.topology.num_nodes} node{'s' if self.topology.num_nodes > 1 else ''}); "
            + (f"pipeline PP {self.pp} x ({self.stage_devices} devices a stage: " if self.pp > 1 else "")
            + f"attention TP {self.tp} x DP {self.dp}, experts EP {self.ep}"
            + (f" ({self.stage_devices // self.ep} replicas)" if self.ep < self.stage_devices else "")
            + (")" if self.pp > 1 else ""),
            f"load: {self.batch} seq x {self.context:,} tokens; weights {self.dtype}, KV {kvd}, block {self.block_size}, "
            f"{self.tokens_per_step} tokens/step per DP group, attention {self.attn_impl}",
        ] + ([self._pipeline_line()] if self.pp > 1 else []) + (
            [self._kv_budget_line()] if self.kv_budgeted else []) + [
            "",
            line(header),
            line(["-" * w for w in widths]),
        ] + [line(r) for r in body] + [""]
        if self.fits:
            lines.append(f"fits: yes, {format_size(self.headroom_bytes)} headroom on the fullest device "
                         f"({self.worst.device})")
        else:
            bad = [d.device for d in self.devices if not d.fits]
            lines.append(f"fits: NO, short by {format_size(self.short_by_bytes)} ({self.short_by_bytes:,} bytes) on "
                         f"device{'s' if len(bad) > 1 else ''} {_ranges(bad)}")
        lines.append("notes:")
        lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        worst = self.worst
        groups = []
        for label, d, ids in self.groups():
            det = self._details(d)
            groups.append({
                "devices": ids, "label": label, "stage": d.stage, "tp_rank": d.tp_rank, "dp_group": d.dp_group,
                "ep_rank": d.ep_rank,
                "experts_local": d.experts_local, "sequences": d.sequences, "kv_blocks": d.kv_blocks,
                "bytes": d.categories(), "detail": det, "activation_detail": d.activation_detail,
                "comm_detail": d.comm_detail, "weights_bytes": d.weights_total, "total_bytes": d.total,
                "headroom_bytes": d.headroom, "fits": d.fits,
                **({"kv_full_bytes": self.kv_full(d), "kv_saved_bytes": self.kv_saved(d)} if self.kv_budgeted else {}),
            })
        return {
            "fits": self.fits,
            "short_by_bytes": self.short_by_bytes,
            "headroom_bytes": self.headroom_bytes,
            "worst_device": worst.device,
            "bytes": worst.categories(),  # per category on the fullest device
            "weights_bytes": worst.weights_total,
            "total_bytes": worst.total,
            "hbm_bytes": self.topology.hbm_bytes,
            "cluster_total_bytes": sum(d.total for d in self.devices),
            **self.params,
            "model": {"name": self.model.name, "architecture": self.model.hf_architecture,
                      "attention": self.model.attention, "layers": self.model.num_layers,
                      "moe_layers": self.model.num_sparse, "experts": self.model.num_experts,
                      "top_k": self.model.top_k, "max_position_embeddings": self.model.max_position_embeddings},
            "deployment": {"devices": self.topology.num_devices, "devices_per_node": self.topology.devices_per_node,
                           "tp": self.tp, "dp": self.dp, "ep": self.ep, "context": self.context, "batch": self.batch,
                           "dtype": self.dtype, "kv_dtype": self.kv_dtype, "block_size": self.block_size,
                           "tokens_per_step": self.tokens_per_step, "attn_impl": self.attn_impl},
            "kv_retention": self.kv_retention(),
            "pipeline": self.pipeline(),
            "device_groups": groups,
            "notes": list(self.notes),
        }


def _kv_torch_dtype(dtype: str) -> torch.dtype:
    return WEIGHT_DTYPES[dtype][1]


def _positive_int(option: str, value, lo: int = 1, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        want = f"an integer in [{lo}, {hi}]" if hi is not None else "a positive integer"
        raise PlanError(f"{option}: must be {want}, got {value!r}")
    return value


def _validate(m: PlanModel, topo: Topology, tp, ep, context, batch, kv_dtype, mbt, block_size, attn_impl,
              ep_capacity, pp: int = 1) -> None:
    if not isinstance(topo, Topology):
        raise PlanError(f"--devices: topology must be a Topology, got {type(topo).__name__}")
    n = topo.num_devices // pp
    _positive_int("--tp", tp, 1, MAX_TP)
    if n % tp:
        raise PlanError(f"--tp: {tp} does not divide --devices {n} (attention runs TP x DP = devices)" if pp == 1 else
                        f"--tp: {tp} does not divide the {n} devices of a pipeline stage (--devices / --pp)")
    if m.num_heads % tp:
        raise PlanError(f"--tp: {tp} does not divide the model's {m.num_heads} attention heads")
    if m.attention == "gqa" and m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise PlanError(f"--tp: {tp} and the model's {m.num_kv_heads} KV heads must divide one another")
    _positive_int("--ep", ep)
    if n % ep:
        raise PlanError(f"--ep: {ep} does not divide --devices {n}" if pp == 1 else
                        f"--ep: {ep} does not divide the {n} devices of a pipeline stage (--devices / --pp)")
    if ep > m.num_experts:
        raise PlanError(f"--ep: {ep} exceeds the model's {m.num_experts} routed experts")
    _positive_int("--context", context)
    if context > m.max_position_embeddings:
        raise PlanError(f"--context: {context} exceeds the model's max_position_embeddings "
                        f"{m.max_position_embeddings}")
    _positive_int("--batch", batch)
    if kv_dtype not in KV_DTYPES:
        raise PlanError(f"--kv-dtype: must be auto or int8, got {kv_dtype!r}")
    if mbt is not None:
        _positive_int("--max-batched-tokens", mbt, 1, 1 << 24)
    _positive_int("--block-size", block_size, 1, 1024)
    if attn_impl not in ATTN_IMPLS:
        raise PlanError(f"--attn-impl: must be flash or eager, got {attn_impl!r}")
    if isinstance(ep_capacity, bool) or not isinstance(ep_capacity, (int, float)) or not 1 <= ep_capacity <= 64:
        raise PlanError(f"--ep-capacity: must be a number in [1, 64], got {ep_capacity!r}")


def _attention_activations(m: PlanModel, tp: int, t: int, context: int, block_size: int, seqs: int,
                           a: int, attn_impl: str) -> dict[str, int]:
    """Live tensors of the attention operator for t tokens on one device (see plan_memory's docstring)."""
    hd = m.num_heads // tp
    lpad = _cdiv(context, block_size) * block_size
    chunk, n_dec = min(t, context), min(t, seqs)
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        proj = t * ((m.q_lora_rank or 0) + hd * qk + m.kv_latent_dim + hd * m.kv_latent_dim + hd * m.v_head_dim) * a
        kernel = t * hd * (m.kv_lora_rank * 4 + 8)  # fp32 latent accumulator + softmax max/sum
        if attn_impl == "eager":
            kernel += max(hd * chunk * context * 4 + lpad * m.kv_latent_dim * a,
                          n_dec * (hd * lpad * 4 + lpad * m.kv_latent_dim * a))
        return {"attention_proj": proj, "attention_kernel": kernel}
    q, kv = hd * m.head_dim, m.kv_heads_per_device(tp) * m.head_dim
    proj = t * (q + 2 * kv) * a + t * q * a
    if attn_impl == "flash":
        kernel = t * q * 4 + t * hd * 8
    else:  # the local backend: gather (+ cat) of the cached K/V, fp32 scores, bool mask
        prefill = 2 * 2 * lpad * kv * a + hd * chunk * context * 4 + chunk * context
        decode = n_dec * (2 * lpad * kv * a + hd * lpad * 4 + lpad)
        kernel = max(prefill, decode)
    return {"attention_proj": proj, "attention_kernel": kernel}


def step_activations(m: PlanModel, *, tp: int, tokens: int, recv_rows: int, context: int, seqs: int,
                     block_size: int, act_bytes: int, attn_impl: str, layers: range | None = None,
                     logits: bool = True) -> tuple[dict[str, int], str]:
    """Live activation bytes at the peak operator of one step on one device: `tokens` tokens of
    its own sequences (`seqs` of them, the longest `context` tokens) and `recv_rows` expert rows it
    computes. Returns (bytes by tensor group, the peak stage). The planner sizes a worst step with
    it; the local backend's ledger applies it to each real step's shapes. A pipeline stage:
    `layers`, its layers (an MoE or dense operator only where it holds one), `logits` whether it
    holds the LM head."""
    t, a, h, k = tokens, act_bytes, m.hidden_size, m.top_k
    if t == 0 and recv_rows == 0:
        return {}, "idle"
    t_moe = _cdiv(t, tp)
    act = {"residual": 2 * t * h * a}
    stages = {"attention": _attention_activations(m, tp, t, max(context, 1), block_size, seqs, a, attn_impl)}
    moe = {"router": t_moe * m.num_experts * (a + 4) + t_moe * k * 12,
           "moe_dispatch": t_moe * k * h * a + t_moe * k * h * a + t_moe * h * a,
           "expert_ffn": recv_rows * (3 * m.expert_intermediate_size + h) * a}
    if m.shared_intermediate_size:
        moe["shared_expert"] = t * (3 * _cdiv(m.shared_intermediate_size, tp) + h) * a
    held = range(m.num_layers) if layers is None else layers
    sparse = sum(m.sparse_layers[i] for i in held)
    if sparse:
        stages["moe"] = moe
    if len(held) > sparse:
        stages["dense_mlp"] = {"dense_mlp": t * (3 * _cdiv(m.dense_intermediate_size, tp) + h) * a}
    rows = min(t, seqs)
    if logits:
        stages["logits"] = {"logits": rows * _cdiv(m.vocab_size, tp) * a + rows * m.vocab_size * 4}
    peak_stage = max(stages, key=lambda s: sum(stages[s].values()))
    act.update(stages[peak_stage])
    return act, peak_stage


def comm_buffers(m: PlanModel, *, tp: int, ep: int, tokens: int, recv_rows: int, act_bytes: int) -> dict[str, int]:
    """Receive buffers of one step's collectives on one device: the EP all-to-all (rows it
    receives to compute, and its tokens' expert outputs coming back) and the TP all-reduce."""
    comm = {}
    h, a = m.hidden_size, act_bytes
    if ep > 1:
        comm["ep_dispatch"] = recv_rows * h * a
        comm["ep_combine"] = _cdiv(tokens, tp) * m.top_k * h * a
    if tp > 1:
        comm["tp_all_reduce"] = tokens * h * a
    return comm


def plan_memory(config: str | Path | dict | PlanModel, topology: Topology, *, tp: int = 1, ep: int | None = None,
                context: int, batch: int = 1, dtype: str | None = None, kv_dtype: str = "auto",
                max_batched_tokens: int | None = None, block_size: int = 16, attn_impl: str = "flash",
                ep_capacity: float = 1.0, kv_budget: int = 0, kv_budget_fraction: float = 1.0, pp: int = 1,
                micro_batches: int | None = None, pp_layers=None) -> MemoryPlan:
    """Per-device memory for `config` (config.json path/dir/dict) deployed on `topology`.

    Pipeline parallel (pp > 1): the devices are `pp` stages of devices / pp consecutive devices,
    stage s holding a contiguous run of layers (`pp_layers`, else `split_layers` on
    PlanModel.layer_macs: balanced by multiply-accumulates per token), and everything below is
    per stage: the layout within a stage is the one described next, over its devices; a device
    holds its stage's layers' weights (`PlanModel.stage_weight_bytes`: the embedding on the first
    stage, the LM head on the last) and their KV; a step's T tokens flow as `micro_batches`
    (default pp) micro-batches of ceil(T / micro_batches), each operator sized for one of them;
    and a stage holds up to micro_batches micro-batches' hidden states and residual in flight
    ("pp_in_flight", 2 * ceil(T / micro_batches) * H * a each: received and waiting, or sent
    asynchronously and not yet delivered; what vLLM's and SGLang's stages pass on).

    Layout: devices = tp x dp. Device d is TP rank d % tp of DP group d // tp; attention, dense
    MLPs, shared experts and the vocab-parallel embeddings / LM head are split over the TP ranks.
    Routed experts: EP rank d % ep holds a contiguous slice of E // ep experts (the first E % ep
    ranks one more) in every MoE layer; ep=None means ep = devices. The `batch` sequences are
    dealt to the DP groups (group g holds batch // dp, the first batch % dp one more), and each of
    a group's devices holds their KV cache: GQA split by KV heads where kv_heads >= tp (else one
    head per device, replicated), MLA's latent replicated on every TP rank.

    Activations (bytes, a = activation element size, T = tokens per step per DP group
    = min(max_batched_tokens, tokens of the fullest group), T_moe = ceil(T / tp)):
      residual stream + normed input 2*T*H*a, plus the largest of the operators:
      attention: projections (GQA: T*(q+2kv)/tp*a + output T*q/tp*a; MLA: q_lora, q, latent,
        absorbed q, v-up activations) and the kernel workspace (flash: fp32 accumulator and
        softmax stats; eager, the local backend's path: gathered K/V, fp32 scores of the chunk
        against the whole context, mask);
      MoE: router logits + fp32 probs T_moe*E*(a+4), top-k ids/weights T_moe*k*12, the dispatch
        copy (top_k copies) T_moe*k*H*a, received rows R = T_moe*k*ep_capacity: their
        intermediates R*3I*a and outputs R*H*a, the combine copy T_moe*k*H*a and output
        T_moe*H*a, plus the shared expert T*(3*I_shared/tp + H)*a;
      dense MLP layer: T*(3*I_dense/tp + H)*a;
      logits: sampled rows r = min(T, sequences of the group): r*V/tp*a local + r*V*4 gathered fp32.
    Communication buffers: EP all-to-all (ep > 1): dispatch R*H*a + combine T_moe*k*H*a
    receive buffers; TP all-reduce (tp > 1): T*H*a.

    KV retention: kv_budget tokens (0: no cap in tokens) and kv_budget_fraction of the context (1:
    none; `--kv-budget N|P%`, wire/kv_budget.py) cap what each sequence keeps of the full-attention
    layers, whatever the policy (streaming, snapkv, h2o): kv_budget_blocks per sequence, at most
    the context's; sliding-window layers as without a budget.
    """
    m = config if isinstance(config, PlanModel) else load_plan_model(config)
    n_all = topology.num_devices if isinstance(topology, Topology) else 0
    _positive_int("--pp", pp, 1, MAX_PP)
    if pp > m.num_layers:
        raise PlanError(f"--pp: {pp} stages exceed the model's {m.num_layers} layers (a stage holds at least one)")
    if n_all % pp:
        raise PlanError(f"--pp: {pp} does not divide --devices {n_all} (every stage has the same devices)")
    if micro_batches is not None and pp == 1 and micro_batches != 1:
        raise PlanError("--micro-batches: goes with --pp > 1 (micro-batches flow through pipeline stages)")
    if pp_layers is not None and pp == 1:
        raise PlanError("--pp-layers: goes with --pp > 1")
    mb = _positive_int("--micro-batches", pp if micro_batches is None else micro_batches, 1, MAX_MICRO_BATCHES)
    counts = parse_pp_layers(pp_layers, pp, m.num_layers) or split_layers(m.layer_macs(), pp)
    ranges = stage_ranges(counts)
    n = n_all // pp  # devices of a stage: TP x DP and EP within it
    ep = n if ep is None and n else ep
    weights = weight_format(dtype, m)
    dtype = weights.name
    _validate(m, topology, tp, ep, context, batch, kv_dtype, max_batched_tokens, block_size, attn_impl, ep_capacity,
              pp)
    _positive_int("--kv-budget", kv_budget, 0, 1 << 40)
    f = kv_budget_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise PlanError(f"--kv-budget: a fraction of the context must be in (0, 1], got {f!r}")
    budget = kv_budget_tokens(kv_budget, kv_budget_fraction, context)
    dp = n // tp
    act_dtype = WEIGHT_DTYPES[dtype][1]
    a = torch.empty((), dtype=act_dtype).element_size()
    quantized = kv_dtype == "int8"
    mbt = max_batched_tokens or SchedulerKnobs().max_num_batched_tokens
    seqs_max = _cdiv(batch, dp)
    t = min(mbt, seqs_max * context)
    t_mb = _cdiv(t, mb)  # one micro-batch's tokens (all of them without a pipeline)
    recv = int(-(-_cdiv(t_mb, tp) * m.top_k * ep_capacity // 1))
    comm = comm_buffers(m, tp=tp, ep=ep, tokens=t_mb, recv_rows=recv, act_bytes=a)

    kv_dtype_t = act_dtype  # auto KV: the activation dtype (bf16 under fp8 weights)
    per_seq, blocks_per_seq = m.kv_bytes_per_sequence(tp, block_size, kv_dtype_t, quantized, context, mbt, budget)
    full_per_seq, full_blocks = (m.kv_bytes_per_sequence(tp, block_size, kv_dtype_t, quantized, context, mbt)
                                 if budget is not None else (per_seq, blocks_per_seq))
    stages, peaks = [], []
    for s_, layers in enumerate(ranges):
        # per-device activations and buffers are the same on every device of a stage (sized for the
        # fullest DP group)
        act, peak_stage = step_activations(m, tp=tp, tokens=t_mb, recv_rows=recv, context=context, seqs=seqs_max,
                                           block_size=block_size, act_bytes=a, attn_impl=attn_impl,
                                           layers=layers, logits=s_ == pp - 1)
        if pp > 1:
            act["pp_in_flight"] = mb * 2 * t_mb * m.hidden_size * a
        kv = (m.kv_bytes_per_sequence(tp, block_size, kv_dtype_t, quantized, context, mbt, budget, layers)[0],
              m.kv_bytes_per_sequence(tp, block_size, kv_dtype_t, quantized, context, mbt, None, layers)[0])
        stages.append((act, kv))
        peaks.append(peak_stage)
    devices = []
    for d in range(n_all):
        stage, local = d // n, d % n
        tp_rank, dp_group, ep_rank = local % tp, local // tp, local % ep
        experts_local = _shard(m.num_experts, ep, ep_rank)
        seqs = _shard(batch, dp, dp_group)
        act, (stage_seq, _) = stages[stage]
        weight = m.weight_bytes(weights, tp, tp_rank, experts_local) if pp == 1 else \
            m.stage_weight_bytes(weights, ranges[stage], tp, tp_rank, experts_local)
        devices.append(DevicePlan(
            device=d, node=topology.node_of(d), tp_rank=tp_rank, dp_group=dp_group, ep_rank=ep_rank,
            experts_local=experts_local, sequences=seqs, kv_blocks=seqs * blocks_per_seq,
            weights=weight, kv_cache=seqs * stage_seq,
            activations=sum(act.values()), comm_buffers=sum(comm.values()), hbm_bytes=topology.hbm_bytes,
            activation_detail=dict(act), comm_detail=dict(comm), stage=stage))

    notes = _notes(m, topology, tp, dp, ep, weights, kv_dtype, kv_dtype_t, block_size, t, mbt, peaks[-1],
                   attn_impl, ep_capacity, batch, context, budget, pp, n)
    if pp > 1:
        notes += _pp_notes(m, pp, mb, counts, pp_layers is not None, t, t_mb, n, topology, peaks)
    return MemoryPlan(model=m, topology=topology, tp=tp, dp=dp, ep=ep, context=context, batch=batch, dtype=dtype,
                      kv_dtype=kv_dtype, block_size=block_size, tokens_per_step=t, attn_impl=attn_impl,
                      devices=devices, notes=notes, weights=weights, kv_budget=kv_budget,
                      kv_budget_fraction=float(kv_budget_fraction),
                      kv_held_tokens=None if budget is None else min(budget, context),
                      kv_blocks_per_sequence=blocks_per_seq, kv_bytes_per_sequence=per_seq,
                      kv_full_blocks_per_sequence=full_blocks, kv_full_bytes_per_sequence=full_per_seq,
                      pp=pp, micro_batches=mb, stage_layers=[(r.start, r.stop - 1) for r in ranges],
                      layer_split="given" if pp_layers is not None else "balanced",
                      stage_kv_bytes_per_sequence=[kv for _, kv in stages])


def _pp_notes(m: PlanModel, pp: int, mb: int, counts: list[int], given: bool, t: int, t_mb: int, n: int,
              topo: Topology, peaks: list[str]) -> list[str]:
    ranges = stage_ranges(counts)
    spans = " | ".join(f"{r.start}-{r.stop - 1}" for r in ranges)
    how = "as --pp-layers gives them" if given else (
        "contiguous, balanced by each layer's multiply-accumulates per token (attention projections, router, "
        "shared and top-k routed experts or the dense MLP; the LM head's on the last layer; the attention core's, "
        "which grows with the context, not counted): the cut whose largest stage is least, later stages taking "
        "the more layers where cuts tie")
    inter = n >= topo.devices_per_node or any((s * n) % topo.devices_per_node == 0 for s in range(1, pp))
    return [
        f"pipeline: PP {pp} stages of {n} devices (stage s is devices s*{n} to s*{n}+{n - 1}), layers {spans}, "
        f"{how}; TP, DP and EP are within a stage",
        f"a stage holds its layers' weights and KV: the embedding on stage 0, the final norm and LM head on stage "
        f"{pp - 1}" + (" (tied: a copy of the embedding there)" if m.tie_word_embeddings else ""),
        f"a step's T = {t} tokens per DP group flow as {mb} micro-batches of {t_mb}: each operator is sized for one "
        f"micro-batch (peak operator per stage: {', '.join(peaks)}), and a stage holds up to {mb} micro-batches' "
        f"hidden states and residual in flight (pp_in_flight: 2 x {t_mb} x hidden x activation bytes each; received "
        "and waiting, or sent asynchronously and not yet delivered)",
        "stage-to-stage sends cross " + ("the inter-node links" if inter else "NVLink only (every stage within a node)")
        + f" ({topo.devices_per_node} devices per node)",
    ]


def _notes(m: PlanModel, topo: Topology, tp, dp, ep, weights: WeightFormat, kv_dtype, kv_t, block_size, t, mbt,
           peak_stage, attn_impl, ep_capacity, batch, context, budget=None, pp: int = 1,
           stage_n: int | None = None) -> list[str]:
    n = topo.num_devices if stage_n is None else stage_n
    kvn = str(kv_t).replace("torch.", "")
    where = "devices" if pp == 1 else f"each stage's {n} devices"
    local = "d" if pp == 1 else f"(d % {n})"
    notes = [
        f"layout: {where} = TP {tp} x DP {dp}; device d is TP rank {local} % {tp} of DP group {local} // {tp} "
        "(DeepSeek-style DP attention: each DP group serves its own sequences and schedules its own steps)",
        f"routed experts: EP {ep}, rank d % {ep} holds a contiguous slice of {m.num_experts} // {ep} experts per MoE "
        "layer (the first E % ep ranks one more); experts are whole on one device (no expert TP)"
        + (f"; {n // ep} expert replicas since EP < devices" if ep < n else ""),
        "attention, dense MLP layers and shared experts are split over TP (by heads / by intermediate rows); "
        "routers, norms and MLA's down-projections (q_a, kv_a) are replicated on every device",
        "embeddings and LM head are vocabulary-parallel over TP (vocab rows split; no padding of the vocabulary)"
        + ("; tied: one matrix" if m.tie_word_embeddings else ""),
        _weights_note(m, weights) + "; no optimizer state, no weight offload to host",
        f"batch {batch} sequences dealt round-robin to the {dp} DP groups; each sequence's KV holds "
        f"ceil({context} / {block_size}) blocks of {block_size} tokens (the engine's paged layout)"
        + ("" if budget is None else " under full retention"),
    ]
    if budget is not None:
        notes.append(f"KV retention budget {budget:,} tokens per sequence (any policy but full; the engine's "
                     f"retention evicts whole blocks): the full-attention layers hold at most ceil(({budget:,} + a "
                     f"{mbt}-token chunk) / {block_size}) = {kv_budget_blocks(budget, block_size, mbt):,} blocks per "
                     "sequence (the budget kept between steps, one step's chunk on top until it is evicted), or the "
                     "whole context where that is fewer; a budget below the blocks a policy never evicts (the "
                     "attention sinks, the block being written, snapkv's and h2o's recent tokens) holds those")
    if m.attention == "mla":
        notes.append(f"MLA KV cache: one compressed latent of kv_lora_rank + qk_rope_head_dim = {m.kv_latent_dim} "
                     "elements per token and layer (no separate K and V); it is shared by all heads, so it is "
                     "not split by TP: every TP rank of the group holds the full latent")
    elif m.num_kv_heads >= tp:
        notes.append(f"GQA KV cache split over TP by KV heads: {m.num_kv_heads // tp} of {m.num_kv_heads} per device")
    else:
        notes.append(f"GQA KV cache: {m.num_kv_heads} KV heads < TP {tp}, one head per device, replicated "
                     f"{tp // m.num_kv_heads}x")
    if kv_dtype == "int8":
        notes.append("INT8 KV: int8 values plus one fp32 scale per (block, head) for K and V, as "
                     "KVCache.bytes_per_block" + (" (MLA: one each for the latent and the RoPE key)"
                                                  if m.attention == "mla" else ""))
    else:
        notes.append(f"KV in {kvn} (auto: the activation dtype)")
    notes += [
        f"activations sized for T = {t} tokens per step per DP group (min(max_batched_tokens {mbt}, tokens of the "
        "fullest group)), allocated on every device; peak = residual stream + the largest operator "
        f"(here: {peak_stage}); between layers only the residual stream lives",
        f"attention kernel: {attn_impl}" + (" (IO-aware: no score matrix, fp32 accumulator + softmax stats)"
                                            if attn_impl == "flash" else
                                            " (the local backend's path: gathered K/V, fp32 scores of the chunk "
                                            "against the whole context)"),
        f"MoE tokens split over the TP ranks before dispatch (T_moe = ceil(T / {tp})); each device receives "
        f"T_moe x top_k x {ep_capacity:g} rows (balanced routing; hot experts need a larger --ep-capacity)",
        "communication buffers: EP all-to-all dispatch + combine receive buffers (tokens x top_k x hidden x "
        "activation bytes, both directions) when EP > 1; one TP all-reduce buffer (T x hidden) when TP > 1; "
        "dispatch in the activation dtype (no fp8 dispatch)",
        "not counted: CUDA context, allocator fragmentation, CUDA graphs, the rotary tables, the sampler; "
        "headroom must cover them",
    ]
    if tp > topo.devices_per_node:
        notes.append(f"TP {tp} spans more than one node ({topo.devices_per_node} devices per node)")
    if ep > topo.devices_per_node:
        notes.append(f"EP {ep} spans {_cdiv(ep, topo.devices_per_node)} nodes: the all-to-all crosses "
                     f"the inter-node links ({topo.inter_node_gbps:g} GB/s)")
    if dp > 1 and batch < dp:
        notes.append(f"only {batch} of the {dp} DP groups hold a sequence; the others hold no KV cache")
    windows = [w for w in m.layer_windows if w]
    if windows:
        notes.append(f"sliding-window layers: {len(windows)} of {m.num_layers} (window {max(windows):,}); their KV is "
                     f"bounded by (window - 1 + {mbt} tokens of a chunk) / {block_size} + 1 blocks per sequence, the "
                     "engine's window pool that frees blocks as they slide out")
    return m.notes + notes


def _weights_note(m: PlanModel, weights: WeightFormat) -> str:
    q = weights.quantization
    if q is None:
        return f"weights in {weights.name}"
    source = "the config's quantization_config" if q == m.quantization else "transformers' defaults for it"
    which = ("every linear layer but lm_head" + ("" if m.family in LINEAR_ROUTERS else " (the router is not one)")
             if q.method == "fp8" else "the routed experts")
    skipped = f", less modules_to_not_convert ({', '.join(q.not_converted)})" if q.not_converted else ""
    return (f"weights in {q.describe()} ({source}): {which}{skipped}; everything else (embeddings, norms, "
            f"biases, ...) in bf16; planning only: the engine runs fp32/bf16/fp16")


# ---------------------------------------------------------------------------------------------
# what would make it fit


def fit_suggestions(config, topology: Topology, **options) -> list[dict]:
    """Single changes that make a plan fit, each as {"change", "fits", "headroom_bytes", "options"}.

    Tried: INT8 KV, fp8 weights, more devices (EP scaled with them), the largest batch and the
    longest context that fit. Empty when the plan already fits."""
    m = config if isinstance(config, PlanModel) else load_plan_model(config)
    base = plan_memory(m, topology, **options)
    if base.fits:
        return []
    out = []

    def attempt(change: str, topo: Topology = topology, **changes):
        try:
            p = plan_memory(m, topo, **{**options, **changes})
        except ValueError:
            return None
        if p.fits:
            out.append({"change": change, "fits": True, "headroom_bytes": p.headroom_bytes, "options": changes})
        return p

    if options.get("kv_dtype", "auto") != "int8":
        attempt("--kv-dtype int8", kv_dtype="int8")
    if base.dtype not in QUANT_METHODS:
        attempt("--dtype fp8 (weights)", dtype="fp8")
    n, ep = topology.num_devices, options.get("ep") or topology.num_devices
    factor = 2
    while n * factor <= 256:  # the fewest more devices that fit; EP grows with them if it spanned all
        grow = ep == n and ep * factor <= m.num_experts
        changes = {"ep": ep * factor} if grow else {}
        p = attempt(f"--devices {n * factor}" + (f" --ep {ep * factor}" if grow else ""),
                    replace(topology, num_devices=n * factor), **changes)
        if p is not None and p.fits:
            break
        factor *= 2
    for key, flag in (("batch", "--batch"), ("context", "--context")):
        cur = options.get(key, 1)
        best, lo, hi = None, 1, cur - 1  # the largest smaller value that fits (bisection)
        while lo <= hi:
            mid = (lo + hi) // 2
            if plan_memory(m, topology, **{**options, key: mid}).fits:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        if best:
            attempt(f"{flag} {best}", **{key: best})
    return out


def plan_for_header(header: dict) -> dict:
    """The per-device memory plan of an engine as its trace header (profiler/recorder.py
    engine_header) describes it: {"table": text} or {"absent": why}. The engine computes it,
    consoles draw it."""
    model = (header.get("model") or {}).get("path")
    topo = (header.get("devices") or {}).get("topology")
    if not model or not (Path(model) / "config.json").is_file() or not topo:
        return {"absent": "needs the model's config.json and a device topology"}
    config = header.get("engine_config") or {}
    knobs = header.get("knobs") or {}
    try:
        plan = plan_memory(model, Topology.from_mapping(topo), tp=1, ep=int(topo["num_devices"]),
                           context=int(config.get("max_model_len") or 2048), batch=int(topo["num_devices"]),
                           max_batched_tokens=knobs.get("max_num_batched_tokens"),
                           block_size=int(config.get("block_size", 16)), attn_impl="eager")
    except (PlanError, ValueError) as exc:
        return {"absent": str(exc)}
    return {"table": plan.format_table()}
