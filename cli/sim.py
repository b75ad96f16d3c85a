"""`moectl sim`: one simulated step of a model (config.json only) on a cluster described by a
hardware profile. Every figure it prints is simulated."""

from __future__ import annotations

from pathlib import Path

import typer

from moectl.cli.common import (
    JSON_OPT,
    BadInput,
    check_output_file,
    check_seed,
    emit_json,
    handles_errors,
    model_dir,
    progress,
    redundant_slots,
)
from moectl.cli.engine_options import DEFAULT_DEVICES, DEVICES_OPT, REDUNDANT_OPT, ROUTING_HINT
from moectl.cli.sim_backend import recorded_routing

sim_app = typer.Typer(invoke_without_command=True, no_args_is_help=False,
                      help="Predict one step at scale (SIMULATED); `moectl sim calibrate` measures this machine's "
                           "profile.")


@sim_app.callback()
@handles_errors
def sim(
    ctx: typer.Context,
    model: Path | None = typer.Option(None, "--model", "-m", help="config.json or a directory holding one (no "
                                                                  "weights), or a shipped model's name (required)."),
    hardware: str | None = typer.Option(None, "--hardware", help="A shipped hardware profile (h100, h800, h200, a100, "
                                                                 "mi300x, ascend-910b, mtt-s5000) or a profile JSON "
                                                                 "file "
                                                                 "(`moectl sim calibrate` writes one; required)."),
    devices: int | None = DEVICES_OPT,
    tp: int = typer.Option(1, "--tp", help="Attention tensor-parallel size (1: data-parallel attention)."),
    ep: int | None = typer.Option(None, "--ep", help="Expert-parallel group size (default: every device)."),
    dp_attention: bool = typer.Option(False, "--dp-attention", help="Data-parallel attention (each device its own "
                                                                    "batch; the default, and refused with --tp > 1)."),
    phase: str = typer.Option("decode", "--phase", help="prefill | decode."),
    batch_seqs: int | None = typer.Option(None, "--batch-seqs", help="decode: sequences per device (default 128)."),
    batch_tokens: int | None = typer.Option(None, "--batch-tokens", help="prefill: prompt tokens per device "
                                                                         "(default 16384)."),
    context: int = typer.Option(4096, "--context", help="decode: KV length; prefill: prompt length."),
    routing: str = typer.Option("balanced", "--routing", help=f"Expert loads: {ROUTING_HINT}."),
    placement: Path | None = typer.Option(None, "--placement", help="A placement file (`plan rebalance --json`) for "
                                                                     "one expert-parallel group."),
    redundant: int | None = REDUNDANT_OPT,
    rebalance: bool = typer.Option(False, "--rebalance", help="Plan an EPLB-style placement on the routing "
                                                              "(replicas in the spare slots) and predict what moving "
                                                              "to it from the naive contiguous one does: the step "
                                                              "before and after, the migration's stall, the steps it "
                                                              "takes to pay off. The step reported is the planned "
                                                              "one's."),
    overlap: str = typer.Option("none", "--overlap", help="none | two-batch (SGLang's two micro-batches) | "
                                                          "five-stage (DeepSeek's decode): one micro-batch's "
                                                          "all-to-all behind the other's compute, as a schedule."),
    comm: str = typer.Option("auto", "--comm", help="The all-to-all: auto (decode low-latency where the profile has "
                                                    "its table, else normal) | normal | low-latency."),
    comm_sms: int | None = typer.Option(None, "--comm-sms", help="With --overlap, normal mode's SMs, taken from "
                                                                 "compute for the step (default: the profile's)."),
    mtp_draft: int = typer.Option(0, "--mtp-draft", help="decode: multi-token prediction's draft tokens a step."),
    mtp_accept: float = typer.Option(0.0, "--mtp-accept", help="decode: each draft token's acceptance (0-1)."),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16 | fp8: the GEMMs' and weights' dtype (default: "
                                                           "the config's quantization_config, else bf16)."),
    pp: int = typer.Option(1, "--pp", help="Pipeline stages: the devices in --pp groups of consecutive devices, each "
                                           "a contiguous run of layers (TP, EP and the batch within a stage); "
                                           "--batch-seqs / --batch-tokens are then per device of a stage."),
    micro_batches: int | None = typer.Option(None, "--micro-batches", help="With --pp: micro-batches a step's batch "
                                                                           "flows through the stages as (default: "
                                                                           "--pp)."),
    pp_layers: str | None = typer.Option(None, "--pp-layers", help="With --pp: layers per stage, e.g. 15,15,15,16 "
                                                                   "(default: balanced by each layer's priced "
                                                                   "time)."),
    seed: int = typer.Option(0, "--seed", help="zipf: which experts are hot; a scaled trace: their order."),
    as_json: bool = JSON_OPT,
):
    """Predict one step: its time, tokens per second (per device and per node), each device's
    utilisation, balancedness and a breakdown by part. Simulated from the config's shapes, the
    hardware profile's sourced figures and the routing: nothing here runs the model."""
    from moectl.engine.sim.hardware import load_profile
    from moectl.engine.sim.model_shape import load_sim_model
    from moectl.engine.sim.routing import routing_from
    from moectl.engine.sim.step_model import (
        SimSpec,
        balanced_stages,
        cluster_placement,
        compare_rebalance,
        memory_per_device,
        moe_rows,
        simulate,
    )
    from moectl.placement.placement_file import read_placement_file
    from moectl.placement.rebalancer import plan_rebalance

    if ctx.invoked_subcommand is not None:
        return
    for value, flag in ((model, "--model"), (hardware, "--hardware")):
        if value is None:
            raise BadInput(f"{flag}: required (moectl sim --model CONFIG --hardware NAME|FILE ...)")
    if dp_attention and tp > 1:
        raise BadInput("--dp-attention: data-parallel attention has no tensor parallelism; drop --tp or this flag")
    if phase == "decode" and batch_tokens is not None:
        raise BadInput("--batch-tokens: is for --phase prefill; decode takes --batch-seqs")
    if phase == "prefill" and batch_seqs is not None:
        raise BadInput("--batch-seqs: is for --phase decode; prefill takes --batch-tokens")
    if placement is not None and (rebalance or redundant is not None):
        raise BadInput("--placement: gives the placement, so it cannot go with --rebalance or --redundant")
    spare = redundant_slots(redundant)
    check_seed(seed)
    devices = DEFAULT_DEVICES if devices is None else devices
    if pp < 1:
        raise BadInput(f"--pp: must be a positive integer (pipeline stages), got {pp}")
    if devices % pp:
        raise BadInput(f"--pp: {pp} must divide the {devices} devices (every stage has the same devices)")
    if pp == 1 and (micro_batches is not None or pp_layers is not None):
        raise BadInput(f"{'--micro-batches' if micro_batches is not None else '--pp-layers'}: goes with --pp > 1")
    stage = devices // pp
    if ep is not None and (ep < 1 or stage % ep):
        raise BadInput(f"--ep: {ep} must divide the {devices} devices" if pp == 1 else
                       f"--ep: {ep} must divide the {stage} devices of a pipeline stage (--devices / --pp)")
    sim_model = load_sim_model(model_dir(model, config_file=True), dtype)
    shape = sim_model.shape
    recorded = recorded_routing(routing)
    loads, routing_line = routing_from(routing, shape.num_sparse, shape.num_experts, seed, recorded)
    try:  # the simulated backend's rule (step_model.cluster_placement): the file's, else the naive one
        chosen, planned_for = read_placement_file(placement) if placement is not None else (None, None)
        chosen = cluster_placement(shape, stage if ep is None else ep, spare, chosen, planned_for)
    except ValueError as exc:
        raise BadInput(f"--placement: {placement}: {str(exc).removeprefix('placement: ')}") from None
    spec = SimSpec(sim_model, load_profile(hardware), devices, loads, phase=phase,
                   tokens_per_device=(128 if batch_seqs is None else batch_seqs) if phase == "decode"
                   else (16384 if batch_tokens is None else batch_tokens),
                   context=context, tp=tp, ep=ep, placement=moe_rows(chosen, shape), overlap=overlap, comm=comm,
                   comm_sms=comm_sms, mtp_draft=mtp_draft, mtp_accept=mtp_accept, pp=pp, micro_batches=micro_batches,
                   pp_layers=pp_layers)
    if pp > 1:  # the stages' layers are fixed before any placement is compared (weights do not move between stages)
        spec.pp_layers = tuple(balanced_stages(spec))
    if rebalance:  # from the naive placement to a planned one: what the rebalance is predicted to do
        planned = plan_rebalance(loads, spec.ep, spare).placement
        comparison, result = compare_rebalance(spec, planned)
        result["rebalance"] = comparison
        spec.placement = planned
    else:
        result = simulate(spec)
    result.update(model=shape.name, hardware=spec.hardware.key, hardware_name=spec.hardware.name,
                  gemm_dtype=sim_model.gemm_dtype, tp=tp, ep=spec.ep, tokens_per_device=spec.tokens_per_device,
                  context=context, overlap=overlap, mtp_draft=mtp_draft, mtp_accept=mtp_accept,
                  routing=routing_line, memory=memory_per_device(spec),
                  assumed=list(spec.hardware.assumed), placement_slots_per_device=spec.placement.slots_per_device)
    if pp > 1:
        result["pp"]["layer_split"] = "given (--pp-layers)" if pp_layers is not None else "balanced"
    if as_json:
        emit_json(result, True)
        return
    _print(result)


