"""KV retention: evicted blocks return to the pool, the attention that follows reads exactly the kept
tokens (checked against transformers with the same tokens masked out), scored policies evict the
blocks that drew the least attention, and the prefix cache never serves K/V computed after an eviction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moectl.engine.core import paged_decode
from moectl.engine.core.config import EngineConfig, KnobError, SchedulerKnobs
from moectl.engine.core.paged_attention import PagedContext, PrefillSlice, split_context
from moectl.engine.core.retention import Retention, budget_tokens
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.core.sequence import Sequence
from moectl.engine.llm_engine import LLMEngine
from tests.checkpoints import tiny_checkpoint

BS = 4


def _engine(ckpt, chunk: int = 8, kv: str = "auto", **knobs) -> LLMEngine:
    knobs = SchedulerKnobs(max_num_batched_tokens=chunk, long_prefill_token_threshold=chunk, **knobs)
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="fp32", block_size=BS, kv_cache_dtype=kv, knobs=knobs))


def _record_evictions(engine: LLMEngine) -> list[tuple[int, frozenset[int]]]:
    """(num_computed, positions evicted so far) after every retention pass of the engine."""
    history = []
    apply = engine.retention.apply

    def recording(seq, knobs):
        n = apply(seq, knobs)
        evicted = frozenset(p for i, b in enumerate(seq.block_table) if b < 0 for p in range(i * BS, (i + 1) * BS))
        history.append((seq.num_computed, evicted))
        return n

    engine.retention.apply = recording
    return history


def _hf(ckpt):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager",
                                                             experts_implementation="eager").eval()


def _reference(hf, ids: list[int], history) -> torch.Tensor:
    """transformers' logits with each query's view of the cache: causal, less the positions evicted
    before its token ran (an additive float mask; positions unchanged)."""
    n = len(ids)
    mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    for q in range(n):
        seen = [evicted for computed, evicted in history if computed <= q]
        for p in seen[-1] if seen else ():
            mask[q, p] = float("-inf")
    with torch.no_grad():
        return hf(torch.tensor([ids]), attention_mask=mask[None, None]).logits[0]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("ret_mixtral"), "mixtral")
    return ckpt, _hf(ckpt)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("ret_dsv3"), "deepseek_v3")
    return ckpt, _hf(ckpt)


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "h2o"])
@pytest.mark.parametrize("chunk", [8, 1], ids=["prefill-chunks", "decode-steps"])
def test_attention_after_eviction_matches_transformers_masked(mixtral, policy, chunk):
    ckpt, hf = mixtral
    engine = _engine(ckpt, chunk=chunk, kv_retention=policy, kv_budget=16, kv_recent_tokens=4)
    history = _record_evictions(engine)
    ids = _ids(48)
    got = engine.score(ids)
    assert any(evicted for _, evicted in history), "the budget never evicted anything"
    torch.testing.assert_close(got, _reference(hf, ids, history), atol=2e-4, rtol=1e-4)


def test_the_decode_kernel_and_the_torch_path_score_and_evict_alike(mixtral):
    if paged_decode.kernel() is None:
        pytest.skip(f"no decode kernel here: {paged_decode.failure()}")
    ckpt, hf = mixtral
    histories = []
    for kernel in (True, False):
        engine = _engine(ckpt, chunk=1, kv_retention="h2o", kv_budget=16, kv_recent_tokens=4)
        engine.runner.decode_kernel = kernel
        histories.append(_record_evictions(engine))
        engine.score(_ids(40, seed=1))
    assert histories[0] == histories[1]
    assert any(evicted for _, evicted in histories[0])


def test_mla_latent_cache_after_eviction_matches_transformers(deepseek):
    ckpt, hf = deepseek
    engine = _engine(ckpt, chunk=8, kv_retention="snapkv", kv_budget_fraction=0.5, kv_recent_tokens=4)
    history = _record_evictions(engine)
    ids = _ids(40, seed=2)
    got = engine.score(ids)
    assert any(evicted for _, evicted in history)
    torch.testing.assert_close(got, _reference(hf, ids, history), atol=2e-4, rtol=1e-4)


def test_int8_kv_evicts_and_stays_close_to_the_masked_reference(mixtral):
    ckpt, hf = mixtral
    engine = _engine(ckpt, chunk=8, kv="int8", kv_retention="streaming", kv_budget=16)
    history = _record_evictions(engine)
    ids = _ids(40, seed=3)
    got = engine.score(ids)
    ref = _reference(hf, ids, history)
    assert any(evicted for _, evicted in history)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_scored_policies_keep_sinks_recent_and_the_most_attended_blocks(tmp_path):
    engine = _engine(tiny_checkpoint(tmp_path / "m", "mixtral"), kv_retention="snapkv", kv_budget=20,
                     kv_sink_tokens=4, kv_recent_tokens=8)
    seq = Sequence("s", list(range(40)), SamplingParams())
    engine.blocks.grow(seq, 40)
    seq.num_computed = 40  # blocks 0..9 hold positions 0..39
    seq.kv_scores = np.array([0.0, 5, 1, 9, 2, 8, 3, 0, 0, 0])
    knobs = engine.knobs
    # fewest attention first; never block 0 (the sink) nor 8 and 9 (the last 8 tokens)
    assert Retention(engine.blocks).evictable(seq, knobs) == [7, 2, 4, 6, 1, 5, 3]
    free = engine.blocks.num_free
    assert Retention(engine.blocks).apply(seq, knobs) == 5  # 40 held -> 20: five blocks of 4
    assert [i for i, b in enumerate(seq.block_table) if b < 0] == [1, 2, 4, 6, 7]
    assert engine.blocks.num_free == free + 5 and seq.kv_held_tokens == 20
    assert seq.held_blocks == [seq.block_table[i] for i in (0, 3, 5, 8, 9)]
    engine.blocks.free(seq)
    engine.blocks.check_invariants()


def test_streaming_keeps_the_sinks_and_the_newest_blocks(tmp_path):
    engine = _engine(tiny_checkpoint(tmp_path / "m", "mixtral"), kv_retention="streaming", kv_budget=12)
    seq = Sequence("s", list(range(30)), SamplingParams())
    engine.blocks.grow(seq, 30)
    seq.num_computed = 30  # 8 blocks, the last one half full
    Retention(engine.blocks).apply(seq, engine.knobs)
    assert [i for i, b in enumerate(seq.block_table) if b >= 0] == [0, 6, 7]  # 12 tokens: sink, then the newest
    assert seq.kv_held_tokens == 30 - 5 * BS


def test_budget_arithmetic_and_knob_checks():
    assert budget_tokens(SchedulerKnobs(), 1000) is None
    assert budget_tokens(SchedulerKnobs(kv_retention="h2o", kv_budget_fraction=0.25), 1000) == 250
    assert budget_tokens(SchedulerKnobs(kv_retention="h2o", kv_budget_fraction=0.25), 1001) == 251
    assert budget_tokens(SchedulerKnobs(kv_retention="h2o", kv_budget=100, kv_budget_fraction=0.5), 1000) == 100
    with pytest.raises(KnobError, match="needs a budget"):
        SchedulerKnobs(kv_retention="streaming")
    with pytest.raises(KnobError, match="kv_retention: must be one of"):
        SchedulerKnobs(kv_retention="lru", kv_budget=8)
    with pytest.raises(KnobError, match="kv_budget_fraction"):
        SchedulerKnobs(kv_retention="h2o", kv_budget_fraction=0)
    with pytest.raises(KnobError, match="kv_budget"):
        SchedulerKnobs(kv_budget=-1)


def test_a_shared_prefix_block_returns_to_the_pool_only_when_no_sequence_keeps_it(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "m", "mixtral")
    engine = _engine(ckpt, chunk=64, kv_retention="streaming", kv_budget=12)
    prompt = _ids(24, seed=4)
    engine.generate([prompt], SamplingParams(max_tokens=1))  # caches the prompt's blocks (evicted and freed since)
    a = Sequence("a", list(prompt) + [5], SamplingParams())
    b = Sequence("b", list(prompt) + [6], SamplingParams())
    blocks = engine.blocks
    for seq in (a, b):
        assert blocks.admit(seq, 25)
        seq.num_computed = 25
    shared = a.block_table[2]
    assert shared == b.block_table[2] and blocks.ref_count[shared] == 2
    free = blocks.num_free
    blocks.evict(a, [1, 2])
    assert blocks.ref_count[shared] == 1 and blocks.num_free == free  # b still reads both blocks
    blocks.evict(b, [2])
    assert blocks.ref_count[shared] == 0 and blocks.num_free == free + 1
    blocks.free(a)
    blocks.free(b)
    blocks.check_invariants()


def test_blocks_computed_after_an_eviction_never_enter_the_prefix_cache(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "m", "mixtral")
    engine = _engine(ckpt, chunk=8, kv_retention="streaming", kv_budget=8)
    prompt = _ids(40, seed=5)
    engine.generate([prompt], SamplingParams(max_tokens=1))
    # two chunks of 8 (4 blocks) ran before the first eviction (the budget is 8 tokens); later
    # blocks saw a pruned context
    seq = Sequence("again", list(prompt), SamplingParams())
    assert len(engine.blocks.match_prefix(seq)) == 4
    full = _engine(ckpt, chunk=8)
    full.generate([prompt], SamplingParams(max_tokens=1))
    assert len(full.blocks.match_prefix(Sequence("again", list(prompt), SamplingParams()))) == 9


def test_generation_under_a_budget_holds_its_blocks_and_records_what_it_evicted(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "m", "mixtral")
    engine = _engine(ckpt, chunk=64, kv_retention="h2o", kv_budget=16, kv_recent_tokens=4)
    peak = []
    engine.add_listener(on_step=lambda stats: peak.append((stats.kv_blocks_used, stats.cache["kv_retention"])))
    outs = engine.generate([_ids(30, seed=6), _ids(20, seed=7)], SamplingParams(max_tokens=40, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [40, 40]
    # per sequence: at most the budget's 4 blocks plus the one being written
    assert max(used for used, _ in peak) <= 2 * (16 // BS + 1)
    last = peak[-1][1]
    assert last["policy"] == "h2o" and last["budget_tokens"] == 16
    assert sum(last["evicted_tokens"]) == sum(engine.blocks.evicted_tokens) > 0
    mid = [r for _, r in peak if sum(r["context_tokens"])]
    assert all(sum(r["held_tokens"]) <= sum(r["context_tokens"]) for r in mid)
    assert any(sum(r["held_tokens"]) < sum(r["context_tokens"]) for r in mid)
    assert engine.blocks.num_used == 0
    engine.blocks.check_invariants()


def test_a_live_policy_change_applies_from_the_next_step(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "m", "mixtral")
    engine = _engine(ckpt, chunk=64)
    engine.add_request(_ids(30, seed=8), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert sum(engine.blocks.evicted_tokens) == 0
    engine.update_knobs(kv_retention="streaming", kv_budget=12)
    engine.step()
    seq = engine.scheduler.running[0]
    assert seq.kv_held_tokens <= 12 and sum(engine.blocks.evicted_tokens) > 0


def test_two_micro_batches_keep_the_observed_queries_with_the_chunk_end():
    mass = torch.zeros(3)
    ctx = PagedContext(cache=None, slot_mapping=torch.arange(10))
    ctx.prefills.append(PrefillSlice(0, 10, 0, torch.arange(3), 0, observe=4, mass=mass))
    first, second = split_context(ctx, 6)
    assert first.prefills[0].observe == 0 and first.prefills[0].mass is None
    assert second.prefills[0].observe == 4 and second.prefills[0].mass is mass


def test_the_memory_ledger_shows_the_blocks_eviction_returns(tmp_path):
    from moectl.placement.topology import Topology

    ckpt = tiny_checkpoint(tmp_path / "m", "mixtral")
    held = {}
    for policy, knobs in (("full", {}), ("streaming", dict(kv_retention="streaming", kv_budget=12))):
        engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="fp32", block_size=BS, topology=Topology(num_devices=2),
                                        knobs=SchedulerKnobs(max_num_batched_tokens=64, **knobs)))
        steps = []
        engine.add_listener(on_step=lambda stats: steps.append(stats.devices["memory"]))
        engine.generate([_ids(40, seed=9), _ids(40, seed=10)], SamplingParams(max_tokens=8, ignore_eos=True))
        kv = [sum(device["kv_blocks"] for device in memory) for memory in steps]
        held[policy] = max(kv) // engine.kv_block_bytes[0]
    # at most 47 tokens each: 12 blocks of 4 in full, the two sequences together 24; a 12-token
    # budget keeps 3 blocks (the sink and the newest) and the block the next token goes to
    assert held["full"] == 24
    assert held["streaming"] <= 2 * (12 // BS + 1)


def test_held_blocks_follow_eviction_growth_and_a_fresh_start(tmp_path):
    engine = _engine(tiny_checkpoint(tmp_path / "m", "mixtral"), kv_retention="streaming", kv_budget=8)
    blocks = engine.blocks
    seq = Sequence("s", list(range(40)), SamplingParams())
    blocks.grow(seq, 24)
    seq.num_computed = 24
    Retention(blocks).apply(seq, engine.knobs)
    first = list(seq.held_blocks)
    assert first == [b for b in seq.block_table if b >= 0] and len(first) == 2
    blocks.grow(seq, 4)  # a new block: the held list follows
    assert seq.held_blocks == [b for b in seq.block_table if b >= 0] and len(seq.held_blocks) == 3
    blocks.free(seq)  # preempted: its blocks go back, and a recompute starts over
    blocks.grow(seq, 4)  # a different block for the same table length as before is possible
    blocks.grow(seq, 20)
    seq.num_computed = 24
    Retention(blocks).apply(seq, engine.knobs)  # the same (length, evicted) as the first time
    assert seq.held_blocks == [b for b in seq.block_table if b >= 0]
    blocks.free(seq)
    blocks.check_invariants()
