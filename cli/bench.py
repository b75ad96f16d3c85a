"""`moectl bench`: benchmarks that print ratios against a baseline measured in the same run."""

from __future__ import annotations

import typer

from moectl.cli.common import (
    JSON_OPT,
    BadInput,
    check_nproc,
    check_seed,
    emit_json,
    handles_errors,
    model_dir,
    parse_cli_size,
    parse_threads,
    progress,
    redundant_slots,
)
from moectl.cli.engine_options import ALL_OPTIONS, DEFAULT_DEVICES, DEFAULT_OPTIONS, EngineOptions, given, with_engine_options
from moectl.cli.sim_backend import SIMULATED, refuse_sim_options

# the options each suite reads: one given to a suite that would ignore it is refused, naming both
SUITE_OPTIONS = {
    "compare-hf": {"compare", "requests", "seed", "contended"},
    "serve": {"workload", "requests", "seed", "host_mem"},
    "kv-int8": set(),
    "profiler": {"backend", "nproc"},
    "rebalance": {"backend", "nproc", "devices", "rounds", "redundant", "requests", "hardware", "routing", "drift",
                  "tp", "overlap", "sim_seed", "pp", "regime", "workload"},
    "limits": set(),
    "soak": {"backend", "requests", "devices", "seed"},
}
EVERY_SUITE = {"suite", "model", "dtype", "threads", "as_json"}
# the engine options a benchmark reads: none loads a checkpoint with an HBM budget, an expert
# cache or a placement file
BENCH_OPTIONS = tuple(name for name in ALL_OPTIONS if name not in ("hbm", "placement", "expert_cache"))


def check_suite_options(ctx: typer.Context, suite: str) -> None:
    """An option given on the command line that `suite` does not read is bad input, not ignored."""
    if suite not in SUITE_OPTIONS:
        return  # the unknown suite's own error follows
    for param in ctx.command.params:
        if given(ctx, param.name) and param.name not in SUITE_OPTIONS[suite] | EVERY_SUITE:
            flag = max(param.opts, key=len)
            if param.name == "compare":
                raise BadInput(f"--compare hf: is the compare-hf suite, not --suite {suite}")
            users = [name for name, options in SUITE_OPTIONS.items() if param.name in options]
            raise BadInput(f"{flag}: not read by --suite {suite} (only by {', '.join(users) or 'no suite'})")


