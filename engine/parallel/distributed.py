"""The distributed backend: one process per device with torch.distributed.

Launched by `generate_distributed(..., nproc=N)` / `launch_distributed` (torch.multiprocessing,
gloo on CPU, NCCL on GPU) or by torchrun (`torchrun --nproc-per-node N -m moectl.engine.parallel.distributed
--model DIR --prompt-ids 1,2,3`).

Layout over W ranks: attention is tensor parallel within groups of `tp` consecutive ranks
(tp divides W; when tp < W the W / tp groups compute the same attention), experts are spread
over all W ranks (expert parallel: each rank runs its experts on the tokens routed to them and
one all_reduce combines the outputs); see rank_experts.py.

Rank 0 runs the real LLMEngine (scheduler, block manager, sampler, telemetry). Its ModelRunner
prepares each step's tensors as usual; just before the forward they are broadcast to every
other rank over a gloo control group (`StepChannel`), every rank runs the same forward on its
shards, and rank 0 alone computes logits and samples. The other ranks run `worker_loop` until
rank 0 publishes "stop". With --overlap two-batch rank 0 also publishes where the step splits
into two micro-batches, so every rank runs the same interleaved schedule (two_batch.py).

Before serving, every rank fingerprints the model it loaded (config.json, tensor names and
shapes, sampled weight bytes) and the launch settings; any disagreement makes every rank raise
the same one-line ValueError, and the launch exits with code 2.

Limits: every rank reads the whole checkpoint and then frees what it does not keep (peak host
memory is one full model per rank); kv_cache_memory is each rank's budget for its own kv heads;
when tp < W the W / tp tensor-parallel groups repeat the same attention (no data parallelism:
rank 0's one scheduler feeds one batch); embeddings, router, LM head, dense MLP layers and the
shared expert are replicated; sampling happens on rank 0 only.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pickle
import queue as queue_mod
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moectl.engine.core import gc_heap, paged_decode
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.model_runner import ModelRunner
from moectl.engine.core.outputs import EngineLost
from moectl.engine.core.paged_attention import DecodeGroup, PagedContext, PrefillSlice
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.experts.control import ExpertControl
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.loader import load_model
from moectl.engine.parallel import two_batch
from moectl.engine.parallel.cluster import DistributedCluster
from moectl.engine.parallel.rank_experts import RankStepStats, install, migrate
from moectl.engine.parallel.sharding import (
    MAX_TP,
    ParallelError,
    apply_tensor_parallel,
    check_tp_size,
    local_kv_heads,
)
from moectl.placement.placement import Placement
from moectl.placement.topology import Topology

COLLECTIVE_TIMEOUT_S = 300.0  # a compute collective that waits longer than this fails the launch
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # workers wait this long for rank 0's next step (an idle server)
LAUNCH_TIMEOUT_S = 900.0  # generate_distributed gives up (and kills every rank) after this


class DistributedError(EngineLost):
    """A distributed launch failed for a reason other than bad input (a crash, a timeout); in a
    step, the engine cannot step again (its ranks are gone or out of step)."""


# ---------------------------------------------------------------- process groups

@dataclasses.dataclass
class DistState:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    ctrl_group: Any = None  # gloo, long timeout: step metadata and the agreement exchange

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None = None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> DistState:
    """Joins the process group described by the environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT: what torchrun sets). NCCL and cuda:LOCAL_RANK when CUDA is
    available (and device is not "cpu"), else gloo on the CPU."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise ValueError("distributed: RANK and WORLD_SIZE must be set (launch with torchrun or --nproc)") from None
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but CUDA is not available")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    return _make_ctrl(DistState(rank, world, local_rank, dev))


