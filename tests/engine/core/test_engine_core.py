"""The serving core: paged cache, prefix reuse, chunked prefill, preemption, knobs, streams."""

from __future__ import annotations

import threading

import pytest
import torch

from moectl.engine.core.config import EngineConfig, KnobError, SchedulerKnobs
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from tests.checkpoints import prompts, reference_greedy, tiny_checkpoint


def make_engine(ckpt, **kw) -> LLMEngine:
    knobs = kw.pop("knobs", SchedulerKnobs(max_num_batched_tokens=24, long_prefill_token_threshold=10))
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=kw.pop("num_kv_blocks", 128),
                                  knobs=knobs, **kw))


GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def test_chunked_continuous_batching_matches_uncached_reference(ckpt, ref_model):
    engine = make_engine(ckpt)
    batch = prompts(6)
    outs = engine.generate(batch, GREEDY)
    for p, out in zip(batch, outs):
        assert out.token_ids == reference_greedy(ref_model, p, 10)
        assert out.finish_reason == "length"
    assert any(s.prefill_tokens and s.decode_tokens for s in engine.step_log), "prefill and decode never mixed"
    assert engine.blocks.num_used == 0
    engine.blocks.check_invariants()


def test_prefix_cache_reuses_blocks_and_keeps_outputs(ckpt, ref_model):
    engine = make_engine(ckpt)
    shared = prompts(1, seed=5, lo=30, hi=30)[0]
    first = engine.generate([shared + [7, 8, 9]], GREEDY)[0]
    second_prompt = shared + [11, 12]
    second = engine.generate([second_prompt], GREEDY)[0]
    assert second.metrics["cached_prompt_tokens"] == 28  # 7 full blocks of 4 from the shared 30 tokens
    assert second.token_ids == reference_greedy(ref_model, second_prompt, 10)
    assert first.metrics["cached_prompt_tokens"] == 0
    stats = engine.stats()
    assert stats["prefix_hits"] == 28 and stats["prefix_queries"] == 33 + 32
    off = make_engine(ckpt, enable_prefix_caching=False)
    off.generate([shared + [7, 8, 9]], GREEDY)
    assert off.generate([second_prompt], GREEDY)[0].token_ids == second.token_ids


def test_preemption_recomputes_and_never_leaks(ckpt, ref_model):
    # 14 blocks of 4 tokens cannot hold four 40-token sequences at once
    engine = make_engine(ckpt, num_kv_blocks=14)
    batch = prompts(4, seed=2, lo=20, hi=30)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = engine.generate(batch, params)
    assert engine.stats()["preemptions"] > 0
    for p, out in zip(batch, outs):
        assert out.token_ids == reference_greedy(ref_model, p, 16)
    assert engine.blocks.num_used == 0
    engine.blocks.check_invariants()


def test_abort_frees_blocks(ckpt):
    engine = make_engine(ckpt)
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in prompts(3)]
    for _ in range(4):
        engine.step()
    assert engine.blocks.num_used > 0
    engine.abort(ids[1])
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == ids[1]]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    for i in (0, 2):
        engine.abort(ids[i])
    engine.step()
    assert engine.blocks.num_used == 0 and not engine.has_unfinished()


def test_knobs_change_from_another_thread_on_next_step(ckpt):
    engine = make_engine(ckpt)
    for p in prompts(4):
        engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.step_log[-1].num_seqs == 4
    t = threading.Thread(target=engine.update_knobs, kwargs={"max_num_seqs": 1})
    t.start()
    t.join()
    assert engine.knobs.max_num_seqs == 64  # validated and queued, not yet applied
    engine.step()
    assert engine.knobs.max_num_seqs == 1 and engine.step_log[-1].num_seqs == 1


@pytest.mark.parametrize("change", [{"max_num_seqs": 0}, {"max_num_batched_tokens": -5}, {"policy": "random"},
                                    {"long_prefill_token_threshold": 1.5}, {"no_such_knob": 3}])
def test_invalid_knob_is_refused_and_engine_unchanged(ckpt, change):
    engine = make_engine(ckpt)
    before = engine.knobs
    with pytest.raises(KnobError) as err:
        engine.update_knobs(**change)
    assert next(iter(change)) in str(err.value) and "\n" not in str(err.value)
    engine.step()
    assert engine.knobs == before


def test_stream_yields_tokens_incrementally(ckpt):
    engine = make_engine(ckpt)
    stream = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=8, ignore_eos=True), stream=True)
    while engine.has_unfinished():
        engine.step()
    chunks = list(stream)
    assert len(chunks) == 8 and chunks[-1].finished
    assert [t for c in chunks for t in c.new_token_ids] == chunks[-1].token_ids


