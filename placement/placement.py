"""Expert placement: which logical expert sits in which physical slot of which device.

A model too large for one device spreads each MoE layer's experts over D devices, each with the
same number S of expert slots. Per layer the placement is an int array [D, S] of logical expert
ids (-1 = empty slot). Hot experts may sit in several slots (replicas); a token picks one replica
by a routing policy. A Placement is immutable: operator edits return a new one, so a plan can be
compared with, or rolled back to, the placement it came from.

The planning model (device_loads, balancedness) splits each expert's load evenly across its
replicas; the runtime (replica_routing.assign_replicas) decides per token and reports real
per-device loads. This module is torch-free, so a console can hold placements without torch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

# the most logical experts per layer anything here plans for (the largest published MoE has 384):
# beyond it a count is a typo or a corrupt file, and a plan's arrays would not fit in memory
MAX_EXPERTS = 4096
MAX_LOAD = float(2**53)  # tokens per expert: exact in float64, and far beyond any recording


class PlacementError(ValueError):
    """A placement edit or query refused; the one-line message names the bad value."""


# a row of Placement.migration: copy `expert` of `layer` from (src_device, src_slot) into
# (dst_device, dst_slot); over_link 1 when the devices differ
MIGRATION_FIELDS = ("layer", "expert", "src_device", "src_slot", "dst_device", "dst_slot", "over_link")


class Move(NamedTuple):
    """Copy expert `expert` of `layer` from device `src_device` into slot `dst_slot` of `dst_device`."""
    layer: int
    expert: int
    src_device: int
    dst_device: int
    dst_slot: int


def _index(value, name: str, upper: int, context: str = "") -> int:
    """An int in [0, upper) or a PlacementError naming it (bools and floats are refused too)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise PlacementError(f"{name} {value!r} is not an integer{context}")
    if not 0 <= value < upper:
        raise PlacementError(f"{name} {value} out of range [0, {upper}){context}")
    return int(value)


