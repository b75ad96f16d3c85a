"""Model configuration read from a Hugging Face config.json, validated once.

Every unsupported value is refused here with an error that names the field, so nothing
downstream has to guess what a checkpoint means.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

# architectures[0] in config.json -> the short name used everywhere else
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
}
# model_type values each architecture accepts (Kimi-K2 ships DeepSeek-V3's architecture)
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


class ConfigError(ValueError):
    """A config value this engine cannot run; the message names the field."""


# The largest size each config.json field may give: far past every published model (DeepSeek-V3:
# 61 layers, 256 experts, hidden 7168, vocabulary 129280; the 3T example: 80 layers x 512 experts,
# hidden 8192, 1M positions), and small enough that what is built per layer, expert or head (the
# layer kinds, routing tables, placements) fits in memory: beyond it a size is a typo or a corrupt file.
MAX_LAYERS = 1024
MAX_EXPERTS = 4096  # placement.MAX_EXPERTS: the most experts per layer anything plans for
MAX_WIDTH = 1 << 20  # hidden, intermediate, head and latent widths
SIZE_LIMITS = {
    "num_hidden_layers": MAX_LAYERS, "first_k_dense_replace": MAX_LAYERS, "decoder_sparse_step": MAX_LAYERS,
    "moe_layer_freq": MAX_LAYERS, "max_window_layers": MAX_LAYERS,
    "num_local_experts": MAX_EXPERTS, "num_experts": MAX_EXPERTS, "n_routed_experts": MAX_EXPERTS,
    "num_experts_per_tok": MAX_EXPERTS, "n_shared_experts": MAX_EXPERTS, "n_group": MAX_EXPERTS,
    "topk_group": MAX_EXPERTS,
    "num_attention_heads": 1 << 16, "num_key_value_heads": 1 << 16,
    "hidden_size": MAX_WIDTH, "intermediate_size": MAX_WIDTH, "moe_intermediate_size": MAX_WIDTH,
    "shared_expert_intermediate_size": MAX_WIDTH, "head_dim": MAX_WIDTH, "q_lora_rank": MAX_WIDTH,
    "kv_lora_rank": MAX_WIDTH, "qk_nope_head_dim": MAX_WIDTH, "qk_rope_head_dim": MAX_WIDTH,
    "v_head_dim": MAX_WIDTH,
    "vocab_size": 1 << 24, "max_position_embeddings": 1 << 34, "sliding_window": 1 << 34,
}


# sizes that may be 0 (no dense first layers, no shared expert, no q LoRA)
MAY_BE_ZERO = ("first_k_dense_replace", "n_shared_experts", "q_lora_rank", "sliding_window")


def check_sizes(raw: dict) -> None:
    """Every size config.json gives within SIZE_LIMITS, checked before anything is built from them
    (a tuple of 10^9 layer kinds is a MemoryError, not an error naming the field). The lower
    bounds and the types are checked where each field is read."""
    for key, limit in SIZE_LIMITS.items():
        value = raw.get(key)
        if is_int(value) and value > limit:
            low = 0 if key in MAY_BE_ZERO else 1
            raise ConfigError(f"{key}: must be in [{low}, {limit:,}], got {value:,}")


def is_int(value) -> bool:
    """A JSON integer: true/false are ints to Python, but a config that says `"hidden_size": true` is wrong."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite JSON number (Python's json reads NaN and Infinity, which no size or rate may be)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# our field -> its config.json key, where they differ, so an error names what the user wrote
CONFIG_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "top_k": "num_experts_per_tok"}


