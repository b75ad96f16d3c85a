"""Load a Hugging Face-format checkpoint (config.json + safetensors, single or sharded).

Every tensor is read and shape-checked before the model is built, so a bad checkpoint fails
with one line that names the file or tensor, and nothing is left half-loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moectl.engine.models.config import ConfigError, ModelConfig
from moectl.engine.models.decoder import MoEForCausalLM


class CheckpointError(ValueError):
    """The checkpoint on disk is missing, corrupt, or does not match its config."""


class _TensorSource:
    """Name -> tensor over one file or an index of shards, opened lazily."""

    def __init__(self, model_dir: Path):
        single = model_dir / "model.safetensors"
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index.name}: unreadable ({exc})") from None
            self.files = {name: model_dir / shard for name, shard in weight_map.items()}
        elif single.is_file():
            self.files = None
            self.single = single
        else:
            raise CheckpointError(f"model.safetensors: not found in {model_dir}")
        self._handles: dict[Path, object] = {}
        self.used: set[str] = set()
        if self.files is None:
            self._open(single)
            self.names = set(self._handles[single].keys())
        else:
            self.names = set(self.files)

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"{path.name}: shard listed in the index is missing")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"{path.name}: corrupt safetensors file ({exc})") from None
        return self._handles[path]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"checkpoint: tensor {name} is missing")
        self.used.add(name)
        path = self.single if self.files is None else self.files[name]
        handle = self._open(path)
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path.name}: cannot read tensor {name} ({exc})") from None


def _checkpoint_names(cfg: ModelConfig, i: int) -> dict:
    """HF tensor names for layer i, by role."""
    p = f"model.layers.{i}."
    moe = p + ("block_sparse_moe." if cfg.architecture == "mixtral" else "mlp.")
    names = {
        "input_norm": p + "input_layernorm.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj",
        "o": p + "self_attn.o_proj.weight", "o_bias": p + "self_attn.o_proj.bias",
        "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight",
        "moe": moe,
    }
    if cfg.architecture == "mixtral":
        names["expert"] = ("w1", "w3", "w2")  # gate, up, down
    else:
        names["expert"] = ("gate_proj", "up_proj", "down_proj")
    return names


def _stack_experts(src: _TensorSource, moe: str, roles: tuple[str, str, str], num_experts: int):
    fused = moe + "experts.gate_up_proj"
    if fused in src.names:  # transformers v5's fused layout
        return src.get(fused), src.get(moe + "experts.down_proj")
    gate, up, down = roles
    w13 = [torch.cat([src.get(f"{moe}experts.{e}.{gate}.weight"), src.get(f"{moe}experts.{e}.{up}.weight")])
           for e in range(num_experts)]
    w2 = [src.get(f"{moe}experts.{e}.{down}.weight") for e in range(num_experts)]
    return torch.stack(w13), torch.stack(w2)


def read_state_dict(cfg: ModelConfig, model_dir: Path) -> dict[str, torch.Tensor]:
    """Our parameter names -> tensors, read from the checkpoint (not yet shape-checked)."""
    src = _TensorSource(model_dir)
    sd = {"embed.weight": src.get("model.embed_tokens.weight"), "norm.weight": src.get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = src.get("lm_head.weight")
    for i in range(cfg.num_layers):
        n, ours = _checkpoint_names(cfg, i), f"layers.{i}."
        sd[ours + "input_norm.weight"] = src.get(n["input_norm"])
        sd[ours + "post_norm.weight"] = src.get(n["post_norm"])
        sd[ours + "attn.qkv.weight"] = torch.cat([src.get(n[x] + ".weight") for x in "qkv"])
        if cfg.attention_bias:
            sd[ours + "attn.qkv.bias"] = torch.cat([src.get(n[x] + ".bias") for x in "qkv"])
        sd[ours + "attn.o_proj.weight"] = src.get(n["o"])
        if cfg.o_proj_bias:
            sd[ours + "attn.o_proj.bias"] = src.get(n["o_bias"])
        if cfg.qk_norm != "none":
            sd[ours + "attn.q_norm.weight"] = src.get(n["q_norm"])
            sd[ours + "attn.k_norm.weight"] = src.get(n["k_norm"])
        moe, (g, u, d) = n["moe"], n["expert"]
        if cfg.sparse_layers[i]:
            sd[ours + "mlp.gate"] = src.get(moe + "gate.weight")
            sd[ours + "mlp.experts.w13"], sd[ours + "mlp.experts.w2"] = _stack_experts(src, moe, n["expert"], cfg.num_experts)
            if cfg.shared_expert_intermediate_size:
                sd[ours + "mlp.shared_w13"] = torch.cat([src.get(f"{moe}shared_expert.{g}.weight"),
                                                         src.get(f"{moe}shared_expert.{u}.weight")])
                sd[ours + "mlp.shared_w2"] = src.get(f"{moe}shared_expert.{d}.weight")
                sd[ours + "mlp.shared_gate"] = src.get(moe + "shared_expert_gate.weight")
        else:
            sd[ours + "mlp.w13"] = torch.cat([src.get(f"{moe}{g}.weight"), src.get(f"{moe}{u}.weight")])
            sd[ours + "mlp.w2"] = src.get(f"{moe}{d}.weight")
    # a tensor we do not read is a weight we would silently drop: refuse it instead
    unused = sorted(n for n in src.names - src.used if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise CheckpointError(f"checkpoint: tensor {unused[0]}{more} is not part of the "
                              f"{cfg.hf_architecture} layout this config describes")
    return sd


def load_model(model_dir: str | Path, dtype=None, device: str | torch.device = "cpu") -> MoEForCausalLM:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model: {model_dir} is not a directory")
    cfg = ModelConfig.from_dir(model_dir, dtype=dtype)
    sd = read_state_dict(cfg, model_dir)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for name, shape in expected.items():
        got = tuple(sd[name].shape)
        if got != shape:
            raise CheckpointError(f"{name}: checkpoint shape {got} does not match config shape {shape}")
    sd = {k: v.to(device=device, dtype=cfg.dtype) for k, v in sd.items()}
    if cfg.tie_word_embeddings:  # state_dict() lists the tied head too, so strict loading wants it
        sd["lm_head.weight"] = sd["embed.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval().requires_grad_(False)


def save_checkpoint(model: MoEForCausalLM, out_dir: str | Path, dtype: torch.dtype | None = None,
                    extra_config: dict | None = None) -> None:
    """Write our model in the HF layout of its architecture (inverse of read_state_dict)."""
    from safetensors.torch import save_file

    cfg = model.cfg
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(dtype or cfg.dtype).contiguous() for k, v in model.state_dict().items()}
    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_word_embeddings:
        hf["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        n, ours = _checkpoint_names(cfg, i), f"layers.{i}."
        hf[n["input_norm"]] = sd[ours + "input_norm.weight"]
        hf[n["post_norm"]] = sd[ours + "post_norm.weight"]
        for part, t in zip("qkv", sd[ours + "attn.qkv.weight"].split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
            hf[n[part] + ".weight"] = t.contiguous()
        if cfg.attention_bias:
            for part, t in zip("qkv", sd[ours + "attn.qkv.bias"].split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                hf[n[part] + ".bias"] = t.contiguous()
        hf[n["o"]] = sd[ours + "attn.o_proj.weight"]
        if cfg.o_proj_bias:
            hf[n["o_bias"]] = sd[ours + "attn.o_proj.bias"]
        if cfg.qk_norm != "none":
            hf[n["q_norm"]], hf[n["k_norm"]] = sd[ours + "attn.q_norm.weight"], sd[ours + "attn.k_norm.weight"]
        moe, (g, u, d) = n["moe"], n["expert"]
        if cfg.sparse_layers[i]:
            hf[moe + "gate.weight"] = sd[ours + "mlp.gate"]
            if cfg.shared_expert_intermediate_size:
                gate_w, up_w = sd[ours + "mlp.shared_w13"].chunk(2)
                hf[f"{moe}shared_expert.{g}.weight"] = gate_w.contiguous()
                hf[f"{moe}shared_expert.{u}.weight"] = up_w.contiguous()
                hf[f"{moe}shared_expert.{d}.weight"] = sd[ours + "mlp.shared_w2"]
                hf[moe + "shared_expert_gate.weight"] = sd[ours + "mlp.shared_gate"]
            for e in range(cfg.num_experts):
                gate_w, up_w = sd[ours + "mlp.experts.w13"][e].chunk(2)
                hf[f"{moe}experts.{e}.{g}.weight"] = gate_w.contiguous()
                hf[f"{moe}experts.{e}.{u}.weight"] = up_w.contiguous()
                hf[f"{moe}experts.{e}.{d}.weight"] = sd[ours + "mlp.experts.w2"][e].contiguous()
        else:
            gate_w, up_w = sd[ours + "mlp.w13"].chunk(2)
            hf[f"{moe}{g}.weight"], hf[f"{moe}{u}.weight"] = gate_w.contiguous(), up_w.contiguous()
            hf[f"{moe}{d}.weight"] = sd[ours + "mlp.w2"]
    save_file(hf, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**cfg.raw, **(extra_config or {})}, indent=2) + "\n")


__all__ = ["CheckpointError", "ConfigError", "load_model", "read_state_dict", "save_checkpoint"]
