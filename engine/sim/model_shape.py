"""What one layer of a model costs per token, from config.json alone: multiply-accumulates and
weight bytes of each part (attention projections, core attention, router, routed and shared
experts, dense MLP, LM head), and the dtype its GEMMs run in.

The shapes and the weights' bytes are the memory planner's (`planning.memory_plan.PlanModel`,
`WeightFormat`): a `quantization_config` stores them as it says, DeepSeek-V3's block-scaled fp8
(one byte a value and an fp32 scale per 128 x 128 block: FP8 GEMMs where the hardware has them)
or gpt-oss's mxfp4 (4.25 bits a routed expert's value: BF16 GEMMs); `dtype` overrides it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moectl.engine.planning.memory_plan import PlanModel, WeightFormat, load_plan_model, weight_format

DTYPES = ("bf16", "fp8", "fp32")  # fp32: what moectl's engine runs on a CPU (a calibrated profile)


@dataclass(frozen=True)
class SimModel:
    shape: PlanModel
    gemm_dtype: str  # bf16 | fp8 | fp32: what the projections and experts multiply in
    weights: WeightFormat  # how the weights are stored (the planner's count of their bytes)
    kv_bytes: float = 2.0  # per KV value (BF16 cache)

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def high_bytes(self) -> float:
        """Bytes per value of what stays in high precision (activations, embeddings, LM head):
        BF16, or fp32 in an fp32 model."""
        return float(self.weights.plain_bytes)

    def part_bytes(self, part: str, tp: int = 1) -> float:
        return float(self.shape.part_bytes(part, self.weights, tp))

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
        return self.part_bytes("attention", tp)

    def router_macs(self) -> float:
        return float(self.shape.router_params())

    def expert_macs(self) -> float:
        """One routed expert on one token."""
        return float(self.shape.expert_params())

    def expert_bytes(self) -> float:
        return self.part_bytes("expert")

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
    except RecursionError:
        raise ValueError(f"--model: {path} is not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        raise ValueError(f"--model: {path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--model: {path} must hold a JSON object")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype is not None:  # it replaces the config's quantization, which then need not be one this reads
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    raw.setdefault("_name_or_path", path.parent.name if path.name == "config.json" else path.stem)
    try:
        shape = load_plan_model(raw)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message + ("; give --dtype bf16 or fp8" if message.startswith("quantization_config.")
                                    else "")) from None
    weights = weight_format(dtype, shape)
    gemm = {"fp8": "fp8", "fp32": "fp32"}.get(weights.name, "bf16")  # mxfp4 experts multiply in BF16
    return SimModel(shape, gemm, weights, kv_bytes=4.0 if weights.name == "fp32" else 2.0)