def _init_from_store(rank: int, world: int, port: int, device: str, timeout_s: float,
                     export_env: bool = True) -> DistState:
    """For processes spawned by `launch`: the parent hosts the TCPStore, so no port can race.
    export_env: also say so in torchrun's variables, for a spawned rank's libraries. A front end
    that is rank 0 in its own process passes False: the variables would outlive its engine and
    make every process it starts later look like a torchrun rank."""
    if export_env:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = str(device).startswith("cuda")
    if use_cuda:
        if not torch.cuda.is_available():
            raise ValueError("device: cuda requested but CUDA is not available")
        if torch.cuda.device_count() < world:
            raise ValueError(f"nproc: {world} processes need {world} GPUs, found {torch.cuda.device_count()}")
        torch.cuda.set_device(rank)
        dev, backend = torch.device("cuda", rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return _make_ctrl(DistState(rank, world, rank, dev))


def _make_ctrl(state: DistState) -> DistState:
    state.ctrl_group = dist.new_group(list(range(state.world_size)), backend="gloo",
                                      timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    return state


def _make_tp_groups(state: DistState, tp: int) -> None:
    """TP groups of `tp` consecutive ranks; every rank creates every group (new_group's rule)."""
    state.tp_size, state.tp_rank = tp, state.rank % tp
    state.tp_group = None
    if tp == state.world_size:
        return  # the default group
    if tp == 1:
        return
    for start in range(0, state.world_size, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= state.rank < start + tp:
            state.tp_group = group


def default_tp(cfg: ModelConfig, world_size: int) -> int:
    """The largest tp <= 8 that divides the world size and fits the model's heads."""
    for tp in range(min(world_size, MAX_TP), 0, -1):
        if world_size % tp:
            continue
        try:
            check_tp_size(cfg.num_heads, cfg.num_kv_heads, tp)
            return tp
        except ParallelError:
            continue
    return 1


def check_layout(cfg: ModelConfig, world_size: int, tp: int) -> None:
    check_tp_size(cfg.num_heads, cfg.num_kv_heads, tp)
    if world_size % tp:
        raise ParallelError(f"tp: {tp} does not divide the {world_size} ranks")
    if world_size > cfg.num_experts:
        raise ParallelError(f"nproc: {world_size} ranks exceed the model's {cfg.num_experts} experts "
                            f"(every rank must own at least one)")


# ---------------------------------------------------------------- model agreement

def _sample_digest(t: torch.Tensor, samples: int = 4096) -> str:
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // samples)
    picked = flat[::step].cpu().contiguous()
    if picked.dtype == torch.bool:
        picked = picked.to(torch.uint8)
    return hashlib.sha256(picked.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def model_fingerprint(model_dir: str | Path, model) -> dict:
    """What a rank loaded, cheaply: config.json's contents, every tensor's name/shape/dtype and
    a digest of up to 4096 evenly strided elements of it (before any sharding)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    config = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]
    tensors = {name: (tuple(t.shape), str(t.dtype), _sample_digest(t)) for name, t in model.state_dict().items()}
    return {"path": str(Path(model_dir).resolve()), "config": config, "tensors": tensors}


def _compare(mine: dict, ref: dict) -> str | None:
    """Why fingerprint `mine` differs from rank 0's `ref`, or None."""
    if mine["config"] != ref["config"]:
        return "config.json differs"
    a, b = mine["tensors"], ref["tensors"]
    if set(a) != set(b):
        name = sorted(set(a) ^ set(b))[0]
        return f"tensor {name} is in one checkpoint only"
    for name in sorted(b):
        if a[name][:2] != b[name][:2]:
            return f"tensor {name} has shape/dtype {a[name][:2]} vs {b[name][:2]}"
    for name in sorted(b):
        if a[name][2] != b[name][2]:
            return f"weights differ, first in {name}"
    return None


def _exchange(state: DistState, payload: dict) -> list[dict]:
    out: list = [None] * state.world_size
    dist.all_gather_object(out, payload, group=state.ctrl_group)
    return out


def _raise_first_error(reports: list[dict], what: str) -> None:
    for rank, rep in enumerate(reports):
        if rep.get("error"):
            kind = ValueError if rep.get("value_error") else DistributedError
            raise kind(f"distributed: rank {rank} {what}: {rep['error']}")


def _error_report(exc: BaseException) -> dict:
    return {"error": f"{exc}" if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}",
            "value_error": isinstance(exc, ValueError)}


def check_agreement(state: DistState, fingerprint: dict | None, settings: dict, error: BaseException | None) -> None:
    """Every rank calls this once after loading; all raise the same one-line error on any
    load failure, launch-setting mismatch or model mismatch."""
    payload = _error_report(error) if error is not None else {"fingerprint": fingerprint, "settings": settings}
    reports = _exchange(state, payload)
    _raise_first_error(reports, "could not load the model")
    ref = reports[0]
    for rank, rep in enumerate(reports[1:], start=1):
        for key, value in ref["settings"].items():
            if rep["settings"].get(key) != value:
                raise ValueError(f"distributed: rank {rank} was launched with {key}={rep['settings'].get(key)!r} "
                                 f"but rank 0 with {key}={value!r}")
        why = _compare(rep["fingerprint"], ref["fingerprint"])
        if why is not None:
            raise ValueError(f"distributed: rank {rank} loaded a different model than rank 0 ({why}; "
                             f"rank 0: {ref['fingerprint']['path']}, rank {rank}: {rep['fingerprint']['path']})")


# ---------------------------------------------------------------- the step channel

_MAGIC = 0x4D6F45  # "MoE": a step; a payload that starts with neither magic is a protocol bug
_PLACEMENT = 0x504C43  # "PLC": a new expert placement, carried out by every rank before the next step


class StepChannel:
    """Rank 0 -> all ranks over the gloo control group: one engine step's prepared inputs, or a
    new placement, as one int64 tensor (a length, then the payload; length 0 means stop)."""

    def __init__(self, group, block_size: int):
        self.group = group
        self.block_size = block_size
        self._lock = threading.Lock()  # a stop from another thread never splits a length from its payload

    def _broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=0, group=self.group)

    def _send(self, payload: torch.Tensor) -> None:
        with self._lock:
            self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64))
            self._broadcast(payload)

    def publish(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedContext, split: int = 0,
                interleaved: bool = True) -> None:
        self._send(pack_step(input_ids, positions, ctx, split, interleaved))

    def publish_placement(self, placement: Placement) -> None:
        slots = placement.slots
        head = torch.tensor([_PLACEMENT, placement.num_experts, *slots.shape], dtype=torch.int64)
        self._send(torch.cat([head, torch.from_numpy(slots.reshape(-1).copy())]))

    def publish_stop(self) -> None:
        with self._lock:
            self._broadcast(torch.zeros(1, dtype=torch.int64))

    def receive(self, cache: KVCache, device: torch.device):
        """("step", input_ids, positions, ctx, split, interleaved) or ("placement", Placement) of the next message,
        or None when rank 0 said stop."""
        length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length)
        if int(length) == 0:
            return None
        payload = torch.empty(int(length), dtype=torch.int64)
        self._broadcast(payload)
        if int(payload[0]) == _PLACEMENT:
            num_experts, L, D, S = payload[1:5].tolist()
            return "placement", Placement(payload[5:].numpy().reshape(L, D, S), num_experts)
        return ("step", *unpack_step(payload, cache, device))


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).to("cpu", torch.int64)


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedContext, split: int = 0,
              interleaved: bool = True) -> torch.Tensor:
    """split: where the step's two micro-batches divide its tokens (0: one batch; two_batch.py);
    interleaved False: they run one after the other (the bench's split-without-overlap control)."""
    n, b = input_ids.numel(), ctx.num_decodes
    head = [_MAGIC, n, b, len(ctx.prefills), int(ctx.window is not None), split, int(interleaved)]
    parts = [torch.tensor(head, dtype=torch.int64), _i64(input_ids), _i64(positions)]
    if b:
        parts.append(_i64(ctx.decode_context_lens))
    for view in (ctx, ctx.window) if ctx.window is not None else (ctx,):  # the window view: the same rows
        parts += [_i64(view.slot_mapping), torch.tensor([len(view.decode_groups)], dtype=torch.int64)]
        for g in view.decode_groups:
            firsts = g.first_positions if g.first_positions is not None else torch.zeros(g.end - g.start)
            padded = g.mask is not None or g.lens is not None  # an in-place group may be padded: its rows say
            parts += [torch.tensor([g.start, g.end, g.width, int(padded)], dtype=torch.int64),
                      _i64(g.blocks), _i64(firsts)]
        for p in view.prefills:
            parts += [torch.tensor([p.start, p.end, p.cached_len, p.block_table.numel(), p.first_position],
                                   dtype=torch.int64), _i64(p.block_table)]
    return torch.cat(parts)


