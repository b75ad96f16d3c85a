"""`plan memory --offload`: the routed experts over three tiers, HBM, host memory and disk.

Everything but the routed experts stays where `plan_memory` puts it. Each device keeps an HBM
expert cache in what its HBM has left, which must hold one MoE layer's working set (the
engine's rule: every expert of a layer the device serves may be needed at once, or top_k x
tokens of them when fewer). Each node keeps a host-memory cache of the experts its devices
serve, up to --host-mem; the rest of them are read from the checkpoint on disk. The engine runs
exactly this arrangement with `--host-mem` (experts/disk_tier.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from moectl.engine.planning.memory_plan import MemoryPlan
from moectl.placement.topology import format_size


@dataclass
class OffloadPlan:
    plan: MemoryPlan
    host_bytes_per_node: int
    expert_bytes: int
    devices: list[dict]  # per device: hbm_for_experts, cache_slots, working_set, total, fits
    nodes: list[dict]  # per node: experts_served, host_cached, host_bytes, disk_reads_share
    disk_bytes: int  # every routed expert, in the checkpoint's files

    @property
    def fits(self) -> bool:
        return all(d["fits"] for d in self.devices)

    def as_dict(self) -> dict:
        return {"host_bytes_per_node": self.host_bytes_per_node, "expert_bytes": self.expert_bytes,
                "devices": self.devices, "nodes": self.nodes, "disk_bytes": self.disk_bytes, "fits": self.fits}

    def format_table(self) -> str:
        first = worst = min(self.devices, key=lambda d: (d["cache_slots"] - d["working_set"], d["device"]))  # tightest
        node = self.nodes[0]
        rows = [
            (f"HBM (device {first['device']}, the tightest)",
             f"expert cache {first['cache_slots']:,} slots = {format_size(first['cache_bytes'])} in the "
             f"{format_size(first['hbm_for_experts'])} left after the other weights, KV, activations and buffers; a "
             f"layer's working set is {first['working_set']:,} experts (device total {format_size(first['total'])} "
             f"of {format_size(first['hbm'])})"),
            ("host (per node)", f"{node['host_cached']:,} of the {node['experts_served']:,} experts its devices serve "
                                f"({node['host_share']:.1%}) = {format_size(node['host_bytes'])} of "
                                f"{format_size(self.host_bytes_per_node)}"),
            ("disk", f"all {self.disk_bytes // self.expert_bytes:,} routed experts = {format_size(self.disk_bytes)} "
                     f"in the checkpoint; a node reads the {1 - node['host_share']:.1%} of its experts not in host "
                     "memory from there on a miss"),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"offload: routed experts of {format_size(self.expert_bytes)} each over three tiers", ""]
        lines += [f"{name.ljust(width)}  {text}" for name, text in rows]
        lines.append("")
        if self.fits:
            lines.append(f"fits: yes; the tightest device caches {worst['cache_slots']:,} experts for a working set "
                         f"of {worst['working_set']:,}")
        else:
            bad = [d["device"] for d in self.devices if not d["fits"]]
            lines.append(f"fits: NO, device {bad[0]} can cache {worst['cache_slots']:,} experts but a layer's working "
                         f"set is {worst['working_set']:,}" + (f" ({len(bad)} devices short)" if len(bad) > 1 else ""))
        return "\n".join(lines)


def plan_offload(plan: MemoryPlan, host_bytes_per_node: int) -> OffloadPlan:
    m, topo = plan.model, plan.topology
    expert_bytes = m.part_bytes("expert", plan.weights)
    tokens_moe = -(-plan.tokens_per_step // plan.tp)
    devices = []
    for d in plan.devices:
        others = d.total - d.weights["experts"]
        left = max(0, d.hbm_bytes - others)
        held = d.experts_local * m.num_sparse
        slots = min(held, left // expert_bytes)
        working = min(d.experts_local, m.top_k * tokens_moe)
        devices.append({"device": d.device, "hbm": d.hbm_bytes, "hbm_for_experts": left, "cache_slots": slots,
                        "cache_bytes": slots * expert_bytes, "working_set": working,
                        "total": others + slots * expert_bytes, "fits": slots >= working and others <= d.hbm_bytes})
    nodes = []
    for n in range(topo.num_nodes):
        ranks = {d.ep_rank: d.experts_local for d in plan.devices if d.node == n}  # each EP rank's experts once
        served = sum(ranks.values()) * m.num_sparse
        cached = min(served, host_bytes_per_node // expert_bytes)
        nodes.append({"node": n, "experts_served": served, "host_cached": cached, "host_bytes": cached * expert_bytes,
                      "host_share": cached / served if served else 1.0})
    return OffloadPlan(plan, host_bytes_per_node, expert_bytes, devices, nodes,
                       m.num_experts * m.num_sparse * expert_bytes)
