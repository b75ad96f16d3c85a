"""Expert parallelism over ranks, with any placement: slots, replicas, routing policies, live moves.

Each rank holds `slots_per_device` expert slots per MoE layer: the experts that placement row
gives it (a contiguous split is just one placement). Every rank computes the same hidden states
between layers (attention is tensor parallel or replicated), so no token has to travel to an
expert: in `dispatch` every rank picks the same replica for each (token, choice) with the
placement's routing policy, runs its own slots on the rows they own, and one all_reduce of
every (token, choice) output (each row filled by exactly one rank, zero elsewhere) gives every
rank all of them; the weighted sum then runs as `moe.combine` does, so the combine adds nothing
to the difference from one process (the tokens are one process's on the CPU:
tests/engine/parallel/test_distributed.py). vLLM's expert parallelism without data-parallel
attention also all-reduces, but the weighted [tokens, hidden] sum: top_k times fewer bytes, and
another order of additions; this one pays those bytes for the exact combine. The all_to_all
dispatch and combine of the seeds' clusters pay off when each rank holds other tokens
(data-parallel attention), which the emulated backend models.

Every collective is timed on this rank (`RankStepStats`): the expert compute (busy), a
two-value all_reduce before the outputs are summed (the time spent *waiting* for slower ranks:
a collective moving 16 bytes is all wait; its values check that every rank routed alike), and
the outputs' all_reduce (the *transfer*). Both are started asynchronously and yielded
(`dispatch_stages`, models/yield_points.py): in one batch each is waited for at once; under
two-batch overlap the other micro-batch computes while it is in flight (`hidden_s`), and the two
figures count only the time a micro-batch was blocked on them. At
the end of a step the figures travel to rank 0 in one fixed-size tensor (`pack` / `unpack`).

`migrate` changes the placement between steps with real transfers: every rank derives the same
plan from the old and new placements (which rank sends which expert to which) and, layer by
layer, packs what it sends into one buffer and exchanges it in one all_to_all (so the extra
memory is one layer's moves, not the whole change); experts that stay on a rank are copied
locally. Its bytes and seconds are measured on every rank.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch import nn

from moectl.engine.experts.replica_routing import RoutingState, assign_replicas, prepare
from moectl.engine.models.moe import SWIGLU, ExpertFFN, MoEBlock, grouped_offsets, grouped_swiglu
from moectl.engine.models.tracing import NULL_TRACER
from moectl.engine.models.yield_points import Collective, run_stages
from moectl.placement.placement import Placement, migration_in

MEMORY_SAMPLE_S = 0.5  # RSS is read at most this often (psutil costs tens of microseconds)
_SCALARS = ("wait_s", "combine_s", "hidden_s", "rss_bytes", "cuda_allocated", "cuda_reserved",
            "cuda_max_allocated")


def _split_bounds(total: int, parts: int) -> list[int]:
    return [total * i // parts for i in range(parts + 1)]


class RankStepStats:
    """One rank's measurements for one step, per layer where it matters."""

    def __init__(self, num_layers: int, world: int, device: torch.device):
        self.num_layers, self.world, self.device = num_layers, world, device
        self.tracer = NULL_TRACER  # rank 0: the engine's spans (its own lanes, measured)
        self.cuda = device.type == "cuda"
        self._process = psutil.Process()
        self._memory_at = -1.0
        self._memory = (0, 0, 0, 0)
        self.reset()

    def reset(self) -> None:
        L = self.num_layers
        self.busy = np.zeros(L)
        self.rows = np.zeros(L)
        self.active = np.zeros(L)
        self.send_rows = np.zeros(self.world)  # expert output rows this rank contributed to each other rank
        self.wait_s = self.combine_s = self.hidden_s = 0.0
        self.split = 0  # rank 0: where this step's batch split into two micro-batches (0: one batch)

    @staticmethod
    def size(num_layers: int, world: int) -> int:
        return 3 * num_layers + world + len(_SCALARS)

    def _sample_memory(self) -> tuple:
        now = time.monotonic()
        if now - self._memory_at >= MEMORY_SAMPLE_S:
            cuda = (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device),
                    torch.cuda.max_memory_allocated(self.device)) if self.cuda else (0, 0, 0)
            self._memory = (self._process.memory_info().rss, *cuda)
            self._memory_at = now
        return self._memory

    def pack(self) -> torch.Tensor:
        scalars = [self.wait_s, self.combine_s, self.hidden_s, *self._sample_memory()]
        return torch.from_numpy(np.concatenate([self.busy, self.rows, self.active, self.send_rows,
                                                np.asarray(scalars, dtype=np.float64)]))


