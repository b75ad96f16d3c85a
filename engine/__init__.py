"""The MoE inference engine, in layers that only import downward:

    models/     config parsing, the checkpoint loader, tokenizer, the decoder (attention, MoE)
    core/       the step loop (EngineCore), scheduler, block manager, KV cache, model runner,
                sampling, records and spans, telemetry, and the driver that runs it on a thread
    planning/   the memory planner (from config.json alone)
    experts/    topology-aware placement, rebalancing, placed experts, expert cache and prefetch,
                the per-device memory ledger, and `engine.experts` (ExpertControl)
    llm_engine  LLMEngine: EngineCore with its expert layer
    parallel/   tensor and expert parallelism over torch.distributed ranks
    tools/      benchmarks, verification against transformers, KV evaluation, workloads, training

The package also ships the sample model (sample_model/), found with `sample_model_dir()`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def sample_model_dir() -> Path:
    """The embedded sample model's directory, wherever moectl is installed."""
    return Path(str(resources.files(__name__) / "sample_model"))
