"""`moectl verify`: this engine against transformers on one checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moectl.cli.common import JSON_OPT, BadInput, handles_errors, model_dir
from moectl.cli.engine_options import MODEL_OPT


@handles_errors
def verify(
    model: Path | None = MODEL_OPT,
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Greedy tokens compared per prompt."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16: bf16/fp16 also compare the per-layer "
                                                      "hidden states and logits in that dtype."),
    as_json: bool = JSON_OPT,
):
    """Check this engine against transformers on one checkpoint: per-layer hidden states and logits
    (fp32, max relative error <= 1e-3), reference-text log-likelihood (bf16, <= 5%), and greedy
    generations (fp32, token-identical); with --dtype bf16/fp16 the hidden states and logits in that
    dtype too. Exits 1 when a check fails. Needs moectl\\[reference] (transformers)."""
    from moectl.engine.models.config import parse_dtype
    from moectl.engine.tools.verify import ReferenceMissing, run_verify

    try:
        numerics_dtype = parse_dtype(dtype)
    except ValueError as exc:
        raise BadInput(f"--dtype: {str(exc).partition(': ')[2]}") from None
    path = model_dir(model)
    try:
        result = run_verify(path, max_new_tokens=max_new_tokens, dtype=numerics_dtype,
                            log=None if as_json else (lambda m: typer.echo(f"  {m}", err=True)))
    except ReferenceMissing as exc:  # only this: the engine's own RuntimeErrors are failures (exit 1)
        raise BadInput(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(result, default=str))
    else:
        t = result["thresholds"]
        typer.echo(f"{result['architecture']} at {path}")
        typer.echo(f"  hidden states + logits (fp32): max rel error {result['max_rel_error']:.2e} "
                   f"(<= {t['max_rel_error']:.0e})")
        if result["half"] is not None:
            half = result["half"]
            typer.echo(f"  hidden states + logits ({half['dtype']}): median per-token rel error "
                       f"{half['median_rel_error']:.2e} (<= {t['median_rel_error']:.0e})")
        typer.echo(f"  log-likelihood (bf16): engine {result['loglik_engine']:.4f}, transformers "
                   f"{result['loglik_reference']:.4f}, rel diff {result['loglik_rel_diff']:.2%} "
                   f"(<= {t['loglik_rel_diff']:.0%})")
        typer.echo(f"  greedy generation (fp32): {result['greedy_matched']} prompts token-identical")
        typer.echo("PASSED" if result["passed"] else "FAILED")
    if not result["passed"]:
        raise typer.Exit(1)
