"""Load a Hugging Face-format checkpoint (config.json + safetensors, single or sharded).

Every tensor is read and shape-checked before the model is built, so a bad checkpoint fails
with one line that names the file or tensor, and nothing is left half-loaded.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import SafetensorError, safe_open

from moectl.engine.models.config import ConfigError, ModelConfig
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.models.moe import StackedExperts


class CheckpointError(ValueError):
    """The checkpoint on disk is missing, corrupt, or does not match its config."""


# the float dtypes a weight may be stored in: each converts to the model dtype without losing its meaning
# (an integer or fp8 tensor would need scales this loader does not read, so casting it would be garbage)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def shard_map(model_dir: Path) -> dict[str, Path] | None:
    """Tensor name -> shard file from model.safetensors.index.json; None for a single-file checkpoint.
    Every shard must lie inside model_dir: the index is checked before any shard is opened."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: (shard, model_dir / shard) for name, shard in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index.name}: unreadable ({exc})") from None
    for name, (shard, _) in files.items():
        _check_shard_entry(model_dir, index.name, name, shard)
    return {name: path for name, (_, path) in files.items()}


def _check_shard_entry(model_dir: Path, index: str, name: str, shard) -> None:
    """A shard named by the index is a plain file name (or a path below model_dir) and, symlinks
    followed, stays in model_dir, so a crafted index cannot make us read any other file."""
    where = f"{index}: weight_map[{name!r}]"
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{where}: must be a shard file name, got {shard!r}")
    for pure in (PurePosixPath(shard), PureWindowsPath(shard)):
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            raise CheckpointError(f"{where}: {shard!r} points outside the checkpoint folder")
    root, target = model_dir.resolve(), (model_dir / shard).resolve()
    if not (target.is_relative_to(root) or _in_hub_cache_blobs(root, target)):
        raise CheckpointError(f"{where}: {shard!r} is a link to {target}, outside the checkpoint folder")


def _in_hub_cache_blobs(root: Path, target: Path) -> bool:
    """The Hugging Face hub cache keeps a snapshot's files as links from snapshots/<rev>/ into the
    repository's blobs/ folder: those links stay inside the downloaded repository."""
    return root.parent.name == "snapshots" and target.is_relative_to(root.parent.parent / "blobs")


class _TensorSource:
    """Name -> tensor over one file or an index of shards, opened lazily."""

    def __init__(self, model_dir: Path):
        single = model_dir / "model.safetensors"
        self.files = shard_map(model_dir)
        if self.files is None and not single.is_file():
            raise CheckpointError(f"model.safetensors: not found in {model_dir}")
        self.single = single
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
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path.name}: cannot read tensor {name} ({exc})") from None
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{name}: dtype {str(tensor.dtype).removeprefix('torch.')} is not a float weight "
                                  "(float32, bfloat16, float16 or float64; quantised checkpoints are not supported)")
        return tensor


