"""`moectl trace info | export | diff | report`: recorded traces from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moectl.cli.common import JSON_OPT, BadInput, check_output_file, handles_errors, open_trace

MAX_STEP = 2**63 - 1  # steps are SQLite integers (int64)


def _check_step_range(start: int | None, stop: int | None) -> None:
    """--from-step/--to-step within the int64 range a trace stores steps in."""
    for option, value in (("--from-step", start), ("--to-step", stop)):
        if value is not None and not 0 <= value <= MAX_STEP:
            raise BadInput(f"{option}: must be a step number in 0-{MAX_STEP}, got {value}")

trace_app = typer.Typer(no_args_is_help=True, help="Inspect, export and compare recorded traces.")


@trace_app.command("info")
@handles_errors
def trace_info(trace: Path = typer.Argument(..., help="A trace file."), as_json: bool = JSON_OPT):
    """Format version, model, devices, steps, duration and completeness of a trace."""
    from moectl.profiler.kineto_import import is_timeline

    with open_trace(trace, gpu_timeline=True) as reader:
        reader.check_integrity()  # "complete" says its writer closed it, not that its pages are intact
        header = reader.header
        if is_timeline(header):
            return _timeline_info(trace, reader, as_json)
        model = header.get("model") if isinstance(header.get("model"), dict) else {}
        devices = header.get("devices") or {}
        status = reader.file_status()  # its -wal and -shm count too: an unclosed trace keeps recent steps there
        info = {"trace": str(trace), "format_version": header.get("format_version"),
                "record_format": header.get("record_format"), "steps": reader.num_steps,
                "first_step": reader.first_step, "last_step": reader.last_step,
                "duration_s": reader.duration_s, "actions": reader.num_actions, "dropped": reader.dropped,
                "complete": reader.complete, "model": model.get("name"), "architecture": model.get("architecture"),
                "devices": (devices.get("topology") or {}).get("num_devices"), "backend": devices.get("backend"),
                "bytes": status["bytes"], "state": status["state"], "software": header.get("software", {})}
    imported = header.get("imported")
    if imported:  # an engine's expert-load dump: its records have no time (t_start = t_end = 0), not a 0 s run
        info.update(duration_s=None, step_times="absent",
                    imported={k: imported.get(k) for k in ("engine", "engine_version", "mode", "files")})
    if as_json:
        typer.echo(json.dumps(info, default=str))
        return
    if imported:
        from moectl.cli.trace_import import imported_source

        span = f", step times absent (imported from {imported_source(imported, most_files=2)})"
    else:
        span = f" over {info['duration_s']:.2f} s"
    typer.echo(f"{trace}: moectl trace format {info['format_version']}, {info['steps']} steps "
               f"({info['first_step']}-{info['last_step']}){span}, {info['actions']} actions, {info['bytes']:,} bytes")
    typer.echo(f"model {info['model']} ({info['architecture'] or 'architecture not recorded'}), "
               f"{info['devices'] or 1} device(s) [{info['backend'] or 'single'}]; {status['summary']}, "
               f"{info['dropped']} records dropped while {'importing' if imported else 'recording'}")


@trace_app.command("export")
@handles_errors
def trace_export(
    trace: Path = typer.Argument(..., help="A trace file."),
    fmt: str = typer.Option("chrome", "--format", help="chrome: Chrome Trace Event JSON (Perfetto, chrome://tracing)."),
    out: Path = typer.Option(..., "--output", "-o", help="Output file."),
    start: int | None = typer.Option(None, "--from-step", help="First step to export."),
    stop: int | None = typer.Option(None, "--to-step", help="Export up to (not including) this step."),
    as_json: bool = JSON_OPT,
):
    """Export a range of a trace: a process per device, a thread per lane, memory counters, and
    modeled spans marked in their args."""
    from moectl.profiler.chrome_export import write_chrome_trace

    if fmt != "chrome":
        raise BadInput(f"--format: only 'chrome' is supported, got {fmt!r}")
    _check_step_range(start, stop)
    check_output_file(out, "--output", trace)  # never over the trace it reads
    with open_trace(trace) as reader:
        records = list(reader.steps(start, stop))
        if not records:
            raise BadInput(_empty_range(trace, reader, start, stop))
        t_lo, t_hi = records[0]["t_start"], records[-1]["t_end"]
        actions = list(reader.actions(t_lo, t_hi))
        write_chrome_trace(records, out, header=reader.header, actions=actions)
    result = {"output": str(out), "steps": len(records), "actions": len(actions), "bytes": Path(out).stat().st_size}
    typer.echo(json.dumps(result) if as_json else f"{out}: {len(records)} steps, {len(actions)} actions, "
                                                  f"{result['bytes']:,} bytes")


def _empty_range(trace: Path, reader, start: int | None, stop: int | None) -> str:
    """Why a step range selected nothing, in the flags' words and the trace's own step range."""
    steps = reader.step_times()[0]
    if not len(steps):
        return f"{trace}: the trace has no steps"
    asked = " ".join(f"{flag} {value}" for flag, value in (("--from-step", start), ("--to-step", stop))
                     if value is not None)
    return f"{trace}: no steps in {asked or 'the trace'}: the trace has steps {int(steps[0])}-{int(steps[-1])}"


def _refuse_imported(path: Path, header: dict) -> None:
    """An imported trace holds the source's expert load only: diff's figures (throughput, latency,
    step times) would be zeros, and its balancedness is under another placement rule."""
    imported = header.get("imported")
    if imported:
        raise BadInput(f"{path}: imported from {imported['engine']} [{imported['mode']}]: it has expert load only, no "
                       f"step times, latency or throughput to diff; compare loads with `moectl trace report` "
                       f"(--placement for another placement)")


@trace_app.command("diff")
@handles_errors
def trace_diff(a: Path = typer.Argument(..., help="Baseline trace."), b: Path = typer.Argument(..., help="Other trace."),
               as_json: bool = JSON_OPT):
    """Compare two traces: throughput, latency percentiles, balancedness, step-time breakdown."""
    from moectl.profiler.trace_queries import trace_summary

    with open_trace(a) as ra, open_trace(b) as rb:
        for path, reader in ((a, ra), (b, rb)):
            _refuse_imported(path, reader.header)
        sa, sb = trace_summary(ra), trace_summary(rb)
    if as_json:
        typer.echo(json.dumps({"a": sa, "b": sb}, default=float))
        return
    rows = [("steps", sa["steps"], sb["steps"]), ("tokens/s", sa["tokens_per_s"], sb["tokens_per_s"]),
            ("balancedness", sa["balancedness"], sb["balancedness"])]
    for key in ("ttft_s", "tpot_s"):
        for q in ("p50", "p99"):
            rows.append((f"{key[:-2]} {q} (s)", (sa["latency"].get(key) or {}).get(q),
                         (sb["latency"].get(key) or {}).get(q)))
    for name, value in sa["breakdown"]["measured_mean_s"].items():
        rows.append((f"step {name} (s, measured)", value, sb["breakdown"]["measured_mean_s"].get(name)))
    rows.append(("step comm (s, modeled)", sa["breakdown"].get("communication_modeled_mean_s"),
                 sb["breakdown"].get("communication_modeled_mean_s")))
    typer.echo(f"{'':<28}{str(a):>18}{str(b):>18}{'ratio':>9}")
    for name, va, vb in rows:
        ratio = f"{vb / va:.3f}" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "-"
        fa = "-" if va is None else (f"{va:.4g}" if isinstance(va, float) else str(va))
        fb = "-" if vb is None else (f"{vb:.4g}" if isinstance(vb, float) else str(vb))
        typer.echo(f"{name:<28}{fa:>18}{fb:>18}{ratio:>9}")


@trace_app.command("report")
@handles_errors
def trace_report(
    trace: Path = typer.Argument(..., help="A trace file, or a PyTorch-profiler (Kineto) trace: a .json / .json.gz "
                                           "file (torch.profiler, vLLM, SGLang) or a folder of one per rank."),
    start: int | None = typer.Option(None, "--from-step", help="First step of the range."),
    stop: int | None = typer.Option(None, "--to-step", help="End of the range (exclusive)."),
    placement_file: Path | None = typer.Option(None, "--placement",
                                                  help="Counterfactual: a placement file (what `plan rebalance "
                                                       "--json` writes) to replay the recorded routing on."),
    rules: Path | None = typer.Option(None, "--rules", help="Kineto traces: your kernel classes, tried before the "
                                                            "shipped ones (a file like profiler/kernel_classes.json)."),
    as_json: bool = JSON_OPT,
):
    """Analyses of a trace range: balancedness, utilisation, stragglers, hottest experts, step-time
    breakdown (measured; modeled communication apart), latency percentiles, memory growth and
    alerts with a suggested action; with --placement, what the same routing does under it.
    A Kineto trace: time per kernel class per rank, GPU idle time, communication overlapped by
    computation, the straggler rank and the kernels no rule classes."""
    from moectl.placement.topology import Topology
    from moectl.profiler import analysis
    from moectl.profiler.kineto import is_kineto
    from moectl.profiler.kineto_import import is_timeline
    from moectl.profiler.trace_queries import cache_summary, placement_in_force

    steps_only = BadInput("--from-step/--to-step/--placement: moectl traces only (a Kineto trace, or its "
                          "import as a GPU timeline, has no engine steps)")
    asked_steps = start is not None or stop is not None or placement_file is not None
    if is_kineto(trace):
        if asked_steps:
            raise steps_only
        from moectl.profiler.kineto import report

        return _kineto_report(report(trace, rules), as_json)
    with open_trace(trace, gpu_timeline=True) as reader:  # one open: a moectl trace or its GPU timeline
        if is_timeline(reader.header):
            if asked_steps:
                raise steps_only
            from moectl.profiler.kineto import summarise
            from moectl.profiler.kineto_import import read_timeline

            return _kineto_report(summarise(read_timeline(reader, rules), trace), as_json)
        if rules is not None:
            raise BadInput("--rules: classes a Kineto trace's kernels (a .json / .json.gz file, a folder, or its "
                           "import)")
        _check_step_range(start, stop)
        records = list(reader.steps(start, stop))
        if not records:
            raise BadInput(_empty_range(trace, reader, start, stop))
        placement, changes = placement_in_force(reader, records[0]["step"])
        devices = reader.header.get("devices") or {}
        header = reader.header
        imported = header.get("imported")  # an engine's expert-load dump (cli/trace_import.py)
    changes = [s for s in changes if s < records[-1]["step"]]
    topology = Topology.from_mapping(devices["topology"]) if devices.get("topology") else None
    stragglers = analysis.stragglers(records, placement)
    counts: dict[int, int] = {}
    for s in stragglers:
        counts[s["device"]] = counts.get(s["device"], 0) + 1
    report = {
        "steps": [records[0]["step"], records[-1]["step"]], "placement_changes_in_range": changes,
        "balancedness": analysis.balancedness(records, placement),
        "utilisation": analysis.utilisation(records),
        "straggler_steps_per_device": counts,
        "hottest_experts": analysis.hottest_experts(records, top=5),
        "breakdown": analysis.step_breakdown(records),
        "latency": analysis.latency_percentiles(records),
        "memory_growth": analysis.memory_growth(records),
        "caches": cache_summary(records),
        "alerts": analysis.alerts(records, placement, topology, devices.get("expert_bytes"),
                                  devices.get("redundant_slots") or None),
    }
    if placement_file is not None:
        report["counterfactual"] = analysis.counterfactual(records, _placement_for_trace(placement_file, header))
    if imported:  # only the load is measured there: the rest is said to be absent, not printed as zeros
        from moectl.cli.trace_import import imported_report
        return imported_report(report, imported, as_json)
    if as_json:
        typer.echo(json.dumps(report, default=float))
        return
    _print_report(report)


def _placement_for_trace(path: Path, header: dict):
    """--placement of trace report: the placement file every command reads, fitted to the model
    the trace recorded (the routing's layers and experts, where the header names no model)."""
    from moectl.placement.placement import PlacementError
    from moectl.placement.placement_file import fit_to_model, identity_from_header, read_placement_file

    try:
        placement, planned_for = read_placement_file(path)
        recorded = identity_from_header(header)
        if recorded is None:
            raise PlacementError("the trace records no model to check it against")
        return fit_to_model(placement, planned_for, recorded)
    except PlacementError as exc:
        raise BadInput(f"--placement: {path}: {exc}") from None


def _print_report(r: dict) -> None:
    say = typer.echo
    lo, hi = r["steps"]
    bal = r["balancedness"]
    say(f"steps {lo}-{hi}" + (f" (placement changed at steps {r['placement_changes_in_range']}: figures use the "
                              f"one in force at step {lo})" if r["placement_changes_in_range"] else ""))
    if bal.get("overall") is not None:
        per_layer = ", ".join("-" if b is None else f"{b:.2f}" for b in bal["per_layer"] or [])
        say(f"balancedness {bal['overall']:.3f}" + (f" (per layer: {per_layer})" if per_layer else ""))
    util = r["utilisation"]["per_device"]
    if util:
        step = "modeled parallel step" if r["utilisation"].get("step_time_modeled") else "measured step"
        say(f"utilisation (measured expert busy / {step}): " + ", ".join(f"d{d} {u:.0%}" for d, u in enumerate(util)))
        say("straggler steps per device: " + ", ".join(f"d{d} {n}" for d, n in sorted(r["straggler_steps_per_device"].items())))
    say("hottest experts: " + ", ".join(f"L{e['layer']}/E{e['expert']} {e['share']:.0%}" for e in r["hottest_experts"]))
    b = r["breakdown"]
    say("step time, mean (measured): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in b["measured_mean_s"].items())
        + (f"; communication (modeled) {b['communication_modeled_mean_s'] * 1e3:.4f} ms"
           if b['communication_modeled_mean_s'] else ""))
    lat = r["latency"]
    for key in ("ttft_s", "tpot_s"):
        p = lat.get(key) or {}
        if p.get("p50") is not None:
            say(f"{key[:-2].upper()} p50/p90/p99: " + "/".join(f"{p[q] * 1e3:.1f}" for q in ("p50", "p90", "p99")) + " ms")
    say(f"throughput {lat.get('throughput_tok_s') or 0:.1f} tok/s")
    c = r["caches"]
    say(f"KV preemptions {c['preemptions']}, prefix cache {c['prefix_hit_tokens']:,} of "
        f"{c['prefix_query_tokens']:,} prompt tokens"
        + (f", expert cache {c['expert_cache_hit_rate']:.1%} hits ({c['expert_prefetches']:,} prefetches)"
           if c["expert_cache_hit_rate"] is not None else ""))
    mem = r["memory_growth"]
    if mem.get("absent"):
        say(f"process memory slope absent ({mem['absent']})")
    elif mem.get("samples"):
        say(f"process memory slope {mem['slope_bytes_per_s'] / 2**20:+.2f} MiB/s over {mem['samples']} samples"
            + (" (leak suspected)" if mem["leak_suspected"] else ""))
    for a in r["alerts"]:
        say(f"[{a['severity']}] {a['message']} -> {a['action']}")
    if "counterfactual" in r:
        say(f"counterfactual placement: balancedness {r['counterfactual']['overall']:.3f} on the same routing")


from moectl.cli.trace_import import trace_import  # noqa: E402 - `trace import` lives in its own module

trace_app.command("import")(trace_import)


def _timeline_info(trace: Path, reader, as_json: bool) -> None:
    meta = reader.header["gpu_timeline"]
    status = reader.file_status()
    info = {"trace": str(trace), "record_format": reader.header.get("record_format"), "records": reader.num_steps,
            "gpu_timeline": {"source": meta["source"], "files": meta["files"], "rules": meta["rules"],
                             "ranks": [{k: r[k] for k in ("rank", "file", "source", "lanes")} for r in meta["ranks"]],
                             "absent": meta["absent"]},
            "bytes": status["bytes"], "state": status["state"], "software": reader.header.get("software", {})}
    if as_json:
        typer.echo(json.dumps(info, default=str))
        return
    ranks = meta["ranks"]
    typer.echo(f"{trace}: a GPU timeline imported from {len(meta['files'])} PyTorch-profiler trace file(s): "
               f"{len(ranks)} rank(s), {sum(len(r['lanes']) for r in ranks)} lanes, {reader.num_steps} records, "
               f"{info['bytes']:,} bytes; {status['summary']}")
    typer.echo(f"absent: {', '.join(meta['absent'])} (the source measures none of them)")


def _kineto_report(result: dict, as_json: bool) -> None:
    """`trace report` of a PyTorch-profiler trace (profiler/kineto.py), read from the source or its
    import: every figure measured by it."""
    path = result["path"]
    if as_json:
        typer.echo(json.dumps(result, default=float))
        return
    ranks = result["ranks"]
    source = ranks[0]["source"]
    typer.echo(f"{path}: {len(ranks)} rank(s), {sum(r['events'] for r in ranks):,} "
               f"{'device events' if source == 'device' else 'CPU ops (no device events: a CPU run)'}")
    total = sum(result["breakdown"].values()) or 1.0
    typer.echo("time by class (all ranks):")
    for cls, seconds in sorted(result["breakdown"].items(), key=lambda kv: -kv[1]):
        typer.echo(f"  {cls:18s} {seconds * 1e3:10.3f} ms  {seconds / total:6.1%}")
    overlap = result["overlap"]
    typer.echo(f"idle: {result['idle_s'] * 1e3:.3f} ms (within each rank's span, no event running)")
    typer.echo("communication overlapped by computation: " + (
        f"{overlap['fraction']:.1%} of {overlap['communication_s'] * 1e3:.3f} ms" if overlap["fraction"] is not None
        else "no communication events"))
    layers = result["layers"]
    if layers["by_layer"]:
        typer.echo(f"per layer ({layers['placed_s'] / (layers['total_s'] or 1.0):.0%} of the time placed by the "
                   f"trace's layer annotations):")
        for layer, per_class in layers["by_layer"].items():
            top = sorted(per_class.items(), key=lambda kv: -kv[1])
            typer.echo(f"  layer {layer:>4s} {sum(per_class.values()) * 1e3:10.3f} ms  "
                       + ", ".join(f"{c} {v * 1e3:.3f}" for c, v in top[:4]))
    else:
        typer.echo("per layer: absent (no layer annotations: profile with with_stack=True, or record_function "
                   "ranges named like 'layers.N'; kernels replayed from a CUDA graph have no per-layer launch)")
    if len(ranks) > 1:
        s = result["straggler"]
        typer.echo(f"straggler: rank {s['rank']}, busy {s['busy_s'] * 1e3:.3f} ms ({s['behind_median_s'] * 1e3:+.3f} ms "
                   f"on the median rank)")
    if result["unclassed"]:
        typer.echo("unclassed, by time (add rules with --rules FILE):")
        for name, seconds in result["unclassed"]:
            typer.echo(f"  {seconds * 1e3:10.3f} ms  {name[:100]}")
