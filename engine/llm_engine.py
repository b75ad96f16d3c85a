"""LLMEngine: the engine core with its expert layer, the engine every front end runs.

EngineCore (core/engine.py) is the step loop on one device. With a topology in the config, the
experts are placed on devices (emulated on this process's torch device, or real GPUs with
`expert_devices`) and `engine.experts` is the handle on them (experts/control.py).
"""

from __future__ import annotations

from moectl.engine.core.config import EngineConfig, KnobError, SchedulerKnobs
from moectl.engine.core.engine import EngineCore
from moectl.engine.core.outputs import RequestOutput, RequestStream
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.experts.control import ExpertControl
from moectl.engine.experts.disk_tier import load_with_disk_tier
from moectl.engine.models.decoder import MoEForCausalLM

# the engine's public API in one import
__all__ = ["EngineConfig", "KnobError", "LLMEngine", "RequestOutput", "RequestStream", "SamplingParams",
           "SchedulerKnobs"]


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig, model: MoEForCausalLM | None = None, **options):
        """options: EngineCore's (kv_heads, runner_factory, experts: a factory replacing the
        local expert layer)."""
        if config.topology is not None:
            options.setdefault("experts", ExpertControl.build)
        if model is None and config.host_mem is not None:
            model = load_with_disk_tier(config.model, config.dtype, config.device, config.host_mem)
        super().__init__(config, model, **options)