def unpack(gathered: torch.Tensor, num_layers: int, world: int) -> dict:
    """[world, size] gathered rank statistics -> arrays by name ([world, L] per-layer ones)."""
    a = gathered.numpy()
    L = num_layers
    out = {"busy_layer": a[:, :L], "rows_layer": a[:, L:2 * L], "active_layer": a[:, 2 * L:3 * L],
           "send_rows": a[:, 3 * L:3 * L + world]}
    for i, name in enumerate(_SCALARS):
        out[name] = a[:, 3 * L + world + i]
    return out


class RankExperts(nn.Module):
    """This rank's expert slots for one MoE layer, and the placement-aware dispatch/combine."""

    def __init__(self, layer_idx: int, w13: torch.Tensor, w2: torch.Tensor, placement: Placement, rank: int,
                 world: int, stats: RankStepStats, policy: str, routing_state: RoutingState, group=None,
                 ffn: ExpertFFN = SWIGLU):
        """w13/w2: this rank's slots, already filled for `placement` (see `install`)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.ffn = ffn
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.rank, self.world, self.group = rank, world, group
        self.stats, self.policy, self.routing_state = stats, policy, routing_state
        self._homes: dict[int, torch.Tensor] = {}  # batch size -> each token's home rank
        self.set_placement(placement)

    def set_placement(self, placement: Placement) -> None:
        self.placement = placement
        prepare(placement)  # the compiled replica rule loads here, not in the next step
        self.slots = placement.slots_per_device
        row = placement.slots[self.layer_idx].reshape(-1)
        table = np.full((placement.num_experts, placement.num_devices), -1, dtype=np.int64)
        for slot, expert in enumerate(row):
            if expert >= 0:
                table[expert, slot // self.slots] = slot
        self.slot_of = torch.from_numpy(table)

    def extra_repr(self) -> str:
        experts = self.placement.experts_on(self.layer_idx, self.rank)
        return f"layer {self.layer_idx}: experts {experts} in {self.slots} slots on rank {self.rank}/{self.world}"

    def _timed(self, fn, name: str | None = None, lane: int = 0):
        """fn() and its seconds (synchronised on a GPU: collectives and kernels are asynchronous);
        with a name, also a measured span on rank 0's timeline (this rank's own lanes)."""
        if self.stats.cuda:  # the compute stream (not another micro-batch's collective in flight)
            torch.cuda.current_stream(self.stats.device).synchronize()
        t0 = time.monotonic()  # the engine clock, which span times are on
        out = fn()
        if self.stats.cuda:
            torch.cuda.current_stream(self.stats.device).synchronize()
        t1 = time.monotonic()
        tracer = self.stats.tracer
        if name is not None and tracer.enabled:
            tracer.add_measured(name, lane, self.layer_idx, t0, t1)
        return out, t1 - t0

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts_t: torch.Tensor):
        return run_stages(self.dispatch_stages(x, weights, ids, counts_t))

    def dispatch_stages(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts_t: torch.Tensor):
        """dispatch, yielding at its two collectives (yield_points): one batch waits for each at
        once; two micro-batches compute the other's stage while it is in flight."""
        n, hidden = x.shape
        W, S, rank, stats = self.world, self.slots, self.rank, self.stats
        top_k = ids.shape[1]
        # (1) a replica for every (token, choice), the same on every rank: each rank routes the
        #     whole batch (it holds every token), so no rank needs to be told the choice
        ids_cpu = ids.cpu()
        dest = assign_replicas(self.placement, self.layer_idx, ids_cpu, self._home(n), self.policy,
                               self.routing_state, check=False).flatten()
        slots = self.slot_of[ids_cpu.flatten(), dest]
        rows_per_rank = torch.bincount(dest, minlength=W)
        # (2) this rank's slots on its (token, choice) rows, grouped by slot
        mine = torch.nonzero(dest == rank).squeeze(1)
        local_slot = slots[mine] - rank * S
        by_slot = torch.argsort(local_slot, stable=True)
        positions = mine[by_slot].to(x.device)
        local_counts = torch.bincount(local_slot, minlength=S)
        counts_list = local_counts.tolist()
        offsets = grouped_offsets(local_counts.to(x.device), positions.numel(), self.w13, self.w2, self.ffn)
        device_lane, link_lane = 1 + rank, 1 + W + rank
        out_sorted, busy = self._timed(lambda: grouped_swiglu(x.index_select(0, positions // top_k), counts_list,
                                                              self.w13, self.w2, offsets, self.ffn),
                                       "experts", device_lane)
        # (3) every (token, choice) output in one buffer, this rank's rows filled and the rest
        #     zero; summed over the ranks, each row is its one rank's output exactly (x + 0 = x)
        outputs = x.new_zeros((n * top_k, hidden)).index_copy_(0, positions, out_sorted)
        # (4) wait for the slowest rank's experts (a two-value all_reduce: its time is all wait),
        #     which also checks that every rank chose the same replicas (a row no rank or two
        #     ranks computed would be dropped or doubled silently), then the sum
        check = zlib.crc32(dest.numpy().tobytes())
        flag = torch.tensor([check, -check], dtype=torch.int64, device=x.device)
        yield self._collective(flag, dist.ReduceOp.MAX, "wait for ranks", link_lane, "wait_s")
        if flag.tolist() != [check, -check]:
            raise RuntimeError(f"distributed: the ranks chose different experts' replicas in layer {self.layer_idx} "
                               f"(their hidden states differ)")
        yield self._collective(outputs, dist.ReduceOp.SUM, "all_reduce combine", link_lane, "combine_s")
        # (5) the weighted sum in moe.combine's order: the same bits as one process
        layer = self.layer_idx
        stats.busy[layer] += busy
        stats.rows[layer] += positions.numel()
        stats.active[layer] += sum(1 for c in counts_list if c)  # per micro-batch: each runs its own GEMMs
        sent = np.full(W, float(rows_per_rank[rank]))
        sent[rank] = 0.0
        stats.send_rows += sent
        return (outputs.view(n, top_k, hidden) * weights.unsqueeze(-1)).sum(1).to(x.dtype)

    def _collective(self, tensor: torch.Tensor, op, name: str, lane: int, figure: str) -> Collective:
        """An all_reduce in place, started now. Once waited for: the time its micro-batch was
        blocked on it goes to `figure` (all of it in one batch), the time it was in flight while
        the other micro-batch computed to `hidden_s`, and its span (start to done) to the timeline."""
        stats, layer = self.stats, self.layer_idx

        def done(issued: float, hidden_until: float, waited_from: float, finished: float) -> None:
            setattr(stats, figure, getattr(stats, figure) + finished - waited_from)
            stats.hidden_s += hidden_until - issued
            if stats.tracer.enabled:
                stats.tracer.add_measured(name, lane, layer, issued, finished)

        # the compute stream only: a device-wide sync would also wait for the other micro-batch's
        # collective in flight on its own stream
        sync = (lambda: torch.cuda.current_stream(stats.device).synchronize()) if stats.cuda else None
        if sync is not None:
            sync()  # the expert kernels are done before the clock starts, as _timed's spans
        return Collective(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), done, sync)

    def _home(self, n: int) -> torch.Tensor:
        """Each token's home rank, which the locality policy prefers: the batch in W contiguous
        shards (the workers know tokens, not the sequences that the emulated backend homes)."""
        home = self._homes.get(n)
        if home is None:
            bounds = _split_bounds(n, self.world)
            home = self._homes[n] = torch.repeat_interleave(torch.arange(self.world), torch.tensor(np.diff(bounds)))
        return home

    # -- moving experts between ranks
    @property
    def expert_numel(self) -> int:
        return self.w13[0].numel() + self.w2[0].numel()

    def flat_slot(self, slot: int) -> torch.Tensor:
        return torch.cat([self.w13[slot].reshape(-1), self.w2[slot].reshape(-1)])

    def write_slot(self, slot: int, flat: torch.Tensor) -> None:
        k = self.w13[slot].numel()
        with torch.no_grad():
            self.w13[slot].copy_(flat[:k].view_as(self.w13[slot]))
            self.w2[slot].copy_(flat[k:].view_as(self.w2[slot]))


