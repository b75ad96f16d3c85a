"""`engine.experts`: the engine's expert layer, and the operator's handle on it.

It owns the cluster (experts placed on devices, see cluster.py), the per-device memory ledger
and, in tiered mode, the router-driven prefetch. The engine calls it at three points of a step
(`begin_step` from the model runner, `step_record` when the step's record is built,
`after_step` to let automatic rebalancing act). Operators preview, apply and edit placements and
set the auto policy through it: every change is checked at once, on the caller's thread, and
carried out between steps on the engine thread, so a step never sees half a placement.
"""

from __future__ import annotations

import numbers
import threading
import time
from concurrent.futures import Future

from moectl.engine.core.config import AutoRebalancePolicy
from moectl.engine.experts.cluster import LocalCluster
from moectl.engine.experts.memory_ledger import MemoryLedger
from moectl.engine.experts.prefetch import CachePrefetcher, CoactivationPredictor, RouterPredictor
from moectl.placement.placement import Placement
from moectl.placement.rebalancer import RebalancePlan
from moectl.wire.actions import Action, PlacementEdit

EDITS = tuple(e.value for e in PlacementEdit)
# each edit's arguments, all integers (the HBM check of a replica is the cluster's, not the caller's)
EDIT_ARGS = {"move": ("layer", "expert", "src_device", "dst_device"),
             "swap": ("layer", "expert_a", "device_a", "expert_b", "device_b"),
             "replicate": ("layer", "expert", "device"), "drop_replica": ("layer", "expert", "device"),
             "pin": ("layer", "expert"), "unpin": ("layer", "expert")}


def _check_edit_args(edit: str, args: dict) -> None:
    """Names the argument that is wrong, in the API's words rather than a Python signature."""
    wanted = EDIT_ARGS[edit]
    for name in args:
        if name not in wanted:
            raise ValueError(f"{name}: not an argument of {edit} (its arguments: {', '.join(wanted)})")
    for name in wanted:
        if name not in args:
            raise ValueError(f"{name}: missing ({edit} takes {', '.join(wanted)})")
        value = args[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name}: must be an integer, got {str(value)[:40]!r}")