@handles_errors
@with_engine_options(*BENCH_OPTIONS)
def bench(
    ctx: typer.Context,
    compare: str | None = typer.Option(None, "--compare", help="'hf': this engine vs transformers' generate."),
    suite: str | None = typer.Option(None, "--suite",
                                        help="compare-hf | serve | kv-int8 | profiler | rebalance | limits | soak "
                                             "(default: compare-hf)."),
    options: EngineOptions = DEFAULT_OPTIONS,
    workload: str | None = typer.Option(None, "--workload",
                                           help="serve suite: a JSONL file or 'rate=4,prompt=32-512,output=16-256,"
                                                "requests=64,seed=0'; rebalance suite: the same (JSONL lines of "
                                                "{\"prompt\", \"max_tokens\"}), every other request planned on, "
                                                "the rest measured."),
    regime: str | None = typer.Option(None, "--regime",
                                      help="rebalance suite: decode (short prompts, the console's demo), prefill "
                                           "(1-2K-token prompts, a few output tokens) or mixed; default decode."),
    requests: int = typer.Option(64, "--requests", help="compare-hf: number of requests, all arriving at once; "
                                                         "soak: requests run (10000 unless given)."),
    rounds: int = typer.Option(10, "--rounds", help="rebalance: rounds of one naive and one planned phase (a 95% "
                                                       "interval needs at least 2; 10 resolve a few percent on this "
                                                       "2-core machine, whose phases vary by 5-10%)."),
    seed: int = typer.Option(0, "--seed"),
    contended: bool = typer.Option(False, "--contended", help="compare-hf: also run it with a busy process holding "
                                                               "one core, and the engine on a thread per core."),
    as_json: bool = JSON_OPT,
):
    """Benchmarks that print ratios against a baseline measured in the same run, and the share of
    this machine's measured limits (memory bandwidth, matmul FLOP/s) that was reached."""
    import torch

    if compare is not None and compare != "hf":
        raise BadInput(f"--compare: only 'hf' is supported, got {compare!r}")
    name = suite or "compare-hf"
    check_suite_options(ctx, name)
    refuse_sim_options(options)
    backend, nproc, devices, dtype, host_mem = (options.backend, options.nproc, options.devices, options.dtype,
                                                options.host_mem)
    if backend == SIMULATED:
        if name != "rebalance":
            raise BadInput(f"--backend simulated: runs --suite rebalance, not {name}")
        for flag, value in (("--regime", regime), ("--workload", workload)):
            if value is not None:
                raise BadInput(f"{flag}: the simulated cluster's rebalance suite replays its recorded workload")
        return _simulated_rebalance(ctx, options, rounds, requests, as_json)
    check_seed(seed)
    check_nproc(nproc, backend)
    threads = parse_threads(options.threads)
    threads = None if threads == "auto" else threads  # auto: the engine's own policy, transformers torch's
    if threads is not None:
        torch.set_num_threads(threads)
    log = progress(as_json)
    path = model_dir(options.model)
    if host_mem is not None and name != "serve":
        raise BadInput("--host-mem: only with --suite serve (the disk tier under a workload)")
    if contended and name != "compare-hf":
        raise BadInput("--contended: only with --compare hf (the compare-hf suite)")
    if contended and threads is not None:
        raise BadInput("--contended: compares thread policies itself; leave --threads out")
    if name == "compare-hf":
        from moectl.engine.tools.bench import check_bench_requests, run_compare_hf, run_contended

        check_bench_requests(requests, "--requests")
        result = (run_contended if contended else run_compare_hf)(path, num_requests=requests, seed=seed,
                                                                  dtype=dtype or "float32", threads=threads, log=log)
    elif name == "serve":
        from moectl.engine.tools.bench import check_bench_requests, expected_requests, run_serve
        from moectl.engine.tools.workload import WorkloadSpec

        if workload:
            spec = WorkloadSpec.from_option(workload)
            check_bench_requests(expected_requests(spec), "--workload: requests (or rate x duration)")
        else:
            check_bench_requests(requests, "--requests")
            spec = WorkloadSpec(num_requests=requests, seed=seed)
        result = run_serve(path, spec=spec, dtype=dtype, log=log,
                           host_mem=None if host_mem is None else parse_cli_size(host_mem, "--host-mem"))
    elif name == "kv-int8":
        from moectl.engine.tools.kv_eval import default_eval_inputs, run_kv_int8_eval

        text_ids, prompts = default_eval_inputs(path)
        # fp32 by default: the accuracy cost is then INT8's alone, not bf16 rounding on top of it
        result = run_kv_int8_eval(str(path), text_ids, prompts, dtype=dtype or "float32", log=log)
    elif name == "profiler":
        from moectl.profiler.overhead_bench import rank_telemetry_cost, run_profiler_overhead

        if backend not in ("local", "distributed"):
            raise BadInput(f"--backend: the profiler suite runs on local or distributed, got {backend!r}")
        from moectl.profiler.watch_cost import numerics_watch_cost

        result = run_profiler_overhead(path, dtype=dtype, log=log)
        result["numerics_watch"] = numerics_watch_cost(path, dtype=dtype, log=log)
        if backend == "distributed":  # the ranks' own telemetry, measured directly
            if nproc is not None and nproc < 2:
                raise BadInput(f"--nproc: the ranks' telemetry needs at least 2, got {nproc}")
            result["rank_telemetry"] = rank_telemetry_cost(path, nproc=nproc or 2, dtype=dtype, log=log)
    elif name == "rebalance":
        from moectl.engine.tools.rebalance_bench import run_rebalance_bench

        if backend not in ("local", "distributed"):
            raise BadInput(f"--backend: the rebalance suite runs on local or distributed, got {backend!r}")
        if nproc is not None and backend != "distributed":
            raise BadInput("--nproc: only with --backend distributed")
        if not 1 <= rounds <= 20:
            raise BadInput("--rounds: must be in 1-20")
        if not 1 <= requests <= 4096:
            raise BadInput("--requests: must be in 1-4096")
        if nproc is not None and devices is not None and devices != nproc:
            raise BadInput(f"--devices {devices}, --nproc {nproc}: the distributed backend runs one process per "
                           "device; give one of them")
        count = nproc if nproc is not None else (DEFAULT_DEVICES if devices is None else devices)
        if not 1 <= count <= 64:
            raise BadInput(f"--{'nproc' if nproc is not None else 'devices'}: must be in 1-64, got {count}")
        from moectl.engine.tools.rebalance_bench import REGIMES

        if regime is not None and regime not in REGIMES:
            raise BadInput(f"--regime: must be one of {', '.join(REGIMES)}, got {regime!r}")
        if regime is not None and workload is not None:
            raise BadInput("--regime, --workload: give one (a workload brings its own requests)")
        spec = None
        if workload is not None:
            from moectl.engine.tools.workload import WorkloadSpec

            try:
                spec = WorkloadSpec.from_option(workload)
            except ValueError as exc:
                raise BadInput(f"--workload: {exc}") from None
        result = run_rebalance_bench(path, backend=backend, devices=count, rounds=rounds, overlap=options.overlap,
                                     redundant=redundant_slots(options.redundant),
                                     requests=48 if requests == 64 else requests, dtype=dtype, threads=threads,
                                     regime=regime or "decode", spec=spec, log=log)
    elif name == "limits":
        from moectl.engine.tools import machine_limits

        result = machine_limits.measure(dtype or "float32")
        log(machine_limits.format_limits(result))
    elif name == "soak":
        from moectl.engine.tools.soak import check_options, format_soak, run_soak

        if backend != "local":
            raise BadInput(f"--backend: the soak suite runs on local, got {backend!r}")
        count = 10_000 if requests == 64 else requests
        devices = DEFAULT_DEVICES if devices is None else devices  # 0: the experts on no devices
        try:
            check_options(count, None, 50, devices, 0)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        result = run_soak(path, num_requests=count, devices=devices, dtype=dtype or "float32",
                          threads=threads or "auto", seed=seed, log=log)
        log(format_soak(result))
    else:
        raise BadInput(f"--suite: {name!r} is not one of compare-hf, serve, kv-int8, profiler, rebalance, limits, "
                       "soak")
    emit_json(result, as_json)


def _simulated_rebalance(ctx, options: EngineOptions, rounds, requests, as_json: bool) -> None:
    """The rebalance suite on a simulated cluster (engine/tools/sim_rebalance.py): every figure simulated."""
    from moectl.cli.sim_backend import SimEngines
    from moectl.engine.tools.sim_rebalance import run_sim_rebalance

    if not 1 <= rounds <= 20:
        raise BadInput("--rounds: must be in 1-20")
    if given(ctx, "requests") and not 1 <= requests <= 1 << 20:
        raise BadInput("--requests: must be in 1-1048576")
    engines = SimEngines(options)
    engine = engines.make_engine()
    result = run_sim_rebalance(engine.config, engines.recorded, rounds=3 if not given(ctx, "rounds") else rounds,
                               requests=requests if given(ctx, "requests") else None, log=progress(as_json))
    emit_json(result, as_json)
