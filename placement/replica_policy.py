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

import time

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
_NO_COUNTERS = np.zeros(0, dtype=np.int64)


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
    home = _NO_COUNTERS if token_device is None else np.ascontiguousarray(token_device, dtype=np.int64)
    if policy == "locality" and home.size * top_k != experts.size:
        raise PlacementError(f"token_device: {home.size} tokens for {experts.size} entries at top_k {top_k}")
    out = np.empty_like(experts)
    _kernel()(experts, home, top_k, t.first, t.group, t.table_t, t.counts, t.num_replicated,
                  placement.num_devices, POLICY_CODES[policy], _NO_COUNTERS if counters is None else counters,
                  devices_per_node or 0, EXACT_DEAL_ENTRIES, MIN_HEADROOM, out)
    return out


def _kernel():
    """The compiled rule (replica_kernel.py), imported on first use: numba and the kernel's load
    (0.2 s from its cache, about 1.5 s the first time on a machine) are paid only by a process
    that routes replicas, and `prepare` pays them at an apply rather than inside a step."""
    from moectl.placement.replica_kernel import route_entries

    return route_entries


def prepare(placement: Placement | None = None) -> None:
    """Load the compiled rule now if `placement` has a replica anywhere (call where a placement is
    installed, so the first step that routes replicas does not carry the load); with no
    placement, load it regardless (set-up compiles it into numba's cache)."""
    if placement is None or (placement._counts > 1).any():
        _kernel()(np.zeros(1, np.int64), _NO_COUNTERS, 1, np.zeros(1, np.int64), np.full(1, -1, np.int64),
                  np.zeros((1, 1), np.int64), np.ones(1, np.int64), 0, 1, 1, _NO_COUNTERS, 0, EXACT_DEAL_ENTRIES,
                  MIN_HEADROOM, np.empty(1, np.int64))


ROUTING_SIZES = (256, 4096)  # entries per layer call the routing overhead is timed at (decode-, prefill-sized)


def routing_overhead(num_experts: int, top_k: int, num_devices: int, policy: str = "locality",
                     devices_per_node: int | None = None, repeat: int = 15) -> tuple[float, float]:
    """Measured on this machine, now: (seconds per layer call, seconds per entry) that routing a
    layer with replicas costs over one without, a line through ROUTING_SIZES. Timed on this
    shape with a spare slot per device holding another device's first expert and a skewed
    (Zipf 1.2) batch, the median of `repeat` interleaved calls, so the cost model prices what a
    plan's first replica in a layer adds to every step."""
    per = -(-num_experts // num_devices)
    naive = Placement.contiguous(1, num_experts, num_devices, 1)
    slots = naive.slots.copy()
    for d in range(num_devices):
        slots[0, d, -1] = min(((d + 1) % num_devices) * per, num_experts - 1)
    replicated = Placement(slots, num_experts)
    prepare(replicated)
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, num_experts + 1) ** 1.2
    extra = []
    for entries in ROUTING_SIZES:
        tokens = -(-entries // top_k)
        experts = rng.choice(num_experts, size=tokens * top_k, p=weights / weights.sum())
        home = np.arange(tokens) % num_devices
        times = {id(naive): [], id(replicated): []}
        for _ in range(repeat):
            for placement in (naive, replicated):
                counters = np.zeros(num_experts, dtype=np.int64)
                t0 = time.perf_counter()
                route(placement, 0, experts, home, policy, counters, devices_per_node, top_k)
                times[id(placement)].append(time.perf_counter() - t0)
        extra.append(max(float(np.median(times[id(replicated)]) - np.median(times[id(naive)])), 0.0))
    (n0, n1), (t0, t1) = ROUTING_SIZES, extra
    per_entry = max((t1 - t0) / (n1 - n0), 0.0)
    return max(t0 - per_entry * n0, 0.0), per_entry


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
