"""Two-batch overlap's pieces in one process: the yield-point drivers' order, the split of a step's
context (decode groups and prefill chunks cut anywhere), and the forward over two micro-batches
giving the one-batch tokens. The ranks' own runs are in test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from moectl.engine.core.config import EngineConfig, KnobError, SchedulerKnobs
from moectl.engine.core.paged_attention import split_context
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.yield_points import Collective, interleave, run_stages
from moectl.engine.parallel import two_batch
from tests.checkpoints import tiny_checkpoint


class FakeWork:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def _stages(log: list, name: str, count: int):
    for i in range(count):
        log.append(f"{name} computes {i}")
        yield Collective(FakeWork(log, f"{name}{i}"))
    log.append(f"{name} done")
    return name


def test_interleave_keeps_each_collective_in_flight_while_the_other_computes():
    log: list[str] = []
    switched: list[int] = []
    assert interleave(_stages(log, "a", 2), _stages(log, "b", 2), switched.append) == ("a", "b")
    assert log == ["a computes 0", "b computes 0", "wait a0", "a computes 1", "wait b0", "b computes 1",
                   "wait a1", "a done", "wait b1", "b done"]
    assert switched[:2] == [0, 1]


def test_run_stages_waits_where_each_collective_starts():
    log: list[str] = []
    assert run_stages(_stages(log, "a", 2)) == "a"
    assert log == ["a computes 0", "wait a0", "a computes 1", "wait a1", "a done"]


def test_a_collective_reports_its_time_in_flight_and_blocked():
    seen = []
    c = Collective(FakeWork([], "x"), on_done=lambda *times: seen.append(times))
    c.finish(overlapped=False)
    issued, hidden_until, waited, done = seen[0]
    assert issued == hidden_until == waited <= done  # one batch: nothing ran under it
    c = Collective(FakeWork([], "y"), on_done=lambda *times: seen.append(times))
    c.completed = c.issued  # done before its micro-batch came back: nothing of the wait counts as hidden
    c.finish()
    issued, hidden_until, waited, done = seen[1]
    assert hidden_until == issued <= waited <= done


def test_choose_split_falls_back_to_one_batch_for_small_steps():
    assert two_batch.choose_split("none", 1000) == 0
    assert two_batch.choose_split("two-batch", 63, 64) == 0
    assert two_batch.choose_split("two-batch", 64, 64) == 32
    assert two_batch.choose_split("two-batch", 3, 2) == 1


def test_an_int8_cache_never_cuts_a_fresh_prefill_chunk():
    """Its second part would read the first's K/V back quantized, where one batch uses them exact."""
    from moectl.engine.core.kv_cache import KVCache
    from moectl.engine.core.paged_attention import PagedContext, PrefillSlice

    def ctx(quantized: bool, cached: int = 0) -> PagedContext:
        c = PagedContext(KVCache(1, 8, 4, 1, 2, torch.float32, quantized=quantized), torch.arange(100))
        c.num_decodes = 10
        c.prefills = [PrefillSlice(10, 70, cached, torch.tensor([0])), PrefillSlice(70, 100, 0, torch.tensor([1]))]
        return c
    assert two_batch.choose_split("two-batch", 100, 2, ctx(False)) == 50
    assert two_batch.choose_split("two-batch", 100, 2, ctx(True)) == 70  # the chunk's nearer edge
    assert two_batch.choose_split("two-batch", 100, 2, ctx(True, cached=5)) == 50  # read from the cache either way
    one = ctx(True)
    one.num_decodes, one.prefills = 0, [PrefillSlice(0, 100, 0, torch.tensor([0]))]
    assert two_batch.choose_split("two-batch", 100, 2, one) == 0  # one fresh chunk: one batch


def test_overlap_settings_are_checked():
    with pytest.raises(KnobError, match="overlap: must be one of none, two-batch"):
        EngineConfig(model="x", overlap="five-stage")
    with pytest.raises(KnobError, match="overlap_min_tokens"):
        EngineConfig(model="x", overlap_min_tokens=1)


class SplitModel:
    """The engine's model, every step of at least 2 tokens run as two micro-batches split at `at(n)`."""

    def __init__(self, model, at):
        self.model, self.at = model, at
        self.cfg, self.splits = model.cfg, []

    def __call__(self, ids, positions, ctx, probe=None):
        n = ids.numel()
        split = self.at(n) if n >= 2 else 0
        self.splits.append((n, split, ctx.num_decodes, len(ctx.prefills)))
        return two_batch.forward(self.model, ids, positions, ctx, split, None, probe)

    def logits(self, hidden):
        return self.model.logits(hidden)


