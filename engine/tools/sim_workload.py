"""A simulated cluster's workload: Poisson arrivals on the simulated clock, requests as lengths.

The live console's demo load (rate, prompt and output lengths, pause; steered while it runs,
as tools/demo_workload.py's) and `record`'s workload (with a request count or a duration, in
simulated seconds) are both this: a request is its prompt and output lengths, drawn from the
workload's LengthDists. When the cluster is idle the clock jumps to the next arrival, so an
idle stretch costs no wall time. rate=auto: the rate that keeps every attention group at the
knobs' max_num_seqs below saturation (see `auto_rate`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from moectl.engine.tools.demo_workload import DemoLoad
from moectl.engine.tools.workload import LengthDist
from moectl.wire.actions import ActionRefused

STEER_STEPS = 20  # steps between two adjustments of an auto rate
MAX_RATE = 1e6  # requests per simulated second: a 1,024-device cluster's short requests stay below it


def check_load(load: DemoLoad) -> tuple[LengthDist, LengthDist]:
    """ValueError naming the field; the load's length distributions."""
    rate = load.rate
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= MAX_RATE:
        raise ValueError(f"rate: must be a number of requests per simulated second in (0, {MAX_RATE:g}], got {rate!r}")
    return LengthDist.parse(load.prompt_len, "prompt_len"), LengthDist.parse(load.output_len, "output_len")


def mean_length(dist: LengthDist) -> float:
    return dist.lo if dist.kind == "fixed" else (dist.lo + dist.hi) / 2 if dist.kind == "uniform" else \
        min(dist.hi, max(dist.lo, dist.median * math.exp(dist.sigma ** 2 / 2)))


AUTO_LOAD = 0.8  # of the estimate below: the queue controller (`SimWorkload._steer_auto`) does the rest


def auto_rate(engine, prompt: LengthDist, output: LengthDist) -> float:
    """A first rate (requests per simulated second) for a steady cluster, by Little's law: the
    sequences the attention groups hold (the knobs' max_num_seqs, or what the KV pool holds at the
    requests' mean full length if fewer) over a request's life of mean_output steps. The step is
    the decode step of that batch at the mean context plus the prompts arriving meanwhile, in full
    chunks on as many groups as they fill (the all-to-all waits for the busiest group): a fixed
    point, found by a few damped iterations from the decode-only step."""
    from moectl.engine.sim.step_model import simulate, uniform_load

    knobs = engine.knobs
    mean_prompt, mean_output = mean_length(prompt), mean_length(output)
    fit = int(engine.blocks_per_group * engine.config.block_size / (mean_prompt + mean_output))
    seqs = max(1, min(knobs.max_num_seqs, fit))
    context = max(1, int(min(engine.max_model_len, mean_prompt + mean_output / 2)))
    spec = replace(engine.spec, tokens_per_device=seqs, context=context)
    chunk = min(knobs.long_prefill_token_threshold, knobs.max_num_batched_tokens)
    rate, step_s = None, 0.0
    for _ in range(6):
        load = uniform_load(spec)
        if rate is not None:  # the prompt tokens one step takes in, as full chunks
            prefill = rate * mean_prompt * step_s
            busy_groups = int(min(engine.groups, max(1, prefill / chunk)))
            load.pairs *= (load.tokens.sum() + busy_groups * chunk) / load.tokens.sum()
            load.tokens[:busy_groups] += chunk
            load.prefill[:busy_groups] += chunk
            load.prefill_keys[:, :busy_groups] += chunk * chunk / 2
            load.kv_reads[:, :busy_groups] += chunk
        step_s = simulate(spec, load)["step_ms"] / 1e3
        estimate = engine.groups * seqs / (step_s * mean_output)
        rate = estimate if rate is None else (rate + estimate) / 2
    return min(MAX_RATE, AUTO_LOAD * rate)


