"""One layer's experts laid out in physical slots on emulated devices (the local backend).

Each device owns `slots_per_device` real slot tensors per layer, filled by real copies from the
logical (host-tier) stacked weights. A token's choice goes to one replica of its expert, picked
by the routing policy; each device then runs its own slots on its own tokens, and that work is
timed: a device's busy time is measured, not modeled. Moving tokens between devices is the part
one machine cannot measure: its bytes are exact, its time is modeled from link bandwidth.

Multi-GPU in one process (`torch_devices`): device d's slots live on a real torch device, the
dispatch and combine copies between devices are real, and busy time is timed with CUDA events
on that device. Attention and the KV cache stay on the engine's device.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from moectl.engine.experts.replica_routing import RoutingState, assign_replicas, prepare, traffic_matrix
from moectl.engine.models.moe import StackedExperts, combine, grouped_offsets, grouped_swiglu
from moectl.engine.models.tracing import NULL_TRACER
from moectl.placement.placement import Placement


class StepDeviceStats:
    """Per-step accumulators shared by every layer's PlacedExperts."""

    def __init__(self, num_devices: int, device: torch.device, num_layers: int):
        self.num_devices = num_devices
        self.num_layers = num_layers
        self.device = device
        self.cuda = device.type == "cuda"
        self.token_device = torch.zeros(0, dtype=torch.int64)
        self.tracer = NULL_TRACER  # the engine's SpanRecorder while spans are recorded
        self.link_s_per_byte: np.ndarray | None = None  # None: no link traffic kept (see set_links)
        self.reset()

    def set_links(self, moe_layers: list[int], s_per_byte: np.ndarray) -> None:
        """Keep each step's link traffic, for the modeled link spans readers derive
        (moectl.wire.link_spans): preallocated arrays, one row per MoE layer, written in place by
        each layer while spans are on. s_per_byte: [D, D] link seconds per byte."""
        d, n = self.num_devices, len(moe_layers)
        self.link_s_per_byte = s_per_byte
        self.moe_layers = np.array(moe_layers, dtype=np.int16)
        self.moe_row = {layer: i for i, layer in enumerate(moe_layers)}
        self.last_moe_layer = max(moe_layers)  # after it, the step's traffic goes to the tracer
        self.link_dispatch = np.full(n, -np.inf)  # each layer's all-to-all starts, engine clock
        self.link_combine = np.zeros(n)
        self.link_traffic = np.zeros((n, d, d), dtype=np.int64)

    def reset(self) -> None:
        d = self.num_devices
        self.tokens = np.zeros(d, dtype=np.int64)  # (token, choice) rows each device computed
        self.peak_rows = np.zeros(d, dtype=np.int64)  # the most rows it computed in one layer (sizes buffers)
        self.busy_s = np.zeros(d)  # measured expert compute time per device
        # per [device, layer]: measured seconds, rows and distinct experts run (the cost model's samples)
        self.busy_layer = np.zeros((d, self.num_layers))
        self.rows_layer = np.zeros((d, self.num_layers), dtype=np.int64)
        self.active_layer = np.zeros((d, self.num_layers), dtype=np.int64)
        self.traffic = np.zeros((d, d), dtype=np.int64)  # dispatch bytes, src x dst
        self._events: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = []

    def note_link(self, layer: int, t_dispatch: float, t_combine: float, traffic: np.ndarray) -> None:
        """One MoE layer's all-to-all, into the preallocated arrays (spans on only); the last MoE
        layer hands the step's to the tracer."""
        row = self.moe_row[layer]
        self.link_dispatch[row] = t_dispatch
        self.link_combine[row] = t_combine
        self.link_traffic[row] = traffic
        if layer >= self.last_moe_layer:
            self.tracer.add_links(self.link_record())

    def link_record(self) -> dict:
        """The step's all-to-alls as spans["links"] (moectl.wire.link_spans), copied out of the
        arrays (the next step reuses them). Their spans are modeled, not measured (on one machine
        nothing crosses a link): readers derive them, so the engine thread only copies bytes and
        times here. The layer and seconds-per-byte arrays never change: every record shares them."""
        t0 = self.tracer.t0
        dispatch = self.link_dispatch - t0
        links = {"layer": self.moe_layers, "dispatch_s": dispatch, "combine_s": self.link_combine - t0,
                 "traffic": self.link_traffic.copy(), "s_per_byte": self.link_s_per_byte}
        ran = dispatch >= 0
        if not ran.all():  # a MoE layer that did not run this step holds an earlier step's start
            links.update({k: links[k][ran] for k in ("layer", "dispatch_s", "combine_s", "traffic")})
        return links

    def timed(self, device: int, fn, torch_device: torch.device | None = None, layer: int = -1):
        """Run fn as `device`'s work and add its time; CUDA events on GPU (recorded on the stream
        of the GPU doing the work, resolved at step end: no sync per span), perf counters on CPU."""
        on = torch_device if torch_device is not None and torch_device.type == "cuda" else None
        if self.cuda or on is not None:  # (device spans are CPU-only: events on several GPUs share no clock)
            with torch.cuda.device(on if on is not None else torch.cuda.current_device()):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn()
                end.record()
            self._events.append((device, layer, start, end))
            return out
        t0 = time.monotonic()
        out = fn()
        t1 = time.monotonic()
        self.busy_s[device] += t1 - t0
        self.busy_layer[device, layer] += t1 - t0
        self.tracer.add_measured("experts", 1 + device, layer, t0, t1)
        return out

    def resolve(self) -> None:
        if self._events:
            for device, layer, start, end in self._events:
                end.synchronize()  # each on its own GPU; a plain synchronize() waits on one device only
                seconds = start.elapsed_time(end) / 1e3
                self.busy_s[device] += seconds
                self.busy_layer[device, layer] += seconds
            self._events.clear()


