"""Which replica of its expert each routed (token, choice) goes to: the runtime's rule, in numpy.

The engine's MoE layers call `route` once per layer and step (engine/experts/replica_routing.py
wraps it for torch tensors); the cost model prices a placement with `expected_work`, the same
rule applied to each step's per-expert counts, so what is predicted is what the runtime does
(locality's node tier excepted: the expectation spreads a remote entry over every replica).

Every entry of a single-replica expert goes to its one device (one gather). Only the entries of
replicated experts are open, and they are handled together, with no Python loop over tokens or
experts:

* least_loaded: an expert's entries are split over its replicas in proportion to each device's
  headroom below the step's balanced level (entries / devices), after the single-replica
  experts' load; exact to one entry for decode-sized batches, within a few entries (a Weyl
  sequence, no ranking) for larger ones, and the same on every rank that routes the same batch.
* locality: an entry whose token sits on a device holding the expert stays there; otherwise a
  replica on its node (with `devices_per_node`), else any, split as least_loaded does.
* round_robin: the r-th entry of an expert this step goes to replica (r + counter) mod R; the
  counter carries across calls.
"""

from __future__ import annotations

import numpy as np

from moectl.placement.placement import Placement, PlacementError

POLICIES = ("locality", "least_loaded", "round_robin")  # how a token picks among an expert's replicas
MIN_HEADROOM = 0.5  # entries: a device at or over the balanced level still takes a sliver, never none


class _Tables:
    """One layer's replica tables, built once per placement (Placement caches them)."""

    def __init__(self, placement: Placement, layer: int):
        rows = placement._slots[layer]
        dev = np.broadcast_to(np.arange(placement.num_devices)[:, None], rows.shape)
        order = np.lexsort((dev.ravel(), rows.ravel()))  # by expert, then device
        experts, devices = rows.ravel()[order], dev.ravel()[order]
        keep = experts >= 0
        experts, devices = experts[keep], devices[keep]
        counts = placement._counts[layer].astype(np.int64)
        rank = np.arange(experts.size) - np.repeat(np.cumsum(counts) - counts, counts)
        table = np.full((placement.num_experts, int(counts.max())), -1, dtype=np.int64)
        table[experts, rank] = devices
        for a in (table, counts):
            a.setflags(write=False)
        self.table, self.counts = table, counts
        self.first = np.ascontiguousarray(table[:, 0])  # the device of each expert's first replica
        self.table_t = np.ascontiguousarray(table.T)  # [Rmax, E]: per-column work runs along rows
        replicated = np.flatnonzero(counts > 1)
        self.group = np.full(placement.num_experts, -1, dtype=np.int64)  # expert -> index among the replicated
        self.group[replicated] = np.arange(replicated.size)
        self.num_replicated = replicated.size
        self.replicated_first = self.first[replicated]  # the device each replicated expert's entries start on


def _tables(placement: Placement, layer: int) -> _Tables:
    key = ("replica_tables", layer)
    if key not in placement._cache:
        placement._cache[key] = _Tables(placement, layer)
    return placement._cache[key]


