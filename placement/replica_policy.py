"""Which replica of its expert each routed (token, choice) goes to: the runtime's rule.

The engine's MoE layers call `route` once per layer and step (engine/experts/replica_routing.py
wraps it for torch tensors); the cost model prices a placement with `expected_work`, the same
rule applied to each step's per-expert counts, so what is predicted is what the runtime does
(locality's node tier excepted: the expectation spreads a remote entry over every replica).

Every entry of a single-replica expert goes to its one device (one gather, in numpy). The entries
of replicated experts are open; a compiled kernel (replica_kernel.py, numba) deals them in one
pass, since some thirty numpy calls per layer call cost more than the rule itself
(`python bench/replica_routing_bench.py` times it per layer call):

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


def _tables(placement: Placement, layer: int) -> _Tables:
    key = ("replica_tables", layer)
    if key not in placement._cache:
        placement._cache[key] = _Tables(placement, layer)
    return placement._cache[key]


POLICY_CODES = {name: code for code, name in enumerate(POLICIES)}  # as replica_kernel.py reads them
EXACT_DEAL_ENTRIES = 512  # up to this many open entries (decode-sized) the split is exact
_EMPTY = np.zeros(0, dtype=np.int64)  # what the kernel takes for "no token devices" and "no counters"


def route(placement: Placement, layer: int, experts: np.ndarray, token_device: np.ndarray | None = None,
          policy: str = "least_loaded", counters: np.ndarray | None = None,
          devices_per_node: int | None = None, top_k: int = 1) -> np.ndarray:
    """The device of every entry: `experts` [M] int64 expert ids (a [tokens, top_k] array
    flattened), `token_device` [M / top_k] the device each token sits on (locality; entry i's
    token is i // top_k), `counters` [E] int64 round-robin positions, advanced in place. Ids and
    devices are trusted (the caller checks)."""
    if policy not in POLICY_CODES:
        raise PlacementError(f"policy {policy!r} unknown (choose from {', '.join(POLICIES)})")
    t = _tables(placement, layer)
    experts = np.ascontiguousarray(experts, dtype=np.int64)
    if t.num_replicated == 0:
        return t.first[experts]
    home = _EMPTY if token_device is None else np.ascontiguousarray(token_device, dtype=np.int64)
    if policy == "locality" and home.size * top_k != experts.size:
        raise PlacementError(f"token_device: {home.size} tokens for {experts.size} entries at top_k {top_k}")
    out = np.empty_like(experts)
    _kernel()(experts, home, top_k, t.first, t.group, t.table_t, t.counts, t.num_replicated,
              placement.num_devices, POLICY_CODES[policy], _EMPTY if counters is None else counters,
              devices_per_node or 0, EXACT_DEAL_ENTRIES, MIN_HEADROOM, out)
    return out


def _kernel():
    """The compiled rule (replica_kernel.py), imported on first use: numba's import and the
    kernel's load from its cache (or its compile, the first time on a machine) are paid only by a
    process that routes replicas, and `prepare` pays them at an apply rather than inside a step."""
    from moectl.placement.replica_kernel import route_entries

    return route_entries


def prepare(placement: Placement | None = None) -> None:
    """Load the compiled rule now if `placement` has a replica anywhere (call where a placement is
    installed, so the first step that routes replicas does not carry the load); with no
    placement, load it regardless (set-up compiles it into numba's cache). It routes one entry
    through the placement's own tables, so what loads is what its steps call."""
    if placement is None:
        placement = Placement([[[0, 1], [0, -1]]], 2)
    replicated = np.flatnonzero((placement._counts > 1).any(1))
    if replicated.size:
        route(placement, int(replicated[0]), np.zeros(1, dtype=np.int64), None, "least_loaded")


def expected_device_rows(placement: Placement, layer: int, expert_counts: np.ndarray,
                         policy: str = "least_loaded") -> np.ndarray:
    """[D] entries each device computes in one step of this layer, given the step's [E] entries
    per expert, by the rule `route` applies (locality: tokens spread evenly over the devices, so
    an expert's entries stay local in proportion to its replicas, the rest split by headroom)."""
    rows, _, _ = layer_work(placement._slots[layer], np.asarray(expert_counts, dtype=np.float64)[None], policy)
    return rows[0]


def expected_work(placement: Placement, step_loads: np.ndarray, layers: list[int],
                  policy: str = "least_loaded") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `route` gives each device, in expectation, for per-step [S, L, E] entries per expert,
    over `layers`: (rows [S, D, M], active experts [S, D, M], link rows [S, M]: the entries the
    busiest device's links carry, sent and received, tokens spread evenly over the devices)."""
    loads = np.asarray(step_loads, dtype=np.float64)
    rows, active, remote = slots_work(placement._slots[list(layers)], loads[:, list(layers)], policy)
    return rows.transpose(0, 2, 1), active.transpose(0, 2, 1), remote
def slot_counts(placement: Placement, layer: int) -> np.ndarray:
    """[D, E] slots of each device holding each expert (a device may hold one in two slots)."""
    key = ("slot_counts", layer)
    if key not in placement._cache:
        placement._cache[key] = counts_of(placement._slots[layer], placement.num_experts)
    return placement._cache[key]


def _check_ids(slots: np.ndarray, num_experts: int) -> None:
    """Slots hold -1 (empty) or an expert id: an id out of range would land in a neighbour's cell."""
    if slots.size and (slots.min() < -1 or slots.max() >= num_experts):
        bad = slots[(slots < -1) | (slots >= num_experts)].ravel()[0]
        raise PlacementError(f"slots: expert {int(bad)} out of range [-1, {num_experts})")


def counts_of(slots: np.ndarray, num_experts: int) -> np.ndarray:
    """[..., D, K] slots -> [..., D, E] slots holding each expert (float)."""
    slots = np.asarray(slots)
    _check_ids(slots, num_experts)
    lead = slots.shape[:-1]
    cells = int(np.prod(lead))
    flat = (np.arange(cells)[:, None] * (num_experts + 1) + slots.reshape(cells, -1) + 1).ravel()
    counts = np.bincount(flat, minlength=cells * (num_experts + 1)).reshape(*lead, num_experts + 1)
    return counts[..., 1:].astype(np.float64)


def layer_work(slots: np.ndarray, loads: np.ndarray, policy: str = "least_loaded"
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's expected work: [D, K] slots (expert ids, -1 empty), per-step `loads` [S, E]
    -> (rows [S, D], active experts [S, D], link rows [S]: slots_work's)."""
    rows, active, remote = slots_work(np.asarray(slots)[None], np.asarray(loads)[:, None], policy)
    return rows[:, 0], active[:, 0], remote[:, 0]


def slots_work(slots: np.ndarray, loads: np.ndarray, policy: str = "least_loaded"
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expected work by the routing rule for C layers (or candidates for one) at once: [C, D, K]
    slots, per-step `loads` [S, C, E] -> (rows [S, C, D], active experts [S, C, D], link rows
    [S, C]: the entries the busiest device's links carry in the dispatch, those it receives from
    other devices' tokens and those its own tokens send, tokens spread evenly over the devices).
    A single-replica expert's load is read where its slot is (a gather, no [D, E] array); the
    replicated (layer, expert) pairs, few, get [S, P, R] arrays over the devices each is on (R:
    the most devices any pair is on; a device with two slots of one expert takes two shares)."""
    slots = np.asarray(slots, dtype=np.int64)
    loads = np.asarray(loads, dtype=np.float64)
    S, C, E = loads.shape
    _check_ids(slots, E)
    D, K = slots.shape[1:]
    flat = slots.reshape(C, D * K)
    # [C, E + 1] slots holding each expert, column 0 the empty slots
    replicas = np.bincount((np.arange(C)[:, None] * (E + 1) + flat + 1).ravel(),
                           minlength=C * (E + 1)).reshape(C, E + 1)
    per_slot_replicas = np.take_along_axis(replicas, flat + 1, axis=1).reshape(C, D, K)
    occupied = slots >= 0
    single = occupied & (per_slot_replicas == 1)
    padded = np.concatenate([loads, np.zeros((S, C, 1))], axis=2)  # an empty slot (-1) reads the 0
    per_slot = np.take_along_axis(padded, np.broadcast_to(flat[None] % (E + 1), (S, C, D * K)), axis=2)
    per_slot = per_slot.reshape(S, C, D, K)
    rows = np.where(single[None], per_slot, 0.0).sum(3)  # [S, C, D]
    active = (single[None] & (per_slot > 0)).sum(3).astype(np.float64)
    total = loads.sum(2)  # [S, C]
    local = rows.copy()  # x 1/D: entries each device computes for tokens it holds (single-replica experts)
    multi = occupied & (per_slot_replicas > 1)
    if multi.any():
        c, d, k = np.nonzero(multi)
        pair_device, slots_there = np.unique((c * E + slots[c, d, k]) * D + d, return_counts=True)
        pairs, pair = np.unique(pair_device // D, return_inverse=True)  # the (layer, expert) pairs, sorted
        pl, pe = pairs // E, pairs % E
        rank = np.arange(len(pair)) - np.searchsorted(pair, pair)  # each device's place among its pair's
        dev = np.zeros((len(pairs), int(rank.max()) + 1), dtype=np.int64)
        on = np.zeros(dev.shape)  # [P, R] slots of the pair on each of its devices
        dev[pair, rank] = pair_device % D
        on[pair, rank] = slots_there
        n = loads[:, pl, pe]  # [S, P]
        local_share = 0.0
        if policy == "round_robin":
            share = np.broadcast_to(on / replicas[pl, pe + 1][:, None], (S,) + on.shape)
        else:
            room = np.maximum(total[:, :, None] / D - rows, MIN_HEADROOM)  # [S, C, D]
            weight = on[None] * room[:, pl[:, None], dev]  # [S, P, R]: one candidate per slot
            share = weight / weight.sum(2, keepdims=True)
            if policy == "locality":  # a token on a device holding the expert stays there
                spread = (on > 0).sum(1)  # devices the pair is on
                local_share = (on > 0)[None] / D
                share = (1 - spread / D)[None, :, None] * share  # the dealt part
        dealt = n[:, :, None] * share  # [S, P, R] entries dealt to each replica
        kept = n[:, :, None] * local_share  # and kept on their token's device (locality)
        per_replica = dealt + kept
        cell = ((np.arange(S)[:, None, None] * C + pl[None, :, None]) * D + dev[None]).ravel()  # (step, layer, device)
        rows = rows + np.bincount(cell, per_replica.ravel(), S * C * D).reshape(S, C, D)
        # a replica runs when it gets an entry. The deal is proportional and deterministic, exact
        # to one entry, so a replica dealt x entries runs with chance min(1, x) (its interval holds
        # a point or not); where tokens sit is random, so one keeping y of its own tokens' entries
        # runs with the Poisson chance 1 - exp(-y)
        ran = 1.0 - (1.0 - np.minimum(dealt, 1.0)) * np.exp(-kept)
        active = active + np.bincount(cell, ran.ravel(), S * C * D).reshape(S, C, D)
        if policy == "locality":  # every device holding a replicated expert keeps its own tokens' entries
            local = local + D * np.bincount(cell, np.broadcast_to(kept, per_replica.shape).ravel(),
                                            S * C * D).reshape(S, C, D)
    local = local / D if policy == "locality" else rows / D  # tokens spread evenly over the devices
    received = rows - local  # [S, C, D] entries each device computes for tokens on other devices
    sent = (total - local.sum(2)) / D  # [S, C] entries each device's tokens send elsewhere
    return rows, active, (received + sent[:, :, None]).max(2)
