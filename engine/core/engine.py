"""The engine: add requests, step (commands -> schedule -> run -> postprocess), stream outputs.

Other threads may add requests, abort them, change knobs and submit commands at any time; each
call is validated at once and its work runs at the start of the next step (core/commands.py),
so the step loop owns all engine state. The expert layer (placement on devices, rebalancing)
plugs in as `experts`, built by moectl.engine.llm_engine.LLMEngine.

A step whose model run, sampler or postprocess raises fails only the requests it scheduled
(finish_reason "error", the cause in RequestOutput.error), frees their KV blocks and raises
StepFailed; the next step serves the other requests (see _fail_step for what a failed step leaves).
The engine reports itself failed (`failure`, why) when MAX_FAILED_STEPS steps fail in a row (a
broken model or device: every request would fail, one step at a time) or a step fails with
EngineLost (it cannot step again: a distributed rank is gone); its driver then stops serving.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from moectl.engine.core import gc_heap, native_memory
from moectl.engine.core.block_manager import BlockManager
from moectl.engine.core.commands import CommandQueue
from moectl.engine.core.config import EngineConfig, KnobError, SchedulerKnobs
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.model_runner import ModelRunner
from moectl.engine.core.outputs import EngineLost, RequestOutput, RequestStream, StepFailed, describe_error
from moectl.engine.core.retention import Retention
from moectl.engine.core.sampling import PenaltyHistory, SamplingParams, _GeneratorFactory, sample, token_logprobs
from moectl.engine.core.scheduler import ScheduledBatch, Scheduler
from moectl.engine.core.sequence import Sequence
from moectl.engine.core.telemetry import DeepCapture, Telemetry
from moectl.engine.core.threads import AdaptiveThreads
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.models.loader import load_model
from moectl.engine.models.numerics import ActivationWatch
from moectl.engine.models.tokenizer import Tokenizer
from moectl.wire.actions import Action
from moectl.wire.records import StepStats

MAX_FAILED_STEPS = 3  # failed steps in a row that mean the engine, not a request, is broken


class EngineCore:
    def __init__(self, config: EngineConfig, model: MoEForCausalLM | None = None, *, experts=None,
                 kv_heads: int | None = None, runner_factory=None, kv_pools: int | None = None):
        """experts(engine): builds the expert layer once the KV pools, runner and telemetry exist
        (it then serves as `engine.experts`); kv_heads: KV heads this process caches (tensor
        parallelism keeps a share); runner_factory(model, cache, device) builds the model runner
        (distributed ranks); kv_pools: KV pools (default one per device: the local backend's
        devices each cache their own sequences; ranks that shard attention share one)."""
        self.config = config
        native_memory.setup()  # glibc's heap, trimmed every few steps (see native_memory)
        self.threads = AdaptiveThreads(reserved=config.reserved_cores) if config.num_threads == "auto" else None
        if isinstance(config.num_threads, int):
            torch.set_num_threads(config.num_threads)
        self.model = model if model is not None else load_model(config.model, dtype=config.dtype, device=config.device)
        cfg: ModelConfig = self.model.cfg
        self.model_config = cfg
        self.tokenizer = Tokenizer.from_dir(config.model, cfg.bos_token_id)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        quantized = config.kv_cache_dtype == "int8"
        num_blocks, window_blocks = KVCache.pool_sizes_for(cfg, config.block_size, quantized, config.kv_cache_memory,
                                                           config.num_kv_blocks, config.knobs, kv_heads)
        self.kv_cache = KVCache.for_model(cfg, num_blocks, config.block_size, quantized, config.device, kv_heads,
                                          window_blocks)
        num_devices = config.topology.num_devices if config.topology is not None else 0
        # one KV pool per device: a sequence's blocks come from its home device's pool
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                   num_pools=kv_pools or max(1, num_devices),
                                   window=max(cfg.layer_windows), window_blocks=window_blocks)
        self.scheduler = Scheduler(self.blocks, config.knobs)
        self.commands = CommandQueue()
        device = torch.device(config.device)
        self.runner = (runner_factory or ModelRunner)(self.model, self.kv_cache, device)
        self.runner.knobs = config.knobs
        if config.mixed_precision:
            self.model.set_residual_dtype(torch.float32)
        self.watch = None
        if config.numerics_watch:
            self.watch = ActivationWatch(cfg.num_layers, [layer.attn.scale for layer in self.model.layers], device)
            self.model.set_watch(self.watch)
        self.retention = Retention(self.blocks)
        self.telemetry = Telemetry(num_devices, device.type == "cuda", config.profile_spans)
        self.model.tracer = self.telemetry.tracer
        self.experts = None
        if experts is not None:
            self.experts = self.runner.experts = experts(self)
        self.step_count = 0
        self.failed_steps_in_a_row = 0
        self.failure: str | None = None  # why this engine should not serve on (see _fail_step)
        self.step_log: deque[StepStats] = deque(maxlen=4096)
        self.num_aborted = 0
        self.actions: deque[dict] = deque(maxlen=4096)  # operator and automatic actions, with their time
        self._generators = _GeneratorFactory(torch.Generator().manual_seed(config.seed))
        self._lock = threading.Lock()  # guards the request ids, streams and pending knobs below
        self._ids = itertools.count()
        self._next_home = itertools.count()
        self._ids_in_use: set[str] = set()  # reserved at add, released at finish
        self._streams: dict[str, RequestStream] = {}
        self._pending_knobs = config.knobs  # the newest knobs asked for: later changes build on them
        self._seqs: dict[str, Sequence] = {}  # owned by the step loop
        self._outputs: list[RequestOutput] = []  # this step's outputs, handed back by step()
        gc_heap.engine_built()  # full collections stop walking the model and torch (see gc_heap)

    # -- requests (any thread)
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
        window = self._window_blocks_needed(blocks_needed, self._pending_knobs)
        if window > self._largest_window_pool():
            raise ValueError(f"prompt: needs {window} sliding-window KV blocks but the window pool has "
                             f"{self._largest_window_pool()}")
        if not isinstance(priority, int):
            raise ValueError("priority: must be an integer")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer.json; use stop_token_ids")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(request_id, ids, params, priority, arrival, self._generators.for_params(params))
        if self.blocks.num_pools > 1:  # the device whose attention serves it (DP-attention style),
            # round robin over the devices whose KV pool can hold it
            fits = [d for d, size in enumerate(self.blocks.pool_sizes) if size >= blocks_needed]
            seq.home_device = fits[next(self._next_home) % len(fits)]
        out = RequestStream(request_id) if stream else None
        with self._lock:
            if request_id in self._ids_in_use:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._ids_in_use.add(request_id)
            if out is not None:
                self._streams[request_id] = out
        self.commands.submit(lambda: self._admit(seq), "add")
        return out if out is not None else request_id

    def abort(self, request_id: str) -> None:
        self.commands.submit(lambda: self._abort(request_id), "abort")

    def update_knobs(self, **changes) -> SchedulerKnobs:
        """Validated against the newest knobs asked for (KnobError); in force from the next step."""
        with self._lock:
            new = self._pending_knobs.updated(**changes)
            if self.blocks.window is not None:
                need = self._window_blocks_needed(self.blocks.largest_pool, new)
                if need > self._largest_window_pool():
                    raise KnobError(f"max_num_batched_tokens: {new.max_num_batched_tokens} lets one sequence hold "
                                    f"{need} sliding-window KV blocks, more than the window pool's "
                                    f"{self._largest_window_pool()}")
            if self.experts is not None:  # the largest step the knobs allow must fit every device's HBM
                try:
                    self.experts.check_knobs(new)
                except ValueError as exc:
                    raise KnobError(str(exc)) from None
            self._pending_knobs = new
            self.commands.submit(lambda: self._set_knobs(new, changes), Action.KNOBS)
        return new

    @property
    def knobs(self) -> SchedulerKnobs:
        return self.scheduler.knobs

    def capture(self, steps: int) -> Future:
        """Deep capture: torch.profiler over the next `steps` steps; their records carry `kernels`."""
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1000:
            raise ValueError(f"capture: steps must be an integer in [1, 1000], got {steps!r}")
        return self.commands.submit(lambda: self._start_capture(steps), Action.CAPTURE)

    def submit(self, fn, kind: str = "call") -> Future:
        """Run fn() on the engine thread between steps; its result or exception in the Future."""
        return self.commands.submit(fn, kind)

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

    def record_action(self, kind: str, args: dict, result) -> None:
        """An operator's or the engine's own action, with its time, to the action listeners."""
        # str(): an Action is recorded as its plain name (records are plain data)
        action = {"time": time.monotonic(), "step": self.step_count, "kind": str(kind), "args": args, "result": result}
        self.actions.append(action)
        self.telemetry.publish_action(action)

    # -- the step loop (engine thread)
    def step(self) -> list[RequestOutput]:
        self.run_commands()
        if self.threads is not None:
            self.threads.maybe_update()
        t_start = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch.empty:
            self.step_count += 1
            if self.watch is not None:
                self.watch.reset()  # what a scoring pass or a failed step left is not this step's
            try:
                with self.telemetry.step(self, batch, t_start):
                    logits = self.runner.run(batch.items)
                    tokens = self._sample(batch, logits)
                    self._postprocess(batch, tokens)
            except Exception as exc:  # noqa: BLE001 - the step's requests fail, not the engine
                raise self._fail_step(batch, exc) from exc
            self.failed_steps_in_a_row = 0
            if self.experts is not None:
                self.experts.after_step(self.step_count)
            native_memory.after_step()  # a periodic malloc_trim: varied batch shapes fragment the C heap
        outputs, self._outputs = self._outputs, []
        return outputs

    def _fail_step(self, batch: ScheduledBatch, exc: Exception) -> StepFailed:
        """Ends the failed step's requests and frees their blocks; every other request, and the
        scheduler's queues, are as schedule() left them. What the step half did is dropped safely:
        K/V it wrote went to its requests' new blocks, freed now without a prefix-cache entry
        (blocks join the prefix cache only in _postprocess, once the forward and the sampler have
        finished, so what a half-done postprocess registered holds K/V really written); the
        runner's prompt scores are keyed by id() and discarded; spans, the routing probe and the
        expert layer's figures start afresh at the next step (telemetry.step records nothing for
        this one). `failure` is set before any request hears of it, so whoever reads a failed
        request's output already sees the engine's state. The caller raises the StepFailed returned."""
        self.runner.prompt_scores = {}
        self.failed_steps_in_a_row += 1
        error = f"step {self.step_count} failed: {describe_error(exc)}"
        if self.watch is not None:  # a failed step has no record: its error says where an inf/NaN began
            numerics = self.numerics_record()
            where = next(((layer, point) for layer, row in enumerate(numerics["nonfinite"])
                          for point, bad in zip(numerics["points"], row) if bad), None)
            if where is not None:
                error += (f" (the numerics watch saw the first inf/NaN at layer {where[0]}, {where[1]}, in "
                          f"{numerics['dtype']}; --mixed-precision keeps the residual stream in fp32)")
        if isinstance(exc, EngineLost):
            self.failure = error
        elif self.failed_steps_in_a_row >= MAX_FAILED_STEPS:
            self.failure = f"{self.failed_steps_in_a_row} steps failed in a row, the last: {error}"
        failed = [seq for seq, _ in batch.items if not seq.finished]
        for seq in failed:
            self.scheduler.finish(seq, "error")
            self._emit(seq, [], error)
        self.record_action("step_failed", {"requests": [s.request_id for s in failed]}, {"error": error})
        outputs, self._outputs = self._outputs, []
        return StepFailed(error, outputs, self.failed_steps_in_a_row, self.failure)

    def run_commands(self) -> None:
        self.commands.run(self._command_failed)

    def _command_failed(self, kind: str, exc: Exception) -> None:
        self.record_action(f"{kind}_failed", {}, {"error": f"{type(exc).__name__}: {exc}"})

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> dict[int, int]:
        """id(sequence) -> its new token, for the sequences whose pending tokens this step completes
        (a request with max_tokens 0 gets none: it only scores its prompt)."""
        completing = [s for s, n in batch.items if s.num_computed + n == s.num_tokens]
        tracer = self.telemetry.tracer
        mark = tracer.mark()
        self._score_prompts(batch)
        rows = [i for i, s in enumerate(completing) if s.params.max_tokens > 0]
        samplers = [completing[i] for i in rows]
        if len(rows) < len(completing):
            logits = logits[rows]
        histories = None
        if any(s.params.penalised for s in samplers):
            histories = [self._penalty_history(s) if s.params.penalised else None for s in samplers]
        tokens = sample(logits, [s.params for s in samplers], [s.generator for s in samplers], histories)
        wanted = [i for i, s in enumerate(samplers) if s.output_logprobs is not None]
        if wanted:
            scored = token_logprobs(logits[wanted], [tokens[i] for i in wanted],
                                    [samplers[i].params.logprobs for i in wanted])
            for i, lp in zip(wanted, scored):
                samplers[i].output_logprobs.append(lp)
        tracer.close(mark, "sampler")
        return dict(zip(map(id, samplers), tokens))

    def _penalty_history(self, seq: Sequence) -> PenaltyHistory:
        if seq.penalty_history is None:
            seq.penalty_history = PenaltyHistory(seq.token_ids[:seq.num_prompt_tokens], self.model_config.vocab_size)
        return seq.penalty_history.update(seq.output_ids)

    def _score_prompts(self, batch: ScheduledBatch) -> None:
        """Prompt log-probabilities the runner scored in this step's prefill."""
        found, self.runner.prompt_scores = self.runner.prompt_scores, {}
        for seq, _ in batch.items if found else ():
            entry = found.get(id(seq))
            if entry is not None:
                first, scored = entry
                seq.prompt_logprobs[first:first + len(scored)] = scored
                seq.prompt_scored = first + len(scored)

    def _postprocess(self, batch: ScheduledBatch, new_tokens: dict[int, int]) -> None:
        now = time.monotonic()
        for seq, n in batch.items:
            seq.num_computed += n
            self.blocks.commit_full_blocks(seq)
            self.retention.apply(seq, self.scheduler.knobs)
            token = new_tokens.get(id(seq))
            if token is None:
                if seq.params.max_tokens == 0 and seq.num_computed == seq.num_tokens:
                    self.scheduler.finish(seq, "length")  # scored its prompt; nothing to generate
                    self._emit(seq, [])
                continue  # otherwise a prefill chunk that does not reach the end of the prompt
            seq.token_ids.append(token)
            seq.token_times.append(now)
            if seq.num_output_tokens == 1:
                self.telemetry.request(seq.request_id, "first_token", now)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            self._emit(seq, [token])

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model_config.eos_token_ids):
            # the stop token ends the text without being part of it (vLLM's default,
            # include_stop_str_in_output false); it stays in the token ids and the counts
            seq.output_text = self.decode(seq.output_ids[:-1])
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

    def _emit(self, seq: Sequence, new: list[int], error: str | None = None) -> None:
        finished = seq.finished
        if finished:
            if seq.output_text is None:
                seq.output_text = self.decode(seq.output_ids)
            metrics = seq.metrics()
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
                            seq.metrics() if finished else {}, error=error)
        if seq.output_logprobs is not None:
            out.new_logprobs = seq.output_logprobs[len(seq.output_logprobs) - len(new):] if new else []
            if finished:
                out.logprobs = list(seq.output_logprobs)
        if seq.prompt_logprobs is not None and (finished or seq.num_output_tokens == len(new) == 1):
            out.prompt_logprobs = list(seq.prompt_logprobs)
        if stream is not None:
            stream.put(out)
        self._outputs.append(out)

    # -- commands (engine thread)
    def _admit(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        self.telemetry.request(seq.request_id, "arrived", seq.arrival, prompt_tokens=seq.num_prompt_tokens)

    def _abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
            self.num_aborted += 1
            self._emit(seq, [])

    def _set_knobs(self, knobs: SchedulerKnobs, changes: dict) -> None:
        self.scheduler.knobs = self.runner.knobs = knobs
        if self.experts is not None:
            self.experts.knobs = knobs
        self.record_action(Action.KNOBS, dict(changes), knobs.as_dict())

    def _start_capture(self, steps: int) -> None:
        self.telemetry.capture = DeepCapture(steps)
        self.record_action(Action.CAPTURE, {"steps": steps}, {})

    # -- conveniences
    def fail_all(self, reason: str = "error", error: str | None = None) -> list[RequestOutput]:
        """After step() raised: end every request (finish_reason `reason`, `error` saying why) and
        free its blocks, so no stream waits forever and the engine can serve again."""
        self.run_commands()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(seq, reason)
            self._emit(seq, [], error)
        outputs, self._outputs = self._outputs, []
        return outputs

    def has_unfinished(self) -> bool:
        return bool(len(self.commands)) or self.scheduler.has_work()

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
        except BaseException as exc:
            self.fail_all(error=str(exc) if isinstance(exc, StepFailed) else describe_error(exc))
            raise
        return [done[i] for i in ids]

    def _window_blocks_needed(self, blocks: int, knobs) -> int:
        """The sliding-window blocks a sequence of `blocks` main blocks can hold at once (0: none)."""
        window = self.blocks.window
        if window is None:
            return 0
        return min(blocks, KVCache.window_blocks_per_sequence(window.window, self.config.block_size,
                                                              knobs.max_num_batched_tokens))

    def _largest_window_pool(self) -> int:
        return self.blocks.window.store.largest_pool if self.blocks.window is not None else 0

    @functools.cached_property
    def kv_block_bytes(self) -> tuple[int, int]:
        """Bytes of one block of the main KV pool and of the sliding-window pool (0: none); fixed at start."""
        cache, blocks = self.kv_cache, self.blocks
        window = cache.window.nbytes() // blocks.window.store.num_blocks if cache.window is not None else 0
        return cache.nbytes(with_window=False) // blocks.num_blocks, window

    def kv_bytes_per_pool(self, used: bool) -> list[int]:
        """KV bytes per device pool, main and window pools together: in use, or the capacity."""
        main, window = self.kv_block_bytes
        blocks = self.blocks
        counts = blocks.used_per_pool() if used else blocks.pool_sizes
        out = [n * main for n in counts]
        if blocks.window is not None:
            store = blocks.window.store
            out = [b + n * window for b, n in zip(out, store.used_per_pool() if used else store.pool_sizes)]
        return out

    def numerics_record(self) -> dict | None:
        """The step's activation watch (the step record's `numerics`), None with the watch off."""
        if self.watch is None:
            return None
        model = self.model
        return self.watch.collect(model.embed.weight.dtype, model.residual_dtype or model.embed.weight.dtype)

    def retention_record(self) -> dict:
        """KV retention in force and what it keeps, per device pool (the step record's
        cache.kv_retention): tokens the running sequences hold and the tokens of their contexts
        (what full retention would hold), and the tokens evicted so far (cumulative)."""
        knobs, blocks = self.scheduler.knobs, self.blocks
        held, context = [0] * blocks.num_pools, [0] * blocks.num_pools
        for seq in self.scheduler.running:
            pool = blocks.pool_of(seq)
            held[pool] += seq.kv_held_tokens
            context[pool] += seq.num_computed
        return {"policy": knobs.kv_retention, "budget_tokens": knobs.kv_budget,
                "budget_fraction": knobs.kv_budget_fraction,
                "token_bytes": self.kv_block_bytes[0] // self.config.block_size,
                "held_tokens": held, "context_tokens": context, "evicted_tokens": list(blocks.evicted_tokens)}

    def score(self, token_ids: list[int], probe=None) -> torch.Tensor:
        """fp32 logits for every position of one sequence, run through the real paged path
        in prefill chunks (for log-likelihoods and layer-by-layer checks). The engine must be idle."""
        if self.has_unfinished():
            raise RuntimeError("score: the engine is serving requests")
        seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
        blocks, pool = -(-seq.num_tokens // self.config.block_size), self.blocks.pool_of(seq)
        window = self.blocks.window
        if blocks > self.blocks.free_in_pool(pool) or (
                window is not None and self._window_blocks_needed(blocks, self.knobs) > window.store.free_in_pool(pool)):
            raise ValueError(f"score: {seq.num_tokens} tokens do not fit in the KV cache")
        chunk = self.scheduler.knobs.max_num_batched_tokens
        parts = []
        try:  # no prefix-cache lookup: every position's logits are wanted
            while seq.num_computed < seq.num_tokens:
                n = min(chunk, seq.num_tokens - seq.num_computed)
                self.blocks.grow(seq, n)
                parts.append(self.runner.run([(seq, n)], all_logits=True, probe=probe))
                seq.num_computed += n
                self.blocks.release_window(seq)
                self.retention.apply(seq, self.scheduler.knobs)  # as a step would, between chunks
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
            "gpu": self.telemetry.gpu_sample(),  # the driver's newest NVML sample (None without a GPU)
        }
