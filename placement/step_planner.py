"""A placement that minimises the predicted step time, not the busiest device's tokens.

The cost model (step_time.ExpertCostModel) prices what a placement changes in one MoE layer:

    layer time = mean over steps of the slowest device's expert time (per call, per active
                 expert, per row, under the runtime's replica rule: replica_policy.slots_work)
               + replica routing's cost, where the layer has a replica
               + link time of the entries the busiest device's links carry (measured or modeled)
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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moectl.placement.placement import Placement, PlacementError, balancedness
from moectl.placement.rebalancer import Balance, RebalancePlan, pack
from moectl.placement.replica_policy import counts_of, layer_work, slots_work
from moectl.placement.step_time import COEFFICIENTS, ExpertCostModel
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
    link_s_per_remote_row: float = 0.0  # measured or modeled link seconds per entry the busiest device's links carry
    copy_s: float = 0.0  # seconds one expert copy stalls the engine (bytes over the migration bandwidth)
    horizon_steps: int = 64  # steps the migration's stall is spread over
    # the backend's own model of the link under a placement (mean seconds a step over the window),
    # where it has one beyond the entries the busiest device carries (a simulator's network
    # model): the plan's final pricing scales the link time by its ratio; the search does not call it
    link_model: Callable[[Placement], float] | None = None
    # likewise the backend's model of a migration's stall (seconds, from one placement to another)
    # where copies run in parallel, not one after another at copy_s each
    stall_model: Callable[[Placement, Placement], float] | None = None

    def prices(self, slots: np.ndarray, loads: np.ndarray, new_copies: np.ndarray, tie_break: float = 0.0) -> np.ndarray:
        """Predicted seconds per step of C layer candidates at once: [C, D, K] slots, [S, C, E]
        per-step loads (each candidate's layer's), [C] new expert copies.
        tie_break weighs the devices' mean busy time too (the search's plateaus: a step is as slow
        as its slowest device, so work taken off another one alone gains nothing)."""
        rows, active, remote = slots_work(slots, loads, self.policy)  # [S, C, D], [S, C]
        busy = self.model.predict(rows, active)
        replicated = _replicated(slots)  # [C]: the layer routes through the replica rule
        routing = np.where(replicated, self.model.routing_s(loads.sum(2)).mean(0), 0.0)
        return (busy.max(2).mean(0) + tie_break * busy.mean((0, 2)) + routing
                + self.link_s_per_remote_row * remote.mean(0) + self.copy_s * np.asarray(new_copies) / self.horizon_steps)


def _replicated(slots: np.ndarray) -> np.ndarray:
    """[C] whether each of [C, D, K] slots holds some expert twice."""
    ordered = np.sort(slots.reshape(len(slots), -1), axis=1)
    return ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1)


def _placed_everywhere(slots: np.ndarray, num_experts: int) -> np.ndarray:
    """[C] whether each of [C, D, K] slots keeps every expert somewhere."""
    flat = slots.reshape(len(slots), -1)
    held = np.bincount((np.arange(len(slots))[:, None] * (num_experts + 1) + flat + 1).ravel(),
                       minlength=len(slots) * (num_experts + 1)).reshape(len(slots), num_experts + 1)
    return (held[:, 1:] > 0).all(1)


def _new_copies(slots: np.ndarray, original: np.ndarray) -> np.ndarray:
    """[C] experts each of [C, D, K] slots puts on a device that does not hold them in `original`
    ([C, D, K], or [1, D, K] for candidates of one layer): the copies a migration makes."""
    width = int(max(slots.max(), original.max())) + 2  # experts, and the empty slot (-1) as the last
    have = np.zeros((len(original), original.shape[1], width), dtype=bool)
    have[np.arange(len(original))[:, None, None], np.arange(original.shape[1])[None, :, None], original] = True
    ordered = np.sort(slots, axis=2)  # an expert twice on one device is one copy
    first = np.ones(ordered.shape, dtype=bool)
    first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    which = np.arange(len(slots)) if len(original) == len(slots) else np.zeros(len(slots), dtype=np.int64)
    held = have[which[:, None, None], np.arange(slots.shape[1])[None, :, None], ordered]
    return ((ordered >= 0) & first & ~held).sum((1, 2))


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
    coef = dict(zip(COEFFICIENTS, model.coefficients()))
    mean = step_loads.mean(0)
    rows_per_call = mean.sum(1, keepdims=True) / devices  # [L, 1] a device's rows in a balanced step
    grouped = model.switch_rows is None or rows_per_call >= model.switch_rows
    per_row = np.where(grouped, coef["per_row_s"], coef["per_row_loop_s"])
    per_expert = np.where(grouped, coef["per_expert_s"], coef["per_expert_loop_s"])
    return per_expert * (step_loads > 0).mean(0) + per_row * mean


FINISH_SHARE = 0.2  # of a deadline, kept for pricing the plan's migration and balance once the search stops


def plan_step_time(step_loads, current: Placement, topology: Topology, cost: StepCost, moe_layers: list[int],
                   expert_bytes: int = 0, deadline_s: float | None = None) -> RebalancePlan:
    """The placement, keeping `current`'s slot count, that minimises the predicted step time for
    these per-step [S, L, E] loads; layers no move improves stay as they are.

    Per layer the start is the best of the layer as it is, a packing of the cost model's
    per-expert weights (rebalancer.py's packer, replicas in the spare slots) and the layer
    without replicas, each priced on the search steps with its migration (all layers at once).
    The local search then gives each layer one move per pass, the layers with the most predicted
    time first, so a deadline cuts the search evenly rather than leaving the last layers
    unsearched; `deadline_s` bounds the whole plan (FINISH_SHARE of it is kept for the finish)."""
    t0 = time.perf_counter()
    stop_at = None if deadline_s is None else t0 + deadline_s * (1 - FINISH_SHARE)
    loads = np.asarray(step_loads, dtype=np.float64)
    if loads.ndim != 3 or loads.shape[1:] != (current.num_layers, current.num_experts):
        raise PlacementError(f"loads: expected per-step [steps, {current.num_layers}, {current.num_experts}], "
                             f"got {list(loads.shape)}")
    if not loads.any():
        raise PlacementError("rebalance: no routing observed yet")
    D, K, E = current.num_devices, current.slots_per_device, current.num_experts
    spare = K - -(-E // D)
    totals = loads.sum(0)
    weights = cost_weights(loads, cost.model, D)
    seeds = [pack(weights, topology, current)]
    if spare:
        seeds.append(_without_replicas(current.slots))
    layers = np.asarray(moe_layers, dtype=np.int64)
    picked = loads[search_steps(loads)][:, layers]  # [S', M, E]
    pinned = [{e for (l, e) in current.pinned if l == layer} for layer in layers]
    slots = current.slots.copy()
    original = slots[layers]  # [M, D, K]
    best = original.copy()
    value = cost.prices(original, picked, np.zeros(len(layers)), TIE_BREAK)
    for seed in seeds:
        candidate = seed[layers]
        priced = cost.prices(candidate, picked, _new_copies(candidate, original), TIE_BREAK)
        usable = _placed_everywhere(candidate, E) & np.array([not _moves_pinned(b, a, p) for b, a, p in
                                                               zip(original, candidate, pinned)], dtype=bool)
        better = usable & (priced < value - MIN_GAIN_S)
        best[better], value[better] = candidate[better], priced[better]
    searching = list(np.argsort(-value, kind="stable"))  # the layers with the most time first
    moves = np.zeros(len(layers), dtype=np.int64)
    while searching and (stop_at is None or time.perf_counter() < stop_at):
        for i in list(searching):
            if stop_at is not None and time.perf_counter() > stop_at:
                break
            found = _improve(best[i], value[i], picked[:, i], cost, pinned[i], original[i:i + 1])
            moves[i] += 1
            if found is None or moves[i] >= 4 * best[i].size:
                searching.remove(i)
            if found is not None:
                best[i], value[i] = found
    slots[layers] = best
    kept = int((slots == current.slots).all((1, 2)).sum())
    plan = Placement(slots, E, current.pinned)
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
    return slots_work(placement._slots, totals[None], policy)[0][0]


def _improve(slots: np.ndarray, value: float, loads: np.ndarray, cost: StepCost, pinned: set[int],
             original: np.ndarray) -> tuple[np.ndarray, float] | None:
    """One round of the local search on a layer's [D, K] slots over [S, E] search-step loads:
    the best of its candidate moves, priced together, if it gains; else None."""
    hot, work = _critical_device(slots, loads, cost)
    candidates = _swaps(slots, loads, cost, pinned, hot, work) + _replica_moves(slots, loads, work["busy"], pinned)
    if not candidates:
        return None
    candidates = np.stack(candidates)
    shared = np.broadcast_to(loads[:, None], (loads.shape[0], len(candidates), loads.shape[1]))
    priced = cost.prices(candidates, shared, _new_copies(candidates, original), TIE_BREAK)
    priced[~_placed_everywhere(candidates, loads.shape[1])] = np.inf  # every expert keeps a replica
    i = int(np.argmin(priced))
    return (candidates[i], float(priced[i])) if priced[i] < value - MIN_GAIN_S else None


def _moves_pinned(before: np.ndarray, after: np.ndarray, pinned: set[int]) -> bool:
    """Whether `after` takes a pinned expert off a device that holds it in `before`."""
    return any((before == e).any(1)[(after == e).any(1) == 0].any() for e in pinned)


def _critical_device(slots: np.ndarray, loads: np.ndarray, cost: StepCost) -> tuple[int, dict]:
    """The device that is slowest in most search steps, and the layer's work under `slots`."""
    held = counts_of(slots, loads.shape[1])
    rows, active, _ = layer_work(slots, loads, cost.policy)
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
