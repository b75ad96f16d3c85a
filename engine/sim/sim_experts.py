"""The expert layer of a simulated cluster: the placement in force, the load window, rebalance
preview and apply, edits and auto mode, with the same actions and records as a real engine's
(experts/control.py), every outcome simulated.

Plans are made and gated as a real cluster's are (placement/decision.py): the same cost model
(step_time.ExpertCostModel), fitted here on the simulated steps' per (device, layer) expert
seconds, prices the planner's candidates, and the gate acts on its interval. Each prediction also
carries the step model's own answer on the same window's steps (`step_model_gain`), so the cost
model's error against the simulator shows. Before a step was simulated, a preview is the token
balancer's plan priced by the step model alone. An apply stalls the next simulated step by the
migration's simulated time."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import replace

import numpy as np

from moectl.engine.core.config import AutoRebalancePolicy
from moectl.engine.experts.cluster import AUTO_PLAN_DEADLINE_S, PREVIEW_PLAN_DEADLINE_S, window_figures
from moectl.engine.experts.control import EDITS, _check_edit_args, _held_result
from moectl.engine.sim.step_model import Roofline, migration_stall, simulate
from moectl.placement.decision import BOOTSTRAP_ROUNDS, Decision, StepBasis, decide
from moectl.placement.placement import Placement
from moectl.placement.rebalancer import LOAD_WINDOW_STEPS, LoadWindow, preview_plan
from moectl.placement.replica_policy import expected_work
from moectl.placement.step_planner import StepCost, plan_between
from moectl.placement.step_time import ExpertCostModel
from moectl.placement.topology import Topology
from moectl.wire.actions import Action

OUTCOME_STEPS = 32  # steps after an apply that its simulated outcome compares
POLICY = "round_robin"  # the step model splits an expert's rows evenly over its replicas: round robin's expectation


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
        self.cost = ExpertCostModel()  # fitted on the simulated steps, as a real cluster's on its measured ones
        self.recent_steps: deque[dict] = deque(maxlen=LOAD_WINDOW_STEPS)  # step-time splits, beside the window
        self.recent_loads: deque = deque(maxlen=LOAD_WINDOW_STEPS)  # the step model's loads of the same steps
        self._simulated: tuple[dict, list] = ({}, [])  # _window_simulated's results and the loads they are of
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
        """The trace header's devices. With pipeline stages the topology and placement are one
        stage's EP group (devices / pp devices), which every stage runs on its own devices for its
        own layers; "pp" says so and gives each stage's layers."""
        hw, config = self._engine.hardware, self._engine.config
        out = {"backend": "simulated", "simulated": True, "hardware": hw.name, "topology": self.topology.as_dict(),
               "placement": self.placement.to_dict(), "expert_bytes": self.expert_bytes,
               "redundant_slots": self.redundant_slots, "routing_policy": "even", "routing": self.routing_line,
               "tiered_experts": False, "expert_cache_slots": None, "link_time": "simulated",
               "step_time": "simulated"}
        if config.pp > 1:
            out["pp"] = {"size": config.pp, "devices": config.devices, "devices_per_stage": self.num_devices,
                         "stage_layers": self._engine._stage_layers(),
                         "placement": "one stage's: stage s's devices s * devices_per_stage onwards run its rows of "
                                      "their own layers"}
        return out

    def balancedness(self) -> float:
        totals = self.window.totals()
        return float(self.placement.balancedness(totals)[1]) if totals.any() else 1.0

    def moe_placement(self, placement: Placement | None = None) -> Placement:
        """The placement's MoE layers: what the step model prices."""
        p = placement or self.placement
        return Placement(p.slots[self._engine.moe_layers], p.num_experts)

    # -- operator actions (any thread)
    def preview(self):
        """The planner's best plan for the window and the gate's verdict, priced by the cost model
        fitted on the simulated steps (the token balancer's plan, priced by the step model, before
        any step was simulated)."""
        token = self._token_plan() if self.auto.objective == "balance" else None
        decision = self.decide(token, deadline_s=PREVIEW_PLAN_DEADLINE_S)
        if decision is None:
            plan = token or self._token_plan()
            plan.prediction = self._step_model_prediction(plan.placement)
        else:
            plan = decision.plan
            plan.prediction = self._prediction(decision)
        self._engine.record_action(Action.REBALANCE_PREVIEW, {}, plan.summary())
        return plan

    def _token_plan(self):
        return preview_plan(self.window.totals(), self.topology, self.placement, expert_bytes=self.expert_bytes,
                            target=self.auto.target)

    def step_basis(self) -> StepBasis | None:
        return StepBasis.from_window(self.window, self.recent_steps, self.cost, self._engine.moe_layers)

    def decide(self, plan=None, deadline_s: float | None = None, rounds: int = BOOTSTRAP_ROUNDS) -> Decision | None:
        """As a real cluster's (experts/cluster.py): the planner's plan (or `plan`) and the gate,
        with link seconds per entry the busiest device's links carry, from the window, for the
        search, and the step model's network and migration for the plan's final pricing."""
        basis = self.step_basis()
        if basis is None:
            return None
        _, _, remote = expected_work(self.placement, basis.step_loads, basis.moe_layers, POLICY)
        per_remote = float(basis.link_s.sum() / remote.sum()) if remote.sum() > 0 else 0.0
        # the search prices copies as spread evenly over the receiving devices' links (one
        # expert's bytes over a device link each); the plan's final price is the busiest receiver's
        spec = self._engine.spec
        copy_s = Roofline(spec.model, spec.hardware).link(float(self.expert_bytes), 0.0) / self.num_devices
        cost = StepCost(self.cost.frozen(), POLICY, per_remote, copy_s, self.auto.horizon_steps or len(self.window),
                        link_model=lambda p: self._window_simulated(p)["link_s"], stall_model=self._stall_s)
        return decide(basis, self.placement, self.topology, cost, expert_bytes=self.expert_bytes,
                      residuals=cost.model.residuals(), min_gain=self.auto.min_gain, plan=plan,
                      deadline_s=deadline_s, rounds=rounds)

    def _window_simulated(self, placement: Placement) -> dict:
        """The step model on the window's steps under `placement`: mean step and all-to-all
        seconds (dispatch and combine, its network: NVLink, NICs, node-level dedup). The plan's
        link time is scaled by the latter (the busiest device's entries alone misjudge a
        deduplicated inter-node exchange), the former checks the cost model; kept until the next step
        (a reader finishing after it writes into the step's discarded cache)."""
        key = placement.slots.tobytes()
        cache, loads = self._simulated  # the engine thread swaps both in at each step: one read
        found = cache.get(key)
        if found is None:
            runs = [simulate(replace(self._engine.spec, placement=self.moe_placement(placement)), load, detail=True)
                    for load in loads]
            found = cache[key] = {
                "step_s": float(np.mean([r["detail"]["step_s"] for r in runs])) if runs else 0.0,
                "link_s": float(np.mean([sum(r["detail"]["layers"].dispatch) + sum(r["detail"]["layers"].combine)
                                         for r in runs])) if runs else 0.0}
        return found

    def _stall_s(self, old: Placement, new: Placement) -> float:
        """The migration's simulated stall (the busiest receiving device's copies)."""
        return migration_stall(self._engine.spec, self.moe_placement(old), self.moe_placement(new))["stall_ms"] / 1e3

    def _prediction(self, decision: Decision) -> dict:
        tokens = float(np.mean([r["tokens"] for r in list(self.recent_steps)[-len(self.window):]]))
        before, after = decision.step_s_before, decision.step_s_after
        stall = migration_stall(self._engine.spec, self.moe_placement(), self.moe_placement(decision.plan.placement))
        return {**decision.prediction(), "simulated": True,
                "throughput_before": tokens / before if before > 0 else 0.0,
                "throughput_after": tokens / after if after > 0 else 0.0,
                "migration_stall_s": stall["stall_ms"] / 1e3, "calibration": self.cost.summary(),
                "step_model_gain": self._step_model_gain(decision.plan.placement),
                "model": f"cost model fitted on the simulated steps ({self._engine.hardware.name})"}

    def predict_change(self, placement: Placement) -> dict | None:
        """The prediction for any placement (an operator's edit): the planner's pricing and gate,
        else (nothing simulated yet) the step model on the last batch."""
        basis = self.step_basis()
        if basis is None:
            return self._step_model_prediction(placement)
        plan = plan_between(self.placement, placement, basis.step_loads.sum(0), self.topology, POLICY,
                            self.expert_bytes)
        return self._prediction(self.decide(plan))

    def _step_model_gain(self, placement: Placement) -> float | None:
        """The simulator's own answer on the prediction's basis: the step model under both
        placements on the window's steps, the migration's simulated stall spread over the same
        horizon; what the cost model's gain is checked against."""
        if not self.recent_loads:
            return None
        before, after = self._window_simulated(self.placement)["step_s"], self._window_simulated(placement)["step_s"]
        stall = self._stall_s(self.placement, placement) / (self.auto.horizon_steps or len(self.window))
        return before / (after + stall) - 1

    def _step_model_prediction(self, placement: Placement) -> dict | None:
        """The simulator's own answer: the step model on the batch just run under both placements."""
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

    def observe_time(self, load, layers, step_s: float, critical_s: float, link_s: float, tokens: int) -> dict:
        """A simulated step's per (device, MoE layer) expert seconds into the cost model and its
        split beside the window (as a real cluster's _time_step); the cost model's summary."""
        self.cost.observe(layers.rows.T, layers.active.T, layers.layer_expert.T)
        self.recent_loads.append(load)
        self._simulated = ({}, list(self.recent_loads)[-len(self.window):])  # a reader holds the old pair
        self.recent_steps.append({"other_s": max(0.0, step_s - critical_s - link_s), "link_s": link_s,
                                  "tokens": tokens})
        return self.cost.summary()

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
        """Auto mode as a real cluster's (experts/cluster.py auto_decision): when its schedule or
        threshold says to look, the planner's plan acts only through the gate; a hold is recorded
        with its reason and looked at again a window later."""
        try:
            if not self.auto.should_rebalance(step, getattr(self, "window_balancedness", 1.0)):
                return
            scheduled = bool(self.auto.every_k_steps) and step > 0 and step % self.auto.every_k_steps == 0
            if not scheduled and step < getattr(self, "_next_look_step", 0):
                return
            token = self._token_plan() if self.auto.objective == "balance" else None
            decision = self.decide(token, deadline_s=AUTO_PLAN_DEADLINE_S, rounds=BOOTSTRAP_ROUNDS // 2)
            if decision is None:
                return
            self._next_look_step = step + len(self.window)
            if decision.acts:
                decision.plan.prediction = self._prediction(decision)
                self._engine.record_action("auto_rebalance_plan", {}, decision.plan.summary())
                self.apply(decision.plan.placement, kind=Action.REBALANCE_APPLY, predicted=decision.plan.prediction)
            else:
                self._engine.record_action("auto_rebalance_held", {}, _held_result(decision))
        except ValueError as exc:
            self._engine.record_action("auto_rebalance_failed", {}, {"error": str(exc)})