@dataclass(frozen=True)
class RopeScaling:
    """rope_scaling / rope_parameters: default RoPE, or YaRN with transformers' parameters."""
    kind: str = "default"  # default | yarn
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor and the mscales
    truncate: bool = True

    @staticmethod
    def yarn_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    @property
    def cos_sin_factor(self) -> float:
        """The factor transformers multiplies into cos and sin."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.factor, self.mscale) / self.yarn_mscale(self.factor, self.mscale_all_dim)
        return self.yarn_mscale(self.factor)


QUANT_METHODS = ("fp8", "mxfp4")


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization_config, as far as sizes go (the engine runs neither kind).

    fp8: transformers' FineGrainedFP8 (integrations/finegrained_fp8.py): every nn.Linear but
    lm_head and modules_to_not_convert holds e4m3 values and one fp32 scale (weight_scale_inv) per
    block of block[0] x block[1] of its [out, in] weight. mxfp4: gpt-oss (integrations/mxfp4.py):
    the routed experts hold 4-bit values, 16 bytes per 32 along the input, and one e8m0 byte of
    scale per 32. Whatever neither converts stays in the config's dtype."""
    method: str  # fp8 | mxfp4
    block: tuple[int, int] = (128, 128)  # fp8: FineGrainedFP8Config's default weight_block_size
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert

    def describe(self) -> str:
        if self.method == "fp8":
            return f"fp8 (e4m3, one fp32 scale per {self.block[0]}x{self.block[1]} block)"
        return "mxfp4 (routed experts: 4-bit values, one e8m0 scale per 32)"