def test_same_seed_same_tokens_whatever_the_batch(ckpt):
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    target = prompts(1, seed=9)[0]
    alone = make_engine(ckpt).generate([target], sampled)[0].token_ids
    crowd = make_engine(ckpt).generate(prompts(3, seed=1) + [target], [SamplingParams(max_tokens=5)] * 3 + [sampled])
    assert crowd[-1].token_ids == alone
    other = SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    assert make_engine(ckpt).generate([target], other)[0].token_ids != alone


def test_stop_token_ids_and_stop_strings(ckpt, ref_model):
    engine = make_engine(ckpt)
    p = prompts(1, seed=3)[0]
    full = reference_greedy(ref_model, p, 10)
    out = engine.generate([p], SamplingParams(max_tokens=10, stop_token_ids=(full[3],), ignore_eos=True))[0]
    assert out.token_ids == full[:full.index(full[3]) + 1] and out.finish_reason == "stop"
    # the stop token is counted but is not part of the text (vLLM's include_stop_str_in_output false)
    assert out.text == engine.decode(out.token_ids[:-1])
    # a random model emits partial UTF-8 too; stop on the first plain character it writes
    stop = next(c for c in engine.decode(full) if c.isascii() and c.isprintable() and not c.isspace())
    out = engine.generate([p], SamplingParams(max_tokens=10, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert out.token_ids == full[:len(out.token_ids)] and stop in engine.decode(out.token_ids)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"stop": ("",)}, "stop"), ({"seed": -1}, "seed"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_with_nothing_queued(ckpt):
    engine = make_engine(ckpt)
    with pytest.raises(ValueError, match="exceed the context"):
        engine.add_request([5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([5, 300], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    small = make_engine(ckpt, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.add_request([5] * 20, GREEDY)
    assert not engine.has_unfinished() and not small.has_unfinished()


def test_priority_policy_runs_urgent_requests_first(ckpt):
    engine = make_engine(ckpt, knobs=SchedulerKnobs(max_num_seqs=1, policy="priority"))
    late = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=3, ignore_eos=True), priority=5)
    urgent = engine.add_request(prompts(1, seed=1)[0], SamplingParams(max_tokens=3, ignore_eos=True), priority=0)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == [urgent, late]


def test_int8_kv_cache_saves_memory_and_stays_close(ckpt, ref_model):
    cfg = ref_model.cfg
    fp = KVCache.bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, False)
    q8 = KVCache.bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, True)
    assert q8 / fp < 0.3
    batch = prompts(4, seed=4, lo=20, hi=40)
    exact = make_engine(ckpt)
    quant = make_engine(ckpt, kv_cache_dtype="int8")
    for p in batch:
        for eng in (exact, quant):
            eng.add_request(p, SamplingParams(max_tokens=1))
        la = _last_logits(exact)
        lb = _last_logits(quant)
        assert ((la - lb).abs().max() / la.abs().max()).item() < 0.05


def _last_logits(engine: LLMEngine) -> torch.Tensor:
    engine.run_commands()
    batch = engine.scheduler.schedule()
    while batch.items[0][0].remaining > batch.items[0][1]:  # run prefill chunks up to the last one
        engine.runner.run(batch.items)
        engine._postprocess(batch, {})
        batch = engine.scheduler.schedule()
    logits = engine.runner.run(batch.items)
    engine._postprocess(batch, {id(batch.items[0][0]): 1})
    return logits[0]


def test_request_metrics_are_recorded(ckpt):
    engine = make_engine(ckpt)
    out = engine.generate(prompts(1), GREEDY)[0]
    m = out.metrics
    assert m["ttft"] > 0 and m["tpot"] > 0 and m["e2e"] >= m["ttft"] and len(m["itl"]) == 9
    assert m["queue_time"] >= 0 and m["output_tokens"] == 10


def test_score_matches_uncached_forward_across_chunks(ckpt, ref_model):
    from moectl.engine.models.attention import DenseContext

    engine = make_engine(ckpt)
    ids = prompts(1, seed=7, lo=60, hi=60)[0]
    got = engine.score(ids)
    with torch.inference_mode():
        want = ref_model.logits(ref_model(torch.tensor(ids), torch.arange(60), DenseContext(1, 60)))
    assert got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert engine.blocks.num_used == 0


def test_stop_string_at_the_very_start_leaves_empty_text(ckpt, ref_model):
    engine = make_engine(ckpt)
    p = prompts(1, seed=3)[0]
    first = engine.decode(reference_greedy(ref_model, p, 1))
    assert first
    out = engine.generate([p], SamplingParams(max_tokens=10, stop=(first[0],), ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == ""


def test_request_ids_are_unique_while_in_flight_and_reusable_after(ckpt):
    engine = make_engine(ckpt)
    engine.add_request([5, 6, 7], GREEDY, request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], GREEDY, request_id="a")
    while engine.has_unfinished():
        engine.step()
    engine.add_request([5, 6], GREEDY, request_id="a")  # finished ids may be reused


def test_stop_strings_without_a_tokenizer_are_refused(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "notok", tokenizer=False)
    engine = make_engine(ckpt)
    with pytest.raises(ValueError, match="stop"):
        engine.add_request([5, 6], SamplingParams(stop=("x",)))


def test_decodes_are_scheduled_before_prefill_chunks(ckpt):
    engine = make_engine(ckpt, knobs=SchedulerKnobs(max_num_batched_tokens=8, long_prefill_token_threshold=8))
    engine.add_request(prompts(1, lo=4, hi=4)[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # its prompt fits one step: it decodes from now on
    engine.add_request(prompts(1, seed=1, lo=40, hi=40)[0], GREEDY)
    for _ in range(3):
        engine.step()
        assert engine.step_log[-1].decode_tokens == 1  # the long prompt never took the whole budget


def test_a_failing_step_ends_every_stream_and_frees_blocks(ckpt, monkeypatch):
    engine = make_engine(ckpt)
    streams = [engine.add_request(p, GREEDY, stream=True) for p in prompts(3)]
    engine.step()
    monkeypatch.setattr(engine.runner, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    engine.fail_all()
    for stream in streams:
        last = list(stream)[-1]
        assert last.finished and last.finish_reason == "error"
    assert engine.blocks.num_used == 0 and not engine.has_unfinished()
    monkeypatch.undo()
    assert len(engine.generate(prompts(1), GREEDY)[0].token_ids) == 10  # serves again


def test_a_one_token_prompt_remainder_counts_as_prefill(ckpt):
    engine = make_engine(ckpt)
    shared = prompts(1, seed=5, lo=28, hi=28)[0]
    engine.generate([shared + [7, 8]], GREEDY)
    engine.add_request(shared + [9], GREEDY)  # 28 tokens from the prefix cache, 1 left to run
    engine.step()
    step = engine.step_log[-1]
    assert (step.prefill_tokens, step.decode_tokens) == (1, 0)
    engine.step()
    assert (engine.step_log[-1].prefill_tokens, engine.step_log[-1].decode_tokens) == (0, 1)


def test_a_victim_already_in_the_step_is_taken_out_of_it(ckpt, ref_model):
    """A long prompt arrives first and prefills in small chunks; two short ones arrive after it
    and decode. When the long one needs blocks, the lowest-ranked decode (already scheduled in
    this step, because decodes go first) is preempted: it must leave the step, not run with no
    blocks."""
    engine = make_engine(ckpt, num_kv_blocks=12, knobs=SchedulerKnobs(long_prefill_token_threshold=8))
    long_prompt = prompts(1, seed=4, lo=40, hi=40)[0]
    short = prompts(2, seed=5, lo=3, hi=3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = engine.generate([long_prompt] + short, params)
    assert engine.stats()["preemptions"] > 0
    for p, out in zip([long_prompt] + short, outs):
        assert out.token_ids == reference_greedy(ref_model, p, 6)
    assert engine.blocks.num_used == 0
    engine.blocks.check_invariants()


def test_an_engine_freezes_the_heap_once_built_only_in_a_process_that_owns_it(ckpt, monkeypatch):
    """gc_heap: once an engine is built, full collections stop walking the model and torch; a
    process that builds and drops engines (this test suite) is left alone."""
    import gc

    from moectl.engine.core import gc_heap

    gc.unfreeze()
    try:
        LLMEngine(EngineConfig(model=ckpt)).generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        assert gc.get_freeze_count() == 0
        monkeypatch.setattr(gc_heap, "_owned", True)
        engine = LLMEngine(EngineConfig(model=ckpt))
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # torch's modules and the engine's objects, before any request
        assert not any(o is engine for o in gc.get_objects())  # frozen objects are out of the collector's lists
        made_later = []
        engine.add_listener(on_step=made_later.append)
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        assert made_later and all(any(o is s for o in gc.get_objects()) for s in made_later)  # not frozen

        class Cycle:  # an engine-like cycle, alive at one freeze and dropped before the next
            def __init__(self):
                self.me = self

        dropped = Cycle()
        gc_heap.engine_built()
        assert not any(o is dropped for o in gc.get_objects())  # frozen with the heap
        probe = __import__("weakref").ref(dropped)
        del dropped
        gc_heap.engine_built()  # the next engine: what the last freeze held is collected first
        assert probe() is None
        monkeypatch.setenv("MOECTL_GC_FREEZE", "0")
        gc.unfreeze()
        LLMEngine(EngineConfig(model=ckpt))
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
