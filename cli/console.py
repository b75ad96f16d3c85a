"""`moectl` / `moectl run` (the live console on its engine process), `moectl replay TRACE`,
`moectl attach URL`, and the engine process itself (`moectl engine-host`, hidden)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from moectl.cli.common import THEME_OPT, BadInput, engine_config, handles_errors
from moectl.cli.engine_options import DEFAULT_OPTIONS, EngineOptions, given, with_engine_options
from moectl.cli.sim_backend import SIMULATED, refuse_sim_options
from moectl.themes import check_theme

DEMO_WORKLOAD = "rate=4,prompt=32-256,output=32-128"
# the live console's own options (`run`, and `web` which hands them on to it)
DEMO_WORKLOAD_OPT = typer.Option(DEMO_WORKLOAD, "--workload", help="The demo workload: rate=R,prompt=LO-HI,"
                                                                  "output=LO-HI (editable live).")


def demo_load(workload: str):
    """The --workload option as the live console's DemoLoad; a bad one is bad input."""
    from moectl.engine.tools.demo_workload import DemoLoad
    from moectl.engine.tools.workload import WorkloadSpec

    try:
        return DemoLoad.from_spec(WorkloadSpec.from_option(workload))
    except ValueError as exc:
        message = str(exc)
        raise BadInput(message if message.startswith("--workload") else f"--workload: {message}") from None


def live_engine_config(options: EngineOptions):
    """The live engine's EngineConfig from run's options (checked: BadInput names the flag)."""
    return engine_config(options, reserved_cores=1)  # a core for the console's process


def live_source(options: EngineOptions, workload: str = DEMO_WORKLOAD):
    """The engine on a thread of this process (console/live_source.py): the baseline that
    bench/console_bench.py measures the engine process against."""
    from moectl.console.live_source import LiveSource
    from moectl.engine.parallel.backends import Engines

    load = demo_load(workload)
    engines = Engines(live_engine_config(options), options.backend)
    try:
        return LiveSource(engines.make_engine, load, on_close=engines.close)
    except BaseException:
        engines.close()
        raise


ENGINE_DIR_OPT = typer.Option(None, "--engine", hidden=True,
                              help="Attach to the engine process in this directory (its socket and token) "
                                   "instead of starting one: how `moectl web`'s tabs share one engine.")


def host_config(ctx: typer.Context | None, options: EngineOptions, workload: str):
    """The engine process's config from run's (or web's) options: the demo workload only where
    it was given, as the simulated backend's default differs."""
    from moectl.cli.engine_process import EngineHostConfig

    return EngineHostConfig(options, workload if ctx is not None and given(ctx, "workload") else None)


@handles_errors
@with_engine_options()
def run(
    ctx: typer.Context,
    options: EngineOptions = DEFAULT_OPTIONS,
    workload: str = DEMO_WORKLOAD_OPT,
    theme: str = THEME_OPT,
    engine: Path | None = ENGINE_DIR_OPT,
    check_only: bool = typer.Option(False, "--check-only", hidden=True,
                                    help="Start the engine and attach, then exit without the console."),
):
    """The live console (the default command): the engine, in a process of its own, on a steady
    demo workload, experts on emulated devices in the naive contiguous placement, so imbalance
    shows and a rebalance visibly helps. The console's process never loads torch."""
    from moectl.engine.core import gc_heap

    gc_heap.own_process()  # this process serves one engine for its life: its heap is frozen once built
    from moectl.cli.engine_process import EngineProcess, EngineStartFailed, exit_lines
    from moectl.console.engine_client import EngineSource
    from moectl.wire.actions import ActionRefused

    check_theme(theme)
    refuse_sim_options(options)
    config = host_config(ctx, options, workload)
    process = None
    if engine is not None:
        given_options = options.given_flags() + (["--workload"] if config.workload is not None else [])
        if given_options:
            raise BadInput(f"{given_options[0]}: an option of the engine; --engine attaches to one already running")
    else:
        process = EngineProcess(config)
        engine = process.dir
    try:
        from moectl.console.app import MoectlApp  # imported while the engine loads

        if process is not None:
            try:
                process.wait_ready()
            except EngineStartFailed as exc:
                typer.echo(f"moectl: error: {exc}", err=True)
                raise typer.Exit(exc.code) from None
        try:
            source = EngineSource(engine, owner=process is not None)
        except ActionRefused as exc:
            raise BadInput(f"--engine: {exc}" if process is None else str(exc)) from None
        try:
            if not check_only:
                MoectlApp(source, theme=theme).run()
        finally:
            source.close()  # the owner's close tells its engine to stop
        if process is not None:
            stopped, process = process, None
            code = stopped.stop()
            if code != 0:  # it died under the console: why, now that the terminal is back (and exit 1)
                head, *tail = exit_lines(code, stopped.log_tail)
                typer.echo(f"moectl: error: {head}", err=True)
                for line in tail:
                    typer.echo(line, err=True)
                raise typer.Exit(1)
    finally:
        if process is not None:  # interrupted before the console stopped it: no owner's Shutdown came
            process.terminate()


