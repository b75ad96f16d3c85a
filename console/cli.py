"""The `moectl` command line (typer).

Exit codes: 0 success, 1 failure, 2 bad input. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from functools import wraps
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(name="moectl", no_args_is_help=False, invoke_without_command=True, add_completion=True, pretty_exceptions_enable=False,
                  help="Control console for Mixture-of-Experts LLM inference: with no command, the live "
                       "Textual console on the embedded sample model; an embedded MoE engine, "
                       "its verification against transformers, benchmarks and the sample model.")
model_app = typer.Typer(no_args_is_help=True, help="Inspect or train models.")
app.add_typer(model_app, name="model")
plan_app = typer.Typer(no_args_is_help=True, help="Offline planning: expert rebalancing and device memory.")
app.add_typer(plan_app, name="plan")

SAMPLE_MODEL = Path(__file__).resolve().parent.parent / "engine" / "sample_model"

MODEL_OPT = typer.Option(None, "--model", "-m", help="Hugging Face-format checkpoint directory "
                                                     "(default: the embedded sample model).")
JSON_OPT = typer.Option(False, "--json", help="Print machine-readable JSON (progress goes to stderr).")
DEVICES_OPT = typer.Option(8, "--devices", "-d", help="Number of devices (1-256).")
HBM_OPT = typer.Option("80GiB", "--hbm", help="HBM per device, e.g. 80GiB, 141GiB.")
DTYPE_OPT = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: the checkpoint's dtype).")


class BadInput(ValueError):
    pass


def _fail(message: str, code: int) -> None:
    typer.echo(f"moectl: error: {message}", err=True)
    raise typer.Exit(code)


def handles_errors(fn):
    """Bad input (ValueError) exits 2, anything else 1; both with one line and no traceback."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly, like any filter
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
        except ValueError as exc:
            _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, 2)
        except KeyboardInterrupt:
            _fail("interrupted", 1)
        except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
            _fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", 1)

    return wrapper


def model_dir(model: Optional[Path]) -> Path:
    path = Path(model) if model is not None else SAMPLE_MODEL
    if not path.is_dir():
        raise BadInput(f"--model: {path} is not a directory")
    return path


def parse_ids(spec: str) -> list[int]:
    try:
        ids = [int(x) for x in spec.replace(" ", "").split(",") if x]
    except ValueError:
        raise BadInput(f"--prompt-ids: {spec!r} is not a comma-separated list of integers") from None
    if not ids:
        raise BadInput("--prompt-ids: empty")
    return ids


@app.command()
@handles_errors
def generate(
    prompts: Optional[list[str]] = typer.Argument(None, help="Prompt text(s); one completion each."),
    prompt_ids: Optional[list[str]] = typer.Option(None, "--prompt-ids",
                                                   help="Token ids '1,2,3' (repeatable) for checkpoints without a tokenizer."),
    model: Optional[Path] = MODEL_OPT,
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 disables top-k."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed: the same seed gives the same text."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    dtype: Optional[str] = DTYPE_OPT,
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto or int8."),
    device: str = typer.Option("cpu", help="Torch device, e.g. cpu or cuda:0."),
    devices: Optional[int] = typer.Option(None, "--devices", "-d",
                                          help="Emulated devices for the experts (local backend; default: one, "
                                               "no placement)."),
    hbm: str = HBM_OPT,
    expert_cache: Optional[int] = typer.Option(None, "--expert-cache",
                                               help="Tiered expert memory (with --devices): experts stay in host "
                                                    "memory and each device caches this many in HBM."),
    backend: str = typer.Option("local", "--backend",
                                help="local (devices emulated on --device), multi-gpu (device d's experts on "
                                     "cuda:d, attention on cuda:0, real copies) or distributed."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="distributed: processes, one per device."),
    device_stats: bool = typer.Option(False, "--device-stats",
                                      help="With --devices: print each device's tokens, measured busy time, "
                                           "modeled link time and expert-cache hits over the run (to stderr)."),
    as_json: bool = JSON_OPT,
):
    """Generate completions with the embedded engine (continuous batching over all prompts).
    With --devices N the experts are placed on N emulated devices; the tokens are the same."""
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    inputs: list = list(prompts or []) + [parse_ids(s) for s in (prompt_ids or [])]
    if not inputs:
        raise BadInput("give a PROMPT or --prompt-ids")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos)
    if backend not in ("local", "multi-gpu", "distributed"):
        raise BadInput(f"--backend: must be local, multi-gpu or distributed, got {backend!r}")
    if backend == "distributed":
        _generate_distributed(model_dir(model), inputs, params, nproc or devices or 2, dtype, as_json)
        return
    topology = None
    if expert_cache is not None and devices is None:
        raise BadInput("--expert-cache: needs --devices")
    if devices is not None:
        from engine.topology import Topology, parse_size

        topology = Topology(num_devices=devices, hbm_bytes=parse_size(hbm, "--hbm"))
    expert_devices = None
    if backend == "multi-gpu":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if devices is None or devices > have:
            raise BadInput(f"--backend multi-gpu: needs --devices N with N <= the {have} CUDA devices here")
        expert_devices, device = tuple(f"cuda:{d}" for d in range(devices)), "cuda:0"
    engine = LLMEngine(EngineConfig(model=str(model_dir(model)), dtype=dtype, device=device,
                                    kv_cache_dtype=kv_cache_dtype, topology=topology,
                                    expert_cache_slots=expert_cache, expert_devices=expert_devices))
    outputs = engine.generate(inputs, params)
    if device_stats and engine.cluster is not None:
        _print_device_stats(engine)
    for out in outputs:
        if as_json:
            typer.echo(json.dumps({"prompt_ids": out.prompt_ids, "token_ids": out.token_ids, "text": out.text,
                                   "finish_reason": out.finish_reason,
                                   "ttft_s": out.metrics.get("ttft"), "tpot_s": out.metrics.get("tpot")}))
        else:
            prompt_text = engine.decode(out.prompt_ids) if engine.tokenizer else str(out.prompt_ids)
            typer.echo(prompt_text + (out.text if engine.tokenizer else " -> " + str(out.token_ids)))
            typer.echo("")


