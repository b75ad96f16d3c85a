"""The MoE inference engine, in layers that only import downward:

    models/     config parsing, the checkpoint loader, tokenizer, the decoder (attention, MoE)
    core/       the step loop (EngineCore), scheduler, block manager, KV cache, model runner,
                sampling, spans, telemetry, and the driver that runs it on a thread
    planning/   the memory planner and the offload plan (from config.json alone)
    experts/    placed experts on emulated devices, expert cache and prefetch, the disk tier,
                the per-device memory ledger, and `engine.experts` (ExpertControl)
    llm_engine  LLMEngine: EngineCore with its expert layer
    sim/        the simulator: a step priced from a hardware profile and config.json, and the
                simulated backend (`moectl sim`, `--backend simulated`; every figure simulated)
    parallel/   tensor and expert parallelism over torch.distributed ranks
    tools/      benchmarks, verification against transformers, KV evaluation, workloads, training,
                the simulator's calibration, fault injection

What it shares with every layer above it is below it, torch-free: moectl.placement (topology,
placement, the placement file, the rebalancer, the step-time model) and moectl.wire (actions,
records, the engine process's protocol, and the Protocols EngineCore and SimulatedEngine satisfy).

The package also ships two sample models, found by name with `resolve_model` (`--model NAME`
on every command, `moectl model list`): `sample` (sample_model/, Mixtral) and `sample-dsv3`
(sample_model_dsv3/, the seeds' DeepSeek-V3 class).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# name -> (folder in this package, one line on what it is)
SAMPLE_MODELS = {
    "sample": ("sample_model", "Mixtral: 4 layers, 16 experts top-2, hidden 256 (the first sample model)"),
    "sample-dsv3": ("sample_model_dsv3", "DeepSeek-V3 class: MLA, 32 routed experts top-8 in 4 groups, a shared "
                                         "expert, a dense first layer; routed experts dominate a step"),
}


def sample_model_dir(name: str = "sample") -> Path:
    """A shipped sample model's directory, wherever moectl is installed."""
    return Path(str(resources.files(__name__) / SAMPLE_MODELS[name][0]))


def resolve_model(model: str | Path | None) -> Path:
    """--model: an existing path as given, else a sample model's name; None: `sample`.
    ValueError naming the names when it is neither."""
    if model is None:
        return sample_model_dir()
    path = Path(model)
    if path.exists():
        return path
    if str(model) in SAMPLE_MODELS:
        return sample_model_dir(str(model))
    raise ValueError(f"--model: {model} is neither a path nor a model name ({', '.join(SAMPLE_MODELS)})")
