"""Routing each (token, choice) to one replica of its expert, at run time, for torch tensors.

A Placement (placement.py, torch-free) says where every expert's replicas sit; the engine's MoE
layers ask here, per layer and step, which replica each routed token goes to (the rule itself is
placement/replica_policy.py, which the cost model prices), and what the dispatch all-to-all then
sends between devices.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from moectl.placement.placement import Placement, PlacementError, _count, _index
from moectl.placement.replica_policy import POLICIES, prepare, route

__all__ = ["POLICIES", "RoutingState", "assign_replicas", "device_token_load", "prepare", "routing_overhead",
           "traffic_matrix"]


def assign_replicas(placement: Placement, layer: int, expert_ids: torch.Tensor, token_device: torch.Tensor,
                    policy: str = "locality", state: RoutingState | None = None, check: bool = True) -> torch.Tensor:
    """Pick a replica (device) for every (token, choice): [N, k] expert ids -> [N, k] devices, by
    placement/replica_policy.py's rule (locality, least_loaded or round_robin; round-robin
    positions and locality's node size come from `state`). check=False skips validating the ids
    and devices (the engine's own router output, per layer and step)."""
    layer = _index(layer, "layer", placement.num_layers)
    if policy not in POLICIES:
        raise PlacementError(f"policy {policy!r} unknown (choose from {', '.join(POLICIES)})")
    ids = torch.as_tensor(expert_ids)
    if ids.dim() != 2:
        raise PlacementError(f"expert_ids: expected shape [tokens, k], got {list(ids.shape)}")
    flat = ids.reshape(-1).numpy().astype(np.int64, copy=False)
    tok = torch.as_tensor(token_device)
    if tok.shape != ids.shape[:1]:
        raise PlacementError(f"token_device: expected shape [{ids.shape[0]}], got {list(tok.shape)}")
    if check and flat.size and (flat.min() < 0 or flat.max() >= placement.num_experts):
        bad = flat[(flat < 0) | (flat >= placement.num_experts)][0]
        raise PlacementError(f"expert {bad} out of range [0, {placement.num_experts}) (layer {layer})")
    home = tok.numpy().astype(np.int64, copy=False)
    if check and home.size and (home.min() < 0 or home.max() >= placement.num_devices):
        bad = home[(home < 0) | (home >= placement.num_devices)][0]
        raise PlacementError(f"device {bad} out of range [0, {placement.num_devices}) in token_device")
    out = route(placement, layer, flat, home if policy == "locality" else None, policy,
                state.counters(layer, placement.num_experts) if state is not None else None,
                state.devices_per_node if state is not None else None, top_k=ids.shape[1])
    return torch.from_numpy(out).view(ids.shape)


ROUTING_SIZES = (256, 4096)  # entries per layer call the routing overhead is timed at (decode-, prefill-sized)


def routing_overhead(num_experts: int, top_k: int, num_devices: int, policy: str = "locality",
                     devices_per_node: int | None = None, repeat: int = 15) -> tuple[float, float]:
    """Measured on this machine, now: (seconds per layer call, seconds per entry) that choosing
    replicas costs a layer with replicas over one without, through `assign_replicas` as the MoE
    layers call it (tensors in and out, the compiled rule), a line through ROUTING_SIZES. Timed on
    this shape with a spare slot per device holding another device's first expert and a skewed
    (Zipf 1.2) batch, the median of `repeat` interleaved calls, so the cost model prices what a
    plan's first replica in a layer adds to every step."""
    per = -(-num_experts // num_devices)
    naive = Placement.contiguous(1, num_experts, num_devices, 1)
    slots = naive.slots.copy()
    for d in range(num_devices):
        slots[0, d, -1] = min(((d + 1) % num_devices) * per, num_experts - 1)
    replicated = Placement(slots, num_experts)
    prepare(replicated)
    gen = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
    extra = []
    for entries in ROUTING_SIZES:
        tokens = -(-entries // top_k)
        ids = torch.multinomial(weights, tokens * top_k, replacement=True, generator=gen).view(tokens, top_k)
        home = torch.arange(tokens) % num_devices
        times: dict[int, list[float]] = {id(naive): [], id(replicated): []}
        for _ in range(repeat):
            for placement in (naive, replicated):
                state = RoutingState(devices_per_node)
                t0 = time.perf_counter()
                assign_replicas(placement, 0, ids, home, policy, state, check=False)
                times[id(placement)].append(time.perf_counter() - t0)
        extra.append(max(float(np.median(times[id(replicated)]) - np.median(times[id(naive)])), 0.0))
    (n0, n1), (t0, t1) = ROUTING_SIZES, extra
    per_entry = max((t1 - t0) / (n1 - n0), 0.0)
    return max(t0 - per_entry * n0, 0.0), per_entry


class RoutingState:
    """What replica routing carries between calls: the node size (for locality) and the
    round-robin position of every (layer, expert)."""

    def __init__(self, devices_per_node: int | None = None):
        self.devices_per_node = None if devices_per_node is None else _count(devices_per_node, "devices_per_node", 1)
        self._rr: dict[int, np.ndarray] = {}

    def counters(self, layer: int, num_experts: int) -> np.ndarray:
        if layer not in self._rr or self._rr[layer].size != num_experts:
            self._rr[layer] = np.zeros(num_experts, dtype=np.int64)
        return self._rr[layer]


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
