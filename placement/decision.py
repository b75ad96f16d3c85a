"""Whether a rebalance pays: the planner's best plan, its predicted gain with an interval, the gate.

Every front end that proposes or applies a placement asks here: previews, auto mode, the alert,
`plan rebalance TRACE`. The prediction holds constant only what no placement changes (the
window's measured other time per step, less the replica routing in it); the expert critical path
comes from the cost model under the runtime's replica rule, replica routing from its measured
cost in each layer that has a replica, the link time is scaled by the entries the busiest device's
links carry (an all-to-all lasts as long as its busiest device's transfers), and the
migration's stall (copies over the measured, else modeled, copy bandwidth) is spread over a
horizon of steps.

The interval is a bootstrap: each round resamples the window's steps and draws, per device and
layer, a relative error from the cost model's own residuals (the same draw for the placement in
force and the plan, since a device the model under-prices is under-priced under both); the
rounds' spread is set around the point estimate. The gate acts only when the interval's lower
end clears `min_gain`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moectl.placement.placement import Placement
from moectl.placement.rebalancer import LoadWindow, RebalancePlan
from moectl.placement.replica_policy import expected_work, slot_counts
from moectl.placement.step_planner import StepCost, plan_between, plan_step_time
from moectl.placement.step_time import ExpertCostModel
from moectl.placement.topology import Topology

BOOTSTRAP_ROUNDS = 200
INTERVAL = (0.05, 0.95)  # the predicted gain's 90% interval
MIN_GAIN = 0.03  # default gate: the interval's lower end must promise at least 3% more throughput


@dataclass
class StepBasis:
    """The window's measured steps a prediction starts from."""

    step_loads: np.ndarray  # [S, L, E] routing per step
    other_s: np.ndarray  # [S] time no placement changes (attention, sampler, the rest)
    link_s: np.ndarray  # [S] link time under the placement in force (modeled on emulated devices; 0 where measured inside other)
    tokens: np.ndarray  # [S] prompt + output tokens per step
    moe_layers: list[int]
    t_start: np.ndarray | None = None  # [S] each step's start (its record's "t_start"): what names it to a console

    @classmethod
    def from_window(cls, window: LoadWindow, recent_steps, model: ExpertCostModel, moe_layers: list[int]
                    ) -> StepBasis | None:
        """A cluster's load window and the step-time splits it keeps beside it ({"other_s",
        "link_s", "tokens", "t_start"} each, oldest first) as a basis: the newest steps both hold;
        None before a step was timed or the cost model has samples."""
        recent = list(recent_steps)[-len(window):]
        if not recent or not model.samples:
            return None
        starts = [r.get("t_start") for r in recent]
        return cls(window.step_loads()[-len(recent):], [r["other_s"] for r in recent], [r["link_s"] for r in recent],
                   [r["tokens"] for r in recent], list(moe_layers), None if None in starts else starts)

    def __post_init__(self):
        self.step_loads = np.asarray(self.step_loads, dtype=np.float64)
        self.other_s, self.link_s, self.tokens = (np.asarray(a, dtype=np.float64) for a in
                                                  (self.other_s, self.link_s, self.tokens))
        if self.t_start is not None:
            self.t_start = np.asarray(self.t_start, dtype=np.float64)


@dataclass
class Decision:
    """A plan, what it is predicted to do, and whether the gate lets it act."""

    plan: RebalancePlan
    step_s_before: float
    step_s_after: float  # with the migration's stall spread over the horizon
    gain: float  # throughput after / before - 1, point estimate
    gain_low: float
    gain_high: float
    acts: bool
    reason: str  # one line: why it acts, or why nothing pays
    parts: dict = field(default_factory=dict)  # predicted seconds per step, before -> after, by part
    per_step: dict | None = None  # {"t_start", "before_s", "after_s"}: each window step's prediction

    def prediction(self) -> dict:
        """The preview's "predicted" dict (RebalancePlan.prediction). "per_step" lets an outcome
        take the preview's own prediction on the population it then compares (profiler/outcome.py)."""
        return {"step_s_before": self.step_s_before, "step_s_after": self.step_s_after, "gain": self.gain,
                "gain_low": self.gain_low, "gain_high": self.gain_high, "acts": self.acts, "reason": self.reason,
                "saved_s_per_step": self.step_s_before - self.step_s_after, "parts": self.parts,
                **({"per_step": self.per_step} if self.per_step is not None else {})}


