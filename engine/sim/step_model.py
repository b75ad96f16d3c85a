"""One simulated step of an MoE model on a cluster described by a hardware profile: every figure
is modeled (simulated), none measured.

The layout is the seeds' (and DeepSeek's and SGLang's large-scale deployments'): attention data
parallel (each device its own batch; or tensor parallel over `tp` devices, whose group then holds
`tp` devices' tokens), routed experts expert-parallel over all devices under a placement, the
tokens' rows sent to their experts' devices and back by all-to-all (dispatch, combine), shared
experts and dense layers on every device for its own tokens.

Each part's time is a roofline with the profile's achieved efficiencies: a GEMM takes the longer
of its multiply-accumulates at (peak x grouped-GEMM efficiency at its rows per expert) and its
weights streamed at (HBM bandwidth x memory-bound efficiency); attention the longer of its core
work at the BF16 peak and its KV reads at HBM bandwidth, each at the attention kernel's
efficiencies; an all-to-all its busiest link's bytes at the link's achieved bandwidth plus a
latency. Expert rows per device come from the routing shares and the placement (replicas share
an expert's rows evenly). Every device syncs at dispatch and combine, so a layer's expert time
is its slowest device's; that is where balance shows.

Two-batch overlap splits the batch in two and hides one half's all-to-all behind the other's
compute, the halves pipelined across layers: a MoE layer takes max(2c, 2m) for one half's compute
c and communication m, and the pipeline fills once per step (+ min(c, m) of the first layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from moectl.engine.experts.placement import Placement
from moectl.engine.sim.hardware import HardwareProfile
from moectl.engine.sim.model_shape import SimModel

MAX_SIM_DEVICES = 1024
PHASES = ("prefill", "decode")
OVERLAPS = ("none", "two-batch")
PARTS = ("attention", "router", "dispatch", "expert_gemm", "combine", "shared_dense", "lm_head", "idle")


@dataclass
class SimSpec:
    model: SimModel
    hardware: HardwareProfile
    devices: int
    routing: np.ndarray  # [MoE layers, experts]: each expert's share of a layer's (token, choice) pairs
    phase: str = "decode"
    tokens_per_device: int = 128  # decode: sequences (one token each); prefill: prompt tokens
    context: int = 4096  # decode: KV length; prefill: prompt length
    tp: int = 1  # attention tensor parallel (1: data-parallel attention)
    ep: int | None = None  # expert-parallel group size (default: all devices); groups run alike
    placement: Placement | None = None  # over one EP group's devices; default contiguous
    overlap: str = "none"
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        m = self.model.shape
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) \
                or not 1 <= self.devices <= MAX_SIM_DEVICES:
            raise ValueError(f"--devices: must be an integer in [1, {MAX_SIM_DEVICES}], got {self.devices!r}")
        if self.phase not in PHASES:
            raise ValueError(f"--phase: {self.phase!r} is not one of {', '.join(PHASES)}")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"--overlap: {self.overlap!r} is not one of {', '.join(OVERLAPS)}")
        if not isinstance(self.tp, int) or self.tp < 1 or self.devices % self.tp or m.num_heads % self.tp:
            raise ValueError(f"--tp: {self.tp!r} must divide both the {self.devices} devices and the model's "
                             f"{m.num_heads} heads")
        if not isinstance(self.tokens_per_device, int) or self.tokens_per_device < 1:
            flag = "--batch-seqs" if self.phase == "decode" else "--batch-tokens"
            raise ValueError(f"{flag}: must be a positive integer per device, got {self.tokens_per_device!r}")
        if not isinstance(self.context, int) or not 1 <= self.context <= m.max_position_embeddings:
            raise ValueError(f"--context: must be in [1, {m.max_position_embeddings}] (the model's "
                             f"max_position_embeddings), got {self.context!r}")
        self.ep = self.devices if self.ep is None else self.ep
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1 or self.devices % self.ep \
                or self.ep % self.tp:
            raise ValueError(f"--ep: {self.ep!r} must divide the {self.devices} devices and be a multiple of --tp")
        per_node = self.hardware.gpus_per_node
        if self.ep % per_node and per_node % self.ep:
            raise ValueError(f"--ep: {self.ep} must be a multiple or a divisor of the {per_node} devices per node, so "
                             f"that every expert-parallel group spans nodes alike")
        if self.tp > per_node:
            raise ValueError(f"--tp: {self.tp} exceeds the {per_node} devices of a node")
        if self.routing.shape != (m.num_sparse, m.num_experts):
            raise ValueError(f"routing: expected [{m.num_sparse}, {m.num_experts}] shares, got {list(self.routing.shape)}")
        if self.placement is None:
            self.placement = Placement.contiguous(m.num_sparse, m.num_experts, self.ep)
        if (self.placement.num_devices, self.placement.num_layers, self.placement.num_experts) != \
                (self.ep, m.num_sparse, m.num_experts):
            raise ValueError(f"--placement: is for {self.placement.num_devices} devices x {self.placement.num_layers} "
                             f"MoE layers x {self.placement.num_experts} experts, not {self.ep} x {m.num_sparse} x "
                             f"{m.num_experts} (one expert-parallel group)")


class Roofline:
    """Part times on one device of `hw` for `model`, in seconds."""

    def __init__(self, model: SimModel, hw: HardwareProfile):
        self.model, self.hw = model, hw
        self.peak = hw.peak_tflops(model.gemm_dtype) * 1e12  # fp8 falls back to bf16 without FP8
        self.bf16 = hw.bf16_tflops * 1e12
        self.hbm = hw.need("hbm_gbps") * 1e9

    def gemms(self, rows, macs_per_row: float, weight_bytes: float, bf16: bool = False) -> np.ndarray:
        """One GEMM per entry of `rows` (0 rows cost nothing). Rows may be an expectation below 1
        (an expert's share of a small batch): its weights are then streamed only when it is hit,
        with probability 1 - exp(-rows)."""
        rows = np.asarray(rows, dtype=np.float64)
        safe = np.maximum(rows, 1e-12)
        peak = self.bf16 if bf16 else self.peak
        compute = 2 * safe * macs_per_row / (peak * self.hw.grouped_gemm.at_many(safe))
        stream = weight_bytes * -np.expm1(-safe) / (self.hbm * self.hw.memory_bound_gemm)
        return np.where(rows > 0, np.maximum(compute, stream), 0.0)

    def gemm(self, rows: float, macs_per_row: float, weight_bytes: float, bf16: bool = False) -> float:
        return float(self.gemms(rows, macs_per_row, weight_bytes, bf16))

    def links(self, intra_bytes, inter_bytes) -> np.ndarray:
        """One all-to-all per entry: the seconds of the device whose links carry these bytes
        (NVLink and NIC at once). A link with no bytes needs no bandwidth figure."""
        intra = np.asarray(intra_bytes, dtype=np.float64)
        inter = np.asarray(inter_bytes, dtype=np.float64)
        t_intra = intra / (self.hw.need("intra_node_gbps") * 1e9 * self.hw.a2a_intra_node) if intra.any() \
            else np.zeros_like(intra)
        t_inter = inter / (self.hw.need("inter_node_gbps") * 1e9 * self.hw.a2a_inter_node) if inter.any() \
            else np.zeros_like(inter)
        busy = (intra > 0) | (inter > 0)
        return np.where(busy, np.maximum(t_intra, t_inter) + self.hw.a2a_latency_us * 1e-6, 0.0)

    def link(self, intra_bytes: float, inter_bytes: float) -> float:
        return float(self.links(intra_bytes, inter_bytes))

    def attention_core(self, tokens: float, macs_per_token: float, kv_bytes: float) -> float:
        compute = 2 * tokens * macs_per_token / (self.bf16 * self.hw.attention_compute)
        return max(compute, kv_bytes / (self.hbm * self.hw.attention_bandwidth))


@dataclass
class LayerTimes:
    """One batch size's per-part seconds: the parts every layer shares, and per MoE layer its
    slowest device's expert GEMMs and all-to-alls."""
    attention: float
    router: float
    shared: float
    dense: float
    lm_head: float
    expert: list[float]  # per MoE layer, the slowest device
    dispatch: list[float]
    combine: list[float]
    device_expert: np.ndarray  # [devices] expert seconds over the MoE layers
    rows: np.ndarray  # [MoE layers, devices] expert rows

    @property
    def moe_compute(self) -> list[float]:
        return [self.attention + self.router + e + self.shared for e in self.expert]

    @property
    def moe_comm(self) -> list[float]:
        return [a + b for a, b in zip(self.dispatch, self.combine)]


def layer_times(spec: SimSpec, tokens_per_device: int) -> LayerTimes:
    """Per-part seconds at this batch, for one expert-parallel group (every group runs alike)."""
    m, hw, D, tp = spec.model, spec.hardware, spec.ep, spec.tp
    shape, roof = m.shape, Roofline(m, hw)
    decode = spec.phase == "decode"
    T = tokens_per_device
    group_tokens = T * tp  # a TP group's tokens; each of its devices does 1/tp of their heads

    # -- attention (every layer: its window where it has one), router, shared and dense: per
    #    device, on its own tokens; KV is read once per sequence and layer
    windows = shape.layer_windows or (0,) * shape.num_layers
    sequences = group_tokens if decode else max(1.0, group_tokens / spec.context)
    _, kv_per_key = m.attention_core(tp, 1, True)
    attention_core = 0.0
    for window in windows:
        keys = min(spec.context, window) if window else spec.context
        # prefill: causal, each token over half its prompt on average
        core_macs, _ = m.attention_core(tp, keys if decode else keys / 2, decode)
        attention_core += roof.attention_core(group_tokens, core_macs, sequences * keys * kv_per_key)
    attention = roof.gemm(group_tokens, m.attention_projection_macs(tp), m.attention_weight_bytes(tp)) \
        + attention_core / len(windows)  # the layers' mean: every layer adds it once
    if tp > 1:  # o_proj's all-reduce within the TP group (ring: 2 (tp - 1) / tp of the data), over NVLink
        attention += roof.link(2 * (tp - 1) / tp * group_tokens * shape.hidden_size * 2, 0.0)
    # the router, embeddings and LM head stay BF16 in fp8 and mxfp4 checkpoints
    router = roof.gemm(T, m.router_macs(), m.router_macs() * 2, bf16=True)
    shared = roof.gemm(T, m.shared_macs(), m.shared_macs() * m.weight_bytes)
    dense = roof.gemm(T, m.dense_macs(), m.dense_macs() * m.weight_bytes)
    lm_head = roof.gemm(T if decode else sequences / tp, m.head_macs(), m.head_macs() * 2, bf16=True)

    # -- MoE layers: rows per device from the routing and the placement, then the all-to-alls
    node_of = np.arange(D) // hw.gpus_per_node
    nodes = int(node_of[-1]) + 1
    same_node = node_of[:, None] == node_of[None, :]
    pairs = T * D * shape.top_k  # (token, choice) pairs of the step, all devices
    fp8 = m.gemm_dtype == "fp8" and hw.fp8_tflops is not None
    dispatch_bytes = shape.hidden_size * (1.0 + 4 / 128 if fp8 else 2.0)  # fp8 rows carry block scales
    combine_bytes = shape.hidden_size * 2.0
    expert, dispatch, combine, rows_all = [], [], [], []
    device_expert = np.zeros(D)
    for layer in range(shape.num_sparse):
        slots = spec.placement.slots[layer]  # [D, S] expert ids, -1 empty
        replicas = np.bincount(slots[slots >= 0], minlength=shape.num_experts)
        share = spec.routing[layer] / np.maximum(replicas, 1)  # each replica's share of the layer's pairs
        rows = np.where(slots >= 0, pairs * share[np.maximum(slots, 0)], 0.0)  # [D, S]
        seconds = roof.gemms(rows, m.expert_macs(), m.expert_bytes()).sum(1)
        device_expert += seconds
        expert.append(float(seconds.max()))
        per_device = rows.sum(1)
        rows_all.append(per_device)
        # every device's tokens route alike: d -> d' carries T * top_k * (d''s share of the pairs)
        to_device = per_device / pairs
        sent = np.tile(T * shape.top_k * to_device, (D, 1))
        np.fill_diagonal(sent, 0.0)
        intra = np.maximum((sent * same_node).sum(1), (sent * same_node).sum(0))
        # across nodes a token's rows travel once per remote node its choices hit (DeepEP's
        # node-level dedup); a device's NIC carries the more of what it sends and what it
        # receives (a hot node's NICs receive from every other node's devices)
        node_share = np.bincount(node_of, weights=to_device, minlength=nodes)
        hit = 1 - (1 - node_share) ** shape.top_k
        inter = np.maximum(T * (hit.sum() - hit[node_of]), T * hit[node_of] * (nodes - 1)) if nodes > 1 \
            else np.zeros(D)
        dispatch.append(float(roof.links(intra * dispatch_bytes, inter * dispatch_bytes).max()))
        combine.append(float(roof.links(intra * combine_bytes, inter * combine_bytes).max()))
    return LayerTimes(attention, router, shared, dense, lm_head, expert, dispatch, combine, device_expert,
                      np.array(rows_all).reshape(shape.num_sparse, D))


def simulate(spec: SimSpec) -> dict:
    """The step's time and what it is made of; see the module's docstring for the model."""
    shape, hw, D, T = spec.model.shape, spec.hardware, spec.devices, spec.tokens_per_device
    groups = spec.devices // spec.ep
    full = layer_times(spec, T)
    if spec.overlap == "two-batch" and T > 1:
        half = layer_times(spec, -(-T // 2))  # the larger half, for both
        # the halves pipeline across layers: each layer takes the longer of both halves' compute
        # and both halves' all-to-alls; the pipeline fills once per step
        moe_layers = [max(2 * c, 2 * mm) for c, mm in zip(half.moe_compute, half.moe_comm)]
        if moe_layers:
            moe_layers[0] += min(half.moe_compute[0], half.moe_comm[0])
    else:
        moe_layers = [c + mm for c, mm in zip(full.moe_compute, full.moe_comm)]
    step = sum(moe_layers) + shape.num_dense * (full.attention + full.dense) + full.lm_head
    busy = shape.num_layers * full.attention + shape.num_sparse * (full.router + full.shared) \
        + shape.num_dense * full.dense + full.lm_head + full.device_expert
    parts = {
        "attention": shape.num_layers * full.attention, "router": shape.num_sparse * full.router,
        "dispatch": sum(full.dispatch), "expert_gemm": sum(full.expert), "combine": sum(full.combine),
        "shared_dense": shape.num_sparse * full.shared + shape.num_dense * full.dense, "lm_head": full.lm_head,
        # the mean device's wait for the slowest one's experts at each layer's combine
        "idle": float(sum(full.expert) - full.device_expert.mean()),
    }
    unhidden = max(0.0, sum(full.moe_compute) + sum(full.moe_comm) - sum(moe_layers))
    balancedness = [r.mean() / r.max() for r in full.rows if r.max() > 0]
    tokens = T * D
    step = float(step)
    return {
        "simulated": True, "phase": spec.phase, "step_ms": step * 1e3,
        "tokens_per_s": tokens / step, "tokens_per_s_per_device": tokens / step / D,
        "tokens_per_s_per_node": tokens / step / D * hw.gpus_per_node,
        "devices": D, "nodes": -(-D // hw.gpus_per_node),
        "utilisation": np.tile(busy / step, groups).tolist(),
        "balancedness": float(np.mean(balancedness)) if balancedness else 1.0,
        "breakdown_ms": {k: float(v) * 1e3 for k, v in parts.items()},
        "overlap_hidden_ms": float(unhidden) * 1e3 if spec.overlap == "two-batch" else 0.0,
    }


def memory_per_device(spec: SimSpec) -> dict:
    """Bytes one device holds: its weights (its share of attention, every shared and dense weight,
    the embeddings and LM head, its expert slots) and its sequences' KV cache at --context;
    activations and communication buffers are not counted."""
    m, shape = spec.model, spec.model.shape
    slots = spec.placement.slots_per_device
    weights = shape.num_layers * m.attention_weight_bytes(spec.tp) \
        + shape.num_sparse * (shape.shared_params() * m.weight_bytes + shape.router_params() * 2) \
        + shape.num_dense * shape.dense_params() * m.weight_bytes + shape.embedding_params() * 2 \
        + shape.num_sparse * slots * m.expert_bytes()  # embeddings, head and router in BF16
    # a TP group's devices each hold the KV of all the group's sequences (their share of the heads;
    # MLA's latent whole)
    tokens = spec.tokens_per_device * spec.tp
    sequences = tokens if spec.phase == "decode" else max(1, tokens // spec.context)
    _, kv_per_key = m.attention_core(spec.tp, 1, True)
    kv = sequences * spec.context * kv_per_key * shape.num_layers
    total = weights + kv
    return {"weights_bytes": int(weights), "kv_bytes": int(kv), "total_bytes": int(total),
            "hbm_bytes": spec.hardware.hbm_bytes, "fits": bool(total <= spec.hardware.hbm_bytes)}


def migration_stall(spec: SimSpec, old: Placement, new: Placement) -> dict:
    """What moving from `old` to `new` costs one expert-parallel group, simulated: the expert
    bytes each device receives over its links (copies within a device are free), the stall being
    the busiest device's, its NVLink and NIC traffic running at once."""
    hw, D = spec.hardware, spec.ep
    rows = old.migration(new, hw.gpus_per_node)  # [layer, expert, src, src_slot, dst, dst_slot, over_link]
    moved = rows[rows[:, 6] == 1]
    per_expert = spec.model.expert_bytes()
    node_of = np.arange(D) // hw.gpus_per_node
    remote = node_of[moved[:, 2]] != node_of[moved[:, 4]]
    intra = np.bincount(moved[~remote, 4], minlength=D) * per_expert
    inter = np.bincount(moved[remote, 4], minlength=D) * per_expert
    roof = Roofline(spec.model, hw)
    seconds = roof.links(intra.astype(float), inter.astype(float))
    return {"experts_moved": int(len(moved)), "bytes": float(len(moved) * per_expert),
            "stall_ms": float(seconds.max()) * 1e3 if len(seconds) else 0.0}


def compare_rebalance(spec: SimSpec, planned: Placement) -> tuple[dict, dict]:
    """(the rebalance: the step under `spec`'s placement and under `planned`, the predicted gain,
    the migration's stall and after how many steps the faster step has paid for it; the planned
    step's whole `simulate` result)."""
    before, after = simulate(spec), simulate(replace(spec, placement=planned))
    migration = migration_stall(spec, spec.placement, planned)
    saved_ms = before["step_ms"] - after["step_ms"]
    return {"step_ms_before": before["step_ms"], "step_ms_after": after["step_ms"],
            "gain": before["step_ms"] / after["step_ms"] - 1,
            "balancedness_before": before["balancedness"], "balancedness_after": after["balancedness"],
            "migration": migration,
            "break_even_steps": migration["stall_ms"] / saved_ms if saved_ms > 0 else None}, after