def _is_tensor(value) -> bool:
    """A torch tensor, known without importing torch: if torch is not loaded, nothing is one."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _count(value, name: str, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise PlacementError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return int(value)


def as_loads(loads, name: str = "loads") -> np.ndarray:
    """[L, E] non-negative finite loads (numpy, torch or nested lists) -> float64 array."""
    if _is_tensor(loads):
        loads = loads.detach().cpu().numpy()
    try:
        arr = np.asarray(loads, dtype=np.float64)
    except (TypeError, ValueError):
        raise PlacementError(f"{name}: not a numeric array") from None
    if arr.ndim != 2:
        raise PlacementError(f"{name}: expected shape [layers, experts], got {list(arr.shape)}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise PlacementError(f"{name}: must be finite and non-negative")
    if arr.size and arr.max() > MAX_LOAD:  # 1e308 is finite, but sums of it overflow the planner
        raise PlacementError(f"{name}: a load of {arr.max():.3g} is more than the {MAX_LOAD:.3g} tokens any count "
                             f"holds")
    if arr.shape[1] > MAX_EXPERTS:
        raise PlacementError(f"{name}: {arr.shape[1]:,} experts a layer; at most {MAX_EXPERTS} are supported")
    return arr


def balancedness(device_loads) -> tuple[np.ndarray, float]:
    """mean device load / max device load, per layer [L] and for the whole step.

    Overall = sum_l mean_l / sum_l max_l. The layers of a step run one after another and each
    waits for its busiest device, so sum_l max_l is the step's MoE time and sum_l mean_l the time
    a perfect balance would take: overall is the fraction of that time spent on useful work (it is
    the per-layer balancedness averaged with weights max_l). Summing loads over layers first would
    let one layer's hot device hide another's and overstate the balance. An idle layer counts 1.
    """
    dl = np.asarray(device_loads.cpu().numpy() if _is_tensor(device_loads) else device_loads,
                    dtype=np.float64)
    if dl.ndim == 1:
        dl = dl[None]
    if dl.ndim != 2 or dl.shape[1] == 0:
        raise PlacementError(f"device_loads: expected shape [layers, devices], got {list(dl.shape)}")
    mean, peak = dl.mean(1), dl.max(1)
    per_layer = np.divide(mean, peak, out=np.ones_like(mean), where=peak > 0)
    total_peak = peak.sum()
    overall = float(mean.sum() / total_peak) if total_peak > 0 else 1.0
    return per_layer, overall


class Placement:
    """Per layer an int64 array [num_devices, slots_per_device] of expert ids (-1 = empty), plus
    the pinned (layer, expert) pairs that the rebalancer must leave where they are."""

    def __init__(self, slots, num_experts: int, pinned: Iterable[tuple[int, int]] = ()):
        num_experts = _count(num_experts, "experts", 1)
        arr = np.array(slots, dtype=np.int64)  # a private copy: callers can't mutate us
        if arr.ndim != 3 or 0 in arr.shape:
            raise PlacementError(f"slots: expected shape [layers, devices, slots_per_device], got {list(arr.shape)}")
        if (arr < -1).any() or (arr >= num_experts).any():
            bad = arr[(arr < -1) | (arr >= num_experts)][0]
            raise PlacementError(f"expert {bad} out of range [0, {num_experts}) in slots")
        L = arr.shape[0]
        counts = _replica_counts(arr, num_experts)
        if (counts == 0).any():
            layer, expert = np.argwhere(counts == 0)[0]
            capacity = arr.shape[1] * arr.shape[2]
            why = f" ({num_experts} experts, {capacity} slots)" if num_experts > capacity else ""
            raise PlacementError(f"expert {expert} of layer {layer} has no replica{why}")
        arr.setflags(write=False)
        counts.setflags(write=False)
        self._slots = arr
        self._counts = counts
        self.num_experts = num_experts
        self.pinned = frozenset((_index(l, "layer", L), _index(e, "expert", num_experts)) for l, e in pinned)
        self._cache: dict = {}

    # ---- construction and serialisation ---------------------------------------------------

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, num_devices: int,
                   redundant_slots_per_device: int = 0) -> Placement:
        """The naive default: experts 0..E/D-1 on device 0 and so on; redundant slots empty."""
        L = _count(num_layers, "layers", 1)
        E = _count(num_experts, "experts", 1)
        D = _count(num_devices, "devices", 1)
        R = _count(redundant_slots_per_device, "redundant slots per device", 0)
        base = -(-E // D)
        layer = np.full(D * base, -1, dtype=np.int64)
        layer[:E] = np.arange(E)
        layer = layer.reshape(D, base)
        layer = np.concatenate([layer, np.full((D, R), -1, dtype=np.int64)], axis=1)
        return cls(np.broadcast_to(layer, (L, D, base + R)), E)

    def to_dict(self) -> dict:
        """JSON-serialisable (trace headers); from_dict(to_dict()) round-trips."""
        return {"num_experts": self.num_experts, "num_devices": self.num_devices,
                "slots_per_device": self.slots_per_device, "layers": self._slots.tolist(),
                "pinned": sorted([l, e] for l, e in self.pinned)}

    @classmethod
    def from_dict(cls, raw: dict) -> Placement:
        if not isinstance(raw, dict):
            raise PlacementError("placement: expected an object")
        for key in ("num_experts", "layers"):
            if key not in raw:
                raise PlacementError(f"placement: missing key {key!r}")
        try:
            slots = np.array(raw["layers"], dtype=np.int64)
        except (TypeError, ValueError):
            raise PlacementError("placement: 'layers' must be a [layers][devices][slots] array of ints") from None
        experts = raw["num_experts"]
        if isinstance(experts, bool) or not isinstance(experts, int) or not 1 <= experts <= MAX_EXPERTS:
            raise PlacementError(f"placement: num_experts must be an integer in 1-{MAX_EXPERTS}, got {experts!r}")
        pinned = raw.get("pinned", [])
        if not isinstance(pinned, list) or any(not isinstance(p, (list, tuple)) or len(p) != 2 for p in pinned):
            raise PlacementError("placement: 'pinned' must be a list of [layer, expert] pairs")
        out = cls(slots, raw["num_experts"], [tuple(p) for p in pinned])
        for key in ("num_devices", "slots_per_device"):
            if key in raw and raw[key] != getattr(out, key):
                raise PlacementError(f"placement: {key} {raw[key]!r} does not match 'layers' ({getattr(out, key)})")
        return out

    # ---- queries -----------------------------------------------------------------------------

    @property
    def slots(self) -> np.ndarray:
        """Read-only [L, D, S] expert ids."""
        return self._slots

    @property
    def num_layers(self) -> int:
        return self._slots.shape[0]

    @property
    def num_devices(self) -> int:
        return self._slots.shape[1]

    @property
    def slots_per_device(self) -> int:
        return self._slots.shape[2]

    @property
    def slot_count(self) -> int:
        """Physical slots per layer (devices x slots per device)."""
        return self.num_devices * self.slots_per_device

    def replica_counts(self) -> np.ndarray:
        """Read-only [L, E] number of replicas of each expert."""
        return self._counts

    def replicas(self, layer: int, expert: int) -> list[tuple[int, int]]:
        """(device, slot) of every replica of the expert, in device order."""
        layer, expert = self._check(layer, expert)
        return [(int(d), int(s)) for d, s in np.argwhere(self._slots[layer] == expert)]

    def experts_on(self, layer: int, device: int) -> list[int]:
        layer = _index(layer, "layer", self.num_layers)
        device = _index(device, "device", self.num_devices)
        row = self._slots[layer, device]
        return row[row >= 0].tolist()

    def free_slots(self, layer: int, device: int) -> int:
        layer = _index(layer, "layer", self.num_layers)
        device = _index(device, "device", self.num_devices)
        return int((self._slots[layer, device] < 0).sum())

    def is_pinned(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.pinned

    def held(self) -> np.ndarray:
        """Read-only [L, D, E] bool: does the device hold a replica of the expert."""
        if "held" not in self._cache:
            L, D, _ = self._slots.shape
            held = np.zeros((L, D, self.num_experts + 1), dtype=bool)
            l, d = np.indices(self._slots.shape[:2])
            held[l[..., None], d[..., None], self._slots + 1] = True  # column 0 catches the empties
            held = held[:, :, 1:]
            held.setflags(write=False)
            self._cache["held"] = held
        return self._cache["held"]

    def _held_by_expert(self) -> np.ndarray:
        """held() as [L, E, D], so one expert's devices are a contiguous row."""
        if "held_t" not in self._cache:
            self._cache["held_t"] = np.ascontiguousarray(self.held().transpose(0, 2, 1))
        return self._cache["held_t"]

    def device_expert_bytes(self, expert_bytes: int) -> np.ndarray:
        """[D] bytes of expert weights each device holds over all layers (occupied slots only)."""
        return (self._slots >= 0).sum(axis=(0, 2)).astype(np.int64) * int(expert_bytes)

    def check_hbm(self, expert_bytes: int, budget_bytes: int | None) -> None:
        """Refuse a placement whose experts overflow a device's HBM budget for experts."""
        if budget_bytes is None:
            return
        used = self.device_expert_bytes(expert_bytes)
        worst = int(used.argmax())
        if used[worst] > budget_bytes:
            raise PlacementError(f"device {worst}: experts need {int(used[worst])} bytes, over the "
                                 f"HBM budget of {int(budget_bytes)} bytes")

    def __eq__(self, other) -> bool:
        return (isinstance(other, Placement) and self.num_experts == other.num_experts
                and self.pinned == other.pinned and self._slots.shape == other._slots.shape
                and bool((self._slots == other._slots).all()))

    def __hash__(self):
        return hash((self.num_experts, self._slots.shape, self._slots.tobytes(), self.pinned))

    def __repr__(self) -> str:
        return (f"Placement(layers={self.num_layers}, experts={self.num_experts}, devices={self.num_devices}, "
                f"slots_per_device={self.slots_per_device}, pinned={len(self.pinned)})")

    # ---- operator edits (each returns a new Placement) ----------------------------------------

    def _check(self, layer, expert) -> tuple[int, int]:
        layer = _index(layer, "layer", self.num_layers)
        return layer, _index(expert, "expert", self.num_experts, f" (layer {layer})")

    def _where(self, layer: int, expert: int, device) -> tuple[int, int]:
        """(device, slot) of the expert's replica on the device, or refuse."""
        device = _index(device, "device", self.num_devices, f" (layer {layer})")
        hits = np.flatnonzero(self._slots[layer, device] == expert)
        if hits.size == 0:
            raise PlacementError(f"expert {expert} of layer {layer} is not on device {device}")
        return device, int(hits[0])

    def _free_slot(self, layer: int, device: int) -> int:
        free = np.flatnonzero(self._slots[layer, device] < 0)
        if free.size == 0:
            raise PlacementError(f"device {device} has no free slot in layer {layer} "
                                 f"(all {self.slots_per_device} hold experts; drop a replica or swap)")
        return int(free[0])

    def _not_pinned(self, layer: int, expert: int) -> None:
        if (layer, expert) in self.pinned:
            raise PlacementError(f"expert {expert} of layer {layer} is pinned; unpin it first")

    def _with(self, slots: np.ndarray, pinned=None) -> Placement:
        return Placement(slots, self.num_experts, self.pinned if pinned is None else pinned)

    def move(self, layer: int, expert: int, src_device: int, dst_device: int) -> Placement:
        """Move one replica to a free slot of another device."""
        layer, expert = self._check(layer, expert)
        self._not_pinned(layer, expert)
        src, src_slot = self._where(layer, expert, src_device)
        dst = _index(dst_device, "device", self.num_devices, f" (layer {layer})")
        if (self._slots[layer, dst] == expert).any():
            raise PlacementError(f"expert {expert} of layer {layer} is already on device {dst}")
        dst_slot = self._free_slot(layer, dst)
        slots = self._slots.copy()
        slots[layer, src, src_slot] = -1
        slots[layer, dst, dst_slot] = expert
        return self._with(slots)

    def swap(self, layer: int, expert_a: int, device_a: int, expert_b: int, device_b: int) -> Placement:
        """Exchange two experts between devices (the way to move when no slot is free)."""
        layer, expert_a = self._check(layer, expert_a)
        _, expert_b = self._check(layer, expert_b)
        self._not_pinned(layer, expert_a)
        self._not_pinned(layer, expert_b)
        da, sa = self._where(layer, expert_a, device_a)
        db, sb = self._where(layer, expert_b, device_b)
        if da == db:
            raise PlacementError(f"experts {expert_a} and {expert_b} of layer {layer} are both on device {da}")
        for expert, dst in ((expert_a, db), (expert_b, da)):
            if (self._slots[layer, dst] == expert).any():
                raise PlacementError(f"expert {expert} of layer {layer} is already on device {dst}")
        slots = self._slots.copy()
        slots[layer, da, sa], slots[layer, db, sb] = expert_b, expert_a
        return self._with(slots)

    def replicate(self, layer: int, expert: int, device: int, expert_bytes: int = 0,
                  hbm_budget_bytes: int | None = None) -> Placement:
        """Add a replica in a free slot of `device` (checked against the HBM budget if given)."""
        layer, expert = self._check(layer, expert)
        self._not_pinned(layer, expert)
        device = _index(device, "device", self.num_devices, f" (layer {layer})")
        if (self._slots[layer, device] == expert).any():
            raise PlacementError(f"expert {expert} of layer {layer} is already on device {device}")
        slots = self._slots.copy()
        slots[layer, device, self._free_slot(layer, device)] = expert
        out = self._with(slots)
        out.check_hbm(expert_bytes, hbm_budget_bytes)
        return out

    def drop_replica(self, layer: int, expert: int, device: int) -> Placement:
        layer, expert = self._check(layer, expert)
        self._not_pinned(layer, expert)
        device, slot = self._where(layer, expert, device)
        if self._counts[layer, expert] == 1:
            raise PlacementError(f"expert {expert} of layer {layer}: device {device} holds its last replica")
        slots = self._slots.copy()
        slots[layer, device, slot] = -1
        return self._with(slots)

    def pin(self, layer: int, expert: int) -> Placement:
        return self._with(self._slots, self.pinned | {self._check(layer, expert)})

    def unpin(self, layer: int, expert: int) -> Placement:
        return self._with(self._slots, self.pinned - {self._check(layer, expert)})

    # ---- analysis -------------------------------------------------------------------------

    def slot_loads(self, loads) -> np.ndarray:
        """[..., L, E] expert loads -> [..., L, D, S], each slot's load under the one replica rule:
        an expert's load split evenly over its replicas (what the engine's least-loaded and
        round-robin policies do on average); an empty slot carries none. Every device-load figure
        (planning, trace analysis, step-time prediction, the console) derives from it."""
        arr = np.asarray(loads, dtype=np.float64)
        if arr.shape[-2:] != (self.num_layers, self.num_experts):
            raise PlacementError(f"loads: shape {list(arr.shape)} does not match the placement "
                                 f"[{self.num_layers}, {self.num_experts}]")
        per_replica = arr / self._counts
        # a zero column appended at index E turns empty slots (-1) into zero load
        per_replica = np.concatenate([per_replica, np.zeros(arr.shape[:-1] + (1,))], axis=-1)
        l = np.arange(self.num_layers)[:, None, None]
        return per_replica[..., l, self._slots]

    def device_loads(self, loads) -> np.ndarray:
        """[L, E] expert loads -> [L, D] device loads (slot_loads summed over each device's slots)."""
        return self.slot_loads(as_loads(loads)).sum(axis=-1)

    def replica_shares(self) -> np.ndarray:
        """[L, E, D]: the share of each expert's load each device computes (slot_loads of a unit
        load, gathered by expert), for figures that need the rule as a matrix."""
        if "shares" not in self._cache:
            L, D, S = self._slots.shape
            E = self.num_experts
            shares = np.zeros((L, E + 1, D))
            l, d = np.broadcast_to(np.arange(L)[:, None, None], (L, D, S)), np.broadcast_to(
                np.arange(D)[None, :, None], (L, D, S))
            np.add.at(shares, (l, np.where(self._slots < 0, E, self._slots), d), self.slot_loads(np.ones((L, E))))
            shares = shares[:, :E]
            shares.setflags(write=False)
            self._cache["shares"] = shares
        return self._cache["shares"]

    def balancedness(self, loads) -> tuple[np.ndarray, float]:
        return balancedness(self.device_loads(loads))

    def moves_to(self, other: Placement, expert_bytes: int = 0,
                 devices_per_node: int | None = None) -> tuple[list[Move], int]:
        """What it takes to go from this placement to `other`: one Move per slot of `other` that
        gets an expert its device did not hold before (each costs expert_bytes). An expert that
        only changes slot on the same device is a local copy and costs nothing on the links. The
        source is a current replica, on the destination's node when there is one."""
        rows = self.move_array(other, devices_per_node)
        return [Move(*r) for r in rows.tolist()], len(rows) * int(expert_bytes)

    def migration(self, other: Placement, devices_per_node: int | None = None) -> np.ndarray:
        """The one migration plan from this placement to `other`, which every backend executes
        and every preview counts: int64 [M, 7] rows of MIGRATION_FIELDS, one per slot of `other`
        whose expert changes (empty slots excepted), ordered by (layer, device, slot). The
        source is a slot of the destination device that holds the expert already (a copy within
        the device: over_link 0), else a replica on another device, on the destination's node
        when there is one, the lowest such device, in its first slot holding the expert."""
        self._check_same_shape(other)
        old, new = self._slots, other.slots
        layer, device, slot = np.nonzero((new != _slots_like(old, new.shape[2])) & (new >= 0))
        expert = new[layer, device, slot]
        held = self._held_by_expert()[layer, expert]  # [M, D] devices holding each expert now
        here = held[np.arange(layer.size), device] if layer.size else np.zeros(0, dtype=bool)
        score = held.astype(np.int8) + 2 * (held & (np.arange(self.num_devices)[None, :] == device[:, None]))
        if devices_per_node:
            node = np.arange(self.num_devices) // devices_per_node
            score = score + (held & (node[None, :] == node[device][:, None]))
        src = score.argmax(1) if layer.size else layer
        src_slot = (old[layer, src, :] == expert[:, None]).argmax(1) if layer.size else layer
        return np.stack([layer, expert, src, src_slot, device, slot, (~here).astype(np.int64)], axis=1)

    def move_array(self, other: Placement, devices_per_node: int | None = None) -> np.ndarray:
        """moves_to's moves as an int64 array [M, 5] of Move fields (cheap for 10^4+ moves): the
        migration's rows that cross a link."""
        m = self.migration(other, devices_per_node)
        return m[m[:, 6] == 1][:, [0, 1, 2, 4, 5]]

    def bytes_to(self, other: Placement, expert_bytes: int) -> int:
        """moves_to's byte count: the migration's copies over links."""
        return int(self._arrivals(other)[0].size) * int(expert_bytes)

    def local_copies(self, other: Placement) -> int:
        """The migration's copies within a device (an expert the device holds, into another of
        its slots): no link carries them, but they are copies all the same."""
        return int((self.migration(other)[:, 6] == 0).sum())

    def _check_same_shape(self, other: Placement) -> None:
        if not isinstance(other, Placement):
            raise PlacementError("moves_to: expected a Placement")
        if (other.num_layers, other.num_experts, other.num_devices) != \
                (self.num_layers, self.num_experts, self.num_devices):
            raise PlacementError("moves_to: placements differ in layers, experts or devices")

    def _arrivals(self, other: Placement):
        """(layer, device, slot, expert) of every slot of `other` whose device did not hold its
        expert: the migration's rows over links, without its sources."""
        self._check_same_shape(other)
        new = other.slots
        l, d = np.indices(new.shape[:2])
        arrives = (new >= 0) & ~self.held()[l[..., None], d[..., None], np.maximum(new, 0)]
        layer, device, slot = np.nonzero(arrives)
        return layer, device, slot, new[layer, device, slot]

