"""`moectl record`: the engine headless on a workload, every step and action to a trace file."""

from __future__ import annotations

import json
import math
import time
from collections import deque
from pathlib import Path

import typer

from moectl.cli.common import JSON_OPT, BadInput, engine_config, handles_errors
from moectl.cli.engine_options import DEFAULT_OPTIONS, EngineOptions, with_engine_options
from moectl.cli.sim_backend import SIMULATED, refuse_sim_options
from moectl.wire.actions import Action

DEFAULT_RECORD_WORKLOAD = "rate=6,prompt=32-256,output=32-128,duration=86400"
# The trace file keeps every step; the engine's own in-memory step log (4096 records of ~25 KB
# by default) would be a second, RAM-resident copy of the first few thousand. The engine reads
# only its newest record, so a short window is all a recording needs.
RECORD_STEP_LOG = 16
MAX_CAPTURE_STEPS = 1000  # the engine's own limit on a deep capture


@handles_errors
@with_engine_options()
def record(
    ctx: typer.Context,
    trace: Path = typer.Argument(..., help="Trace file to write (SQLite)."),
    steps: int | None = typer.Option(None, "--steps", help="Stop after this many engine steps."),
    seconds: float | None = typer.Option(None, "--seconds", help="Stop after this many seconds."),
    options: EngineOptions = DEFAULT_OPTIONS,
    workload: str = typer.Option(DEFAULT_RECORD_WORKLOAD, "--workload",
                                 help="key=value list (rate, prompt, output, requests, duration, seed) or a "
                                      ".jsonl file; arrivals in real time (simulated backend: in simulated "
                                      "seconds, lengths only, rate auto unless given)."),
    kv_blocks: int | None = typer.Option(None, "--kv-blocks", help="KV cache blocks in all (default: from "
                                                                   "the engine's KV memory)."),
    rebalance_at: int | None = typer.Option(None, "--rebalance-at", help="At this step, preview and apply a "
                                                                         "rebalance (an operator action)."),
    capture: int | None = typer.Option(None, "--capture", help="Deep capture (torch.profiler) of this many "
                                                               "steps at the start."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing trace file."),
    as_json: bool = JSON_OPT,
):
    """Run the engine headless on a workload and record every step and action to TRACE."""
    from moectl.engine.core import gc_heap

    gc_heap.own_process()  # this process serves one engine for its life: its heap is frozen once built

    from moectl.engine.parallel.backends import Engines
    from moectl.engine.tools.workload import WorkloadSpec

    _check_options(trace, steps, seconds, overwrite, capture, rebalance_at, kv_blocks)
    refuse_sim_options(options)
    if options.backend == SIMULATED:
        return _record_simulated(ctx, options, trace, steps, seconds, workload, rebalance_at, capture, kv_blocks,
                                 overwrite, as_json)
    spec = WorkloadSpec.from_option(workload)
    config = engine_config(options, num_kv_blocks=kv_blocks)
    engines = Engines(config, options.backend)
    try:
        return _record(engines, trace, steps, seconds, spec, rebalance_at, capture, overwrite, as_json)
    finally:
        engines.close()


def _record_simulated(ctx, options: EngineOptions, trace, steps, seconds, workload, rebalance_at, capture, kv_blocks,
                      overwrite, as_json):
    """record --backend simulated: the simulated cluster on its simulated clock (--seconds is wall
    time still: how long to record); the workload's requests and duration count in it."""
    from moectl.cli.engine_options import given
    from moectl.cli.sim_backend import SimEngines, refuse_real_engine_options, sim_load
    from moectl.engine.core.driver import EngineDriver
    from moectl.engine.tools.sim_workload import SimWorkload

    refuse_real_engine_options(options)
    if capture is not None:
        raise BadInput("--capture: a simulated cluster runs no kernels to profile (its spans are all modeled)")
    if kv_blocks is not None:
        raise BadInput("--kv-blocks: the simulated backend's KV pool is what the memory plan leaves")
    engines = SimEngines(options)
    load, spec = sim_load(workload if given(ctx, "workload") else None, engines.first.max_model_len)
    feed = SimWorkload(load, seed=spec.seed or options.sim_seed, num_requests=spec.num_requests, duration_s=spec.duration_s)
    driver = EngineDriver(engines.make_engine, feed=feed, buffer_records=False, start=False, name="moectl-record")
    engine = driver.engine
    biggest = spec.prompt_dist.hi + spec.output_dist.hi
    if biggest > engine.max_model_len:
        raise BadInput(f"--workload: its largest request ({biggest} tokens) exceeds the model's context of "
                       f"{engine.max_model_len} tokens (the simulated backend's max_model_len)")
    recorder, seconds_run = _record_run(driver, feed, trace, steps, seconds, rebalance_at, None, overwrite, as_json,
                                        "the simulated engine")
    return _report(recorder, feed, trace, seconds_run, as_json, simulated_s=engine.now)


def _check_options(trace: Path, steps, seconds, overwrite: bool, capture, rebalance_at, kv_blocks) -> None:
    """Every option that can be checked without the engine, before anything is loaded or written."""
    if (steps is None) == (seconds is None):
        raise BadInput("give --steps N or --seconds S (one of them)")
    if steps is not None and steps < 1:
        raise BadInput("--steps: must be >= 1")
    if seconds is not None and not 0 < seconds < math.inf:
        raise BadInput("--seconds: must be a positive number")
    if capture is not None and not 1 <= capture <= MAX_CAPTURE_STEPS:
        raise BadInput(f"--capture: must be a step count in 1-{MAX_CAPTURE_STEPS}, got {capture}")
    if rebalance_at is not None and rebalance_at < 1:
        raise BadInput(f"--rebalance-at: must be a step number >= 1 (the first step is 1), got {rebalance_at}")
    if capture is not None and steps is not None and capture > steps:  # it would end short, unsaid
        raise BadInput(f"--capture: {capture} steps is more than the {steps} of --steps")
    if rebalance_at is not None and steps is not None and rebalance_at > steps:
        raise BadInput(f"--rebalance-at: step {rebalance_at} is after the last of --steps {steps}")
    if kv_blocks is not None and kv_blocks < 1:
        raise BadInput(f"--kv-blocks: must be >= 1, got {kv_blocks}")
    path = Path(trace)
    if path.is_dir():
        raise BadInput(f"{trace}: is a directory; give a trace file path" + (" (--overwrite replaces files only)"
                                                                              if overwrite else ""))
    if path.exists() and not overwrite:
        raise BadInput(f"{trace}: exists (use --overwrite to replace it)")
    if not path.parent.is_dir():
        raise BadInput(f"{trace}: {path.parent} is not an existing directory")


def _check_workload_fits(spec, engine, items=None) -> None:
    """Bad input when a request of the workload could never run: longer than the model's context
    or than the KV pool a request draws on (the engine would refuse it as it arrives). Without
    items: the workload's smallest possible request (before generating prompts that long);
    with them: the largest generated one."""
    if items is None:
        if spec.source == "jsonl":
            return  # lengths come from the file: checked on the items
        prompt, output = spec.prompt_dist.lo, spec.output_dist.lo
        what = "its smallest request"
    else:
        if not items:
            return
        largest = max(items, key=lambda it: len(it.prompt_ids) + it.params.max_tokens)
        prompt, output = len(largest.prompt_ids), largest.params.max_tokens
        what = "its largest request"
    tokens = prompt + output
    if tokens > engine.max_model_len:
        raise BadInput(f"--workload: {what} ({prompt} prompt + {output} output tokens) exceeds the model's context "
                       f"of {engine.max_model_len} tokens")
    block = engine.config.block_size
    pool = engine.blocks.largest_pool
    if -(-tokens // block) > pool:
        where = "a device's KV pool" if engine.blocks.num_pools > 1 else "the KV cache"
        raise BadInput(f"--workload: {what} ({prompt} prompt + {output} output tokens) needs {-(-tokens // block)} "
                       f"KV blocks of {block} tokens but {where} has {pool} (--kv-blocks {engine.blocks.num_blocks} "
                       f"over {engine.blocks.num_pools} pool(s)); raise --kv-blocks or shorten the workload")


def _record(engines, trace: Path, steps, seconds, spec, rebalance_at, capture, overwrite: bool, as_json: bool):
    from moectl.engine.core.driver import EngineDriver
    from moectl.engine.tools.workload import WorkloadFeed, workload_for_engine

    driver = EngineDriver(engines.make_engine, buffer_records=False, start=False, name="moectl-record")
    engine = driver.engine
    engine.step_log = deque(engine.step_log, maxlen=RECORD_STEP_LOG)
    _check_workload_fits(spec, engine)
    items = workload_for_engine(spec, engine)
    _check_workload_fits(spec, engine, items)
    feed = driver.feed = WorkloadFeed(items)
    recorder, seconds_run = _record_run(driver, feed, trace, steps, seconds, rebalance_at, capture, overwrite, as_json,
                                        "the engine")
    return _report(recorder, feed, trace, seconds_run, as_json)


def _record_run(driver, feed, trace: Path, steps, seconds, rebalance_at, capture, overwrite: bool, as_json: bool,
                what: str):
    """Records the driver's engine to `trace` until done (see _run); a trace this run created
    and left empty is removed. Returns (the recorder, the seconds it ran)."""
    from moectl.profiler.recorder import TraceRecorder

    engine = driver.engine
    existed = Path(trace).exists()
    recorder = TraceRecorder(engine, trace, overwrite=overwrite, max_steps=steps)
    try:
        seconds_run = _run(driver, recorder, feed, steps, seconds, rebalance_at, capture, as_json)
    except BaseException:
        _discard_if_empty(recorder, trace, existed)
        raise
    if driver.error is not None:
        _discard_if_empty(recorder, trace, existed)
        raise RuntimeError(f"{what} failed at step {engine.step_count}: {driver.error} "
                           f"({recorder.steps} steps recorded in {trace})")
    return recorder, seconds_run


def _run(driver, recorder, feed, steps, seconds, rebalance_at, capture, as_json: bool) -> float:
    """Steps the engine on its thread until --steps/--seconds or the workload ends; closes the
    trace. Returns the seconds it ran."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    engine = driver.engine
    if rebalance_at is not None:
        def rebalance(stats) -> None:  # on the engine thread, right after the step is recorded
            if stats.step == rebalance_at:
                plan = engine.experts.preview()
                engine.experts.apply(plan.placement, kind=Action.REBALANCE_APPLY)
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
    if close_error is not None and driver.error is None:  # not bad input: exit 1, one line
        raise RuntimeError(close_error)
    return time.monotonic() - t0


def _report(recorder, feed, trace: Path, seconds: float, as_json: bool, simulated_s: float | None = None) -> None:
    """The result line (or JSON); then a non-zero exit if the engine refused requests on the way.
    simulated_s: a simulated cluster's clock at the end (its steps per wall second are reported)."""
    result = {"trace": str(trace), "steps": recorder.steps, "dropped": recorder.dropped,
              "rejected_requests": feed.rejected, "seconds": round(seconds, 3),
              "bytes": Path(trace).stat().st_size}
    if simulated_s is not None:
        result.update(simulated=True, simulated_seconds=round(simulated_s, 3),
                      steps_per_s=round(recorder.steps / seconds, 2) if seconds > 0 else None)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(f"{trace}: {result['steps']} steps in {result['seconds']:.1f} s, {result['bytes']:,} bytes, "
                   f"{result['dropped']} dropped"
                   + (f"; SIMULATED: {simulated_s:.1f} s of the simulated clock, {result['steps_per_s']} steps "
                      f"per wall second" if simulated_s is not None else ""))
    if feed.rejected:
        raise RuntimeError(f"{feed.rejected} of {feed.added + feed.rejected} requests were refused by the engine "
                           f"(too long for its KV cache or context); {trace} holds the rest")


def _discard_if_empty(recorder, trace: Path, existed: bool) -> None:
    """A trace this run created and that holds no step is removed, so a rerun is not refused with
    'exists'. A file that was there before the run is never deleted."""
    if existed or recorder.steps:
        return
    _close_recorder(recorder)
    for path in (Path(trace), *(Path(f"{trace}{suffix}") for suffix in ("-wal", "-shm", "-journal"))):
        path.unlink(missing_ok=True)


def _close_recorder(recorder) -> str | None:
    """Closes the recording; its failure as one line, so that it never masks an earlier error."""
    from moectl.profiler.codec import TraceError

    try:
        recorder.close()
    except TraceError as exc:
        return str(exc).splitlines()[0]
    return None
