"""The local backend: N devices emulated on this process's one torch device.

Compute is real and runs on the one torch device; each MoE layer's experts live in real slot
tensors that belong to emulated devices (see placed_experts.py). What one machine measures is
reported as measured (each device's expert compute time, tokens, bytes); what it cannot (time on
a link between devices, and the step time the devices would take running at once) is modeled
from those measurements and the topology's bandwidths, and flagged so.

`ClusterBase` is what every backend's cluster shares (the distributed one is in
engine/parallel/cluster.py): the placement in force, the load window, planning, and the
step-time prediction a preview shows.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from moectl.engine.core.config import AutoRebalancePolicy
from moectl.engine.experts.memory_ledger import MemoryLedger
from moectl.engine.experts.placed_experts import PlacedExperts, StepDeviceStats
from moectl.engine.experts.replica_routing import RoutingState, routing_overhead
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.models.moe import GROUPED_MM_MIN_ROWS, SWIGLU, MoEBlock, grouped_mm_fits
from moectl.placement.decision import BOOTSTRAP_ROUNDS, Decision, StepBasis, decide
from moectl.placement.placement import Placement, PlacementError, migration_in
from moectl.placement.rebalancer import LOAD_WINDOW_STEPS, LoadWindow, RebalancePlan, preview_plan
from moectl.placement.replica_policy import expected_work
from moectl.placement.step_planner import StepCost, plan_between
from moectl.placement.step_time import ExpertCostModel, parallel_step
from moectl.placement.topology import Topology, format_size
from moectl.wire.link_spans import link_seconds

AUTO_PLAN_DEADLINE_S = 0.05  # auto mode's plan search runs between steps: it stops at this
PREVIEW_PLAN_DEADLINE_S = 2.0  # an operator waits on a preview (small models' searches end far sooner)

# The window's figures move slowly (a window of LOAD_WINDOW_STEPS steps) and cost more than the
# rest of the devices record: a real cluster recomputes them every this many steps, and at once
# when the placement changes; a record says how many steps old its figures are ("age_steps").
WINDOW_FIGURES_EVERY = 8


def window_figures(window, placement: Placement, device_window) -> dict:
    """A step record's "window": the window's routing over the placement in force (balancedness,
    overall and per layer), and per device its rows, busy seconds and utilisation (busy over the
    devices' parallel step time) summed over `device_window`'s (rows, busy_s, step_s) entries:
    the steps since the placement last changed, at most the window (what devices did under
    another placement is not this one's). Every cluster's, real or simulated."""
    totals = window.totals()  # balancedness is scale-free: the sum serves as well as the mean
    per_layer, overall = placement.balancedness(totals) if totals.any() else (np.ones(placement.num_layers), 1.0)
    tokens = np.sum([t for t, _, _ in device_window], axis=0)
    busy = np.sum([b for _, b, _ in device_window], axis=0)
    step_s = sum(w for _, _, w in device_window)
    return {"steps": len(window), "balancedness": float(overall),
            "balancedness_per_layer": [float(x) for x in per_layer], "device_steps": len(device_window),
            "device_tokens": tokens.tolist(), "device_busy_s": busy.tolist(),
            "utilisation": (busy / step_s).tolist() if step_s > 0 else [0.0] * len(busy)}

def kernel_switch_rows(model: MoEForCausalLM) -> int | None:
    """The rows of one device's layer call from which its experts run as one grouped GEMM
    (engine/models/moe.py grouped_offsets), None where they always run the per-expert loop: what
    the cost model splits its per-row term at."""
    mlp = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock))
    experts = getattr(mlp.experts, "logical", mlp.experts)
    w13, w2 = getattr(experts, "w13", None), getattr(experts, "w2", None)
    if w13 is None or w2 is None or w13.device.type == "meta":  # experts left on disk: probe their twin
        if w13 is None or w2 is None:
            return None
        w13, w2 = torch.empty(w13.shape[-2:], dtype=w13.dtype)[None], torch.empty(w2.shape[-2:], dtype=w2.dtype)[None]
    return GROUPED_MM_MIN_ROWS if grouped_mm_fits(w13, w2, getattr(experts, "ffn", SWIGLU)) else None


class ClusterBase:
    """The placement in force, the routing window, planning, and step-time prediction."""

    backend = "emulated"
    link_time = "modeled"

    def _init_base(self, model: MoEForCausalLM, topology: Topology, placement: Placement, policy: str,
                   auto: AutoRebalancePolicy | None, window_steps: int) -> None:
        cfg = model.cfg
        self.topology = topology
        self.policy = policy
        self.auto = auto or AutoRebalancePolicy()
        self.num_layers = cfg.num_layers
        self.num_experts = cfg.num_experts
        self.moe_layers = [layer.mlp.layer_idx for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
        if not self.moe_layers:
            raise PlacementError("devices: this model has no MoE layers to place")
        self.window = LoadWindow(cfg.num_layers, cfg.num_experts, size=window_steps)
        self.cost = ExpertCostModel(switch_rows=kernel_switch_rows(model))
        self._routing_shape = (cfg.num_experts, cfg.top_k)  # what routing_overhead times, at the first plan
        self._routing_timed = False
        self.recent_steps: deque[dict] = deque(maxlen=window_steps)  # step-time splits, beside the window
        # each step's measured (device tokens, device busy seconds, parallel step seconds), beside the window
        self.device_window: deque[tuple[np.ndarray, np.ndarray, float]] = deque(maxlen=window_steps)
        self.placement = placement
        self.bytes_moved_total = 0
        self.recent_step_s = 0.0  # the last step's parallel step time (_time_step)
        self._figures: dict | None = None  # the window figures last computed (observe)
        self._figures_placement: Placement | None = None

    @property
    def num_devices(self) -> int:
        return self.topology.num_devices

    def check_shape(self, placement: Placement, slots_per_device: int | None) -> None:
        if placement.num_devices != self.num_devices:
            raise PlacementError(f"placement: has {placement.num_devices} devices, the cluster {self.num_devices}")
        if placement.num_experts != self.num_experts:
            raise PlacementError(f"placement: has {placement.num_experts} experts, the model {self.num_experts}")
        if placement.num_layers != self.num_layers:
            raise PlacementError(f"placement: has {placement.num_layers} layers, the model {self.num_layers}")
        if slots_per_device is not None and placement.slots_per_device != slots_per_device:
            raise PlacementError(f"placement: {placement.slots_per_device} slots per device, the cluster has "
                                 f"{slots_per_device}")

    @property
    def redundant_slots(self) -> int:
        return self.placement.slots_per_device - -(-self.placement.num_experts // self.num_devices)

    def balancedness(self) -> float:
        """Of the placement in force, over the load window (1.0 before any load)."""
        loads = self.window.loads()
        return float(self.placement.balancedness(loads)[1]) if loads.any() else 1.0

    def preview(self) -> RebalancePlan:
        """The plan that minimises the predicted step time for the window's steps (keeping this
        cluster's slot count), with its prediction and the gate's verdict; nothing changes."""
        if not len(self.window):
            raise PlacementError("rebalance: no routing observed yet")
        token = self._token_plan() if self.auto.objective == "balance" else None
        decision = self.decide(token, deadline_s=PREVIEW_PLAN_DEADLINE_S)
        if decision is None:  # no measured step to price with yet: the token-balancing plan, unpriced
            return token or self._token_plan()
        decision.plan.prediction = self._prediction(decision)
        return decision.plan

    def _token_plan(self) -> RebalancePlan:
        return preview_plan(self.window.loads(), self.topology, self.placement, expert_bytes=self.expert_bytes,
                            target=self.auto.target)

    def step_basis(self) -> StepBasis | None:
        """The window's steps as the planner prices them, None before a step was measured."""
        return StepBasis.from_window(self.window, self.recent_steps, self.cost, self.moe_layers)

    def step_cost(self, basis: StepBasis) -> StepCost:
        """What the planner prices with: this run's cost model (replica routing's cost timed at the
        first call), the link seconds per entry the busiest device's links carry (from the window),
        the copy stall (measured by the last migration, else modeled from the topology's links)
        spread over the auto policy's horizon (the window)."""
        if not self._routing_timed:  # at the first plan, not at every engine start (numba's import and load)
            self.cost.route_call_s, self.cost.route_entry_s = routing_overhead(
                *self._routing_shape, self.num_devices, self.policy, self.topology.devices_per_node)
            self._routing_timed = True
        _, _, remote = expected_work(self.placement, basis.step_loads, self.moe_layers, self.policy)
        per_remote = float(basis.link_s.sum() / remote.sum()) if remote.sum() > 0 else 0.0
        return StepCost(self.cost.frozen(), self.policy, per_remote, self.expert_bytes / self.copy_bytes_per_s(),
                        self.auto.horizon_steps or len(self.window))

    def copy_bytes_per_s(self) -> float:
        """Bytes per second one expert copy moves: the last migration's, measured, else the
        topology's slowest device link (modeled)."""
        measured = getattr(self, "measured_copy_bytes_per_s", None)
        if measured:
            return measured
        t = self.topology
        return 1e9 * (t.inter_node_gbps if t.num_nodes > 1 else t.intra_node_gbps)

    def decide(self, plan: RebalancePlan | None = None, deadline_s: float | None = None,
               rounds: int = BOOTSTRAP_ROUNDS) -> Decision | None:
        """The planner's best plan (or `plan`) for the window and the gate's verdict, priced by a
        frozen copy of the cost model (the engine calibrates on meanwhile)."""
        basis = self.step_basis()
        if basis is None:
            return None
        cost = self.step_cost(basis)
        return decide(basis, self.placement, self.topology, cost, expert_bytes=self.expert_bytes,
                      residuals=cost.model.residuals(), min_gain=self.auto.min_gain, plan=plan,
                      deadline_s=deadline_s, rounds=rounds)

    def _prediction(self, decision: Decision) -> dict:
        tokens = float(np.mean([r["tokens"] for r in list(self.recent_steps)[-len(self.window):]]))
        before, after = decision.step_s_before, decision.step_s_after
        return {**decision.prediction(),
                "throughput_before": tokens / before if before > 0 else 0.0,
                "throughput_after": tokens / after if after > 0 else 0.0,
                "calibration": self.cost.summary(),
                "model": "measured per-expert costs; link time " + self.link_time}

    def observe(self, routing) -> dict:
        """Adds a step's routing (and its devices' measured work, from end_step) to the load
        window; returns the window's figures for the step record's "window", which every client
        draws instead of recomputing: balancedness (the window's routing over the placement in
        force, overall and per layer), and per device the measured rows, busy seconds and
        utilisation (busy over the devices' parallel step time: modeled on emulated devices,
        measured on ranks)."""
        self.window.add(routing.numpy() if isinstance(routing, torch.Tensor) else routing)
        s = self.stats
        self.device_window.append((np.asarray(s.tokens, dtype=np.float64), np.asarray(s.busy_s, dtype=np.float64),
                                   float(self.recent_step_s)))
        figures = self._figures
        if (figures is None or figures["age_steps"] + 1 >= WINDOW_FIGURES_EVERY
                or self._figures_placement is not self.placement or len(self.device_window) == 1):
            figures = self._figures = {**window_figures(self.window, self.placement, self.device_window), "age_steps": 0}
            self._figures_placement = self.placement
            self.window_balancedness = figures["balancedness"]  # auto mode's trigger reads it (auto_decision)
        else:
            figures = self._figures = {**figures, "age_steps": figures["age_steps"] + 1}
        return figures

    def auto_decision(self, step: int) -> Decision | None:
        """In auto mode, when its schedule or threshold says to look (after the step's routing was
        observed): the planner's best plan and the gate's verdict (Decision.acts). A threshold
        that holds while nothing pays is looked at again only a window later, not every step."""
        balance = getattr(self, "window_balancedness", None) or self.balancedness()
        if not self.auto.should_rebalance(step, balance):
            return None
        scheduled = bool(self.auto.every_k_steps) and step > 0 and step % self.auto.every_k_steps == 0
        if not scheduled and step < getattr(self, "_next_look_step", 0):
            return None
        # on the engine thread, between steps: a bounded search and fewer bootstrap rounds
        decision = self.decide(self._token_plan() if self.auto.objective == "balance" else None,
                               deadline_s=AUTO_PLAN_DEADLINE_S, rounds=BOOTSTRAP_ROUNDS // 2)
        if decision is None:
            return None
        if decision.acts:
            decision.plan.prediction = self._prediction(decision)
        # after an apply the window holds the old placement's steps; after a hold nothing changed
        self._next_look_step = step + len(self.window)
        return decision

    # -- time
    def _time_step(self, wall_s: float, link_s: float, tokens: int, measured_parallel: bool,
                   t_start: float | None = None) -> dict:
        """Splits the step's time (parallel_step), feeds the cost model, keeps the split for predictions."""
        s = self.stats
        moe = self.moe_layers
        split = parallel_step(wall_s, s.busy_layer[:, moe], link_s, measured_parallel)
        self.cost.observe(s.rows_layer[:, moe], s.active_layer[:, moe], s.busy_layer[:, moe])
        # measured: the ranks' collectives are already inside other_s, so predictions add no link time
        self.recent_steps.append({"other_s": split["other_s"], "link_s": 0.0 if measured_parallel else link_s,
                                  "tokens": tokens, "t_start": t_start})
        self.recent_step_s = split["step_s"]
        split["utilisation"] = (s.busy_s / split["step_s"]).tolist() if split["step_s"] > 0 else [0.0] * len(s.busy_s)
        # what each device spends waiting for the slowest one at the layers' synchronisation points
        busy = s.busy_layer[:, moe]
        split["wait_s"] = (busy.max(0, keepdims=True) - busy).sum(1).tolist() if busy.size else []
        split["cost_model"] = self.cost.summary()
        return split

    def predict_change(self, placement: Placement) -> dict | None:
        """The prediction a preview carries, for any placement (an operator's edit, a placement
        file): the same pricing and gate as the planner's plans. None before a step was timed."""
        basis = self.step_basis()
        if basis is None:
            return None
        plan = plan_between(self.placement, placement, basis.step_loads.sum(0), self.topology, self.policy,
                            self.expert_bytes)
        return self._prediction(self.decide(plan))

    def expert_slot_bytes(self, slots_per_device: int) -> int:
        """Routed-expert bytes one device holds with this many slots in every MoE layer."""
        return slots_per_device * self.expert_bytes * len(self.moe_layers)


class LocalCluster(ClusterBase):
    def __init__(self, model: MoEForCausalLM, topology: Topology, placement: Placement | None = None,
                 policy: str = "locality", redundant_slots: int = 0, auto: AutoRebalancePolicy | None = None,
                 window_steps: int = LOAD_WINDOW_STEPS, expert_cache_slots: int | None = None, ledger: MemoryLedger | None = None,
                 knobs=None, torch_devices: list[str] | None = None):
        """expert_cache_slots: tiered expert memory. Experts stay in the host tier and each device
        keeps a cache of this many expert slots (shared by its layers) in HBM, filled by real
        copies on a miss. None: tiered only if the ledger finds that a device's HBM cannot hold
        its placed experts next to everything else, with the largest cache that fits.
        ledger (with the engine's knobs): the per-device memory accounting that enforces HBM.
        torch_devices: multi-GPU in one process: device d's experts (slots or cache) live on
        torch_devices[d], e.g. cuda:d, and the dispatch/combine copies to it are real."""
        cfg = model.cfg
        self.model = model
        if torch_devices is not None and len(torch_devices) != topology.num_devices:
            raise PlacementError(f"devices: {len(torch_devices)} torch devices for {topology.num_devices} devices")
        self.torch_devices = None if torch_devices is None else [torch.device(d) for d in torch_devices]
        if self.torch_devices is not None:
            self.backend = "multi-gpu"
        self.ledger = ledger
        self.knobs = knobs
        placement = placement or Placement.contiguous(cfg.num_layers, cfg.num_experts, topology.num_devices,
                                                      redundant_slots)
        self._init_base(model, topology, placement, policy, auto, window_steps)
        self.stats = StepDeviceStats(topology.num_devices, next(model.parameters()).device, cfg.num_layers)
        self.stats.set_links(self.moe_layers, self._link_s_per_byte())  # what readers price link spans with
        self.routing_state = RoutingState(topology.devices_per_node)
        self.layers: list[PlacedExperts] = []
        moe_layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
        logical = moe_layers[0].experts
        self.expert_bytes = logical.w13[0].nbytes + logical.w2[0].nbytes
        self.host_expert_bytes = self.expert_bytes * cfg.num_experts * len(self.moe_layers)
        self.tiered_auto = False
        # the disk tier (experts left in the checkpoint's files): always tiered, the caches fill from disk
        self.disk = getattr(model, "disk_experts", None)
        self._disk_stats = None
        if self.disk is not None:
            self.host_expert_bytes = self.disk.capacity * self.expert_bytes
            if expert_cache_slots is None:
                expert_cache_slots = self._cache_slots_for_disk(placement)
        elif expert_cache_slots is None and ledger is not None:
            expert_cache_slots = self._cache_slots_if_experts_overflow(placement)
        self.cache_slots = expert_cache_slots
        self.check(placement)
        for mlp in moe_layers:
            placed = PlacedExperts(mlp.layer_idx, mlp.experts, placement, self.stats, policy, self.routing_state,
                                   tiered=expert_cache_slots is not None, torch_devices=self.torch_devices)
            mlp.experts = placed
            self.layers.append(placed)
        self.caches = self._make_caches(placement) if expert_cache_slots is not None else None
        if ledger is not None:
            ledger.expert_category = "expert_weights" if self.caches is None else "expert_cache"
            ledger.expert_bytes = (self.expert_slot_bytes(placement.slots_per_device) if self.caches is None
                                   else self.caches[0].w13_cache.nbytes + self.caches[0].w2_cache.nbytes)

    def _cache_slots_for_disk(self, placement: Placement) -> int:
        """The HBM cache in front of the disk tier: what HBM leaves for experts, at most the experts
        a device holds (more slots could never fill)."""
        placed = placement.slots_per_device * len(self.moe_layers)
        if self.ledger is None:
            return placed
        return max(1, min(placed, self.ledger.expert_budget(self.knobs) // self.expert_bytes))

    def _cache_slots_if_experts_overflow(self, placement: Placement) -> int | None:
        budget = self.ledger.expert_budget(self.knobs)
        if self.expert_slot_bytes(placement.slots_per_device) <= budget:
            return None
        self.tiered_auto = True
        return max(1, budget // self.expert_bytes)  # the cache's own check refuses one too small

    def _make_caches(self, placement: Placement) -> list:
        from moectl.engine.experts.expert_cache import ExpertCache

        engine_device = next(self.model.parameters()).device
        devices = self.torch_devices or [engine_device] * self.num_devices
        try:  # pinned host memory only when copies really go host -> GPU
            caches = [ExpertCache.for_device(self.model, placement, d, self.cache_slots, devices[d],
                                             pin_host=devices[d].type == "cuda" and engine_device.type == "cpu",
                                             disk=self.disk)
                      for d in range(self.num_devices)]
        except ValueError as exc:
            if not self.tiered_auto:
                raise
            raise PlacementError(f"hbm: the experts placed on each device need "
                                 f"{format_size(self.expert_slot_bytes(placement.slots_per_device))} and the "
                                 f"{self.cache_slots}-slot cache that fits instead is too small ({exc})") from None
        for layer in self.layers:
            layer.caches = caches
        return caches

    def check(self, placement: Placement) -> None:
        """Refuse (PlacementError, one line) a placement this cluster cannot hold."""
        self.check_shape(placement, self.layers[0].slots_per_device if self.layers else None)
        if self.cache_slots is not None:
            per_device, what = self.cache_slots * self.expert_bytes, "expert cache"
        else:
            per_device, what = self.expert_slot_bytes(placement.slots_per_device), "experts placed"
        if self.ledger is not None:
            self.ledger.check(self.knobs, per_device, what="with the " + what + ", ")
        elif per_device > self.topology.hbm_bytes:
            raise PlacementError(f"hbm: the {what} on each device need {format_size(per_device)}, "
                                 f"more than its {format_size(self.topology.hbm_bytes)} of HBM")
        if self.cache_slots is not None:  # after the HBM check: "does not fit" says more than "too small"
            self._check_working_set(placement)

    def _check_working_set(self, placement: Placement) -> None:
        """Tiered: a device's cache must hold one layer's working set under the new placement
        (all of a layer's experts on the device may be active at once)."""
        from moectl.engine.experts.expert_cache import max_working_set

        layers = [layer.layer_idx for layer in self.layers] or range(placement.num_layers)
        widest = max(len(set(placement.experts_on(layer, d))) for layer in layers for d in range(self.num_devices))
        need = max_working_set(widest, self.model.cfg.top_k, None)
        if need > self.cache_slots:
            if self.tiered_auto:
                raise PlacementError(f"hbm: the experts placed on each device need "
                                     f"{format_size(self.expert_slot_bytes(placement.slots_per_device))} and the "
                                     f"{self.cache_slots}-slot cache that fits instead cannot hold one layer's "
                                     f"working set ({need} experts)")
            raise PlacementError(f"expert cache of {self.cache_slots} slots cannot hold one layer's working set: "
                                 f"a device would hold {widest} experts of one layer")

    def check_knobs(self, knobs) -> None:
        """Refuse knobs whose largest step would not fit next to what the devices hold."""
        if self.ledger is not None:
            self.ledger.check(knobs, what=f"at max_num_batched_tokens {knobs.max_num_batched_tokens}, ")

    def apply(self, placement: Placement) -> int:
        """Copy experts into their new slots (between steps). Returns bytes copied."""
        self.check(placement)
        if self.caches is not None:  # each device now serves other experts: build before changing anything
            self.caches = self._make_caches(placement)
        plan = migration_in(self.placement, placement, self.moe_layers)
        for layer in self.layers:
            layer.load(placement)
        self.placement = placement
        if self.caches is not None:  # tiered: nothing moves between HBMs; caches refill on demand
            moved = local = 0
        else:  # the copies made are the migration's (the slots whose expert changed)
            moved = int(plan[:, 6].sum()) * self.expert_bytes
            local = int((plan[:, 6] == 0).sum()) * self.expert_bytes
        self.last_migration = {"bytes_local": local}
        self.bytes_moved_total += moved
        return moved

    def link_seconds(self, traffic: np.ndarray) -> np.ndarray:
        """Modeled seconds each device's links are busy for one all-to-all of `traffic` bytes
        (src x dst): every off-diagonal transfer over its link's bandwidth (within or between
        nodes), counted on both ends; links are full-duplex. One array expression, also over a
        stack of layers' traffic ([..., D, D] -> [..., D]); the readers' link spans price theirs
        with the same function (moectl.wire.link_spans)."""
        return link_seconds(traffic, self._link_s_per_byte())

    def _link_s_per_byte(self) -> np.ndarray:
        """[D, D] seconds per byte on each device pair's link; 0 on the diagonal (no transfer)."""
        d = self.num_devices
        cached = getattr(self, "_link_cost", None)
        if cached is None or cached.shape != (d, d):
            gbps = np.array([[self.topology.link_gbps(s, t) for t in range(d)] for s in range(d)], dtype=np.float64)
            cached = 1.0 / (gbps * 1e9)
            np.fill_diagonal(cached, 0.0)
            self._link_cost = cached
        return cached

    # -- per step
    def begin_step(self, token_device: torch.Tensor) -> None:
        self.stats.reset()
        self.stats.token_device = token_device

    def end_step(self, wall_s: float, t_start: float | None = None) -> dict:
        """The step's "devices" record; wall_s: the step's measured (serial) time so far, t_start
        the step's start as its record gives it (predictions name their steps by it)."""
        s = self.stats
        s.resolve()
        link_s = 2 * self.link_seconds(s.traffic)  # dispatch, then combine (the same bytes back)
        record = {
            "backend": self.backend,
            "tokens": s.tokens.tolist(),
            "busy_s": s.busy_s.tolist(),  # measured
            "traffic_bytes": s.traffic.copy(),  # exact bytes of the dispatch all-to-all (combine: transpose)
            "link_s": link_s.tolist(),  # modeled from bytes and bandwidth
            "link_s_modeled": True,
            # the devices ran one after another here: the parallel step is modeled from what they measured
            "step_time": self._time_step(wall_s, float(link_s.max()) if link_s.size else 0.0,
                                         len(s.token_device), measured_parallel=False, t_start=t_start),
        }
        if self.caches is not None:
            stats = [c.stats() for c in self.caches]
            for c in self.caches:
                c.reset_stats()
            record["expert_cache"] = [{"hits": st["hits"], "misses": st["misses"], "prefetched": st["prefetch_issued"],
                                       "prefetch_useful": st["prefetch_useful"], "bytes_copied": st["bytes_copied"],
                                       "miss_wait_s": st["miss_wait_seconds"]} for st in stats]  # measured
        if self.disk is not None:
            self._disk_stats = self.disk.stats()
            self.disk.reset_stats()
        return record

    def memory(self, work: list[dict], kv_bytes_used: list[int]) -> dict:
        """The ledger's HBM bytes per device by category for this step, each device's capacity,
        and the host tier (the logical experts: the source of every slot or cache fill)."""
        ledger = self.ledger
        return {"memory": ledger.step(work, kv_bytes_used),
                "memory_modeled": ["activations", "comm_buffers"],  # from shapes, not an allocator
                "memory_capacity": {"hbm": self.topology.hbm_bytes,
                                    "kv_blocks": [ledger.kv_capacity(d) for d in range(self.num_devices)]},
                "tiers": self._disk_stats or {"host": {"expert_weights": self.host_expert_bytes}},
                "tiered_experts": ("disk" if self.disk is not None else "auto" if self.tiered_auto
                                   else "on" if self.caches is not None else "off")}
