"""The expert layer of a simulated cluster: the placement in force, the load window, rebalance
preview and apply, edits and auto mode, with the same actions and records as a real engine's
(experts/control.py), every outcome simulated: a preview predicts with the step model on the
batch just run, and an apply stalls the next simulated step by the migration's modeled time."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import replace

import numpy as np

from moectl.engine.core.config import AutoRebalancePolicy
from moectl.engine.experts.cluster import window_figures
from moectl.engine.experts.control import EDITS, _check_edit_args
from moectl.engine.sim.step_model import migration_stall, simulate
from moectl.placement.placement import Placement
from moectl.placement.rebalancer import LOAD_WINDOW_STEPS, LoadWindow, preview_plan
from moectl.placement.topology import Topology
from moectl.wire.actions import Action

OUTCOME_STEPS = 32  # steps after an apply that its simulated outcome compares


class SimExperts:
    def __init__(self, engine, placement: Placement, topology: Topology, redundant_slots: int, routing_line: str):
        self._engine = engine
        self.placement = placement
        self.topology = topology
        self.redundant_slots = redundant_slots
        self.routing_line = routing_line
        self.auto = AutoRebalancePolicy()
        self.window = LoadWindow(engine.model_config.num_layers, placement.num_experts, LOAD_WINDOW_STEPS)
        self.device_window: deque[tuple[np.ndarray, np.ndarray, float]] = deque(maxlen=LOAD_WINDOW_STEPS)
        self.pending_stall_s = 0.0  # a migration's stall, added to the next simulated step
        self._outcome: dict | None = None  # the last apply's outcome while its steps accumulate
        self._pending: Placement | None = None
        self._lock = threading.RLock()  # edit() holds it across apply()

    # -- what a header, a console or the alerts read
    @property
    def num_devices(self) -> int:
        return self.topology.num_devices

    @property
    def backend(self) -> str:
        return "simulated"

    @property
    def expert_bytes(self) -> int:
        return int(self._engine.sim_model.expert_bytes())

    def header(self) -> dict:
        hw = self._engine.hardware
        return {"backend": "simulated", "simulated": True, "hardware": hw.name, "topology": self.topology.as_dict(),
                "placement": self.placement.to_dict(), "expert_bytes": self.expert_bytes,
                "redundant_slots": self.redundant_slots, "routing_policy": "even", "routing": self.routing_line,
                "tiered_experts": False, "expert_cache_slots": None, "link_time": "simulated",
                "step_time": "simulated"}

    def balancedness(self) -> float:
        totals = self.window.totals()
        return float(self.placement.balancedness(totals)[1]) if totals.any() else 1.0

    def moe_placement(self, placement: Placement | None = None) -> Placement:
        """The placement's MoE layers: what the step model prices."""
        p = placement or self.placement
        return Placement(p.slots[self._engine.moe_layers], p.num_experts)

    # -- operator actions (any thread)
    def preview(self):
        """A plan for the window's routing, its predicted step on the batch just run (simulated)."""
        plan = preview_plan(self.window.totals(), self.topology, self.placement, expert_bytes=self.expert_bytes,
                            target=self.auto.target, predict=self.predict_change)
        self._engine.record_action(Action.REBALANCE_PREVIEW, {}, plan.summary())
        return plan

    def predict_change(self, placement: Placement) -> dict | None:
        load = self._engine.last_load
        if load is None:
            return None
        spec = self._engine.spec
        before = simulate(replace(spec, placement=self.moe_placement()), load)
        after = simulate(replace(spec, placement=self.moe_placement(placement)), load)
        stall = migration_stall(spec, self.moe_placement(), self.moe_placement(placement))
        return {"step_s_before": before["step_ms"] / 1e3, "step_s_after": after["step_ms"] / 1e3,
                "throughput_before": before["tokens_per_s"], "throughput_after": after["tokens_per_s"],
                "gain": before["step_ms"] / after["step_ms"] - 1,
                "min_util_before": min(before["utilisation"]), "min_util_after": min(after["utilisation"]),
                "migration_stall_s": stall["stall_ms"] / 1e3, "simulated": True,
                "calibration": {}, "model": f"simulated on {self._engine.hardware.name} (step model, last batch)"}

    def check(self, placement: Placement) -> None:
        if not isinstance(placement, Placement):
            raise ValueError("placement: not a Placement")
        current = self.placement
        if (placement.num_layers, placement.num_experts, placement.num_devices) != \
                (current.num_layers, current.num_experts, current.num_devices):
            raise ValueError(f"placement: is for {placement.num_devices} devices x {placement.num_layers} layers x "
                             f"{placement.num_experts} experts, not {current.num_devices} x {current.num_layers} x "
                             f"{current.num_experts}")

    def apply(self, placement: Placement, kind: str = "placement", predicted: dict | None = None) -> Future:
        self.check(placement)
        with self._lock:
            self._pending = placement
            return self._engine.submit(lambda: self._apply(placement, kind, predicted), kind)

    def edit(self, edit: str, **args) -> Placement:
        if edit not in EDITS:
            raise ValueError(f"edit: must be one of {', '.join(EDITS)}, got {edit!r}")
        _check_edit_args(edit, args)
        with self._lock:
            current = self._pending or self.placement
            new = getattr(current, edit)(**args)
            self.apply(new, edit)
        return new

    def set_auto(self, policy: AutoRebalancePolicy) -> Future:
        def set_policy() -> dict:
            self.auto = policy
            self._engine.record_action(Action.AUTO_REBALANCE, policy.as_dict(), {})
            return {"mode": policy.mode}
        return self._engine.submit(set_policy, Action.AUTO_REBALANCE)

    def check_knobs(self, knobs) -> None:
        """Simulated devices hold what the memory plan gives them; knobs change only the batch."""

    # -- the engine thread
    def _apply(self, placement: Placement, kind: str, predicted: dict | None = None) -> dict:
        if predicted is None:  # not a previewed plan: priced now
            predicted = self.predict_change(placement)
        stall = migration_stall(self._engine.spec, self.moe_placement(), self.moe_placement(placement))
        moved = self.placement.bytes_to(placement, self.expert_bytes) if placement != self.placement else 0
        self._outcome = {"old": self.moe_placement(), "predicted": predicted, "tokens": 0, "seconds_after": 0.0,
                         "seconds_before": 0.0, "steps": 0, "stall_s": stall["stall_ms"] / 1e3}
        self.placement = placement
        self._engine.placement_changed()
        self.device_window.clear()
        self.pending_stall_s += stall["stall_ms"] / 1e3
        with self._lock:
            if self._pending is placement:
                self._pending = None
        result = {"bytes_moved": int(moved), "seconds": stall["stall_ms"] / 1e3, "simulated": True,
                  "placement": placement.to_dict(), "predicted": predicted,
                  "migration": {"experts_moved": stall["experts_moved"], "bytes_transferred": stall["bytes"],
                                "seconds_max": stall["stall_ms"] / 1e3, "measured": False, "simulated": True}}
        self._engine.record_action(kind, {}, result)
        return result

    def observe(self, routing: np.ndarray, rows: np.ndarray, busy_s: np.ndarray, step_s: float) -> dict:
        """The step's routing into the window; the record's "window" figures (as experts/cluster.py)."""
        self.window.add(routing)
        self.device_window.append((rows, busy_s, step_s))
        figures = window_figures(self.window, self.placement, self.device_window)
        self.window_balancedness = figures["balancedness"]
        return figures

    def observe_outcome(self, load, tokens: int, step_s: float) -> None:
        """After an apply: this step's batch again under the placement it replaced (routing does
        not depend on the placement, so the batches are the same), until OUTCOME_STEPS steps give
        the apply's simulated outcome, recorded as a "rebalance_outcome" action."""
        o = self._outcome
        if o is None:
            return
        o["tokens"] += tokens
        o["seconds_after"] += step_s
        o["seconds_before"] += simulate(replace(self._engine.spec, placement=o["old"]), load)["step_ms"] / 1e3
        o["steps"] += 1
        if o["steps"] < OUTCOME_STEPS:
            return
        self._outcome = None
        before, after = o["tokens"] / o["seconds_before"], o["tokens"] / o["seconds_after"]
        predicted = o["predicted"] or {}
        self._engine.record_action("rebalance_outcome", {}, {
            "simulated": True, "same_batches": True, "steps": o["steps"], "throughput_before": before,
            "throughput_after": after, "gain": after / before - 1, "predicted_gain": predicted.get("gain"),
            "migration_stall_s": o["stall_s"]})

    def after_step(self, step: int) -> None:
        try:
            if self.auto.should_rebalance(step, getattr(self, "window_balancedness", 1.0)):
                plan = self.preview()
                if plan.bytes_moved == 0:
                    return  # nothing to move (as the real cluster's auto mode: no apply, no outcome reset)
                self._engine.record_action("auto_rebalance_plan", {}, plan.summary())
                self.apply(plan.placement, kind=Action.REBALANCE_APPLY, predicted=plan.prediction)
        except ValueError as exc:
            self._engine.record_action("auto_rebalance_failed", {}, {"error": str(exc)})
