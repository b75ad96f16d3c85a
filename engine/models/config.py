"""Model configuration read from a Hugging Face config.json, validated once.

Every unsupported value is refused here with an error that names the field, so nothing
downstream has to guess what a checkpoint means.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

# architectures[0] in config.json -> the short name used everywhere else
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


class ConfigError(ValueError):
    """A config value this engine cannot run; the message names the field."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise ConfigError(f"dtype: {name} is not supported (use fp32, bf16 or fp16)")
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ConfigError(f"dtype: {name!r} is not supported (use fp32, bf16 or fp16)") from None


@dataclass
class ModelConfig:
    architecture: str  # mixtral | qwen2_moe | qwen3_moe | olmoe
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str = "none"  # none | per_head (Qwen3-MoE) | full (OLMoE)
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE only; 0 = no shared expert
    dense_intermediate_size: int = 0  # for layers that use a dense MLP instead of experts
    sparse_layers: tuple[bool, ...] = ()
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.architecture not in MODEL_TYPES:
            raise ConfigError(f"architectures: {self.architecture!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "num_experts", "top_k", "expert_intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_key_value_heads: {self.num_kv_heads} does not divide "
                              f"num_attention_heads {self.num_heads}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"num_experts_per_tok: {self.top_k} exceeds the {self.num_experts} experts")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: {self.head_dim} must be even for RoPE")
        if not self.sparse_layers:
            self.sparse_layers = (True,) * self.num_layers
        if len(self.sparse_layers) != self.num_layers:
            raise ConfigError("mlp_only_layers: does not match num_hidden_layers")
        if not all(self.sparse_layers) and self.dense_intermediate_size <= 0:
            raise ConfigError("intermediate_size: required for the dense (mlp_only) layers")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError("rms_norm_eps/rope_theta: must be positive")

    # -- derived sizes used by the runtime, the planner and `model info`
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def o_proj_bias(self) -> bool:
        # Qwen3-MoE and OLMoE put attention_bias on o_proj too; Qwen2-MoE biases q/k/v only
        return self.attention_bias and self.architecture in ("qwen3_moe", "olmoe")

    @property
    def hf_architecture(self) -> str:
        return MODEL_TYPES[self.architecture]

    def param_counts(self) -> dict[str, int]:
        """Total and per-token-active parameter counts, from shapes alone."""
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size + (h if self.o_proj_bias else 0)
        if self.qk_norm == "per_head":
            attn += 2 * self.head_dim
        elif self.qk_norm == "full":
            attn += self.q_size + self.kv_size
        expert = 3 * h * self.expert_intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        dense = 3 * h * self.dense_intermediate_size
        total = active = 0
        for sparse in self.sparse_layers:
            norms = 2 * h
            if sparse:
                router = h * self.num_experts
                total += attn + norms + router + self.num_experts * expert + shared
                active += attn + norms + router + self.top_k * expert + shared
            else:
                total += attn + norms + dense
                active += attn + norms + dense
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        total += embed + head + h
        active += embed + head + h
        return {"params_total": total, "params_active": active}

    @classmethod
    def from_dir(cls, path: str | Path, dtype: str | torch.dtype | None = None) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"config.json: not found in {path}")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"config.json: unreadable ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError("config.json: top level must be an object")
        cfg = cls.from_hf(raw, dtype=dtype)
        # generation_config.json may list more end-of-sequence ids (Qwen3 adds <|endoftext|>)
        gen_path = Path(path) / "generation_config.json"
        if gen_path.is_file():
            try:
                eos = json.loads(gen_path.read_text()).get("eos_token_id")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                raise ConfigError("generation_config.json: unreadable") from None
            extra = eos if isinstance(eos, list) else [eos]
            cfg.eos_token_ids = tuple(dict.fromkeys(
                [*cfg.eos_token_ids, *(e for e in extra if isinstance(e, int) and 0 <= e < cfg.vocab_size)]))
        return cfg

    @classmethod
    def from_hf(cls, raw: dict, dtype: str | torch.dtype | None = None) -> ModelConfig:
        try:
            return cls._from_hf(raw, dtype)
        except (TypeError, AttributeError) as exc:  # a value of the wrong JSON type somewhere
            raise ConfigError(f"config.json: a value has the wrong type ({exc})") from None

    @classmethod
    def _from_hf(cls, raw: dict, dtype: str | torch.dtype | None = None) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch_name = archs[0] if archs else MODEL_TYPES.get(raw.get("model_type", ""), raw.get("model_type"))
        if arch_name not in ARCHITECTURES:
            raise ConfigError(f"architectures: {arch_name!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        arch = ARCHITECTURES[arch_name]

        def need(key: str):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{key}: missing from config.json")
            return raw[key]

        quant = raw.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ConfigError(f"quantization_config.quant_method: {method!r} checkpoints are not supported "
                              "(dequantise to bf16/fp16/fp32 first)")
        _refuse_rope_scaling(raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window") or (arch == "mixtral" and raw.get("sliding_window")):
            raise ConfigError("sliding_window: sliding-window attention is not supported")

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        head_dim = raw.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0)
        layers = need("num_hidden_layers")
        kw: dict = {}
        if arch == "mixtral":
            experts, expert_size = need("num_local_experts"), need("intermediate_size")
            norm_topk = True  # Mixtral always renormalises its top-k weights
            bias = False
        elif arch == "olmoe":
            experts = raw.get("num_experts") or need("num_local_experts")
            expert_size = need("intermediate_size")
            norm_topk = _flag(raw, "norm_topk_prob", False)
            bias = _flag(raw, "attention_bias", False)
            kw.update(qk_norm="full", clip_qkv=raw.get("clip_qkv"))
        else:  # the Qwen MoE family
            experts = raw.get("num_experts") or need("num_local_experts")  # v5 renamed it for Qwen3
            expert_size = need("moe_intermediate_size")
            norm_topk = _flag(raw, "norm_topk_prob", False)
            if arch == "qwen2_moe":
                bias = _flag(raw, "qkv_bias", True)
                kw["shared_expert_intermediate_size"] = int(raw.get("shared_expert_intermediate_size") or 0)
            else:
                bias = _flag(raw, "attention_bias", False)
                kw["qk_norm"] = "per_head"
            step = raw.get("decoder_sparse_step", 1) or 1
            mlp_only = set(raw.get("mlp_only_layers") or [])
            if isinstance(layers, int):
                kw["sparse_layers"] = tuple(
                    i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(layers))
            kw["dense_intermediate_size"] = int(raw.get("intermediate_size") or 0)

        theta = raw.get("rope_theta")
        if theta is None:
            theta = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        vocab = need("vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int):
            raise ConfigError(f"vocab_size: must be an integer, got {vocab!r}")
        eos_ids = tuple(e for e in eos_ids if isinstance(e, int) and 0 <= e < vocab)
        load_dtype = dtype if dtype is not None else (raw.get("dtype") or raw.get("torch_dtype") or "float32")
        return cls(
            architecture=arch, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
            num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
            num_experts=experts, top_k=need("num_experts_per_tok"), expert_intermediate_size=expert_size,
            norm_topk_prob=norm_topk, rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
            rope_theta=float(theta), max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=_flag(raw, "tie_word_embeddings", False), attention_bias=bias,
            dtype=parse_dtype(load_dtype), bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids,
            raw=raw, **kw)


def _flag(raw: dict, key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):  # bool("false") is True: refuse rather than guess
        raise ConfigError(f"{key}: must be true or false, got {value!r}")
    return value


def _number(raw: dict, key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: must be a number, got {value!r}")
    return float(value)


def _refuse_rope_scaling(raw: dict) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        spec = raw.get(key)
        if not spec:
            continue
        if not isinstance(spec, dict):
            raise ConfigError(f"{key}: must be an object, got {spec!r}")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"{key}.rope_type: {kind!r} is not supported (only default RoPE)")
        if spec.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{key}.partial_rotary_factor: only 1.0 is supported")
