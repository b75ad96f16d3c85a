"""`moectl trace import`: the expert load SGLang or vLLM measured, as a moectl trace, and the
report of such a trace, which holds only that load (docs/external_load.md); or PyTorch-profiler
(Kineto) traces as a GPU timeline (docs/kineto.md)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moectl.cli.common import JSON_OPT, BadInput, check_output_file, handles_errors

# report sections no imported source measures (the header's imported.absent says why)
ABSENT_SECTIONS = ("utilisation", "straggler_steps_per_device", "breakdown", "latency", "memory_growth", "caches")


@handles_errors
def trace_import(
    sources: list[Path] = typer.Argument(..., help="SGLang expert distribution dump(s) (.pt; per_pass/per_token: "
                                                   "one per rank), saved vLLM EplbState dict(s) (.pt or .json, "
                                                   "one per rank), or PyTorch-profiler traces (.json / .json.gz, "
                                                   "one per rank, or a folder of them)."),
    out: Path = typer.Option(..., "--output", "-o", help="The trace file to write."),
    fmt: str | None = typer.Option(None, "--format", help="sglang, vllm or kineto (default: told by the file's "
                                                          "contents)."),
    rules: Path | None = typer.Option(None, "--rules", help="kineto: your kernel classes and layer patterns, tried "
                                                            "before the shipped ones (profiler/kernel_classes.json)."),
    ep_size: int | None = typer.Option(None, "--ep-size", help="EP ranks the source ran on: splits its "
                                                             "physical_to_logical_map into a device placement "
                                                             "(vLLM: default the saved 'ep_size')."),
    engine_version: str | None = typer.Option(None, "--engine-version", help="The engine's version, for the header "
                                                                           "(SGLang's dumps carry none)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
    as_json: bool = JSON_OPT,
):
    """Write the per-expert load an engine measured (tokens per logical expert per layer, one step
    record per pass) into a trace that report, replay and `plan rebalance` read. Step times,
    requests and memory are not in the source and stay absent; the header names the source.
    PyTorch-profiler traces become a GPU timeline: each rank's kernels, copies and memsets by
    stream, classed and placed in layers, that `trace report` and `replay` read."""
    from moectl.profiler.external_load import guess_engine, read_source, write_imported_trace
    from moectl.profiler.kineto import looks_like_trace

    check_output_file(out, "--output", *sources)  # never over a source it reads
    if out.exists() and not overwrite:
        raise BadInput(f"--output: {out} exists (give --overwrite to replace it)")
    if fmt == "kineto" or (fmt is None and looks_like_trace(sources[0])):
        if ep_size is not None or engine_version is not None:
            raise BadInput("--ep-size/--engine-version: for expert-load dumps (a PyTorch-profiler trace says its own)")
        return _import_timeline(sources, out, rules, overwrite, as_json)
    if rules is not None:
        raise BadInput("--rules: classes a PyTorch-profiler trace's kernels (--format kineto)")
    engine = fmt or guess_engine(sources)
    load = read_source(engine, sources, ep_size)
    if engine_version is not None:
        load.engine_version = engine_version
    result = write_imported_trace(load, out, overwrite=overwrite)
    if as_json:
        typer.echo(json.dumps(result))
        return
    devices = f"on {result['devices']} devices" if result["devices"] else "no device placement"
    typer.echo(f"{out}: {result['steps']} {engine} {result['mode']} records, {result['layers']} layers x "
               f"{result['experts']} experts, {result['tokens_routed']:,} routed tokens, {devices}")
    for note in result["notes"]:
        typer.echo(f"  {note}")


def _import_timeline(sources: list[Path], out: Path, rules: Path | None, overwrite: bool, as_json: bool) -> None:
    from moectl.profiler.kineto_import import read_source, write_timeline

    traces = read_source(sources, rules)
    result = write_timeline(traces, out, rules, overwrite=overwrite)
    if as_json:
        typer.echo(json.dumps(result))
        return
    what = "device events" if result["source"] == "device" else "CPU ops (no device events: a CPU run)"
    typer.echo(f"{out}: a GPU timeline of {len(traces)} rank(s), {result['events']:,} {what}, "
               f"{sum(len(t.lanes) for t in traces)} lanes; open it with `moectl replay {out}`")


def imported_source(imported: dict, most_files: int = 3) -> str:
    """'sglang 0.5.4 [per_pass]: a.pt, b.pt': what an imported trace's header says it came from."""
    names = [f["name"] for f in imported.get("files") or ()]
    files = ", ".join(names[:most_files]) + (f" and {len(names) - most_files} more" if len(names) > most_files else "")
    return f"{imported['engine']} {imported.get('engine_version') or '(version unknown)'} [{imported['mode']}]: {files}"


def imported_report(report: dict, imported: dict, as_json: bool) -> None:
    """`trace report` of an imported trace: the load figures, and what the source did not measure
    said to be absent instead of printed as zeros."""
    report = {**report, **dict.fromkeys(ABSENT_SECTIONS), "absent": imported.get("absent", []),
              "imported": {k: imported.get(k) for k in ("engine", "engine_version", "mode", "files")}}
    if as_json:
        typer.echo(json.dumps(report, default=float))
        return
    say = typer.echo
    lo, hi = report["steps"]
    say(f"imported from {imported_source(imported, most_files=len(imported.get('files') or ()))}; "
        f"records {lo}-{hi} are source passes")
    bal = report["balancedness"]
    if bal.get("overall") is not None:
        per_layer = ", ".join("-" if b is None else f"{b:.2f}" for b in bal["per_layer"] or [])
        say(f"balancedness {bal['overall']:.3f} under the source's placement (per layer: {per_layer})")
    else:
        say("balancedness: absent (the source has no device placement)")
    say("hottest experts: " + ", ".join(f"L{e['layer']}/E{e['expert']} {e['share']:.0%}"
                                        for e in report["hottest_experts"]))
    for a in report["alerts"]:
        say(f"[{a['severity']}] {a['message']} -> {a['action']}")
    if "counterfactual" in report:
        say(f"counterfactual placement: balancedness {report['counterfactual']['overall']:.3f} on the same routing")
    say("absent (not measured by the source): " + ", ".join(report["absent"]))
