"""`moectl generate`: completions from the embedded engine, on any backend.

Command modules import torch and the engine inside their commands, so `moectl --help` and
every other command start without loading them.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moectl.cli.common import JSON_OPT, BadInput, check_seed, engine_config, handles_errors, option_flag, parse_ids
from moectl.cli.engine_options import DEFAULT_OPTIONS, REAL_ENGINE_OPTIONS, EngineOptions, given, with_engine_options
from moectl.placement.topology import format_size


@handles_errors
@with_engine_options(*REAL_ENGINE_OPTIONS)
def generate(
    ctx: typer.Context,
    prompts: list[str] | None = typer.Argument(None, help="Prompt text(s); one completion each."),
    prompt_ids: list[str] | None = typer.Option(None, "--prompt-ids",
                                                help="Token ids '1,2,3' (repeatable) for checkpoints without a "
                                                     "tokenizer."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 disables top-k."),
    seed: int | None = typer.Option(None, help="Sampling seed: the same seed gives the same text."),
    stop: list[str] | None = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto or int8."),
    device: str = typer.Option("cpu", help="Torch device, e.g. cpu or cuda:0."),
    options: EngineOptions = DEFAULT_OPTIONS,
    engine: Path | None = typer.Option(None, "--engine", help="Send the prompts to a running engine (the directory "
                                                             "`moectl serve` prints, or a console's: its header shows "
                                                             "it) instead of starting one; its consoles show them."),
    device_stats: bool = typer.Option(False, "--device-stats",
                                      help="Print each device's tokens, measured busy time, "
                                           "modeled link time and expert-cache hits over the run (to stderr)."),
    as_json: bool = JSON_OPT,
):
    """Generate completions with the embedded engine (continuous batching over all prompts), its
    experts on --devices emulated devices (the tokens are the same on any count); or, with
    --engine DIR, on a running engine."""
    from moectl.engine.core.sampling import SamplingParams
    from moectl.engine.parallel.backends import Engines

    inputs: list = [_checked_text(i, p) for i, p in enumerate(prompts or [], 1)] + [_checked_ids(s) for s in
                                                                                   (prompt_ids or [])]
    if not inputs:
        raise BadInput("give a PROMPT or --prompt-ids")
    check_seed(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos)
    if engine is not None:
        _generate_on(ctx, options, engine, inputs, params, as_json)
        return
    config = engine_config(options, device=device, kv_cache_dtype=kv_cache_dtype)
    engines = Engines(config, options.backend)
    try:
        engine = engines.make_engine()
        outputs = engine.generate(inputs, params)
        if device_stats and engine.experts is not None:
            _print_device_stats(engine)
    finally:
        engines.close()
    for out in outputs:
        if as_json:
            typer.echo(json.dumps({"prompt_ids": out.prompt_ids, "token_ids": out.token_ids, "text": out.text,
                                   "finish_reason": out.finish_reason,
                                   "ttft_s": out.metrics.get("ttft"), "tpot_s": out.metrics.get("tpot")}))
        else:
            prompt_text = engine.decode(out.prompt_ids) if engine.tokenizer else str(out.prompt_ids)
            typer.echo(prompt_text + (out.text if engine.tokenizer else " -> " + str(out.token_ids)))
            typer.echo("")


OUTPUT_TIMEOUT_S = 600.0  # --engine: the longest wait for a request's next output before giving up

# generate's own options that configure an engine it would start: meaningless with --engine, as
# are the engine options
OWN_ENGINE_OPTIONS = ("kv_cache_dtype", "device", "device_stats")


def _generate_on(ctx: typer.Context | None, options: EngineOptions, engine_dir: Path, inputs: list, params,
                 as_json: bool) -> None:
    """The prompts on a running engine, over its client protocol (wire/protocol.py Generate):
    they run beside what it serves, and every console attached to it shows them."""
    from dataclasses import asdict

    from moectl.console.engine_client import EngineSource
    from moectl.wire.actions import ActionRefused

    given_flags = options.given_flags() + [option_flag(ctx, name) for name in OWN_ENGINE_OPTIONS
                                           if ctx is not None and given(ctx, name)]
    if given_flags:
        raise BadInput(f"{given_flags[0]}: configures an engine; --engine sends to one already running")
    try:
        source = EngineSource(engine_dir, client="generate", records=False)
    except ActionRefused as exc:
        raise BadInput(f"--engine: {exc}") from None
    try:
        fields = {k: v for k, v in asdict(params).items() if v != getattr(type(params)(), k)}
        handles = [source.generate(prompt, **fields) for prompt in inputs]
        results = [handle.result(timeout_s=OUTPUT_TIMEOUT_S) for handle in handles]
    except TimeoutError as exc:
        raise RuntimeError(f"--engine: {exc} (the engine is busy or stuck)") from None
    finally:
        source.close()
    failed = [r for r in results if r["finish_reason"] == "error"]
    for r in results:
        if as_json:
            typer.echo(json.dumps({"request_id": r["request_id"], "token_ids": r["token_ids"], "text": r["text"],
                                   "finish_reason": r["finish_reason"], "error": r["error"]}))
        elif r["finish_reason"] != "error":
            typer.echo(r["text"] if r["text"] else str(r["token_ids"]))
            typer.echo("")
    if failed:  # refused (bad input: 2) or failed in the engine (1), as a local run would exit
        error = failed[0]["error"] or "the request failed"
        typer.echo(f"moectl: error: {error}", err=True)
        raise typer.Exit(2 if error.startswith("refused:") else 1)


def _checked_text(n: int, text: str) -> str:
    """A PROMPT argument that is text: bytes that are not UTF-8 reach Python as lone surrogates
    (surrogateescape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadInput(f"PROMPT: prompt {n} is not valid UTF-8 text (a lone surrogate or undecodable byte at "
                       f"character {exc.start})") from None
    return text


def _checked_ids(spec: str) -> list[int]:
    """A --prompt-ids value: parse_ids skips empty items, so a typo such as '1,,2' or '1,2,' would
    run as a different prompt than the one meant."""
    items = spec.replace(" ", "").split(",")
    if len(items) > 1 and "" in items:
        raise BadInput(f"--prompt-ids: {spec!r} has an empty item {items.index('') + 1} (give token ids as '1,2,3')")
    return parse_ids(spec)


def _print_device_stats(engine) -> None:
    """Totals over the run from the step records: measured and modeled columns kept apart."""
    import numpy as np

    records = [s.devices for s in engine.step_log]
    tokens = np.sum([r["tokens"] for r in records], axis=0)
    busy = np.sum([r["busy_s"] for r in records], axis=0)
    link = np.sum([r["link_s"] for r in records], axis=0)
    say = lambda line: typer.echo(line, err=True)  # noqa: E731
    link_how = "modeled" if records[0]["link_s_modeled"] else "measured"
    say(f"{'device':>6} {'tokens':>8} {'busy ms (measured)':>19} {'link ms (' + link_how + ')':>18} {'cache hits':>11} "
        f"{'peak HBM (accounted)':>21}")
    hbm = records[0]["memory_capacity"]["hbm"]
    for d in range(len(tokens)):
        peak = max(sum(r["memory"][d].values()) for r in records)
        cache = ""
        if "expert_cache" in records[0]:
            hits = sum(r["expert_cache"][d]["hits"] for r in records)
            total = hits + sum(r["expert_cache"][d]["misses"] for r in records)
            cache = f"{hits / total:.1%}" if total else "-"
        say(f"{d:>6} {int(tokens[d]):>8} {busy[d] * 1e3:>19.2f} {link[d] * 1e3:>18.4f} {cache:>11} "
            f"{format_size(peak) + ' / ' + format_size(hbm):>21}")
    tiered = records[-1]["tiered_experts"]
    if tiered != "off":
        slots = engine.experts.cluster.cache_slots
        why = " (chosen: HBM cannot hold the placed experts)" if tiered == "auto" else ""
        say(f"experts: host tier, a {slots}-expert cache per device{why}")
    say(f"balancedness (mean/max device tokens): {tokens.mean() / max(tokens.max(), 1):.3f}")
