"""A hardware profile's kernel cost tables: the optional "kernels" block of profiles/NAME.json,
each table with its source, read into `KernelTables` and used by step_model in place of the
roofline where given.

A roofline priced from a README's peaks misses what a profile shows: the small ops between the
GEMMs (norms, casts, RoPE, top-k, permute, activation) that take about 30% of a prefill layer on
DeepSeek's own H800 profile; projection GEMMs well under the grouped GEMM's efficiency; a floor
under every kernel, which is most of a decode layer's small work; the SMs the all-to-all takes
from compute; the low-latency all-to-all that decode deployments run. Tables:

* small_ops: per op class, per layer pass: its kernels, their floor and the time per token
  above it: `kernels x floor_us + us_per_token x tokens` (linear in the tokens; a table from one
  profile is exact at that profile's tokens);
* grouped_gemm: the experts' grouped GEMM's fraction of the peak by rows per expert, in place of
  the profile's efficiency.grouped_gemm (a profile's curve scaled through a trace's point);
* dense_gemm: the projections', shared experts' and dense MLPs' fraction of the GEMM dtype's
  peak by rows (a Curve; the grouped GEMM's curve where absent);
* attention_prefill: the prefill attention core's fraction of the BF16 peak;
* kernel_floor_us: the least time any kernel takes (launch and tail), under every GEMM;
* comm: normal mode's SMs (taken from compute while it runs) of the device's SMs, and the
  low-latency mode's table (DeepEP's published one: a latency plus a copy per chosen expert at
  a bandwidth, both fitted to the table) with the share of its time its kernels hold SMs (to
  send and receive; the rest is the wait for the wire, which compute can hide);
* overlap: the synchronisation each overlap stage costs, and a step's fixed time outside the
  layers (sampling, scheduling, the MTP module's own work).
Every figure is {"value", "source"} or a table with a "source"; a source beginning "assumed" is
listed in the profile's `assumed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SMALL_OP_CLASSES = ("norm", "cast", "rope", "topk", "permute", "activation", "elementwise")
# the small ops a MoE layer runs around its experts, after the dispatch (the rest run before it)
EXPERT_SIDE_OPS = frozenset({"permute", "activation"})
MOE_ONLY_OPS = frozenset({"topk", "permute"})


class TableError(ValueError):
    """A kernel table that cannot be read; the message names it."""


@dataclass(frozen=True)
class SmallOp:
    kernels: float  # per layer pass
    floor_us: float
    us_per_token: float

    def seconds(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.float64)
        return np.where(tokens > 0, (self.kernels * self.floor_us + self.us_per_token * tokens) * 1e-6, 0.0)


@dataclass(frozen=True)
class LowLatency:
    """DeepEP-style low-latency all-to-all: every (token, choice) row is its own copy (no node
    dedup), sent over RDMA to another node's device or NVLink within the node; seconds =
    latency + the busiest link's bytes over its bandwidth, per direction (dispatch, combine)."""
    dispatch_latency_us: float
    dispatch_gbps: float
    combine_latency_us: float
    combine_gbps: float
    sm_share: float = 0.0  # of its time, the share its kernels hold SMs (sending, receiving): not hidden

    def seconds(self, intra_bytes, inter_bytes, nvlink_gbps: float, which: str) -> np.ndarray:
        latency, gbps = ((self.dispatch_latency_us, self.dispatch_gbps) if which == "dispatch"
                         else (self.combine_latency_us, self.combine_gbps))
        intra = np.asarray(intra_bytes, dtype=np.float64)
        inter = np.asarray(inter_bytes, dtype=np.float64)
        busy = (intra > 0) | (inter > 0)
        return np.where(busy, latency * 1e-6 + np.maximum(inter / (gbps * 1e9), intra / (nvlink_gbps * 1e9)), 0.0)


