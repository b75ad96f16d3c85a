"""`moectl verify`: this engine against transformers on one checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moectl.cli.common import JSON_OPT, MODEL_OPT, BadInput, handles_errors, model_dir


@handles_errors
def verify(
    model: Path | None = MODEL_OPT,
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Greedy tokens compared per prompt."),
    as_json: bool = JSON_OPT,
):
    """Check this engine against transformers on one checkpoint: per-layer hidden states and logits
    (fp32, max relative error <= 1e-3), reference-text log-likelihood (bf16, <= 5%), and greedy
    generations (fp32, token-identical). Exits 1 when a check fails. Needs moectl\\[reference] (transformers)."""
    from moectl.engine.tools.verify import run_verify

    path = model_dir(model)
    try:
        result = run_verify(path, max_new_tokens=max_new_tokens,
                            log=None if as_json else (lambda m: typer.echo(f"  {m}", err=True)))
    except RuntimeError as exc:  # transformers missing
        raise BadInput(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(result, default=str))
    else:
        t = result["thresholds"]
        typer.echo(f"{result['architecture']} at {path}")
        typer.echo(f"  hidden states + logits (fp32): max rel error {result['max_rel_error']:.2e} "
                   f"(<= {t['max_rel_error']:.0e})")
        typer.echo(f"  log-likelihood (bf16): engine {result['loglik_engine']:.4f}, transformers "
                   f"{result['loglik_reference']:.4f}, rel diff {result['loglik_rel_diff']:.2%} "
                   f"(<= {t['loglik_rel_diff']:.0%})")
        typer.echo(f"  greedy generation (fp32): {result['greedy_matched']} prompts token-identical")
        typer.echo("PASSED" if result["passed"] else "FAILED")
    if not result["passed"]:
        raise typer.Exit(1)
