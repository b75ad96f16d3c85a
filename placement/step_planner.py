"""A placement that minimises the predicted step time, not the busiest device's tokens.

The cost model (step_time.ExpertCostModel) prices what a placement changes in one MoE layer:

    layer time = mean over steps of the slowest device's expert time (per call, per active
                 expert, per row, under the runtime's replica rule: replica_policy.layer_work)
               + replica routing's cost, where the layer has a replica
               + link time of the entries that cross a link (per remote entry, measured or modeled)
               + the migration's stall, amortised over `horizon_steps`

and the rest of the step (attention, sampler, everything no placement changes) is held constant,
so the step is a sum of independent layer terms and each layer is planned on its own. A layer is
searched locally from the placement in force: swaps of two experts (or of an expert with an empty
slot), a replica added in an empty slot, a replica dropped (its slot left empty: a replica that
does not pay is not kept). Each round screens every swap off the slowest device with a linear
update of its rows and active experts, prices the best few and the replica moves exactly, and
takes the best; it stops when nothing gains. "No change" is always a candidate: the plan is never
predicted slower than the placement in force.

Steps for the search are a handful of the window's, spread over its batch sizes (SEARCH_STEPS);
the plan's prediction is then priced on every step of the window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from moectl.placement.placement import Placement, PlacementError, balancedness
from moectl.placement.rebalancer import Balance, RebalancePlan, plan_rebalance
from moectl.placement.replica_policy import counts_of, layer_work, slot_counts
from moectl.placement.step_time import ExpertCostModel
from moectl.placement.topology import Topology

SEARCH_STEPS = 8  # steps of the window the local search prices (spread over its batch sizes)
SCREENED = 4  # swaps priced exactly per round, of those the linear screen ranks best
MIN_GAIN_S = 1e-9  # a move must save at least this much predicted time per step to be taken
TIE_BREAK = 0.01  # the search's weight on the devices' mean busy time beside the slowest one's


@dataclass(frozen=True)
class StepCost:
    """What the planner prices a layer with."""

    model: ExpertCostModel
    policy: str = "locality"
    link_s_per_remote_row: float = 0.0  # measured or modeled link seconds per entry crossing a link
    copy_s: float = 0.0  # seconds one expert copy stalls the engine (bytes over the migration bandwidth)
    horizon_steps: int = 64  # steps the migration's stall is spread over

    def layer(self, held: np.ndarray, loads: np.ndarray, new_copies: int, tie_break: float = 0.0) -> float:
        """Predicted seconds per step of one layer: [D, E] slots holding each expert, [S, E]
        per-step loads. tie_break weighs the devices' mean busy time too (the search's plateaus:
        a step is as slow as its slowest device, so work taken off another one alone gains nothing)."""
        rows, active, remote = layer_work(held, loads, self.policy)
        busy = self.model.predict(rows, active)  # [S, D]
        routing = float(self.model.routing_s(loads.sum(1)).mean()) if (held.sum(0) > 1).any() else 0.0
        return (float(busy.max(1).mean()) + tie_break * float(busy.mean()) + routing
                + self.link_s_per_remote_row * float(remote.mean()) + self.copy_s * new_copies / self.horizon_steps)


def search_steps(step_loads: np.ndarray, count: int = SEARCH_STEPS) -> np.ndarray:
    """Indices of `count` steps spread over the window's batch sizes (quantiles of entries per step)."""
    S = step_loads.shape[0]
    if S <= count:
        return np.arange(S)
    order = np.argsort(step_loads.sum(axis=(1, 2)), kind="stable")
    return np.unique(order[np.linspace(0, S - 1, count).round().astype(int)])


