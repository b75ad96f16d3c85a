"""`moectl model info | train`: inspect a checkpoint, re-train the sample model."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moectl.cli.common import JSON_OPT, MODEL_OPT, emit_json, handles_errors, model_dir, progress

model_app = typer.Typer(no_args_is_help=True, help="Inspect or train models.")


@model_app.command("info")
@handles_errors
def model_info(model: Path | None = MODEL_OPT, as_json: bool = JSON_OPT):
    """Print a checkpoint's architecture, size and parameter counts (from config.json alone)."""
    from moectl.engine.models.config import ModelConfig

    path = model_dir(model)
    cfg = ModelConfig.from_dir(path)
    info = {"path": str(path.resolve()), "architecture": cfg.hf_architecture, "layers": cfg.num_layers,
            "experts": cfg.num_experts, "top_k": cfg.top_k, **cfg.param_counts(),
            "hidden_size": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "expert_intermediate_size": cfg.expert_intermediate_size,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
            "dtype": str(cfg.dtype).removeprefix("torch."), "tokenizer": (path / "tokenizer.json").is_file()}
    if as_json:
        typer.echo(json.dumps(info))
        return
    for key, value in info.items():
        typer.echo(f"{key:>32}: {value:,}" if isinstance(value, int) and not isinstance(value, bool)
                   else f"{key:>32}: {value}")


@model_app.command("train")
@handles_errors
def model_train(
    out: Path = typer.Option(..., "--out", help="Output directory (the shipped model is rebuilt with "
                                                "--out engine/sample_model)."),
    steps: int = typer.Option(3000, "--steps", help="Optimizer steps."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training window."),
    batch_size: int = typer.Option(16, "--batch-size"),
    lr: float = typer.Option(3e-3, "--lr", help="Peak learning rate."),
    aux_coef: float = typer.Option(0.003, "--aux-coef", help="Weight of the load-balancing loss."),
    seed: int = typer.Option(0, "--seed"),
    time_budget: float | None = typer.Option(None, "--time-budget",
                                             help="Seconds; the schedule is fitted to it and the run saved when "
                                                  "spent (then not bit-reproducible). The shipped model used 2640."),
    eval_every: int = typer.Option(0, "--eval-every", help="Steps between validation evals (0: only at the end)."),
    as_json: bool = JSON_OPT,
):
    """Re-train the sample model (tokenizer, model, model card) from the Python stdlib's source."""
    from moectl.engine.tools.train import train_sample_model

    stats = train_sample_model(out, steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, aux_coef=aux_coef,
                               seed=seed, time_budget_s=time_budget, eval_every=eval_every,
                               log=progress(as_json))
    emit_json(stats, as_json)
