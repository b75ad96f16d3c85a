"""The simulated backend: an engine over a cluster that exists only in the step model.

SimulatedEngine has the engine's interface (the driver steps it, the engine host serves its
records and actions, the recorder writes them), so the console, replay and `record` work on it
unchanged. Its step loop is the engine's: commands, schedule (batching.py: continuous batching
and chunked prefill in every attention group, KV blocks from the memory plan's capacity), run
(the step model prices the scheduled batch on the placement in force, with this step's routing
drawn from the routing source) and postprocess (request events, the step record).

Everything it reports is simulated, and says so: the clock is simulated seconds (the header's
"clock": "simulated", t_start of the first step is 0), the records' devices are
{"backend": "simulated", "simulated": true}, every span is modeled, an applied placement's
migration stalls the next step by its modeled time. Only "process" is measured: the simulator's
own process.

With pipeline stages (config.pp) the placement is one stage's EP group (devices / pp), every
stage running its rows of its own layers; the records' per-device arrays cover every device and
say each one's stage ("stage", "pp", "pipeline"), the spans are the pipeline's schedule, and the
KV pool is the tightest stage's.

KV capacity per device: `memory_fraction` of HBM less the weights (step_model.memory_per_device,
with its expert slots) and the activations and communication buffers the memory planner sizes for
the knobs' largest step (planning/memory_plan.py), in blocks of `block_size` tokens of every
layer's KV (sliding-window layers counted whole).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, replace

import numpy as np
import psutil

from moectl.engine.core.commands import CommandQueue
from moectl.engine.core.config import KnobError, SchedulerKnobs
from moectl.engine.sim.batching import ClusterBatcher, Scheduled
from moectl.engine.sim.cluster_config import SimClusterConfig
from moectl.engine.sim.hardware import load_profile
from moectl.engine.sim.model_shape import load_sim_model
from moectl.engine.sim.routing import routing_from
from moectl.engine.sim.step_model import (
    SimSpec,
    StepLoad,
    _capped,
    balanced_stages,
    cluster_placement,
    memory_per_device,
    moe_rows,
    simulate,
    stage_of_devices,
    window_classes,
)
from moectl.placement.placement import PlacementError
from moectl.placement.topology import Topology, format_size
from moectl.wire.actions import Action
from moectl.wire.records import ENGINE_LANE, PROCESS_SAMPLE_S, device_lane

ALL_LINKS_LANE = "links (all devices)"


class SimStep:
    """A finished simulated step, as the listeners take engine steps (`as_record()`)."""
    __slots__ = ("record", "step", "devices")

    def __init__(self, record: dict):
        self.record = record
        self.step = record["step"]
        self.devices = record["devices"]

    def as_record(self) -> dict:
        return self.record


class SimulatedEngine:
    def __init__(self, config: SimClusterConfig, recorded_routing: np.ndarray | None = None):
        """recorded_routing: a trace's summed [layers, experts] routing when config.routing names
        one (the caller reads the trace)."""
        self.config = config
        self.sim_model = load_sim_model(config.model, config.dtype)
        self.hardware = load_profile(config.hardware)
        shape = self.sim_model.shape
        self.model_config = shape
        self.tokenizer = None
        self.moe_layers = [i for i, sparse in enumerate(shape.sparse_layers) if sparse]
        if not self.moe_layers:
            raise ValueError("--model: has no MoE layers to simulate")
        self.max_model_len = min(config.max_model_len, shape.max_position_embeddings)
        shares, self.routing_line = routing_from(config.routing, shape.num_sparse, shape.num_experts, config.seed,
                                                 recorded_routing)
        self.shares = shares
        hw, D, pp = self.hardware, config.devices, config.pp
        # with pipeline stages the placement is one stage's EP group (devices / pp): every stage runs
        # its own layers' rows of it on its own devices
        stage = D // pp
        try:
            placement = cluster_placement(shape, stage, config.redundant_slots, config.placement,
                                          config.placement_model)
        except PlacementError as exc:
            raise ValueError(f"--placement: {exc}") from None
        self.spec = SimSpec(self.sim_model, hw, D, shares, phase="decode", tokens_per_device=config.knobs.max_num_seqs,
                            context=min(self.max_model_len, shape.max_position_embeddings), tp=config.tp,
                            placement=moe_rows(placement, shape), overlap=config.overlap, pp=pp)
        if pp > 1:  # the stages' layers, fixed for the run (weights do not move between stages)
            self.spec = replace(self.spec, pp_layers=tuple(balanced_stages(self.spec)))
        self.stage_of = stage_of_devices(self.spec)
        topology = Topology(num_devices=stage, devices_per_node=hw.gpus_per_node, hbm_bytes=hw.hbm_bytes,
                            intra_node_gbps=hw.intra_node_gbps or 0.0, inter_node_gbps=hw.inter_node_gbps or 0.0)
        from moectl.engine.sim.sim_experts import SimExperts

        self.experts = SimExperts(self, placement, topology, config.redundant_slots, self.routing_line)
        self.groups = stage // config.tp
        self._plan_memory(config.knobs)
        self.batcher = ClusterBatcher(self.groups, self.blocks_per_group, config.block_size, config.knobs)
        self.windows, _ = window_classes(shape)
        self.rng = np.random.default_rng(config.seed)
        self.commands = CommandQueue()
        self.step_count = 0
        self.failure: str | None = None
        self.now = 0.0  # the simulated clock, seconds
        self.last_load: StepLoad | None = None
        self._step_listeners: list = []
        self._action_listeners: list = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._names: dict[int, str] = {}  # request number -> its id, for requests added with their own id
        self._pending_knobs = config.knobs
        # the all-to-alls are synchronised and priced at the busiest link: one lane for every device's
        self.lanes = [ENGINE_LANE] + [device_lane(d) for d in range(D)] + [ALL_LINKS_LANE]
        self._span_names = ["attention", "dispatch", "experts", "combine", "lm_head", "step_overhead"]
        if pp > 1:  # a pipeline's spans: each micro-batch's pass of a stage, and its send to the next
            self._span_names = ["pp_stage", "pp_send", "step_overhead"]
        self._arrived: list[dict] = []
        self._process = psutil.Process()
        self._process_sample: dict | None = None
        self.step_log: deque[SimStep] = deque(maxlen=16)

    # -- memory: the KV capacity the plan leaves
    def _plan_memory(self, knobs: SchedulerKnobs) -> None:
        from moectl.engine.planning.memory_plan import plan_memory

        shape, D, tp, pp = self.sim_model.shape, self.config.devices, self.config.tp, self.config.pp
        memory = memory_per_device(self.spec)
        stage_weights = [x["weights_bytes"] for x in memory["stages"]] if pp > 1 else [memory["weights_bytes"]]
        layers = [b - a + 1 for a, b in (x["layers"] for x in memory["stages"])] if pp > 1 else [shape.num_layers]
        topo = Topology(num_devices=D, devices_per_node=self.hardware.gpus_per_node, hbm_bytes=self.hardware.hbm_bytes)
        plan = plan_memory(shape, topo, tp=tp, ep=D // pp, context=self.max_model_len, batch=D // tp,
                           max_batched_tokens=knobs.max_num_batched_tokens, block_size=self.config.block_size,
                           pp=pp, pp_layers=list(self.spec.pp_layers) if pp > 1 else None)
        self._plan_table = plan.format_table()
        import torch

        kv_dtype = torch.float32 if self.sim_model.kv_bytes == 4 else torch.bfloat16
        # per stage: its weights (its layers' expert slots included), the plan's activations and
        # buffers on its fullest device, one KV block of its layers; the pool is the tightest stage's
        self._stage_memory, blocks = [], []
        for s, (weights, count) in enumerate(zip(stage_weights, layers)):
            worst = min((d for d in plan.devices if d.stage == s), key=lambda d: (d.headroom, d.device))
            block = shape.kv_bytes_per_block(tp, self.config.block_size, kv_dtype, False, layers=count)
            self._stage_memory.append({"weights": int(weights), "activations": int(worst.activations),
                                       "comm_buffers": int(worst.comm_buffers), "block_bytes": int(block)})
            free = self.hardware.hbm_bytes * self.config.memory_fraction - weights - worst.activations \
                - worst.comm_buffers
            blocks.append(int(free // block))
        self.memory_plan = {k: self._stage_memory[0][k] for k in ("weights", "activations", "comm_buffers")}
        self.block_bytes = self._stage_memory[0]["block_bytes"]
        self.blocks_per_group = min(blocks)
        if self.blocks_per_group < -(-knobs.long_prefill_token_threshold // self.config.block_size):
            tight = int(np.argmin(blocks))
            raise ValueError(f"--devices {D}: each device's {format_size(self.hardware.hbm_bytes)} of HBM holds "
                             f"{format_size(stage_weights[tight])} of weights plus activations"
                             + (f" (pipeline stage {tight})" if pp > 1 else "")
                             + ", leaving no room for a KV cache; give more devices")

    # -- requests (any thread)
    def add_request(self, prompt, params=None, *, request_id: str | None = None, priority: int = 0,
                    arrival: float | None = None, stream: bool = False):
        """A request of len(prompt) tokens that generates params.max_tokens (a simulated request
        has lengths, not text: token ids are only counted)."""
        if isinstance(prompt, str):
            raise ValueError("prompt: the simulated backend takes token ids (their count is the prompt's length)")
        if stream:
            raise ValueError("stream: a simulated request has lengths, not tokens; it streams nothing (its events "
                             "are in the step records)")
        prompt_len = len(prompt)
        max_tokens = getattr(params, "max_tokens", 16) if params is not None else 16
        return self.add_lengths(prompt_len, max_tokens, request_id=request_id)

    def add_lengths(self, prompt_len: int, max_tokens: int, *, request_id: str | None = None,
                    arrival: float | None = None) -> str:
        """arrival: when it arrived on the simulated clock (default: now, the next step's start)."""
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError("prompt: needs at least one prompt token and one to generate")
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(f"prompt: {prompt_len} tokens plus max_tokens {max_tokens} exceed the context of "
                             f"{self.max_model_len} tokens")
        blocks = -(-(prompt_len + max_tokens) // self.config.block_size)
        if blocks > self.blocks_per_group:
            raise ValueError(f"prompt: needs {blocks} KV blocks but a device's KV pool has {self.blocks_per_group}")
        number = next(self._ids)
        name = request_id or f"req-{number}"
        if request_id is not None:
            self._names[number] = request_id
        self.commands.submit(lambda: self._admit(number, name, prompt_len, max_tokens, arrival), "add")
        return name

    def _admit(self, number: int, name: str, prompt_len: int, max_tokens: int, arrival: float | None) -> None:
        t = self.now if arrival is None else min(arrival, self.now)
        self.batcher.add(number, prompt_len, max_tokens, t)
        self._arrived.append({"id": name, "event": "arrived", "t": t, "prompt_tokens": prompt_len})

    def abort(self, request_id: str) -> None:
        """Simulated requests run to their length: an abort (a client gone) changes nothing."""

    def update_knobs(self, **changes) -> SchedulerKnobs:
        with self._lock:
            new = self._pending_knobs.updated(**changes)
            if new.long_prefill_token_threshold > new.max_num_batched_tokens:
                raise KnobError("long_prefill_token_threshold: above max_num_batched_tokens, no chunk could run")
            if new.kv_retention != "full":
                raise KnobError("kv_retention: the simulated backend keeps every token's KV (it does not model "
                                "retention); `moectl plan memory --kv-budget` prices a budget")
            self._pending_knobs = new
            self.commands.submit(lambda: self._set_knobs(new, changes), Action.KNOBS)
        return new

    def _set_knobs(self, knobs: SchedulerKnobs, changes: dict) -> dict:
        self.batcher.knobs = knobs
        self.spec = replace(self.spec, tokens_per_device=knobs.max_num_seqs)
        self.record_action(Action.KNOBS, changes, knobs.as_dict())
        return knobs.as_dict()

    @property
    def knobs(self) -> SchedulerKnobs:
        return self.batcher.knobs

    def capture(self, steps: int) -> Future:
        raise ValueError("capture: a simulated cluster runs no kernels to profile (its spans are all modeled)")

    def submit(self, fn, kind: str = "call") -> Future:
        return self.commands.submit(fn, kind)

    def add_listener(self, on_step=None, on_action=None) -> None:
        if on_step is not None:
            self._step_listeners.append(on_step)
        if on_action is not None:
            self._action_listeners.append(on_action)

    def remove_listener(self, on_step=None, on_action=None) -> None:
        for listeners, fn in ((self._step_listeners, on_step), (self._action_listeners, on_action)):
            if fn in listeners:
                listeners.remove(fn)

    def record_action(self, kind: str, args: dict, result) -> None:
        action = {"time": self.now, "step": self.step_count, "kind": str(kind), "args": args, "result": result}
        for fn in list(self._action_listeners):
            fn(action)

    def clock(self) -> float:
        """The simulated clock (what a workload's arrivals are timed on)."""
        return self.now

    def advance_to(self, t: float) -> None:
        """An idle cluster's clock jumps to `t` (the next arrival)."""
        self.now = max(self.now, t)

    def placement_changed(self) -> None:
        self.spec = replace(self.spec, placement=self.experts.moe_placement())

    # -- the step loop (engine thread)
    def run_commands(self) -> None:
        self.commands.run(lambda kind, exc: self.record_action(f"{kind}_failed", {},
                                                               {"error": f"{type(exc).__name__}: {exc}"}))

    def has_unfinished(self) -> bool:
        return bool(len(self.commands)) or self.batcher.has_work()

    def fail_all(self, reason: str = "error", error: str | None = None) -> list:
        self.run_commands()
        self.batcher = ClusterBatcher(self.groups, self.blocks_per_group, self.config.block_size, self.batcher.knobs)
        return []

    def step(self) -> list:
        self.run_commands()
        t_start = self.now
        batch = self.batcher.schedule(t_start)
        if not batch.tokens.any():
            self.now += 1e-3  # nothing fits yet (every group waits): the clock moves on
            return []
        self.step_count += 1
        load, routing = self._load(batch)
        result = simulate(self.spec, load, detail=True)
        stall = self.experts.pending_stall_s
        self.experts.pending_stall_s = 0.0
        step_s = result["detail"]["step_s"] + stall
        t_end = t_start + step_s
        scheduled_ids = self.batcher.run["rid"][batch.tokens > 0].tolist()
        self.batcher.finish_step(batch, t_end)
        self.now = t_end
        self.last_load = load
        record = self._record(batch, scheduled_ids, routing, result, t_start, t_end, stall)
        step = SimStep(record)
        self.step_log.append(step)
        self.experts.observe_outcome(load, int(batch.tokens.sum()), step_s)
        for fn in list(self._step_listeners):
            fn(step)
        self.experts.after_step(self.step_count)
        return []

    def _load(self, batch: Scheduled) -> tuple[StepLoad, np.ndarray]:
        """The step model's load for this batch, and its routing ([layers, experts] pair counts)."""
        r, G = self.batcher.run, self.groups
        group, tokens, done = r["group"], batch.tokens, r["done"]
        decoding = (done >= r["target"]) & (tokens > 0)
        prefilling = (done < r["target"]) & (tokens > 0)
        shape = (len(self.windows), G)
        decode_keys, prefill_keys, reads = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        for i, w in enumerate(self.windows):
            decode_keys[i] = np.bincount(group[decoding], _capped(done[decoding] + 1, w), G)
            prefill_keys[i] = np.bincount(group[prefilling], tokens[prefilling]
                                          * _capped(done[prefilling] + tokens[prefilling] / 2, w), G)
            reads[i] = np.bincount(group[tokens > 0], _capped(done[tokens > 0] + tokens[tokens > 0], w), G)
        self._drift()
        pairs = self.rng.multinomial(int(tokens.sum()) * self.sim_model.shape.top_k, self.shares)
        load = StepLoad(np.bincount(group, tokens, G).astype(np.float64),
                        np.bincount(group, batch.samples, G).astype(np.float64),
                        decode_keys, prefill_keys, reads, pairs.astype(np.float64),
                        np.bincount(group[prefilling], tokens[prefilling], G).astype(np.float64))
        routing = np.zeros((self.sim_model.shape.num_layers, self.sim_model.shape.num_experts), dtype=np.int32)
        routing[self.moe_layers] = pairs
        return load, routing

    def _drift(self) -> None:
        """--drift: swaps of two experts' shares in each layer, Poisson with mean drift x experts
        per step: the skew stays, which experts are hot wanders."""
        if not self.config.drift:
            return
        layers, experts = self.shares.shape
        swaps = self.rng.poisson(self.config.drift * experts, layers)
        for layer in np.flatnonzero(swaps).tolist():
            order = np.arange(experts)
            for a, b in self.rng.integers(0, experts, (swaps[layer], 2)).tolist():  # one at a time: a
                order[a], order[b] = order[b], order[a]  # pair may repeat an expert
            self.shares[layer] = self.shares[layer][order]

    def _record(self, batch: Scheduled, scheduled_ids: list[int], routing: np.ndarray, result: dict, t_start: float,
                t_end: float, stall_s: float) -> dict:
        detail, D = result["detail"], self.config.devices
        layers = detail["layers"]
        busy, rows = detail["busy_s"], detail["rows"]
        step_s = t_end - t_start
        pp = self.config.pp
        if pp > 1:  # per device its stage's all-to-alls and expert rows, over the step's micro-batches
            link = np.asarray(detail["link_s"], dtype=np.float64)
            comm, critical, device_rows = float(link.mean()), float(detail["expert_critical_s"]), detail["device_rows"]
        else:
            comm = float(sum(layers.dispatch) + sum(layers.combine))
            link = np.full(D, comm)
            critical = float(sum(layers.expert))
            device_rows = rows.sum(0)
        window = self.experts.observe(routing, device_rows, busy, step_s)
        cost_model = self.experts.observe_time(self.last_load, layers, step_s - stall_s, critical, comm,
                                               int(batch.tokens.sum()))
        blocks = self.batcher.blocks_used()
        kv_devices = np.tile(np.repeat(blocks, self.config.tp), self.config.pp)  # every stage holds its layers' share
        memory = []
        for b, s in zip(kv_devices.tolist(), self.stage_of.tolist()):
            held, experts = self._stage_memory[s], self._expert_weight_bytes(s)
            memory.append({"dense_weights": held["weights"] - experts, "expert_weights": experts,
                           "kv_blocks": int(b * held["block_bytes"]), "activations": held["activations"],
                           "comm_buffers": held["comm_buffers"]})
        scheduled = self.batcher.take_events()
        if self._names:  # requests added with their own id (the batcher names them by number)
            for event in scheduled:
                event["id"] = self._names.get(int(event["id"][4:]), event["id"])
        requests, self._arrived = self._arrived + scheduled, []
        return {
            "step": self.step_count, "t_start": t_start, "t_end": t_end, "simulated": True,
            "batch": {"prefill_tokens": batch.prefill_tokens, "decode_tokens": batch.decode_tokens,
                      "num_seqs": len(scheduled_ids),
                      "request_ids": [self._names.get(i) or f"req-{i}" for i in scheduled_ids],
                      "preempted": [self._names.get(i) or f"req-{i}" for i in batch.preempted]},
            "routing": routing, "knobs": self.batcher.knobs.as_dict(),
            "cache": {"kv_blocks_used": int(blocks.sum()), "kv_blocks_total": self.batcher.kv_blocks_total(),
                      "prefix_queries": 0, "prefix_hits": 0, "preemptions": self.batcher.preemptions},
            "process": self._process_memory(), "requests": requests,
            "spans": self._pipeline_spans(detail, stall_s, step_s) if pp > 1 else self._spans(
                layers, busy, stall_s, step_s, (result["breakdown_ms"]["overhead"] + result["breakdown_ms"]["mtp"]) * 1e-3),
            "devices": {
                "backend": "simulated", "simulated": True, "tokens": device_rows.round().astype(np.int64).tolist(),
                "busy_s": busy.tolist(), "link_s": link.tolist(), "link_s_modeled": True,
                "step_time": {"step_s": step_s, "modeled": True, "simulated": True,
                              "other_s": max(0.0, step_s - stall_s - critical - comm), "expert_critical_s": critical,
                              "link_s": comm, "migration_stall_s": stall_s, "cost_model": cost_model,
                              "utilisation": (busy / step_s).tolist(), "wait_s": np.maximum(
                                  0.0, step_s - stall_s - link - busy).tolist()},
                "memory": memory,
                "memory_capacity": {"hbm": self.hardware.hbm_bytes, "kv_blocks": [self.blocks_per_group] * D},
                "tiered_experts": "off", "window": window,
                "breakdown_ms": result["breakdown_ms"],
                "pp": pp, "stage": self.stage_of.tolist(),
                **({"pipeline": self._pipeline_record(result)} if pp > 1 else {}),
            },
        }

    def _pipeline_record(self, result: dict) -> dict:
        """The step's pipeline, as the devices record carries it (all simulated)."""
        pp = result["pp"]
        return {"micro_batches": pp["micro_batches"], "stage_layers": pp["stage_layers"], "bubble": pp["bubble"],
                "stage_s": [x / 1e3 for x in pp["stage_ms"]], "transfer_s": [x / 1e3 for x in pp["transfer_ms"]],
                "transfer_links": pp["transfer_links"], "modeled": True}

    def _pipeline_spans(self, detail: dict, stall_s: float, step_s: float) -> dict:
        """Modeled spans of a pipelined step (pipeline.flush's schedule): each micro-batch's pass of
        a stage on every device lane of that stage ("pp_stage", layer -1), each send between
        stages on the links lane ("pp_send"), the step's costs outside the pipeline closing it on
        the engine lane; a migration's stall leaves the step's first `stall_s` empty."""
        run, D = detail["run"], self.config.devices
        stage_devices = [np.flatnonzero(self.stage_of == s) + 1 for s in range(self.config.pp)]
        lane, name, start, dur = [], [], [], []
        for j, (starts, ends) in enumerate(zip(run.start, run.end)):
            for s, (a, b) in enumerate(zip(starts, ends)):
                lane.append(stage_devices[s]), name.append(np.zeros(len(stage_devices[s]), int))
                start.append(np.full(len(stage_devices[s]), stall_s + a)), dur.append(np.full(len(stage_devices[s]), b - a))
            for a, b in zip(run.send_start[j], run.send_end[j]):
                lane.append([D + 1]), name.append([1]), start.append([stall_s + a]), dur.append([b - a])
        closing = step_s - stall_s - run.makespan
        if closing > 0:
            lane.append([0]), name.append([2]), start.append([stall_s + run.makespan]), dur.append([closing])
        n = sum(len(x) for x in lane)
        return {"lanes": self.lanes, "names": self._span_names,
                "lane": np.concatenate(lane).astype(np.int16), "name": np.concatenate(name).astype(np.int16),
                "layer": np.full(n, -1, dtype=np.int16),
                "start_s": np.concatenate(start).astype(np.float64), "dur_s": np.concatenate(dur).astype(np.float64),
                "modeled": np.ones(n, dtype=bool)}

    def _process_memory(self) -> dict:
        """The simulator's own process (measured), sampled at most every PROCESS_SAMPLE_S of wall time."""
        now = time.monotonic()
        sample = self._process_sample
        if sample is None or now - sample["wall"] >= PROCESS_SAMPLE_S:
            system = psutil.virtual_memory()
            sample = self._process_sample = {
                "rss_bytes": self._process.memory_info().rss, "sys_used_bytes": system.total - system.available,
                "sys_total_bytes": system.total, "sampled_at": self.now, "cuda": None, "wall": now}
        return {k: v for k, v in sample.items() if k != "wall"}

    def _expert_weight_bytes(self, stage: int = 0) -> int:
        """A device's expert slots' bytes: every MoE layer's, or with pipeline stages its stage's."""
        shape = self.sim_model.shape
        layers = shape.num_sparse
        if self.config.pp > 1:
            first = sum(self.spec.pp_layers[:stage])
            layers = sum(shape.sparse_layers[first:first + self.spec.pp_layers[stage]])
        return int(layers * self.spec.placement.slots_per_device * self.sim_model.expert_bytes())

    def _spans(self, layers, busy: np.ndarray, stall_s: float, step_s: float, overhead_s: float = 0.0) -> dict:
        """Modeled spans of one step: per MoE layer the slowest device's part before the dispatch
        on the engine lane, each device's expert GEMMs on its lane, the dispatch and combine on
        the one links lane; the dense layers and the LM head on the engine lane; a migration's
        stall leaves the step's first `stall_s` empty; the step's own overhead (`overhead_s`: fixed
        costs, MTP's draft layers) closes it. With overlap the parts, laid end to end, take longer
        than the overlapped step (or less, where the halves' floors cost more than overlap hides):
        they are scaled to fit it (overlap.py schedules the halves'
        chunks to price the step; the spans show the parts, not that schedule)."""
        D = self.config.devices
        pre, dense = layers.pre_moe, layers.dense_layer
        lane, name, layer_ids, start, dur = [], [], [], [], []
        t = stall_s
        device_lanes = np.arange(1, D + 1)
        link_lane = D + 1
        sparse = set(self.moe_layers)
        # every device's expert time per MoE layer, shaped as the placement's rows split its busy
        per_layer = self._expert_seconds(layers)
        m = 0
        for i in range(self.sim_model.shape.num_layers):
            if i not in sparse:
                lane.append([0]), name.append([0]), layer_ids.append([i]), start.append([t]), dur.append([dense])
                t += dense
                continue
            lane.append([0]), name.append([0]), layer_ids.append([i]), start.append([t]), dur.append([pre])
            t += pre
            d_s, e_s, c_s = layers.dispatch[m], layers.expert[m], layers.combine[m]
            lane += [[link_lane], device_lanes, [link_lane]]
            name += [[1], np.full(D, 2), [3]]
            layer_ids += [[i], np.full(D, i), [i]]
            start += [[t], np.full(D, t + d_s), [t + d_s + e_s]]
            dur += [[d_s], per_layer[m], [c_s]]
            t += d_s + e_s + c_s
            m += 1
        head = float(layers.lm_head.max())
        lane.append([0]), name.append([4]), layer_ids.append([-1]), start.append([t]), dur.append([head])
        t += head
        if overhead_s > 0:  # the step's fixed costs outside the layers (and MTP's draft layers)
            lane.append([0]), name.append([5]), layer_ids.append([-1]), start.append([t]), dur.append([overhead_s])
            t += overhead_s
        n = sum(len(x) for x in lane)
        starts, durs = np.concatenate(start).astype(np.float64), np.concatenate(dur).astype(np.float64)
        laid = t - stall_s
        if laid > 0 and step_s - stall_s > 0 and laid != step_s - stall_s:  # overlap hid part, or its halves cost more
            scale = (step_s - stall_s) / laid
            starts, durs = stall_s + (starts - stall_s) * scale, durs * scale
        return {"lanes": self.lanes, "names": self._span_names,
                "lane": np.concatenate(lane).astype(np.int16), "name": np.concatenate(name).astype(np.int16),
                "layer": np.concatenate(layer_ids).astype(np.int16),
                "start_s": starts, "dur_s": durs,
                "modeled": np.ones(n, dtype=bool)}

    def _expert_seconds(self, layers) -> np.ndarray:
        """[MoE layers, devices] expert seconds: each layer's rows share of the device's total."""
        rows = layers.rows
        totals = rows.sum(0)
        share = np.divide(rows, totals, out=np.zeros_like(rows), where=totals > 0)
        return share * layers.device_expert

    # -- what the header and `stats` report
    def header_extra(self) -> dict:
        """The simulated backend's part of the trace header: where every figure came from."""
        hw = self.hardware
        return {"clock": "simulated", "simulated": {
            "hardware": hw.name, "hardware_file": str(self.config.hardware), "devices": self.config.devices,
            "pricing": "kernel tables" if hw.kernels is not None else "roofline only",
            "nodes": -(-self.config.devices // hw.gpus_per_node), "tp": self.config.tp, "overlap": self.config.overlap,
            "pp": self.config.pp, **({"stage_layers": self._stage_layers()} if self.config.pp > 1 else {}),
            "routing": self.routing_line, "drift": self.config.drift, "gemm_dtype": self.sim_model.gemm_dtype,
            "kv_blocks_per_device": self.blocks_per_group, "block_size": self.config.block_size,
            "memory_fraction": self.config.memory_fraction}}

    def _stage_layers(self) -> list[list[int]]:
        """Each pipeline stage's first and last layer."""
        out, first = [], 0
        for count in self.spec.pp_layers:
            out.append([first, first + count - 1])
            first += count
        return out

    def memory_plan_table(self) -> dict:
        """The memory plan the KV capacity came from, as a header's "memory_plan" (its KV column
        is the plan's one sequence per attention group at max_model_len; the pool is what is left)."""
        return {"table": self._plan_table + f"\nKV pool per device (simulated): {self.blocks_per_group:,} blocks of "
                                            f"{self.config.block_size} tokens"}

    def stats(self) -> dict:
        return {"steps": self.step_count, "running": self.batcher.running, "waiting": len(self.batcher.waiting)}


def engine_config_dict(config: SimClusterConfig) -> dict:
    """The config as a trace header's "engine_config" (plain values)."""
    out = {k: v for k, v in asdict(config).items() if k not in ("placement", "knobs")}
    out["model"] = str(config.model)
    return out