def _print(r: dict) -> None:
    from moectl.placement.topology import format_size

    unit = "output" if r["phase"] == "decode" else "prompt"
    typer.echo(f"SIMULATED: {r['model']} on {r['devices']} x {r['hardware_name']} ({r['nodes']} nodes), {r['phase']}, "
               f"{r['tokens_per_device']} {'sequences' if r['phase'] == 'decode' else 'tokens'} per device, context "
               f"{r['context']:,}, tp {r['tp']}, ep {r['ep']}" + (f", pp {r['pp']['pp']}" if "pp" in r else "")
               + f", GEMMs in {r['gemm_dtype']}, overlap {r['overlap']}, "
               f"{r['comm']} all-to-all" + (f", MTP {r['mtp_draft']} draft at {r['mtp_accept']:.0%}" if r["mtp_draft"]
                                            else ""))
    typer.echo("priced from " + ("the profile's kernel tables (docs/sim.md, \"Kernel tables\")" if r["kernel_tables"]
                                 else "the roofline alone: this profile has no kernel tables (peaks and efficiencies "
                                      "only; `moectl sim calibrate --from-trace` fits them)"))
    typer.echo(f"routing: {r['routing']}")
    typer.echo(f"step {r['step_ms']:.2f} ms: {r['tokens_per_s']:,.0f} {unit} tok/s, "
               f"{r['tokens_per_s_per_device']:,.0f} per device, {r['tokens_per_s_per_node']:,.0f} per node")
    util = r["utilisation"]
    typer.echo(f"balancedness {r['balancedness']:.3f}; utilisation min {min(util):.0%}, mean "
               f"{sum(util) / len(util):.0%}, max {max(util):.0%}")
    typer.echo("breakdown (ms; parts overlap with --overlap): " + ", ".join(
        f"{k} {v:.2f}" for k, v in r["breakdown_ms"].items()))
    if "pp" in r:
        _print_pipeline(r)
    mem = r["memory"]
    if "stages" in mem:
        typer.echo("per device, by stage: " + "; ".join(
            f"{x['stage']} (layers {x['layers'][0]}-{x['layers'][1]}) weights {format_size(x['weights_bytes'])} + KV "
            f"{format_size(x['kv_bytes'])}" + ("" if x["fits"] else " -- DOES NOT FIT") for x in mem["stages"])
            + f", of {format_size(mem['hbm_bytes'])} HBM")
    else:
        typer.echo(f"per device: weights {format_size(mem['weights_bytes'])} + KV {format_size(mem['kv_bytes'])} of "
                   f"{format_size(mem['hbm_bytes'])} HBM" + ("" if mem["fits"] else " -- DOES NOT FIT"))
    if "rebalance" in r:
        rb, mig = r["rebalance"], r["rebalance"]["migration"]
        pays = "never" if rb["break_even_steps"] is None else f"after {rb['break_even_steps']:,.1f} steps"
        typer.echo(f"rebalance from the naive placement: step {rb['step_ms_before']:.2f} -> {rb['step_ms_after']:.2f} ms "
                   f"({rb['gain']:+.1%}), balancedness {rb['balancedness_before']:.3f} -> {rb['balancedness_after']:.3f}; "
                   f"migration {mig['experts_moved']:,} experts, {mig['bytes'] / 1e9:.1f} GB, stall {mig['stall_ms']:.1f} "
                   f"ms; pays for itself {pays}")
    if r["assumed"]:
        typer.echo(f"assumed (borrowed from another device's benchmarks): {', '.join(r['assumed'])}")