class SimWorkload:
    def __init__(self, load: DemoLoad, seed: int = 0, num_requests: int | None = None,
                 duration_s: float | None = None):
        """load.rate may be "auto": auto_rate's estimate at the first feed, then steered to keep the
        queue short (`_steer_auto`) until the operator sets a rate."""
        self.load = load
        self.auto = load.rate == "auto"
        self._steered_at = 0
        self.num_requests, self.duration_s = num_requests, duration_s
        self.rng = np.random.default_rng(seed)
        self.next_arrival: float | None = None
        self.added = self.rejected = 0
        if load.rate != "auto":
            check_load(load)

    @property
    def exhausted(self) -> bool:
        return (self.num_requests is not None and self.added + self.rejected >= self.num_requests) or \
            (self.duration_s is not None and self.next_arrival is not None and self.next_arrival > self.duration_s)

    def steer(self, driver, **changes):
        """The operator's "workload" action, checked now, in force from the engine's next turn."""
        try:
            check_load(replace(self.load if self.load.rate != "auto" else replace(self.load, rate=1.0), **changes))
        except (TypeError, ValueError) as exc:
            raise ActionRefused(f"workload: {exc}") from None
        # applied to the load in force then (an auto rate may have moved meanwhile)
        return driver.call(lambda: self.update(replace(self.load, **changes), "rate" in changes) or
                           {"workload": changes}, "workload")

    def update(self, load: DemoLoad, rate_given: bool = True) -> None:
        """rate_given: the operator set the rate, which then holds (no more auto steering)."""
        check_load(load)
        if rate_given:
            self.auto = False
        self.load = load
        self.next_arrival = None  # the new rate applies from now on

    def feed(self, engine) -> None:
        if self.load.rate == "auto":
            prompt, output = LengthDist.parse(self.load.prompt_len), LengthDist.parse(self.load.output_len)
            self.load = replace(self.load, rate=round(auto_rate(engine, prompt, output), 3))
        if self.load.paused or self.exhausted:
            return
        if self.auto:
            self._steer_auto(engine)
        prompt, output = check_load(self.load)
        now = engine.clock()
        if self.next_arrival is None:
            self.next_arrival = now + self.rng.exponential(1 / self.load.rate)
        if not engine.has_unfinished() and self.next_arrival > now:
            engine.advance_to(self.next_arrival)  # idle: nothing happens until the next arrival
            now = self.next_arrival
        while self.next_arrival <= now and not self.exhausted:
            try:
                engine.add_lengths(prompt.sample(self.rng, 1)[0], output.sample(self.rng, 1)[0],
                                   arrival=self.next_arrival)
            except ValueError:
                self.rejected += 1
            else:
                self.added += 1
            self.next_arrival += self.rng.exponential(1 / self.load.rate)

    __call__ = feed

    def _steer_auto(self, engine) -> None:
        """Every STEER_STEPS steps once requests finish: while requests queue (more than one per
        attention group), the rate the cluster served over those steps (requests finished per
        simulated second) less a tenth, at most halving; while nothing queues, the groups have
        room and the running count has stopped growing, a tenth faster. It settles just below what the cluster keeps up with."""
        if engine.step_count - self._steered_at < STEER_STEPS:
            return
        finished, now = engine.batcher.finished, engine.clock()
        waiting, running = len(engine.batcher.waiting), engine.batcher.running
        last = getattr(self, "_last", None)
        self._steered_at, self._last = engine.step_count, (finished, now, running)
        if last is None or now <= last[1]:
            return
        served = (finished - last[0]) / (now - last[1])
        if not served:
            return  # the first requests are still running: nothing to steer by yet
        if waiting > engine.groups:
            self.load = replace(self.load, rate=round(min(self.load.rate, max(served * 0.9, self.load.rate / 2)), 3))
        elif not waiting and running <= last[2] and running < 0.9 * engine.groups * engine.knobs.max_num_seqs:
            # room, and no longer filling up (a request lives hundreds of steps)
            self.load = replace(self.load, rate=round(min(MAX_RATE, self.load.rate * 1.1), 3))