def unpack_step(payload: torch.Tensor, cache: KVCache, device: torch.device):
    cur = 0

    def take(count: int) -> torch.Tensor:
        nonlocal cur
        out = payload[cur:cur + count]
        cur += count
        return out

    magic, n, b, num_prefills, has_window, split, interleaved = take(7).tolist()
    if magic != _MAGIC or has_window != (cache.window is not None) or not 0 <= split < max(n, 1):
        raise DistributedError("distributed: corrupt step message from rank 0")
    ids, positions = take(n).to(device), take(n).to(device)
    lens = take(b) if b else None
    bs = cache.block_size
    in_place = paged_decode.serves(cache)  # this rank's own cache decides, as on rank 0

    def view(view_cache, window: bool) -> PagedContext:
        ctx = PagedContext(cache=view_cache, slot_mapping=take(n).to(device))
        if b:
            ctx.num_decodes, ctx.decode_context_lens = b, lens.to(device)
        for _ in range(int(take(1))):  # the window view groups its decodes by their own lengths
            start, end, gw, has_mask = take(4).tolist()
            blocks, firsts = take((end - start) * gw).to(device), take(end - start)
            if in_place:
                ctx.decode_groups.append(DecodeGroup(start, end, blocks.view(end - start, gw), gw, None,
                                                     lens=(lens[start:end] - firsts).to(device)))
                continue
            mask = None
            if has_mask:
                mask = (torch.arange(gw * bs)[None, :] < (lens[start:end] - firsts)[:, None])[:, None, None, :]
                mask = mask.to(device)
            ctx.decode_groups.append(DecodeGroup(start, end, blocks, gw, mask, firsts.to(device) if window else None))
        for _ in range(num_prefills):
            start, end, cached, tlen, first = take(5).tolist()
            ctx.prefills.append(PrefillSlice(start, end, cached, take(tlen).to(device), first))
        return ctx

    ctx = view(cache, False)
    if has_window:
        ctx.window = view(cache.window, True)
    if cur != payload.numel():
        raise DistributedError("distributed: corrupt step message from rank 0")
    return ids, positions, ctx, split, bool(interleaved)


