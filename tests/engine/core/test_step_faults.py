"""A step that raises fails only the requests it scheduled: they end with finish_reason "error"
and the cause, their KV blocks are freed (what the step half wrote is never served from the
prefix cache), and the engine serves the next requests. Under the driver a broken model fails
requests one step at a time and, after MAX_FAILED_STEPS in a row, the engine reports itself
failed with the cause. On the distributed backend an error in rank 0's part of a forward leaves
the other ranks mid-collective: it ends the group, naming rank 0 and the error."""

from __future__ import annotations

import queue

import pytest

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.driver import EngineDriver
from moectl.engine.core.engine import MAX_FAILED_STEPS
from moectl.engine.core.outputs import StepFailed
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.parallel.group import RankGroup
from moectl.placement.topology import Topology
from tests.checkpoints import prompts, reference_greedy

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
CAUSE = "strides should be multiple of 16 bytes"


def make_engine(ckpt, **knobs) -> LLMEngine:
    knobs = SchedulerKnobs(**{"max_num_batched_tokens": 64, "long_prefill_token_threshold": 64, **knobs})
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=64, knobs=knobs, num_threads=1))


class FaultyRun:
    """The runner's run, raising RuntimeError(CAUSE) for a batch that holds a sequence with
    `prompt` (every time, or `times` times). With garbage=True the real forward runs first and
    the step's new blocks are then filled with NaN: the half-written K/V of a failed step."""

    def __init__(self, engine, prompt=None, times=None, garbage=False):
        self.engine, self.real = engine, engine.runner.run
        self.prompt, self.times, self.garbage = prompt, times, garbage
        self.raised = 0

    def __call__(self, items, *args, **kwargs):
        hit = self.prompt is None or any(s.token_ids[:s.num_prompt_tokens] == self.prompt for s, _ in items)
        if not hit or (self.times is not None and self.raised >= self.times):
            return self.real(items, *args, **kwargs)
        if self.garbage:
            self.real(items, *args, **kwargs)
            cache = self.engine.kv_cache
            for seq, _ in items:
                for block in seq.block_table[len(seq.block_hashes):]:  # not yet in the prefix cache
                    cache.k[:, block] = float("nan")
                    cache.v[:, block] = float("nan")
        self.raised += 1
        raise RuntimeError(CAUSE)


def last_output(stream):
    outs = list(stream)
    assert outs[-1].finished
    return outs[-1]


def test_a_failing_step_fails_only_its_requests_and_the_engine_serves_on(ckpt, ref_model, monkeypatch):
    engine = make_engine(ckpt, max_num_seqs=2)
    batch = prompts(4, seed=3, lo=6, hi=12)
    monkeypatch.setattr(engine.runner, "run", FaultyRun(engine, batch[0], times=1))
    streams = [engine.add_request(p, GREEDY, stream=True) for p in batch]
    with pytest.raises(StepFailed, match=f"step 1 failed: RuntimeError: {CAUSE}") as info:
        engine.step()  # the first two requests' step
    assert info.value.in_a_row == 1 and info.value.failure is None
    assert {o.request_id for o in info.value.outputs} == {streams[0].request_id, streams[1].request_id}
    assert engine.failed_steps_in_a_row == 1 and engine.blocks.num_used == 0
    assert engine.actions[-1]["kind"] == "step_failed" and CAUSE in engine.actions[-1]["result"]["error"]
    while engine.has_unfinished():
        engine.step()
    assert engine.failed_steps_in_a_row == 0
    for stream, prompt in zip(streams[:2], batch):
        out = last_output(stream)
        assert out.finish_reason == "error" and out.error == f"step 1 failed: RuntimeError: {CAUSE}"
    for stream, prompt in zip(streams[2:], batch[2:]):  # waiting during the failed step: untouched
        out = last_output(stream)
        assert out.finish_reason == "length" and out.error is None
        assert out.token_ids == reference_greedy(ref_model, prompt, GREEDY.max_tokens)
    assert engine.blocks.num_used == 0 and not engine.scheduler.running and not engine.scheduler.waiting
    engine.blocks.check_invariants()
    # the failed requests' ids are free again, and their prompts now run
    again = engine.generate(batch[:2], GREEDY)
    assert [o.token_ids for o in again] == [reference_greedy(ref_model, p, GREEDY.max_tokens) for p in batch[:2]]


