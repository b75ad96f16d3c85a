"""The local backend's memory ledger: what each emulated device holds, by tier and category.

* Weights are real tensors' bytes. Routed experts: the device's slot tensors, or its expert
  cache in tiered mode (the experts themselves then live in the host tier). The other weights
  (attention, norms and routers, shared experts, dense MLPs, embeddings): a whole replica per
  device, because the local backend runs attention data-parallel at tp 1; the one copy in this
  process stands for each device's replica.
* KV: the blocks of the device's own pool that its sequences hold, against that pool's size.
* Activations and communication buffers: computed every step from that step's real shapes on
  the device (its sequences' tokens and context, the expert rows it computed), with the
  planner's operator formulas (`memory_plan.step_activations`): a CPU keeps no allocator
  statistics per emulated device, so these two are derived from shapes, not read from an
  allocator.

Capacity is enforced up front, the way a serving engine sizes itself: weights + the KV pool +
the activations and buffers of the largest step the knobs allow must fit each device's HBM.
The engine refuses to start otherwise, and refuses a knob change that would break it.
"""

from __future__ import annotations

from torch import nn

from moectl.engine.planning.memory_plan import PlanModel, comm_buffers, plan_model_of, step_activations
from moectl.placement.placement import PlacementError
from moectl.placement.topology import Topology, format_size

# the planner's weight categories -> the names the step records use
WEIGHT_CATEGORIES = {
    "attention": "attention_weights",
    "shared_experts": "shared_expert_weights",
    "dense_mlp": "dense_mlp_weights",
    "embeddings": "embedding_weights",
    "norms_routers": "norm_router_weights",
}


def _category_of(name: str) -> str | None:
    """A parameter's planner category by its name in MoEForCausalLM; None for routed experts."""
    if ".mlp.experts." in name:
        return None
    if name.startswith(("embed.", "lm_head.")):
        return "embeddings"
    if ".attn." in name:
        return "attention"  # q/k norms and biases included, as the planner counts them
    if ".mlp.shared_" in name:
        return "shared_experts"
    if ".mlp.gate" in name or "norm" in name or name.endswith(".e_score_correction_bias"):
        return "norms_routers"
    if ".mlp." in name:
        return "dense_mlp"
    raise ValueError(f"memory ledger: no category for parameter {name!r}")


def non_expert_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of every weight but the routed experts, by category (tied weights once)."""
    out = dict.fromkeys(WEIGHT_CATEGORIES.values(), 0)
    # named_parameters skips a tied duplicate; DeepSeek's routing correction bias is a buffer
    bias = [(n, b) for n, b in model.named_buffers() if n.endswith(".e_score_correction_bias")]
    for name, param in [*model.named_parameters(), *bias]:
        category = _category_of(name)
        if category is not None:
            out[WEIGHT_CATEGORIES[category]] += param.nbytes
    return out


class MemoryLedger:
    def __init__(self, model: nn.Module, topology: Topology, *, kv_pool_bytes: list[int], block_size: int,
                 max_model_len: int):
        """kv_pool_bytes: each device's KV pool (its sliding-window pool included)."""
        cfg = model.cfg
        self.topology = topology
        self.plan_model: PlanModel = plan_model_of(cfg, "engine", [])
        self.act_bytes = next(model.parameters()).element_size()
        self.weights = {k: v for k, v in non_expert_weight_bytes(model).items() if v}
        self.kv_pool_bytes = kv_pool_bytes
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_devices = topology.num_devices
        self.expert_category, self.expert_bytes = "expert_weights", 0  # set by the cluster

    # -- capacity
    def kv_capacity(self, device: int) -> int:
        return self.kv_pool_bytes[device]

    def largest_step(self, knobs) -> tuple[int, int]:
        """Activations + buffers of the largest step the knobs allow on one device: every token of
        the step homed there, at the longest context, and all their expert rows computed there."""
        tokens = knobs.max_num_batched_tokens
        act, _ = step_activations(self.plan_model, tp=1, tokens=tokens, recv_rows=tokens * self.plan_model.top_k,
                                  context=self.max_model_len, seqs=min(knobs.max_num_seqs, tokens),
                                  block_size=self.block_size, act_bytes=self.act_bytes, attn_impl="eager")
        comm = comm_buffers(self.plan_model, tp=1, ep=self.num_devices, tokens=tokens,
                            recv_rows=tokens * self.plan_model.top_k, act_bytes=self.act_bytes)
        return sum(act.values()), sum(comm.values())

    def fixed_bytes(self, device: int, knobs) -> int:
        """Everything but the routed experts: weights, the KV pool, the largest step's working memory."""
        return sum(self.weights.values()) + self.kv_capacity(device) + sum(self.largest_step(knobs))

    def expert_budget(self, knobs) -> int:
        """HBM left for routed experts (slots or cache) on the tightest device."""
        return min(self.topology.hbm_bytes - self.fixed_bytes(d, knobs) for d in range(self.num_devices))

    def check(self, knobs, expert_bytes: int | None = None, what: str = "") -> None:
        """Refuse (PlacementError, one line) a layout or knob setting that overflows a device."""
        experts = self.expert_bytes if expert_bytes is None else expert_bytes
        hbm = self.topology.hbm_bytes
        for d in range(self.num_devices):
            weights = sum(self.weights.values())
            act, comm = self.largest_step(knobs)
            total = weights + experts + self.kv_capacity(d) + act + comm
            if total > hbm:
                raise PlacementError(
                    f"hbm: {what}device {d} needs {format_size(total)} (weights {format_size(weights)}, "
                    f"experts {format_size(experts)}, KV pool {format_size(self.kv_capacity(d))}, activations "
                    f"{format_size(act)} and buffers {format_size(comm)} for a {knobs.max_num_batched_tokens}-token "
                    f"step), more than its {format_size(hbm)} of HBM")

    # -- per step
    def step(self, work: list[dict], kv_bytes_used: list[int]) -> list[dict]:
        """HBM bytes by category per device for one step. work[d]: tokens, seqs and context of the
        device's sequences this step, and recv_rows, the most expert rows it computed in one layer."""
        out = []
        for d, w in enumerate(work):
            act, _ = step_activations(self.plan_model, tp=1, tokens=w["tokens"], recv_rows=w["recv_rows"],
                                      context=w["context"], seqs=w["seqs"], block_size=self.block_size,
                                      act_bytes=self.act_bytes, attn_impl="eager")
            comm = comm_buffers(self.plan_model, tp=1, ep=self.num_devices, tokens=w["tokens"],
                                recv_rows=w["recv_rows"], act_bytes=self.act_bytes)
            out.append({**self.weights, self.expert_category: self.expert_bytes,
                        "kv_blocks": kv_bytes_used[d],
                        "activations": sum(act.values()), "comm_buffers": sum(comm.values())})
        return out