class _PublishingModel:
    """Stands in for the model inside rank 0's ModelRunner: publishes each step's inputs to the
    other ranks, then runs the real (sharded) forward."""

    def __init__(self, model, channel: StepChannel, overlap: str = "none", stats: RankStepStats | None = None,
                 overlap_min_tokens: int = two_batch.DEFAULT_MIN_TOKENS):
        self.model, self.channel = model, channel
        self.cfg = model.cfg
        self.after_forward = None  # rank 0's cluster: gathers every rank's figures for the step
        self.health = None  # see DistributedModelRunner.health
        self.overlap = overlap  # none | two-batch: read every step, so it can change between steps
        self.overlap_min_tokens = overlap_min_tokens
        self.interleaved = True  # False: the two micro-batches one after the other (bench/two_batch_overlap.py)
        self.stats = stats

    def __call__(self, input_ids, positions, ctx, probe=None):
        try:
            # a probe that reads the step's hidden states whole (verify's layer-by-layer one) keeps
            # one batch; the routing counts add up over micro-batches
            whole = probe is not None and not getattr(probe, "splittable", False)
            split = 0 if whole else two_batch.choose_split(self.overlap, input_ids.numel(), self.overlap_min_tokens,
                                                           ctx)
            if self.stats is not None:
                self.stats.split = split
            self.channel.publish(input_ids, positions, ctx, split, self.interleaved)
            hidden = two_batch.forward(self.model, input_ids, positions, ctx, split, self.stats, probe,
                                       self.interleaved)
            if self.after_forward is not None:
                self.after_forward()
        except Exception as exc:  # noqa: BLE001 - from the publish to the gather the ranks run in
            # lockstep: a failure here (a collective, or rank 0's own part) leaves them out of step
            if self.health is not None:
                self.health(exc)  # raises DistributedError naming the rank, and ends the group
            raise
        return hidden

    def logits(self, hidden):
        return self.model.logits(hidden)