def migration_in(old: Placement, new: Placement, layers) -> np.ndarray:
    """old.migration(new)'s rows for these layers only (the MoE layers: a dense layer's row holds
    no experts to copy)."""
    plan = old.migration(new)
    return plan[np.isin(plan[:, 0], np.asarray(list(layers), dtype=np.int64))]


def _slots_like(slots: np.ndarray, slots_per_device: int) -> np.ndarray:
    """[L, D, S] slots cut or padded with empty slots (-1) to `slots_per_device` a device: a
    placement with more spare slots compared slot by slot with one with fewer."""
    have = slots.shape[2]
    if have >= slots_per_device:
        return slots[:, :, :slots_per_device]
    pad = np.full((*slots.shape[:2], slots_per_device - have), -1, dtype=slots.dtype)
    return np.concatenate([slots, pad], axis=2)


def expert_nbytes(experts) -> int:
    """Bytes of one expert of a StackedExperts (w13 [E, 2I, H] + w2 [E, H, I])."""
    return sum(p[0].numel() * p.element_size() for p in (experts.w13, experts.w2))


def _replica_counts(slots: np.ndarray, num_experts: int) -> np.ndarray:
    L = slots.shape[0]
    flat = slots.reshape(L, -1)
    key = (np.arange(L)[:, None] * (num_experts + 1) + flat + 1).ravel()
    return np.bincount(key, minlength=L * (num_experts + 1)).reshape(L, num_experts + 1)[:, 1:]
