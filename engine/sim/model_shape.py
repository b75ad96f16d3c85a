"""What one layer of a model costs per token, from config.json alone: multiply-accumulates and
weight bytes of each part (attention projections, core attention, router, routed and shared
experts, dense MLP, LM head), and the dtype its GEMMs run in.

The shapes are the memory planner's (`planning.memory_plan.PlanModel`); a `quantization_config`
sets the weights' bytes and the GEMM dtype: DeepSeek-V3's block-scaled fp8 (1 byte, FP8 GEMMs
where the hardware has them), gpt-oss's mxfp4 (4.25 bits for the routed experts, BF16 GEMMs);
`dtype` overrides both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moectl.engine.planning.memory_plan import PlanModel, load_plan_model

DTYPES = ("bf16", "fp8", "fp32")  # fp32: what moectl's engine runs on a CPU (a calibrated profile)
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp32": 4.0, "mxfp4": 4.25 / 8}


@dataclass(frozen=True)
class SimModel:
    shape: PlanModel
    gemm_dtype: str  # bf16 | fp8: what the projections and experts multiply in
    weight_bytes: float  # bytes per parameter of the dense weights (attention, shared, dense, head)
    expert_weight_bytes: float  # ... of the routed experts
    kv_bytes: float = 2.0  # per KV value (BF16 cache)

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def high_bytes(self) -> float:
        """Bytes per value of what stays in high precision (router, embeddings, LM head): BF16,
        or fp32 in an fp32 model."""
        return 4.0 if self.gemm_dtype == "fp32" else 2.0

    # -- per token, per layer, on a device holding 1/tp of the attention heads
    def attention_projection_macs(self, tp: int) -> float:
        return float(self.shape.attention_params(tp))

    def attention_core(self, tp: int, context: float, decode: bool) -> tuple[float, float]:
        """(multiply-accumulates, KV bytes read) of one token's attention over `context` keys.
        MLA in decode runs absorbed (DeepSeek's FlashMLA): every head scores the 576-wide latent
        and reads its 512 values, one shared latent per key; in prefill it runs on the
        decompressed per-head keys (qk_nope + rope) and values."""
        m = self.shape
        heads = m.num_heads / tp
        if m.attention == "mla":
            if decode:
                width = m.kv_latent_dim + m.kv_lora_rank
                return heads * context * width, context * m.kv_latent_dim * self.kv_bytes
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            return heads * context * (qk + m.v_head_dim), context * m.kv_latent_dim * self.kv_bytes
        kv_heads = m.kv_heads_per_device(tp)
        return heads * context * 2 * m.head_dim, context * 2 * kv_heads * m.head_dim * self.kv_bytes

    def attention_weight_bytes(self, tp: int) -> float:
        return self.shape.attention_params(tp) * self.weight_bytes

    def router_macs(self) -> float:
        return float(self.shape.router_params())

    def expert_macs(self) -> float:
        """One routed expert on one token."""
        return float(self.shape.expert_params())

    def expert_bytes(self) -> float:
        return self.shape.expert_params() * self.expert_weight_bytes

    def shared_macs(self, tp: int = 1) -> float:
        return float(self.shape.shared_params(tp))

    def dense_macs(self, tp: int = 1) -> float:
        return float(self.shape.dense_params(tp))

    def head_macs(self, tp: int = 1) -> float:
        return float(self.shape.vocab_size) * self.shape.hidden_size / tp


def load_sim_model(config: str | Path, dtype: str | None = None) -> SimModel:
    """config.json (a file or a directory holding one) -> SimModel; ValueError naming the field."""
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"--model: cannot read {path} ({exc.strerror})") from None
    except ValueError as exc:
        raise ValueError(f"--model: {path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--model: {path} must hold a JSON object")
    quant = raw.get("quantization_config") or {}
    # the shapes without the quantization, which the engine (and so the planner's parser) refuses
    # to load but a simulation only has to price
    unquantized = {k: v for k, v in raw.items() if k != "quantization_config"}
    unquantized.setdefault("_name_or_path", path.parent.name if path.name == "config.json" else path.stem)
    shape = load_plan_model(unquantized)
    method = str(quant.get("quant_method") or "").lower()
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype is not None:
        return SimModel(shape, dtype, WEIGHT_BYTES[dtype], WEIGHT_BYTES[dtype], kv_bytes=4.0 if dtype == "fp32" else 2.0)
    if method == "fp8":
        return SimModel(shape, "fp8", 1.0, 1.0)
    if method == "mxfp4":  # the routed experts only (modules_to_not_convert keeps the rest in BF16)
        return SimModel(shape, "bf16", 2.0, WEIGHT_BYTES["mxfp4"])
    if method:
        raise ValueError(f"quantization_config.quant_method: {method!r} is not simulated (fp8, mxfp4); "
                         f"give --dtype bf16 or fp8")
    return SimModel(shape, "bf16", 2.0, 2.0)
