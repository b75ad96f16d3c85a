"""Engine configuration and the live knobs, each validated in one place.

`SchedulerKnobs` and `AutoRebalancePolicy` are what an operator may change while requests run
(from the TUI, the CLI or the server); `EngineConfig` is fixed for the engine's lifetime.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from moectl.placement.replica_policy import POLICIES as REPLICA_POLICIES
from moectl.placement.topology import Topology

POLICIES = ("fcfs", "priority")  # scheduling order
OBJECTIVES = ("step_time", "balance")  # what a rebalance plans for (AutoRebalancePolicy.objective)
ROUTING_POLICIES = REPLICA_POLICIES  # how a token picks among an expert's replicas (placement/replica_policy.py)
OVERLAP_MODES = ("none", "two-batch")  # the distributed backend's step: one batch, or two overlapped
# which KV of the full-attention layers a sequence keeps (core/retention.py): all of it, attention
# sinks plus the recent window (StreamingLLM), or sinks, the recent window and the blocks that drew
# the most attention, scored at each prefill chunk's end (SnapKV) or accumulated (H2O)
RETENTION_POLICIES = ("full", "streaming", "snapkv", "h2o")
# two-batch's fallback: smaller steps run as one batch. 512 lies between the step sizes measured on
# this machine's ranks: decode steps of tens of tokens lose when split, prefill steps of ~1K tokens
# gain (bench/two_batch_overlap.py measures both sides)
OVERLAP_MIN_TOKENS = 512


class KnobError(ValueError):
    """An engine setting out of range; the message names the knob."""


def _int_in(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise KnobError(f"{name}: must be an integer in [{lo}, {hi}], got {value!r}")


def _check_torch_devices(names) -> None:
    import torch

    for name in names:
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError):
            raise KnobError(f"expert_devices: {name!r} is not a torch device") from None
        if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
            raise KnobError(f"expert_devices: {name} does not exist here "
                            f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices)")


@dataclass(frozen=True)
class SchedulerKnobs:
    max_num_seqs: int = 64  # sequences in one batch
    max_num_batched_tokens: int = 1024  # tokens in one step, prefill and decode together
    long_prefill_token_threshold: int = 256  # cap on one prefill's tokens per step (the prefill chunk)
    policy: str = "fcfs"  # fcfs | priority (lower value first)
    # KV retention of the full-attention layers (RETENTION_POLICIES): a sequence keeps at most
    # kv_budget tokens (0: no cap in tokens) and at most kv_budget_fraction of its context
    kv_retention: str = "full"
    kv_budget: int = 0
    kv_budget_fraction: float = 1.0
    kv_sink_tokens: int = 4  # the first tokens, always kept (rounded up to whole blocks)
    kv_recent_tokens: int = 64  # scored policies: the last tokens, always kept (and their queries score the rest)

    def __post_init__(self):
        _int_in("max_num_seqs", self.max_num_seqs, 1, 4096)
        _int_in("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        _int_in("long_prefill_token_threshold", self.long_prefill_token_threshold, 1, 1 << 20)
        if self.policy not in POLICIES:
            raise KnobError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.kv_retention not in RETENTION_POLICIES:
            raise KnobError(f"kv_retention: must be one of {', '.join(RETENTION_POLICIES)}, got {self.kv_retention!r}")
        _int_in("kv_budget", self.kv_budget, 0, 1 << 40)
        f = self.kv_budget_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise KnobError(f"kv_budget_fraction: must be a fraction in (0, 1], got {f!r}")
        _int_in("kv_sink_tokens", self.kv_sink_tokens, 0, 1 << 20)
        _int_in("kv_recent_tokens", self.kv_recent_tokens, 0, 1 << 20)
        if self.kv_retention != "full" and not self.kv_budget and f == 1:
            raise KnobError(f"kv_retention: {self.kv_retention} needs a budget (kv_budget tokens or a "
                            "kv_budget_fraction below 1)")

    def updated(self, **changes) -> SchedulerKnobs:
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise KnobError(f"{sorted(unknown)[0]}: not a batching knob "
                            f"(knobs: {', '.join(f.name for f in fields(self))})")
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AutoRebalancePolicy:
    """manual: only the operator rebalances. auto: every `every_k_steps` steps (0 = never on a
    schedule) and whenever balancedness drops below `threshold` (None = no threshold; the window's
    balancedness is recomputed every WINDOW_FIGURES_EVERY steps, so the threshold is seen up to
    that many steps late). target: the token-balancing plan (before any step is timed) aims at
    this balancedness from the placement in force, moving only as much as that takes (None: the
    best balance). min_gain: the gate: a plan is applied automatically (and an alert proposes
    one) only when the lower end of its predicted throughput gain's 90% interval reaches this.
    horizon_steps: the steps a migration's stall is spread over when a plan is priced (None: the
    load window's). objective: what previews and auto mode plan for: "step_time" (the placement
    that minimises the predicted step time, placement/step_planner.py) or "balance" (the token
    balancer, EPLB-style; its plan priced and gated the same way)."""
    mode: str = "manual"
    every_k_steps: int = 0
    threshold: float | None = None
    target: float | None = None
    min_gain: float = 0.03
    horizon_steps: int | None = None
    objective: str = "step_time"

    def __post_init__(self):
        if self.mode not in ("manual", "auto"):
            raise KnobError(f"mode: {self.mode!r} is not manual or auto")
        _int_in("every_k_steps", self.every_k_steps, 0, 1 << 40)
        if self.threshold is not None and (isinstance(self.threshold, bool)
                                           or not isinstance(self.threshold, (int, float))
                                           or not 0 < self.threshold <= 1):
            raise KnobError(f"threshold: must be in (0, 1], got {self.threshold!r}")
        if self.target is not None and (isinstance(self.target, bool) or not isinstance(self.target, (int, float))
                                        or not 0 < self.target <= 1):
            raise KnobError(f"target: must be in (0, 1], got {self.target!r}")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) or not 0 <= self.min_gain < 1:
            raise KnobError(f"min_gain: must be a fraction in [0, 1), got {self.min_gain!r}")
        if self.horizon_steps is not None:
            _int_in("horizon_steps", self.horizon_steps, 1, 1 << 40)
        if self.objective not in OBJECTIVES:
            raise KnobError(f"objective: must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")

    def should_rebalance(self, step: int, current_balancedness: float) -> bool:
        if self.mode == "manual":
            return False
        if self.every_k_steps and step > 0 and step % self.every_k_steps == 0:
            return True
        return self.threshold is not None and current_balancedness < self.threshold

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineConfig:
    model: str
    dtype: str | None = None  # None: the checkpoint's own dtype
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: int = 256 << 20  # bytes for K and V of all layers
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    kv_cache_dtype: str = "auto"  # auto (model dtype) | int8
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    knobs: SchedulerKnobs = field(default_factory=SchedulerKnobs)
    # emulated devices (the local backend); None runs everything as one device with no accounting
    topology: Topology | None = None
    routing_policy: str = "locality"  # how a token picks among an expert's replicas
    redundant_slots: int = 0  # extra expert slots per device, for replicas
    auto_rebalance: AutoRebalancePolicy = field(default_factory=AutoRebalancePolicy)  # manual by default
    expert_cache_slots: int | None = None  # tiered expert memory: per-device cache size in experts
    expert_prefetch: str = "router"  # tiered mode: router (next layer's router on the hidden state) | coact | none
    # the initial expert placement (Placement.to_dict form, what `plan rebalance --json` writes);
    # None: contiguous with redundant_slots spare slots per device
    placement: dict | None = None
    # multi-GPU in one process: the torch device of each device's experts (e.g. cuda:0..cuda:N-1)
    expert_devices: tuple[str, ...] | None = None
    # the disk tier: routed experts beyond this many bytes of host memory stay in the checkpoint's
    # files, read on demand (experts/disk_tier.py); None: every weight is loaded
    host_mem: int | None = None
    profile_spans: bool = True  # always-on spans (profiler/spans.py) in every step record
    # torch intra-op threads for this process; "auto": the cores other processes leave free,
    # re-measured as the engine runs (core/threads.py); None: leave torch's setting
    num_threads: int | str | None = None
    reserved_cores: int = 0  # cores "auto" leaves to other work of this process (the console's UI)
    # the distributed backend: none, or two-batch (each step as two micro-batches, one's
    # collectives in flight while the other computes; moectl.engine.parallel.two_batch)
    overlap: str = "none"
    overlap_min_tokens: int = OVERLAP_MIN_TOKENS  # two-batch: a step with fewer tokens runs as one batch
    # the numerics watch (models/numerics.py): per layer, the largest activations where half
    # precision overflows first, in every step record
    numerics_watch: bool = True
    # mixed precision: the residual stream (the norms' inputs, the sums into it) in fp32 under
    # half-precision weights, whose matmuls stay in their dtype
    mixed_precision: bool = False

    def __post_init__(self):
        _int_in("block_size", self.block_size, 1, 1024)
        _int_in("kv_cache_memory", self.kv_cache_memory, 1, 1 << 50)
        if self.num_kv_blocks is not None:
            _int_in("num_kv_blocks", self.num_kv_blocks, 1, 1 << 30)
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise KnobError(f"kv_cache_dtype: must be auto or int8, got {self.kv_cache_dtype!r}")
        if self.max_model_len is not None:
            _int_in("max_model_len", self.max_model_len, 2, 1 << 24)
        _int_in("seed", self.seed, 0, 2**63 - 1)
        if self.num_threads is not None and self.num_threads != "auto":
            if isinstance(self.num_threads, str):
                raise KnobError(f"num_threads: must be an integer >= 1 or auto, got {self.num_threads!r}")
            _int_in("num_threads", self.num_threads, 1, 4096)
        _int_in("reserved_cores", self.reserved_cores, 0, 4096)
        if self.overlap not in OVERLAP_MODES:
            raise KnobError(f"overlap: must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap!r}")
        _int_in("overlap_min_tokens", self.overlap_min_tokens, 2, 1 << 30)
        if self.routing_policy not in ROUTING_POLICIES:
            raise KnobError(f"routing_policy: must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing_policy!r}")
        _int_in("redundant_slots", self.redundant_slots, 0, 1024)
        if self.expert_cache_slots is not None:
            _int_in("expert_cache_slots", self.expert_cache_slots, 1, 1 << 20)
        if self.expert_prefetch not in ("router", "coact", "none"):
            raise KnobError(f"expert_prefetch: must be router, coact or none, got {self.expert_prefetch!r}")
        if self.placement is not None and (self.topology is None or not isinstance(self.placement, dict)):
            raise KnobError("placement: needs devices (a topology) and a placement object")
        if self.expert_devices is not None:
            self.expert_devices = tuple(self.expert_devices)
            if self.topology is None or len(self.expert_devices) != self.topology.num_devices:
                raise KnobError("expert_devices: needs a topology with one device per entry")
            _check_torch_devices(self.expert_devices)
        if isinstance(self.knobs, dict):
            self.knobs = SchedulerKnobs(**self.knobs)
        if self.host_mem is not None:
            _int_in("host_mem", self.host_mem, 1, 1 << 60)
            if self.topology is None:  # the tiers need the expert layer: one device by default
                self.topology = Topology(num_devices=1)