def _print_pipeline(r: dict) -> None:
    """The pipeline's lines of `moectl sim`'s output (all simulated)."""
    pp = r["pp"]
    spans = " | ".join(f"{a}-{b}" for a, b in pp["stage_layers"])
    typer.echo(f"pipeline: {pp['pp']} stages of {pp['devices_per_stage']} devices, layers {spans} "
               f"({pp['layer_split']}), {pp['micro_batches']} micro-batches"
               + (" (each prompt's chunks in order)" if pp["micro_batches_chunked"] else "")
               + "; stage per micro-batch (ms): " + ", ".join(f"{x:.2f}" for x in pp["stage_ms"]))
    links = sorted(set(pp["transfer_links"]))
    typer.echo(f"  bubble {pp['bubble']:.1%} of stage time (equal stages and free sends: {pp['bubble_uniform']:.1%}); "
               f"stage-to-stage sends " + ", ".join(f"{x:.3f}" for x in pp["transfer_ms"]) + f" ms ({', '.join(links)})")
    typer.echo(f"  kept in flight across steps (no drain; vLLM's and SGLang's PP schedulers): step "
               f"{pp['steady_step_ms']:.2f} ms, bubble {pp['steady_bubble']:.1%}, {pp['steady_tokens_per_s']:,.0f} tok/s")


