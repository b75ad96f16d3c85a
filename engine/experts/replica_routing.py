"""Routing each (token, choice) to one replica of its expert, at run time (torch).

A Placement (placement.py, torch-free) says where every expert's replicas sit; the engine's MoE
layers ask here, per layer and step, which replica each routed token goes to, and what the
dispatch all-to-all then sends between devices.
"""

from __future__ import annotations

import numpy as np
import torch

from moectl.engine.core.config import ROUTING_POLICIES as POLICIES
from moectl.placement.placement import Placement, PlacementError, _count, _index


def replica_table(placement: Placement, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([E, Rmax] devices of each expert's replicas, -1 padded; [E] replica counts)."""
    key = ("table", layer)
    if key not in placement._cache:
        rows = placement._slots[layer]
        dev = np.broadcast_to(np.arange(placement.num_devices)[:, None], rows.shape)
        order = np.lexsort((dev.ravel(), rows.ravel()))  # by expert, then device
        experts, devices = rows.ravel()[order], dev.ravel()[order]
        keep = experts >= 0
        experts, devices = experts[keep], devices[keep]
        counts = placement._counts[layer]
        rank = np.arange(experts.size) - np.repeat(np.cumsum(counts) - counts, counts)
        table = np.full((placement.num_experts, int(counts.max())), -1, dtype=np.int64)
        table[experts, rank] = devices
        placement._cache[key] = (torch.from_numpy(table), torch.from_numpy(counts.copy()))
    return placement._cache[key]


def _single_replica(placement: Placement, layer: int) -> bool:
    key = ("single", layer)
    if key not in placement._cache:
        placement._cache[key] = bool(placement._counts[layer].max() == 1)
    return placement._cache[key]


def assign_replicas(placement: Placement, layer: int, expert_ids: torch.Tensor, token_device: torch.Tensor,
                    policy: str = "locality", state: RoutingState | None = None, check: bool = True) -> torch.Tensor:
    """Pick a replica (device) for every (token, choice): [N, k] expert ids -> [N, k] devices.

    locality: a replica on the token's device, else one on its node (needs
      state.devices_per_node), else any; ties are spread to even out this step's device load.
    least_loaded: spread each expert's tokens over its replicas so device loads even out.
    round_robin: cycle through the replicas; the cycle continues across calls via `state`.
    check=False skips validating the ids and devices (the engine's own router output, per layer
    and step, where the checks cost more than the routing of a layer without replicas).
    """
    layer = _index(layer, "layer", placement.num_layers)
    if policy not in POLICIES:
        raise PlacementError(f"policy {policy!r} unknown (choose from {', '.join(POLICIES)})")
    ids = torch.as_tensor(expert_ids)
    if ids.dim() != 2:
        raise PlacementError(f"expert_ids: expected shape [tokens, k], got {list(ids.shape)}")
    ids = ids.long()
    table, counts = replica_table(placement, layer)
    if not check and _single_replica(placement, layer):  # no choice to make: each expert's one device
        return table[ids.reshape(-1), 0].view_as(ids)
    tok = torch.as_tensor(token_device).long()
    if tok.shape != ids.shape[:1]:
        raise PlacementError(f"token_device: expected shape [{ids.shape[0]}], got {list(tok.shape)}")
    if check and ids.numel() and (ids.min() < 0 or ids.max() >= placement.num_experts):
        bad = ids[(ids < 0) | (ids >= placement.num_experts)][0].item()
        raise PlacementError(f"expert {bad} out of range [0, {placement.num_experts}) (layer {layer})")
    if check and tok.numel() and (tok.min() < 0 or tok.max() >= placement.num_devices):
        bad = tok[(tok < 0) | (tok >= placement.num_devices)][0].item()
        raise PlacementError(f"device {bad} out of range [0, {placement.num_devices}) in token_device")

    flat = ids.reshape(-1)
    cand, cnt = table[flat], counts[flat]  # [M, Rmax], [M]
    if policy == "round_robin":
        rank = _occurrence_rank(flat)
        if state is not None:
            rr = state.counters(layer, placement.num_experts)
            rank = rank + rr[flat]
            rr += torch.bincount(flat, minlength=placement.num_experts)
        out = cand.gather(1, (rank % cnt).unsqueeze(1)).squeeze(1)
        return out.view_as(ids)

    # numpy from here: [tokens x k] arrays of small ints, where each torch op's overhead dominated
    cand, flat, cnt = cand.numpy(), flat.numpy(), cnt.numpy()
    out = cand[:, 0].copy()  # the only choice for single-replica experts
    open_ = cnt > 1
    if policy == "locality":
        tok_dev = np.repeat(tok.numpy(), ids.shape[1])
        local = cand == tok_dev[:, None]
        has_local = local.any(1) & open_
        rows = np.flatnonzero(has_local)
        out[rows] = cand[rows, local[rows].argmax(1)]
        open_ &= ~has_local
        dpn = state.devices_per_node if state is not None else None
        group = flat * (placement.num_devices + 1)  # group key: expert, and node when tier 2
        allowed = cand >= 0
        if dpn:
            same = (cand >= 0) & (cand // dpn == (tok_dev // dpn)[:, None])
            tier2 = open_ & same.any(1)
            group = np.where(tier2, group + 1 + tok_dev // dpn, group)
            allowed = np.where(tier2[:, None], same, allowed)
            single = np.flatnonzero(tier2 & (same.sum(1) == 1))  # one replica on the node: no choice
            out[single] = cand[single, same[single].argmax(1)]
            open_[single] = False
    else:
        group, allowed = flat, cand >= 0
    load = np.bincount(out[~open_], minlength=placement.num_devices)
    _spread(out, np.flatnonzero(open_), group, cand, allowed, load)
    return torch.from_numpy(out).view_as(ids)


class RoutingState:
    """What replica routing carries between calls: the node size (for locality) and the
    round-robin position of every (layer, expert)."""

    def __init__(self, devices_per_node: int | None = None):
        self.devices_per_node = None if devices_per_node is None else _count(devices_per_node, "devices_per_node", 1)
        self._rr: dict[int, torch.Tensor] = {}

    def counters(self, layer: int, num_experts: int) -> torch.Tensor:
        if layer not in self._rr or self._rr[layer].numel() != num_experts:
            self._rr[layer] = torch.zeros(num_experts, dtype=torch.int64)
        return self._rr[layer]


def _occurrence_rank(keys: torch.Tensor) -> torch.Tensor:
    """For each entry, how many earlier entries share its key (0, 1, 2, ... per key)."""
    if keys.numel() == 0:
        return keys.clone()
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    pos = torch.arange(keys.numel())
    start = torch.ones_like(sorted_keys, dtype=torch.bool)
    start[1:] = sorted_keys[1:] != sorted_keys[:-1]
    first = torch.cummax(torch.where(start, pos, torch.zeros_like(pos)), 0).values
    rank = torch.empty_like(keys)
    rank[order] = pos - first
    return rank


def _spread(out: np.ndarray, entries: np.ndarray, group: np.ndarray, cand: np.ndarray,
            allowed: np.ndarray, load: np.ndarray, passes: int = 3) -> None:
    """Route the open entries group by group (entries of a group share their candidate devices).
    Each group starts split evenly over its candidates; then, a few times over, each group in
    turn is taken off and water-filled back onto its least-loaded candidates given everyone
    else (coordinate descent on the busiest device: one greedy pass can dump a big group on a
    device another group needs more). A Python loop over groups, not tokens: only replicated
    experts form groups."""
    if entries.size == 0:
        return
    keys = group[entries]
    order = np.argsort(keys, kind="stable")
    entries_np, keys = entries[order], keys[order]
    bounds = np.flatnonzero(np.diff(keys)) + 1
    starts = np.concatenate([[0], bounds]).tolist()
    sizes = np.diff(np.concatenate([starts, [keys.size]])).tolist()
    cand_np, allowed_np = cand, allowed
    load_np = load.astype(np.int64)
    devs, quotas = [], []
    for start, size in zip(starts, sizes):
        first = entries_np[start]
        d = np.unique(cand_np[first][allowed_np[first]])
        q = np.full(d.size, size // d.size, dtype=np.int64)
        q[:size % d.size] += 1
        load_np[d] += q
        devs.append(d)
        quotas.append(q)
    by_size = sorted(range(len(sizes)), key=lambda g: -sizes[g])
    for _ in range(passes):
        for g in by_size:
            d = devs[g]
            load_np[d] -= quotas[g]
            quotas[g] = _water_fill(load_np[d], sizes[g])
            load_np[d] += quotas[g]
    picked = np.empty(entries_np.size, dtype=np.int64)
    for start, size, d, q in zip(starts, sizes, devs, quotas):
        # the group's r-th token goes to the device whose cumulative quota first exceeds r
        picked[start:start + size] = d[np.searchsorted(np.cumsum(q), np.arange(size), side="right")]
    out[entries_np] = picked


def _water_fill(levels: np.ndarray, amount: int) -> np.ndarray:
    """Split `amount` unit tokens over bins with integer `levels` so the fullest ends lowest."""
    order = np.argsort(levels, kind="stable")
    lv = levels[order].astype(np.int64)
    prefix = np.cumsum(lv)
    n = lv.size
    k = n
    for i in range(1, n):  # fill the i lowest bins; stop when the level stays below bin i
        if (amount + prefix[i - 1]) / i <= lv[i]:
            k = i
            break
    top = (amount + prefix[k - 1]) // k
    give = np.zeros(n, dtype=np.int64)
    give[:k] = top - lv[:k]
    give[:amount - give.sum()] += 1  # the remainder, one each, to the lowest bins
    out = np.empty(n, dtype=np.int64)
    out[order] = give
    return out


def traffic_matrix(token_device: torch.Tensor, dest_device: torch.Tensor, bytes_per_token: int,
                   num_devices: int, dedupe: bool = False) -> torch.Tensor:
    """[D, D] int64 bytes sent from row device to column device in the dispatch all-to-all
    (combine sends the same bytes back: its matrix is the transpose). Every (token, choice) sends
    bytes_per_token; with dedupe a token sends once per distinct destination device (DeepEP-style).
    The diagonal is traffic that stays on the device."""
    D = _count(num_devices, "devices", 1)
    tok = torch.as_tensor(token_device).long()
    dst = torch.as_tensor(dest_device).long()
    if dst.dim() != 2 or dst.shape[0] != tok.shape[0]:
        raise PlacementError(f"dest_device: expected shape [{tok.shape[0]}, k], got {list(dst.shape)}")
    for name, t in (("token_device", tok), ("dest_device", dst)):
        if t.numel() and (t.min() < 0 or t.max() >= D):
            raise PlacementError(f"{name}: device {int(t[(t < 0) | (t >= D)][0])} out of range [0, {D})")
    pair = (tok[:, None] * D + dst).reshape(-1)
    if dedupe:
        token = torch.arange(tok.shape[0]).repeat_interleave(dst.shape[1])
        pair = torch.unique(token * D * D + pair) % (D * D)
    return torch.bincount(pair, minlength=D * D).view(D, D) * int(bytes_per_token)


def device_token_load(dest_device: torch.Tensor, num_devices: int) -> torch.Tensor:
    """[D] (token, choice) pairs each device computes this step."""
    return torch.bincount(torch.as_tensor(dest_device).reshape(-1).long(), minlength=num_devices)
