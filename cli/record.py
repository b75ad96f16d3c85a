"""`moectl record`: the engine headless on a workload, every step and action to a trace file."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import typer

from moectl.cli.common import (
    BACKEND_OPT,
    DTYPE_OPT,
    EXPERT_CACHE_OPT,
    HBM_OPT,
    HOST_MEM_OPT,
    JSON_OPT,
    MODEL_OPT,
    NPROC_OPT,
    PLACEMENT_OPT,
    THREADS_OPT,
    BadInput,
    engine_config,
    handles_errors,
    parse_threads,
)
from moectl.engine.parallel.backends import Engines

DEFAULT_RECORD_WORKLOAD = "rate=6,prompt=32-256,output=32-128,duration=86400"


@handles_errors
def record(
    trace: Path = typer.Argument(..., help="Trace file to write (SQLite)."),
    steps: int | None = typer.Option(None, "--steps", help="Stop after this many engine steps."),
    seconds: float | None = typer.Option(None, "--seconds", help="Stop after this many seconds."),
    model: Path | None = MODEL_OPT,
    devices: int = typer.Option(4, "--devices", "-d", help="Devices for the experts (emulated on the local backend)."),
    hbm: str = HBM_OPT,
    backend: str = BACKEND_OPT,
    nproc: int | None = NPROC_OPT,
    placement: Path | None = PLACEMENT_OPT,
    expert_cache: int | None = EXPERT_CACHE_OPT,
    host_mem: str | None = HOST_MEM_OPT,
    redundant: int = typer.Option(0, "--redundant", help="Redundant expert slots per device."),
    workload: str = typer.Option(DEFAULT_RECORD_WORKLOAD, "--workload",
                                 help="key=value list (rate, prompt, output, requests, duration, seed) or a "
                                      ".jsonl file; arrivals in real time."),
    kv_blocks: int | None = typer.Option(None, "--kv-blocks", help="KV cache blocks in all (default: from "
                                                                   "the engine's KV memory)."),
    rebalance_at: int | None = typer.Option(None, "--rebalance-at", help="At this step, preview and apply a "
                                                                         "rebalance (an operator action)."),
    capture: int | None = typer.Option(None, "--capture", help="Deep capture (torch.profiler) of this many "
                                                               "steps at the start."),
    dtype: str | None = DTYPE_OPT,
    threads: str = THREADS_OPT,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing trace file."),
    as_json: bool = JSON_OPT,
):
    """Run the engine headless on a workload and record every step and action to TRACE."""

    from moectl.engine.tools.workload import WorkloadSpec

    if (steps is None) == (seconds is None):
        raise BadInput("give --steps N or --seconds S (one of them)")
    if steps is not None and steps < 1:
        raise BadInput("--steps: must be >= 1")
    if seconds is not None and not 0 < seconds < math.inf:
        raise BadInput("--seconds: must be a positive number")
    if Path(trace).exists() and not overwrite:
        raise BadInput(f"{trace}: exists (use --overwrite to replace it)")
    spec = WorkloadSpec.from_option(workload)
    config = engine_config(model, devices=devices, hbm=hbm, expert_cache=expert_cache, host_mem=host_mem, dtype=dtype,
                           redundant_slots=redundant, num_kv_blocks=kv_blocks, backend=backend, nproc=nproc,
                           placement=placement, num_threads=parse_threads(threads))
    engines = Engines(config, backend)
    try:
        return _record(engines, trace, steps, seconds, spec, rebalance_at, capture, overwrite, as_json)
    finally:
        engines.close()


def _record(engines, trace: Path, steps, seconds, spec, rebalance_at, capture, overwrite: bool, as_json: bool):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from moectl.engine.core.driver import EngineDriver
    from moectl.engine.tools.workload import WorkloadFeed, workload_for_engine
    from moectl.profiler.recorder import TraceRecorder

    driver = EngineDriver(engines.make_engine, buffer_records=False, start=False, name="moectl-record")
    engine = driver.engine
    feed = driver.feed = WorkloadFeed(workload_for_engine(spec, engine))
    recorder = TraceRecorder(engine, trace, overwrite=overwrite, max_steps=steps)
    if rebalance_at is not None:
        def rebalance(stats) -> None:  # on the engine thread, right after the step is recorded
            if stats.step == rebalance_at:
                plan = engine.experts.preview()
                engine.experts.apply(plan.placement, kind="rebalance_apply")
        engine.add_listener(on_step=rebalance)
    if capture:
        engine.capture(capture)
    t0 = time.monotonic()
    total = steps if steps is not None else seconds
    progress = Progress(TextColumn("recording"), BarColumn(), TextColumn("{task.fields[what]}"), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=as_json)
    task = progress.add_task("record", total=total, what="")
    driver.start()
    try:
        with progress:
            while True:
                done = recorder.steps if steps is not None else time.monotonic() - t0
                progress.update(task, completed=min(done, total), what=f"{recorder.steps} steps")
                if done >= total or recorder.full.is_set() or driver.error is not None:
                    break
                if feed.exhausted and not engine.has_unfinished():
                    break  # the workload ended first
                recorder.full.wait(0.1)
    finally:
        driver.close()
        engine.fail_all("abort")
        close_error = _close_recorder(recorder)
    if driver.error is not None:
        raise RuntimeError(f"the engine failed at step {engine.step_count}: {driver.error} "
                           f"({recorder.steps} steps recorded in {trace})")
    if close_error is not None:  # not bad input: exit 1, one line
        raise RuntimeError(close_error)
    result = {"trace": str(trace), "steps": recorder.steps, "dropped": recorder.dropped,
              "rejected_requests": feed.rejected, "seconds": round(time.monotonic() - t0, 3),
              "bytes": Path(trace).stat().st_size}
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(f"{trace}: {result['steps']} steps in {result['seconds']:.1f} s, {result['bytes']:,} bytes, "
                   f"{result['dropped']} dropped" + (f", {feed.rejected} requests refused by the engine "
                                                     f"(too long for its KV cache)" if feed.rejected else ""))


def _close_recorder(recorder) -> str | None:
    """Closes the recording; its failure as one line, so that it never masks an earlier error."""
    from moectl.profiler.codec import TraceError

    try:
        recorder.close()
    except TraceError as exc:
        return str(exc).splitlines()[0]
    return None
