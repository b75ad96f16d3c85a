"""The simulated backend's one config: the model's config.json, the hardware profile, the
cluster's layout, the routing and the batching knobs, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moectl.engine.core.config import SchedulerKnobs
from moectl.engine.sim.step_model import OVERLAPS
from moectl.placement.topology import MAX_DEVICES

MAX_DRIFT = 1.0


@dataclass
class SimClusterConfig:
    model: Path  # config.json, or a directory holding one
    hardware: str = "h800"  # a profile name or a profile file
    devices: int = 256
    tp: int = 1  # attention tensor parallel; experts are parallel over every device of a stage (ep = devices / pp)
    pp: int = 1  # pipeline stages (step_model.SimSpec.pp): devices / pp consecutive devices each, micro-batches = pp
    routing: str = "zipf:1.0"  # balanced | zipf:S | a trace (see engine/sim/routing.py)
    drift: float = 0.0  # swaps of two experts' shares per expert and step (zipf and traces)
    overlap: str = "none"
    redundant_slots: int = 1
    placement: object | None = None  # a placement file's Placement (step_model.cluster_placement fits it)
    placement_model: dict | None = None  # ... and the model it was planned for, when the file says
    dtype: str | None = None  # bf16 | fp8 (default: the config's quantization_config)
    knobs: SchedulerKnobs = field(default_factory=lambda: SchedulerKnobs(max_num_seqs=128,
                                                                       max_num_batched_tokens=4096,
                                                                       long_prefill_token_threshold=2048))
    block_size: int = 64
    max_model_len: int = 32768
    memory_fraction: float = 0.9  # of HBM the engine may use (vLLM's gpu_memory_utilization default)
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or not 1 <= self.devices <= MAX_DEVICES:
            raise ValueError(f"--devices: must be an integer in [1, {MAX_DEVICES}] on the simulated backend, "
                             f"got {self.devices!r}")
        if isinstance(self.drift, bool) or not isinstance(self.drift, (int, float)) or not 0 <= self.drift <= MAX_DRIFT:
            raise ValueError(f"--drift: must be a number in [0, {MAX_DRIFT:g}] swaps per expert and step, "
                             f"got {self.drift!r}")
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 1:
            raise ValueError(f"--pp: must be a positive integer (pipeline stages), got {self.pp!r}")
        if self.devices % self.pp:
            raise ValueError(f"--pp: {self.pp} must divide the {self.devices} devices (every stage has the same "
                             f"devices)")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"--overlap: {self.overlap!r} is not one of {', '.join(OVERLAPS)}")
        if isinstance(self.redundant_slots, bool) or not isinstance(self.redundant_slots, int) \
                or not 0 <= self.redundant_slots <= 64:
            raise ValueError(f"--redundant: must be an integer in [0, 64], got {self.redundant_slots!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size: must be an integer in [1, 1024], got {self.block_size!r}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be a positive integer, got {self.max_model_len!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction: must be in (0, 1], got {self.memory_fraction!r}")