class DistributedModelRunner(ModelRunner):
    """Rank 0's runner: ModelRunner's own input preparation, with every forward mirrored on the
    other ranks. `shutdown()` releases them."""

    def __init__(self, model, cache: KVCache, device: torch.device, channel: StepChannel, overlap: str = "none",
                 stats: RankStepStats | None = None, overlap_min_tokens: int = two_batch.DEFAULT_MIN_TOKENS):
        super().__init__(_PublishingModel(model, channel, overlap, stats, overlap_min_tokens), cache, device)
        self.channel = channel
        self.closed = False

    @property
    def health(self):
        """health(error=None): raises DistributedError naming a failed rank (group.RankGroup.check)."""
        return self.model.health

    @health.setter
    def health(self, check) -> None:
        self.model.health = check

    def run(self, *args, **kwargs):
        if self.health is not None:
            self.health()  # a rank that died while idle fails this step before it starts
        return super().run(*args, **kwargs)

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.channel.publish_stop()


def worker_loop(model, cache: KVCache, channel: StepChannel, device: torch.device, experts=None,
                stats: RankStepStats | None = None, state: DistState | None = None) -> int:
    """Ranks other than 0: run each step rank 0 publishes, then send rank 0 this rank's figures
    for it (one fixed-size gather); move experts when rank 0 publishes a placement. Returns the
    step count when rank 0 says stop."""
    steps = 0
    gc_heap.engine_built()  # this rank's model and cache live as long as the loop
    with torch.inference_mode():
        while (message := channel.receive(cache, device)) is not None:
            if message[0] == "placement":
                report = migrate(experts, message[1], state.rank, state.world_size, None)
                dist.all_gather_object([None] * state.world_size, report, group=state.ctrl_group)
                continue
            _, ids, positions, ctx, split, interleaved = message
            if stats is not None:
                stats.reset()
            two_batch.forward(model, ids, positions, ctx, split, stats, interleaved=interleaved)
            steps += 1
            if stats is not None:
                dist.gather(stats.pack(), None, dst=0, group=state.ctrl_group)
    return steps


# ---------------------------------------------------------------- one rank's session

def kv_blocks_for(config: EngineConfig, cfg: ModelConfig, tp: int) -> tuple[int, int, int]:
    """(kv heads per rank, KV blocks, sliding-window KV blocks): kv_cache_memory is each rank's
    budget for its own heads (the rule of the engine's own sizing, KVCache.pool_sizes_for)."""
    heads = local_kv_heads(cfg.num_heads, cfg.num_kv_heads, tp) if cfg.attention == "gqa" else None
    quantized = config.kv_cache_dtype == "int8"
    blocks, window_blocks = KVCache.pool_sizes_for(cfg, config.block_size, quantized, config.kv_cache_memory,
                                                   config.num_kv_blocks, config.knobs, heads)
    return heads, blocks, window_blocks


def initial_placement(config: EngineConfig, cfg: ModelConfig, world: int) -> Placement:
    if config.placement is not None:
        return Placement.from_dict(config.placement)
    return Placement.contiguous(cfg.num_layers, cfg.num_experts, world, config.redundant_slots)


def _make_engine(config: EngineConfig, model, kv_heads: int, channel: StepChannel, state: DistState,
                 experts, stats: RankStepStats, placement: Placement) -> LLMEngine:
    """Rank 0's real engine over this rank's share of the KV heads, with a runner that mirrors
    every forward on the other ranks, and `engine.experts` over the ranks' experts."""
    topology = config.topology or Topology(num_devices=state.world_size)
    if topology.num_devices != state.world_size:
        raise ValueError(f"devices: the topology has {topology.num_devices} devices, the launch "
                         f"{state.world_size} ranks")
    config = dataclasses.replace(config, topology=topology)

    def expert_layer(engine: LLMEngine) -> ExpertControl:
        cluster = DistributedCluster(engine.model, topology, placement, experts, stats, state, channel,
                                     policy=config.routing_policy, auto=config.auto_rebalance, knobs=config.knobs,
                                     kv_pool_bytes=engine.kv_cache.nbytes())
        engine.runner.model.after_forward = cluster.collect
        return ExpertControl(engine, cluster, "none")

    return LLMEngine(config, model=model, kv_heads=kv_heads, experts=expert_layer, kv_pools=1,
                     runner_factory=lambda m, cache, device: DistributedModelRunner(m, cache, device, channel,
                                                                                     config.overlap, stats,
                                                                                     config.overlap_min_tokens))


