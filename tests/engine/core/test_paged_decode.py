"""The in-place paged decode kernel against the padded-gather torch path it replaces, and the
engine end to end on each path."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from moectl.engine.core import paged_decode
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.paged_attention import DecodeGroup, PagedContext
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import EngineConfig, LLMEngine
from tests.checkpoints import prompts, tiny_checkpoint

# skipped only where the kernel cannot be built at all: a build that fails must fail these tests
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None
                                or os.environ.get("MOECTL_DECODE_KERNEL") == "0",
                                reason="no C++ compiler, or the kernel is turned off")


def test_the_kernel_builds_here():
    assert paged_decode.kernel() is not None, paged_decode.failure()


def _contexts(dtype, heads=2, kv_heads=1, k_width=8, v_width=8, lens=(3, 17, 9, 1), block=4, blocks=40, seed=0):
    """One cache with random contents, the same decode rows as an in-place group and as the
    torch path's padded group with its mask; each row's table is a random set of blocks."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(1, blocks, block, kv_heads, k_width, dtype, v_head_dim=v_width)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    width = -(-max(lens) // block)
    table = torch.randperm(blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    lens_t = torch.tensor(lens)
    mask = (torch.arange(width * block)[None, :] < lens_t[:, None])[:, None, None, :]
    rows = len(lens)
    slots = torch.arange(rows)  # the step's own K/V writes go to slots nobody reads here
    kernel_ctx = PagedContext(cache=cache, slot_mapping=slots, num_decodes=rows, decode_context_lens=lens_t,
                              decode_groups=[DecodeGroup(0, rows, table, width, None, lens=lens_t)])
    torch_ctx = PagedContext(cache=cache, slot_mapping=slots, num_decodes=rows, decode_context_lens=lens_t,
                             decode_groups=[DecodeGroup(0, rows, table.reshape(-1), width, mask)])
    q = torch.randn(rows, heads, k_width + (v_width if k_width != v_width else 0), generator=gen).to(dtype)
    return cache, kernel_ctx, torch_ctx, q


def _attend_both(kernel_ctx, torch_ctx, q, cache, **kw):
    rows = q.shape[0]
    heads, k_width = cache.k.shape[3], cache.k.shape[4]
    # write slots far from the tables' blocks would still change nothing; write what is there already
    k_new = cache.k[0].view(-1, heads, k_width)[:rows].clone()
    v_new = cache.v[0].view(-1, heads, cache.v.shape[4])[:rows].clone()
    a = kernel_ctx._attend(0, q, k_new, v_new, 0.3, kw.get("latent_keys", False), kw.get("window", 0), kw.get("sinks"))
    b = torch_ctx._attend(0, q, k_new, v_new, 0.3, kw.get("latent_keys", False), kw.get("window", 0), kw.get("sinks"))
    return a, b


@pytest.mark.parametrize("heads,kv_heads", [(2, 1), (4, 2), (3, 3)])
def test_kernel_matches_the_torch_path_with_grouped_query_heads(heads, kv_heads):
    cache, kernel_ctx, torch_ctx, q = _contexts(torch.float32, heads=heads, kv_heads=kv_heads)
    a, b = _attend_both(kernel_ctx, torch_ctx, q, cache)
    assert a.shape == b.shape == (4, heads, 8)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kernel_matches_with_a_sliding_window_and_sinks():
    cache, kernel_ctx, torch_ctx, q = _contexts(torch.float32, heads=4, kv_heads=2)
    window = 5
    # the torch path takes each decode's query at position len - 1, its window from first_positions
    torch_ctx.decode_groups[0].first_positions = torch.zeros(4, dtype=torch.int64)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    a, b = _attend_both(kernel_ctx, torch_ctx, q, cache, window=window, sinks=sinks)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    unwindowed, _ = _attend_both(kernel_ctx, torch_ctx, q, cache, sinks=sinks)
    assert not torch.allclose(a[1], unwindowed[1])  # row 1 (17 keys) really was cut to its last 5


def test_kernel_matches_with_latent_keys():
    """MLA: K is the RoPE key, V the latent, the key attended [V; K], one KV head for all."""
    cache, kernel_ctx, torch_ctx, q = _contexts(torch.float32, heads=4, kv_heads=1, k_width=4, v_width=12)
    assert q.shape[-1] == 16
    a, b = _attend_both(kernel_ctx, torch_ctx, q, cache, latent_keys=True)
    assert a.shape == (4, 4, 12)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kernel_in_bf16_stays_within_bf16_rounding_of_the_fp32_result():
    cache, kernel_ctx, torch_ctx, q = _contexts(torch.bfloat16, heads=4, kv_heads=2)
    a, _ = _attend_both(kernel_ctx, torch_ctx, q, cache)
    cache32 = KVCache(1, cache.num_blocks, cache.block_size, 2, 8, torch.float32)
    cache32.k.copy_(cache.k.float())
    cache32.v.copy_(cache.v.float())
    g = kernel_ctx.decode_groups[0]
    ref = paged_decode.decode(q.float(), cache32.k[0], cache32.v[0], g.blocks, g.lens, torch.zeros_like(g.lens), 0.3)
    assert a.dtype == torch.bfloat16
    torch.testing.assert_close(a.float(), ref, rtol=2e-2, atol=1e-2)


def test_the_kernel_refuses_mismatched_inputs():
    cache, kernel_ctx, _, q = _contexts(torch.float32)
    g = kernel_ctx.decode_groups[0]
    with pytest.raises(RuntimeError, match="query width"):
        paged_decode.decode(q[..., :5], cache.k[0], cache.v[0], g.blocks, g.lens, torch.zeros_like(g.lens), 0.3)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_decode.decode(q.double(), cache.k[0], cache.v[0], g.blocks, g.lens, torch.zeros_like(g.lens), 0.3)


def test_int8_caches_take_the_torch_path():
    assert paged_decode.serves(KVCache(1, 4, 4, 1, 8, torch.float32))
    assert not paged_decode.serves(KVCache(1, 4, 4, 1, 8, torch.float32, quantized=True))


def test_engine_tokens_are_the_same_on_both_paths(tmp_path, monkeypatch):
    ckpt = tiny_checkpoint(tmp_path)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    batch = prompts(6, seed=3, lo=3, hi=40)
    engine = LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128))
    assert engine.runner.decode_kernel
    fast = [o.token_ids for o in engine.generate(batch, params)]
    monkeypatch.setattr(paged_decode, "serves", lambda cache: False)
    engine = LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128))
    assert not engine.runner.decode_kernel
    assert [o.token_ids for o in engine.generate(batch, params)] == fast


