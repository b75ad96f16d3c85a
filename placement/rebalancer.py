"""Expert-parallel load balancer (the class of DeepSeek's EPLB), migration-aware.

plan_rebalance(loads [L, E], topology, R per device) -> a Placement with S = ceil(E/D) + R slots
per device that keeps the busiest device of each layer as light as it can:

1. replicate: every free slot goes to the expert with the highest load per replica (an expert
   never gets more replicas than devices: two on one device do no good);
2. pack: replicas, heaviest first, go to the least-loaded bin with a free slot (LPT with equal
   slot counts), never next to another replica of their expert when avoidable; with several
   nodes, first into nodes and then into the devices of each node. A replica stays on a bin
   that holds its expert now if that bin is within a small slack of the least loaded;
3. relabel and refine: bins are matched to the current nodes/devices they overlap most (greedy
   on overlap counts), then a swap search evens out what greedy packing left;
4. choose per layer among the current placement, a swap repair of it, the packing above and a
   fresh packing without the stay-put preference: of those within `tolerance` of the best
   balance, the one that moves fewest experts. Experts a device keeps stay in their slots, so
   re-planning unchanged loads moves nothing.

Every step runs vectorised over layers (numpy), looping only over replicas, bins and swaps.
Pinned experts keep their current devices (and slots) and are neither replicated nor dropped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moectl.placement.placement import Move, Placement, PlacementError, _count, as_loads, balancedness
from moectl.placement.topology import Topology

# how much above the least-loaded bin an item may land to stay where it is, as a fraction of the
# ideal bin load; the swap search after packing takes most of it back (see _pack)
_HOME_SLACK = 0.05

# bytes of one DeepSeek-V3 routed expert in FP8: 3 matrices of 7168 x 2048
DEFAULT_EXPERT_BYTES = 3 * 7168 * 2048


class RebalanceError(PlacementError):
    """A rebalance request refused; the one-line message names the bad value."""


@dataclass(frozen=True)
class Balance:
    per_layer: np.ndarray
    overall: float

    def to_dict(self) -> dict:
        return {"overall": self.overall, "per_layer": self.per_layer.tolist()}


@dataclass
class RebalancePlan:
    placement: Placement
    balancedness_before: Balance  # of `current` (or the contiguous placement) under the loads
    balancedness_after: Balance
    bytes_moved: int
    move_array: np.ndarray  # [M, 5] int64 rows of Move fields
    seconds: float  # wall time of planning (perf_counter), the move array included
    layers_kept: int = 0  # layers left exactly as they were (already balanced within tolerance)
    bytes_local: int = 0  # the migration's copies within a device (Placement.local_copies), in bytes
    prediction: dict | None = None  # predicted step time and throughput before/after (step_time.py), when known

    @property
    def moves(self) -> list[Move]:
        """The moves as Move tuples (built on first use: 10^4 tuples cost more than the plan)."""
        if not hasattr(self, "_moves"):
            self._moves = [Move(*r) for r in self.move_array.tolist()]
        return self._moves

    def summary(self) -> dict:
        return {"balancedness_before": self.balancedness_before.overall,
                "balancedness_after": self.balancedness_after.overall,
                "bytes_moved": self.bytes_moved, "bytes_local": self.bytes_local, "moves": len(self.move_array),
                "layers_kept": self.layers_kept, "seconds": self.seconds,
                **({"predicted": self.prediction} if self.prediction is not None else {})}


def plan_rebalance(loads, topology: Topology | int, redundant_per_device: int,
                   current: Placement | None = None, expert_bytes: int = 0,
                   hbm_budget_bytes: int | None = None, pinned=None,
                   tolerance: float = 0.01, target: float | None = None) -> RebalancePlan:
    """Plan a placement with `redundant_per_device` extra slots per device for these loads.

    loads: [L, E] expert loads over a window (token counts; any non-negative scale).
    topology: a Topology or a device count (one node). current: the placement now in force
      (default: contiguous); moves and bytes are counted from it.
    tolerance: plans whose busiest device (per layer) differs by at most this fraction count as
      equally balanced, and of those the one that moves fewer bytes wins: the current layer as
      it is, then a packing that leaves replicas in place, then a fresh packing.
    pinned: (layer, expert) pairs kept where `current` has them, besides current.pinned.
    target: with `current`, move only as much as reaching this overall balancedness takes:
      swaps of the experts in force, keeping their replicas (`repair_to_target`); when swaps
      cannot reach it, the plan is the usual one. None: the best balance within tolerance.
    Refuses (RebalanceError) bad input and plans whose experts overflow hbm_budget_bytes.
    """
    t0 = time.perf_counter()
    W = as_loads(loads)
    L, E = W.shape
    if isinstance(topology, Topology):
        D, dpn = topology.num_devices, topology.devices_per_node
    else:
        D = _count(topology, "devices", 1)
        dpn = D
    R = _count(redundant_per_device, "redundant_per_device", 0)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise RebalanceError(f"tolerance: must be a non-negative number, got {tolerance!r}")
    expert_bytes = _count(expert_bytes, "expert_bytes", 0)
    if hbm_budget_bytes is not None:
        hbm_budget_bytes = _count(hbm_budget_bytes, "hbm_budget_bytes", 0)
    S = -(-E // D) + R
    given_current = current is not None
    if current is None:
        current = Placement.contiguous(L, E, D)
    elif not isinstance(current, Placement):
        raise RebalanceError("current: expected a Placement")
    elif (current.num_layers, current.num_experts, current.num_devices) != (L, E, D):
        raise RebalanceError(f"current: placement is [{current.num_layers} layers, {current.num_experts} experts, "
                             f"{current.num_devices} devices], loads/topology are [{L}, {E}, {D}]")
    pins = set(current.pinned)
    for item in pinned or ():
        try:
            layer, expert = item
        except (TypeError, ValueError):
            raise RebalanceError(f"pinned: {item!r} is not a (layer, expert) pair") from None
        pins.add(current._check(layer, expert))
    pin_mask = np.zeros((L, E), dtype=bool)
    if pins:
        pl, pe = np.array(sorted(pins)).T
        pin_mask[pl, pe] = True
    cur = _resize(current.slots, S, pin_mask)
    hierarchical = D // dpn > 1 and D % dpn == 0
    K = dpn if hierarchical else D
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not 0 < target <= 1):
        raise RebalanceError(f"target: must be a balancedness in (0, 1], got {target!r}")
    repaired = _repair(W, cur, E, pin_mask, target) if target is not None and given_current else None
    if repaired is not None:
        new, after_loads, kept = repaired
    else:
        new, after_loads, kept = _plan_slots(W, cur, E, K, pin_mask, tolerance)
    before_loads = current.device_loads(W)
    plan = Placement(new, E, pins)
    try:
        plan.check_hbm(expert_bytes, hbm_budget_bytes)
    except PlacementError as exc:
        raise RebalanceError(str(exc)) from None
    migration = current.migration(plan, dpn if hierarchical else None)  # once: the moves and the local copies
    over_link = migration[:, 6] == 1
    moves = migration[over_link][:, [0, 1, 2, 4, 5]]
    b_per, b_all = balancedness(before_loads)
    a_per, a_all = balancedness(after_loads)
    return RebalancePlan(plan, Balance(b_per, b_all), Balance(a_per, a_all), len(moves) * expert_bytes, moves,
                         time.perf_counter() - t0, kept, int((~over_link).sum()) * expert_bytes)


def pack(loads, topology: Topology, current: Placement) -> np.ndarray:
    """[L, D, S] slots for [L, E] loads in `current`'s slot count: the packer alone (replicas in
    the spare slots by load per replica, packed through nodes, bins relabelled to the devices in
    force, pinned experts kept, the swap search), with none of plan_rebalance's choice among
    candidates, migration or balance figures: a seed for a planner that prices placements itself."""
    W = as_loads(loads)
    L, E = W.shape
    D, dpn, S = current.num_devices, topology.devices_per_node, current.slots_per_device
    pin_mask = np.zeros((L, E), dtype=bool)
    if current.pinned:
        pl, pe = np.array(sorted(current.pinned)).T
        pin_mask[pl, pe] = True
    cur = current.slots
    K = dpn if D // dpn > 1 and D % dpn == 0 else D
    pinned_slot = (cur >= 0) & pin_mask[np.arange(L)[:, None, None], np.maximum(cur, 0)]
    counts = np.where(pin_mask, _counts(cur, E), _replicate(W, pin_mask, D * S - pinned_slot.sum((1, 2)), D, D * S))
    share = np.concatenate([W / np.maximum(counts, 1), np.zeros((L, 1))], axis=1)
    return _stable_slots(_assign(W, counts, share, cur, pin_mask, pinned_slot, K, sticky=True), cur)


def preview_plan(loads, topology: Topology, current: Placement, *, expert_bytes: int = 0,
                 redundant: int | None = None, target: float | None = None, predict=None) -> RebalancePlan:
    """The rebalance preview every front end shows (live, simulated and replayed engines): a plan
    for the window's loads from the placement in force, keeping its slot count unless `redundant`
    spare slots per device are asked for, with `predict(new_placement)` (a dict, or None where the
    caller has no model to price it with) as its prediction. Nothing changes."""
    W = np.asarray(loads)
    if not W.any():
        raise PlacementError("rebalance: no routing observed yet")
    if redundant is None:
        redundant = current.slots_per_device - -(-current.num_experts // topology.num_devices)
    plan = plan_rebalance(W, topology, redundant, current=current, expert_bytes=expert_bytes, target=target)
    plan.prediction = predict(plan.placement) if predict is not None else None
    return plan


def _repair(W: np.ndarray, cur: np.ndarray, E: int, pin_mask: np.ndarray, target: float):
    """repair_to_target on the placement in force -> (slots, device loads, layers kept), or None."""
    L = cur.shape[0]
    li = np.arange(L)[:, None, None]
    counts = _counts(cur, E)
    if not (counts > 0).all():  # narrowing cut an expert's last replica: it has to be placed again
        return None
    share = np.concatenate([W / np.maximum(counts, 1), np.zeros((L, 1))], axis=1)
    movable = (cur < 0) | ~pin_mask[li, np.maximum(cur, 0)]
    new = repair_to_target(cur, share, movable, target)
    if new is None:
        return None
    new = _stable_slots(new, cur)
    return new, share[li, new].sum(2), int((new == cur).all((1, 2)).sum())


def _resize(slots: np.ndarray, S: int, pin_mask: np.ndarray) -> np.ndarray:
    """The current slots widened (empty slots) or narrowed to S per device. Narrowing first moves
    pinned experts to the front of their device (a local copy, they stay on the device), then
    drops the last slots."""
    L, D, S0 = slots.shape
    if S0 < S:
        return np.concatenate([slots, np.full((L, D, S - S0), -1, dtype=np.int64)], axis=2)
    pinned = (slots >= 0) & pin_mask[np.arange(L)[:, None, None], np.maximum(slots, 0)]
    over = pinned.sum(2) > S
    if over.any():
        layer, device = np.argwhere(over)[0]
        raise RebalanceError(f"device {device} holds {int(pinned[layer, device].sum())} pinned experts in layer "
                             f"{layer}, more than the planned {S} slots per device")
    if (pinned[:, :, S:]).any():
        slots = np.take_along_axis(slots, np.argsort(~pinned, axis=2, kind="stable"), 2)
    return slots[:, :, :S].copy()


def _plan_slots(W: np.ndarray, cur: np.ndarray, E: int, K: int, pin_mask: np.ndarray,
                tolerance: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Steps 1-4 of the module doc -> ([L, D, S] slots, [L, D] device loads, layers kept).

    Per layer up to four candidates: the current placement as it is; a repair of it by swaps
    (same replicas); a packing that prefers to leave replicas where they are; a fresh packing
    (only where the previous one is not provably within `tolerance` of the best possible,
    max(mean device load, heaviest replica)). Of those whose busiest device is within
    `tolerance` of the best candidate's, the one with the fewest arrivals wins."""
    L, D, S = cur.shape
    layers = np.arange(L)
    li = layers[:, None, None]
    cur_counts = _counts(cur, E)
    # pinned replicas: fixed slots, with their share of the load, at their current device
    pinned_slot = (cur >= 0) & pin_mask[li, np.maximum(cur, 0)]
    counts = _replicate(W, pin_mask, D * S - pinned_slot.sum((1, 2)), D, D * S)
    counts = np.where(pin_mask, cur_counts, counts)
    # per-replica load, with a zero column for empty slots (index -1)
    share = np.concatenate([W / np.maximum(counts, 1), np.zeros((L, 1))], axis=1)
    cur_share = np.concatenate([W / np.maximum(cur_counts, 1), np.zeros((L, 1))], axis=1)
    cur_whole = (cur_counts > 0).all(1)  # narrowing may have cut an expert's last replica
    held = np.zeros((L, D, E + 1), dtype=bool)  # column 0: empty slots
    held[li, np.arange(D)[None, :, None], cur + 1] = True

    cands, peaks = [], []  # per candidate: (slots, the layers it covers); [L] busiest device load

    def add(slots, rows, table):
        full = np.full(L, np.inf)
        full[rows] = table[rows[:, None, None], slots].sum(2).max(1)
        cands.append((slots, rows))
        peaks.append(full)

    add(cur[cur_whole], layers[cur_whole], cur_share)
    sticky = _assign(W, counts, share, cur, pin_mask, pinned_slot, K, sticky=True)
    add(sticky, layers, share)
    best_possible = np.maximum(W.sum(1) / D, np.where(counts > 0, share[:, :E], 0).max(1))
    redo = layers[peaks[1] > best_possible * (1 + tolerance)]
    if redo.size:
        add(_assign(W[redo], counts[redo], share[redo], cur[redo], pin_mask[redo], pinned_slot[redo], K,
                    sticky=False), redo, share)
    # repair only a current that is near the plan's balance: swaps fix small drifts, not layouts
    fixable = layers[cur_whole & (peaks[0] <= np.minimum(peaks[1], peaks[-1]) * 1.25)
                     & (peaks[0] > np.minimum(peaks[1], peaks[-1]) * (1 + tolerance))]
    if fixable.size:
        c = cur[fixable]
        movable = (c < 0) | ~pin_mask[fixable[:, None, None], np.maximum(c, 0)]
        add(_refine(c, cur_share[fixable[:, None, None], c], movable), fixable, cur_share)

    peaks = np.stack(peaks)  # [C, L]
    arrivals = np.full(peaks.shape, np.iinfo(np.int64).max)
    for i, (slots, rows) in enumerate(cands):
        arrivals[i, rows] = ((slots >= 0) & ~held[rows[:, None, None], np.arange(D)[None, :, None], slots + 1]).sum((1, 2))
    eligible = peaks <= peaks.min(0) * (1 + tolerance)
    choice = np.where(eligible, arrivals, np.iinfo(np.int64).max).argmin(0)  # ties: the earlier candidate
    out = np.empty_like(cur)
    for i, (slots, rows) in enumerate(cands):
        pick = choice[rows] == i
        out[rows[pick]] = slots[pick]
    out = _stable_slots(out, cur)
    final_share = np.concatenate([W / np.maximum(_counts(out, E), 1), np.zeros((L, 1))], axis=1)
    return out, final_share[li, out].sum(2), int((choice == 0).sum())