def install(model: nn.Module, placement: Placement, rank: int, world: int, stats: RankStepStats, policy: str,
            group=None, devices_per_node: int | None = None) -> list[RankExperts]:
    """Swaps every MoE layer's stacked experts for this rank's slots under `placement` (the
    experts it does not hold are freed). The placement is checked against the model first."""
    cfg = model.cfg
    if placement.num_devices != world:
        raise ValueError(f"placement: has {placement.num_devices} devices, the launch {world} ranks")
    if placement.num_experts != cfg.num_experts or placement.num_layers != cfg.num_layers:
        raise ValueError(f"placement: is for {placement.num_layers} layers x {placement.num_experts} experts, "
                         f"the model has {cfg.num_layers} x {cfg.num_experts}")
    routing_state = RoutingState(devices_per_node)  # locality's node tier, when ranks span nodes
    layers = []
    for module in list(model.modules()):
        if isinstance(module, MoEBlock):
            old = module.experts
            row = placement.slots[module.layer_idx, rank]
            w13 = old.w13.new_zeros((len(row), *old.w13.shape[1:]))
            w2 = old.w2.new_zeros((len(row), *old.w2.shape[1:]))
            for slot, expert in enumerate(row):
                if expert >= 0:
                    w13[slot], w2[slot] = old.w13[expert], old.w2[expert]
            module.experts = RankExperts(module.layer_idx, w13, w2, placement, rank, world, stats, policy,
                                         routing_state, group, old.ffn)
            layers.append(module.experts)
            del old
    return layers