@sim_app.command("calibrate")
@handles_errors
def calibrate(
    out: Path = typer.Option(..., "--out", "-o", help="The profile JSON to write (refused if it exists)."),
    model: Path | None = typer.Option(None, "--model", "-m", help="The model whose expert and attention shapes are "
                                                                  "timed, and whose engine gives the per-layer "
                                                                  "overhead (default: sample); with --from-trace, "
                                                                  "the model the trace ran (config.json)."),
    ranks: int = typer.Option(2, "--ranks", help="Processes the link is measured between (the distributed "
                                                 "backend's ranks on this machine)."),
    from_trace: Path | None = typer.Option(None, "--from-trace", help="A PyTorch-profiler (Kineto) trace of a few "
                                                                      "layers on a card: its kernel tables, fitted on "
                                                                      "the trace, on --base's datasheet figures "
                                                                      "(nothing runs here)."),
    base: str | None = typer.Option(None, "--base", help="--from-trace: the card's profile (shipped name or file) "
                                                        "giving its peaks, memory, links and all-to-all tables."),
    tokens: int | None = typer.Option(None, "--tokens", help="--from-trace: tokens per device each layer pass of "
                                                             "the trace ran."),
    context: int | None = typer.Option(None, "--context", help="--from-trace: the prompts' length (default: "
                                                               "--tokens)."),
    ep: int | None = typer.Option(None, "--ep", help="--from-trace: devices the trace's experts were spread over."),
    layers: int | None = typer.Option(None, "--layers", help="--from-trace: layer passes the trace covers (default: "
                                                             "its attention kernels, one a pass)."),
    training: bool = typer.Option(False, "--training", help="--from-trace: a training step's trace (forward and "
                                                            "backward); its training-only kernels are dropped."),
    comm_sms: int = typer.Option(0, "--comm-sms", help="--from-trace: SMs the trace's all-to-all held while its "
                                                       "compute ran (its compute is scaled to the whole card)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing file."),
    as_json: bool = JSON_OPT,
):
    """Measure this machine as a hardware profile with the engine's own kernels (the grouped expert
    GEMM, the paged decode kernel, gloo's all_reduce, the engine's decode step), for `moectl sim
    --hardware FILE` and the validation against this machine (docs/sim.md). With --from-trace: a
    card's kernel tables from a profiler trace of a few of its layers (docs/sim.md, "Kernel
    tables")."""
    import json

    # never the trace or the base profile read: --overwrite would lose them
    check_output_file(out, "--out", *[Path(p) for p in (from_trace, base) if p is not None])
    if out.exists() and not overwrite:
        raise BadInput(f"--out: {out} exists (use --overwrite to replace it)")
    if from_trace is not None:
        _calibrate_from_trace(out, from_trace, model, base, tokens, context, ep, layers, training, comm_sms, as_json)
        return
    for value, flag in ((base, "--base"), (tokens, "--tokens"), (context, "--context"), (ep, "--ep"),
                        (layers, "--layers"), (training or None, "--training"), (comm_sms or None, "--comm-sms")):
        if value is not None:
            raise BadInput(f"{flag}: goes with --from-trace")
    if not 2 <= ranks <= 16:
        raise BadInput(f"--ranks: must be in 2-16, got {ranks}")
    import tempfile

    from moectl.engine.tools.sim_calibrate import calibrate as measure
    from moectl.profiler.recorder import TraceRecorder

    path = model_dir(model)
    with tempfile.TemporaryDirectory() as tmp:
        def attach(engine):  # the engine as `moectl record` runs it: its trace writer beside it
            recorder = TraceRecorder(engine, Path(tmp) / "calibrate.trace")
            return recorder.close
        profile = measure(path, ranks=ranks, log=progress(as_json), attach=attach)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    emit_json({"profile": str(out), "name": profile["name"]}, as_json) if as_json else typer.echo(
        f"{out}: this machine's profile (every figure measured; see its sources)")