def decide(basis: StepBasis, current: Placement, topology: Topology, cost: StepCost, *, expert_bytes: int = 0,
           residuals: np.ndarray | None = None, min_gain: float = MIN_GAIN, plan: RebalancePlan | None = None,
           rounds: int = BOOTSTRAP_ROUNDS, seed: int = 0, deadline_s: float | None = None) -> Decision:
    """The best plan for the window (or `plan`, priced as given) and the gate's verdict on it."""
    planned = plan is None
    if planned:
        plan = plan_step_time(basis.step_loads, current, topology, cost, basis.moe_layers, expert_bytes,
                              deadline_s=deadline_s)
    before = _per_step(cost, current, basis)
    rest = basis.other_s - before["routing"]  # what no placement changes: routing under it is in other_s
    step_b = rest + before["routing"] + before["critical"] + before["link"]
    after, amortised, step_a = _after(plan, cost, basis, before, rest, current)
    if planned and step_a.mean() > step_b.mean():  # searched on a few steps, slower on the window: keep
        plan = plan_between(current, current, basis.step_loads.sum(0), topology, cost.policy, expert_bytes,
                            plan.seconds)
        after, amortised, step_a = _after(plan, cost, basis, before, rest, current)
    changed = not np.array_equal(plan.placement.slots, current.slots)  # a plan may only drop replicas
    gain = float(step_b.mean() / step_a.mean() - 1)
    low, high = _interval(rest, before, after, amortised, residuals, rounds, seed, gain)
    parts = {"expert_critical_s": [float(before["critical"].mean()), float(after["critical"].mean())],
             "routing_s": [float(before["routing"].mean()), float(after["routing"].mean())],
             "link_s": [float(before["link"].mean()), float(after["link"].mean())],
             "migration_s": [0.0, amortised], "other_s": [float(rest.mean())] * 2}
    acts = bool(changed and low >= min_gain)
    per_step = None if basis.t_start is None else {
        "t_start": basis.t_start.tolist(), "before_s": step_b.tolist(), "after_s": step_a.tolist()}
    decision = Decision(plan, float(step_b.mean()), float(step_a.mean()), gain, low, high, acts, "", parts, per_step)
    decision.reason = _reason(decision, before, cost, min_gain, changed)
    return decision


def _after(plan: RebalancePlan, cost: StepCost, basis: StepBasis, before: dict, rest: np.ndarray,
           current: Placement):
    """The plan's per-step prediction, its migration's stall per step, and its step times."""
    after = _per_step(cost, plan.placement, basis, before["remote"])
    if cost.link_model is not None and plan.placement != current:  # the backend's network model
        now = cost.link_model(current)
        after["link"] = basis.link_s * (cost.link_model(plan.placement) / now if now > 0 else 1.0)
    stall = cost.stall_model(current, plan.placement) if cost.stall_model is not None else \
        len(plan.move_array) * cost.copy_s
    amortised = stall / cost.horizon_steps
    return after, amortised, rest + after["routing"] + after["critical"] + after["link"] + amortised


def _per_step(cost: StepCost, placement: Placement, basis: StepBasis, remote_now: np.ndarray | None = None) -> dict:
    """Per step: the expert critical path, replica routing, the link time, and the [S, D, M] busy
    the critical path comes from.
    remote_now: the entries the busiest device's links carry under the placement in force
    ([S, M], summed over layers), when `placement` is another: the link time scales by the ratio."""
    rows, active, remote = expected_work(placement, basis.step_loads, basis.moe_layers, cost.policy)
    busy = cost.model.predict(rows, active)
    link = basis.link_s
    if remote_now is not None:
        scale = np.divide(remote.sum(1), remote_now.sum(1), out=np.ones(len(link)), where=remote_now.sum(1) > 0)
        link = link * scale
    replicated = [layer for layer in basis.moe_layers if (slot_counts(placement, layer).sum(0) > 1).any()]
    routing = cost.model.routing_s(basis.step_loads[:, replicated].sum(2)).sum(1) if replicated else np.zeros(len(link))
    return {"busy": busy, "critical": busy.max(1).sum(1), "link": link, "active": active, "rows": rows,
            "remote": remote, "routing": routing}