def _print_device_stats(engine) -> None:
    """Totals over the run from the step records: measured and modeled columns kept apart."""
    import numpy as np

    from engine.topology import format_size

    records = [s.devices for s in engine.step_log]
    tokens = np.sum([r["tokens"] for r in records], axis=0)
    busy = np.sum([r["busy_s"] for r in records], axis=0)
    link = np.sum([r["link_s"] for r in records], axis=0)
    say = lambda line: typer.echo(line, err=True)  # noqa: E731
    say(f"{'device':>6} {'tokens':>8} {'busy ms (measured)':>19} {'link ms (modeled)':>18} {'cache hits':>11} "
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
        slots = engine.cluster.cache_slots
        why = " (chosen: HBM cannot hold the placed experts)" if tiered == "auto" else ""
        say(f"experts: host tier, a {slots}-expert cache per device{why}")
    say(f"balancedness (mean/max device tokens): {tokens.mean() / max(tokens.max(), 1):.3f}")


def _generate_distributed(path: Path, inputs: list, params, nproc: int, dtype, as_json: bool) -> None:
    try:
        from engine.distributed import generate_distributed
    except ImportError:
        raise BadInput("--backend distributed: not available in this build") from None
    for out in generate_distributed(str(path), inputs, params, nproc=nproc, dtype=dtype, timeout_s=1800.0):
        if as_json:
            typer.echo(json.dumps({k: out[k] for k in ("prompt_ids", "token_ids", "text")}))
        else:
            typer.echo(out["text"] or str(out["token_ids"]))


@app.command()
@handles_errors
def verify(
    model: Optional[Path] = MODEL_OPT,
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Greedy tokens compared per prompt."),
    as_json: bool = JSON_OPT,
):
    """Check this engine against transformers on one checkpoint: per-layer hidden states and logits
    (fp32, max relative error <= 1e-3), reference-text log-likelihood (bf16, <= 5%), and greedy
    generations (fp32, token-identical). Exits 1 when a check fails. Needs moectl[reference]."""
    from engine.verify import run_verify

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


@model_app.command("info")
@handles_errors
def model_info(model: Optional[Path] = MODEL_OPT, as_json: bool = JSON_OPT):
    """Print a checkpoint's architecture, size and parameter counts (from config.json alone)."""
    from engine.config import ModelConfig

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


def _emit(result: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(result, default=str))


def _progress(as_json: bool):
    """Human progress lines: on stdout normally, on stderr when stdout carries JSON."""
    return (lambda line: typer.echo(line, err=True)) if as_json else typer.echo


@app.command()
@handles_errors
def bench(
    compare: Optional[str] = typer.Option(None, "--compare", help="'hf': this engine vs transformers' generate."),
    suite: Optional[str] = typer.Option(None, "--suite",
                                        help="compare-hf | serve | kv-int8 | profiler | limits (default: compare-hf)."),
    model: Optional[Path] = MODEL_OPT,
    workload: Optional[str] = typer.Option(None, "--workload",
                                           help="serve suite: a JSONL file or 'rate=4,prompt=32-512,output=16-256,"
                                                "requests=64,seed=0'."),
    requests: int = typer.Option(64, "--requests", help="compare-hf: number of requests, all arriving at once."),
    dtype: Optional[str] = DTYPE_OPT,
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads (default: torch's own)."),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = JSON_OPT,
):
    """Benchmarks that print ratios against a baseline measured in the same run, and the share of
    this machine's measured limits (memory bandwidth, matmul FLOP/s) that was reached."""
    import torch

    if compare is not None and compare != "hf":
        raise BadInput(f"--compare: only 'hf' is supported, got {compare!r}")
    name = suite or "compare-hf"
    if threads is not None:
        if threads < 1:
            raise BadInput("--threads: must be >= 1")
        torch.set_num_threads(threads)
    log = _progress(as_json)
    path = model_dir(model)
    if name == "compare-hf":
        from engine.bench import run_compare_hf

        result = run_compare_hf(path, num_requests=requests, seed=seed, dtype=dtype or "float32",
                                threads=threads, log=log)
    elif name == "serve":
        from engine.bench import run_serve
        from engine.workload import WorkloadSpec

        spec = WorkloadSpec.from_option(workload) if workload else WorkloadSpec(num_requests=requests, seed=seed)
        result = run_serve(path, spec=spec, dtype=dtype, log=log)
    elif name == "kv-int8":
        from engine.kv_eval import default_eval_inputs, run_kv_int8_eval

        text_ids, prompts = default_eval_inputs(path)
        # fp32 by default: the accuracy cost is then INT8's alone, not bf16 rounding on top of it
        result = run_kv_int8_eval(str(path), text_ids, prompts, dtype=dtype or "float32", log=log)
    elif name == "profiler":
        from profiler.overhead_bench import run_profiler_overhead

        result = run_profiler_overhead(path, dtype=dtype, log=log)
    elif name == "limits":
        from engine import machine_limits

        result = machine_limits.measure(dtype or "float32")
        log(machine_limits.format_limits(result))
    else:
        raise BadInput(f"--suite: {name!r} is not one of compare-hf, serve, kv-int8, profiler, limits")
    _emit(result, as_json)


@plan_app.command("memory")
@handles_errors
def plan_memory_cmd(
    model: Path = typer.Option(..., "--model", "-m", help="config.json, or a directory holding one (no weights needed)."),
    devices: int = DEVICES_OPT,
    hbm: str = HBM_OPT,
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size for attention (<= 8)."),
    ep: Optional[int] = typer.Option(None, "--ep", help="Expert-parallel size (default: all devices)."),
    context: int = typer.Option(..., "--context", help="Tokens of context per sequence."),
    batch: int = typer.Option(1, "--batch", help="Concurrent sequences."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weight dtype: fp32, bf16, fp16 or fp8 (planning only)."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto (weight dtype) or int8."),
    as_json: bool = JSON_OPT,
):
    """The operator-level memory table for each device: weights by category, KV cache, activations
    at peak, communication buffers and headroom; whether it fits and, if not, by how much."""
    from engine.memory_plan import fit_suggestions, plan_memory
    from engine.topology import Topology, parse_size

    topo = Topology(num_devices=devices, hbm_bytes=parse_size(hbm, "--hbm"))
    kw = dict(tp=tp, ep=ep, context=context, batch=batch, dtype=dtype, kv_dtype=kv_dtype)
    plan = plan_memory(model, topo, **kw)
    suggestions = [] if plan.fits else fit_suggestions(model, topo, **kw)
    if as_json:
        typer.echo(json.dumps({**plan.as_dict(), "suggestions": suggestions}, default=str))
        return
    typer.echo(plan.format_table())
    for s in suggestions:
        typer.echo(f"  to fit: {s['change']}")


@plan_app.command("rebalance")
@handles_errors
def plan_rebalance_cmd(
    loads_file: Optional[Path] = typer.Argument(None, help="A recorded trace (moectl record), or per-layer x "
                                                           "per-expert loads (.npy or .json)."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Plan for synthetic skewed (Zipf) loads."),
    layers: int = typer.Option(61, "--layers"),
    experts: int = typer.Option(384, "--experts"),
    skew: float = typer.Option(1.0, "--skew", help="Zipf exponent of the synthetic loads."),
    devices: Optional[int] = typer.Option(None, "--devices", "-d",
                                          help="Number of devices (default: the trace's, else 8)."),
    devices_per_node: int = typer.Option(8, "--devices-per-node"),
    redundant: int = typer.Option(1, "--redundant", help="Redundant expert slots per device."),
    expert_bytes: Optional[str] = typer.Option(None, "--expert-bytes",
                                               help="Bytes of one expert, for bytes_moved (default: the trace's "
                                                    "model, else a DeepSeek-V3 FP8 expert, 42 MiB)."),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = JSON_OPT,
):
    """Compute an EPLB-style expert placement offline: replicate hot experts, pack them in balance
    (by node when there are nodes), and report balancedness before/after and bytes moved. From a
    trace, the loads are its recorded routing and "before" is the placement it was recorded with
    (exact: routing does not depend on placement)."""
    from engine.rebalancer import DEFAULT_EXPERT_BYTES, load_loads_file, run_plan_rebalance, synthetic_loads
    from engine.topology import parse_size

    if synthetic == (loads_file is not None):
        raise BadInput("give a TRACE or loads FILE, or --synthetic (one of them)")
    current, size = None, DEFAULT_EXPERT_BYTES
    if synthetic:
        loads = synthetic_loads(layers, experts, seed=seed, skew=skew)
    elif loads_file.suffix in (".npy", ".json"):
        loads = load_loads_file(loads_file)
    else:
        from console.trace_cli import trace_routing

        loads, current, trace_devices, trace_bytes = trace_routing(loads_file)
        size = trace_bytes or size
        if devices is None or devices == trace_devices:
            devices = trace_devices
        else:
            current = None  # another device count: no recorded placement to compare against
    result = run_plan_rebalance(loads, devices or 8, redundant, devices_per_node=devices_per_node,
                                expert_bytes=size if expert_bytes is None else parse_size(expert_bytes, "--expert-bytes"),
                                current=current)
    if as_json:
        typer.echo(json.dumps(result, default=str))
        return
    typer.echo(f"balancedness {result['balancedness_before']:.4f} -> {result['balancedness_after']:.4f}, "
               f"{result['bytes_moved']:,} bytes moved, planned in {result['seconds'] * 1e3:.1f} ms")


@model_app.command("train")
@handles_errors
def model_train(
    out: Path = typer.Option(SAMPLE_MODEL, "--out", help="Output directory (default: the embedded sample model)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (default: the recipe's)."),
    seed: int = typer.Option(0, "--seed"),
    time_budget: Optional[float] = typer.Option(None, "--time-budget",
                                                help="Seconds; the schedule is fitted to it and the run saved when "
                                                     "spent (then not bit-reproducible). The shipped model used 2640."),
    as_json: bool = JSON_OPT,
):
    """Re-train the sample model (tokenizer, model, model card) from the Python stdlib's source."""
    from engine.train import train_sample_model

    kw = {"steps": steps} if steps is not None else {}
    stats = train_sample_model(out, seed=seed, time_budget_s=time_budget, log=_progress(as_json), **kw)
    _emit(stats, as_json)


from console import console_cli, trace_cli  # noqa: E402,F401 - registers run/replay, record and trace


@app.callback()
def _default(ctx: typer.Context, theme: Optional[str] = typer.Option(None, "--theme", help="With no command: the "
                                                                            "console's theme (dark, light, high-contrast).")) -> None:
    """With no command, `moectl` opens the live console (`moectl run` with its defaults)."""
    if ctx.invoked_subcommand is None:
        console_cli.run(model=None, devices=4, hbm="80GiB", redundant=1, expert_cache=None,
                        workload=console_cli.DEMO_WORKLOAD, dtype=None, threads=1, theme=theme or "dark")
    elif theme is not None:
        raise typer.BadParameter("--theme: give it after the command, e.g. `moectl replay T --theme light`")


def main() -> None:
    """Entry point: usage errors (unknown option, bad value) become one line and exit code 2."""
    try:  # newer typer vendors click
        from typer._click.exceptions import NoArgsIsHelpError, UsageError
    except ImportError:
        from click.exceptions import NoArgsIsHelpError, UsageError

    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help())
        code = 0
    except UsageError as exc:
        where = f"{exc.ctx.command_path}: " if exc.ctx is not None else ""
        typer.echo(f"moectl: error: {where}{exc.format_message().splitlines()[0]}", err=True)
        code = 2
    except typer.Abort:
        typer.echo("moectl: error: aborted", err=True)
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    sys.exit(main())