def run_rank(config: EngineConfig, job: Callable[[LLMEngine], Any], tp: int | None = None,
             state: DistState | None = None) -> Any:
    """One rank's whole session inside an initialised process group: load, agree, shard, then
    rank 0 runs `job(engine)` on a real LLMEngine (its return value is returned) while the
    other ranks serve its steps (they return None)."""
    state = state or init_distributed(config.device)
    engine = start_rank(config, tp, state)
    if engine is None:
        return None
    try:
        return job(engine)
    finally:
        engine.runner.shutdown()


def start_rank(config: EngineConfig, tp: int | None, state: DistState,
               compute_timeout_s: float | None = None) -> LLMEngine | None:
    """Load, agree, shard. Rank 0 gets its LLMEngine back (call `engine.runner.shutdown()` to
    release the others); every other rank serves rank 0's steps until it says stop, then
    returns None. compute_timeout_s: once every rank has started (which may take long), the
    compute collectives' timeout, so a rank that hangs mid-step fails the step quickly."""
    if isinstance(config.num_threads, int):  # the launchers turn "auto" into each rank's share
        torch.set_num_threads(config.num_threads)
    model = fp = error = None
    settings = {"world_size": state.world_size, "tp": tp, "dtype": str(config.dtype),
                "block_size": config.block_size, "kv_cache_dtype": config.kv_cache_dtype,
                "num_kv_blocks": config.num_kv_blocks, "kv_cache_memory": config.kv_cache_memory}
    try:
        cfg = ModelConfig.from_dir(config.model, dtype=config.dtype)
        tp = default_tp(cfg, state.world_size) if tp is None else tp
        settings["tp"] = tp
        check_layout(cfg, state.world_size, tp)
        model = load_model(config.model, dtype=config.dtype, device=state.device)
        fp = model_fingerprint(config.model, model)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised there
        error = exc
    check_agreement(state, fp, settings, error)
    _make_tp_groups(state, tp)
    engine = cache = channel = experts = stats = None
    error = None
    try:
        apply_tensor_parallel(model, state.tp_rank, tp, state.tp_group)
        placement = initial_placement(config, model.cfg, state.world_size)
        stats = RankStepStats(model.cfg.num_layers, state.world_size, state.device)
        node = config.topology.devices_per_node if config.topology is not None else None
        experts = install(model, placement, state.rank, state.world_size, stats, config.routing_policy,
                          devices_per_node=node)
        heads, num_blocks, window_blocks = kv_blocks_for(config, model.cfg, tp)
        channel = StepChannel(state.ctrl_group, config.block_size)
        if state.is_driver:  # the engine sizes its cache by the same rule as kv_blocks_for
            engine = _make_engine(config, model, heads, channel, state, experts, stats, placement)
        else:
            cfg = model.cfg
            cache = KVCache.for_model(cfg, num_blocks, config.block_size, config.kv_cache_dtype == "int8",
                                      state.device, heads, window_blocks)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised there
        error = exc
    reports = _exchange(state, _error_report(error) if error is not None else {})
    _raise_first_error(reports, "could not start")
    if compute_timeout_s is not None:
        _set_compute_timeout(state, compute_timeout_s)
    if not state.is_driver:
        worker_loop(model, cache, channel, state.device, experts, stats, state)
        return None
    return engine


def _set_compute_timeout(state: DistState, seconds: float) -> None:
    # torch has no public setter; without it the start-up timeout stays (slower failure detection)
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds))  # the default group: expert parallelism, the gathers
    if state.tp_group is not None:
        _set_pg_timeout(timedelta(seconds=seconds), state.tp_group)


