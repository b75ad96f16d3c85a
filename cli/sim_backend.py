"""`--backend simulated` for run, record and bench: the engine factory that the simulated
cluster's options (engine_options.py) build (engine/sim/cluster_engine.py), and their checks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moectl.cli.common import BadInput, check_seed, model_dir, open_trace, redundant_slots
from moectl.cli.engine_options import SIM_OPTIONS, refuse_given

if TYPE_CHECKING:
    from moectl.cli.engine_options import EngineOptions

SIMULATED = "simulated"
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


def refuse_sim_options(options: EngineOptions) -> None:
    """A simulated-backend option given with another backend is bad input, not ignored. --overlap
    also runs on the distributed backend (none or two-batch: real micro-batches on the ranks)."""
    if options.backend == SIMULATED:
        return
    if options.backend == "distributed":
        from moectl.engine.core.config import OVERLAP_MODES

        if options.overlap not in OVERLAP_MODES:
            raise BadInput(f"--overlap: the distributed backend runs {' or '.join(OVERLAP_MODES)}, got "
                           f"{options.overlap!r} (five-stage is simulated only)")
    else:
        refuse_given(options, ("overlap",), "only with --backend simulated or distributed")
    refuse_given(options, [name for name in SIM_OPTIONS if name != "overlap"], "only with --backend simulated")


def refuse_real_engine_options(options: EngineOptions) -> None:
    """Options of a real engine that a simulated cluster has no use for: bad input, not ignored."""
    refuse_given(options, ("hbm", "nproc", "expert_cache", "host_mem", "threads"),
                 "not on the simulated backend (its devices are the hardware profile's)")
    refuse_given(options, ("mixed_precision",), "not on the simulated backend (it runs no arithmetic to keep wider)")
    refuse_given(options, ("kv_retention", "kv_budget"), "not on the simulated backend (it keeps every token's KV; "
                 "`moectl plan memory --kv-budget` prices a budget)")


class SimEngines:
    """Engines' interface (make_engine, close) for the simulated backend; everything is checked
    here, before the first engine is built (BadInput names the flag)."""

    def __init__(self, options: EngineOptions, knobs=None):
        from moectl.engine.sim.cluster_config import SimClusterConfig
        from moectl.engine.sim.cluster_engine import SimulatedEngine

        check_seed(options.sim_seed, "--sim-seed")
        recorded = recorded_routing(options.routing)
        placement = options.placement
        chosen, planned_for = None, None
        if placement is not None:
            from moectl.placement.placement_file import read_placement_file

            try:
                chosen, planned_for = read_placement_file(placement)
            except ValueError as exc:
                raise BadInput(f"--placement: {placement}: {str(exc).removeprefix('placement: ')}") from None
        try:
            config = SimClusterConfig(model=model_dir(options.model, config_file=True), hardware=options.hardware,
                                      devices=256 if options.devices is None else options.devices, tp=options.tp,
                                      pp=options.pp,  # docs/sim.md
                                      routing=options.routing, drift=options.drift, overlap=options.overlap,
                                      redundant_slots=redundant_slots(options.redundant), placement=chosen,
                                      placement_model=planned_for, dtype=options.dtype, seed=options.sim_seed,
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