@handles_errors
def engine_host(
    engine_dir: Path = typer.Option(..., "--engine-dir", help="The run's private directory (token, the engine "
                                                               "options; the socket goes there)."),
):
    """The engine process of `run` and `web` (server/engine_host.py): not for direct use."""
    import json
    import os
    import signal

    from moectl.cli.engine_process import EngineHostConfig
    from moectl.engine.parallel.backends import Engines
    from moectl.server.engine_host import EngineHost, starter_pid
    from moectl.wire.protocol import SOCKET_NAME, die_with_parent, read_token

    parent = starter_pid()
    if not die_with_parent(parent):  # its starter died before the signal was set
        raise typer.Exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the console's to handle; it stops us
    config = EngineHostConfig.read(engine_dir)
    options = config.options
    refuse_sim_options(options)
    from moectl.engine.core import gc_heap, native_memory

    gc_heap.own_process()  # the engine process serves one engine for its life: its heap is frozen once built
    native_memory.bound_kernel_caches()  # as serve does: a kernel kept per batch shape grows it for hours
    token = read_token(engine_dir)
    demo = None
    if options.backend == SIMULATED:
        from moectl.cli.sim_backend import SimEngines, refuse_real_engine_options, sim_load
        from moectl.engine.tools.sim_workload import SimWorkload

        refuse_real_engine_options(options)
        engines = SimEngines(options)
        load, _ = sim_load(config.workload, engines.first.max_model_len)
        demo = SimWorkload(load, seed=options.sim_seed)
    else:
        load = demo_load(config.workload or DEMO_WORKLOAD)
        engines = Engines(live_engine_config(options), options.backend)
    try:
        make_engine = engines.make_engine
        if config.inject_fault is not None:
            from moectl.engine.tools.fault_injection import first_engine_faulty

            make_engine = first_engine_faulty(make_engine, config.inject_fault)
        host = EngineHost(engine_dir, token, make_engine=make_engine, load=load, on_close=engines.close,
                          workload=demo)
    except BaseException:
        engines.close()
        raise
    signal.signal(signal.SIGTERM, lambda *_: host.on_signal("SIGTERM"))
    typer.echo(json.dumps({"ready": str(Path(engine_dir) / SOCKET_NAME), "pid": os.getpid()}))
    sys.stdout.flush()
    try:
        host.wait()
    finally:
        host.close()
        if parent is not None and os.getppid() != parent:  # its starter died (SIGKILL): nobody else will clean up
            import shutil

            shutil.rmtree(engine_dir, ignore_errors=True)


@handles_errors
def replay(trace: Path = typer.Argument(..., help="A trace recorded by `moectl record` or imported by `trace "
                                                  "import`, or PyTorch-profiler traces (.json / .json.gz, or a "
                                                  "folder of one per rank)."),
           rules: Path | None = typer.Option(None, "--rules", help="PyTorch-profiler traces: your kernel classes, "
                                                                   "tried before the shipped ones."),
           theme: str = THEME_OPT):
    """Replay a trace in the console: play, pause, speed, step, seek; rebalancing shows the
    counterfactual on the recorded routing. A GPU timeline (PyTorch-profiler traces, or their
    import): lanes per rank and stream with zoom and search, time per kernel class and layer,
    idle time, hidden communication and the straggler rank."""
    from moectl.profiler.kineto import is_kineto

    check_theme(theme)
    if is_kineto(trace):
        from moectl.profiler.kineto import trace_files
        from moectl.profiler.kineto_import import read_source

        if sum(p.stat().st_size for p in trace_files(trace)) > 64 << 20:  # a large one reads for a while
            typer.echo(f"reading {trace} (`moectl trace import` it once to open it faster) ...", err=True)
        return _gpu_timeline(read_source([trace], rules), trace, theme)
    if Path(trace).is_dir():
        raise BadInput(f"{trace}: is a directory, not a trace")
    if not Path(trace).is_file():
        raise BadInput(f"{trace}: no such trace file")
    from moectl.cli.common import open_trace
    from moectl.profiler.kineto_import import is_timeline, read_timeline

    with open_trace(trace, gpu_timeline=True) as reader:
        traces = read_timeline(reader, rules) if is_timeline(reader.header) else None
    if traces is not None:
        return _gpu_timeline(traces, trace, theme)
    if rules is not None:
        raise BadInput("--rules: classes a PyTorch-profiler trace's kernels (a .json / .json.gz file, a folder, "
                       "or its import)")
    from moectl.console.app import MoectlApp
    from moectl.console.sources import ReplaySource
    from moectl.profiler.recorder import with_memory_plan

    source = ReplaySource(trace)
    source.header = with_memory_plan(source.header)  # planned here for a trace from before engines sent it
    MoectlApp(source, theme=theme).run()


def _gpu_timeline(traces, source: Path, theme: str) -> None:
    from moectl.console.gpu_timeline import gpu_timeline_app

    gpu_timeline_app(traces, Path(source).name, theme=theme).run()


@handles_errors
def attach(url: str = typer.Argument(..., help="A running `moectl serve`, e.g. http://127.0.0.1:8000 (with "
                                                 "--vllm: a vLLM server)"),
           token: str | None = typer.Option(None, "--token", help="Bearer token: lets the console's controls act "
                                                                  "on the remote engine (read-only without)."),
           vllm: bool = typer.Option(False, "--vllm", help="The server is vLLM's: the console shows its /metrics, "
                                                           "every figure labelled as vLLM's (no controls)."),
           theme: str = THEME_OPT):
    """Open the console on a remote engine (`moectl serve`): its telemetry stream live; with the
    server's token, rebalancing and knobs act on it. With --vllm: a running vLLM server, read
    from its Prometheus /metrics."""
    from moectl.console.app import MoectlApp
    from moectl.console.sources import AttachSource

    check_theme(theme)
    if vllm:
        from moectl.console.vllm_source import VllmSource

        if token is not None:
            raise BadInput("--token: moectl drives no control on a vLLM server; drop it with --vllm")
        MoectlApp(VllmSource(url), theme=theme).run()
        return
    MoectlApp(AttachSource(url, token), theme=theme).run()