class PlacedExperts(nn.Module):
    def __init__(self, layer_idx: int, logical: StackedExperts, placement: Placement,
                 stats: StepDeviceStats, policy: str, routing_state: RoutingState, tiered: bool = False,
                 torch_devices: list[torch.device] | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.logical = logical  # the host tier: the source of every copy into a slot
        self.stats = stats
        self.policy = policy
        self.routing_state = routing_state
        num_devices, slots = placement.num_devices, placement.slots_per_device
        w13, w2 = logical.w13, logical.w2
        # tiered: experts stay in the host tier (the logical stack) and each device computes from
        # its ExpertCache (set by the cluster); no HBM slot tensors are allocated
        self.tiered = tiered
        self.caches = None
        self.expert_bytes = w13[0].nbytes + w2[0].nbytes
        self.torch_devices = torch_devices  # None: every device emulated on the weights' device
        if torch_devices is None:  # one tensor for all devices' slots; each device a view of its rows
            rows = 0 if tiered else num_devices * slots
            self.slot_w13 = torch.zeros((rows, *w13.shape[1:]), dtype=w13.dtype, device=w13.device)
            self.slot_w2 = torch.zeros((rows, *w2.shape[1:]), dtype=w2.dtype, device=w2.device)
            self.device_w13 = [self.slot_w13[d * slots:(d + 1) * slots] for d in range(num_devices)]
            self.device_w2 = [self.slot_w2[d * slots:(d + 1) * slots] for d in range(num_devices)]
        else:
            rows = 0 if tiered else slots
            self.device_w13 = [torch.zeros((rows, *w13.shape[1:]), dtype=w13.dtype, device=dev) for dev in torch_devices]
            self.device_w2 = [torch.zeros((rows, *w2.shape[1:]), dtype=w2.dtype, device=dev) for dev in torch_devices]
            self.slot_w13 = self.slot_w2 = torch.zeros(0, device=w13.device)  # no slots on the engine's device
        self.slot_expert = np.full(num_devices * slots, -1, dtype=np.int64)
        self.slots_per_device = slots
        self.placement = placement
        self.load(placement)

    def load(self, placement: Placement) -> None:
        """Make the slots hold `placement`'s layer: copies only the slots whose expert changes
        (the migration's rows for this layer; the cluster counts their bytes)."""
        wanted = placement.slots[self.layer_idx].reshape(-1)
        changed = np.nonzero(wanted != self.slot_expert)[0]
        with torch.no_grad():
            for slot in () if self.tiered else changed:
                expert = int(wanted[slot])
                if expert >= 0:
                    device, local = divmod(int(slot), self.slots_per_device)
                    self.device_w13[device][local].copy_(self.logical.w13[expert])
                    self.device_w2[device][local].copy_(self.logical.w2[expert])
        self.slot_expert = wanted.copy()
        self.placement = placement
        prepare(placement)  # the compiled replica rule loads here, not in the next step
        # (expert, device) -> global slot, for routing a chosen replica to its slot
        num_devices = placement.num_devices
        table = np.full((self.logical.w13.shape[0], num_devices), -1, dtype=np.int64)
        for slot, expert in enumerate(wanted):
            if expert >= 0:
                table[expert, slot // self.slots_per_device] = slot
        # the routing table lives where the tokens are (the experts may be meta: left on disk)
        device = self.logical.w13.device if self.logical.w13.device.type != "meta" else self.stats.device
        self.slot_of = torch.from_numpy(table).to(device)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts_t: torch.Tensor):
        stats = self.stats
        tracer = stats.tracer
        t_dispatch = time.monotonic()
        mark = tracer.mark()
        token_device = stats.token_device
        # replica tables live on the CPU; route there, then bring the choice to the compute device
        devices_cpu = assign_replicas(self.placement, self.layer_idx, ids.cpu(), token_device.cpu(), self.policy,
                                                     self.routing_state, check=False)
        devices = devices_cpu.to(ids.device)
        slots = self.slot_of[ids, devices].flatten()
        order = torch.argsort(slots, stable=True)
        slot_counts = torch.bincount(slots, minlength=len(self.slot_expert))
        x_sorted = x.index_select(0, order // ids.shape[1])
        out = torch.empty_like(x_sorted)
        per_device = slot_counts.view(-1, self.slots_per_device)
        device_rows = per_device.sum(1).tolist()
        tracer.close(mark, "dispatch", 0, self.layer_idx)  # replica choice, sort by slot, gather
        start = 0
        s = self.slots_per_device
        for device, rows in enumerate(device_rows):
            if not rows:
                continue
            end = start + rows
            counts_d = per_device[device]
            counts_list = counts_d.tolist()  # on the CPU-side copy: no device sync
            active = [i for i, n in enumerate(counts_list) if n]
            rows_in = x_sorted[start:end]
            real = self.torch_devices[device] if self.torch_devices is not None else None
            if real is not None:  # a real dispatch copy to the GPU that holds these slots
                rows_in, counts_d = rows_in.to(real, non_blocking=True), counts_d.to(real)
            if self.tiered:  # misses are copied in from the host tier first: that time is the device's too
                experts = [int(self.slot_expert[device * s + i]) for i in active]
                result = stats.timed(device, lambda: self.caches[device].run_groups(
                    self.layer_idx, rows_in, experts, [counts_list[i] for i in active]), real, self.layer_idx)
            else:
                w13, w2 = self.device_w13[device], self.device_w2[device]
                offsets = grouped_offsets(counts_d, rows, w13, w2, self.logical.ffn)
                result = stats.timed(device, lambda: grouped_swiglu(rows_in, counts_list, w13, w2, offsets,
                                                                    self.logical.ffn),
                                     real, self.layer_idx)
            out[start:end] = result  # on a real device: the combine copy back
            stats.tokens[device] += rows
            stats.rows_layer[device, self.layer_idx] += rows
            stats.active_layer[device, self.layer_idx] += len(active)
            stats.peak_rows[device] = max(stats.peak_rows[device], rows)
            start = end
        bytes_per_row = x.shape[-1] * x.element_size()
        traffic = traffic_matrix(token_device.cpu(), devices_cpu, bytes_per_row, self.placement.num_devices).numpy()
        stats.traffic += traffic
        if tracer.enabled and stats.link_s_per_byte is not None:
            stats.note_link(self.layer_idx, t_dispatch, time.monotonic(), traffic)
        mark = tracer.mark()
        result = combine(out, order, weights, x.dtype)
        tracer.close(mark, "combine", 0, self.layer_idx)
        return result