def cat_rows(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The named checkpoint tensors stacked along their rows (q/k/v, gate/up): a tensor whose other
    dimensions differ from the first's is named, not left to torch.cat's error."""
    (first, ref), *rest = tensors.items()
    for name, t in rest:
        if t.dim() != ref.dim() or t.shape[1:] != ref.shape[1:]:
            raise CheckpointError(f"{name}: checkpoint shape {tuple(t.shape)} does not fit with {first}'s "
                                  f"{tuple(ref.shape)}")
    return torch.cat(list(tensors.values()))


# MLA tensors: our name under layers.{i}.attn. -> the checkpoint's under model.layers.{i}.self_attn.
MLA_NAMES = {"q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj", "q_proj": "q_proj",
             "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
             "o_proj": "o_proj"}


def _rope_rows(cfg: ModelConfig, name: str, inverse: bool = False) -> torch.Tensor | None:
    """The row order that turns a checkpoint's interleaved RoPE rows (rope_interleave) into the
    half-split layout our rotation uses (or back, with inverse): transformers' interleaved
    rotation equals de-interleaving, then the half-split one. None: the tensor keeps its rows."""
    dr = cfg.qk_rope_head_dim
    perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
    if inverse:
        perm = torch.argsort(perm)
    if name in ("q_proj", "q_b_proj"):  # per head: qk_nope rows, then the rope rows
        qk = cfg.head_dim
        head = torch.cat([torch.arange(cfg.qk_nope_head_dim), cfg.qk_nope_head_dim + perm])
        return torch.cat([h * qk + head for h in range(cfg.num_heads)])
    if name == "kv_a_proj":  # the latent's rows, then the shared rope key's
        return torch.cat([torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + perm])
    return None


def _mla_parts(cfg: ModelConfig) -> list[str]:
    parts = ["q_a_proj", "q_a_norm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
    return [*parts, "kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj"]


def _mla_has_bias(cfg: ModelConfig, part: str) -> bool:
    return cfg.attention_bias and part in ("q_a_proj", "kv_a_proj", "o_proj")


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


def read_experts(cfg: ModelConfig, layer: int, names: set[str], get, experts: list[int] | None = None):
    """Layer `layer`'s routed experts as our stacks (w13 [n, 2I, H(+1)], w2 [n, H, I(+1)]), all of
    them or only `experts`. get(name, rows): the checkpoint tensor `name`, or only rows `rows` of a
    stacked one (None: all of it); names: every tensor name in the checkpoint."""
    n = _checkpoint_names(cfg, layer)
    moe, (gate, up, down) = n["moe"], n["expert"]
    if cfg.architecture == "gpt_oss":
        return _gpt_oss_stack(moe, *(get(moe + "experts." + t, experts) for t in
                                     ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")))
    if moe + "experts.gate_up_proj" in names:  # transformers v5's fused layout
        return get(moe + "experts.gate_up_proj", experts), get(moe + "experts.down_proj", experts)
    chosen = range(cfg.num_experts) if experts is None else experts
    h, i = cfg.hidden_size, cfg.expert_intermediate_size

    def expert(e: int, role: str, shape: tuple[int, int]) -> torch.Tensor:
        # one expert of the wrong shape would otherwise stop torch.stack with a message naming none
        name = f"{moe}experts.{e}.{role}.weight"
        t = get(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{name}: checkpoint shape {tuple(t.shape)} does not match config shape {shape}")
        return t

    w13 = [torch.cat([expert(e, gate, (i, h)), expert(e, up, (i, h))]) for e in chosen]
    return torch.stack(w13), torch.stack([expert(e, down, (h, i)) for e in chosen])


def expert_tensor_names(cfg: ModelConfig, layer: int, names: set[str]) -> list[str]:
    """The checkpoint tensors that hold layer `layer`'s routed experts."""
    n = _checkpoint_names(cfg, layer)
    moe, roles = n["moe"], n["expert"]
    fused = [moe + "experts." + t for t in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]
    if cfg.architecture == "gpt_oss":
        return fused
    if fused[0] in names:  # transformers v5's fused layout: no biases
        return [fused[0], fused[2]]
    return [f"{moe}experts.{e}.{r}.weight" for e in range(cfg.num_experts) for r in roles]


def _read_attention(cfg: ModelConfig, src: _TensorSource, n: dict, ours: str, sd: dict) -> None:
    if cfg.attention == "mla":
        base = n["q"].rsplit(".", 1)[0] + "."  # model.layers.{i}.self_attn.
        for part in _mla_parts(cfg):
            rows = _rope_rows(cfg, part) if cfg.rope_interleave else None
            for kind in ("weight", "bias") if _mla_has_bias(cfg, part) else ("weight",):
                t = src.get(f"{base}{MLA_NAMES[part]}.{kind}")
                # a tensor of the wrong size keeps its rows: the shape check names it below
                sd[f"{ours}attn.{part}.{kind}"] = t if rows is None or t.shape[0] != rows.numel() else t[rows]
        return
    sd[ours + "attn.qkv.weight"] = cat_rows({n[x] + ".weight": src.get(n[x] + ".weight") for x in "qkv"})
    if cfg.attention_bias:
        sd[ours + "attn.qkv.bias"] = cat_rows({n[x] + ".bias": src.get(n[x] + ".bias") for x in "qkv"})
    sd[ours + "attn.o_proj.weight"] = src.get(n["o"])
    if cfg.o_proj_bias:
        sd[ours + "attn.o_proj.bias"] = src.get(n["o_bias"])
    if cfg.qk_norm != "none":
        sd[ours + "attn.q_norm.weight"] = src.get(n["q_norm"])
        sd[ours + "attn.k_norm.weight"] = src.get(n["k_norm"])
    if cfg.attention_sinks:
        sd[ours + "attn.sinks"] = src.get(n["q"].rsplit(".", 1)[0] + ".sinks")


def _gpt_oss_stack(moe: str, gu, gu_bias, down, down_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's fused experts -> our stacks with the biases as an extra input column:
    gate_up_proj [E, H, 2I] holds gate and up in interleaved columns (x @ W, not a linear's
    [out, in]); down_proj [E, I, H]."""
    if gu.dim() != 3 or down.dim() != 3 or gu_bias.dim() != 2 or down_bias.dim() != 2:
        raise CheckpointError(f"{moe}experts: expected stacked 3-D weights and 2-D biases")
    w13 = torch.cat([gu[:, :, 0::2], gu[:, :, 1::2]], dim=2).transpose(1, 2)  # [E, 2I, H]: gate rows, then up
    b13 = torch.cat([gu_bias[:, 0::2], gu_bias[:, 1::2]], dim=1)
    w2 = down.transpose(1, 2)  # [E, H, I]
    return torch.cat([w13, b13[..., None]], dim=2), torch.cat([w2, down_bias[..., None]], dim=2)


def _write_gpt_oss_experts(w13: torch.Tensor, w2: torch.Tensor, moe: str, hf: dict) -> None:
    gate_up, bias = w13[..., :-1].transpose(1, 2), w13[..., -1]  # [E, H, 2I] with gate then up columns
    half = gate_up.shape[-1] // 2
    inter = torch.stack([gate_up[..., :half], gate_up[..., half:]], dim=-1).flatten(-2)
    inter_bias = torch.stack([bias[:, :half], bias[:, half:]], dim=-1).flatten(-2)
    hf[moe + "experts.gate_up_proj"], hf[moe + "experts.gate_up_proj_bias"] = inter.contiguous(), inter_bias.contiguous()
    hf[moe + "experts.down_proj"] = w2[..., :-1].transpose(1, 2).contiguous()
    hf[moe + "experts.down_proj_bias"] = w2[..., -1].contiguous()


def _shared_names(cfg: ModelConfig, moe: str) -> str:
    return moe + ("shared_experts." if cfg.architecture == "deepseek_v3" else "shared_expert.")


def read_state_dict(cfg: ModelConfig, model_dir: Path, experts: bool = True) -> dict[str, torch.Tensor]:
    """Our parameter names -> tensors, read from the checkpoint (not yet shape-checked).
    experts=False: the routed experts are left on disk (their names are still checked)."""
    src = _TensorSource(model_dir)

    def get(name: str, rows=None) -> torch.Tensor:
        return src.get(name)
    sd = {"embed.weight": src.get("model.embed_tokens.weight"), "norm.weight": src.get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = src.get("lm_head.weight")
    for i in range(cfg.num_layers):
        n, ours = _checkpoint_names(cfg, i), f"layers.{i}."
        sd[ours + "input_norm.weight"] = src.get(n["input_norm"])
        sd[ours + "post_norm.weight"] = src.get(n["post_norm"])
        _read_attention(cfg, src, n, ours, sd)
        moe, (g, u, d) = n["moe"], n["expert"]
        if cfg.sparse_layers[i]:
            if cfg.architecture == "gpt_oss":
                sd[ours + "mlp.gate"], sd[ours + "mlp.gate_bias"] = src.get(moe + "router.weight"), src.get(moe + "router.bias")
            else:
                sd[ours + "mlp.gate"] = src.get(moe + "gate.weight")
            if cfg.router == "grouped_sigmoid":
                sd[ours + "mlp.e_score_correction_bias"] = src.get(moe + "gate.e_score_correction_bias")
            if experts:
                sd[ours + "mlp.experts.w13"], sd[ours + "mlp.experts.w2"] = read_experts(cfg, i, src.names, get)
            else:
                missing = [t for t in expert_tensor_names(cfg, i, src.names) if t not in src.names]
                if missing:
                    raise CheckpointError(f"checkpoint: tensor {missing[0]} is missing")
                src.used.update(expert_tensor_names(cfg, i, src.names))
            if cfg.shared_expert_intermediate_size:
                shared = _shared_names(cfg, moe)
                sd[ours + "mlp.shared_w13"] = cat_rows({t: src.get(t) for t in (f"{shared}{g}.weight", f"{shared}{u}.weight")})
                sd[ours + "mlp.shared_w2"] = src.get(f"{shared}{d}.weight")
                if cfg.shared_expert_gated:
                    sd[ours + "mlp.shared_gate"] = src.get(moe + "shared_expert_gate.weight")
        else:
            sd[ours + "mlp.w13"] = cat_rows({t: src.get(t) for t in (f"{moe}{g}.weight", f"{moe}{u}.weight")})
            sd[ours + "mlp.w2"] = src.get(f"{moe}{d}.weight")
    # a tensor we do not read is a weight we would silently drop: refuse it instead
    unused = sorted(n for n in src.names - src.used if not n.endswith("rotary_emb.inv_freq")
                    and not _is_mtp_layer(cfg, n))
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise CheckpointError(f"checkpoint: tensor {unused[0]}{more} is not part of the "
                              f"{cfg.hf_architecture} layout this config describes")
    return sd


def _is_mtp_layer(cfg: ModelConfig, name: str) -> bool:
    """DeepSeek-V3's multi-token-prediction module sits in layers past num_hidden_layers; inference
    without speculative decoding does not use it (transformers skips it too)."""
    if cfg.architecture != "deepseek_v3" or not name.startswith("model.layers."):
        return False
    index = name.split(".", 3)[2]
    return index.isdigit() and int(index) >= cfg.num_layers


def _keeps_fp32(cfg: ModelConfig, name: str) -> bool:
    """DeepSeek-V3's router weight and correction bias stay fp32 whatever the model dtype
    (transformers' _keep_in_fp32_modules_strict): in bf16 the sigmoid scores would tie."""
    return cfg.router == "grouped_sigmoid" and name.endswith(("mlp.gate", "mlp.e_score_correction_bias"))


def load_model(model_dir: str | Path, dtype=None, device: str | torch.device = "cpu",
               experts: bool = True) -> MoEForCausalLM:
    """experts=False: every weight but the routed experts, which stay on disk (their stacks are
    left on the meta device; the disk tier, experts/disk_tier.py, reads them on demand)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model: {model_dir} is not a directory")
    cfg = ModelConfig.from_dir(model_dir, dtype=dtype)
    sd = read_state_dict(cfg, model_dir, experts=experts)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    if not experts:
        expected = {k: v for k, v in expected.items() if ".mlp.experts." not in k}
    for name, shape in expected.items():
        got = tuple(sd[name].shape)
        if got != shape:
            raise CheckpointError(f"{name}: checkpoint shape {got} does not match config shape {shape}")
    sd = {k: v.to(device=device, dtype=torch.float32 if _keeps_fp32(cfg, k) else cfg.dtype) for k, v in sd.items()}
    if cfg.tie_word_embeddings:  # state_dict() lists the tied head too, so strict loading wants it
        sd["lm_head.weight"] = sd["embed.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if unexpected or any(experts or ".mlp.experts." not in k for k in missing):
        raise CheckpointError(f"checkpoint: {(unexpected or missing)[0]} does not match the model")
    if not experts:  # the stacks left on meta still say the dtype the tiers fill caches in
        for module in model.modules():
            if isinstance(module, StackedExperts):
                module.w13 = torch.nn.Parameter(module.w13.to(cfg.dtype), requires_grad=False)
                module.w2 = torch.nn.Parameter(module.w2.to(cfg.dtype), requires_grad=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval().requires_grad_(False)


def _write_attention(cfg: ModelConfig, sd: dict, n: dict, ours: str, hf: dict) -> None:
    if cfg.attention == "mla":
        base = n["q"].rsplit(".", 1)[0] + "."
        for part in _mla_parts(cfg):
            rows = _rope_rows(cfg, part, inverse=True) if cfg.rope_interleave else None
            for kind in ("weight", "bias") if _mla_has_bias(cfg, part) else ("weight",):
                t = sd[f"{ours}attn.{part}.{kind}"]
                hf[f"{base}{MLA_NAMES[part]}.{kind}"] = (t if rows is None else t[rows]).contiguous()
        return
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
    if cfg.attention_sinks:
        hf[n["q"].rsplit(".", 1)[0] + ".sinks"] = sd[ours + "attn.sinks"]


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
        _write_attention(cfg, sd, n, ours, hf)
        moe, (g, u, d) = n["moe"], n["expert"]
        if cfg.sparse_layers[i] and cfg.architecture == "gpt_oss":
            hf[moe + "router.weight"], hf[moe + "router.bias"] = sd[ours + "mlp.gate"], sd[ours + "mlp.gate_bias"]
            _write_gpt_oss_experts(sd[ours + "mlp.experts.w13"], sd[ours + "mlp.experts.w2"], moe, hf)
        elif cfg.sparse_layers[i]:
            hf[moe + "gate.weight"] = sd[ours + "mlp.gate"]
            if cfg.router == "grouped_sigmoid":
                hf[moe + "gate.e_score_correction_bias"] = sd[ours + "mlp.e_score_correction_bias"].float()
            if cfg.shared_expert_intermediate_size:
                shared = _shared_names(cfg, moe)
                gate_w, up_w = sd[ours + "mlp.shared_w13"].chunk(2)
                hf[f"{shared}{g}.weight"] = gate_w.contiguous()
                hf[f"{shared}{u}.weight"] = up_w.contiguous()
                hf[f"{shared}{d}.weight"] = sd[ours + "mlp.shared_w2"]
                if cfg.shared_expert_gated:
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
