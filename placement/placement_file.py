"""The one placement file every command reads and writes.

A placement file is JSON: Placement.to_dict (one row per model layer; a dense layer's row is the
contiguous layout, never used) plus "model", the model it was planned for (model_identity), when
the planner knew one. `plan rebalance --json` writes it as its result's "placement"; a trace's
header and its rebalance actions hold the same object. read_placement_file takes a bare one or a
plan result, and fit_to_model checks it against the model a command runs (or a trace recorded):
one planned for another model is refused, one with a row per MoE layer only (vLLM's layer
indexing, or a plan written before every-layer rows) gets the dense layers' rows filled in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from moectl.placement.placement import MAX_EXPERTS, Placement, PlacementError

# what makes a placement fit a model: these equal, a placement is about the same expert tables
# (the name is only for messages: a checkpoint copied elsewhere is the same model)
IDENTITY_KEYS = ("architecture", "num_experts", "top_k", "hidden_size", "sparse_layers")


class ModelShape(Protocol):
    """What model_identity reads of a model: the engine's ModelConfig, or the simulator's shape."""
    @property
    def hf_architecture(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def sparse_layers(self) -> tuple[bool, ...]: ...


def model_identity(cfg: ModelShape, name: str | None = None) -> dict:
    return {"name": name, "architecture": cfg.hf_architecture, "num_layers": cfg.num_layers,
            "num_experts": cfg.num_experts, "top_k": cfg.top_k, "hidden_size": cfg.hidden_size,
            "sparse_layers": list(cfg.sparse_layers)}


def identity_from_header(header: dict) -> dict | None:
    """The model identity a trace header records (profiler/recorder.py engine_header, or an
    import's: there the unknown fields are None and vLLM's rows are MoE layers only)."""
    model = header.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("num_layers"), int):
        return None
    identity = {k: model.get(k) for k in ("name", "num_layers", *IDENTITY_KEYS)}
    if (header.get("imported") or {}).get("layer_indexing") == "moe":
        identity["layer_indexing"] = "moe"
    return identity


def placement_document(placement: Placement, model: dict | None) -> dict:
    """Placement.to_dict, with the model it was planned for when known."""
    out = placement.to_dict()
    if model is not None:
        out["model"] = model
    return out


def read_placement_file(path) -> tuple[Placement, dict | None]:
    """(the placement, the model it was planned for or None) from a placement file or a
    `plan rebalance --json` result. PlacementError names what is wrong and the field, without
    the path."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlacementError("no such file") from None
    except IsADirectoryError:
        raise PlacementError("is a directory, not a placement file") from None
    except RecursionError:
        raise PlacementError("not JSON (nested too deeply)") from None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON, an integer of 5,000 digits
        raise PlacementError(f"not JSON ({exc})") from None
    if isinstance(raw, dict) and isinstance(raw.get("placement"), dict):
        raw = raw["placement"]  # a plan result
    _check_ids(raw)
    placement = Placement.from_dict(raw)
    model = raw.get("model")
    if model is not None and (not isinstance(model, dict) or not isinstance(model.get("num_layers"), int)):
        raise PlacementError("placement: 'model' must be an object with num_layers (the model it was planned for)")
    return placement, model


def _check_ids(raw) -> None:
    """Every expert id in 'layers' and every pair in 'pinned' a JSON integer in range, before
    numpy reads them: it would truncate 1.5 to 1, read "3" as 3 and overflow on 1e20. The error
    names the field ('layers[0][2][1]')."""
    if not isinstance(raw, dict):
        return  # Placement.from_dict says what is wrong with it
    experts = raw.get("num_experts")
    if isinstance(experts, bool) or not isinstance(experts, int) or not 1 <= experts <= MAX_EXPERTS:
        return  # ... and with this
    layers = raw.get("layers")
    if not isinstance(layers, list):
        return
    for li, layer in enumerate(layers):
        for di, device in enumerate(layer if isinstance(layer, list) else [layer]):
            for si, expert in enumerate(device if isinstance(device, list) else [device]):
                _check_id(f"layers[{li}][{di}][{si}]", "expert", expert, -1, experts, " (-1: an empty slot)")
    pinned = raw.get("pinned", [])
    for i, pair in enumerate(pinned if isinstance(pinned, list) else []):
        if isinstance(pair, list) and len(pair) == 2:
            _check_id(f"pinned[{i}]", "layer", pair[0], 0, len(layers))
            _check_id(f"pinned[{i}]", "expert", pair[1], 0, experts)


def _check_id(field: str, what: str, value, low: int, upper: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlacementError(f"placement: {field}: must be an integer {what} id in [{low}, {upper - 1}]{note}, "
                             f"got {value!r}")
    if not low <= value < upper:
        raise PlacementError(f"placement: {field}: {what} {value} out of range [{low}, {upper - 1}]{note}")


def fit_to_model(placement: Placement, planned_for: dict | None, model: dict) -> Placement:
    """The placement for `model` (a model_identity): refused, with a PlacementError naming both,
    when planned for another model or shaped for another; a row per MoE layer is widened to one
    per layer."""
    by_moe_layer = planned_for is not None and planned_for.get("layer_indexing") == "moe"
    if planned_for is not None:
        keys = [k for k in IDENTITY_KEYS if not (by_moe_layer and k == "sparse_layers")]
        differ = [k for k in keys if planned_for.get(k) is not None and model.get(k) is not None
                  and planned_for[k] != model[k]]
        if differ:
            raise PlacementError(f"planned for {_describe(planned_for)}, not this model, {_describe(model)} "
                                 f"({', '.join(differ)} differ)")
    if placement.num_experts != model["num_experts"]:
        raise PlacementError(f"{placement.num_experts} experts per layer, the model has {model['num_experts']}")
    sparse = model.get("sparse_layers") or [True] * model["num_layers"]
    moe_layers = [i for i, s in enumerate(sparse) if s]
    if placement.num_layers == len(sparse):
        return placement
    if placement.num_layers == len(moe_layers):
        return _widen(placement, moe_layers, len(sparse))
    raise PlacementError(f"{placement.num_layers} layers, the model has {len(sparse)} "
                         f"({len(moe_layers)} of them MoE)")


def _widen(placement: Placement, moe_layers: list[int], num_layers: int) -> Placement:
    """Rows for MoE layers only -> a row for every layer, dense layers contiguous (unused)."""
    import numpy as np

    D, S, E = placement.num_devices, placement.slots_per_device, placement.num_experts
    filler = Placement.contiguous(1, E, D, S - -(-E // D)).slots[0]
    slots = np.broadcast_to(filler, (num_layers, D, S)).copy()
    slots[moe_layers] = placement.slots
    pinned = [(moe_layers[layer], expert) for layer, expert in placement.pinned]
    return Placement(slots, E, pinned)


def _describe(model: dict) -> str:
    shape = f"{sum(model['sparse_layers']) if model.get('sparse_layers') else '?'} MoE of {model['num_layers']} " \
            f"layers x {model.get('num_experts')} experts"
    name = model.get("name")
    arch = model.get("architecture")
    return " ".join(p for p in (repr(name) if name else None, f"({arch}, {shape})" if arch else f"({shape})") if p)
