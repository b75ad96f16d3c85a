"""The distributed backend's cluster, on rank 0: the same operator surface as the local one
(placement, window, preview/apply/auto, edits, step records), over real rank processes.

A placement change is published to every rank through the step channel and carried out by all
of them between two steps (rank_experts.migrate: real transfers); what each rank measured comes
back to rank 0. Every step, each rank's measurements arrive in one fixed-size gather
(`collect`), and the step record is built from them: busy time, rows, traffic and link time are
all measured here, nothing is modeled.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from moectl.engine.experts.cluster import ClusterBase
from moectl.engine.experts.memory_ledger import non_expert_weight_bytes
from moectl.engine.parallel.rank_experts import RankExperts, RankStepStats, migrate, unpack
from moectl.placement.placement import Placement, PlacementError
from moectl.placement.rebalancer import LOAD_WINDOW_STEPS
from moectl.placement.topology import Topology, format_size


class GatheredStats:
    """Every rank's figures for the step, as the local backend's StepDeviceStats names them."""

    def __init__(self, world: int, num_layers: int, rank_stats: RankStepStats):
        self._rank_stats = rank_stats
        self.token_device = torch.zeros(0, dtype=torch.int64)
        self.fill(np.zeros((world, RankStepStats.size(num_layers, world))), world, num_layers)

    @property
    def tracer(self):
        return self._rank_stats.tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        """Rank 0's own expert and collective spans go to the engine's timeline (measured); the
        other ranks' figures arrive as per-layer sums, without times to draw them at."""
        self._rank_stats.tracer = tracer

    def fill(self, gathered: np.ndarray, world: int, num_layers: int) -> None:
        figures = unpack(torch.as_tensor(gathered), num_layers, world)
        self.figures = figures
        self.busy_layer = figures["busy_layer"]
        self.rows_layer = figures["rows_layer"]
        self.active_layer = figures["active_layer"]
        self.busy_s = self.busy_layer.sum(1)
        self.tokens = self.rows_layer.sum(1).astype(np.int64)
        self.peak_rows = self.rows_layer.max(1).astype(np.int64)


