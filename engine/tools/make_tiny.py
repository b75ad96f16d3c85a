"""`moectl model make-tiny --like CONFIG`: a scaled-down random checkpoint with a config's layer kinds.

The architecture and every option that changes the computation stay as the config has them
(MLA with or without a q LoRA, YaRN, grouped routing, shared experts, dense first layers, biases,
tied embeddings); only the widths and counts shrink. The sample model's tokenizer is copied in
(and the vocabulary sized to it), so the engine, the console and the server run on the result.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from moectl.engine.models.config import ConfigError, ModelConfig, read_config_json
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.models.loader import save_checkpoint


def _deepseek(raw: dict, hidden: int, experts: int) -> dict:
    groups = raw.get("n_group") or 1
    while groups > 1 and (experts % groups or experts // groups < 2):
        groups //= 2
    top_k = min(raw["num_experts_per_tok"], max(1, experts // 4))
    keep = max(1, min(raw.get("topk_group") or 1, groups))
    while keep < groups and keep * (experts // groups) < top_k:
        keep += 1
    return dict(
        n_routed_experts=experts, num_experts_per_tok=top_k, n_group=groups, topk_group=keep,
        moe_intermediate_size=hidden // 2, intermediate_size=2 * hidden,
        q_lora_rank=None if raw.get("q_lora_rank") is None else hidden // 2 + hidden // 4,
        kv_lora_rank=hidden // 2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        first_k_dense_replace=min(raw.get("first_k_dense_replace", 0), 1), num_key_value_heads=4,
        num_nextn_predict_layers=0)


def _generic(raw: dict, cfg: ModelConfig, hidden: int, experts: int) -> dict:
    out = dict(num_key_value_heads=min(cfg.num_kv_heads, 2), head_dim=hidden // 4,
               num_experts_per_tok=min(cfg.top_k, max(1, experts // 2)))
    for key in ("num_local_experts", "num_experts"):
        if key in raw:
            out[key] = experts
    if "moe_intermediate_size" in raw:
        out["moe_intermediate_size"] = hidden
        out["intermediate_size"] = 2 * hidden
        if raw.get("shared_expert_intermediate_size"):
            out["shared_expert_intermediate_size"] = hidden + hidden // 2
    else:
        out["intermediate_size"] = hidden + hidden // 2
    if raw.get("mlp_only_layers"):
        out["mlp_only_layers"] = [1]
    return out


DEFAULT_LAYERS, DEFAULT_EXPERTS = 4, 16  # or the config's, when it has fewer


def check_options(layers: int | None, hidden: int, experts: int | None) -> None:
    """The options as given, before any config is read: their errors come first, naming the value."""
    if layers is not None and layers < 1:
        raise ConfigError(f"--layers: must be at least 1, got {layers}")
    if hidden % 16 or hidden < 32:
        raise ConfigError(f"--hidden: must be a multiple of 16 and at least 32, got {hidden}")
    if experts is not None and experts < 2:
        raise ConfigError(f"--experts: must be at least 2, got {experts}")


def tiny_config(raw: dict, *, layers: int | None = None, hidden: int = 64, experts: int | None = None,
                vocab_size: int, max_positions: int = 4096) -> dict:
    """config.json of the scaled-down model: the same architecture and options, small shapes.
    layers, experts None: DEFAULT_LAYERS and DEFAULT_EXPERTS, or the config's when fewer. A
    quantization_config is dropped: the tiny model is float32, which the engine runs."""
    check_options(layers, hidden, experts)
    # refuses what the engine cannot run, naming the field; a quantized config is read for its shapes
    cfg = ModelConfig.from_hf(raw, sizes_only=True)
    if experts is not None and experts > cfg.num_experts:
        raise ConfigError(f"--experts: must be in 2..{cfg.num_experts} (the config's routed experts), got {experts}")
    if layers is not None and layers > cfg.num_layers:
        raise ConfigError(f"--layers: must be in 1..{cfg.num_layers} (the config's layers), got {layers}")
    if cfg.num_experts < 2:
        raise ConfigError(f"--like: {cfg.num_experts} routed expert a layer; a tiny model of it needs at least 2")
    layers = min(DEFAULT_LAYERS, cfg.num_layers) if layers is None else layers
    experts = min(DEFAULT_EXPERTS, cfg.num_experts) if experts is None else experts
    out = {k: v for k, v in raw.items() if not k.startswith("_") and k != "quantization_config"}
    out.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, vocab_size=vocab_size,
               max_position_embeddings=min(cfg.max_position_embeddings, max_positions), dtype="float32")
    out.pop("torch_dtype", None)
    out.update(_deepseek(raw, hidden, experts) if cfg.architecture == "deepseek_v3" else _generic(raw, cfg, hidden, experts))
    if cfg.architecture == "deepseek_v3" and layers == 1:
        out["first_k_dense_replace"] = 0
    if isinstance(raw.get("layer_types"), list):  # the first layers' kinds (gpt-oss: sliding, full, ...)
        out["layer_types"] = raw["layer_types"][:layers]
    for key in ("rope_scaling", "rope_parameters"):  # keep YaRN, over the shorter context
        spec = raw.get(key)
        if isinstance(spec, dict) and spec.get("original_max_position_embeddings"):
            factor = cfg.rope_scaling.factor
            out[key] = dict(spec, original_max_position_embeddings=max(16, int(out["max_position_embeddings"] / factor)))
    for key in ("bos_token_id", "eos_token_id"):
        out[key] = {"bos_token_id": 0, "eos_token_id": 1}[key]  # the sample tokenizer's <s> and </s>
    # the source's other ids (pad 199999 for gpt-oss, 163839 for Kimi) name tokens of its own
    # vocabulary: in this one they would be out of range (transformers refuses a padding_idx
    # beyond the embedding), so they are dropped, and the result says which
    dropped = sorted(key for key, value in out.items()
                     if key.endswith("_token_id") and not _token_ids_fit(value, vocab_size))
    out.update(dict.fromkeys(dropped, None))
    ModelConfig.from_hf(out)  # the result must itself be a valid config, one the engine runs
    # make_tiny reports these; they are not written to config.json
    return {**out, "_dropped_token_ids": dropped, "_quantization": cfg.quantization}


def _token_ids_fit(value, vocab_size: int) -> bool:
    ids = value if isinstance(value, list) else [value]
    return all(i is None or (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size) for i in ids)


def make_tiny(like: str | Path, out_dir: str | Path, *, layers: int | None = None, hidden: int = 64,
              experts: int | None = None, seed: int = 0, tokenizer_dir: str | Path) -> dict:
    """Write a random checkpoint shaped like `like` (a config.json or a checkpoint directory) to
    out_dir, with the tokenizer of tokenizer_dir. Returns `model info`-style facts about it."""
    like, out_dir, tokenizer_dir = Path(like), Path(out_dir), Path(tokenizer_dir)
    check_options(layers, hidden, experts)
    raw = read_config_json(like if like.is_file() else like / "config.json", what="--like")
    vocab = read_config_json(tokenizer_dir / "config.json")["vocab_size"]
    tiny = tiny_config(raw, layers=layers, hidden=hidden, experts=experts, vocab_size=vocab)
    dropped = tiny.pop("_dropped_token_ids", [])
    quantization = tiny.pop("_quantization", None)
    model = MoEForCausalLM(ModelConfig.from_hf(tiny))
    # std 1/sqrt(hidden): activations keep their scale through the layers, so routing is not a near-tie
    model.init_weights(std=1.0 / math.sqrt(hidden), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, out_dir)
    (out_dir / "config.json").write_text(json.dumps(tiny, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    cfg = ModelConfig.from_dir(out_dir)
    return {"out": str(out_dir), "architecture": cfg.hf_architecture, "model_type": tiny.get("model_type"),
            "layers": cfg.num_layers, "dense_layers": cfg.num_layers - sum(cfg.sparse_layers),
            "experts": cfg.num_experts, "top_k": cfg.top_k, "attention": cfg.attention,
            "rope": cfg.rope_scaling.kind, "token_ids_dropped": dropped, "dtype": str(cfg.dtype).removeprefix("torch."),
            **({"quantization": f"--like's {quantization.describe()} not kept: this checkpoint is "
                                f"{str(cfg.dtype).removeprefix('torch.')}, the engine runs no quantized weights"}
               if quantization else {}),
            **cfg.param_counts()}