def route(placement: Placement, layer: int, experts: np.ndarray, token_device: np.ndarray | None = None,
          policy: str = "least_loaded", counters: np.ndarray | None = None,
          devices_per_node: int | None = None) -> np.ndarray:
    """The device of every entry: `experts` [M] int64 expert ids (a [tokens, k] array flattened),
    `token_device` [M] the device each entry's token sits on (locality), `counters` [E] int64
    round-robin positions, advanced in place. Ids and devices are trusted (the caller checks)."""
    t = _tables(placement, layer)
    out = t.first[experts]
    if t.num_replicated == 0:
        return out
    group = t.group[experts]
    open_ = np.flatnonzero(group >= 0)
    if open_.size == 0:
        return out
    ex, group = experts[open_], group[open_]
    cand = np.take(t.table_t, ex, axis=1)  # [Rmax, m]
    num_groups = t.num_replicated
    if policy == "round_robin":
        rank, _ = _rank(group, num_groups)
        if counters is not None:
            rank = rank + counters[ex]
            counters += np.bincount(ex, minlength=placement.num_experts)
        out[open_] = _pick(rank % t.counts[ex], cand)
        return out
    headroom = _headroom(t, out, group, placement.num_devices)
    allowed = None
    if policy == "locality":
        # one deal for every open entry: one that can stay on its token's device may pick only
        # that device; one that can stay on its node only that node's replicas; the rest any
        home = token_device[open_]
        local = cand == home  # [Rmax, m]
        stay = local.any(0)
        allowed = np.where(stay, local, True)
        kind, kinds = stay.astype(np.int64), 2  # each kind deals among its own: they never shift each other
        if devices_per_node:
            same = (cand >= 0) & (cand // devices_per_node == home // devices_per_node)
            on_node = same.any(0) & ~stay
            allowed = np.where(on_node, same, allowed)
            kind = np.where(on_node, 2 + home // devices_per_node, kind)
            kinds += -(-placement.num_devices // devices_per_node)
        group, num_groups = group * kinds + kind, num_groups * kinds
    elif policy != "least_loaded":
        raise PlacementError(f"policy {policy!r} unknown (choose from {', '.join(POLICIES)})")
    out[open_] = _deal(cand, allowed, headroom, open_, group, num_groups)
    return out


def _headroom(t: _Tables, first: np.ndarray, group: np.ndarray, num_devices: int) -> np.ndarray:
    """[D + 1] room below the balanced level after the single-replica experts' entries; the last,
    0, is what a padded (-1) replica column indexes. `first`: every entry's first-replica device;
    `group`: the open entries' replicated-expert index, whose entries are taken back off it."""
    fixed = np.bincount(first, minlength=num_devices + 1).astype(np.float64)
    fixed -= np.bincount(t.replicated_first, weights=np.bincount(group, minlength=t.num_replicated),
                         minlength=num_devices + 1)
    room = np.maximum(first.size / num_devices - fixed, MIN_HEADROOM)
    room[-1] = 0.0
    return room


EXACT_DEAL_ENTRIES = 512  # up to this many open entries (decode-sized) the split is exact


def _deal(cand: np.ndarray, allowed: np.ndarray | None, headroom: np.ndarray, entries: np.ndarray,
          group: np.ndarray, num_groups: int) -> np.ndarray:
    """Each open entry to one of its allowed candidates ([Rmax, m]) in proportion to their
    headroom: an entry takes the candidate whose cumulative weight first exceeds its point of
    the total. Up to EXACT_DEAL_ENTRIES entries the point of the r-th of a group's n entries is
    (r + 1/2) / n, so every split is exact to one entry; beyond, where one entry is a small
    share, it is frac(entry index * golden ratio) (a Weyl sequence, spread evenly over [0, 1)),
    which needs no ranking: the proportional split to within a few entries. Either is the same
    on every rank. A padded (-1) or disallowed candidate weighs nothing, so the count of
    cumulative weights at or below an entry's point is its row."""
    weight = headroom[cand]  # headroom[-1] is the padding's 0
    if allowed is not None:
        weight = np.where(allowed, weight, 0.0)
    for r in range(1, weight.shape[0]):  # running sum down the few replica rows (np.cumsum is slower)
        weight[r] += weight[r - 1]
    if entries.size <= EXACT_DEAL_ENTRIES:
        rank, per_group = _rank(group, num_groups)
        point = (rank + 0.5) / per_group[group] * weight[-1]
    else:
        point = _weyl(int(entries[-1]) + 1)[entries] * weight[-1]
    row = (weight[0] <= point).astype(np.int64)
    for r in range(1, weight.shape[0] - 1):
        row += weight[r] <= point
    return _pick(row, cand)


_WEYL = np.zeros(0)


def _weyl(n: int) -> np.ndarray:
    """frac(i * golden ratio) for i < n (grown and kept: one array for every call)."""
    global _WEYL
    if _WEYL.size < n:
        _WEYL = np.modf(np.arange(max(n, 2 * _WEYL.size, 4096)) * 0.6180339887498949)[0]
        _WEYL.setflags(write=False)
    return _WEYL


def _pick(row: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """cand[row[i], i] for every entry i."""
    if cand.shape[0] <= 32:  # np.choose's limit; it beats fancy indexing
        return np.choose(row, cand)
    return cand[row, np.arange(cand.shape[1])]


SMALL_RANK_CELLS = 1 << 16  # up to this many (group, entry) cells a one-hot running count beats a sort


def _rank(keys: np.ndarray, num_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Each entry's rank among the entries with its key, in order (0, 1, 2, ...); entries per key."""
    m = keys.size
    if num_keys * m <= SMALL_RANK_CELLS:
        running = np.cumsum(keys == np.arange(num_keys)[:, None], axis=1)  # [keys, m]
        return running[keys, np.arange(m)] - 1, running[:, -1]
    small = keys.astype(np.uint16) if num_keys <= 65536 else keys  # 16-bit keys: numpy's radix sort
    order = np.argsort(small, kind="stable")
    per_key = np.bincount(keys, minlength=num_keys)
    rank = np.empty_like(keys)
    rank[order] = np.arange(m) - (np.cumsum(per_key) - per_key)[keys[order]]
    return rank, per_key


def expected_device_rows(placement: Placement, layer: int, expert_counts: np.ndarray,
                         policy: str = "least_loaded") -> np.ndarray:
    """[D] entries each device computes in one step of this layer, given the step's [E] entries
    per expert, by the rule `route` applies (locality: tokens spread evenly over the devices, so
    an expert's entries stay local in proportion to its replicas, the rest split by headroom)."""
    rows, _, _ = layer_work(slot_counts(placement, layer), np.asarray(expert_counts, dtype=np.float64)[None], policy)
    return rows[0]


def expected_work(placement: Placement, step_loads: np.ndarray, layers: list[int],
                  policy: str = "least_loaded") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `route` gives each device, in expectation, for per-step [S, L, E] entries per expert,
    over `layers`: (rows [S, D, M], active experts [S, D, M], remote rows [S, M]: entries whose
    token sits on another device, tokens spread evenly over the devices)."""
    loads = np.asarray(step_loads, dtype=np.float64)
    S, D = loads.shape[0], placement.num_devices
    rows, active, remote = np.zeros((S, D, len(layers))), np.zeros((S, D, len(layers))), np.zeros((S, len(layers)))
    for i, layer in enumerate(layers):
        rows[:, :, i], active[:, :, i], remote[:, i] = layer_work(slot_counts(placement, layer), loads[:, layer], policy)
    return rows, active, remote


def slot_counts(placement: Placement, layer: int) -> np.ndarray:
    """[D, E] slots of each device holding each expert (a device may hold one in two slots)."""
    key = ("slot_counts", layer)
    if key not in placement._cache:
        placement._cache[key] = counts_of(placement._slots[layer], placement.num_experts)
    return placement._cache[key]


def counts_of(slots: np.ndarray, num_experts: int) -> np.ndarray:
    """[D, K] slots -> [D, E] slots holding each expert."""
    counts = np.zeros((slots.shape[0], num_experts + 1))
    np.add.at(counts, (np.arange(slots.shape[0])[:, None], slots + 1), 1.0)
    return counts[:, 1:]


def layer_work(counts: np.ndarray, loads: np.ndarray, policy: str = "least_loaded"
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's expected work by the routing rule: `counts` [D, E] slots of each device
    holding each expert, per-step `loads` [S, E] -> (rows [S, D], active experts [S, D], remote
    rows [S]). Array expressions over every step; the replicated experts (few) get their own
    [S, R, D] arrays."""
    D = counts.shape[0]
    counts = np.asarray(counts, dtype=np.float64)
    replicas = counts.sum(0)  # [E] slots holding each expert
    devices = (counts > 0).sum(0)  # [E] devices holding it
    single = replicas == 1
    rows = loads[:, single] @ counts[:, single].T  # [S, D]
    active = (loads[:, single] > 0).astype(np.float64) @ counts[:, single].T
    total = loads.sum(1)
    multi = np.flatnonzero(replicas > 1)
    if multi.size:
        on = counts[:, multi].T  # [R, D] slots per device
        n = loads[:, multi]  # [S, R]
        if policy == "round_robin":
            share = np.broadcast_to(on / replicas[multi][:, None], (loads.shape[0],) + on.shape)
        else:
            room = np.maximum(total[:, None] / D - rows, MIN_HEADROOM)  # [S, D]
            weight = on[None] * room[:, None, :]  # [S, R, D]: one candidate per slot
            share = weight / weight.sum(2, keepdims=True)
            if policy == "locality":  # a token on a device holding the expert stays there
                share = (on > 0)[None] / D + (1 - devices[multi] / D)[None, :, None] * share
        per_replica = n[:, :, None] * share  # [S, R, D]
        rows = rows + per_replica.sum(1)
        # a replica runs when it gets an entry: 1 - exp(-expected entries), the Poisson chance of one
        # or more (one entry over two replicas: 0.79 expected runs, where one always runs)
        active = active + (1.0 - np.exp(-per_replica)).sum(1)
    local = (loads * devices).sum(1) / D if policy == "locality" else total / D
    return rows, active, total - local
