"""`moectl plan memory | rebalance`: offline planning from a config, a trace or loads."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moectl.cli.common import (
    JSON_OPT,
    BadInput,
    check_output_file,
    handles_errors,
    model_dir,
    open_trace,
    option_flag,
    parse_cli_size,
    redundant_slots,
)
from moectl.cli.engine_options import DEFAULT_DEVICES, DEFAULT_REDUNDANT, DEVICES_OPT, HBM_OPT, REDUNDANT_OPT, given
from moectl.placement.placement import MAX_EXPERTS
from moectl.placement.topology import MAX_DEVICES
from moectl.wire.kv_budget import parse_kv_budget

plan_app = typer.Typer(no_args_is_help=True, help="Offline planning: expert rebalancing and device memory.")
# --synthetic's sizes: past any MoE model (DeepSeek-V3: 61 x 256, Kimi K2: 61 x 384), and small enough that
# the [layers, experts] loads and the [layers, devices, slots] plan fit in memory
MAX_LAYERS = 1024
EXPORTS = ("sglang", "vllm")
SYNTHETIC_ONLY = ("layers", "experts", "skew", "seed")  # plan rebalance's options that shape --synthetic loads


def _check_range(option: str, value: int | None, lo: int, hi: int | None = None) -> None:
    if value is not None and (value < lo or (hi is not None and value > hi)):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise BadInput(f"{option}: must be {bound}, got {value}")


@plan_app.command("memory")
@handles_errors
def plan_memory_cmd(
    ctx: typer.Context,
    model: Path = typer.Option(..., "--model", "-m", help="config.json, a directory holding one (no weights needed), "
                                                          "or a shipped model's name."),
    devices: int | None = DEVICES_OPT,
    hbm: str = HBM_OPT,
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size for attention (<= 8)."),
    ep: int | None = typer.Option(None, "--ep", help="Expert-parallel size (default: all devices)."),
    context: int = typer.Option(..., "--context", help="Tokens of context per sequence."),
    batch: int = typer.Option(1, "--batch", help="Concurrent sequences."),
    dtype: str | None = typer.Option(None, "--dtype", help="Weight dtype: fp32, bf16, fp16, or fp8 or mxfp4 with "
                                                         "their scales (planning only) [default: the config's "
                                                         "quantization_config, else bf16]."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto (weight dtype) or int8."),
    offload: bool = typer.Option(False, "--offload", help="Plan the routed experts over three tiers: an HBM cache "
                                                          "per device, host memory per node (--host-mem), disk."),
    host_mem: str = typer.Option("2TiB", "--host-mem", help="With --offload: host memory per node for experts."),
    kv_budget: str | None = typer.Option(None, "--kv-budget", show_default=False,
                                         help="A KV retention budget (any --kv-retention but full): each sequence "
                                              "keeps N tokens or P% of its context in the full-attention layers "
                                              "(e.g. 4096, 25%); the table says what it saves against full "
                                              "retention."),
    pp: int = typer.Option(1, "--pp", help="Pipeline stages: the devices in --pp groups of consecutive devices, "
                                           "each holding a contiguous run of layers (TP, DP and EP within a "
                                           "stage); the table then has a column per stage."),
    micro_batches: int | None = typer.Option(None, "--micro-batches", help="With --pp: micro-batches a step's "
                                                                           "tokens flow as (default: --pp); each "
                                                                           "stage holds up to this many in flight."),
    pp_layers: str | None = typer.Option(None, "--pp-layers", help="With --pp: layers per stage, e.g. 15,15,15,16 "
                                                                   "(default: balanced by each layer's "
                                                                   "multiply-accumulates per token)."),
    as_json: bool = JSON_OPT,
):
    """The operator-level memory table for each device: weights by category, KV cache, activations
    at peak, communication buffers and headroom; whether it fits and, if not, by how much. With
    --offload, also the experts' three tiers (HBM cache, host, disk); with --kv-budget, the KV
    cache under that retention budget; with --pp, per pipeline stage (its layers' weights and KV,
    and the micro-batches' activations it holds in flight)."""
    from moectl.engine.planning.memory_plan import fit_suggestions, plan_memory
    from moectl.engine.planning.offload_plan import plan_offload
    from moectl.placement.topology import Topology

    _check_range("--devices", devices, 1, MAX_DEVICES)
    if not offload and given(ctx, "host_mem"):
        raise BadInput("--host-mem: applies only with --offload (the experts' host-memory tier)")
    if offload and pp > 1:
        raise BadInput("--offload: the experts' tiers are not planned per pipeline stage; give --pp 1")
    topo = Topology(num_devices=devices or DEFAULT_DEVICES, hbm_bytes=parse_cli_size(hbm, "--hbm"))
    kw = dict(tp=tp, ep=ep, context=context, batch=batch, dtype=dtype, kv_dtype=kv_dtype)
    if pp != 1 or micro_batches is not None or pp_layers is not None:  # checked by the planner (PlanError: exit 2)
        kw.update(pp=pp, micro_batches=micro_batches, pp_layers=pp_layers)
    if kv_budget is not None:
        kw["kv_budget"], kw["kv_budget_fraction"] = parse_kv_budget(kv_budget, "--kv-budget")
    model = model_dir(model, config_file=True)
    plan = plan_memory(model, topo, **kw)
    tiers = plan_offload(plan, parse_cli_size(host_mem, "--host-mem")) if offload else None
    suggestions = [] if plan.fits or (tiers is not None and tiers.fits) else fit_suggestions(model, topo, **kw)
    if as_json:
        out = {**plan.as_dict(), "suggestions": suggestions}
        if tiers is not None:
            out["offload"] = tiers.as_dict()
        typer.echo(json.dumps(out, default=str))
        return
    typer.echo(plan.format_table())
    if tiers is not None:
        typer.echo("")
        typer.echo(tiers.format_table())
    for s in suggestions:
        typer.echo(f"  to fit: {s['change']}")


@plan_app.command("rebalance")
@handles_errors
def plan_rebalance_cmd(
    ctx: typer.Context,
    loads_file: Path | None = typer.Argument(None, help="A recorded trace (moectl record), or per-layer x "
                                                           "per-expert loads (.npy or .json)."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Plan for synthetic skewed (Zipf) loads."),
    model: Path | None = typer.Option(None, "--model", "-m",
                                      help="With --synthetic: a config.json (or checkpoint) that gives the MoE "
                                           "layers, routed experts and expert bytes."),
    layers: int | None = typer.Option(None, "--layers", help="MoE layers of --synthetic (default: --model's, else 61)."),
    experts: int | None = typer.Option(None, "--experts",
                                       help="Routed experts per layer of --synthetic (default: --model's, else 384)."),
    skew: float = typer.Option(1.0, "--skew", help="Zipf exponent of the synthetic loads."),
    devices: int | None = DEVICES_OPT,
    devices_per_node: int = typer.Option(8, "--devices-per-node"),
    redundant: int | None = REDUNDANT_OPT,
    expert_bytes: str | None = typer.Option(None, "--expert-bytes",
                                               help="Bytes of one expert, for bytes_moved (default: the trace's "
                                                    "model, else a DeepSeek-V3 FP8 expert, 42 MiB)."),
    seed: int = typer.Option(0, "--seed"),
    target: float | None = typer.Option(None, "--target", help="From a trace's placement: move only as much as "
                                                             "reaching this balancedness takes (e.g. 0.99)."),
    export: str | None = typer.Option(None, "--export", help="Also write the plan as the engine loads it: sglang "
                                                            "(an --init-expert-location .json/.pt) or vllm (JSON; "
                                                            "vLLM loads no placement, see docs/external_load.md)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="With --export: the file to write."),
    as_json: bool = JSON_OPT,
):
    """Compute an EPLB-style expert placement offline: replicate hot experts, pack them in balance
    (by node when there are nodes), and report balancedness before/after and bytes moved. From a
    trace, the loads are its recorded routing and "before" is the placement it was recorded with
    (exact: routing does not depend on placement)."""
    from moectl.placement.rebalancer import (
        DEFAULT_EXPERT_BYTES,
        load_loads_file,
        run_plan_rebalance,
        synthetic_loads,
    )

    if synthetic == (loads_file is not None):
        raise BadInput("give a TRACE or loads FILE, or --synthetic (one of them)")
    if not synthetic:  # a trace or loads file has its own layers, experts and loads
        for name in SYNTHETIC_ONLY:
            if given(ctx, name):
                raise BadInput(f"{option_flag(ctx, name)}: applies only to --synthetic loads, not to {loads_file}")
    _check_range("--layers", layers, 1, MAX_LAYERS)
    _check_range("--experts", experts, 1, MAX_EXPERTS)
    _check_range("--devices", devices, 1, MAX_DEVICES)  # 0 must not fall back to the default
    _check_range("--devices-per-node", devices_per_node, 1)
    if (export is None) != (output is None):
        raise BadInput("--export and --output: give both (the engine, and the file to write)")
    if export is not None:
        if export not in EXPORTS:
            raise BadInput(f"--export: must be one of {', '.join(EXPORTS)}, got {export!r}")
        check_output_file(output, "--output", *([loads_file] if loads_file is not None else []))
        suffixes = (".pt", ".json") if export == "sglang" else (".json",)  # what each engine reads (physical_map.py)
        if output.suffix not in suffixes:
            raise BadInput(f"--output: the {export} file is {' or '.join(suffixes)}, got {output.name!r}")
    current, size, final, header, planned_for = None, DEFAULT_EXPERT_BYTES, None, {}, None
    if model is not None and not synthetic:
        raise BadInput("--model: only with --synthetic (a trace or loads file carries its own shape)")
    if synthetic:
        if model is not None:
            import numpy as np

            from moectl.engine.models.config import ModelConfig
            from moectl.engine.planning.memory_plan import load_plan_model, weight_format
            from moectl.placement.placement_file import model_identity

            path = model_dir(model, config_file=True)
            cfg = ModelConfig.from_dir(path, sizes_only=True)
            for option, given_value, value in (("--layers", layers, sum(cfg.sparse_layers)),
                                               ("--experts", experts, cfg.num_experts)):
                if given_value is not None and given_value != value:
                    raise BadInput(f"{option}: --model {model} has {value}; give one or the other")
            planned_for = model_identity(cfg, (path.parent if path.is_file() else path).resolve().name)
            # an expert as the checkpoint stores it: quantized with its scales, else in its dtype
            shape = load_plan_model(path)
            size = shape.part_bytes("expert", weight_format(
                None if cfg.quantization else str(cfg.dtype).removeprefix("torch."), shape))
            # a row for every layer, as a trace's plan has: the dense layers route nothing
            moe_loads = synthetic_loads(sum(cfg.sparse_layers), cfg.num_experts, seed=seed, skew=skew)
            loads = np.zeros((cfg.num_layers, cfg.num_experts), dtype=moe_loads.dtype)
            loads[np.asarray(cfg.sparse_layers)] = moe_loads
        else:
            loads = synthetic_loads(layers or 61, experts or 384, seed=seed, skew=skew)
    elif loads_file.suffix in (".npy", ".json"):
        loads = load_loads_file(loads_file)
    else:
        from moectl.profiler.trace_queries import trace_routing

        with open_trace(loads_file) as reader:
            loads, current, trace_devices, trace_bytes = trace_routing(reader)
            from moectl.profiler.trace_queries import placement_timeline

            last = reader.last_step
            # the prediction's window: the trace's last steps (their routing, step time and costs),
            # on the placement in force at the end of the trace
            recent = list(reader.steps(max(reader.first_step, last - 63), last + 1)) if last is not None else []
            timeline = placement_timeline(reader)
            final = timeline[-1][1] if timeline else None
            header = reader.header
            from moectl.placement.placement_file import identity_from_header

            planned_for = identity_from_header(header)
        size = trace_bytes or size
        if devices is None or devices == trace_devices:
            devices = trace_devices
        else:
            current = None  # another device count: no recorded placement to compare against
    # as many spare slots as the source had: fewer would lower the balance it reached
    redundant = redundant_slots(redundant, current.slots_per_device - -(-current.num_experts // current.num_devices)
                                if current else DEFAULT_REDUNDANT)
    size = size if expert_bytes is None else parse_cli_size(expert_bytes, "--expert-bytes")
    timed = None
    # the planner keeps the recorded cluster's slots and nodes: asking for others is the token balancer's job
    if (final is not None and target is None and not header.get("imported") and devices == trace_devices
            and not given(ctx, "redundant") and not given(ctx, "devices_per_node")):
        from moectl.placement.decision import basis_from_records

        timed = basis_from_records(recent)
    if timed is not None:  # step times recorded: the plan that minimises the predicted step, gated
        result = _plan_step_time(timed, final, header, size)
    else:
        result = run_plan_rebalance(loads, devices or DEFAULT_DEVICES, redundant, devices_per_node=devices_per_node,
                                    expert_bytes=size, current=current, target=target)
        result["objective"] = "token balance"
    if export is not None:  # the engines fill every slot: so does the plan they get (and its figures)
        _fill_for_export(result, loads, current)
    imported = header.get("imported")
    if imported:  # an engine's expert-load dump: its loads and placement are real, step times absent
        result["imported"] = {k: imported.get(k) for k in ("engine", "engine_version", "mode")}
        result["predicted"] = None
        result["predicted_absent"] = f"{imported['engine']}'s dump has no step times to predict them from"
    elif final is not None and timed is None:  # a trace with devices: predict from its last steps
        from moectl.placement.decision import predict_from_records
        from moectl.placement.placement import Placement

        result["predicted"] = predict_from_records(recent, final, Placement.from_dict(result["placement"]))
    if export is not None:
        result["export"] = _export(export, output, result, loads, header)
    if planned_for is not None:  # the placement file says which model it fits (placement_file.py)
        result["placement"]["model"] = planned_for
    if as_json:
        typer.echo(json.dumps(result, default=str))
        return
    typer.echo(f"balancedness {result['balancedness_before']:.4f} -> {result['balancedness_after']:.4f}, "
               f"{result['bytes_moved']:,} bytes moved, planned in {result['seconds'] * 1e3:.1f} ms "
               f"(objective: {result['objective']})")
    predicted = result.get("predicted")
    if predicted:
        typer.echo(f"predicted step {predicted['step_s_before'] * 1e3:.2f} -> {predicted['step_s_after'] * 1e3:.2f} ms, "
                   f"throughput {predicted['throughput_before']:,.0f} -> {predicted['throughput_after']:,.0f} tok/s "
                   f"({predicted['gain']:+.1%}; {predicted['model']})")
        if "reason" in predicted:
            typer.echo(f"{'apply it' if predicted['acts'] else 'keep the placement'}: {predicted['reason']}")
    elif result.get("predicted_absent"):
        typer.echo(f"predicted step time: absent ({result['predicted_absent']})")
    if "export" in result:
        typer.echo(f"{result['export']['file']}: the plan for {export} ({result['export']['layers']} layers, "
                   f"{result['export']['physical_experts']} physical experts); start it with {result['export']['flags']}")


def _plan_step_time(timed, final, header: dict, expert_bytes: int) -> dict:
    """`plan rebalance TRACE` where the trace carries step times: the planner's best plan for its
    last steps, from the placement in force at its end, with the gate's verdict (decision.py)."""
    from moectl.placement.decision import MIN_GAIN, decide
    from moectl.placement.replica_policy import POLICIES
    from moectl.placement.step_planner import StepCost
    from moectl.placement.topology import Topology

    basis, model, modeled = timed
    devices = header.get("devices") or {}
    topology = Topology.from_mapping(devices["topology"])
    policy = devices.get("routing_policy") if devices.get("routing_policy") in POLICIES else "round_robin"
    link_bytes_per_s = 1e9 * (topology.inter_node_gbps if topology.num_nodes > 1 else topology.intra_node_gbps)
    cost = StepCost(model, policy, copy_s=expert_bytes / link_bytes_per_s, horizon_steps=len(basis.other_s))
    decision = decide(basis, final, topology, cost, expert_bytes=expert_bytes, residuals=model.residuals(),
                      min_gain=MIN_GAIN)
    totals = basis.step_loads.sum(0)
    spare = final.slots_per_device - -(-final.num_experts // final.num_devices)
    from moectl.placement.rebalancer import plan_dict

    result = plan_dict(decision.plan, totals, topology, spare, expert_bytes)
    tokens = float(basis.tokens.mean())
    result["objective"] = "predicted step time"
    result["predicted"] = {**decision.prediction(),
                           "throughput_before": tokens / decision.step_s_before if decision.step_s_before > 0 else 0.0,
                           "throughput_after": tokens / decision.step_s_after if decision.step_s_after > 0 else 0.0,
                           "calibration": model.summary(),
                           "model": "recorded per-expert costs; " + ("modeled" if modeled else "measured")
                                    + " parallel step; copies at the topology's link bandwidth (modeled)"}
    return result


def _fill_for_export(result: dict, loads, current) -> None:
    """Fill the plan's empty slots (physical_map.fill_empty_slots) and redo the figures that change."""
    from moectl.engine.experts.physical_map import fill_empty_slots
    from moectl.placement.placement import Placement

    plan = Placement.from_dict(result["placement"])
    filled, slots = fill_empty_slots(plan, loads)
    result["slots_filled_for_export"] = slots
    if not slots:
        return
    before = current or Placement.contiguous(plan.num_layers, plan.num_experts, plan.num_devices)
    per_layer, overall = filled.balancedness(loads)
    result.update(placement=filled.to_dict(), balancedness_after=overall, balancedness_after_per_layer=per_layer.tolist(),
                  bytes_moved=before.bytes_to(filled, result["expert_bytes"]), moves=len(before.move_array(filled)),
                  max_replicas=int(filled.replica_counts().max()))


def _export(engine: str, output: Path, result: dict, loads, header: dict) -> dict:
    """The plan in the file `engine` reads (engine/experts/physical_map.py). Layers: SGLang's map
    has one row per model layer, vLLM's one per MoE layer, so the trace's layer indexing decides."""
    from moectl.engine.experts.physical_map import write_sglang_location, write_vllm_placement
    from moectl.placement.placement import Placement, PlacementError

    placement = Placement.from_dict(result["placement"])
    per_moe_layer = (header.get("imported") or {}).get("layer_indexing") == "moe"
    try:
        if engine == "sglang":
            if per_moe_layer:
                raise BadInput("--export sglang: the loads are per MoE layer (imported from vLLM); SGLang's map "
                               "needs one row per model layer")
            return write_sglang_location(placement, output)
        sparse = (header.get("model") or {}).get("sparse_layers")
        moe_layers = None if per_moe_layer or not sparse else [i for i, s in enumerate(sparse) if s]
        return write_vllm_placement(placement, output, loads, moe_layers)
    except PlacementError as exc:
        raise BadInput(f"--export {engine}: {exc}") from None