def test_in_place_groups_cross_to_the_ranks_with_their_window_offsets():
    """Rank 0's in-place groups travel in the step message; a rank rebuilds each row's key count
    relative to its window table (a row whose first blocks slid out holds fewer than its length)."""
    from moectl.engine.parallel.distributed import pack_step, unpack_step

    cache = KVCache(1, 16, 4, 1, 8, torch.float32)
    cache.window = KVCache(1, 16, 4, 1, 8, torch.float32)
    abs_lens = torch.tensor([6, 23])
    main = DecodeGroup(0, 2, torch.tensor([[1, 2, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8]]), 6, None, lens=abs_lens.clone())
    win = DecodeGroup(0, 2, torch.tensor([[9, 10], [11, 12]]), 2, None, first_positions=torch.tensor([0, 16]),
                      lens=torch.tensor([6, 7]))
    ctx = PagedContext(cache=cache, slot_mapping=torch.tensor([5, 22]), num_decodes=2, decode_context_lens=abs_lens,
                       decode_groups=[main])
    ctx.window = PagedContext(cache=cache.window, slot_mapping=torch.tensor([5, 6]), num_decodes=2,
                              decode_context_lens=abs_lens, decode_groups=[win])
    _, _, got, _, _ = unpack_step(pack_step(torch.tensor([1, 2]), torch.tensor([5, 22]), ctx), cache,
                               torch.device("cpu"))
    assert got.decode_groups[0].lens.tolist() == [6, 23]
    assert got.window.decode_groups[0].lens.tolist() == [6, 7]
    assert got.window.decode_groups[0].blocks.tolist() == [[9, 10], [11, 12]]


def test_the_kernel_refuses_a_row_longer_than_its_table():
    cache, kernel_ctx, _, q = _contexts(torch.float32)
    g = kernel_ctx.decode_groups[0]
    with pytest.raises(RuntimeError, match="keys, its table holds"):
        paged_decode.decode(q, cache.k[0], cache.v[0], g.blocks, g.lens + 100, torch.zeros_like(g.lens), 0.3)
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_decode.decode(q, cache.k[0], cache.v[0], g.blocks + 1000, g.lens, torch.zeros_like(g.lens), 0.3)
    with pytest.raises(RuntimeError, match="starts at key"):
        paged_decode.decode(q, cache.k[0], cache.v[0], g.blocks, g.lens, torch.full_like(g.lens, -1), 0.3)
    with pytest.raises(RuntimeError, match="one per query head"):
        paged_decode.decode(q, cache.k[0], cache.v[0], g.blocks, g.lens, torch.zeros_like(g.lens), 0.3,
                            sinks=torch.zeros(1))


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("lens", [(17,), (3, 17)])
def test_fewer_rows_than_threads_split_over_kv_heads_and_match(threads, lens):
    """With fewer rows than threads each (row, KV head) is a task of its own (with 1 thread, or
    as many rows as threads, a row is one task): the same result either way."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for heads, kv_heads in ((4, 2), (6, 3), (4, 1)):
            cache, kernel_ctx, torch_ctx, q = _contexts(torch.float32, heads=heads, kv_heads=kv_heads, lens=lens)
            a, b = _attend_both(kernel_ctx, torch_ctx, q, cache)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        torch.set_num_threads(before)


def test_a_steps_rows_are_checked_by_its_first_layer_and_trusted_after():
    cache, kernel_ctx, torch_ctx, q = _contexts(torch.float32, heads=4, kv_heads=2)
    g = kernel_ctx.decode_groups[0]
    bad = PagedContext(cache=cache, slot_mapping=kernel_ctx.slot_mapping, num_decodes=4,
                       decode_context_lens=g.lens,
                       decode_groups=[DecodeGroup(0, 4, g.blocks, g.width, None, lens=g.lens + 100)])
    with pytest.raises(RuntimeError, match="keys, its table holds"):
        _attend_both(bad, torch_ctx, q, cache)
    assert not bad.decode_groups[0].checked_for  # a refused group is not trusted by the next layer
    first, _ = _attend_both(kernel_ctx, torch_ctx, q, cache)
    assert g.checked_for == {(0, cache.k[0].shape[:2])}
    second, expected = _attend_both(kernel_ctx, torch_ctx, q, cache)  # checked=True this time
    torch.testing.assert_close(second, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(first, second)
    windowed, _ = _attend_both(kernel_ctx, torch_ctx, q, cache, window=5)  # another lo: checked again
    assert g.checked_for == {(0, cache.k[0].shape[:2]), (5, cache.k[0].shape[:2])} and set(g.lo) == {0, 5}
