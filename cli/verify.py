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
                                                      "hidden states and logits in that dtype, and report the layers "
                                                      "and operators that overflow or lose accuracy against fp32."),
    mixed_precision: bool = typer.Option(False, "--mixed-precision",
                                         help="With --dtype bf16/fp16: also run the mixed-precision path (half "
                                              "matmuls, the residual stream and norms in fp32) and check it "
                                              "instead of the pure one."),
    as_json: bool = JSON_OPT,
):
    """Check this engine against transformers on one checkpoint: per-layer hidden states and logits
    (fp32, max relative error <= 1e-3), reference-text log-likelihood (bf16, <= 5%), and greedy
    generations (fp32, token-identical); with --dtype bf16/fp16 the hidden states and logits in that
    dtype too, and where that dtype overflows or loses accuracy, layer by layer and operator by
    operator (--mixed-precision: and whether the mixed path repairs it). Exits 1 when a check
    fails. Needs moectl\\[reference] (transformers)."""
    from moectl.engine.models.config import parse_dtype
    from moectl.engine.tools.verify import ReferenceMissing, run_verify

    try:
        numerics_dtype = parse_dtype(dtype)
    except ValueError as exc:
        raise BadInput(f"--dtype: {str(exc).partition(': ')[2]}") from None
    if mixed_precision and str(numerics_dtype) == "torch.float32":
        raise BadInput("--mixed-precision: needs --dtype bf16 or fp16 (fp32 has nothing to mix)")
    path = model_dir(model)
    try:
        result = run_verify(path, max_new_tokens=max_new_tokens, dtype=numerics_dtype, mixed_precision=mixed_precision,
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
            for report in result["precision"].values():
                typer.echo(_precision_line(report))
        typer.echo(f"  log-likelihood (bf16): engine {result['loglik_engine']:.4f}, transformers "
                   f"{result['loglik_reference']:.4f}, rel diff {result['loglik_rel_diff']:.2%} "
                   f"(<= {t['loglik_rel_diff']:.0%})")
        typer.echo(f"  greedy generation (fp32): {result['greedy_matched']} prompts token-identical")
        typer.echo("PASSED" if result["passed"] else "FAILED")
    if not result["passed"]:
        raise typer.Exit(1)


def _precision_line(report: dict) -> str:
    """One path of the precision report: what overflows, which layers lose accuracy, or all clear."""
    path = (f"{report['dtype']}, residual stream in {report['residual_dtype']}" if report["path"] == "mixed"
            else f"{report['dtype']}, pure")
    parts = []
    if report["overflows"]:
        shown = [f"layer {o['layer']} {o['operator']}" + (" (inf/NaN)" if o["nonfinite"] else f" ({o['max']:.3g})")
                 for o in report["overflows"][:4]]
        more = len(report["overflows"]) - len(shown)
        parts.append("overflows at " + ", ".join(shown) + (f" and {more} more" if more > 0 else ""))
    if report["lossy_layers"]:
        parts.append(f"layers losing accuracy against fp32 (median per-token error > {report['threshold']:.0e}): "
                     + ", ".join(map(str, report["lossy_layers"][:8])) + (" ..." if len(report["lossy_layers"]) > 8 else ""))
    if not parts:
        tight = min(report["min_headroom"].items(), key=lambda kv: kv[1])
        parts.append(f"no overflow (tightest: {tight[0]}, {tight[1]:.3g}x headroom), logits within "
                     f"{report['logits_median_error_vs_fp32']:.2e} of fp32")
    return f"  precision ({path}): " + "; ".join(parts)