class ExpertControl:
    def __init__(self, engine, cluster: LocalCluster, prefetch: str = "router"):
        self._engine = engine
        self.cluster = cluster
        self._lock = threading.RLock()  # edit() holds it across apply()
        self._pending: Placement | None = None  # the newest placement asked for, not yet applied
        cluster.stats.tracer = engine.telemetry.tracer
        self.prefetcher = None
        if cluster.caches is not None and prefetch != "none":
            predictor = (RouterPredictor if prefetch == "router" else CoactivationPredictor)(engine.model)
            # the routing probe that also prefetches each device's next-layer experts
            self.prefetcher = engine.runner.probe = CachePrefetcher(engine.model, cluster.caches, predictor)

    @classmethod
    def build(cls, engine) -> ExpertControl:
        """The local (emulated) or multi-GPU expert layer for an engine whose config has a topology."""
        config = engine.config
        ledger = MemoryLedger(engine.model, config.topology, kv_pool_bytes=engine.kv_bytes_per_pool(used=False),
                              block_size=config.block_size, max_model_len=engine.max_model_len)
        placement = Placement.from_dict(config.placement) if config.placement is not None else None
        cluster = LocalCluster(engine.model, config.topology, placement, policy=config.routing_policy,
                               redundant_slots=config.redundant_slots, auto=config.auto_rebalance,
                               expert_cache_slots=config.expert_cache_slots, ledger=ledger, knobs=config.knobs,
                               torch_devices=config.expert_devices)
        return cls(engine, cluster, config.expert_prefetch)

    # -- what is in force (read from any thread)
    @property
    def placement(self) -> Placement:
        return self.cluster.placement

    @property
    def topology(self):
        return self.cluster.topology

    @property
    def num_devices(self) -> int:
        return self.cluster.num_devices

    @property
    def auto(self) -> AutoRebalancePolicy:
        return self.cluster.auto

    @property
    def backend(self) -> str:
        return self.cluster.backend

    def header(self) -> dict:
        """What a trace or a remote console needs to know about the devices."""
        c = self.cluster
        return {"backend": self.backend, "topology": c.topology.as_dict(), "placement": c.placement.to_dict(),
                "expert_bytes": c.expert_bytes, "redundant_slots": c.redundant_slots, "routing_policy": c.policy,
                "tiered_experts": c.cache_slots is not None, "expert_cache_slots": c.cache_slots,
                "link_time": c.link_time,
                "step_time": "modeled" if c.link_time == "modeled" else "measured"}

    def balancedness(self) -> float:
        return self.cluster.balancedness()

    # -- operator actions (any thread)
    def preview(self) -> RebalancePlan:
        """A plan for the recent routing window: predicted balancedness before/after, bytes to move.
        Nothing changes; the preview is recorded as an action."""
        plan = self.cluster.preview()
        self._engine.record_action(Action.REBALANCE_PREVIEW, {}, plan.summary())
        return plan

    def apply(self, placement: Placement, kind: str = "placement", predicted: dict | None = None) -> Future:
        """Checked now (PlacementError); the experts are copied between steps, so in-flight
        requests see either the old or the new placement for a whole step, never a mix."""
        self.cluster.check(placement)
        with self._lock:
            self._pending = placement
            return self._engine.submit(lambda: self._apply(placement, kind, predicted), kind)

    def edit(self, edit: str, **args) -> Placement:
        """An operator's edit of one expert (Placement.move/swap/replicate/drop_replica/pin/unpin
        with their arguments), validated against the newest placement asked for, applied between
        steps. Returns the placement it makes."""
        if edit not in EDITS:
            raise ValueError(f"edit: must be one of {', '.join(EDITS)}, got {edit!r}")
        _check_edit_args(edit, args)
        with self._lock:  # held across read-modify-submit so concurrent edits are not lost
            current = self._pending or self.cluster.placement
            new = getattr(current, edit)(**args)
            self.apply(new, edit)
        return new

    def set_auto(self, policy: AutoRebalancePolicy) -> Future:
        def set_policy() -> dict:
            self.cluster.auto = policy
            self._engine.record_action(Action.AUTO_REBALANCE, policy.as_dict(), {})
            return {"mode": policy.mode}
        return self._engine.submit(set_policy, Action.AUTO_REBALANCE)

    def check_knobs(self, knobs) -> None:
        """Refuse (ValueError) knobs whose largest step would not fit next to what the devices hold."""
        self.cluster.check_knobs(knobs)

    @property
    def knobs(self):
        return self.cluster.knobs

    @knobs.setter
    def knobs(self, knobs) -> None:
        self.cluster.knobs = knobs

    # -- the engine's step (engine thread)
    def begin_step(self, token_device) -> None:
        self.cluster.begin_step(token_device)

    def step_record(self, items, contexts: list[int], kv_bytes_used: list[int], t_start: float, routing) -> dict:
        """The step record's "devices": measured work, links (modeled or measured by backend), the
        parallel step time, each device's memory, and the load window's figures with this step's
        routing in it."""
        cluster = self.cluster
        record = cluster.end_step(time.monotonic() - t_start, t_start)
        record["window"] = cluster.observe(routing)
        work = [{"tokens": 0, "seqs": 0, "context": 0, "recv_rows": int(rows)} for rows in cluster.stats.peak_rows]
        for (seq, n), context in zip(items, contexts):
            w = work[seq.home_device]
            w["tokens"] += n
            w["seqs"] += 1
            w["context"] = max(w["context"], context)
        record.update(cluster.memory(work, kv_bytes_used))
        return record

    def after_step(self, step: int) -> None:
        """In auto mode, a plan may follow the step (its routing is in the window since its
        record was built); it is applied at the start of the next step."""
        try:
            decision = self.cluster.auto_decision(step)
            if decision is not None and decision.acts:
                self._engine.record_action("auto_rebalance_plan", {}, decision.plan.summary())
                self.apply(decision.plan.placement, kind=Action.REBALANCE_APPLY, predicted=decision.plan.prediction)
            elif decision is not None:  # the gate held it back: say so, and why
                self._engine.record_action("auto_rebalance_held", {}, _held_result(decision))
        except ValueError as exc:  # never lose a finished step's outputs to a failed plan
            self._engine.record_action("auto_rebalance_failed", {}, {"error": str(exc)})

    def _apply(self, placement: Placement, kind: str, predicted: dict | None = None) -> dict:
        if predicted is None:  # not a previewed plan: priced now, before the placement in force changes
            predicted = self.cluster.predict_change(placement)
        t0 = time.perf_counter()
        try:
            moved = self.cluster.apply(placement)
            self.cluster.device_window.clear()  # the devices' figures under the old placement are not the new one's
        finally:
            with self._lock:
                if self._pending is placement:
                    self._pending = None
        seconds = time.perf_counter() - t0
        if moved > 0 and seconds > 0:  # what the next plan's copies are priced at
            self.cluster.measured_copy_bytes_per_s = moved / seconds
        if self.prefetcher is not None:  # the caches were rebuilt for the new placement
            self.prefetcher.caches = list(self.cluster.caches)
        result = {"bytes_moved": moved, "seconds": seconds, "placement": placement.to_dict(), "predicted": predicted,
                  **getattr(self.cluster, "last_migration", {})}
        self._engine.record_action(kind, {}, result)
        return result


def _held_result(decision) -> dict:
    """An auto_rebalance_held record's result: the best plan's predicted gain, its interval, why."""
    keep = ("gain", "gain_low", "gain_high", "reason", "step_s_before", "step_s_after")
    return {k: v for k, v in decision.prediction().items() if k in keep} | {"moves": len(decision.plan.move_array)}