class DistributedCluster(ClusterBase):
    backend = "distributed"
    link_time = "measured"

    def __init__(self, model, topology: Topology, placement: Placement, layers: list[RankExperts],
                 rank_stats: RankStepStats, state, channel, *, policy: str = "locality", auto=None,
                 window_steps: int = LOAD_WINDOW_STEPS, knobs=None, kv_pool_bytes: int = 0):
        self._init_base(model, topology, placement, policy, auto, window_steps)
        self.layers = layers
        self.rank_stats = rank_stats
        self.state, self.channel = state, channel
        self.knobs = knobs
        self.caches = self.cache_slots = self.torch_devices = self.ledger = None
        self.world = state.world_size
        first = layers[0]
        self.expert_bytes = first.w13[0].nbytes + first.w2[0].nbytes
        self.stats = GatheredStats(self.world, self.num_layers, rank_stats)
        self.weights = {k: v for k, v in non_expert_weight_bytes(model).items() if v}
        self.kv_pool_bytes = kv_pool_bytes  # one rank's KV pool (its share of the heads; sliding-window pool included)
        self.bytes_per_row = model.cfg.hidden_size * first.w13.element_size()
        self.telemetry_s = 0.0
        self.last_migration: dict = {}
        self.health = None  # health(error=None): raises naming a failed rank (group.RankGroup.check)
        self.check(placement)

    # -- placement
    def check(self, placement: Placement) -> None:
        self.check_shape(placement, self.layers[0].slots)
        need = self.expert_slot_bytes(placement.slots_per_device)
        if need > self.topology.hbm_bytes:
            raise PlacementError(f"hbm: the experts placed on each rank need {format_size(need)}, more than its "
                                 f"{format_size(self.topology.hbm_bytes)}")

    def check_knobs(self, knobs) -> None:
        pass  # each rank sized its KV cache at start; activations are not accounted on this backend

    def apply(self, placement: Placement) -> int:
        """Every rank moves its experts to `placement` now (between steps). Returns the bytes that
        crossed between ranks; `last_migration` has each rank's measured bytes and seconds."""
        self.check(placement)
        if self.health is not None:
            self.health()  # never publish to a group that has lost a rank
        try:
            self.channel.publish_placement(placement)
            mine = migrate(self.layers, placement, 0, self.world, None)
            reports = [None] * self.world
            dist.all_gather_object(reports, mine, group=self.state.ctrl_group)
        except RuntimeError as exc:  # a rank failed mid-migration: say which
            if self.health is not None:
                self.health(exc)
            raise
        self.placement = placement
        moved = int(sum(r["bytes_received"] for r in reports))
        self.bytes_moved_total += moved
        self.last_migration = {"bytes_local": int(sum(r["bytes_local"] for r in reports)),
                               "migration": {"per_rank": reports, "bytes_transferred": moved,
                                             "seconds_max": max(r["seconds"] for r in reports), "measured": True}}
        return moved

    # -- per step
    def begin_step(self, token_device: torch.Tensor) -> None:
        self.rank_stats.reset()
        self.stats.token_device = token_device

    def collect(self) -> None:
        """After rank 0's forward: every rank's figures for the step, in one gather."""
        t0 = time.perf_counter()
        gathered = [torch.empty(RankStepStats.size(self.num_layers, self.world), dtype=torch.float64)
                    for _ in range(self.world)]
        # the gloo control group: these are CPU tensors, also when the compute group is NCCL
        dist.gather(self.rank_stats.pack(), gathered, dst=0, group=self.state.ctrl_group)
        self.stats.fill(torch.stack(gathered).numpy(), self.world, self.num_layers)
        self.telemetry_s = time.perf_counter() - t0

    def end_step(self, wall_s: float, t_start: float | None = None) -> dict:
        s, f = self.stats, self.stats.figures
        # src x dst: the expert output rows src computed, which the combine delivers to dst
        traffic = (f["send_rows"] * self.bytes_per_row).astype(np.int64)
        link_s = f["combine_s"]
        record = {
            "backend": self.backend,
            "tokens": s.tokens.tolist(),
            "busy_s": s.busy_s.tolist(),  # measured on each rank
            "traffic_bytes": traffic,
            "link_s": link_s.tolist(),  # measured: the outputs' all_reduce, per rank
            "link_wait_s": f["wait_s"].tolist(),  # measured: time in the tiny collectives (waiting for peers)
            "link_s_modeled": False,
            "step_time": self._time_step(wall_s, float(link_s.max()), len(s.token_device), measured_parallel=True,
                                         t_start=t_start),
            "telemetry_s": self.telemetry_s,  # rank 0's time in the per-step gather of these figures
            "micro_batches": self._micro_batches(),
            "link_hidden_s": f["hidden_s"].tolist(),  # measured: collectives in flight under the other micro-batch
            "process": [{"rss_bytes": int(f["rss_bytes"][r]),
                         "cuda": ({"allocated": int(f["cuda_allocated"][r]), "reserved": int(f["cuda_reserved"][r]),
                                   "max_allocated": int(f["cuda_max_allocated"][r])}
                                  if f["cuda_reserved"][r] else None)} for r in range(self.world)],
        }
        return record

    def _micro_batches(self) -> list[int]:
        """The step's tokens in each micro-batch: one entry, or two under two-batch overlap."""
        tokens, split = len(self.stats.token_device), self.rank_stats.split
        return [split, tokens - split] if split else [tokens]

    def memory(self, work: list[dict], kv_bytes_used: list[int]) -> dict:
        """Each rank's weights (rank 0's shard sizes: tensor-parallel shards are equal), its expert
        slots and its share of the KV blocks in use; activations are not accounted here (the
        ranks' RSS and CUDA statistics are measured instead)."""
        experts = self.expert_slot_bytes(self.placement.slots_per_device)
        kv = sum(kv_bytes_used)
        per_rank = {**self.weights, "expert_weights": experts, "kv_blocks": kv}
        return {"memory": [dict(per_rank) for _ in range(self.world)], "memory_modeled": [],
                "memory_capacity": {"hbm": self.topology.hbm_bytes,
                                    "kv_blocks": [self.kv_pool_bytes] * self.world},
                "tiers": {"host": {}}, "tiered_experts": "off"}
