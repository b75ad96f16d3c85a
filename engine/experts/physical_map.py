"""A Placement as the engines people run write it down: a physical-to-logical map.

SGLang (python/sglang/srt/eplb/expert_location.py) and vLLM (vllm/distributed/eplb/eplb_state.py)
both keep, per MoE layer, an int row `physical_to_logical_map[layer, p]` = the logical expert in
physical slot p, and both put physical slot p on EP rank p // num_local_physical_experts (SGLang's
`_compute_gpu_id_of_physical_expert`; vLLM's rank r holds slots [r * local, (r + 1) * local)). So a
[L, D, S] Placement and an [L, D * S] map are the same table read in device-major order; neither
engine has empty slots (every physical slot holds some logical expert). docs/external_load.md
names the versions read.
"""

from __future__ import annotations

import numpy as np

from moectl.placement.placement import Placement, PlacementError


def placement_from_physical_map(physical_to_logical, num_experts: int, num_devices: int) -> Placement:
    """[L, P] logical expert of each physical slot, P = num_devices x slots per device -> Placement.
    Refuses (PlacementError) a map whose slots do not split evenly over the devices, or that
    leaves a logical expert without any physical slot (neither engine would start with it)."""
    p2l = np.asarray(physical_to_logical)
    if p2l.ndim != 2 or 0 in p2l.shape:
        raise PlacementError(f"physical_to_logical_map: expected shape [layers, physical experts], got {list(p2l.shape)}")
    if not np.issubdtype(p2l.dtype, np.integer):
        raise PlacementError(f"physical_to_logical_map: expected integers, got {p2l.dtype}")
    layers, physical = p2l.shape
    if num_devices < 1 or physical % num_devices:
        raise PlacementError(f"physical_to_logical_map: {physical} physical experts do not split over "
                             f"{num_devices} devices")
    if (p2l < 0).any():
        raise PlacementError("physical_to_logical_map: holds a negative expert id (the engines leave no slot empty)")
    return Placement(p2l.reshape(layers, num_devices, physical // num_devices), num_experts)


def fill_empty_slots(placement: Placement, loads) -> tuple[Placement, int]:
    """The placement with every empty slot holding a replica, and how many slots that took.

    moectl's plans may leave redundant slots empty (a layer already balanced keeps its placement
    rather than copy experts). Neither engine can: each physical slot holds a logical expert. A
    replica takes its share of its expert's load (the replica rule): it adds load to the slot's
    device and takes some off the expert's other devices. Each empty slot gets the expert after which
    the layer's busiest device is lightest (ties: the lowest id). A second copy of an expert whose
    replicas all sit on that device changes no load, so filling never makes the busiest device busier
    when the device holds such an expert (it costs memory, not balance)."""
    W = np.asarray(loads, dtype=np.float64)
    slots = placement.slots.copy()
    E = placement.num_experts
    filled = 0
    for layer in np.unique(np.argwhere(slots < 0)[:, 0]):
        held = np.zeros((placement.num_devices, E + 1))  # [D, E] replicas per device; column E: empty slots
        np.add.at(held, (np.arange(placement.num_devices)[:, None], slots[layer]), 1)
        held = held[:, :E]
        for device, slot in np.argwhere(slots[layer] < 0):
            counts = held.sum(0)
            share = W[layer] / np.maximum(counts, 1)
            device_load = held @ share
            after = device_load[:, None] - held * (share - W[layer] / (counts + 1))  # [D, E]: each candidate
            after[device] += W[layer] / (counts + 1)
            expert = int(np.argmin(after.max(0)))  # argmin: the lowest id of equal ones
            slots[layer, device, slot] = expert
            held[device, expert] += 1
            filled += 1
    return Placement(slots, E, placement.pinned), filled


def physical_map(placement: Placement) -> np.ndarray:
    """The placement's [L, D * S] int64 physical-to-logical map. Refuses empty slots (the engines
    have none; fill_empty_slots fills them)."""
    slots = placement.slots
    empty = np.argwhere(slots < 0)
    if len(empty):
        layer, device, _ = empty[0]
        raise PlacementError(f"the placement leaves {len(empty)} slot(s) empty (first: layer {layer}, device "
                             f"{device}); SGLang and vLLM fill every physical slot")
    return slots.reshape(placement.num_layers, -1).astype(np.int64)


SGLANG_SUFFIXES = (".json", ".pt")


def write_sglang_location(placement: Placement, path) -> dict:
    """The file SGLang's `--init-expert-location` reads (compute_initial_expert_location_metadata):
    a .json or torch.save'd .pt dict holding exactly `physical_to_logical_map` [layers, physical
    experts] (the loader passes the dict as keyword arguments to init_by_mapping, so no other key
    may be there). Returns what the SGLang command line must say to match it."""
    from pathlib import Path

    path = Path(path)
    if path.suffix not in SGLANG_SUFFIXES:
        raise PlacementError(f"SGLang's --init-expert-location reads .pt or .json files, got {path.name!r}")
    p2l = physical_map(placement)
    if path.suffix == ".pt":
        import torch

        torch.save({"physical_to_logical_map": torch.from_numpy(p2l)}, path)
    else:
        import json

        path.write_text(json.dumps({"physical_to_logical_map": p2l.tolist()}))
    return {"file": str(path), "layers": placement.num_layers, "physical_experts": int(p2l.shape[1]),
            "ep_size": placement.num_devices,
            "ep_num_redundant_experts": int(p2l.shape[1]) - placement.num_experts,
            "flags": f"--init-expert-location {path} --ep-size {placement.num_devices} "
                     f"--ep-num-redundant-experts {int(p2l.shape[1]) - placement.num_experts}"}


VLLM_FORMAT = "moectl-vllm-placement/1"


def write_vllm_placement(placement: Placement, path, loads=None, moe_layers=None) -> dict:
    """vLLM (as read, docs/external_load.md) loads no placement at start: its EplbState starts from
    [0..E-1, redundant copies] and only its elastic-EP path hands `global_expert_load`
    [num_moe_layers, num_logical_experts] int64 to EplbState.add_model. The closest thing, as
    JSON: the plan's physical_to_logical_map over the MoE layers (vLLM counts MoE layers only),
    that global_expert_load (when the loads are whole token counts) and the eplb_config values
    that size vLLM's physical experts to the plan."""
    import json
    from pathlib import Path

    path = Path(path)
    if path.suffix != ".json":
        raise PlacementError(f"the vLLM placement file is JSON: give a .json name, got {path.name!r}")
    rows = list(range(placement.num_layers)) if moe_layers is None else [int(i) for i in moe_layers]
    p2l = physical_map(placement)[rows]  # vLLM's rows: its MoE layers only
    E, P = placement.num_experts, int(p2l.shape[1])
    out = {"format": VLLM_FORMAT, "loadable_by_vllm": False,
           "physical_to_logical_map": p2l.tolist(), "ep_size": placement.num_devices,
           "num_logical_experts": E, "num_redundant_experts": P - E,
           "eplb_config": {"num_redundant_experts": P - E}, "moe_layers_of_plan": rows}
    if loads is not None:
        W = np.asarray(loads, dtype=np.float64)[rows]
        if np.array_equal(W, np.rint(W)):  # vLLM asserts int64 token counts
            out["global_expert_load"] = W.astype(np.int64).tolist()
    path.write_text(json.dumps(out))
    return {"file": str(path), "layers": len(rows), "physical_experts": P, "ep_size": placement.num_devices,
            "num_redundant_experts": P - E,
            "flags": f"--enable-expert-parallel --enable-eplb --eplb-config '{json.dumps(out['eplb_config'])}' "
                     f"(vLLM cannot load the map itself; see docs/external_load.md)"}