def _positive(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        raise TableError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def fit_low_latency(table: dict, gpus_per_node: int) -> tuple[float, float]:
    """(latency us, RDMA GB/s) of a published low-latency table {"tokens", "top_k", "row_bytes",
    "points": [[ep, us], ...]}: least squares of us = latency + bytes over RDMA / bandwidth over
    the points spanning nodes, a device's copies leaving its node being (ep - per node) / ep of
    its tokens x top_k rows. Within a node the same latency is taken (DeepEP's EP8 row is
    NVLink's, priced at the profile's NVLink bandwidth)."""
    if not isinstance(table, dict):
        raise TableError("must be an object")
    rows = _positive(table.get("tokens"), "tokens") * _positive(table.get("top_k"), "top_k")
    row_bytes = _positive(table.get("row_bytes"), "row_bytes")
    raw = table.get("points")
    if not isinstance(raw, list) or not all(isinstance(p, list) and len(p) == 2 for p in raw):
        raise TableError("points must be [[ep, us], ...]")
    points = [(_positive(ep, "an ep"), _positive(us, "a latency")) for ep, us in raw]
    points = [(ep, us) for ep, us in points if ep > gpus_per_node]
    if len({ep for ep, _ in points}) < 2:
        raise TableError("needs points at two or more ep above the devices per node")
    remote_bytes = np.array([rows * row_bytes * (ep - gpus_per_node) / ep for ep, _ in points])
    us = np.array([u for _, u in points], dtype=np.float64)
    slope, latency = np.polyfit(remote_bytes, us, 1)  # us per byte, us
    if slope <= 0 or latency < 0:
        raise TableError(f"the points give no positive latency and bandwidth ({points})")
    return float(latency), float(1e-3 / slope)  # bytes per us -> GB/s


@dataclass(frozen=True)
class KernelTables:
    small_ops: dict[str, SmallOp]  # class -> its ops, per layer pass
    grouped_gemm: object | None  # hardware.Curve by rows per expert, in place of efficiency.grouped_gemm
    dense_gemm: object | None  # hardware.Curve by rows
    attention_prefill: float | None
    kernel_floor_us: float
    comm_sms: float  # normal mode's SMs taken from compute while it runs
    device_sms: float
    low_latency: LowLatency | None
    stage_sync_us: float
    step_fixed_us: float

    def small_seconds(self, tokens, moe: bool, side: str | None = None) -> np.ndarray:
        """One layer pass's small ops on `tokens` per device (an array): those before the
        dispatch ("pre"), around the experts ("expert"), or all (None); a dense layer runs no
        top-k or permute."""
        total = np.zeros_like(np.asarray(tokens, dtype=np.float64))
        for name, op in self.small_ops.items():
            if not moe and name in MOE_ONLY_OPS:
                continue
            if side is not None and (name in EXPERT_SIDE_OPS) != (side == "expert"):
                continue
            total = total + op.seconds(tokens)
        return total


def parse_tables(key: str, node: dict, figure, curve_of, gpus_per_node: int, sources: dict) -> KernelTables:
    """The "kernels" block of profile `key`. `figure(path, optional)` reads a {"value", "source"}
    figure (hardware._parse's), `curve_of(node, name)` a Curve; sources collects each table's."""
    if not isinstance(node, dict):
        raise TableError(f"hardware {key}: kernels must be an object")

    def sourced(name: str) -> dict | None:
        table = node.get(name)
        if table is None:
            return None
        if not isinstance(table, dict) or not str(table.get("source") or "").strip():
            raise TableError(f"hardware {key}: kernels.{name} must be an object with a source")
        sources[f"kernels.{name}"] = table["source"]
        return table

    def number(table: dict, name: str, field: str, minimum: float = 0.0) -> float:
        value = table.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) \
                or not value >= minimum:
            raise TableError(f"hardware {key}: kernels.{name}.{field} must be a number >= {minimum:g}, got {value!r}")
        return float(value)

    small: dict[str, SmallOp] = {}
    ops = sourced("small_ops")
    classes = (ops or {}).get("classes") or {}
    if not isinstance(classes, dict):
        raise TableError(f"hardware {key}: kernels.small_ops.classes must be an object of classes")
    for name, entry in classes.items():
        if name not in SMALL_OP_CLASSES:
            raise TableError(f"hardware {key}: kernels.small_ops.classes.{name}: not one of {', '.join(SMALL_OP_CLASSES)}")
        if not isinstance(entry, dict):
            raise TableError(f"hardware {key}: kernels.small_ops.classes.{name} must be an object")
        small[name] = SmallOp(number(entry, f"small_ops.classes.{name}", "kernels"),
                              number(entry, f"small_ops.classes.{name}", "floor_us"),
                              number(entry, f"small_ops.classes.{name}", "us_per_token"))
    grouped = sourced("grouped_gemm")
    dense = sourced("dense_gemm")
    attention = sourced("attention_prefill")
    comm = sourced("comm") or {}
    device_sms = number(comm, "comm", "device_sms", 1.0) if "device_sms" in comm else 0.0
    comm_sms = number(comm, "comm", "normal_sms") if "normal_sms" in comm else 0.0
    if comm_sms and not comm_sms < device_sms:
        raise TableError(f"hardware {key}: kernels.comm.normal_sms ({comm_sms:g}) needs device_sms above it "
                         f"(got {device_sms:g})")
    low = comm.get("low_latency")
    low_latency = None
    if low is not None:
        if not isinstance(low, dict):
            raise TableError(f"hardware {key}: kernels.comm.low_latency must be an object")
        fits = []
        for which in ("dispatch", "combine"):
            table = low.get(which)
            if not isinstance(table, dict):
                raise TableError(f"hardware {key}: kernels.comm.low_latency.{which} must be an object")
            try:
                fits.append(fit_low_latency({**low, **table}, gpus_per_node))
            except TableError as exc:
                raise TableError(f"hardware {key}: kernels.comm.low_latency.{which}: {exc}") from None
        share = number(low, "comm.low_latency", "sm_share") if "sm_share" in low else 0.0
        if share > 1:
            raise TableError(f"hardware {key}: kernels.comm.low_latency.sm_share must be a fraction in [0, 1]")
        low_latency = LowLatency(fits[0][0], fits[0][1], fits[1][0], fits[1][1], share)
    prefill_compute = number(attention, "attention_prefill", "compute", 1e-6) if attention else None
    if prefill_compute is not None and prefill_compute > 1:
        raise TableError(f"hardware {key}: kernels.attention_prefill.compute must be a fraction in (0, 1]")
    overlap = sourced("overlap") or {}
    floor = figure("kernels.kernel_floor_us", optional=True)
    return KernelTables(
        small_ops=small, grouped_gemm=curve_of(grouped, "kernels.grouped_gemm") if grouped else None,
        dense_gemm=curve_of(dense, "kernels.dense_gemm") if dense else None,
        attention_prefill=prefill_compute,
        kernel_floor_us=floor or 0.0, comm_sms=comm_sms, device_sms=device_sms, low_latency=low_latency,
        stage_sync_us=number(overlap, "overlap", "stage_sync_us") if "stage_sync_us" in overlap else 0.0,
        step_fixed_us=number(overlap, "overlap", "step_fixed_us") if "step_fixed_us" in overlap else 0.0)
