"""`moectl model info | train`: inspect a checkpoint, re-train the sample model."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moectl.cli.common import JSON_OPT, BadInput, check_seed, emit_json, handles_errors, model_dir, progress
from moectl.cli.engine_options import MODEL_OPT
from moectl.engine import SAMPLE_MODELS, sample_model_dir

model_app = typer.Typer(no_args_is_help=True, help="Inspect or train models.")


@model_app.command("info")
@handles_errors
def model_info(model: Path | None = MODEL_OPT, as_json: bool = JSON_OPT):
    """Print a checkpoint's architecture, size and parameter counts (from config.json alone)."""
    from moectl.engine.models.config import ModelConfig

    path = model_dir(model, config_file=True)
    cfg = ModelConfig.from_dir(path, sizes_only=True)  # a quantized checkpoint too: no weight is read
    folder = path if path.is_dir() else path.parent
    info = {"path": str(path.resolve()), "architecture": cfg.hf_architecture, "layers": cfg.num_layers,
            "experts": cfg.num_experts, "top_k": cfg.top_k, **cfg.param_counts(),
            "hidden_size": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "attention": cfg.attention, "kv_values_per_token_per_layer": _kv_values(cfg),
            "expert_intermediate_size": cfg.expert_intermediate_size,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
            "dtype": str(cfg.dtype).removeprefix("torch."),
            "quantization": cfg.quantization.describe() if cfg.quantization else None,
            "tokenizer": (folder / "tokenizer.json").is_file()}
    _print_facts(info, as_json, width=32)


@model_app.command("list")
@handles_errors
def model_list(as_json: bool = JSON_OPT):
    """The shipped models, by the name every command's --model takes: what each is, its size
    and parameters (from its config.json), and where it lies."""
    from moectl.engine.models.config import ModelConfig

    rows = []
    for name, (_folder, about) in SAMPLE_MODELS.items():
        path = sample_model_dir(name)
        row = {"name": name, "default": name == "sample", "about": about, "path": str(path.resolve())}
        if (path / "config.json").is_file():
            cfg = ModelConfig.from_dir(path)
            row.update(architecture=cfg.hf_architecture, **cfg.param_counts(),
                       bytes_on_disk=sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
        else:
            row["missing"] = "not in this installation"
        rows.append(row)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for row in rows:
        mark = " (default)" if row["default"] else ""
        size = (f"{row['architecture']}, {row['params_total'] / 1e6:.1f}M params ({row['params_active'] / 1e6:.1f}M "
                f"active), {row['bytes_on_disk'] / 2**20:.1f} MiB" if "missing" not in row else row["missing"])
        typer.echo(f"{row['name']}{mark}: {row['about']}\n    {size}\n    {row['path']}")


def _print_facts(info: dict, as_json: bool, width: int) -> None:
    if as_json:
        typer.echo(json.dumps(info))
        return
    for key, value in info.items():
        shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else value
        typer.echo(f"{key:>{width}}: {shown}")


def _kv_values(cfg) -> int:
    heads, k_width, v_width = cfg.kv_entry()
    return heads * (k_width + v_width)


@model_app.command("make-tiny")
@handles_errors
def model_make_tiny(
    like: Path = typer.Option(..., "--like", help="config.json (or a checkpoint directory) whose architecture and "
                                                  "options to copy, e.g. docs/configs/k3-3t-1m.json."),
    out: Path = typer.Option(..., "--out", help="Directory to write the random checkpoint to."),
    layers: int | None = typer.Option(None, "--layers", show_default=False,
                                      help="Decoder layers (dense first layers kept, at most one) [default: 4, "
                                           "or the config's when fewer]."),
    hidden: int = typer.Option(64, "--hidden", help="hidden_size (a multiple of 16)."),
    experts: int | None = typer.Option(None, "--experts", show_default=False,
                                       help="Routed experts per MoE layer [default: 16, or the config's when fewer]."),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = JSON_OPT,
):
    """Write a scaled-down random checkpoint with a config's layer kinds (attention, routing, RoPE
    scaling, shared and dense layers), with the sample model's tokenizer: runs in the engine,
    the console and the server. Random weights: for plumbing and placement, not for text. A
    quantized config (fp8, mxfp4) gives a float32 checkpoint: the engine runs no quantized weights."""
    from moectl.engine.tools.make_tiny import make_tiny

    check_seed(seed)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out: {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        raise BadInput(f"--out: {out} exists and is not empty")
    info = make_tiny(like, out, layers=layers, hidden=hidden, experts=experts, seed=seed,
                     tokenizer_dir=sample_model_dir())
    _print_facts(info, as_json, width=16)


@model_app.command("train")
@handles_errors
def model_train(
    out: Path = typer.Option(..., "--out", help="Output directory (required: there is no default). The shipped "
                                                "sample model's own folder is refused unless --replace-sample-model."),
    replace_sample: bool = typer.Option(False, "--replace-sample-model",
                                        help="Allow --out to be the shipped sample model's folder and overwrite it "
                                             "(how the shipped model is rebuilt)."),
    steps: int = typer.Option(3000, "--steps", help="Optimizer steps."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training window."),
    batch_size: int = typer.Option(16, "--batch-size"),
    lr: float = typer.Option(3e-3, "--lr", help="Peak learning rate."),
    arch: str = typer.Option("mixtral", "--arch", help="mixtral (the sample model) or deepseek_v3 (sample-dsv3: "
                                                       "MLA, grouped sigmoid routing with DeepSeek-V3's bias "
                                                       "balancing, a shared expert, a dense first layer)."),
    aux_coef: float | None = typer.Option(None, "--aux-coef", help="Weight of the load-balancing loss [default: "
                                                                   "0.003 for mixtral, 0.0001 for deepseek_v3]."),
    seed: int = typer.Option(0, "--seed"),
    time_budget: float | None = typer.Option(None, "--time-budget",
                                             help="Seconds; the schedule is fitted to it and the run saved when "
                                                  "spent (then not bit-reproducible). The shipped model used 2640."),
    eval_every: int = typer.Option(0, "--eval-every", help="Steps between validation evals (0: only at the end)."),
    as_json: bool = JSON_OPT,
):
    """Re-train the sample model (tokenizer, model, model card) from the Python stdlib's source."""
    from moectl.engine.tools.train import ARCHS, check_train_options, train_sample_model

    if arch not in ARCHS:
        raise BadInput(f"--arch: must be one of {', '.join(ARCHS)}, got {arch!r}")
    if aux_coef is None:
        aux_coef = ARCHS[arch][1]
    if not 0 <= aux_coef < 1:
        raise BadInput(f"--aux-coef: must be in [0, 1), got {aux_coef}")

    check_train_options(steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, time_budget_s=time_budget,
                        eval_every=eval_every)
    check_seed(seed)
    _check_train_out(out, replace_sample)
    stats = train_sample_model(out, steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, aux_coef=aux_coef,
                               seed=seed, time_budget_s=time_budget, eval_every=eval_every, arch=arch,
                               log=progress(as_json))
    emit_json(stats, as_json)


def _check_train_out(out: Path, replace_sample: bool) -> None:
    """--out: a directory (new or existing), and never the shipped sample model by accident."""
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out: {out} exists and is not a directory")
    target = out.resolve()
    for name in SAMPLE_MODELS:
        shipped = sample_model_dir(name).resolve()
        if (target == shipped or shipped in target.parents) and not replace_sample:
            raise BadInput(f"--out: {out} is the shipped sample model {name}'s folder; add --replace-sample-model "
                           f"to overwrite it, or give another directory")