# ---------------------------------------------------------------- jobs for rank 0

@dataclasses.dataclass
class GenerateJob:
    prompts: list
    params: SamplingParams | list[SamplingParams] | None = None

    def __call__(self, engine: LLMEngine) -> list[dict]:
        outs = engine.generate(self.prompts, self.params)
        return [{"prompt_ids": o.prompt_ids, "token_ids": o.token_ids, "text": o.text} for o in outs]


@dataclasses.dataclass
class ScoreJob:
    token_ids: list[int]

    def __call__(self, engine: LLMEngine) -> torch.Tensor:
        return engine.score(self.token_ids).cpu()


# ---------------------------------------------------------------- the launcher

def _child(rank: int, world: int, port: int, device: str, timeout_s: float, num_threads: int | None,
           fn: Callable[[], Any], results) -> None:
    code = 0
    gc_heap.own_process()  # a rank runs its engine (or step loop) for its whole life
    try:
        if num_threads:
            torch.set_num_threads(num_threads)
        state = _init_from_store(rank, world, port, device, timeout_s)
        try:
            out = fn(state)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # plain pickle bytes: torch's queue pickler would pass tensors as shared-memory handles,
        # which die with this process
        results.put(("ok", rank, pickle.dumps(out if rank == 0 else None)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as one line
        code = 2 if isinstance(exc, ValueError) else 1
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, ValueError) and not msg.startswith("distributed:"):
            msg = f"distributed: rank {rank} failed: {type(exc).__name__}: {msg}"
        results.put(("error", rank, isinstance(exc, ValueError), msg))
    finally:
        results.close()
        results.join_thread()
    os._exit(code)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2)


def launch(fn: Callable[[DistState], Any], nproc: int, device: str = "cpu", timeout_s: float = LAUNCH_TIMEOUT_S,
           collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, num_threads: int | None = None) -> Any:
    """Runs `fn(state)` in `nproc` spawned processes joined in one process group; returns rank
    0's result. Any rank's failure stops every rank and is raised here as one line: ValueError
    for bad input (exit code 2 in the children), DistributedError otherwise. Nothing is left
    running: ranks still alive at the end, on error or after timeout_s are terminated."""
    import torch.multiprocessing as mp

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc: must be a positive integer, got {nproc!r}")
    if num_threads is None:
        num_threads = threads_per_rank(device, nproc)
    store = dist.TCPStore("127.0.0.1", 0, nproc + 1, True, wait_for_workers=False,
                          timeout=timedelta(seconds=collective_timeout_s))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, nproc, store.port, device, collective_timeout_s, num_threads,
                                              fn, results), daemon=True, name=f"moectl-rank{r}")
             for r in range(nproc)]
    try:
        for p in procs:
            p.start()
        done: dict[int, Any] = {}
        errors: list[tuple[int, bool, str]] = []
        deadline = time.monotonic() + timeout_s
        while len(done) < nproc and not errors:
            try:
                msg = results.get(timeout=0.2)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise DistributedError(f"distributed: timed out after {timeout_s:.0f} s; "
                                           f"all ranks stopped") from None
                for rank, p in enumerate(procs):
                    if rank not in done and p.exitcode is not None:
                        try:  # its report may still be in flight
                            msg = results.get(timeout=1.0)
                            break
                        except queue_mod.Empty:
                            raise DistributedError(f"distributed: rank {rank} exited with code {p.exitcode} "
                                                   f"before reporting; all ranks stopped") from None
                else:
                    continue
            if msg[0] == "ok":
                done[msg[1]] = msg[2]
            else:
                errors.append(msg[1:])
        if errors:
            # the first failure is usually the cause, but give the others a moment: a bad-input
            # error is reported by every rank, and a rank that crashed outright (killed, os._exit)
            # shows up only as its exit code while the survivors report lost connections
            grace = time.monotonic() + 1.0
            while time.monotonic() < grace and len(errors) + len(done) < nproc:
                try:
                    msg = results.get(timeout=0.1)
                except queue_mod.Empty:
                    continue
                if msg[0] == "ok":
                    done[msg[1]] = msg[2]
                else:
                    errors.append(msg[1:])
            value_errors = sorted(e for e in errors if e[1])
            if value_errors:
                raise ValueError(value_errors[0][2])
            reported = set(done) | {e[0] for e in errors}
            crashed = [(r, p.exitcode) for r, p in enumerate(procs)
                       if r not in reported and p.exitcode not in (None, 0)]
            if crashed:
                rank, code = crashed[0]
                raise DistributedError(f"distributed: rank {rank} exited with code {code} before reporting "
                                       f"(then {errors[0][2]})")
            raise DistributedError(errors[0][2])
        return pickle.loads(done[0])
    finally:
        _stop(procs)