PROMPTS = [list(range(3, 26)), [30, 31, 32], list(range(40, 51)), list(range(3, 15)) + [99, 98]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tbo") / "mixtral")


def _engine(checkpoint, **config):
    knobs = SchedulerKnobs(max_num_batched_tokens=12, long_prefill_token_threshold=7)
    return LLMEngine(EngineConfig(model=str(checkpoint), knobs=knobs, block_size=4, num_kv_blocks=96,
                                  num_threads=1, **config))


def test_micro_batch_spans_keep_only_their_own_running_time():
    """A span opened before a yield and closed after it keeps the stretches its micro-batch ran,
    each once, however many yields came before."""
    from moectl.engine.core.spans import SpanRecorder

    recorder = SpanRecorder(1)
    recorder.begin_step()
    views = [two_batch.MicroBatchTracer(recorder, i) for i in (0, 1)]

    def stages(i: int):
        for layer in range(4):
            mark = views[i].mark()
            yield Collective(FakeWork([], f"{i}{layer}"))
            views[i].close(mark, "attention", 0, layer)
        return i

    def switch(i: int) -> None:
        views[1 - i].suspend()
        views[i].resume()

    interleave(stages(0), stages(1), switch)
    for view in views:
        view.suspend()
        assert all(end != float("inf") for _, end in view.running)
    cols = recorder.collect()
    names = [cols["names"][n] for n in cols["name"]]
    for i in (0, 1):  # one piece per layer: the stretch before its yield is empty-or-tiny, the one after is its own
        pieces = [(s, d) for n, s, d in zip(names, cols["start_s"], cols["dur_s"]) if n == f"attention (mb {i})"]
        assert 1 <= len(pieces) <= 8, pieces
    starts = sorted((s, s + d, n) for n, s, d in zip(names, cols["start_s"], cols["dur_s"]))
    for (s0, e0, n0), (s1, e1, n1) in zip(starts, starts[1:]):
        assert n0 == n1 or e0 <= s1 + 1e-9  # the two micro-batches' spans never overlap


@pytest.mark.parametrize("at", [lambda n: n // 2, lambda n: 1, lambda n: n - 1], ids=["half", "first", "last"])
def test_two_micro_batches_give_one_batch_tokens_and_logits(checkpoint, single_thread, at):
    """Splits anywhere: inside decode groups, inside prefill chunks (the second part reads the
    first's K/V from the cache in the same layer), between decodes and prefills."""
    plain = _engine(checkpoint)
    ref = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    ref_logits = plain.score(list(range(5, 36)))
    engine = _engine(checkpoint)
    engine.runner.model = split = SplitModel(engine.runner.model, at)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == ref
    assert (engine.score(list(range(5, 36))) - ref_logits).abs().max().item() < 1e-5
    mixed = [s for s in split.splits if s[1] and s[2] and s[3]]  # steps with decodes and prefills, split
    assert mixed and any(n > 2 for n, *_ in split.splits)


def test_split_context_cuts_a_chunk_and_a_decode_group(checkpoint):
    engine = _engine(checkpoint)
    seen = []

    class Capture(SplitModel):
        def __call__(self, ids, positions, ctx, probe=None):
            if ctx.num_decodes and ctx.prefills and not seen:
                seen.append(ctx)
            return self.model(ids, positions, ctx, probe)

    engine.runner.model = Capture(engine.runner.model, None)
    engine.generate(PROMPTS, PARAMS)
    ctx = seen[0]
    b, n = ctx.num_decodes, ctx.slot_mapping.numel()
    first, second = split_context(ctx, b + 1)  # one row into the first prefill chunk
    assert first.num_decodes == b and second.num_decodes == 0
    assert first.prefills[-1].end == b + 1 and second.prefills[0].start == 0
    assert second.prefills[0].cached_len == ctx.prefills[0].cached_len + b + 1 - ctx.prefills[0].start
    assert torch.equal(torch.cat([first.slot_mapping, second.slot_mapping]), ctx.slot_mapping)
    if b >= 2:
        first, second = split_context(ctx, 1)  # inside the decode rows
        assert first.num_decodes == 1 and second.num_decodes == b - 1
        assert sum(g.end - g.start for g in second.decode_groups) == b - 1
        assert second.decode_context_lens.tolist() == ctx.decode_context_lens[1:].tolist()
    for bad in (0, n):
        with pytest.raises(ValueError, match="inside the step"):
            split_context(ctx, bad)
