"""`--backend simulated` for run, record and bench: the options that describe the simulated
cluster, declared once, and the engine factory they build (engine/sim/cluster_engine.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from moectl.cli.common import BadInput, check_seed, model_dir, open_trace, redundant_slots

SIMULATED = "simulated"
ROUTING_HINT = ("balanced, zipf:S, sample (what moectl recorded on sample-dsv3, scaled), or a moectl trace "
                "(recorded, or imported with `moectl trace import`)")
HARDWARE_OPT = typer.Option("h800", "--hardware", help="simulated backend: a shipped hardware profile (h100, h800, "
                                                       "h200, a100, mi300x, ascend-910b) or a profile JSON file.")
SIM_ROUTING_OPT = typer.Option("sample", "--routing", help=f"simulated backend: expert loads, {ROUTING_HINT}.")
DRIFT_OPT = typer.Option(0.0, "--drift", help="simulated backend: swaps of two experts' shares per expert and step "
                                              "(which experts are hot wanders; the skew stays).")
TP_OPT = typer.Option(1, "--tp", help="simulated backend: attention tensor-parallel size (1: data-parallel "
                                      "attention, each device its own batch).")
OVERLAP_OPT = typer.Option("none", "--overlap", help="simulated backend: none | two-batch (one half's all-to-all "
                                                     "behind the other's compute).")
SIM_SEED_OPT = typer.Option(0, "--sim-seed", help="simulated backend: the routing draws and the workload's seed.")
# the options only the simulated backend reads (run forwards them to its engine process)
SIM_OPTIONS = ("hardware", "routing", "drift", "tp", "overlap", "sim_seed")
SIM_DEFAULTS = {"hardware": "h800", "routing": "sample", "drift": 0.0, "tp": 1, "overlap": "none", "sim_seed": 0}
# the simulated demo's default load: long requests (a model with a short context: scaled to it),
# at the rate that keeps the cluster busy
SIM_WORKLOAD = "prompt=1024-4096,output=256-1024"


def default_sim_workload(context: int) -> str:
    if context >= 8192:
        return SIM_WORKLOAD
    return f"prompt={max(1, context // 8)}-{max(1, context // 2)},output={max(1, context // 16)}-{max(1, context // 4)}"


def recorded_routing(routing: str):
    """A trace named by --routing: its summed [layers, experts] routing; None for the built-in sources."""
    from moectl.profiler.trace_queries import trace_routing

    if routing in ("balanced", "sample") or routing.startswith("zipf:"):
        return None
    if not Path(routing).is_file():
        raise BadInput(f"--routing: {routing!r} is neither balanced, zipf:S, sample nor a trace file")
    with open_trace(Path(routing)) as reader:
        return trace_routing(reader)[0]


def refuse_sim_options(ctx: typer.Context | None, backend: str) -> None:
    """A simulated-backend option given with another backend is bad input, not ignored."""
    from moectl.cli.common import given, option_flag

    if ctx is None or backend == SIMULATED:
        return
    for name in SIM_OPTIONS:
        if any(p.name == name for p in ctx.command.params) and given(ctx, name):
            raise BadInput(f"{option_flag(ctx, name)}: only with --backend simulated")


def refuse_real_engine_options(ctx: typer.Context) -> None:
    """Options of a real engine that a simulated cluster has no use for: bad input, not ignored."""
    from moectl.cli.common import given, option_flag

    for name in ("hbm", "nproc", "expert_cache", "host_mem", "threads"):
        if given(ctx, name):
            raise BadInput(f"{option_flag(ctx, name)}: not on the simulated backend (its devices are the hardware "
                           f"profile's)")


class SimEngines:
    """Engines' interface (make_engine, close) for the simulated backend; everything is checked
    here, before the first engine is built (BadInput names the flag)."""

    def __init__(self, model: Path | None, devices: int | None, redundant: int | None, placement: Path | None,
                 dtype: str | None, hardware: str, routing: str, drift: float, tp: int, overlap: str, seed: int,
                 knobs=None):
        from moectl.engine.sim.cluster_config import SimClusterConfig
        from moectl.engine.sim.cluster_engine import SimulatedEngine

        check_seed(seed, "--sim-seed")
        recorded = recorded_routing(routing)
        chosen, planned_for = None, None
        if placement is not None:
            from moectl.engine.experts.placement_file import read_placement_file

            try:
                chosen, planned_for = read_placement_file(placement)
            except ValueError as exc:
                raise BadInput(f"--placement: {placement}: {str(exc).removeprefix('placement: ')}") from None
        try:
            config = SimClusterConfig(model=model_dir(model, config_file=True), hardware=hardware,
                                      devices=256 if devices is None else devices, tp=tp, routing=routing,
                                      drift=drift, overlap=overlap, redundant_slots=redundant_slots(redundant),
                                      placement=chosen, placement_model=planned_for, dtype=dtype, seed=seed,
                                      **({"knobs": knobs} if knobs is not None else {}))
            self.first = SimulatedEngine(config, recorded)
        except ValueError as exc:
            message = str(exc).splitlines()[0]
            if message.startswith("--placement: "):  # fitted to the model in the engine: name the file
                message = f"--placement: {placement}: {message.removeprefix('--placement: ')}"
            raise BadInput(message if message.startswith("--") else f"--backend simulated: {message}") from None
        self.recorded = recorded
        self._make = lambda: SimulatedEngine(config, recorded)

    def make_engine(self):
        first, self.first = self.first, None
        return first if first is not None else self._make()

    def close(self) -> None:
        pass


def sim_load(workload: str | None, context: int):
    """--workload for a simulated demo: its rate ("auto" unless given) and lengths (default: for a
    model of `context` tokens)."""
    from moectl.engine.tools.demo_workload import DemoLoad
    from moectl.engine.tools.workload import WorkloadSpec

    text = workload or default_sim_workload(context)
    try:
        spec = WorkloadSpec.from_option(text if "rate=" in text else text + ",rate=1")
    except ValueError as exc:
        message = str(exc)
        raise BadInput(message if message.startswith("--workload") else f"--workload: {message}") from None
    if spec.source == "jsonl":
        raise BadInput("--workload: the simulated backend draws lengths; give rate=,prompt=,output=")
    return DemoLoad(rate=spec.rate if "rate=" in text else "auto", prompt_len=spec.prompt_len,
                    output_len=spec.output_len), spec