def parse_quantization(raw: dict) -> Quantization | None:
    """config.json's quantization_config (None when absent); a ConfigError names the field."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"quantization_config: must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(f"quantization_config.quant_method: {method!r} cannot be read (fp8 or mxfp4)")
    skip = quant.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"quantization_config.modules_to_not_convert: must be a list of module names, got {skip!r}")
    block = quant.get("weight_block_size") or (128, 128)
    if method == "fp8" and (not isinstance(block, (list, tuple)) or len(block) != 2
                            or not all(is_int(b) and 1 <= b <= MAX_WIDTH for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size: must be two integers in [1, {MAX_WIDTH:,}], "
                          f"got {block!r}")
    if method == "fp8":
        return Quantization(method, tuple(block), tuple(skip))
    return Quantization(method, not_converted=tuple(skip))


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
    architecture: str  # mixtral | qwen2_moe | qwen3_moe | olmoe | deepseek_v3 | gpt_oss
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
    rope_scaling: RopeScaling = RopeScaling()
    # DeepSeek-V3 / Kimi-K2: multi-head latent attention (head_dim is then qk_nope + qk_rope)
    attention: str = "gqa"  # gqa | mla
    q_lora_rank: int = 0  # 0: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint's rope rows interleaved (permuted away at load)
    # ... and its router: sigmoid scores, grouped selection, a selection-only correction bias
    router: str = "softmax"  # softmax | grouped_sigmoid | topk_softmax (gpt-oss: softmax over the top-k logits)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # Qwen2-MoE gates its shared expert; DeepSeek adds it as is
    # per layer: 0 = full attention, W = each query sees its last W positions (itself included)
    layer_windows: tuple[int, ...] = ()
    # gpt-oss: a learned per-head sink logit in every softmax, biases on the router and the experts,
    # and a clamped SwiGLU
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    dtype: torch.dtype = torch.float32
    quantization: Quantization | None = None  # read with sizes_only; the engine runs none
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
            if not is_int(value) or value <= 0:
                raise ConfigError(f"{CONFIG_KEYS.get(name, name)}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_key_value_heads: {self.num_kv_heads} does not divide "
                              f"num_attention_heads {self.num_heads}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"num_experts_per_tok: {self.top_k} exceeds the {self.num_experts} experts")
        if self.attention == "gqa" and self.head_dim % 2:
            raise ConfigError(f"head_dim: {self.head_dim} must be even for RoPE")
        if not self.sparse_layers:
            self.sparse_layers = (True,) * self.num_layers
        if len(self.sparse_layers) != self.num_layers:
            raise ConfigError("mlp_only_layers: does not match num_hidden_layers")
        if not all(self.sparse_layers) and self.dense_intermediate_size <= 0:
            raise ConfigError("intermediate_size: required for the dense (mlp_only) layers")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not is_number(value) or value <= 0:
                raise ConfigError(f"{name}: must be a finite positive number, got {value!r}")
        if not self.layer_windows:
            self.layer_windows = (0,) * self.num_layers
        if len(self.layer_windows) != self.num_layers:
            raise ConfigError(f"layer_types: {len(self.layer_windows)} entries for {self.num_layers} layers")
        for window in self.layer_windows:
            if not is_int(window) or window < 0:
                raise ConfigError(f"sliding_window: must be a positive integer, got {window!r}")
            if window > self.max_position_embeddings:
                raise ConfigError(f"sliding_window: {window} is larger than the context "
                                  f"(max_position_embeddings {self.max_position_embeddings})")
        if self.attention == "mla" and any(self.layer_windows):
            raise ConfigError("sliding_window: latent attention (MLA) has no sliding-window layers")
        if self.swiglu_limit is not None and (not is_number(self.swiglu_limit) or self.swiglu_limit <= 0):
            raise ConfigError(f"swiglu_limit: must be positive, got {self.swiglu_limit!r}")
        if self.clip_qkv is not None and (not is_number(self.clip_qkv) or self.clip_qkv <= 0):
            raise ConfigError(f"clip_qkv: must be positive or null, got {self.clip_qkv!r}")
        if self.attention == "mla":
            self._check_mla()
        if self.router == "grouped_sigmoid":
            self._check_grouped_router()

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if not is_int(self.q_lora_rank) or self.q_lora_rank < 0:
            raise ConfigError(f"q_lora_rank: must be a positive integer or null, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim: {self.qk_rope_head_dim} must be even for RoPE")
        if self.num_kv_heads != self.num_heads:
            # MLA has no KV heads of its own; transformers breaks on any other value
            raise ConfigError(f"num_key_value_heads: must equal num_attention_heads ({self.num_heads}) "
                              f"with MLA, got {self.num_kv_heads}")

    def _check_grouped_router(self) -> None:
        e, g, tg = self.num_experts, self.n_group, self.topk_group
        if not is_int(g) or g <= 0 or e % g:
            raise ConfigError(f"n_group: {g!r} must divide n_routed_experts ({e})")
        if not is_int(tg) or not 1 <= tg <= g:
            raise ConfigError(f"topk_group: must be in 1..n_group ({g}), got {tg!r}")
        if g > 1 and e // g < 2:
            raise ConfigError(f"n_group: {g} groups of {e // g} expert leave no top-2 to score a group")
        if tg * (e // g) < self.top_k:
            raise ConfigError(f"topk_group: {tg} groups of {e // g} experts hold fewer than num_experts_per_tok "
                              f"({self.top_k})")
        if not is_number(self.routed_scaling_factor) or self.routed_scaling_factor <= 0:
            raise ConfigError(f"routed_scaling_factor: must be positive, got {self.routed_scaling_factor!r}")

    # -- derived sizes used by the runtime, the planner and `model info`
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale: head_dim^-0.5, and for MLA under YaRN times mscale(factor, mscale_all_dim)^2
        (transformers' DeepseekV3Attention)."""
        scale = self.head_dim ** -0.5
        rope = self.rope_scaling
        if self.attention == "mla" and rope.kind != "default" and rope.mscale_all_dim:
            scale *= RopeScaling.yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        return scale

    def kv_entry(self, kv_heads: int | None = None) -> tuple[int, int, int]:
        """(heads, K width, V width) of one token's KV-cache entry per layer. MLA caches one latent
        shared by all heads: K = the roped k_pe (qk_rope_head_dim), V = the normed latent (kv_lora_rank);
        attention reads [latent; k_pe] as the key and the latent as the value."""
        if self.attention == "mla":
            return 1, self.qk_rope_head_dim, self.kv_lora_rank
        return kv_heads or self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def o_proj_bias(self) -> bool:
        # Qwen3-MoE, OLMoE and gpt-oss put attention_bias on o_proj too; Qwen2-MoE biases q/k/v only
        return self.attention_bias and self.architecture in ("qwen3_moe", "olmoe", "gpt_oss")

    @property
    def hf_architecture(self) -> str:
        return MODEL_TYPES[self.architecture]

    def param_counts(self) -> dict[str, int]:
        """Total and per-token-active parameter counts, from shapes alone."""
        h = self.hidden_size
        attn = self.attention_matmul_weights()
        if self.attention == "mla":
            attn += self._mla_norms_and_biases()
        elif self.attention_bias:
            attn += self.q_size + 2 * self.kv_size + (h if self.o_proj_bias else 0)
        if self.qk_norm == "per_head":
            attn += 2 * self.head_dim
        elif self.qk_norm == "full":
            attn += self.q_size + self.kv_size
        attn += self.num_heads if self.attention_sinks else 0
        expert = 3 * h * self.expert_intermediate_size
        expert += 2 * self.expert_intermediate_size + h if self.expert_bias else 0
        shared = 3 * h * self.shared_expert_intermediate_size
        shared += h if self.shared_expert_intermediate_size and self.shared_expert_gated else 0
        dense = 3 * h * self.dense_intermediate_size
        total = active = 0
        for sparse in self.sparse_layers:
            norms = 2 * h
            if sparse:
                router = h * self.num_experts + (self.num_experts if self.router == "grouped_sigmoid" or self.router_bias
                                                 else 0)
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

    def attention_matmul_weights(self) -> int:
        """The attention projections' weight elements, what one token's matmuls multiply (no
        norms, no biases). MLA as the engine runs it absorbed: kv_b_proj's elements still count
        once per token (folded into the query and applied after attention)."""
        h = self.hidden_size
        if self.attention != "mla":
            return h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        heads, r, dr = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        q = (h * self.q_lora_rank + self.q_lora_rank * heads * self.head_dim if self.q_lora_rank
             else h * heads * self.head_dim)
        kv = h * (r + dr) + r * heads * (self.qk_nope_head_dim + self.v_head_dim)  # kv_a_proj_with_mqa, kv_b_proj
        return q + kv + heads * self.v_head_dim * h  # o_proj

    def _mla_norms_and_biases(self) -> int:
        """MLA's parameters beside its matmuls: q_a_layernorm, kv_a_layernorm and the biases."""
        h, r, dr, ql = self.hidden_size, self.kv_lora_rank, self.qk_rope_head_dim, self.q_lora_rank
        bias = self.attention_bias
        return (ql + (ql if bias else 0) if ql else 0) + r + ((r + dr) if bias else 0) + (h if bias else 0)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: str | torch.dtype | None = None, sizes_only: bool = False) -> ModelConfig:
        """A checkpoint directory, or a config.json file on its own. sizes_only: for what needs
        the shapes and not the weights (model info, planning), so a quantized checkpoint is read
        (its quantization_config in .quantization) where the engine refuses it."""
        cfg_path = Path(path) if Path(path).is_file() else Path(path) / "config.json"
        path = cfg_path.parent
        if not cfg_path.is_file():
            raise ConfigError(f"config.json: not found in {path}")
        cfg = cls.from_hf(read_config_json(cfg_path), dtype=dtype, sizes_only=sizes_only)
        # generation_config.json may list more end-of-sequence ids (Qwen3 adds <|endoftext|>)
        gen_path = Path(path) / "generation_config.json"
        if gen_path.is_file():
            try:
                eos = json.loads(gen_path.read_text()).get("eos_token_id")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                raise ConfigError("generation_config.json: unreadable") from None
            extra = eos if isinstance(eos, list) else [eos]
            cfg.eos_token_ids = tuple(dict.fromkeys(
                [*cfg.eos_token_ids, *(e for e in extra if is_int(e) and 0 <= e < cfg.vocab_size)]))
        return cfg

    @classmethod
    def from_hf(cls, raw: dict, dtype: str | torch.dtype | None = None, sizes_only: bool = False) -> ModelConfig:
        """sizes_only: see from_dir."""
        try:
            return cls._from_hf(raw, dtype, sizes_only)
        except (TypeError, AttributeError) as exc:  # a value of the wrong JSON type somewhere
            raise ConfigError(f"config.json: a value has the wrong type ({exc})") from None

    @classmethod
    def _from_hf(cls, raw: dict, dtype: str | torch.dtype | None, sizes_only: bool) -> ModelConfig:
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type", "")
        arch_name = archs[0] if archs else MODEL_TYPES.get(MODEL_TYPE_ALIASES.get(model_type, model_type), model_type)
        if arch_name not in ARCHITECTURES:
            raise ConfigError(f"architectures: {arch_name!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        arch = ARCHITECTURES[arch_name]

        def need(key: str):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{key}: missing from config.json")
            return raw[key]

        quant = raw.get("quantization_config")
        if quant and not sizes_only:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ConfigError(f"quantization_config.quant_method: {method!r} checkpoints are not supported "
                              "(dequantise to bf16/fp16/fp32 first)")
        quantization = parse_quantization(raw)
        check_sizes(raw)
        rope_scaling = _rope_scaling(raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: {raw['hidden_act']!r} is not supported (only silu)")

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        head_dim = raw.get("head_dim") or (hidden // heads if is_int(hidden) and is_int(heads) and heads else 0)
        layers = need("num_hidden_layers")
        kw: dict = {}
        if arch == "mixtral":
            experts, expert_size = need("num_local_experts"), need("intermediate_size")
            norm_topk = True  # Mixtral always renormalises its top-k weights
            bias = False
        elif arch == "deepseek_v3":
            experts, expert_size = need("n_routed_experts"), need("moe_intermediate_size")
            norm_topk = _flag(raw, "norm_topk_prob", True)
            bias = _flag(raw, "attention_bias", False)
            kw.update(_deepseek_v3(raw, need, layers))
            head_dim = kw.pop("head_dim")  # config.json's head_dim is the RoPE width here
        elif arch == "gpt_oss":
            experts = raw.get("num_local_experts") or need("num_experts")
            expert_size = need("intermediate_size")
            norm_topk = True  # the softmax runs over the chosen logits: the weights always sum to 1
            bias = _flag(raw, "attention_bias", True)
            kw.update(router="topk_softmax", router_bias=True, expert_bias=True, attention_sinks=True,
                      swiglu_limit=_number(raw, "swiglu_limit", 7.0), swiglu_alpha=_number(raw, "swiglu_alpha", 1.702))
            if rope_scaling.kind == "default" and not (raw.get("rope_parameters") or raw.get("rope_scaling")):
                rope_scaling = RopeScaling(kind="yarn", factor=32.0, original_max_position_embeddings=4096,
                                           truncate=False)  # GptOssConfig's default
        elif arch == "olmoe":
            experts = raw.get("num_experts") or need("num_local_experts")
            expert_size = need("intermediate_size")
            norm_topk = _flag(raw, "norm_topk_prob", False)
            bias = _flag(raw, "attention_bias", False)
            kw.update(qk_norm="full", clip_qkv=_number(raw, "clip_qkv", None))
        else:  # the Qwen MoE family
            experts = raw.get("num_experts") or need("num_local_experts")  # v5 renamed it for Qwen3
            expert_size = need("moe_intermediate_size")
            norm_topk = _flag(raw, "norm_topk_prob", False)
            if arch == "qwen2_moe":
                bias = _flag(raw, "qkv_bias", True)
                kw["shared_expert_intermediate_size"] = _size(raw, "shared_expert_intermediate_size")
            else:
                bias = _flag(raw, "attention_bias", False)
                kw["qk_norm"] = "per_head"
            step = _size(raw, "decoder_sparse_step") or 1
            mlp_only = raw.get("mlp_only_layers") or []
            if not isinstance(mlp_only, list) or not all(is_int(i) for i in mlp_only):
                raise ConfigError(f"mlp_only_layers: must be a list of layer indices, got {mlp_only!r}")
            mlp_only = set(mlp_only)  # looked up once per layer
            if is_int(layers):
                kw["sparse_layers"] = tuple(
                    i not in mlp_only and is_int(experts) and experts > 0 and (i + 1) % step == 0 for i in range(layers))
            kw["dense_intermediate_size"] = _size(raw, "intermediate_size")

        theta = _rope_theta(raw, 150000.0 if arch == "gpt_oss" else 10000.0)
        if is_int(layers):
            kw["layer_windows"] = _layer_windows(raw, arch, layers)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        vocab = need("vocab_size")
        if not is_int(vocab):
            raise ConfigError(f"vocab_size: must be an integer, got {vocab!r}")
        eos_ids = tuple(e for e in eos_ids if is_int(e) and 0 <= e < vocab)
        bos = raw.get("bos_token_id")
        if bos is not None and not is_int(bos):
            raise ConfigError(f"bos_token_id: must be an integer or null, got {bos!r}")
        kv_heads = raw.get("num_key_value_heads")  # absent: one KV head per query head; 0 is an error, not absent
        load_dtype = dtype if dtype is not None else (raw.get("dtype") or raw.get("torch_dtype") or "float32")
        return cls(
            architecture=arch, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
            num_heads=heads, num_kv_heads=heads if kv_heads is None else kv_heads, head_dim=head_dim,
            num_experts=experts, top_k=need("num_experts_per_tok"), expert_intermediate_size=expert_size,
            norm_topk_prob=norm_topk, rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
            rope_theta=theta, max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=_flag(raw, "tie_word_embeddings", False), attention_bias=bias,
            rope_scaling=rope_scaling, dtype=parse_dtype(load_dtype), quantization=quantization, bos_token_id=bos,
            eos_token_ids=eos_ids, raw=raw, **kw)


def read_config_json(path: str | Path, what: str | None = None) -> dict:
    """A config.json file as a dict; a ConfigError that starts with `what` (default: the file's
    name) if it cannot be read, is not JSON or is not an object."""
    what = what or Path(path).name
    try:
        raw = json.loads(Path(path).read_text())
    except RecursionError:
        raise ConfigError(f"{what}: unreadable (JSON nested too deeply)") from None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON, an integer of 5,000 digits
        raise ConfigError(f"{what}: unreadable ({getattr(exc, 'strerror', None) or exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}: top level must be an object")
    return raw


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
    if not is_number(value):
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    return float(value)


def _size(raw: dict, key: str) -> int:
    """An optional non-negative integer (0 when absent or null)."""
    value = raw.get(key)
    if value is None:
        return 0
    if not is_int(value) or value < 0:
        raise ConfigError(f"{key}: must be a non-negative integer, got {value!r}")
    return value


def _rope_theta(raw: dict, default: float) -> float:
    """rope_theta at the top level, or inside rope_parameters (transformers v5): a finite positive number."""
    key, theta = "rope_theta", raw.get("rope_theta")
    if theta is None and isinstance(raw.get("rope_parameters"), dict):
        key, theta = "rope_parameters.rope_theta", raw["rope_parameters"].get("rope_theta")
    if theta is None:
        return default
    if not is_number(theta) or theta <= 0:
        raise ConfigError(f"{key}: must be a finite positive number, got {theta!r}")
    return float(theta)


def _rope_scaling(raw: dict) -> RopeScaling:
    """rope_parameters (transformers v5) or the legacy rope_scaling; only default RoPE and YaRN."""
    spec, key = None, None
    for name in ("rope_parameters", "rope_scaling"):
        value = raw.get(name)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: must be an object, got {value!r}")
        if spec is None or value.get("rope_type", value.get("type", "default")) != "default":
            spec, key = value, name
    if spec is None:
        return RopeScaling()
    kind = spec.get("rope_type", spec.get("type", "default"))
    if spec.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{key}.partial_rotary_factor: only 1.0 is supported")
    if kind == "default":
        return RopeScaling()
    if kind != "yarn":
        raise ConfigError(f"{key}.rope_type: {kind!r} is not supported (default or yarn)")

    def number(field_name: str, default, positive: bool = True):
        value = spec.get(field_name, default)
        if value is None:
            return default
        if not is_number(value) or (positive and value <= 0):
            raise ConfigError(f"{key}.{field_name}: must be a {'positive' if positive else 'finite'} number, "
                              f"got {value!r}")
        return float(value)

    if "original_max_position_embeddings" not in spec:
        raise ConfigError(f"{key}.original_max_position_embeddings: missing from the yarn block")
    original = spec["original_max_position_embeddings"]
    if not is_int(original) or original <= 0:
        raise ConfigError(f"{key}.original_max_position_embeddings: must be a positive integer, got {original!r}")
    if "factor" not in spec:
        raise ConfigError(f"{key}.factor: missing from the yarn block")
    factor = number("factor", None)
    if factor is None:  # transformers: the context's growth over the original
        max_pos = raw.get("max_position_embeddings")
        if not is_int(max_pos) or max_pos <= 0:
            raise ConfigError(f"{key}.factor: null needs max_position_embeddings to derive it")
        factor = max_pos / original
    truncate = spec.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{key}.truncate: must be true or false, got {truncate!r}")
    return RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=number("beta_fast", None) or 32.0, beta_slow=number("beta_slow", None) or 1.0,
                       mscale=number("mscale", None, positive=False),
                       mscale_all_dim=number("mscale_all_dim", None, positive=False),
                       attention_factor=number("attention_factor", None), truncate=truncate)


def _layer_windows(raw: dict, arch: str, layers: int) -> tuple[int, ...]:
    """Per layer 0 (full attention) or its window, by transformers' rule for each architecture:
    gpt-oss and Qwen2-MoE by layer_types (gpt-oss's default: even layers slide; Qwen2-MoE's: even
    layers below max_window_layers, with use_sliding_window), Mixtral and Qwen3-MoE every layer
    when sliding_window (and for Qwen3, use_sliding_window) is set."""
    window = raw.get("sliding_window")
    if arch == "qwen2_moe" or arch == "qwen3_moe":
        if not raw.get("use_sliding_window"):
            return (0,) * layers
        if not window:
            raise ConfigError("sliding_window: use_sliding_window is true but no window is given")
    elif arch in ("mixtral", "olmoe", "deepseek_v3"):
        if window and arch != "mixtral":
            raise ConfigError(f"sliding_window: {MODEL_TYPES[arch]} has no sliding-window attention")
        return (window,) * layers if window else (0,) * layers
    if arch == "qwen3_moe":
        return (window,) * layers
    kinds = raw.get("layer_types")
    if kinds is None:
        if arch == "gpt_oss":
            kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        else:
            last = raw.get("max_window_layers", 28)
            kinds = ["sliding_attention" if i % 2 == 0 and i < last else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ConfigError(f"layer_types: must list one kind for each of the {layers} layers")
    unknown = sorted({k for k in kinds if k not in ("sliding_attention", "full_attention")}, key=str)
    if unknown:
        raise ConfigError(f"layer_types: {unknown[0]!r} is not supported (sliding_attention or full_attention)")
    if "sliding_attention" in kinds and not window:
        raise ConfigError("sliding_window: layer_types has sliding_attention layers but no window is given")
    return tuple(window if k == "sliding_attention" else 0 for k in kinds)


def _deepseek_v3(raw: dict, need, layers) -> dict:
    """DeepSeek-V3 / Kimi-K2 fields. Values transformers silently ignores but a checkpoint may still
    set to something else (scoring_func, topk_method, moe_layer_freq) are refused, not guessed."""
    for key, computed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if raw.get(key, computed) != computed:
            raise ConfigError(f"{key}: {raw[key]!r} is not supported (DeepseekV3ForCausalLM computes {computed!r})")

    def integer(key: str, low: int = 1) -> int:
        value = need(key)
        if not is_int(value) or value < low:
            raise ConfigError(f"{key}: must be an integer >= {low}, got {value!r}")
        return value

    if "q_lora_rank" not in raw:
        raise ConfigError("q_lora_rank: missing from config.json (null for a plain q_proj)")
    q_lora = 0 if raw["q_lora_rank"] is None else integer("q_lora_rank")
    first_dense = integer("first_k_dense_replace", 0)
    if is_int(layers) and first_dense >= layers:
        raise ConfigError(f"first_k_dense_replace: {first_dense} leaves none of the {layers} layers MoE")
    expert_size = integer("moe_intermediate_size")
    nope, rope = integer("qk_nope_head_dim"), integer("qk_rope_head_dim")
    return dict(
        attention="mla", q_lora_rank=q_lora, kv_lora_rank=integer("kv_lora_rank"), qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=integer("v_head_dim"), head_dim=nope + rope,
        rope_interleave=_flag(raw, "rope_interleave", True), router="grouped_sigmoid",
        n_group=integer("n_group"), topk_group=integer("topk_group"),
        routed_scaling_factor=_number(raw, "routed_scaling_factor", need("routed_scaling_factor")),
        shared_expert_intermediate_size=integer("n_shared_experts", 0) * expert_size, shared_expert_gated=False,
        sparse_layers=tuple(i >= first_dense for i in range(layers)) if is_int(layers) else (),
        dense_intermediate_size=_size(raw, "intermediate_size"))