def _calibrate_from_trace(out: Path, trace: Path, model: Path | None, base: str | None, tokens: int | None,
                          context: int | None, ep: int | None, layers: int | None, training: bool, comm_sms: int,
                          as_json: bool) -> None:
    import json

    from moectl.engine.sim.hardware import parse_profile, raw_profile
    from moectl.engine.sim.model_shape import load_sim_model
    from moectl.profiler.kineto import KinetoError
    from moectl.profiler.trace_calibration import TraceShape, calibrate_from_trace, reproduce

    for value, flag in ((model, "--model"), (base, "--base"), (tokens, "--tokens"), (ep, "--ep")):
        if value is None:
            raise BadInput(f"{flag}: required with --from-trace")
    if not trace.exists():
        raise BadInput(f"--from-trace: {trace} does not exist")
    sim_model = load_sim_model(model_dir(model, config_file=True))
    shape = TraceShape(tokens=tokens, context=tokens if context is None else context, ep=ep, layers=layers,
                       training=training, comm_sms=comm_sms)
    if shape.context > sim_model.shape.max_position_embeddings:
        raise BadInput(f"--context: must be in [1, {sim_model.shape.max_position_embeddings}] (the model's "
                       f"max_position_embeddings), got {shape.context}")
    if sim_model.shape.num_experts % ep:
        raise BadInput(f"--ep: {ep} does not divide the model's {sim_model.shape.num_experts} experts")
    try:
        profile, fitted = calibrate_from_trace(trace, sim_model, raw_profile(base), shape)
    except KinetoError as exc:
        raise BadInput(str(exc)) from None
    # checked before it is written: it reads back as a profile and prices the trace's layer
    priced = reproduce(parse_profile(out.stem, profile), sim_model, shape)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    result = {"profile": str(out), "layers": fitted["layers"], "per_layer_us": fitted["per_layer_us"],
              "priced_us": priced, "training_only_us": fitted["training_only_us"],
              "unclassed_us": fitted["unclassed_us"]}
    if as_json:
        emit_json(result, True)
        return
    typer.echo(f"{out}: {base}'s figures with kernel tables fitted on {trace.name} ({fitted['layers']} layer passes "
               f"of {tokens:,} tokens per device)")
    typer.echo("per layer pass, us: class  trace  priced back")
    for name, us in sorted(fitted["per_layer_us"].items(), key=lambda kv: -kv[1]):
        back = priced.get(name)
        typer.echo(f"  {name:15s} {us:10.1f}  " + ("(not a kernel table: the profile's links price it)"
                                                   if back is None else f"{back:10.1f}"))
    if fitted["training_only_us"]:
        top = sorted(fitted["training_only_us"].items(), key=lambda kv: -kv[1])
        typer.echo(f"training only (dropped), {sum(fitted['training_only_us'].values()):,.0f} us a pass: " + "; ".join(
            f"{name[:60]} {us:,.0f}" for name, us in top[:5]))
    if fitted["unclassed_us"]:
        typer.echo(f"unclassed (no rule matched; not priced): {fitted['unclassed_us']:,.0f} us a pass")