def threads_per_rank(device: str, nproc: int) -> int | None:
    """On CPU the ranks share this machine's cores: each gets its share (None on GPUs)."""
    if str(device).startswith("cuda"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nproc)


class _Session:
    """Picklable `fn(state)` for launch: one run_rank session with a job."""

    def __init__(self, config: EngineConfig, job, tp: int | None):
        self.config, self.job, self.tp = config, job, tp

    def __call__(self, state: DistState):
        return run_rank(self.config, self.job, self.tp, state)


def launch_distributed(config: EngineConfig, job: Callable[[LLMEngine], Any], nproc: int, tp: int | None = None,
                       timeout_s: float = LAUNCH_TIMEOUT_S) -> Any:
    """`job(engine)` on rank 0's LLMEngine, with `nproc` ranks serving the sharded model."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc: must be a positive integer, got {nproc!r}")
    cfg = ModelConfig.from_dir(config.model, dtype=config.dtype)  # bad input fails here, before spawning
    check_layout(cfg, nproc, default_tp(cfg, nproc) if tp is None else tp)
    if not isinstance(config.num_threads, int):  # "auto": each rank its fixed share (see RankGroup)
        config = dataclasses.replace(config, num_threads=threads_per_rank(config.device, nproc))
    return launch(_Session(config, job, tp), nproc, device=config.device, timeout_s=timeout_s,
                  num_threads=config.num_threads)


def generate_distributed(model_dir: str | Path, prompts: list,
                         params: SamplingParams | list[SamplingParams] | None = None, nproc: int = 2,
                         tp: int | None = None, dtype=None, device: str = "cpu",
                         timeout_s: float = LAUNCH_TIMEOUT_S, **engine_options) -> list[dict]:
    """Generates for `prompts` (token-id lists or strings) on `nproc` ranks; one dict per prompt
    (prompt_ids, token_ids, text), in order. engine_options go to EngineConfig (knobs,
    block_size, num_kv_blocks, kv_cache_memory, seed, num_threads, ...)."""
    config = EngineConfig(model=str(model_dir), dtype=dtype, device=device, **engine_options)
    return launch_distributed(config, GenerateJob(list(prompts), params), nproc, tp, timeout_s)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moectl.engine.parallel.distributed",
                                 description="Distributed generation: run under torchrun, or pass --nproc.")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--nproc", type=int, default=None, help="spawn this many ranks (without torchrun)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        prompts: list = [_parse_ids(p) for p in args.prompt_ids] + list(args.prompt)
        if not prompts:
            raise ValueError("prompt: give --prompt-ids or --prompt")
        params = SamplingParams(max_tokens=args.max_tokens)
        if "RANK" in os.environ and args.nproc is None:
            gc_heap.own_process()  # a torchrun rank runs its engine (or step loop) for its whole life
            state = init_distributed(args.device)
            config = EngineConfig(model=args.model, dtype=args.dtype, device=str(state.device))
            try:
                outs = run_rank(config, GenerateJob(prompts, params), args.tp, state)
            finally:
                dist.destroy_process_group()
            if state.rank != 0:
                return 0
        else:
            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            outs = generate_distributed(args.model, prompts, params, nproc=args.nproc or 1, tp=args.tp,
                                        dtype=args.dtype, device=device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(outs))
    else:
        for out in outs:
            print(" ".join(map(str, out["token_ids"])) + (f"\t{out['text']!r}" if out["text"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