def _interval(rest: np.ndarray, before: dict, after: dict, amortised: float, residuals, rounds: int,
              seed: int, point: float) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    S = len(rest)
    # a prediction never less than a tenth of itself: the first fits' errors can be wild
    pool = np.clip(residuals, -0.9, 9.0) if residuals is not None and len(residuals) else np.zeros(1)
    cells = before["busy"].shape[1:]  # [D, M]
    gains = np.empty(rounds)
    for r in range(rounds):
        idx = rng.integers(0, S, S)
        scale = 1.0 + rng.choice(pool, size=cells)  # the model's relative error on each (device, layer)
        crit_b = (before["busy"][idx] * scale).max(1).sum(1)
        crit_a = (after["busy"][idx] * scale).max(1).sum(1)
        step_b = rest[idx] + before["routing"][idx] + crit_b + before["link"][idx]
        step_a = rest[idx] + after["routing"][idx] + crit_a + after["link"][idx] + amortised
        gains[r] = step_b.mean() / step_a.mean() - 1
    # centred on the point estimate: noise on every cell raises the slowest device under both
    # placements, which biases the rounds' level; their spread is what the interval takes
    low, mid, high = np.quantile(gains, (INTERVAL[0], 0.5, INTERVAL[1]))
    return float(point - (mid - low)), float(point + (high - mid))


def _reason(d: Decision, before: dict, cost: StepCost, min_gain: float, changed: bool) -> str:
    interval = f"{d.gain:+.1%} ({d.gain_low:+.1%} to {d.gain_high:+.1%})"
    saved_ms = (d.step_s_before - d.step_s_after) * 1e3
    if d.acts:
        return (f"predicted {saved_ms:.2f} ms a step saved, throughput {interval}, "
                f"{len(d.plan.move_array)} expert copies")  # (a plan that only drops replicas copies none)
    if not changed:
        best = "no placement is predicted faster than the one in force"
    else:
        best = f"the best plan gains {interval}, below the {min_gain:.0%} gate"
    expert_share = float(before["critical"].mean() / d.step_s_before) if d.step_s_before > 0 else 0.0
    fixed = cost.model.fixed_part(before["rows"], before["active"])
    modeled = before["busy"].sum()
    fixed_share = float(fixed.sum() / modeled) if modeled > 0 else 0.0
    why = f"expert work is {expert_share:.0%} of the step"
    if fixed_share >= 0.5:
        why += f" and fixed per-expert costs are {fixed_share:.0%} of it"
    return f"{best}: {why}"


def basis_from_records(records: list[dict]) -> tuple[StepBasis, ExpertCostModel, bool] | None:
    """The window of recorded step records as a prediction's basis: their routing and step-time
    split, the cost model as the engine had calibrated it (the newest record's), and whether the
    parallel step was modeled (emulated devices; a simulated engine's steps say modeled too, and
    carry the cost model fitted on them). None when the records carry no timed steps (older
    traces, no devices)."""
    timed = [r for r in records if ((r.get("devices") or {}).get("step_time") or {}).get("cost_model")
             and r.get("routing") is not None]
    if not timed:
        return None
    last = timed[-1]["devices"]["step_time"]
    model = ExpertCostModel.from_summary(last["cost_model"])
    if not model.samples:
        return None
    loads = np.stack([np.asarray(r["routing"], dtype=np.float64) for r in timed])
    moe_layers = [int(i) for i in np.nonzero(loads.sum((0, 2)))[0]]
    splits = [r["devices"]["step_time"] for r in timed]
    modeled = bool(last.get("modeled"))
    link = [s["link_s"] if modeled else 0.0 for s in splits]  # measured: the collectives are inside other_s
    tokens = [r["batch"]["prefill_tokens"] + r["batch"]["decode_tokens"] for r in timed]
    return (StepBasis(loads, [s["other_s"] for s in splits], link, tokens, moe_layers,
                      np.array([float(r["t_start"]) for r in timed])), model, modeled)


def predict_from_records(records: list[dict], before: Placement, after: Placement,
                         policy: str = "locality") -> dict | None:
    """The prediction a preview carries, for `after` against `before`, from recorded step records
    alone (replay's counterfactual, `plan rebalance` on a trace, the rebalance suite's check):
    basis_from_records' window and cost model, priced and gated by decide(). The copies are not
    priced (a record does not say the bandwidth). None when the records carry no timed steps."""
    timed = basis_from_records(records)
    if timed is None:
        return None
    basis, model, modeled = timed
    topology = Topology(num_devices=before.num_devices)
    cost = StepCost(model, policy)
    plan = plan_between(before, after, basis.step_loads.sum(0), topology, policy)
    decision = decide(basis, before, topology, cost, residuals=model.residuals(), plan=plan)
    tokens = float(basis.tokens.mean())
    return {**decision.prediction(),
            "throughput_before": tokens / decision.step_s_before if decision.step_s_before > 0 else 0.0,
            "throughput_after": tokens / decision.step_s_after if decision.step_s_after > 0 else 0.0,
            "calibration": model.summary(),
            "model": "recorded per-expert costs; " + ("modeled" if modeled else "measured") + " parallel step"}