def cost_weights(step_loads: np.ndarray, model: ExpertCostModel, devices: int) -> np.ndarray:
    """[L, E] what each expert adds to its device's time in a mean step, for packing: its share
    of the per-expert term (the fraction of steps it runs in) plus its rows at the per-row cost
    of the kernel a device's call then runs (grouped from the model's switch, else the loop)."""
    coef = dict(zip(("per_call_s", "per_expert_s", "per_row_s", "per_row_loop_s"), model.coefficients()))
    mean = step_loads.mean(0)
    rows_per_call = mean.sum(1, keepdims=True) / devices  # [L, 1] a device's rows in a balanced step
    grouped = model.switch_rows is None or rows_per_call >= model.switch_rows
    per_row = np.where(grouped, coef["per_row_s"], coef["per_row_loop_s"])
    return coef["per_expert_s"] * (step_loads > 0).mean(0) + per_row * mean


def plan_step_time(step_loads, current: Placement, topology: Topology, cost: StepCost, moe_layers: list[int],
                   expert_bytes: int = 0, deadline_s: float | None = None) -> RebalancePlan:
    """The placement, keeping `current`'s slot count, that minimises the predicted step time for
    these per-step [S, L, E] loads; layers no move improves stay as they are.

    Per layer the candidates are the layer as it is and a packing of the cost model's per-expert
    weights (rebalancer.py's packer, replicas in the spare slots), each priced on the search steps
    with its migration; the better is improved by local search (which also drops replicas that
    do not pay) while `deadline_s` allows."""
    t0 = time.perf_counter()
    loads = np.asarray(step_loads, dtype=np.float64)
    if loads.ndim != 3 or loads.shape[1:] != (current.num_layers, current.num_experts):
        raise PlacementError(f"loads: expected per-step [steps, {current.num_layers}, {current.num_experts}], "
                             f"got {list(loads.shape)}")
    if not loads.any():
        raise PlacementError("rebalance: no routing observed yet")
    D, K = current.num_devices, current.slots_per_device
    spare = K - -(-current.num_experts // D)
    totals = loads.sum(0)
    weights = cost_weights(loads, cost.model, D)
    seeds = [plan_rebalance(weights, topology, spare, current=current).placement.slots]
    if spare:
        seeds.append(_without_replicas(current.slots))
    picked = loads[search_steps(loads)]
    slots = current.slots.copy()
    kept = current.num_layers - len(moe_layers)
    stop_at = None if deadline_s is None else t0 + deadline_s
    for layer in moe_layers:
        pinned = {e for (l, e) in current.pinned if l == layer}
        new = _plan_layer(slots[layer], [seed[layer] for seed in seeds], picked[:, layer], cost, pinned, stop_at)
        kept += int((new == slots[layer]).all())
        slots[layer] = new
    plan = Placement(slots, current.num_experts, current.pinned)
    return plan_between(current, plan, totals, topology, cost.policy, expert_bytes, time.perf_counter() - t0, kept)


def plan_between(current: Placement, placement: Placement, totals: np.ndarray, topology: Topology, policy: str,
                 expert_bytes: int = 0, seconds: float = 0.0, kept: int | None = None) -> RebalancePlan:
    """`placement` as a plan from `current`: its migration, and both balancednesses for the
    window's summed [L, E] loads under the runtime's replica rule."""
    migration = current.migration(placement, topology.devices_per_node)
    over_link = migration[:, 6] == 1
    b_per, b_all = balancedness(_device_rows(current, totals, policy))
    a_per, a_all = balancedness(_device_rows(placement, totals, policy))
    if kept is None:  # layers with no slot to fill (also across a change of slot count)
        kept = current.num_layers - len(np.unique(migration[:, 0]))
    return RebalancePlan(placement, Balance(b_per, b_all), Balance(a_per, a_all), int(over_link.sum()) * expert_bytes,
                         migration[over_link][:, [0, 1, 2, 4, 5]], seconds, kept,
                         int((~over_link).sum()) * expert_bytes)


def _without_replicas(slots: np.ndarray) -> np.ndarray:
    """Every layer with one slot per expert, the others left empty: a replica is taken off the
    device holding the most experts, one at a time, until none is left."""
    out = slots.copy()
    for layer in out:
        while True:
            experts, counts = np.unique(layer[layer >= 0], return_counts=True)
            extra = np.isin(layer, experts[counts > 1])  # slots of replicated experts
            if not extra.any():
                break
            held = (layer >= 0).sum(1)
            device = int(np.argmax(np.where(extra.any(1), held, -1)))
            layer[device, np.flatnonzero(extra[device])[-1]] = -1
    return out


def _device_rows(placement: Placement, totals: np.ndarray, policy: str) -> np.ndarray:
    """[L, D] rows per device for the window's summed loads, by the runtime's rule."""
    return np.stack([layer_work(slot_counts(placement, layer), totals[layer][None], policy)[0][0]
                     for layer in range(placement.num_layers)])


def _plan_layer(slots0: np.ndarray, seeds: list[np.ndarray], loads: np.ndarray, cost: StepCost, pinned: set[int],
                stop_at: float | None = None) -> np.ndarray:
    """The best of the layer as it is and the seeds (each [D, K] slots), improved by local search
    (until nothing gains, or perf_counter() passes `stop_at`) over [S, E] search-step loads."""
    E = loads.shape[1]
    original = counts_of(slots0, E)

    def price(candidate: np.ndarray) -> float:
        held = counts_of(candidate, E)
        if not held.any(0).all():  # every expert keeps a replica
            return np.inf
        return cost.layer(held, loads, int(((held > 0) & (original == 0)).sum()), TIE_BREAK)

    starts = [(price(slots0), slots0)]
    for seed in seeds:
        if _moves_pinned(slots0, seed, pinned):
            continue
        value = price(seed)
        if value < starts[0][0] - MIN_GAIN_S:
            starts.append((value, seed))
    # from the layer as it is (few moves) and from the packing (a better balance, more moves)
    return min((_descend(slots, value, loads, cost, pinned, price, stop_at) for value, slots in starts),
               key=lambda found: found[0])[1]


def _descend(slots: np.ndarray, best: float, loads: np.ndarray, cost: StepCost, pinned: set[int], price,
             stop_at: float | None) -> tuple[float, np.ndarray]:
    """Greedy local search: the best priced move of each round while it gains and time is left."""
    for _ in range(4 * slots.size):
        if stop_at is not None and time.perf_counter() > stop_at:
            break
        hot, work = _critical_device(slots, loads, cost)
        candidates = _swaps(slots, loads, cost, pinned, hot, work) + _replica_moves(slots, loads, work["busy"], pinned)
        priced = [(price(c), i) for i, c in enumerate(candidates)]
        if not priced:
            break
        value, i = min(priced)
        if value > best - MIN_GAIN_S:
            break
        slots, best = candidates[i], value
    return best, slots


def _moves_pinned(before: np.ndarray, after: np.ndarray, pinned: set[int]) -> bool:
    """Whether `after` takes a pinned expert off a device that holds it in `before`."""
    return any((before == e).any(1)[(after == e).any(1) == 0].any() for e in pinned)


def _critical_device(slots: np.ndarray, loads: np.ndarray, cost: StepCost) -> tuple[int, dict]:
    """The device that is slowest in most search steps, and the layer's work under `slots`."""
    held = counts_of(slots, loads.shape[1])
    rows, active, _ = layer_work(held, loads, cost.policy)
    busy = cost.model.predict(rows, active)  # [S, D]
    critical = np.bincount(busy.argmax(1), minlength=slots.shape[0])
    return int(critical.argmax()), {"held": held, "rows": rows, "active": active, "busy": busy}


def _swaps(slots: np.ndarray, loads: np.ndarray, cost: StepCost, pinned: set[int], hot: int,
           work: dict) -> list[np.ndarray]:
    """The SCREENED most promising exchanges of a slot on the slowest device with a slot elsewhere
    (an expert or an empty slot), ranked by a linear update of the two devices' work that treats
    each expert as computed where it sits (exact for single-replica experts)."""
    D, K = slots.shape
    flat = slots.ravel()
    movable = (flat < 0) | ~np.isin(flat, list(pinned))  # a pinned expert's slot never takes part
    on_hot = np.arange(D * K) // K == hot
    mine = np.flatnonzero(on_hot & movable & (flat >= 0))
    others = np.flatnonzero(~on_hot & movable)
    if not mine.size or not others.size:
        return []
    padded = np.concatenate([loads, np.zeros((loads.shape[0], 1))], axis=1)  # column -1: an empty slot
    a, b = padded[:, flat[mine]], padded[:, flat[others]]  # [S, m], [S, o]
    held, rows, active, busy = work["held"], work["rows"], work["active"], work["busy"]
    other_dev = others // K
    delta = b[:, None, :] - a[:, :, None]  # [S, m, o]: what the slowest device gains
    act = (b > 0)[:, None, :].astype(float) - (a > 0)[:, :, None]
    new_hot = cost.model.predict(rows[:, hot, None, None] + delta, active[:, hot, None, None] + act)
    new_other = cost.model.predict(rows[:, other_dev][:, None, :] - delta, active[:, other_dev][:, None, :] - act)
    rest = busy.copy()
    rest[:, hot] = 0.0
    # the slowest device of the rest, leaving out the partner: its top two per step suffice
    top2 = np.sort(rest, axis=1)[:, -2:]
    first_dev = rest.argmax(1)
    rest_max = np.where(first_dev[:, None, None] == other_dev[None, None, :], top2[:, 0, None, None],
                        top2[:, 1, None, None])
    score = np.maximum(np.maximum(new_hot, new_other), rest_max).mean(0)  # [m, o]
    # a device never holds an expert twice: not the partner's expert coming here, nor ours going there
    ours, theirs = flat[mine][:, None], flat[others][None, :]
    held = held > 0
    twice = (ours == theirs) | held[other_dev[None, :], ours] | (held[hot, np.maximum(theirs, 0)] & (theirs >= 0))
    score[twice] = np.inf
    order = np.argsort(score, axis=None)[:SCREENED]
    out = []
    for k in order:
        if not np.isfinite(score.flat[k]):
            break
        i, j = np.unravel_index(k, score.shape)
        new = flat.copy()
        new[mine[i]], new[others[j]] = flat[others[j]], flat[mine[i]]
        out.append(new.reshape(D, K))
    return out


REPLICA_CANDIDATES = 3  # hottest experts x least busy devices with room, and replicas to drop, per round


def _replica_moves(slots: np.ndarray, loads: np.ndarray, busy: np.ndarray, pinned: set[int]) -> list[np.ndarray]:
    """A replica of one of the hottest experts in an empty slot of one of the least busy devices
    with room, and each of the coldest replicas dropped (its slot left empty)."""
    D, K = slots.shape
    out = []
    flat = slots.ravel()
    per_expert = loads.sum(0)
    counts = np.bincount(flat[flat >= 0], minlength=loads.shape[1])
    empty = np.flatnonzero(flat < 0)
    if empty.size:
        first_empty = empty[np.unique(empty // K, return_index=True)[1]]  # one empty slot per device
        by_idle = first_empty[np.argsort(busy.mean(0)[first_empty // K], kind="stable")][:REPLICA_CANDIDATES]
        for e in np.argsort(-per_expert, kind="stable")[:REPLICA_CANDIDATES]:
            for slot in by_idle:
                if (slots[slot // K] == e).any():
                    continue
                new = flat.copy()
                new[slot] = e
                out.append(new.reshape(D, K))
    replicas = np.flatnonzero((flat >= 0) & (counts[np.maximum(flat, 0)] > 1))
    replicas = [s for s in replicas if flat[s] not in pinned]
    for slot in sorted(replicas, key=lambda s: per_expert[flat[s]] / counts[flat[s]])[:REPLICA_CANDIDATES]:
        new = flat.copy()
        new[slot] = -1
        out.append(new.reshape(D, K))
    return out