def test_a_failed_steps_half_written_blocks_are_never_served_from_the_prefix_cache(ckpt, ref_model, monkeypatch):
    engine = make_engine(ckpt)
    head = prompts(1, seed=8, lo=12, hi=12)[0]  # three full blocks, cached once it has run
    engine.generate([head], GREEDY)
    longer = head + prompts(1, seed=9, lo=10, hi=10)[0]
    monkeypatch.setattr(engine.runner, "run", FaultyRun(engine, longer, times=1, garbage=True))
    stream = engine.add_request(longer, GREEDY, stream=True)
    with pytest.raises(StepFailed):
        engine.step()  # a prefix hit on `head`, the rest written (garbage), then the step fails
    assert last_output(stream).finish_reason == "error"
    assert engine.blocks.num_used == 0
    hits = engine.blocks.prefix_hits
    out = engine.generate([longer], GREEDY)[0]
    assert out.token_ids == reference_greedy(ref_model, longer, GREEDY.max_tokens)
    assert engine.blocks.prefix_hits - hits == 12  # head's blocks, written by a good step, still serve
    engine.blocks.check_invariants()


def test_generate_raises_the_step_failure_and_fails_the_rest_with_its_cause(ckpt, monkeypatch):
    engine = make_engine(ckpt, max_num_seqs=1)
    batch = prompts(2, seed=4)
    monkeypatch.setattr(engine.runner, "run", FaultyRun(engine, batch[0]))
    streams = []
    real_add = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *a, **k: streams.append(real_add(*a, stream=True, **k))
                        or streams[-1].request_id)
    with pytest.raises(StepFailed, match=CAUSE):
        engine.generate(batch, GREEDY)
    outs = [last_output(s) for s in streams]
    assert [o.finish_reason for o in outs] == ["error", "error"] and all(CAUSE in o.error for o in outs)
    assert engine.blocks.num_used == 0 and not engine.has_unfinished()


def _outputs(engine, prompt) -> queue.Queue:
    """The request's outputs, readable with a timeout (a test must not hang on a lost one)."""
    got: queue.Queue = queue.Queue()
    engine.add_request(prompt, GREEDY, stream=True).set_sink(got.put)
    return got


def _final(got: queue.Queue):
    while not (out := got.get(timeout=30)).finished:
        pass
    return out


def test_a_broken_model_fails_requests_one_step_at_a_time_then_the_engine_reports_it(ckpt):
    faults: list[FaultyRun] = []

    def make():
        engine = make_engine(ckpt)
        faults.append(FaultyRun(engine))  # every step raises
        engine.runner.run = faults[-1]
        return engine

    driver = EngineDriver(make)
    try:
        engine = driver.engine
        for n in range(1, MAX_FAILED_STEPS):
            out = _final(_outputs(engine, prompts(1, seed=n)[0]))
            assert out.finish_reason == "error" and CAUSE in out.error
            assert driver.error is None and faults[0].raised == n  # one step per request: no spinning
        # a good step in between starts the count again
        faults[0].prompt = [5, 6, 7]
        assert _final(_outputs(engine, prompts(1, seed=20)[0])).finish_reason == "length"
        faults[0].prompt = None
        for n in range(1, MAX_FAILED_STEPS + 1):
            assert driver.error is None
            out = _final(_outputs(engine, prompts(1, seed=30 + n)[0]))
            assert out.finish_reason == "error" and CAUSE in out.error
        assert driver.error == (f"{MAX_FAILED_STEPS} steps failed in a row, the last: step {engine.step_count} "
                                f"failed: RuntimeError: {CAUSE}")
        assert engine.blocks.num_used == 0
        late = _final(_outputs(engine, prompts(1, seed=50)[0]))  # added after: failed too, not left waiting
        assert late.finish_reason == "error" and late.error == driver.error
    finally:
        driver.close()


class FailingForward:
    def __init__(self, error: Exception):
        self.error = error

    def __call__(self, *args):
        raise self.error


def test_an_error_in_rank_0s_part_of_a_forward_ends_the_group_naming_it(ckpt):
    config = EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=64, topology=Topology(num_devices=2),
                          num_threads=1)
    ranks = RankGroup(config, 2)
    driver = EngineDriver(ranks.make_engine)
    try:
        engine = driver.engine
        assert _final(_outputs(engine, prompts(1)[0])).finish_reason == "length"
        # rank 1 has the step and waits in its collectives; rank 0's own forward raises
        engine.runner.model.model = FailingForward(ValueError(CAUSE))
        out = _final(_outputs(engine, prompts(1, seed=1)[0]))
        cause = f"distributed: rank 0 failed: ValueError: {CAUSE}"
        assert out.finish_reason == "error" and cause in out.error
        assert driver.error is not None and cause in driver.error  # the engine cannot step again
        ranks.procs[0].join(10)
        assert not ranks.procs[0].is_alive()  # stopped, not left waiting in a collective
    finally:
        driver.close()
        ranks.close()
