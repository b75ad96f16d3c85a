"""The engine: add requests, step (schedule -> run -> postprocess), stream outputs.

Other threads may add requests, abort them and change knobs at any time; those calls are
validated at once and applied at the start of the next step, so the step loop owns all state.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .block_manager import BlockManager
from .config import ModelConfig
from .engine_config import EngineConfig, KnobError, SchedulerKnobs
from .kv_cache import KVCache
from .loader import load_model
from .model import MoEForCausalLM
from .model_runner import ModelRunner
from .sampling import SamplingParams, _GeneratorFactory, sample
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence
from .telemetry import DeepCapture, Telemetry
from .tokenizer import Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    new_token_ids: list[int]  # tokens added by this step
    text: str
    finished: bool
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)


class RequestStream:
    """Thread-safe iterator over one request's outputs, ending with the finished one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._sink = None
        self._sink_lock = threading.Lock()

    def put(self, out: RequestOutput) -> None:
        with self._sink_lock:
            sink = self._sink
            if sink is None:
                self._queue.put(out)
                return
        sink(out)

    def set_sink(self, sink) -> None:
        """Send outputs to sink(out) instead of the iterator: first those already queued, in
        order, then each new one as the engine thread produces it (so sink must return at once;
        an event loop's bridge, for example)."""
        with self._sink_lock:
            while True:
                try:
                    sink(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._sink = sink

    def __iter__(self):
        while True:
            out = self._queue.get()
            yield out
            if out.finished:
                return


@dataclass
class StepStats:
    step: int
    t_start: float
    t_end: float
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    request_ids: list[str]
    preempted: list[str]
    kv_blocks_used: int
    routing: torch.Tensor  # [layers, experts] token counts this step
    devices: dict | None = None  # emulated devices: tokens, busy_s (measured), traffic, link_s (modeled)
    spans: dict | None = None
    kernels: dict | None = None  # deep capture only
    requests: list = field(default_factory=list)
    cache: dict = field(default_factory=dict)
    process: dict = field(default_factory=dict)
    knobs: dict = field(default_factory=dict)

    def as_record(self) -> dict:
        """The step record of profiler/records.py (the stream every consumer reads)."""
        wall = max(self.t_end - self.t_start, 1e-12)
        devices = self.devices
        if devices is not None:
            devices = {**devices, "util": [b / wall for b in devices["busy_s"]]}
        record = {
            "step": self.step, "t_start": self.t_start, "t_end": self.t_end,
            "batch": {"prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                      "num_seqs": self.num_seqs, "request_ids": self.request_ids, "preempted": self.preempted},
            "routing": self.routing.numpy().astype(np.int32), "knobs": self.knobs, "cache": self.cache,
            "process": self.process, "requests": self.requests, "spans": self.spans, "devices": devices,
        }
        if self.kernels is not None:
            record["kernels"] = self.kernels
        return record


class LLMEngine:
    def __init__(self, config: EngineConfig, model: MoEForCausalLM | None = None, *,
                 kv_heads: int | None = None, runner_factory=None):
        """kv_heads: KV heads this process caches (tensor parallelism keeps a share);
        runner_factory(model, cache, device, cluster) builds the model runner (distributed ranks)."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model = model if model is not None else load_model(config.model, dtype=config.dtype, device=config.device)
        cfg: ModelConfig = self.model.cfg
        self.model_config = cfg
        self.tokenizer = Tokenizer.from_dir(config.model, cfg.bos_token_id)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        quantized = config.kv_cache_dtype == "int8"
        kv_heads = kv_heads or cfg.num_kv_heads
        per_block = KVCache.bytes_per_block(cfg.num_layers, config.block_size, kv_heads, cfg.head_dim,
                                            cfg.dtype, quantized)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory // per_block)
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size, kv_heads, cfg.head_dim,
                                cfg.dtype, quantized, config.device)
        # emulated devices: one KV pool per device, each sized and enforced by the memory ledger
        pools = config.topology.num_devices if config.topology is not None else 1
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, num_pools=pools)
        self.scheduler = Scheduler(self.blocks, config.knobs)
        self.cluster = None
        if config.topology is not None:
            from .devices import LocalCluster
            from .memory_ledger import MemoryLedger

            ledger = MemoryLedger(self.model, config.topology, kv_pool_blocks=self.blocks.pool_sizes,
                                  kv_bytes_per_block=self.kv_cache.nbytes() // num_blocks,
                                  block_size=config.block_size, max_model_len=self.max_model_len)
            self.cluster = LocalCluster(self.model, config.topology, policy=config.routing_policy,
                                        redundant_slots=config.redundant_slots, auto=config.auto_rebalance,
                                        expert_cache_slots=config.expert_cache_slots, ledger=ledger,
                                        knobs=config.knobs, torch_devices=config.expert_devices)
        self.runner = (runner_factory or ModelRunner)(self.model, self.kv_cache, torch.device(config.device),
                                                      self.cluster)
        if self.cluster is not None and self.cluster.caches is not None and config.expert_prefetch != "none":
            from .prefetch import CachePrefetcher, CoactivationPredictor, RouterPredictor

            predictor = (RouterPredictor if config.expert_prefetch == "router" else CoactivationPredictor)(self.model)
            # the routing probe that also prefetches each device's next-layer experts
            self.runner.probe = CachePrefetcher(self.model, self.cluster.caches, predictor)
        self._next_home = itertools.count()
        self._generators = _GeneratorFactory(torch.Generator().manual_seed(config.seed))
        self._lock = threading.Lock()
        self._inbox: list = []  # (kind, payload) from other threads, applied at the next step
        self._seqs: dict[str, Sequence] = {}  # owned by the step loop
        self._streams: dict[str, RequestStream] = {}  # guarded by _lock
        self._ids_in_use: set[str] = set()  # guarded by _lock: reserved at add, released at finish
        self.last_bytes_moved = 0
        self._ids = itertools.count()
        self.step_count = 0
        self.step_log: deque[StepStats] = deque(maxlen=4096)
        self.finished_metrics: deque[dict] = deque(maxlen=4096)
        self.num_aborted = 0
        self.actions: deque[dict] = deque(maxlen=4096)  # operator and automatic actions, with their time
        num_devices = self.cluster.num_devices if self.cluster is not None else 0
        self.telemetry = Telemetry(num_devices, torch.device(config.device).type == "cuda", config.profile_spans)
        self.model.tracer = self.telemetry.tracer
        if self.cluster is not None:
            self.cluster.stats.tracer = self.telemetry.tracer

    # -- requests
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this checkpoint has no tokenizer.json; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, arrival: float | None = None,
                    stream: bool = False) -> RequestStream | str:
        """Validates now (ValueError), enqueues for the next step. Returns a stream or the id."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt: is empty")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens plus max_tokens {params.max_tokens} exceed the "
                             f"context of {self.max_model_len} tokens")
        blocks_needed = -(-(len(ids) + params.max_tokens) // self.config.block_size)
        if blocks_needed > self.blocks.largest_pool:
            where = "a device's KV pool" if self.blocks.num_pools > 1 else "the cache"
            raise ValueError(f"prompt: needs {blocks_needed} KV blocks but {where} has {self.blocks.largest_pool}")
        if not isinstance(priority, int):
            raise ValueError("priority: must be an integer")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer.json; use stop_token_ids")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(request_id, ids, params, priority, arrival, self._generators.for_params(params))
        if self.cluster is not None:  # the device whose attention would serve it (DP-attention style),
            # round robin over the devices whose KV pool can hold it
            fits = [d for d, size in enumerate(self.blocks.pool_sizes) if size >= blocks_needed]
            seq.home_device = fits[next(self._next_home) % len(fits)]
        out = RequestStream(request_id) if stream else None
        with self._lock:
            if request_id in self._ids_in_use:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._ids_in_use.add(request_id)
            self._inbox.append(("add", seq))
            if out is not None:
                self._streams[request_id] = out
        return out if out is not None else request_id

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def _require_cluster(self):
        if self.cluster is None:
            raise ValueError("placement: this engine runs without emulated devices (no topology)")
        return self.cluster

    def apply_placement(self, placement, kind: str = "placement") -> None:
        """Checked now (PlacementError); the experts are copied between steps, so in-flight
        requests see either the old or the new placement for a whole step, never a mix."""
        self._require_cluster().check(placement)
        with self._lock:
            self._inbox.append(("placement", (placement, kind)))

    EXPERT_EDITS = ("move", "swap", "replicate", "drop_replica", "pin", "unpin")

    def edit_experts(self, edit: str, **args):
        """An operator's edit of one expert (Placement.move/swap/replicate/drop_replica/pin/unpin
        with their arguments), validated against the newest placement and applied between steps."""
        cluster = self._require_cluster()
        if edit not in self.EXPERT_EDITS:
            raise ValueError(f"edit: must be one of {', '.join(self.EXPERT_EDITS)}, got {edit!r}")
        with self._lock:  # held across read-modify-append so concurrent edits are not lost
            pending = [p for kind, (p, _) in ((k, v) for k, v in self._inbox if k == "placement")]
            current = pending[-1] if pending else cluster.placement
            try:
                new = getattr(current, edit)(**args)
            except TypeError as exc:
                raise ValueError(f"{edit}: {exc}") from None
            cluster.check(new)
            self._inbox.append(("placement", (new, edit)))
        return new

    def rebalance_preview(self):
        """A plan for the recent routing window: predicted balancedness before/after, bytes to move."""
        plan = self._require_cluster().preview()
        self._action("rebalance_preview", {}, plan.summary())
        return plan

    def _action(self, kind: str, args: dict, result) -> None:
        action = {"time": time.monotonic(), "step": self.step_count, "kind": kind, "args": args, "result": result}
        self.actions.append(action)
        self.telemetry.publish_action(action)

    def capture(self, steps: int) -> None:
        """Deep capture: torch.profiler over the next `steps` steps; their records carry `kernels`."""
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1000:
            raise ValueError(f"capture: steps must be an integer in [1, 1000], got {steps!r}")
        with self._lock:
            self._inbox.append(("capture", steps))

    def add_listener(self, on_step=None, on_action=None) -> None:
        """on_step(StepStats) after every step, on_action(dict) after every action, both on the
        engine thread: they must return at once (hand the record to a queue or a slot)."""
        if on_step is not None:
            self.telemetry.step_listeners.append(on_step)
        if on_action is not None:
            self.telemetry.action_listeners.append(on_action)

    def remove_listener(self, on_step=None, on_action=None) -> None:
        for listeners, fn in ((self.telemetry.step_listeners, on_step), (self.telemetry.action_listeners, on_action)):
            if fn in listeners:
                listeners.remove(fn)

    def update_knobs(self, **changes) -> SchedulerKnobs:
        """Validated against the newest pending knobs; takes effect at the next step."""
        with self._lock:
            pending = [p for k, (p, _) in ((k, v) for k, v in self._inbox if k == "knobs")]
            new = (pending[-1] if pending else self.scheduler.knobs).updated(**changes)
            if self.cluster is not None:  # the largest step the knobs allow must fit every device's HBM
                try:
                    self.cluster.check_knobs(new)
                except ValueError as exc:
                    raise KnobError(str(exc)) from None
            self._inbox.append(("knobs", (new, changes)))
        return new

    @property
    def knobs(self) -> SchedulerKnobs:
        return self.scheduler.knobs

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        outputs = []
        for kind, payload in inbox:
            try:
                self._apply_inbox_item(kind, payload, outputs)
            except Exception as exc:  # noqa: BLE001 - one bad item must not lose the others
                self._action(f"{kind}_failed", {}, {"error": f"{type(exc).__name__}: {exc}"})
        return outputs

    def _apply_inbox_item(self, kind: str, payload, outputs: list) -> None:
        if kind == "add":
            self._seqs[payload.request_id] = payload
            self.scheduler.add(payload)
            self.telemetry.request(payload.request_id, "arrived", payload.arrival,
                                   prompt_tokens=payload.num_prompt_tokens)
        elif kind == "capture":
            self.telemetry.capture = DeepCapture(payload)
            self._action("capture", {"steps": payload}, {})
        elif kind == "abort":
            seq = self._seqs.get(payload)
            if seq is not None and not seq.finished:
                self.scheduler.finish(seq, "abort")
                self.num_aborted += 1
                outputs.append(self._emit(seq, []))
        elif kind == "placement":
            placement, what = payload
            t0 = time.perf_counter()
            self.last_bytes_moved = self.cluster.apply(placement)
            seconds = time.perf_counter() - t0
            if hasattr(self.runner.probe, "caches"):  # the caches were rebuilt for the new placement
                self.runner.probe.caches = list(self.cluster.caches)
            self._action(what, {}, {"bytes_moved": self.last_bytes_moved, "seconds": seconds,
                                    "placement": placement.to_dict()})
        else:
            knobs, changes = payload
            self.scheduler.knobs = knobs
            if self.cluster is not None:
                self.cluster.knobs = knobs
            self._action("knobs", dict(changes), knobs.as_dict())

    # -- the step loop
    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        t_start = time.monotonic()
        batch = self.scheduler.schedule()
        if batch.empty:
            return outputs
        self.telemetry.begin_step(t_start)
        tracer = self.telemetry.tracer
        self.runner.probe.reset()
        logits = self.runner.run(batch.items)
        samplers = [s for s, n in batch.items if s.num_computed + n == s.num_tokens]
        # a decode runs a generated token; a 1-token prompt remainder (after a prefix hit) is prefill
        decodes = sum(1 for s, n in batch.items if n == 1 and s.num_computed >= s.num_prompt_tokens)
        # each sequence's context this step, read before postprocess can finish (and reset) it
        contexts = [seq.num_computed + n for seq, n in batch.items]
        mark = tracer.mark() if tracer is not None else None
        tokens = sample(logits, [s.params for s in samplers], [s.generator for s in samplers])
        if tracer is not None:
            tracer.close(mark, "sampler")
        outputs += self._postprocess(batch, dict(zip(map(id, samplers), tokens)))
        self._record_step(batch, t_start, decodes, contexts)
        return outputs

    def _postprocess(self, batch: ScheduledBatch, new_tokens: dict[int, int]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for seq, n in batch.items:
            seq.num_computed += n
            self.blocks.commit_full_blocks(seq)
            token = new_tokens.get(id(seq))
            if token is None:
                continue  # a prefill chunk that does not reach the end of the prompt
            seq.token_ids.append(token)
            seq.token_times.append(now)
            if seq.num_output_tokens == 1:
                self.telemetry.request(seq.request_id, "first_token", now)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(self._emit(seq, [token]))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model_config.eos_token_ids):
            return "stop"
        if p.stop and self.tokenizer is not None:
            # a stop string of L characters ends within the last L tokens (+ a few for split UTF-8):
            # look there each step, and decode the whole output only once one is seen
            tail = self.decode(seq.output_ids[-(max(map(len, p.stop)) + 4):])
            if not any(s in tail for s in p.stop):
                return "length" if self._at_length(seq) else None
            text = self.decode(seq.output_ids)
            cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.output_text = text[:cut]  # may be "" when the output starts with the stop string
                return "stop"
        return "length" if self._at_length(seq) else None

    def _at_length(self, seq: Sequence) -> bool:
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    def _emit(self, seq: Sequence, new: list[int]) -> RequestOutput:
        finished = seq.finished
        if finished:
            if seq.output_text is None:
                seq.output_text = self.decode(seq.output_ids)
            metrics = seq.metrics()
            self.finished_metrics.append({"request_id": seq.request_id, "finish_reason": seq.finish_reason,
                                          **metrics})
            self.telemetry.request(seq.request_id, "finished", seq.finished_at, reason=seq.finish_reason,
                                   prompt_tokens=metrics["prompt_tokens"], output_tokens=metrics["output_tokens"],
                                   ttft_s=metrics["ttft"], tpot_s=metrics["tpot"])
            del self._seqs[seq.request_id]
        with self._lock:
            if finished:  # the stream goes first, then the id may be reused
                stream = self._streams.pop(seq.request_id, None)
                self._ids_in_use.discard(seq.request_id)
            else:
                stream = self._streams.get(seq.request_id)
        out = RequestOutput(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], seq.output_ids, new,
                            (seq.output_text or "") if finished else "", finished, seq.finish_reason,
                            seq.metrics() if finished else {})
        if stream is not None:
            stream.put(out)
        return out

    def _device_record(self, batch: ScheduledBatch, contexts: list[int]) -> dict:
        cluster = self.cluster
        record = cluster.end_step()
        work = [{"tokens": 0, "seqs": 0, "context": 0, "recv_rows": int(rows)} for rows in cluster.stats.peak_rows]
        for (seq, n), context in zip(batch.items, contexts):
            w = work[seq.home_device]
            w["tokens"] += n
            w["seqs"] += 1
            w["context"] = max(w["context"], context)
        record.update(cluster.memory(work, self.blocks.used_per_pool()))
        return record

    def _record_step(self, batch: ScheduledBatch, t_start: float, decode: int, contexts: list[int]) -> None:
        self.step_count += 1
        tel = self.telemetry
        for seq in batch.preempted:
            tel.request(seq.request_id, "preempted")
        for seq, _ in batch.items:
            if seq.first_scheduled is not None and seq.first_scheduled >= t_start and seq.num_preemptions == 0:
                tel.request(seq.request_id, "scheduled", seq.first_scheduled)
        devices = self._device_record(batch, contexts) if self.cluster is not None else None
        spans, kernels = tel.end_step(t_start)
        b = self.blocks
        self.step_log.append(StepStats(
            step=self.step_count, t_start=t_start, t_end=time.monotonic(),
            prefill_tokens=batch.num_tokens - decode, decode_tokens=decode, num_seqs=len(batch.items),
            request_ids=[s.request_id for s, _ in batch.items], preempted=[s.request_id for s in batch.preempted],
            kv_blocks_used=b.num_used, routing=self.runner.probe.counts.clone(), devices=devices,
            spans=spans, kernels=kernels, requests=tel.take_request_events(),
            cache={"kv_blocks_used": b.num_used, "kv_blocks_total": b.num_blocks, "prefix_queries": b.prefix_queries,
                   "prefix_hits": b.prefix_hits, "preemptions": self.scheduler.num_preemptions},
            process=tel.process_memory(), knobs=self.scheduler.knobs.as_dict()))
        tel.publish_step(self.step_log[-1])
        if self.cluster is not None:
            try:
                plan = self.cluster.observe(self.step_count, self.step_log[-1].routing)
                if plan is not None:  # auto mode: applied at the start of the next step
                    self._action("auto_rebalance_plan", {}, plan.summary())
                    self.apply_placement(plan.placement, kind="rebalance_apply")
            except ValueError as exc:  # never lose a finished step's outputs to a failed plan
                self._action("auto_rebalance_failed", {}, {"error": str(exc)})

    # -- conveniences
    def fail_all(self, reason: str = "error") -> list[RequestOutput]:
        """After step() raised: end every request (finish_reason `reason`) and free its blocks, so
        no stream waits forever and the engine can serve again."""
        outputs = self._drain_inbox()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(seq, reason)
            outputs.append(self._emit(seq, []))
        return outputs

    def has_unfinished(self) -> bool:
        with self._lock:
            pending = bool(self._inbox)
        return pending or self.scheduler.has_work()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Blocking: runs the step loop until every prompt has finished; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("params: one SamplingParams per prompt, or a single one for all")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                for out in self.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            self.fail_all()
            raise
        return [done[i] for i in ids]

    def score(self, token_ids: list[int], probe=None) -> torch.Tensor:
        """fp32 logits for every position of one sequence, run through the real paged path
        in prefill chunks (for log-likelihoods and layer-by-layer checks). The engine must be idle."""
        if self.has_unfinished():
            raise RuntimeError("score: the engine is serving requests")
        seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
        if -(-seq.num_tokens // self.config.block_size) > self.blocks.free_in_pool(self.blocks.pool_of(seq)):
            raise ValueError(f"score: {seq.num_tokens} tokens do not fit in the KV cache")
        chunk = self.scheduler.knobs.max_num_batched_tokens
        parts = []
        try:  # no prefix-cache lookup: every position's logits are wanted
            while seq.num_computed < seq.num_tokens:
                n = min(chunk, seq.num_tokens - seq.num_computed)
                self.blocks.grow(seq, n)
                parts.append(self.runner.run([(seq, n)], all_logits=True, probe=probe))
                seq.num_computed += n
        finally:
            self.blocks.free(seq)
        return torch.cat(parts)

    def stats(self) -> dict:
        b = self.blocks
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": b.num_blocks, "kv_blocks_used": b.num_used, "kv_usage": b.usage(),
            "prefix_queries": b.prefix_queries, "prefix_hits": b.prefix_hits,
            "prefix_hit_rate": (b.prefix_hits / b.prefix_queries) if b.prefix_queries else 0.0,
            "preemptions": self.scheduler.num_preemptions, "aborted": self.num_aborted,
            "steps": self.step_count,
        }


__all__ = ["LLMEngine", "EngineConfig", "SchedulerKnobs", "SamplingParams", "RequestOutput", "KnobError"]