def _counts(slots: np.ndarray, E: int) -> np.ndarray:
    """[L, E] replicas of each expert in [L, D, S] slots."""
    L = slots.shape[0]
    key = (np.arange(L)[:, None] * (E + 1) + slots.reshape(L, -1) + 1).ravel()
    return np.bincount(key, minlength=L * (E + 1)).reshape(L, E + 1)[:, 1:]


def _assign(W, counts, share, cur, pin_mask, pinned_slot, K: int, sticky: bool) -> np.ndarray:
    """Pack the replicas of each layer into devices (through nodes of K devices when D > K),
    relabel bins to current devices, put pinned replicas back and run the swap search."""
    L, D, S = cur.shape
    E = W.shape[1]
    N = D // K
    layer_ix = np.arange(L)[:, None, None]
    fixed_count = pinned_slot.sum(2)
    fixed_load = np.where(pinned_slot, share[layer_ix, cur], 0.0).sum(2)
    weight, expert, valid = _items(W, np.where(pin_mask, 0, counts))
    cl, ct, cs = np.nonzero(cur >= 0)  # the occupied current slots: where experts are now
    ce = cur[cl, ct, cs]

    if N > 1:
        node_fixed_count = fixed_count.reshape(L, N, K).sum(2)
        pairs = _homes(expert, valid, E, cl, ct // K, ce)
        node = _pack(weight, expert, valid, fixed_load.reshape(L, N, K).sum(2), K * S - node_fixed_count,
                     cap_same=K, home=_home_counts(pairs, expert.shape, N) if sticky else None)
        node = _relabel(node, pairs, node_fixed_count > 0)
        # regroup the items per (layer, node), keeping heaviest-first order inside each node
        weight, expert, valid = _split_by_bin(node, weight, expert, valid, N)  # [L*N, T']
    pairs = _homes(expert, valid, E, cl * N + ct // K, ct % K, ce)
    dev = _pack(weight, expert, valid, fixed_load.reshape(L * N, K), S - fixed_count.reshape(L * N, K),
                cap_same=1, home=_home_counts(pairs, expert.shape, K) if sticky else None)
    dev = _relabel(dev, pairs, fixed_count.reshape(L * N, K) > 0)

    # scatter the items into [L*N, K, S] slots behind the pinned ones
    rows = np.broadcast_to(np.arange(L * N)[:, None], dev.shape)[valid]
    bins = dev[valid]
    new = np.full((L * N, K, S), -1, dtype=np.int64)
    key = rows * K + bins
    order = np.argsort(key, kind="stable")
    key_sorted = key[order]
    pos = np.empty_like(key)
    pos[order] = np.arange(key.size) - np.searchsorted(key_sorted, key_sorted, side="left")
    pos += fixed_count.reshape(L * N, K)[rows, bins]
    new[rows, bins, pos] = expert[valid]
    new = new.reshape(L, D, S)
    pinned_cols = np.argsort(~pinned_slot, axis=2, kind="stable")  # pinned experts first
    pinned_vals = np.where(pinned_slot, cur, -1)[layer_ix, np.arange(D)[None, :, None], pinned_cols]
    new = np.where(np.arange(S) < fixed_count[..., None], pinned_vals, new)
    movable = (new < 0) | ~pin_mask[layer_ix, np.maximum(new, 0)]
    return _refine(new, share[layer_ix, new], movable)


def _replicate(W: np.ndarray, pin_mask: np.ndarray, free: np.ndarray, D: int, slots: int) -> np.ndarray:
    """[L, E] replica counts: one per unpinned expert, then each free slot to the expert with the
    highest load per replica (experts with no load get none). Pinned experts count 0 here."""
    L, E = W.shape
    counts = (~pin_mask).astype(np.int64)
    extra = free - counts.sum(1)
    if (extra < 0).any():
        layer = int(np.argmax(extra < 0))
        need = int(counts[layer].sum()) + slots - int(free[layer])
        raise RebalanceError(f"layer {layer}: {int(counts[layer].sum())} unpinned experts + {slots - int(free[layer])} "
                             f"pinned replicas need {need} slots, the plan has {slots}")
    score = np.where(pin_mask | (counts >= D), -1.0, W)
    rows = np.arange(L)
    for step in range(int(extra.max(initial=0))):
        best = score.argmax(1)
        top = score[rows, best]
        go = (step < extra) & (top > 0)
        if not go.any():
            break
        r, e = rows[go], best[go]
        counts[r, e] += 1
        score[r, e] = np.where(counts[r, e] >= D, -1.0, W[r, e] / counts[r, e])
    return counts


def _items(W: np.ndarray, counts: np.ndarray):
    """Replicas as items per layer, heaviest first (replicas of an expert adjacent):
    weight [L, T], expert [L, T], valid [L, T] (rows padded to the longest)."""
    L, E = W.shape
    share = W / np.maximum(counts, 1)
    # sort experts by share, descending, then lay out each expert's replicas in that order
    order = np.argsort(-share, axis=1, kind="stable")
    c_sorted = np.take_along_axis(counts, order, 1)
    total = counts.sum(1)
    T = int(total.max(initial=0))
    flat_src = np.repeat((np.arange(L)[:, None] * E + order).ravel(), c_sorted.ravel())
    row = flat_src // E
    pos = np.arange(flat_src.size) - np.repeat(np.cumsum(total) - total, total)
    expert = np.full((L, T), -1, dtype=np.int64)
    weight = np.zeros((L, T))
    expert[row, pos] = flat_src % E
    weight[row, pos] = share.ravel()[flat_src]
    return weight, expert, expert >= 0


def _pack(weight: np.ndarray, expert: np.ndarray, valid: np.ndarray, load0: np.ndarray,
          free0: np.ndarray, cap_same: int, home: np.ndarray | None = None) -> np.ndarray:
    """Greedy LPT over B independent rows: item j (heaviest first) goes to the least-loaded bin
    with a free slot, avoiding bins that already hold cap_same replicas of its expert when
    another bin has room. -> [B, T] bin per item (-1 for padding).

    home [B, T, K]: replicas of the item's expert each bin holds now. An item stays in such a
    bin when the bin's load is within _HOME_SLACK x the row's ideal bin load of the least
    loaded: nearly the LPT choice, and one that moves nothing."""
    B, T = weight.shape
    K = free0.shape[1]
    # flat [B*K] state, indexed by row*K + bin: 1-D fancy indexing is the cheapest per step.
    # cost = load, +inf once the bin is full; pen = +big (keeping the load order) while the bin
    # is at the cap of the current expert's replicas
    free = free0.astype(np.int64).ravel().copy()
    cost = np.where(free > 0, load0.astype(np.float64).ravel(), np.inf)
    big = np.repeat(2.0 * (weight.sum(1) + load0.sum(1)) + 1.0, K)
    pen = np.zeros(B * K)
    run = np.zeros(B * K, dtype=np.int64)  # replicas of the current expert per bin
    # column-major copies: one contiguous column per step
    w_cols = np.ascontiguousarray((weight * valid).T)
    inc_cols = np.ascontiguousarray(valid.T.astype(np.int64))
    keep_run = np.ones((T, B * K), dtype=np.int64)  # 0 where a new expert's run starts
    keep_run[1:] = np.repeat(expert[:, 1:] == expert[:, :-1], K, axis=0).T
    out = np.empty((T, B), dtype=np.int64)
    base = np.arange(B) * K
    if home is not None:
        home_cols = np.ascontiguousarray(home.transpose(1, 0, 2)).reshape(T, B * K)
        ideal = ((weight * valid).sum(1) + load0.sum(1)) / K
        ideal = np.maximum(ideal, np.where(valid, weight, 0).max(1, initial=0))
        slack = _HOME_SLACK * ideal[:, None]
    rows_k = np.arange(B)[:, None]
    for j in range(T):
        kr = keep_run[j]
        run *= kr
        pen *= kr
        c = (cost + pen).reshape(B, K)
        b = c.argmin(1)
        if home is not None:
            # bins that hold a replica not yet claimed by this run, close enough to the least loaded
            stay = (run < home_cols[j]).reshape(B, K)
            stay &= c <= c[rows_k, b[:, None]] + slack
            b = np.where(stay.any(1), np.where(stay, c, np.inf).argmin(1), b)
        idx = base + b
        inc = inc_cols[j]
        left = free[idx] - inc
        free[idx] = left
        cost[idx] = np.where(left > 0, cost[idx] + w_cols[j], np.inf)
        if cap_same == 1:  # the common device-level case: a bin that got a replica is capped
            run[idx] += inc
            pen[idx] = big[idx] * inc
        else:
            placed = run[idx] + inc
            run[idx] = placed
            pen[idx] = np.where(placed >= cap_same, big[idx], 0.0)
        out[j] = b
    return np.where(valid, out.T, -1)


def _best_swaps(r: np.ndarray, new: np.ndarray, weight: np.ndarray, movable: np.ndarray, load: np.ndarray, P: int):
    """For layers r: the best swap of one item (or empty slot) of the busiest device with one of
    the P lightest devices' (keeping replicas of an expert on different devices). Returns
    (busiest device, partner device, slot on the busiest, slot on the partner, the busier of the
    two after the swap), or inf there when no swap lowers the busiest."""
    S = new.shape[2]
    m = load[r].argmax(1)
    light = np.argpartition(load[r], P, axis=1)[:, :P]  # [R, P] the P lightest devices
    a, ea, am = weight[r, m], new[r, m], movable[r, m]  # [R, S] the busiest device's slots
    rp = r[:, None]
    b, eb, bm = weight[rp, light], new[rp, light], movable[rp, light]  # [R, P, S]
    delta = a[:, :, None, None] - b[:, None]  # [R, S(a), P, S(b)] load moved off the busiest
    lm = load[r, m][:, None, None, None]
    after = np.maximum(lm - delta, load[rp, light][:, None, :, None] + delta)
    # a's expert must not already be on the partner, nor b's on the busiest (empties are free)
    a_there = ((ea[:, :, None, None] == eb[:, None, :, :]).any(3) & (ea >= 0)[:, :, None])  # [R, S, P]
    b_there = ((eb[:, :, :, None] == ea[:, None, None, :]).any(3) & (eb >= 0))  # [R, P, S]
    ok = (delta > 0) & am[:, :, None, None] & bm[:, None] & ~a_there[..., None] & ~b_there[:, None]
    cost = np.where(ok, after, np.inf).reshape(r.size, -1)
    best = cost.argmin(1)
    pair_max = cost[np.arange(r.size), best]
    pair_max = np.where(pair_max < load[r, m] * (1 - 1e-9), pair_max, np.inf)
    sa, rest = np.divmod(best, P * S)
    p, sb = np.divmod(rest, S)
    return m, light[np.arange(r.size), p], sa, sb, pair_max


def _swap(arrays, r, m, d, sa, sb) -> None:
    for arr in arrays:
        arr[r, m, sa], arr[r, d, sb] = arr[r, d, sb], arr[r, m, sa].copy()


def _refine(new: np.ndarray, weight: np.ndarray, movable: np.ndarray, partners: int = 4,
            max_steps: int = 64, good_enough: float = 1e-3) -> np.ndarray:
    """Local search after the greedy packing, all layers at once: swap one item (or an empty
    slot) of the busiest device with one of a few of the lightest devices when that lowers the
    busier of the two, keeping replicas of an expert on different devices. LPT with equal slot
    counts leaves some devices with two big replicas; a few swaps fix most of that. A layer
    stops when its busiest device is within `good_enough` of the lower bound (mean load or
    heaviest replica), or when no swap helps."""
    new, weight, movable = new.copy(), weight.copy(), movable.copy()
    L, D, S = new.shape
    P = min(partners, D - 1)
    if P < 1:
        return new
    load = weight.sum(2)
    bound = np.maximum(load.mean(1), weight.max((1, 2))) * (1 + good_enough)
    rows = np.arange(L)
    active = load.max(1) > bound
    for _ in range(max_steps):
        r = rows[active]
        if r.size == 0:
            break
        m, d, sa, sb, pair_max = _best_swaps(r, new, weight, movable, load, P)
        better = np.isfinite(pair_max)
        active[r[~better]] = False
        if not better.any():
            break
        r, m, d, sa, sb = r[better], m[better], d[better], sa[better], sb[better]
        _swap((new, weight, movable), r, m, d, sa, sb)
        load[r, m] = weight[r, m].sum(1)
        load[r, d] = weight[r, d].sum(1)
        active[r] = load[r].max(1) > bound[r]
    return new


def repair_to_target(slots: np.ndarray, share: np.ndarray, movable: np.ndarray, target: float,
                     partners: int = 8) -> np.ndarray | None:
    """Swaps from `slots` (the placement in force, its replicas kept; share [L, E + 1]: each
    expert's load per replica, 0 for an empty slot) that bring the overall balancedness (sum of
    layer means / sum of layer maxima) to `target` while moving as little as this search can:
    every layer is swapped down to a common per-layer bound, the lowest bound (found by bisection)
    whose result still meets the target overall. None when even a bound at the target misses it
    (a layer no swap can even out: the caller then packs afresh)."""
    L = slots.shape[0]
    li = np.arange(L)[:, None, None]
    weight = share[li, slots]
    mean_sum = weight.sum(2).mean(1).sum()
    if mean_sum >= target * weight.sum(2).max(1).sum():
        return slots.copy()  # already there: nothing to move

    def attempt(bound: float):
        new = _refine(slots, weight, movable, partners=partners, max_steps=1024, good_enough=1 / bound - 1)
        return new, mean_sum / share[li, new].sum(2).max(1).sum()

    best, reached = attempt(target)
    if reached < target:
        return None
    lo, hi = target - 0.02, target
    for _ in range(6):
        mid = (lo + hi) / 2
        new, reached = attempt(mid)
        if reached >= target:
            hi = mid
            if (new != slots).sum() < (best != slots).sum():
                best = new
        else:
            lo = mid
    return best


def _homes(expert: np.ndarray, valid: np.ndarray, E: int, cur_row: np.ndarray, cur_target: np.ndarray,
           cur_expert: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Join items [B, T] with the occupied current slots (one entry each: row, target, expert)
    on (row, expert): -> (flat item index, current target) for every pair. A sort and a bincount,
    O(slots + B*E), where a dense [B, T, K] comparison would not be."""
    B, T = expert.shape
    cur_key = cur_row * E + cur_expert
    order = np.argsort(cur_key, kind="stable")
    cur_target = cur_target[order]
    # a CSR index over (row, expert): where each key's current slots start, and how many
    n_of = np.bincount(cur_key, minlength=B * E)
    start_of = np.cumsum(n_of) - n_of
    flat = np.flatnonzero(valid)
    item_key = (flat // T) * E + expert.ravel()[flat]
    lo, n = start_of[item_key], n_of[item_key]
    match = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)
    return np.repeat(flat, n), cur_target[match]


def _home_counts(pairs, shape: tuple[int, int], K: int) -> np.ndarray:
    """[B, T, K] replicas of each item's expert that each target holds now."""
    item, target = pairs
    return np.bincount(item * K + target, minlength=shape[0] * shape[1] * K).reshape(*shape, K)


def _relabel(bins: np.ndarray, pairs, fixed: np.ndarray) -> np.ndarray:
    """Rename the interchangeable bins of each row to the current targets they overlap most.
    bins [B, T]: the new bin of each item (-1 padding); pairs: _homes(); fixed [B, K]: bins
    holding pinned replicas, which keep their own target."""
    B, K = fixed.shape
    T = bins.shape[1]
    item, target = pairs
    key = ((item // T) * K + bins.ravel()[item]) * K + target
    overlap = np.bincount(key, minlength=B * K * K).reshape(B, K, K).astype(np.float64)
    # pinned bins are matched to themselves first and nothing else may take their target
    eye = np.eye(K, dtype=bool)
    huge = 1e18
    overlap = np.where(fixed[:, :, None] & eye, huge, overlap)
    overlap = np.where((fixed[:, :, None] | fixed[:, None, :]) & ~eye, -huge, overlap)
    perm = _greedy_match(overlap)
    return np.where(bins >= 0, np.take_along_axis(perm, np.maximum(bins, 0), 1), -1)


def _greedy_match(score: np.ndarray) -> np.ndarray:
    """[B, K, K] scores -> [B, K] target per bin: repeatedly take the best remaining pair.
    Rows whose bins each prefer a distinct target are settled in one pass; the rest loop."""
    B, K, _ = score.shape
    best = score.argmax(2)
    distinct = np.sort(best, 1)
    clear = (np.diff(distinct, axis=1) != 0).all(1)
    perm = best.copy()
    todo = np.flatnonzero(~clear)
    if todo.size:
        s = score[todo].copy()
        r = np.arange(todo.size)
        out = np.empty((todo.size, K), dtype=np.int64)
        for _ in range(K):
            flat = s.reshape(todo.size, -1).argmax(1)
            b, t = flat // K, flat % K
            out[r, b] = t
            s[r, b, :] = -np.inf
            s[r, :, t] = -np.inf
        perm[todo] = out
    return perm


def _split_by_bin(bins: np.ndarray, weight: np.ndarray, expert: np.ndarray, valid: np.ndarray, N: int):
    """Regroup row items by their bin: [L, T] -> [L*N, T'] keeping each bin's item order."""
    L, T = bins.shape
    key = np.where(valid, np.arange(L)[:, None] * N + bins, L * N)  # padding sorts last
    order = np.argsort(key.ravel(), kind="stable")
    key_sorted = key.ravel()[order]
    keep = key_sorted < L * N
    order, key_sorted = order[keep], key_sorted[keep]
    sizes = np.bincount(key_sorted, minlength=L * N)
    Tn = int(sizes.max(initial=0))
    pos = np.arange(key_sorted.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    w = np.zeros((L * N, Tn))
    x = np.full((L * N, Tn), -1, dtype=np.int64)
    w[key_sorted, pos] = weight.ravel()[order]
    x[key_sorted, pos] = expert.ravel()[order]
    return w, x, x >= 0


def _stable_slots(new: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """Reorder each device's new slots so an expert it keeps stays in its current slot; the
    arrivals fill the freed slots in order. Duplicates are matched copy by copy."""
    L, D, S = new.shape
    R = L * D
    n, c = new.reshape(R, S), cur.reshape(R, S)
    # key = (expert, copy number) so the k-th copy on a device matches only the k-th copy
    nk = np.where(n >= 0, n * S + _occurrence(n), -1)
    ck = np.where(c >= 0, c * S + _occurrence(c), -2)
    match = nk[:, :, None] == ck[:, None, :]  # [R, new slot, current slot]
    c_keep = match.any(1)
    n_rest = ~match.any(2)  # arrivals (and empties)
    out = np.where(c_keep, c, -1)
    free_pos = np.argsort(c_keep, axis=1, kind="stable")  # free slots first, in slot order
    rest_val = np.take_along_axis(n, np.argsort(~n_rest, axis=1, kind="stable"), 1)  # arrivals first
    fill = np.arange(S)[None, :] < (~c_keep).sum(1, keepdims=True)
    rows = np.broadcast_to(np.arange(R)[:, None], (R, S))
    out[rows[fill], free_pos[fill]] = rest_val[fill]
    return out.reshape(L, D, S)


def _occurrence(x: np.ndarray) -> np.ndarray:
    """[R, S] -> how many earlier slots of the row hold the same value."""
    S = x.shape[1]
    same = x[:, :, None] == x[:, None, :]
    return (same & np.tri(S, S, -1, dtype=bool)[None]).sum(2)


# ---- when to rebalance, and over what window ---------------------------------------------


LOAD_WINDOW_STEPS = 64  # the one routing window: the planner's, the console's and /metrics' balancedness


class LoadWindow:
    """Per-layer, per-expert loads over recent steps: the mean of the last `size` steps, or an
    exponential moving average with weight `ema` on the newest step when ema is given; totals()
    is their sum. The one routing window: the cluster plans from it, and the console and the
    server's metrics keep one of the same size over the records they receive."""

    @classmethod
    def like(cls, routing, size: int = LOAD_WINDOW_STEPS) -> LoadWindow:
        """A window for step loads of this [layers, experts] shape."""
        rows, cols = np.shape(routing)
        return cls(rows, cols, size=size)

    def __init__(self, num_layers: int, num_experts: int, size: int = LOAD_WINDOW_STEPS, ema: float | None = None):
        self.shape = (_count(num_layers, "layers", 1), _count(num_experts, "experts", 1))
        self.size = _count(size, "size", 1)
        if ema is not None and (isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 < ema <= 1):
            raise RebalanceError(f"ema: must be in (0, 1], got {ema!r}")
        self.ema = ema
        self._ring = np.zeros((self.size, *self.shape))
        self._avg = np.zeros(self.shape)
        self._total = np.zeros(self.shape)  # the ring's sum, kept per step: one add and one subtract
        self.steps = 0

    def add(self, step_loads) -> None:
        """One step's [L, E] token counts (numpy, torch or lists)."""
        arr = as_loads(step_loads, "step loads")
        if arr.shape != self.shape:
            raise RebalanceError(f"step loads: shape {list(arr.shape)}, window expects {list(self.shape)}")
        if self.ema is not None:
            self._avg = arr.copy() if self.steps == 0 else self.ema * arr + (1 - self.ema) * self._avg
        slot = self.steps % self.size
        self._total += arr - self._ring[slot]  # exact: token counts stay far below 2^53
        self._ring[slot] = arr
        self.steps += 1

    def __len__(self) -> int:
        return min(self.steps, self.size)

    def step_loads(self) -> np.ndarray:
        """[n, L, E]: each of the last n steps' loads, oldest first."""
        n = len(self)
        if self.steps <= self.size:
            return self._ring[:n].copy()
        start = self.steps % self.size
        return np.concatenate([self._ring[start:], self._ring[:start]])

    def totals(self) -> np.ndarray:
        """[L, E] the last n steps' loads summed (int64: token counts); zeros before the first step."""
        return np.rint(self._total).astype(np.int64)

    def loads(self) -> np.ndarray:
        """[L, E]; zeros before the first step."""
        if self.ema is not None:
            return self._avg.copy()
        n = len(self)
        return self._ring[:n].mean(0) if n else np.zeros(self.shape)


# ---- synthetic workloads, loads files and the benchmark entry point -----------------------


def synthetic_loads(layers: int, experts: int, seed: int = 0, skew: float = 1.0,
                    tokens_per_layer: int = 65536, steps: int | None = None) -> np.ndarray:
    """[L, E] token counts with Zipf-like skew: expert popularity ~ 1/rank**skew, the ranking
    shuffled per layer (hot experts differ between layers), counts drawn multinomially. With
    `steps`: a window, [steps, L, E], each step's tokens_per_layer drawn from the layer's one
    popularity."""
    L, E = _count(layers, "layers", 1), _count(experts, "experts", 1)
    if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not skew >= 0:
        raise RebalanceError(f"skew: must be a non-negative number, got {skew!r}")
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** skew
    if steps is not None:
        window = np.zeros((_count(steps, "steps", 1), L, E))
        for layer in range(L):
            popularity = p[rng.permutation(E)]
            window[:, layer] = rng.multinomial(tokens_per_layer, popularity / popularity.sum(), size=steps)
        return window
    p /= p.sum()
    out = np.empty((L, E))
    for layer in range(L):
        out[layer] = rng.multinomial(tokens_per_layer, p[rng.permutation(E)])
    return out


def load_loads_file(path: str | Path) -> np.ndarray:
    """A [layers, experts] loads matrix from .npy or .json (a list of lists, or {"loads": ...})."""
    path = Path(path)
    try:
        if path.suffix == ".npy":
            raw = np.load(path, allow_pickle=False)
        elif path.suffix == ".json":
            raw = json.loads(path.read_text())
            if isinstance(raw, dict):
                if "loads" not in raw:
                    raise RebalanceError(f"loads file {path.name}: an object needs a 'loads' key")
                raw = raw["loads"]
        else:
            raise RebalanceError(f"loads file {path.name}: expected .npy or .json")
    except OSError as exc:
        raise RebalanceError(f"loads file {path}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        if isinstance(exc, RebalanceError):
            raise
        raise RebalanceError(f"loads file {path.name}: not valid {path.suffix.lstrip('.')} "
                             f"({str(exc).splitlines()[0]})") from None
    return as_loads(raw, f"loads file {path.name}")


def run_plan_rebalance(loads, devices: int, redundant: int, devices_per_node: int = 8,
                       expert_bytes: int = DEFAULT_EXPERT_BYTES, hbm_budget_bytes: int | None = None,
                       current: Placement | None = None, target: float | None = None) -> dict:
    """plan_rebalance on a fresh Topology, as a JSON-ready dict (the CLI's `plan rebalance`)."""
    W = as_loads(loads)
    topo = Topology(num_devices=devices, devices_per_node=devices_per_node)
    plan = plan_rebalance(W, topo, redundant, current=current, expert_bytes=expert_bytes,
                          hbm_budget_bytes=hbm_budget_bytes, target=target)
    return plan_dict(plan, W, topo, redundant, expert_bytes)


def plan_dict(plan: RebalancePlan, W: np.ndarray, topo: Topology, redundant: int, expert_bytes: int) -> dict:
    """A plan as `plan rebalance --json` reports it."""
    counts = plan.placement.replica_counts()
    return {
        "layers": W.shape[0], "experts": W.shape[1], "devices": topo.num_devices,
        "devices_per_node": topo.devices_per_node,
        "nodes": topo.num_nodes, "redundant_per_device": redundant,
        "slots_per_device": plan.placement.slots_per_device, "expert_bytes": expert_bytes,
        "balancedness_before": plan.balancedness_before.overall,
        "balancedness_after": plan.balancedness_after.overall,
        "balancedness_before_per_layer": plan.balancedness_before.per_layer.tolist(),
        "balancedness_after_per_layer": plan.balancedness_after.per_layer.tolist(),
        "bytes_moved": plan.bytes_moved, "moves": len(plan.move_array), "layers_kept": plan.layers_kept,
        "max_replicas": int(counts.max()), "seconds": plan.seconds,
        "placement": plan.placement.to_dict(),  # what `--placement FILE` loads at start
    }
