"""`moectl` / `moectl run` (the live console), `moectl replay TRACE` and `moectl attach URL`."""

from __future__ import annotations

from pathlib import Path

import typer

from moectl.cli.common import (
    BACKEND_OPT,
    DEFAULT_DEVICES,
    DEVICES_OPT,
    DTYPE_OPT,
    EXPERT_CACHE_OPT,
    HBM_OPT,
    HOST_MEM_OPT,
    MODEL_OPT,
    NPROC_OPT,
    PLACEMENT_OPT,
    THEME_OPT,
    THREADS_OPT,
    BadInput,
    engine_config,
    handles_errors,
    parse_threads,
)
from moectl.engine.parallel.backends import Engines
from moectl.themes import check_theme

DEMO_WORKLOAD = "rate=4,prompt=32-256,output=32-128"
# the live console's own options (`run`, and `web` which hands them on to it)
LIVE_REDUNDANT_OPT = typer.Option(1, "--redundant", help="Redundant expert slots per device (room for replicas).")
DEMO_WORKLOAD_OPT = typer.Option(DEMO_WORKLOAD, "--workload", help="The demo workload: rate=R,prompt=LO-HI,"
                                                                  "output=LO-HI (editable live).")


def demo_load(workload: str):
    """The --workload option as the live console's DemoLoad; a bad one is bad input."""
    from moectl.console.sources import DemoLoad
    from moectl.engine.tools.workload import WorkloadSpec

    try:
        return DemoLoad.from_spec(WorkloadSpec.from_option(workload))
    except ValueError as exc:
        message = str(exc)
        raise BadInput(message if message.startswith("--workload") else f"--workload: {message}") from None


def live_source(model: Path | None, devices: int | None, hbm: str, redundant: int, expert_cache: int | None,
                workload: str, dtype: str | None, threads: int | str, backend: str = "local", nproc: int | None = None,
                placement: Path | None = None, host_mem: str | None = None):
    from moectl.console.sources import LiveSource

    load = demo_load(workload)
    config = engine_config(model, devices=devices, hbm=hbm, expert_cache=expert_cache, host_mem=host_mem, dtype=dtype,
                           redundant_slots=redundant, num_threads=parse_threads(threads), backend=backend,
                           nproc=nproc, placement=placement, default_devices=DEFAULT_DEVICES,
                           reserved_cores=1)  # a core for the UI
    engines = Engines(config, backend)
    try:
        return LiveSource(engines.make_engine, load, on_close=engines.close)
    except BaseException:
        engines.close()
        raise


@handles_errors
def run(
    model: Path | None = MODEL_OPT,
    devices: int | None = DEVICES_OPT,
    hbm: str = HBM_OPT,
    redundant: int = LIVE_REDUNDANT_OPT,
    backend: str = BACKEND_OPT,
    nproc: int | None = NPROC_OPT,
    placement: Path | None = PLACEMENT_OPT,
    expert_cache: int | None = EXPERT_CACHE_OPT,
    host_mem: str | None = HOST_MEM_OPT,
    workload: str = DEMO_WORKLOAD_OPT,
    dtype: str | None = DTYPE_OPT,
    threads: str = THREADS_OPT,
    theme: str = THEME_OPT,
    check_only: bool = typer.Option(False, "--check-only", hidden=True,
                                    help="Build the engine, then exit without the console (how `web` checks "
                                         "its options before serving)."),
):
    """The live console (the default command): the embedded engine on a steady demo workload,
    experts on emulated devices in the naive contiguous placement, so imbalance shows and a
    rebalance visibly helps."""
    from moectl.console.app import MoectlApp

    check_theme(theme)
    source = live_source(model, devices, hbm, redundant, expert_cache, workload, dtype, threads, backend, nproc,
                         placement, host_mem)
    if check_only:
        source.close()
        return
    MoectlApp(source, theme=theme).run()


@handles_errors
def replay(trace: Path = typer.Argument(..., help="A trace recorded by `moectl record`."), theme: str = THEME_OPT):
    """Replay a trace in the console: play, pause, speed, step, seek; rebalancing shows the
    counterfactual on the recorded routing."""
    from moectl.console.app import MoectlApp
    from moectl.console.sources import ReplaySource

    check_theme(theme)
    if Path(trace).is_dir():
        raise BadInput(f"{trace}: is a directory, not a trace")
    if not Path(trace).is_file():
        raise BadInput(f"{trace}: no such trace file")
    MoectlApp(ReplaySource(trace), theme=theme).run()


@handles_errors
def attach(url: str = typer.Argument(..., help="A running `moectl serve`, e.g. http://127.0.0.1:8000"),
           token: str | None = typer.Option(None, "--token", help="Bearer token: lets the console's controls act "
                                                                  "on the remote engine (read-only without)."),
           theme: str = THEME_OPT):
    """Open the console on a remote engine (`moectl serve`): its telemetry stream live; with the
    server's token, rebalancing and knobs act on it."""
    from moectl.console.app import MoectlApp
    from moectl.console.sources import AttachSource

    check_theme(theme)
    MoectlApp(AttachSource(url, token), theme=theme).run()