def migration_plan(old: Placement, new: Placement, layers: list[int]) -> list[tuple[int, int, int, int, int]]:
    """The migration (Placement.migration, the plan every preview counts) for these layers as
    (layer, dst rank, dst slot, src rank, src slot) rows. Every rank derives the same list, in
    the same order."""
    rows = migration_in(old, new, layers)
    return [(layer, dst, slot, src, src_slot) for layer, _, src, src_slot, dst, slot, _ in rows.tolist()]


def migrate(layers: list[RankExperts], new: Placement, rank: int, world: int, group=None) -> dict:
    """Moves this rank's share of the change to `new` (every rank calls it between the same two
    steps), one MoE layer at a time. Returns what this rank measured: bytes sent and received,
    bytes copied within the rank, seconds."""
    t0 = time.perf_counter()
    old = layers[0].placement
    numel = layers[0].expert_numel
    dtype, device = layers[0].w13.dtype, layers[0].w13.device
    sent = received = local_moves = 0
    plan = migration_plan(old, new, [m.layer_idx for m in layers])  # once, then layer by layer
    for m in layers:
        outgoing = [[] for _ in range(world)]  # per destination: src slots, in plan order
        incoming = [[] for _ in range(world)]  # per source: dst slots
        local = []
        moves = [move for move in plan if move[0] == m.layer_idx]
        for _, dst, slot, src, src_slot in moves:
            if dst == rank and src == rank:
                local.append((slot, src_slot))
            elif src == rank:
                outgoing[dst].append(src_slot)
            elif dst == rank:
                incoming[src].append(slot)
        send_counts = [len(o) * numel for o in outgoing]
        recv_counts = [len(i) * numel for i in incoming]
        # copies of every source, taken before any slot of the layer is written
        local_src = [m.flat_slot(src_slot) for _, src_slot in local]
        sends = [m.flat_slot(s) for o in outgoing for s in o]
        recv = torch.empty(sum(recv_counts), dtype=dtype, device=device)
        # the same answer on every rank (the plan is global), so all take part in the collective or none
        if world > 1 and any(src != dst for _, dst, _, src, _ in moves):
            send = torch.cat(sends) if sends else torch.zeros(0, dtype=dtype, device=device)
            dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
        cursor = 0
        for source in incoming:
            for slot in source:
                m.write_slot(slot, recv[cursor:cursor + numel])
                cursor += numel
        for (slot, _), flat in zip(local, local_src):
            m.write_slot(slot, flat)
        sent, received, local_moves = sent + sum(send_counts), received + sum(recv_counts), local_moves + len(local)
    for m in layers:
        m.set_placement(new)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    element = torch.empty(0, dtype=dtype).element_size()
    return {"bytes_sent": sent * element, "bytes_received": received * element,
            "bytes_local": local_moves * numel * element, "seconds": time.perf_counter() - t0}
